"""The library's figures leave matplotlib's global state alone (no backend switch, no pyplot figure) and keep
their labels inside the picture."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest

SCRIPT = """
import sys, matplotlib
matplotlib.use("svg")  # the user's choice, which the library must keep
from gdnprune.runtime.figures import new_figure
fig = new_figure(figsize=(3, 2), dpi=50)
ax = fig.subplots()
ax.plot([0, 1], [1, 0])
fig.savefig(sys.argv[1])
print(matplotlib.get_backend(), "matplotlib.pyplot" in sys.modules)
"""


def test_a_figure_is_drawn_and_saved_without_pyplot_or_a_backend_switch(tmp_path):
    out = tmp_path / "plot.png"
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(out)], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["svg", "False"]
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"  # the file's own format, whatever the backend


# ---- what is drawn stays inside the picture ---------------------------------------------------------------


def _misplaced(fig) -> list[str]:
    """What of ``fig`` is misplaced once drawn: an axis label, title or tick label that reaches past the
    picture's edges, or that overlaps another one (tick labels of one axis aside). The figures use fixed
    margins, not a layout engine: this is what the margins must hold."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    renderer = FigureCanvasAgg(fig).get_renderer()
    fig.draw(renderer)
    texts = [(fig._suptitle, "suptitle")] if fig._suptitle is not None else []
    for k, ax in enumerate(ax for ax in fig.axes if ax.get_visible()):
        texts += [(ax.xaxis.label, None), (ax.yaxis.label, None), (ax.title, None)]
        for axis, values, limits in (
            ("x", ax.get_xticks(), ax.get_xlim()),
            ("y", ax.get_yticks(), ax.get_ylim()),
        ):
            labels = ax.get_xticklabels() if axis == "x" else ax.get_yticklabels()
            low, high = sorted(limits)
            texts += [(t, f"{k}{axis}") for t, v in zip(labels, values) if low <= v <= high]
    boxes = [
        (t.get_text(), group, t.get_window_extent(renderer))
        for t, group in texts
        if t.get_visible() and t.get_text()
    ]
    edge = fig.bbox
    out = [
        f"{text!r} past the edge"
        for text, _, b in boxes
        if b.x0 < edge.x0 - 1 or b.x1 > edge.x1 + 1 or b.y0 < edge.y0 - 1 or b.y1 > edge.y1 + 1
    ]
    for i, (text, group, b) in enumerate(boxes):
        for other, other_group, c in boxes[i + 1 :]:
            if (group is None or group != other_group) and b.overlaps(c):
                out.append(f"{text!r} over {other!r}")
    return out


@pytest.mark.parametrize("scale", [0.0035, 1234.5, 2e-6])
def test_the_loss_plot_keeps_its_labels_and_ticks_inside(scale):
    """Small KLs (ticks like 0.0035), large losses, losses with an offset: the y label beside six-character
    ticks, the title and the x label all lie inside the picture."""
    pytest.importorskip("matplotlib")
    from gdnprune.distill.records import loss_figure

    steps = range(1, 1001)
    history = [{"step": s, "loss": scale * (1 + math.exp(-s / 300))} for s in steps[::10]]
    history += [
        {"step": s, "eval_loss": scale, "eval_lm_loss": 1.2, "eval_teacher_lm_loss": 1.1}
        for s in steps[99::100]
    ]
    per_step = [(s, scale * (1 + math.exp(-s / 300) * (1 + 0.1 * math.sin(s)))) for s in steps]
    for fig in (loss_figure(history[:100], 1.0, 0.0, per_step), loss_figure(history, 1.0, 0.3, per_step)):
        assert _misplaced(fig) == []


def test_the_loss_plot_names_eval_losses_only_where_the_run_evaluated():
    pytest.importorskip("matplotlib")
    from gdnprune.distill.records import loss_figure

    trained = [{"step": s, "loss": 1.0 / s} for s in (1, 2, 4)]
    for history, evaluated in ((trained, False), (trained + [{"step": 4, "eval_loss": 0.3}], True)):
        (ax,) = loss_figure(history).axes
        assert ("eval losses" in ax.get_title()) == evaluated
        assert any(t.get_text().startswith("eval") for t in ax.get_legend().get_texts()) == evaluated


@pytest.mark.parametrize("panels", [1, 2, 3, 5])
def test_the_sensitivity_plot_keeps_its_labels_and_ticks_inside(panels):
    """One to five panels (GDN, attention, MLP, removal, evolution) at KLs of 0.0035 and over four decades."""
    pytest.importorskip("matplotlib")
    from gdnprune.plan.report.plot import sensitivity_figure

    def block(kls, kind=None):
        cands = [
            {"params": 135_216 - 20_000 * i, "sensitivity": kl, "windows": 4} for i, kl in enumerate(kls)
        ]
        return {"candidates": cands, "chosen": 1, **({"kind": kind} if kind else {})}

    report: dict = {
        "sensitivity": "measured",
        "layers": {"model.layers.0.linear_attn": block([0, 1e-4, 0.0035])},
    }
    kinds = ["attention", "mlp"][: max(0, panels - 1)]
    report["blocks"] = {f"model.layers.3.{k}": block([0, 2e-7, 3e-3, 0.2], k) for k in kinds}
    if panels == 5:
        report["removal"] = {"model.layers.1": {"layer": 1, "sensitivity": 0.02, "removed": True}}
        report["evolution"] = {
            "seed_kl": 0.3,
            "history": [{"generation": 1, "kl": 0.2, "best_offspring_kl": 0.25}],
        }
    fig = sensitivity_figure(report)
    assert len([ax for ax in fig.axes if ax.get_visible()]) == panels
    assert _misplaced(fig) == []
