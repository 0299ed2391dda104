"""The sensitivity plot: each block's sensitivity against its kept parameters, one panel per kind, the chosen
points marked."""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

__all__ = ["lower_envelope", "plot_sensitivity", "sensitivity_figure"]

#: how each block's line and points look, by its position in the panel: lines that lie on top of each
#: other (layers with the same sensitivities) stay distinguishable by their dashes and markers
_STYLES = [("-", "o"), ("--", "s"), (":", "^"), ("-.", "D"), ((0, (5, 1, 1, 1)), "v"), ((0, (1, 3)), "P")]


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
    "gdn": ("GDN layers", "parameters kept in the GDN layer"),
    "attention": ("attention", "parameters kept in the attention"),
    "mlp": ("MLP", "parameters kept in the MLP"),
    "shared_expert": ("shared expert", "parameters kept in the shared expert"),
    "experts": ("routed experts", "parameters kept in the routed experts"),
}


def _nice_ticks(low: float, high: float) -> list[float]:
    """1-2-5 steps of every decade from ``low`` to ``high`` (both > 0), at most about 8 of them."""
    ticks: list[float] = []
    for exponent in range(math.floor(math.log10(low)), math.ceil(math.log10(high)) + 1):
        ticks += [m * 10.0**exponent for m in (1, 2, 5) if low <= m * 10.0**exponent <= high * 1.0001]
    while len(ticks) > 8:
        ticks = ticks[::2]
    return ticks


def _sensitivity_scale(ax, values: list[float]) -> str:
    """Scale the y axis for these sensitivities, with labelled ticks across the whole range; returns the
    scale's name for the axis label. Zero (the uncut block) stays on the axis: a linear scale when the
    values span less than two decades, else a symmetric log scale (linear below its smallest value)."""
    from matplotlib.ticker import FixedLocator, FuncFormatter, NullLocator  # lazy: optional extra ([plot])

    positive = sorted(v for v in values if v > 0)
    if not positive or positive[-1] / positive[0] < 100:
        ax.set_ylim(bottom=0)
        return "linear scale"
    low, high = positive[0], positive[-1]
    ax.set_yscale("symlog", linthresh=low, linscale=0.3)
    ticks = [0.0, *_nice_ticks(low, high)]
    ax.yaxis.set_major_locator(FixedLocator(ticks))
    ax.yaxis.set_minor_locator(NullLocator())
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: "0" if v == 0 else f"{v:.3g}"))
    return f"log scale, linear below {low:.2g}"


def _short(prefix: str) -> str:
    """``model.layers.3.linear_attn`` -> ``layers.3`` (the legend of a panel names the layer)."""
    parts = prefix.split(".")
    if "layers" not in parts:
        return prefix
    i = parts.index("layers")
    return ".".join(parts[i : i + 2])


def _panel(ax, groups: Mapping[str, Mapping], title: str, xlabel: str, measured: bool) -> bool:
    """One kind's blocks: every candidate, the lower envelope, the chosen one; True when some are estimated."""
    from matplotlib.ticker import FuncFormatter  # lazy: optional extra ([plot])

    estimated = False
    for i, (prefix, group) in enumerate(groups.items()):
        layer = _short(prefix).rpartition(".")[2]
        color = f"C{(int(layer) if layer.isdigit() else i) % 10}"  # a layer has one color in every panel
        dashes, marker = _STYLES[i % len(_STYLES)]
        cands = group["candidates"]
        # windows 0: never measured (halving skips what no plan within the budgets can hold): nothing to draw
        seen = [c for c in cands if c.get("windows", 1) != 0]
        full_windows = max((c.get("windows", 0) for c in seen), default=0)
        exact = [c for c in seen if c.get("windows", full_windows) == full_windows]
        rough = [c for c in seen if c.get("windows", full_windows) != full_windows]
        ax.scatter(
            [c["params"] for c in exact],
            [c["sensitivity"] for c in exact],
            s=14,
            alpha=0.5,
            color=color,
            marker=marker,
        )
        if rough:
            estimated = True
            ax.scatter(
                [c["params"] for c in rough],
                [c["sensitivity"] for c in rough],
                s=14,
                alpha=0.45,
                facecolors="none",
                edgecolors=color,
                linewidths=0.7,
                marker=marker,
            )
        envelope = lower_envelope([(c["params"], c["sensitivity"]) for c in seen])
        ax.step(
            [p[0] for p in envelope],
            [p[1] for p in envelope],
            where="post",
            color=color,
            linestyle=dashes,
            lw=1.4,
            label=_short(prefix),
        )
        if group.get("chosen") is not None:  # None: the block's decoder layer is removed
            chosen = cands[group["chosen"]]
            ax.scatter(
                [chosen["params"]],
                [chosen["sensitivity"]],
                s=90,
                marker="*",
                color=color,
                edgecolor="black",
                zorder=5,
            )
            ax.annotate(  # the layer beside its star, each at its own offset: coinciding stars stay legible
                layer,
                (chosen["params"], chosen["sensitivity"]),
                xytext=(-8 - 8 * i, 6),
                textcoords="offset points",
                ha="right",
                fontsize=8,
                color=color,
                fontweight="bold",
            )
    values = [c["sensitivity"] for g in groups.values() for c in g["candidates"]]
    scale = _sensitivity_scale(ax, values)
    what = "KL divergence per token, this block alone cut" if measured else "output energy removed"
    ax.set_ylabel(f"{what}\n({scale})", fontsize=9)
    ax.set_xlabel(f"{xlabel} (right: cut deeper)", fontsize=9)
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:,.0f}"))
    ax.invert_xaxis()
    ax.set_title(f"{title}: one line per block, its lowest sensitivity at each size", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2 if len(groups) > 4 else 1, title="block", title_fontsize=7)
    return estimated


