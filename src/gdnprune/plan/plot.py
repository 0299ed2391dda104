"""The sensitivity plot: each layer's sensitivity against its kept parameters, the chosen points marked."""

from __future__ import annotations

from pathlib import Path
from typing import Mapping

__all__ = ["lower_envelope", "plot_sensitivity"]


def lower_envelope(points: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The least sensitivity reachable with at most ``x`` kept parameters, at every ``x`` where it drops:
    ``(params, sensitivity)`` points, fewest parameters first."""
    best, out = float("inf"), []
    for x, y in sorted(points):
        if y < best:
            best = y
            out.append((x, y))
    return out


def plot_sensitivity(report: Mapping, path: str | Path) -> bool:
    """Write a PNG of a plan report (:func:`gdnprune.plan.plan_model`); False when matplotlib is missing.

    Per layer: every candidate as a point — filled when measured on every calibration window, hollow when
    successive halving left it with an estimate from fewer windows —, the lower envelope of all of them (the
    least sensitivity reachable with at most that many kept parameters) as a line, and the chosen candidate as a
    star. With a joint refinement, a second panel shows its fitness (the whole cut model's KL) per generation.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    refinement = report.get("refinement")
    fig, axes = plt.subplots(1, 2 if refinement else 1, figsize=(12 if refinement else 7.5, 4.8), dpi=120,
                             gridspec_kw={"width_ratios": [3, 2]} if refinement else None, squeeze=False)
    ax = axes[0][0]
    estimated = False
    for i, (prefix, layer) in enumerate(report["layers"].items()):
        color = f"C{i % 10}"
        cands = layer["candidates"]
        full_windows = max((c.get("windows", 0) for c in cands), default=0)
        exact = [c for c in cands if c.get("windows", full_windows) == full_windows]
        rough = [c for c in cands if c.get("windows", full_windows) != full_windows]
        ax.scatter([c["params"] for c in exact], [c["sensitivity"] for c in exact], s=8, alpha=0.45, color=color)
        if rough:
            estimated = True
            ax.scatter([c["params"] for c in rough], [c["sensitivity"] for c in rough], s=8, alpha=0.35,
                       facecolors="none", edgecolors=color, linewidths=0.6)
        envelope = lower_envelope([(c["params"], c["sensitivity"]) for c in cands])
        ax.step([p[0] for p in envelope], [p[1] for p in envelope], where="post", color=color, lw=1.2,
                label=prefix.replace(".linear_attn", ""))
        chosen = cands[layer["chosen"]]
        ax.scatter([chosen["params"]], [chosen["sensitivity"]], s=70, marker="*", color=color, edgecolor="black",
                   zorder=5)
    measured = report.get("sensitivity") in ("measured", "halving")
    kind = "KL divergence per token (cut alone)" if measured else "output energy removed"
    ax.set_xlabel("kept GDN parameters of the layer")
    ax.set_ylabel(kind)
    positive = [c["sensitivity"] for layer in report["layers"].values() for c in layer["candidates"]
                if c["sensitivity"] > 0]
    ax.set_yscale("symlog", linthresh=max(min(positive, default=1e-4), 1e-9))
    ax.invert_xaxis()
    ax.set_title("per-layer sensitivity (star: chosen" + ("; hollow: estimated on fewer windows)" if estimated
                                                          else ")"))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    if refinement:
        ax = axes[0][1]
        history = refinement["history"]
        ax.plot(range(len(history) + 1), [refinement["seed_kl"], *[h["kl"] for h in history]], marker="o", ms=3,
                label="current plan (all windows)")
        offspring = [(h["generation"], h["best_offspring_kl"]) for h in history if h["best_offspring_kl"] is not None]
        ax.scatter([g for g, _ in offspring], [v for _, v in offspring], s=10, color="C3", alpha=0.6,
                   label="best offspring")
        ax.xaxis.get_major_locator().set_params(integer=True)
        ax.set_xlabel("generation")
        ax.set_ylabel("KL of the whole cut model (calibration)")
        ax.set_title("joint refinement")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return True
