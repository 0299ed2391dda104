"""The latency budget (issue 30): candidate latencies measured with the harness are positive; the budget is met
in the MILP's own arithmetic (against brute force over a small real table); the plan reports the predicted
latency beside the measured one; bad latency options are refused with exit 2 and one line, before any
calibration forward. Additivity is a benchmark (`python -m benchmarks latency`), not a timed test."""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterator

import numpy as np
import pytest
import torch
from helpers import make_source
from transformers import AutoModelForCausalLM

from gdnprune.cli import main
from gdnprune.model.latency import parse_workload
from gdnprune.plan import driver as plan_driver
from gdnprune.plan import plan_model
from gdnprune.plan.choose.solve import BudgetError, choose
from gdnprune.plan.measure import latency_costs
from gdnprune.plan.measure.candidates import parse_dim_step
from gdnprune.plan.measure.latency_costs import add_latency_budget, fit_latency, measure_latency_costs
from gdnprune.plan.measure.problem import Grid, build_problem, given_budgets
from gdnprune.scoring import score_model

pytestmark = pytest.mark.filterwarnings("ignore::gdnprune.checkpoint.UnsortedInputWarning")
WORKLOAD = parse_workload("prefill:1:16")


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    src = make_source(tmp_path_factory.mktemp("latency") / "model", "qwen3_5", seed=2)
    return AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval(), src


def _problem(model, blocks=("gdn",)):
    return build_problem(
        model,
        given_budgets({}),
        None,
        context=None,
        blocks=blocks,
        grid=Grid(parse_dim_step("1/2"), ("key_heads", "lanes")),
        orders_applied=True,
        uniform=False,
        latency=True,
    )


def test_candidate_latencies_are_positive_and_the_budget_is_met_as_brute_force_finds(model):
    model, _ = model
    problem = _problem(model)
    costs = measure_latency_costs(model, problem, WORKLOAD, repeats=2, warmup=1, progress=False)
    assert costs.whole > 0 and costs.fixed >= 0
    assert all(t > 0 for group in costs.groups for t in group)
    assert [len(g) for g in costs.groups] == [len(g.candidates) for g in problem.groups]
    with pytest.raises(BudgetError, match="least reachable"):
        add_latency_budget(_problem(model), costs, 1e-6)
    # a budget between the fastest plan and the unpruned model, from the measured costs (not a fixed
    # fraction: the share of the fixed part on a tiny model depends on the machine's load)
    least = (costs.fixed + sum(min(g) for g in costs.groups)) / costs.whole
    fraction = min(0.999, (least + 1.0) / 2)
    add_latency_budget(problem, costs, fraction)
    limit = problem.limits["latency"]
    assert limit == pytest.approx(fraction * costs.whole)
    assert problem.budgets["latency"] == pytest.approx(limit - costs.fixed)
    rng = np.random.default_rng(0)
    sens = [list(rng.uniform(0, 1, len(g))) for g in costs.groups]
    for g, group in enumerate(problem.groups):  # the full candidate costs nothing
        sens[g][next(c for c, t in enumerate(group.candidates) if t == group.shape)] = 0.0
    best = None
    for picks in itertools.product(*(range(len(g)) for g in costs.groups)):
        spent = costs.fixed + sum(costs.groups[g][p] for g, p in enumerate(picks))
        value = sum(sens[g][p] for g, p in enumerate(picks))
        if spent <= limit and (best is None or value < best[0]):
            best = (value, picks)
    if best is None:
        with pytest.raises(BudgetError):
            choose(sens, problem.costs, problem.budgets)
        return
    picks = choose(sens, problem.costs, problem.budgets)
    assert sum(sens[g][p] for g, p in enumerate(picks)) == pytest.approx(best[0])
    assert costs.predicted(picks, []) <= limit + 1e-12


