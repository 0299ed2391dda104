"""The side-by-side report of ``gdnprune eval``: rows of models, the markdown table and the plots.

No torch, no lm-eval: it reads lm-eval's ``results`` mapping (``task -> "metric,filter" -> value``). In the
table a recall probe's cell is marked :data:`DROP` where the model is below the first model (the unpruned
one, as the models are usually given) by more than the standard error of the difference; the needle grid
is drawn as a heat map, one panel per model (:func:`plot_needles`).
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..runtime.figures import new_figure

__all__ = [
    "DROP",
    "ModelResult",
    "metric_columns",
    "markdown_table",
    "needle_grid",
    "plot_needles",
    "recall_curves",
    "plot_report",
]

_PROBE_TASK = re.compile(r"^(passkey|mqar|multikey|vartrack)_(\d+)$")
_NEEDLE_TASK = re.compile(r"^needle_(\d+)_(\d+)$")
#: the mark of a recall drop beyond its standard error (against the first model of the table)
DROP = "▼"


@dataclass
class ModelResult:
    """One evaluated model: its folder, a short name, parameter counts and lm-eval's ``results`` unchanged."""

    path: str
    name: str
    parameters: int
    active_parameters: int
    results: dict[str, dict[str, Any]] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "name": self.name,
            "parameters": self.parameters,
            "active_parameters": self.active_parameters,
            "results": self.results,
        }


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def metric_columns(rows: Sequence[ModelResult]) -> list[tuple[str, str]]:
    """(task, ``metric,filter``) of every numeric metric of every task, in first-seen order, stderr excluded."""
    columns: list[tuple[str, str]] = []
    for row in rows:
        for task, metrics in row.results.items():
            for key, value in metrics.items():
                if "," in key and "_stderr," not in key and _is_number(value) and (task, key) not in columns:
                    columns.append((task, key))
    return columns


def _stderr(metrics: dict[str, Any], key: str) -> Any:
    metric, _, filt = key.partition(",")
    return metrics.get(f"{metric}_stderr,{filt}")


def _dropped(metrics: dict[str, Any], reference: dict[str, Any] | None, task: str, key: str) -> bool:
    """A recall probe below the reference by more than the standard error of the difference (both
    standard errors combined; a missing one counts as 0)."""
    if reference is None or not (_PROBE_TASK.match(task) or _NEEDLE_TASK.match(task)):
        return False
    mine, theirs = metrics.get(key), reference.get(key)
    if not (_is_number(mine) and _is_number(theirs)):
        return False
    a, b = _stderr(metrics, key), _stderr(reference, key)
    spread = math.hypot(a if _is_number(a) else 0.0, b if _is_number(b) else 0.0)
    return float(theirs) - float(mine) > spread  # type: ignore[arg-type]  # numbers: checked above


def _cell(metrics: dict[str, Any] | None, key: str, dropped: bool = False) -> str:
    if metrics is None or not _is_number(metrics.get(key)):
        return "–"
    stderr = _stderr(metrics, key)
    text = f"{metrics[key]:.4f}"
    text = f"{text} ± {stderr:.4f}" if _is_number(stderr) else text
    return f"{text} {DROP}" if dropped else text


def _label(task: str, key: str) -> str:
    metric, _, filt = key.partition(",")
    name = task if metric == task else f"{task} {metric}"
    return name + ("" if filt in ("none", "") else f" ({filt})")


def markdown_table(rows: Sequence[ModelResult]) -> str:
    """One row per model: name, parameters, active parameters, each task's metric ± its standard error; a
    recall probe below the first model's by more than the standard error of the difference is marked
    :data:`DROP`, and a note under the table says so."""
    columns = metric_columns(rows)
    head = ["model", "parameters", "active parameters", *(_label(t, k) for t, k in columns)]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join(["---"] + ["---:"] * (len(head) - 1)) + "|"]
    marked = False
    for n, row in enumerate(rows):
        cells = [row.name, f"{row.parameters:,}", f"{row.active_parameters:,}"]
        for t, k in columns:
            metrics = row.results.get(t)
            drop = n > 0 and metrics is not None and _dropped(metrics, rows[0].results.get(t), t, k)
            marked |= drop
            cells.append(_cell(metrics, k, drop))
        lines.append("| " + " | ".join(cells) + " |")
    if marked:
        lines.append(
            f"\n{DROP}: recall below {rows[0].name}'s by more than the standard error of the difference"
        )
    return "\n".join(lines) + "\n"


def recall_curves(row: ModelResult) -> dict[str, list[tuple[int, float]]]:
    """Probe kind -> [(context length, accuracy)] sorted by length, from tasks named ``{kind}_{length}``."""
    curves: dict[str, list[tuple[int, float]]] = {}
    for task, metrics in row.results.items():
        match = _PROBE_TASK.match(task)
        if match and _is_number(metrics.get("acc,none")):
            curves.setdefault(match.group(1), []).append((int(match.group(2)), float(metrics["acc,none"])))
    return {kind: sorted(points) for kind, points in curves.items()}


