"""The plan search: candidates and their costs, measured and proxy sensitivity, the exact choice, the CLI."""

from __future__ import annotations

import itertools
import json

import pytest
import torch
from helpers import SOURCE_SHAPE as SHAPE
from hypothesis import given, settings
from hypothesis import strategies as st
from tiny_models import build_model, cut_model

from gdnprune import load_pretrained
from gdnprune.cli import main
from gdnprune.model.geometry import GDNShape
from gdnprune.model.layouts import find_gdn_modules
from gdnprune.plan import BudgetError, choose, choose_uniform, layer_candidates, parse_dim_step, plan_model
from gdnprune.plan.measure.candidates import dim_values
from gdnprune.plan.measure.sensitivity import LayerToPlan, measured_sensitivity, proxy_sensitivity
from gdnprune.scoring import score_model, scores_to_permutations

pytestmark = pytest.mark.filterwarnings("ignore::gdnprune.checkpoint.UnsortedInputWarning")


def windows(n=2, length=72, seed=0, vocab=128):
    return torch.randint(0, vocab, (n, length), generator=torch.Generator().manual_seed(seed))


# ---- the exact choice ----------------------------------------------------------------------------------------


def _ratio_greedy(sensitivity, costs, budget):
    """Start from every layer's first (largest) candidate and keep taking the cut with the least sensitivity
    added per unit of cost saved, until the budget is met: the heuristic the MILP replaces."""
    picks = [0] * len(sensitivity)
    while sum(costs[g][p] for g, p in enumerate(picks)) > budget:
        moves = [
            ((sensitivity[g][c] - sensitivity[g][picks[g]]) / (costs[g][picks[g]] - costs[g][c]), g, c)
            for g in range(len(picks))
            for c in range(len(costs[g]))
            if costs[g][c] < costs[g][picks[g]]
        ]
        _, g, c = min(moves)
        picks[g] = c
    return picks


def test_the_milp_finds_the_optimum_where_the_greedy_does_not():
    sensitivity = [[0, 10], [0, 5.5], [0, 5.5]]
    params = [[10, 0], [6, 0], [6, 0]]
    picks = choose(sensitivity, {"params": params}, {"params": 12})
    assert picks == [1, 0, 0]  # summed sensitivity 10
    greedy = _ratio_greedy(sensitivity, params, 12)
    assert greedy == [0, 1, 1] and sum(s[p] for s, p in zip(sensitivity, greedy)) == 11 > 10


@settings(max_examples=40, deadline=None)
@given(
    st.lists(
        st.lists(st.tuples(st.integers(0, 20), st.integers(0, 30)), min_size=1, max_size=4),
        min_size=1,
        max_size=4,
    ),
    st.integers(0, 60),
    st.integers(0, 60),
)
def test_the_milp_equals_brute_force(layers, params_budget, state_budget):
    sensitivity = [[float(s) for s, _ in layer] for layer in layers]
    params = [[c for _, c in layer] for layer in layers]
    state = [[(3 * c) % 17 for _, c in layer] for layer in layers]
    best = None
    for picks in itertools.product(*[range(len(layer)) for layer in layers]):
        if (
            sum(params[g][p] for g, p in enumerate(picks)) <= params_budget
            and sum(state[g][p] for g, p in enumerate(picks)) <= state_budget
        ):
            value = sum(sensitivity[g][p] for g, p in enumerate(picks))
            best = value if best is None else min(best, value)
    budgets = {"params": params_budget, "state": state_budget}
    if best is None:
        with pytest.raises(BudgetError, match="no plan meets the budgets"):
            choose(sensitivity, {"params": params, "state": state}, budgets)
        return
    picks = choose(sensitivity, {"params": params, "state": state}, budgets)
    assert sum(sensitivity[g][p] for g, p in enumerate(picks)) == pytest.approx(best)
    assert sum(params[g][p] for g, p in enumerate(picks)) <= params_budget
    assert sum(state[g][p] for g, p in enumerate(picks)) <= state_budget