def test_a_latency_plan_reports_predicted_beside_measured(model, monkeypatch):
    model, _ = model
    # every whole-model measurement (the real one), in order: the fitting's, then the report's if it measures
    measured: list[float] = []

    def counted(*args, **kwargs):
        measured.append(real(*args, **kwargs))
        return measured[-1]

    real = latency_costs.cut_model_latency
    monkeypatch.setattr(latency_costs, "cut_model_latency", counted)
    monkeypatch.setattr(plan_driver, "cut_model_latency", counted)
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    scores = score_model(model, [ids], progress=False, blocks=True)
    plan, report = plan_model(
        model,
        [ids],
        scores,
        budget_latency=0.95,
        workload="prefill:1:16",
        sensitivity="measured",
        dim_step="1/2",
        axes=("key_heads", "lanes"),
        blocks=("gdn", "mlp", "depth"),
        progress=False,
    )
    t = report["latency"]
    assert t["workload"] == "prefill:1:16" and t["unpruned_seconds"] > 0 and t["measured_seconds"] > 0
    assert t["predicted_seconds"] <= 0.95 * t["unpruned_seconds"] + 1e-12
    assert t["predicted_fraction"] == pytest.approx(t["predicted_seconds"] / t["unpruned_seconds"])
    assert t["measured_speedup"] == pytest.approx(t["unpruned_seconds"] / t["measured_seconds"])
    assert plan["budgets"]["latency"]["given"] == 0.95
    assert plan["predicted"]["latency"]["predicted_seconds"] == t["predicted_seconds"]
    assert t["fitting"][0]["planned_seconds"] == pytest.approx(0.95 * t["unpruned_seconds"])
    # the cut model is timed once per fitting round; the report reuses the last round's time unless the depth
    # check replaced the fitted choice (then that one is timed too)
    changed = report.get("depth_check", {}).get("kept") == "widths"
    assert measured == [r["measured_seconds"] for r in t["fitting"]] + (
        [t["measured_seconds"]] if changed else []
    )
    assert changed or t["measured_seconds"] == t["fitting"][-1]["measured_seconds"]


def test_a_choice_measured_over_the_limit_is_chosen_again_against_a_lower_planned_latency(model):
    """fit_latency: each round's choice meets the latency it planned against (the MILP's arithmetic), and
    after a measurement over the limit the planned latency is min(planned, predicted) * limit / measured. A
    tolerance of -0.9 (the cut model must measure under a tenth of the limit) makes every round go on, so the
    rounds do not depend on the machine's timings."""
    model, _ = model
    problem = _problem(model)
    costs = measure_latency_costs(model, problem, WORKLOAD, repeats=2, warmup=1, progress=False)
    least = (costs.fixed + sum(min(g) for g in costs.groups)) / costs.whole
    add_latency_budget(problem, costs, min(0.999, (least + 1.0) / 2))
    limit = problem.limits["latency"]
    rng = np.random.default_rng(1)
    sens = [list(rng.uniform(0, 1, len(g))) for g in costs.groups]
    chosen: list[list[int]] = []

    class Picked:  # what fit_latency reads of a choice
        def __init__(self, picks):
            self.picks, self.removed = picks, []

    def choose_now():
        chosen.append(list(choose(sens, problem.costs, problem.budgets)))
        return Picked(chosen[-1])

    choice, history = fit_latency(model, problem, costs, WORKLOAD, choose_now, rounds=3, tolerance=-0.9)
    assert 1 <= len(history) <= 4 and choice.picks == chosen[len(history) - 1]
    assert history[0]["planned_seconds"] == pytest.approx(limit)
    for k, record in enumerate(history):
        picks = chosen[k]
        spent = costs.fixed + sum(costs.groups[g][p] for g, p in enumerate(picks))
        assert record["predicted_seconds"] == pytest.approx(spent)
        assert spent <= record["planned_seconds"] + 1e-12
        assert record["measured_seconds"] > 0.1 * limit  # why it went on
        if k + 1 < len(history):
            expected = min(record["planned_seconds"], spent) * limit / record["measured_seconds"]
            assert history[k + 1]["planned_seconds"] == pytest.approx(expected)
    # it stopped after 3 more choices, or when no plan met a lower planned latency (one more try refused)
    assert len(history) == 4 or len(chosen) == len(history)