#: the figure's margins in inches around and between its panels: room for the two-line y labels and their
#: ticks, the x labels, and the titles (fixed: a layout engine would draw the whole figure once more)
_MARGINS = {
    "left": 1.05,
    "right": 0.25,
    "top": 0.75,
    "bottom": 0.6,
    "between_columns": 1.3,
    "between_rows": 1.0,
}


def _margins(width: float, height: float, rows: int, columns: int) -> dict[str, float]:
    """``subplots_adjust`` arguments (fractions of the figure, spaces as fractions of a panel) for
    :data:`_MARGINS` on a figure of ``width`` x ``height`` inches."""
    m = _MARGINS
    panel_width = (width - m["left"] - m["right"] - (columns - 1) * m["between_columns"]) / columns
    panel_height = (height - m["top"] - m["bottom"] - (rows - 1) * m["between_rows"]) / rows
    return {
        "left": m["left"] / width,
        "right": 1 - m["right"] / width,
        "top": 1 - m["top"] / height,
        "bottom": m["bottom"] / height,
        "wspace": m["between_columns"] / panel_width,
        "hspace": m["between_rows"] / panel_height,
    }


def plot_sensitivity(report: Mapping, path: str | Path) -> bool:
    """Write :func:`sensitivity_figure` of a plan report as a PNG; False when matplotlib is missing."""
    fig = sensitivity_figure(report)
    if fig is None:
        return False
    fig.savefig(path)
    return True


# long: its documented signature and docstring; the body is 79 lines, one step after another
def sensitivity_figure(report: Mapping) -> Any:
    """The figure of a plan report (:func:`gdnprune.plan.plan_model`), a ``matplotlib.figure.Figure`` drawn
    without pyplot (no global state); None when matplotlib is missing.

    One panel per kind of block (GDN layers, then attention, MLP, shared experts of a whole-model plan), per
    block: every candidate as a point — filled when measured on every calibration window, hollow when
    successive halving left it with an estimate from fewer windows —, the lower envelope of all of them (the
    least sensitivity reachable with at most that many kept parameters) as a line, and the chosen candidate as a
    star. With removal candidates (``depth``), one more panel shows each decoder layer's removal sensitivity,
    the removed ones in red; with the evolutionary search, one more its fitness (the whole cut model's KL) per
    generation.
    """
    try:  # lazy: matplotlib is an optional extra ([plot])
        from matplotlib.figure import Figure  # lazy: optional extra ([plot])
    except ImportError:
        return None
    kinds: dict[str, dict[str, Mapping]] = {}
    if report.get("layers"):
        kinds["gdn"] = dict(report["layers"])
    for prefix, block in (report.get("blocks") or {}).items():
        kinds.setdefault(block["kind"], {})[prefix] = block
    kinds = {
        k: kinds[k]
        for k in sorted(kinds, key=lambda k: list(_KINDS).index(k) if k in _KINDS else len(_KINDS))
    }
    evolution = report.get("evolution")
    removal = {k: v for k, v in (report.get("removal") or {}).items() if "sensitivity" in v}
    count = len(kinds) + bool(removal) + bool(evolution)
    columns = 1 if count == 1 else 2
    rows = -(-count // columns)
    width, height = 7.5 if columns == 1 else 13, 4.8 * rows
    fig = Figure(figsize=(width, height), dpi=120)  # no pyplot
    axes = fig.subplots(rows, columns, squeeze=False)
    fig.subplots_adjust(**_margins(width, height, rows, columns))
    flat = [ax for row in axes for ax in row]
    measured = report.get("sensitivity") in ("measured", "halving", "short", "bld")
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
        ax.set_xlabel("decoder layer (red: removed by the plan, grey: kept)", fontsize=9)
        scale = _sensitivity_scale(ax, [e["sensitivity"] for e in entries])
        what = "KL divergence per token, this layer alone skipped" if measured else "sensitivity"
        ax.set_ylabel(f"{what}\n({scale})", fontsize=9)
        ax.set_title("layer removal: the cost of skipping each layer", fontsize=10)
        ax.grid(alpha=0.3, axis="y")
    if evolution:
        ax = flat[len(kinds) + bool(removal)]
        history = evolution["history"]
        ax.plot(
            range(len(history) + 1),
            [evolution["seed_kl"], *[h["kl"] for h in history]],
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
        ax.set_xlabel("generation", fontsize=9)
        ax.set_ylabel(
            "KL divergence per token of the whole cut model\n(calibration windows, linear scale)", fontsize=9
        )
        ax.set_title("evolutionary search: the plan's KL as it improves", fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    for ax in flat[count:]:
        ax.set_visible(False)
    fig.suptitle(
        "How much each block's cuts cost, and what the plan chose (points: candidate widths; star: chosen"
        + ("; hollow: estimated on fewer windows)" if estimated else ")"),
        fontsize=11,
    )
    return fig