@pytest.mark.parametrize("excess", [1e-9, 1e-8, 1e-7, 2e-7])
def test_the_choice_never_exceeds_a_budget_by_the_solvers_tolerance(excess):
    """A latency budget in seconds (5.6 ms) that the most accurate choice exceeds by ``excess``: HiGHS accepts a
    row up to its feasibility tolerance over its bound, and took that choice (seen in a plan's latency fit). The
    choice must be brute force's best among those within the budget, its cost at most the budget exactly."""
    high, low = 0.0028224205, 0.001
    sensitivity = [[0.0, 1.0], [0.0, 1.0], [0.0, 0.5]]
    latency = [[high + excess / 2, low], [high + excess / 2, low], [low, low / 2]]
    budget = 2 * high + low
    within = [
        picks
        for picks in itertools.product(range(2), repeat=3)
        if sum(latency[g][p] for g, p in enumerate(picks)) <= budget
    ]
    best = min(sum(sensitivity[g][p] for g, p in enumerate(picks)) for picks in within)
    picks = choose(sensitivity, {"latency": latency}, {"latency": budget})
    assert sum(latency[g][p] for g, p in enumerate(picks)) <= budget
    assert sum(sensitivity[g][p] for g, p in enumerate(picks)) == best


def test_uniform_choice_takes_the_best_shared_geometry():
    keys = [["a", "b", "c"], ["a", "b", "c"]]
    sensitivity = [[0, 1, 2], [0, 4, 5]]
    costs = {"params": [[10, 5, 1], [10, 5, 1]]}
    assert choose_uniform(keys, sensitivity, costs, {"params": 11}) == [1, 1]  # 5; "c" for both costs 7
    assert choose(sensitivity, costs, {"params": 11}) == [2, 0]  # 2: heterogeneous does better
    with pytest.raises(BudgetError):
        choose_uniform(keys, sensitivity, costs, {"params": 1})


# ---- candidates and costs ------------------------------------------------------------------------------------


def test_dim_grid_and_constraints():
    assert parse_dim_step("1/8") == parse_dim_step(0.125) and parse_dim_step("16") == 16
    assert dim_values(128, parse_dim_step("1/8")) == list(range(16, 129, 16))
    assert dim_values(6, parse_dim_step("1/4")) == [2, 3, 5, 6]
    assert dim_values(128, 48) == [48, 96, 128]
    assert dim_values(128, parse_dim_step("1/8"), multiple_of=32) == [32, 64, 96, 128]
    for bad in ("0", "-1/2", "x", "2.5"):
        with pytest.raises(ValueError):
            parse_dim_step(bad)


@pytest.mark.parametrize("model_type", ["qwen3_5", "qwen3_next", "olmo_hybrid"])
def test_candidate_parameter_counts_are_exact(model_type):
    model = build_model(model_type, SHAPE)
    prefix, module = find_gdn_modules(model)[0]
    tensors = {n: tuple(p.shape) for n, p in module.named_parameters()}
    layout = {"qwen3_5": "qwen3_5", "qwen3_next": "qwen3_next", "olmo_hybrid": "olmo_hybrid"}[model_type]
    candidates = layer_candidates(
        prefix, SHAPE, tensors, layout, module.conv_kernel_size, dim_step="1/2", tp=None
    )
    assert candidates[0].target == SHAPE and len(candidates) == 2 * 2 * 2 * 2
    for candidate in candidates[::5]:
        cut = cut_model(model, {prefix: candidate.target})
        module_cut = dict(find_gdn_modules(cut))[prefix]
        assert candidate.params == sum(p.numel() for p in module_cut.parameters())
        t = candidate.target
        assert candidate.state == t.num_value_heads * t.key_head_dim * t.value_head_dim + t.conv_dim * 3
    with_tp = layer_candidates(prefix, SHAPE, tensors, layout, 4, dim_step="1/2", tp=2)
    assert {c.target.num_key_heads for c in with_tp} == {2} and all(
        c.target.num_value_heads % 2 == 0 for c in with_tp
    )


# ---- sensitivity ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("model_type", ["qwen3_5", "qwen3_next", "olmo_hybrid"])
def test_measured_sensitivity_is_the_kl_of_the_real_cut_model(model_type):
    model = build_model(model_type, SHAPE, seed=3)
    x = windows()
    scores = score_model(model, [x], progress=False)
    permutations = scores_to_permutations(scores)
    layers = [(p, m) for p, m in find_gdn_modules(model)]
    targets = [GDNShape(1, 2, 8, 6), GDNShape(2, 2, 5, 4)]
    to_plan = [
        LayerToPlan(p, m, random_block_orders(scores["layers"][p], m), [GDNShape.from_module(m), *targets])
        for p, m in layers
    ]
    result = measured_sensitivity(model, [x[:1], x[1:]], to_plan, progress=False)
    with torch.no_grad():
        teacher = model(input_ids=x).logits.log_softmax(-1)
        for prefix, _ in layers:
            assert result["kl"][prefix][0] == 0.0
            for k, target in enumerate(targets, start=1):
                cut = cut_model(model, {prefix: target}, {p: permutations[p] for p, _ in layers})
                student = cut(input_ids=x).logits.log_softmax(-1)
                kl = (teacher.exp() * (teacher - student)).sum(-1).mean()
                loss = torch.nn.functional.cross_entropy(
                    student[:, :-1].reshape(-1, student.shape[-1]), x[:, 1:].reshape(-1)
                )
                assert result["kl"][prefix][k] == pytest.approx(float(kl), rel=1e-4, abs=1e-7)
                assert result["loss"][prefix][k] == pytest.approx(float(loss), rel=1e-5)
    # the model is left as it was
    after = score_model(model, [x], progress=False)
    assert after["layers"] == scores["layers"]


