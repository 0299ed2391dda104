"""The side-by-side report of ``gdnprune eval``: rows of models, the markdown table and the plot.

No torch, no lm-eval: it reads lm-eval's ``results`` mapping (``task -> "metric,filter" -> value``).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["ModelResult", "metric_columns", "markdown_table", "recall_curves", "plot_report"]

_PROBE_TASK = re.compile(r"^(passkey|mqar)_(\d+)$")


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


def _cell(metrics: dict[str, Any] | None, key: str) -> str:
    if metrics is None or not _is_number(metrics.get(key)):
        return "–"
    metric, _, filt = key.partition(",")
    stderr = metrics.get(f"{metric}_stderr,{filt}")
    text = f"{metrics[key]:.4f}"
    return f"{text} ± {stderr:.4f}" if _is_number(stderr) else text


def _label(task: str, key: str) -> str:
    metric, _, filt = key.partition(",")
    name = task if metric == task else f"{task} {metric}"
    return name + ("" if filt in ("none", "") else f" ({filt})")


def markdown_table(rows: Sequence[ModelResult]) -> str:
    """One row per model: name, parameters, active parameters, each task's metric ± its standard error."""
    columns = metric_columns(rows)
    head = ["model", "parameters", "active parameters", *(_label(t, k) for t, k in columns)]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join(["---"] + ["---:"] * (len(head) - 1)) + "|"]
    for row in rows:
        cells = [row.name, f"{row.parameters:,}", f"{row.active_parameters:,}"]
        cells += [_cell(row.results.get(t), k) for t, k in columns]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def recall_curves(row: ModelResult) -> dict[str, list[tuple[int, float]]]:
    """Probe kind -> [(context length, accuracy)] sorted by length, from tasks named ``{kind}_{length}``."""
    curves: dict[str, list[tuple[int, float]]] = {}
    for task, metrics in row.results.items():
        match = _PROBE_TASK.match(task)
        if match and _is_number(metrics.get("acc,none")):
            curves.setdefault(match.group(1), []).append((int(match.group(2)), float(metrics["acc,none"])))
    return {kind: sorted(points) for kind, points in curves.items()}


def plot_report(rows: Sequence[ModelResult], path: str | Path) -> bool:
    """Bars per task (one panel per task that is not a recall probe, one bar per model) and recall against
    context length (one line per model and probe kind). False when matplotlib is missing."""
    try:
        from matplotlib.figure import Figure  # lazy: optional extra
    except ImportError:
        return False
    bars = [(t, k) for t, k in metric_columns(rows) if not _PROBE_TASK.match(t)]
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
        styles = {"passkey": "o-", "mqar": "s--"}
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