@pytest.mark.parametrize(
    "extra, words",
    [
        (["--budget-latency", "0.5", "--workload", "prefill:1"], "--workload"),
        (["--budget-latency", "0.5", "--workload", "train:1:16"], "--workload"),
        (["--budget-latency", "0.5"], "--workload"),
        (["--budget-params", "0.5", "--workload", "prefill:1:16"], "--budget-latency"),
        (["--budget-latency", "2", "--workload", "prefill:1:16"], "(0, 1]"),
    ],
)
def test_bad_latency_options_exit_2_with_one_line_before_loading(model, tmp_path, capsys, extra, words):
    _, src = model
    text = tmp_path / "calib.txt"
    text.write_text("some calibration text " * 50)
    scores = tmp_path / "scores.json"  # exists (paths are checked first) but is never read: the options
    scores.write_text("not a scores file")  # are refused before any file is parsed or any model loads
    capsys.readouterr()
    args = ["plan", str(src), "--scores", str(scores), "--data", str(text), "-o", str(tmp_path / "p.json")]
    assert main([*args, *extra]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and words in err[0]


def test_a_latency_budget_no_plan_reaches_exits_2_before_the_calibration_forwards(model, tmp_path, capsys):
    _, src = model
    text = tmp_path / "calib.txt"
    text.write_text("some calibration text " * 200)
    scores = tmp_path / "scores.json"
    assert (
        main(
            [
                "score",
                str(src),
                "--data",
                str(text),
                "-o",
                str(scores),
                "--num-samples",
                "2",
                "--seq-len",
                "16",
                "--quiet",
            ]
        )
        == 0
    )
    capsys.readouterr()
    args = ["plan", str(src), "--scores", str(scores), "--data", str(text), "-o", str(tmp_path / "p.json")]
    extra = ["--budget-latency", "0.0001", "--workload", "prefill:1:24", "--blocks", "gdn", "--quiet"]
    with _layer_calls() as shapes:
        assert main([*args, *extra, "--num-samples", "2", "--seq-len", "16"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--budget-latency 0.0001" in err[0] and "embeddings and LM head" in err[0]
    assert shapes and set(shapes) == {(1, 24)}  # the unpruned model's timed calls, no candidate, no window
    assert not (tmp_path / "p.json").exists()


@contextlib.contextmanager
def _layer_calls() -> Iterator[list[tuple[int, ...]]]:
    """The (batch, tokens) of every decoder-layer call while the block runs (a global forward hook,
    removed after): a timing call at ``prefill:1:24`` is (1, 24), a calibration window of 16 tokens is not."""
    shapes: list[tuple[int, ...]] = []

    def hook(module, args, kwargs, output):
        if type(module).__name__.endswith("DecoderLayer"):
            hidden = output[0] if isinstance(output, tuple) else output
            shapes.append(tuple(hidden.shape[:2]))

    handle = torch.nn.modules.module.register_module_forward_hook(hook, with_kwargs=True)
    try:
        yield shapes
    finally:
        handle.remove()


def test_prune_refuses_a_latency_budget_below_the_fixed_part_before_scoring(model, tmp_path, capsys):
    """Every decoder-layer call of the refused run is a timing call of the unpruned model at the workload
    (1 x 24 tokens): no scoring forward (calibration windows of 16 tokens), no candidate timed."""
    _, src = model
    text = tmp_path / "calib.txt"
    text.write_text("some calibration text " * 200)
    out = tmp_path / "out"
    args = ["prune", str(src), "--data", str(text), "-o", str(out), "--num-samples", "4", "--seq-len", "16"]
    extra = ["--budget-latency", "0.0001", "--workload", "prefill:1:24", "--servable", "--quiet"]
    capsys.readouterr()
    with _layer_calls() as shapes:
        assert main([*args, *extra]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--budget-latency 0.0001" in err[0] and "embeddings and LM head" in err[0]
    assert shapes and set(shapes) == {(1, 24)}
    assert not out.exists()