def random_block_orders(payload, module):
    from gdnprune.model.geometry import orders_from_payload

    return orders_from_payload(payload, GDNShape.from_module(module))


def test_measured_sensitivity_on_a_dispatched_model_matches():
    from accelerate import dispatch_model

    model = build_model("qwen3_5", SHAPE, seed=4)
    x = windows(seed=2)
    scores = score_model(model, [x], progress=False)
    plan, report = plan_model(model, [x], scores, budget_gdn_params=0.6, dim_step="1/2", progress=False)
    dispatched = dispatch_model(build_model("qwen3_5", SHAPE, seed=4), device_map={"": "cpu"})
    plan_d, report_d = plan_model(
        dispatched, [x], scores, budget_gdn_params=0.6, dim_step="1/2", progress=False
    )
    assert plan_d["layers"] == plan["layers"]
    for prefix, layer in report["layers"].items():
        assert [c["sensitivity"] for c in report_d["layers"][prefix]["candidates"]] == pytest.approx(
            [c["sensitivity"] for c in layer["candidates"]], rel=1e-6, abs=1e-9
        )


def test_the_proxy_grows_as_candidates_shrink():
    model = build_model("qwen3_5", SHAPE, seed=5)
    scores = score_model(model, [windows()], progress=False)
    prefix, module = find_gdn_modules(model)[0]
    candidates = [
        c.target
        for c in layer_candidates(
            prefix,
            SHAPE,
            {n: tuple(p.shape) for n, p in module.named_parameters()},
            "qwen3_5",
            4,
            dim_step="1/2",
        )
    ]
    proxy = proxy_sensitivity(scores["layers"][prefix], SHAPE, candidates)
    assert proxy[0] == pytest.approx(0.0, abs=1e-9) and min(proxy) >= 0
    for a, b in itertools.product(range(len(candidates)), repeat=2):
        ta, tb = candidates[a], candidates[b]
        if all(
            getattr(ta, f) <= getattr(tb, f)
            for f in ("num_key_heads", "value_heads_per_group", "key_head_dim", "value_head_dim")
        ):
            assert proxy[a] >= proxy[b] - 1e-9  # a nested smaller cut removes at least as much


# ---- the plan and the command line ---------------------------------------------------------------------------


def _gdn_params(model) -> int:
    return sum(p.numel() for _, m in find_gdn_modules(model) for p in m.parameters())


def _gdn_state(model) -> int:
    """Recurrent state per sequence, summed over the GDN layers of a loaded model, by the formula of DESIGN.md:
    the delta-rule state Hv*dk*dv plus the conv state (2*Hk*dk + Hv*dv)*(K-1)."""
    return sum(
        m.num_v_heads * m.head_k_dim * m.head_v_dim
        + (2 * m.num_k_heads * m.head_k_dim + m.num_v_heads * m.head_v_dim) * (m.conv_kernel_size - 1)
        for _, m in find_gdn_modules(model)
    )


