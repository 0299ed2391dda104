"""The sensitivity plot: each layer's sensitivity against its kept parameters, the chosen points marked."""

from __future__ import annotations

from pathlib import Path
from typing import Mapping

__all__ = ["plot_sensitivity"]


def plot_sensitivity(report: Mapping, path: str | Path) -> bool:
    """Write a PNG of a plan report (:func:`gdnprune.plan.plan_model`); False when matplotlib is missing.

    Per layer: every candidate as a faint point, the lower envelope (the least sensitivity at each kept
    parameter count or fewer) as a line, and the chosen candidate as a large marker.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(7.5, 4.8), dpi=120)
    for i, (prefix, layer) in enumerate(report["layers"].items()):
        color = f"C{i % 10}"
        cands = layer["candidates"]
        xs = [c["params"] for c in cands]
        ys = [c["sensitivity"] for c in cands]
        ax.scatter(xs, ys, s=6, alpha=0.25, color=color)
        best, envelope = float("inf"), []
        for x, y in sorted(zip(xs, ys), key=lambda p: (-p[0], p[1])):
            best = min(best, y)
            envelope.append((x, best))
        ax.plot([p[0] for p in envelope], [p[1] for p in envelope], color=color, lw=1.2,
                label=prefix.replace(".linear_attn", ""))
        chosen = cands[layer["chosen"]]
        ax.scatter([chosen["params"]], [chosen["sensitivity"]], s=70, marker="*", color=color, edgecolor="black",
                   zorder=5)
    kind = "KL divergence per token (cut alone)" if report.get("sensitivity") == "measured" else "output energy removed"
    ax.set_xlabel("kept GDN parameters of the layer")
    ax.set_ylabel(kind)
    ax.set_yscale("symlog", linthresh=1e-4)
    ax.invert_xaxis()
    ax.set_title("per-layer sensitivity (star: chosen)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return True