def needle_grid(row: ModelResult) -> dict[tuple[int, int], float]:
    """(context length, depth %) -> accuracy, from tasks named ``needle_{length}_{depth}``."""
    grid = {}
    for task, metrics in row.results.items():
        match = _NEEDLE_TASK.match(task)
        if match and _is_number(metrics.get("acc,none")):
            grid[(int(match.group(1)), int(match.group(2)))] = float(metrics["acc,none"])
    return grid


def plot_needles(rows: Sequence[ModelResult], path: str | Path) -> bool:
    """The needle-in-a-haystack grid as a heat map, one panel per model (depth down, context length
    across, accuracy as colour and as a number in each cell). False without matplotlib or needle tasks."""
    grids = [needle_grid(row) for row in rows]
    if not any(grids):
        return False
    lengths = sorted({n for g in grids for n, _ in g})
    depths = sorted({d for g in grids for _, d in g})
    fig = new_figure(figsize=(1.2 + 0.9 * len(lengths) * len(rows) + 1.0, 1.2 + 0.45 * len(depths)), dpi=120)
    if fig is None:
        return False
    fig.set_layout_engine("constrained")
    axes = fig.subplots(1, len(rows), squeeze=False)[0]
    image = None
    for ax, row, grid in zip(axes, rows, grids, strict=True):
        values = [[grid.get((n, d), math.nan) for n in lengths] for d in depths]
        image = ax.imshow(values, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto")
        for i, line in enumerate(values):
            for j, v in enumerate(line):
                if not math.isnan(v):
                    ax.text(j, i, f"{v:.2f}", ha="center", va="center", fontsize=7)
        ax.set_xticks(range(len(lengths)), [str(n) for n in lengths], rotation=45)
        ax.set_yticks(range(len(depths)), [f"{d}%" for d in depths])
        ax.set_xlabel("context length (characters)")
        ax.set_title(row.name if len(row.name) <= 28 else "…" + row.name[-27:], fontsize=9)
    axes[0].set_ylabel("needle depth (share of the filler before it)")
    assert image is not None  # one panel or more
    fig.colorbar(image, ax=list(axes), label="exact-match accuracy")
    fig.savefig(path)
    return True


def plot_report(rows: Sequence[ModelResult], path: str | Path) -> bool:
    """Bars per task (one panel per task that is not a recall probe, one bar per model) and recall against
    context length (one line per model and probe kind). False when matplotlib is missing."""
    try:
        from matplotlib.figure import Figure  # lazy: optional extra
    except ImportError:
        return False
    bars = [(t, k) for t, k in metric_columns(rows) if not (_PROBE_TASK.match(t) or _NEEDLE_TASK.match(t))]
    curves = [recall_curves(row) for row in rows]
    recall = any(curves)
    panels = len(bars) + int(recall)
    if panels == 0:
        return False
    fig = Figure(figsize=(4.2 * panels, 3.8), dpi=120, layout="constrained")
    axes = fig.subplots(1, panels, squeeze=False)[0]
    colors = [f"C{i % 10}" for i in range(len(rows))]
    for ax, (task, key) in zip(axes, bars, strict=False):
        values = [row.results.get(task, {}).get(key) for row in rows]
        xs = [i for i, v in enumerate(values) if _is_number(v)]
        ax.bar(xs, [values[i] for i in xs], color=[colors[i] for i in xs])
        metric, _, filt = key.partition(",")
        errors = [rows[i].results[task].get(f"{metric}_stderr,{filt}") for i in xs]
        if all(_is_number(e) for e in errors) and xs:
            ax.errorbar(xs, [values[i] for i in xs], yerr=errors, fmt="none", ecolor="black", capsize=3)
        ax.set_xticks(range(len(rows)), [row.name for row in rows], rotation=35, ha="right")
        ax.set_title(task)
        ax.set_ylabel(metric + (" (lower is better)" if "per_byte" in metric else ""))
    if recall:
        ax = axes[-1]
        styles = {"passkey": "o-", "mqar": "s--", "multikey": "^-.", "vartrack": "d:"}
        lines = [
            (row, kind, points, color)
            for row, c, color in zip(rows, curves, colors, strict=True)
            for kind, points in c.items()
        ]
        for k, (row, kind, points, color) in enumerate(lines):
            # equal curves (every model at 0, say) would hide one another: each line is dodged sideways a
            # little and drawn with a smaller marker than the one before
            dodge = 2 ** (0.04 * (k - (len(lines) - 1) / 2))
            ax.plot(
                [n * dodge for n, _ in points],
                [a for _, a in points],
                styles.get(kind, "x:"),
                color=color,
                markersize=max(3.0, 9.0 - 1.5 * k),
                label=f"{row.name}: {kind}",
            )
        ax.set_xscale("log", base=2)
        lengths = sorted({n for c in curves for points in c.values() for n, _ in points})
        ax.set_xticks(lengths, [str(n) for n in lengths])
        ax.minorticks_off()
        ax.set_ylim(-0.03, 1.03)
        ax.set_xlabel("context length (characters; equal points set apart)")
        ax.set_ylabel("recall (exact-match accuracy)")
        ax.set_title("recall against context length")
        ax.legend(fontsize=7)
    fig.savefig(path)
    return True
