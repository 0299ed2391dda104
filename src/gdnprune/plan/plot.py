"""The sensitivity plot: each block's sensitivity against its kept parameters, one panel per kind, the chosen
points marked."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

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


#: panel titles and x labels of the kinds of block, in the order the panels appear
_KINDS = {
    "gdn": ("GDN layers", "kept GDN parameters of the layer"),
    "attention": ("attention", "kept parameters of the attention"),
    "mlp": ("MLP", "kept parameters of the MLP"),
    "shared_expert": ("shared expert", "kept parameters of the shared expert"),
    "experts": ("routed experts", "kept parameters of the routed experts"),
}


def _short(prefix: str) -> str:
    """``model.layers.3.linear_attn`` -> ``layers.3`` (the legend of a panel names the layer)."""
    parts = prefix.split(".")
    if "layers" not in parts:
        return prefix
    i = parts.index("layers")
    return ".".join(parts[i : i + 2])


def _panel(ax, groups: Mapping[str, Mapping], title: str, xlabel: str, measured: bool) -> bool:
    """One kind's blocks: every candidate, the lower envelope, the chosen one; True when some are estimated."""
    estimated = False
    for i, (prefix, group) in enumerate(groups.items()):
        layer = _short(prefix).rpartition(".")[2]
        color = f"C{(int(layer) if layer.isdigit() else i) % 10}"  # a layer has one color in every panel
        cands = group["candidates"]
        full_windows = max((c.get("windows", 0) for c in cands), default=0)
        exact = [c for c in cands if c.get("windows", full_windows) == full_windows]
        rough = [c for c in cands if c.get("windows", full_windows) != full_windows]
        ax.scatter(
            [c["params"] for c in exact], [c["sensitivity"] for c in exact], s=8, alpha=0.45, color=color
        )
        if rough:
            estimated = True
            ax.scatter(
                [c["params"] for c in rough],
                [c["sensitivity"] for c in rough],
                s=8,
                alpha=0.35,
                facecolors="none",
                edgecolors=color,
                linewidths=0.6,
            )
        envelope = lower_envelope([(c["params"], c["sensitivity"]) for c in cands])
        ax.step(
            [p[0] for p in envelope],
            [p[1] for p in envelope],
            where="post",
            color=color,
            lw=1.2,
            label=_short(prefix),
        )
        if group.get("chosen") is not None:  # None: the block's decoder layer is removed
            chosen = cands[group["chosen"]]
            ax.scatter(
                [chosen["params"]],
                [chosen["sensitivity"]],
                s=70,
                marker="*",
                color=color,
                edgecolor="black",
                zorder=5,
            )
    ax.set_xlabel(xlabel)
    ax.set_ylabel("KL divergence per token (cut alone)" if measured else "output energy removed")
    positive = [c["sensitivity"] for g in groups.values() for c in g["candidates"] if c["sensitivity"] > 0]
    ax.set_yscale("symlog", linthresh=max(min(positive, default=1e-4), 1e-9))
    ax.invert_xaxis()
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2 if len(groups) > 4 else 1)
    return estimated


def plot_sensitivity(report: Mapping, path: str | Path) -> bool:
    """Write a PNG of a plan report (:func:`gdnprune.plan.plan_model`); False when matplotlib is missing.

    One panel per kind of block (GDN layers, then attention, MLP, shared experts of a whole-model plan), per
    block: every candidate as a point — filled when measured on every calibration window, hollow when
    successive halving left it with an estimate from fewer windows —, the lower envelope of all of them (the
    least sensitivity reachable with at most that many kept parameters) as a line, and the chosen candidate as a
    star. With removal candidates (``depth``), one more panel shows each decoder layer's removal sensitivity,
    the removed ones in red; with a joint refinement, one more its fitness (the whole cut model's KL) per
    generation.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    kinds: dict[str, dict[str, Mapping]] = {}
    if report.get("layers"):
        kinds["gdn"] = dict(report["layers"])
    for prefix, block in (report.get("blocks") or {}).items():
        kinds.setdefault(block["kind"], {})[prefix] = block
    kinds = {
        k: kinds[k]
        for k in sorted(kinds, key=lambda k: list(_KINDS).index(k) if k in _KINDS else len(_KINDS))
    }
    refinement = report.get("refinement")
    removal = {k: v for k, v in (report.get("removal") or {}).items() if "sensitivity" in v}
    count = len(kinds) + bool(removal) + bool(refinement)
    columns = 1 if count == 1 else 2
    rows = -(-count // columns)
    fig, axes = plt.subplots(
        rows, columns, figsize=(7.5 if columns == 1 else 13, 4.8 * rows), dpi=120, squeeze=False
    )
    flat = [ax for row in axes for ax in row]
    measured = report.get("sensitivity") in ("measured", "halving")
    estimated = False
    for ax, (kind, groups) in zip(flat, kinds.items()):
        title, xlabel = _KINDS.get(kind, (kind, "kept parameters"))
        estimated |= _panel(ax, groups, title, xlabel, measured)
    if removal:
        ax = flat[len(kinds)]
        entries = sorted(removal.values(), key=lambda e: e["layer"])
        ax.bar(
            [str(e["layer"]) for e in entries],
            [e["sensitivity"] for e in entries],
            color=["C3" if e["removed"] else "C7" for e in entries],
        )
        ax.set_xlabel("decoder layer (red: removed)")
        ax.set_ylabel("KL divergence per token (layer alone skipped)" if measured else "sensitivity")
        ax.set_yscale("log")
        ax.set_title("layer removal")
        ax.grid(alpha=0.3, axis="y")
    if refinement:
        ax = flat[len(kinds) + bool(removal)]
        history = refinement["history"]
        ax.plot(
            range(len(history) + 1),
            [refinement["seed_kl"], *[h["kl"] for h in history]],
            marker="o",
            ms=3,
            label="current plan (all windows)",
        )
        offspring = [
            (h["generation"], h["best_offspring_kl"]) for h in history if h["best_offspring_kl"] is not None
        ]
        ax.scatter(
            [g for g, _ in offspring],
            [v for _, v in offspring],
            s=10,
            color="C3",
            alpha=0.6,
            label="best offspring",
        )
        ax.xaxis.get_major_locator().set_params(integer=True)
        ax.set_xlabel("generation")
        ax.set_ylabel("KL of the whole cut model (calibration)")
        ax.set_title("joint refinement")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    for ax in flat[count:]:
        ax.set_visible(False)
    fig.suptitle(
        "per-block sensitivity (star: chosen"
        + ("; hollow: estimated on fewer windows)" if estimated else ")"),
        fontsize=11,
    )
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return True
