"""``gdnprune bench``: the whole-model latency of model folders side by side at serving workloads, and its
figure; the timing itself is :class:`gdnprune.model.latency.LatencyHarness`'s."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..io.loading import load_causal_lm
from ..model.latency import LatencyHarness, Timing, Workload
from .api import model_parameters

__all__ = ["BenchResult", "bench_figure", "bench_models"]


@dataclass(frozen=True)
class BenchResult:
    """One model at one workload: ``model`` (the folder as given), ``parameters`` (every parameter of the
    causal LM), ``timing`` (:meth:`LatencyHarness.model_latency`) and ``speedup`` (the first model's
    median over this one's, at the same workload: 1.0 for the first model)."""

    model: str
    parameters: int
    timing: Timing
    speedup: float

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON values: ``model``, ``parameters``, ``speedup`` and :meth:`Timing.to_dict`'s keys."""
        return {
            "model": self.model,
            "parameters": self.parameters,
            "speedup": self.speedup,
            **self.timing.to_dict(),
        }


def bench_models(
    models: Sequence[str | os.PathLike],
    workloads: Sequence[Workload],
    *,
    device: str | None = None,
    dtype: str = "float32",
    repeats: int = 5,
    warmup: int = 2,
    seed: int = 0,
    progress: Callable[[int], None] | None = None,
) -> list[BenchResult]:
    """The whole-model latency of every model folder at every workload, one model loaded at a time
    (:func:`gdnprune.io.loading.load_causal_lm`: per-layer geometries too; ``device`` default: cuda when
    available), in the order ``models`` x ``workloads``; ``progress(1)`` after each timing."""
    timings: list[tuple[str, int, Timing]] = []
    for path in models:
        model = load_causal_lm(path, dtype=dtype, device=device)
        parameters = model_parameters(model)[0]
        for workload in workloads:
            timing = LatencyHarness(
                model, workload, repeats=repeats, warmup=warmup, seed=seed
            ).model_latency()
            timings.append((str(path), parameters, timing))
            if progress is not None:
                progress(1)
        del model
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    first = {str(t.workload): t.seconds for _, _, t in timings[: len(workloads)]}
    return [BenchResult(m, n, t, first[str(t.workload)] / t.seconds) for m, n, t in timings]


def bench_figure(results: Sequence[BenchResult], names: Sequence[str] | None = None) -> Any:
    """A ``matplotlib.figure.Figure`` (never pyplot): one panel per workload, one bar per model, tokens per
    second, each bar labelled with its speed-up over the first model. ``names``: the models' labels (default:
    their folder names)."""
    from matplotlib.figure import Figure  # lazy: the optional plot extra

    workloads = list(dict.fromkeys(str(r.timing.workload) for r in results))
    models = list(dict.fromkeys(r.model for r in results))
    labels = (
        list(names) if names is not None else [os.path.basename(os.path.normpath(m)) or m for m in models]
    )
    fig = Figure(figsize=(max(4.0, 2.2 + 1.1 * len(models)) * len(workloads), 4.2), layout="constrained")
    axes = fig.subplots(1, len(workloads), squeeze=False)[0]
    colors = [f"C{i % 10}" for i in range(len(models))]
    for ax, workload in zip(axes, workloads):
        rows = {r.model: r for r in results if str(r.timing.workload) == workload}
        values = [rows[m].timing.tokens_per_second if m in rows else 0.0 for m in models]
        bars = ax.bar(range(len(models)), values, color=colors)
        for bar, m in zip(bars, models):
            if m in rows:
                ax.annotate(
                    f"{rows[m].speedup:.2f}x",
                    (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                    ha="center",
                    va="bottom",
                    fontsize=8,
                )
        ax.set_xticks(range(len(models)), labels, rotation=20, ha="right", fontsize=8)
        ax.set_title(workload)
        phase = workload.split(":")[0]
        ax.set_ylabel("tokens/s" + (" (generated)" if phase == "decode" else " (prompt)"))
        ax.margins(y=0.15)
    device = results[0].timing.device if results else ""
    fig.suptitle(
        f"throughput per model and workload ({device})\nbar labels: speed-up over the first model", fontsize=9
    )
    return fig