def test_plan_command_writes_the_plan_its_report_and_plot(scored_folder, tmp_path, capsys):
    src, text, scores = scored_folder
    out = tmp_path / "plan.json"
    assert (
        main(
            [
                "plan",
                str(src),
                "--scores",
                str(scores),
                "--data",
                str(text),
                "--output",
                str(out),
                "--budget-gdn-params",
                "0.5",
                "--dim-step",
                "1/2",
                "--num-samples",
                "2",
                "--seq-len",
                "72",
                "-q",
            ]
        )
        == 0
    )
    stdout = capsys.readouterr().out
    assert "predicted summed KL" in stdout and "GDN parameters kept" in stdout
    plan = json.loads(out.read_text())
    assert plan["format"] == "gdnprune-plan" and plan["totals"]["gdn_params_fraction"] <= 0.5
    assert plan["budgets"]["gdn_params"]["given"] == 0.5
    report = json.loads((tmp_path / "plan.sensitivity.json").read_text())
    assert set(report["layers"]) == set(plan["layers"])
    assert (tmp_path / "plan.sensitivity.png").stat().st_size > 1000
    # the plan is what slice --plan reads
    sliced = tmp_path / "sliced"
    assert main(["slice", str(src), "--plan", str(out), "-o", str(sliced), "-q"]) == 0
    model = load_pretrained(sliced, dtype=torch.float32)
    kept = sum(p.numel() for _, m in find_gdn_modules(model) for p in m.parameters())
    assert kept == plan["totals"]["gdn_params_kept"]
    # an existing plan is not replaced without --overwrite; budgets that nothing meets say why
    assert (
        main(
            [
                "plan",
                str(src),
                "--scores",
                str(scores),
                "--output",
                str(out),
                "--budget-gdn-params",
                "0.5",
                "--sensitivity",
                "proxy",
            ]
        )
        == 2
    )
    assert "already exists" in capsys.readouterr().err
    assert (
        main(
            [
                "plan",
                str(src),
                "--scores",
                str(scores),
                "--output",
                str(tmp_path / "p2.json"),
                "--budget-gdn-params",
                "10",
                "--sensitivity",
                "proxy",
            ]
        )
        == 2
    )
    assert "no plan meets the budgets" in capsys.readouterr().err
    assert (
        main(
            [
                "plan",
                str(src),
                "--scores",
                str(scores),
                "--output",
                str(tmp_path / "p3.json"),
                "--sensitivity",
                "proxy",
            ]
        )
        == 2
    )
    assert "give a budget" in capsys.readouterr().err


def test_uniform_and_state_budgets(scored_folder, tmp_path, capsys):
    src, _, scores = scored_folder
    out = tmp_path / "uniform.json"
    assert (
        main(
            [
                "plan",
                str(src),
                "--scores",
                str(scores),
                "--output",
                str(out),
                "--budget-state",
                "0.5",
                "--sensitivity",
                "proxy",
                "--uniform",
                "--dim-step",
                "1/2",
                "--json",
            ]
        )
        == 0
    )
    plan = json.loads(capsys.readouterr().out)
    assert len({json.dumps(t, sort_keys=True) for t in plan["layers"].values()}) == 1
    assert plan["totals"]["state_fraction"] <= 0.5 and plan["uniform"]
    # the state of the model sliced to the plan, counted on the loaded model, is within the budget
    assert main(["slice", str(src), "--plan", str(out), "-o", str(tmp_path / "sliced"), "-q"]) == 0
    sliced, full = (
        load_pretrained(tmp_path / "sliced", dtype=torch.float32),
        load_pretrained(src, dtype=torch.float32),
    )
    assert 0 < _gdn_state(sliced) <= 0.5 * _gdn_state(full)
    # and the plan's report counts the same state (float32 elements: 4 bytes)
    assert (plan["totals"]["state_bytes_kept"], plan["totals"]["state_bytes"]) == (
        4 * _gdn_state(sliced),
        4 * _gdn_state(full),
    )


def test_prune_with_a_budget_scores_plans_sorts_and_slices(scored_folder, tmp_path, capsys):
    src, text, _ = scored_folder
    out = tmp_path / "pruned"
    assert (
        main(
            [
                "prune",
                str(src),
                "--data",
                str(text),
                "-o",
                str(out),
                "--budget-gdn-params",
                "0.5",
                "--dim-step",
                "1/2",
                "--num-samples",
                "4",
                "--plan-samples",
                "2",
                "--seq-len",
                "72",
                "--quiet",
                "--self-contained",
            ]
        )
        == 0
    )
    assert "under the budget" in (line := capsys.readouterr().out) and "self-contained" in line
    manifest = json.loads((out / "gdnprune.json").read_text())
    assert manifest["operation"] == "prune" and manifest["sorted"]
    assert manifest["self_contained"] == "modeling_gdnprune.py" and (out / "modeling_gdnprune.py").is_file()
    assert json.loads((out / "config.json").read_text())["auto_map"]  # loading: tests/test_self_contained.py
    assert manifest["plan"]["metadata"]["totals"]["gdn_params_fraction"] <= 0.5
    model = load_pretrained(out, dtype=torch.float32)
    assert 0 < _gdn_params(model) <= 0.5 * _gdn_params(load_pretrained(src, dtype=torch.float32))
    assert model(input_ids=windows(1, 80, vocab=11)).logits.isfinite().all()
    assert (
        main(
            [
                "prune",
                str(src),
                "--data",
                str(text),
                "-o",
                str(tmp_path / "x"),
                "--budget-gdn-params",
                "0.5",
                "--num-key-heads",
                "1",
            ]
        )
        == 2
    )
    assert "exactly one of" in capsys.readouterr().err
