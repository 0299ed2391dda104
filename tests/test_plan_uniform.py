"""Whole-model uniform plans (issue 21): every kind of sub-block takes one geometry for all its blocks (all GDN
layers one GDN target, all MLPs one intermediate size, all attention layers one head geometry). The choice
against brute force over every combination of per-kind geometries, with a real tiny model's cost tables; the
list of uniform candidates against the same brute force; a uniform plan measured and sliced on a real model,
its parameters counted on the sliced model; kinds whose blocks share no geometry refused."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from helpers import random_dense_model, token_ids

from gdnprune.model.geometry import GDNShape
from gdnprune.model.subblock_shapes import AttentionShape
from gdnprune.plan import BudgetError, choose_uniform, plan_model, uniform_choices, uniform_plans
from gdnprune.plan.measure.candidates import parse_dim_step
from gdnprune.plan.measure.problem import Grid, build_problem


def _tables(model, *, dim_step="1/2", axes=("key_heads", "lanes", "key_dim", "value_dim"), budget=1.0):
    given = dict(params=budget, gdn_params=None, active_params=None, memory=None, state=None)
    problem = build_problem(
        model,
        given,
        None,
        context=None,
        blocks=("gdn", "attention", "mlp", "shared_expert"),
        grid=Grid(parse_dim_step(dim_step), axes),
        orders_applied=True,
        uniform=True,
    )
    return problem


def _combinations(keys, kinds):
    """Brute force: per kind, the geometries all its groups have; every product of them, as per-group picks."""
    order = list(dict.fromkeys(kinds))
    shared = {
        k: [
            key
            for key in keys[kinds.index(k)]
            if all(key in keys[g] for g in range(len(keys)) if kinds[g] == k)
        ]
        for k in order
    }
    for combo in itertools.product(*(shared[k] for k in order)):
        geometry = dict(zip(order, combo))
        yield tuple(keys[g].index(geometry[kinds[g]]) for g in range(len(keys))), geometry


def _larger(a, b):
    """``b`` strictly contains ``a`` (nested prefix), from the shapes' fields."""
    if isinstance(a, GDNShape):
        fa = (a.num_key_heads, a.num_value_heads // a.num_key_heads, a.key_head_dim, a.value_head_dim)
        fb = (b.num_key_heads, b.num_value_heads // b.num_key_heads, b.key_head_dim, b.value_head_dim)
    elif isinstance(a, AttentionShape):
        fa = (a.num_key_value_heads, a.num_attention_heads // a.num_key_value_heads)
        fb = (b.num_key_value_heads, b.num_attention_heads // b.num_key_value_heads)
    else:
        fa, fb = (a.intermediate_size,), (b.intermediate_size,)
    return a != b and all(x <= y for x, y in zip(fa, fb))


@pytest.mark.parametrize("model_type", ["qwen3_5", "qwen3_5_moe"])
def test_uniform_choice_and_list_equal_brute_force_on_a_real_models_cost_tables(model_type):
    model = random_dense_model(model_type, seed=3)
    problem = _tables(model)
    keys, kinds, costs = problem.keys, problem.kinds, problem.costs["params"]
    assert set(kinds) == {"gdn", "attention", "mlp" if model_type == "qwen3_5" else "shared_expert"}
    combos = list(_combinations(keys, kinds))
    assert len(combos) > 50
    full = sum(c[0] for c in costs)
    rng = np.random.default_rng(0)
    checked_optimum = 0
    for _ in range(12):
        # sensitivity grows as a candidate shrinks (like a real KL), with noise so that kinds trade off
        sensitivity = [
            [
                float(rng.uniform(0, 1) * (1 - c / cands[0]) + rng.uniform(0, 0.05)) if c < cands[0] else 0.0
                for c in cands
            ]
            for cands in costs
        ]
        budget = {"params": float(rng.uniform(0.3, 1.0)) * full}
        feasible = [
            (picks, g)
            for picks, g in combos
            if sum(costs[i][p] for i, p in enumerate(picks)) <= budget["params"]
        ]
        if not feasible:
            with pytest.raises(BudgetError, match="single geometry per kind"):
                choose_uniform(keys, sensitivity, {"params": costs}, budget, kinds=kinds)
            continue
        best = min(sum(sensitivity[i][p] for i, p in enumerate(picks)) for picks, _ in feasible)
        picks = choose_uniform(keys, sensitivity, {"params": costs}, budget, kinds=kinds)
        assert sum(sensitivity[i][p] for i, p in enumerate(picks)) == pytest.approx(best, abs=1e-12)
        for kind in set(kinds):  # one geometry per kind
            assert len({keys[i][p] for i, p in enumerate(picks) if kinds[i] == kind}) == 1
        checked_optimum += 1
        # the list: every feasible combination, and the maximal ones (no single kind can grow within the budget)
        listed = {
            tuple(p) for p in uniform_choices(keys, {"params": costs}, budget, kinds=kinds, maximal=False)
        }
        assert listed == {picks for picks, _ in feasible}
        maximal = set()
        for picks, geometry in feasible:
            grows = False
            for kind, shape in geometry.items():
                for _, other in feasible:
                    if all(other[k] == geometry[k] for k in geometry if k != kind) and _larger(
                        shape, other[kind]
                    ):
                        grows = True
            if not grows:
                maximal.add(picks)
        assert {tuple(p) for p in uniform_choices(keys, {"params": costs}, budget, kinds=kinds)} == maximal
        assert maximal and len(maximal) < len(feasible)
    assert checked_optimum >= 8


def test_a_uniform_whole_model_plan_on_a_real_model_meets_its_budget_and_is_the_uniform_optimum():
    from gdnprune.io.loading import slice_model
    from gdnprune.scoring import score_model

    model = random_dense_model("qwen3_5", seed=4)
    ids = token_ids(seed=3, batch=4, seq=16)
    scores = score_model(model, [ids], progress=False, blocks=True)
    plan, report = plan_model(
        model,
        [ids[:2], ids[2:]],
        scores,
        budget_params=0.6,
        dim_step="1/2",
        sensitivity="measured",
        uniform=True,
        progress=False,
    )
    assert plan["uniform"]
    groups = {
        **{k: ("gdn", v) for k, v in plan["layers"].items() if k.endswith("linear_attn")},
        **{
            k: ("attention" if k.endswith("self_attn") else "mlp", v)
            for k, v in plan["layers"].items()
            if not k.endswith("linear_attn")
        },
    }
    for kind, count in (("gdn", 2), ("attention", 2), ("mlp", 4)):
        entries = [v for k, v in groups.values() if k == kind]
        assert len(entries) == count and all(e == entries[0] for e in entries), kind
    # the budget, counted on the sliced model
    gdn = {k: v for k, v in plan["layers"].items() if k.endswith("linear_attn")}
    blocks = {k: v for k, v in plan["layers"].items() if not k.endswith("linear_attn")}
    from gdnprune.scoring import scores_to_permutations

    gdn_scores = {**scores, "layers": {k: v for k, v in scores["layers"].items() if k in gdn}}
    cut = slice_model(
        model,
        gdn,
        scores_to_permutations(gdn_scores),
        blocks=blocks,
        block_orders={k: scores["layers"][k] for k in blocks},
    )
    full_params = sum(p.numel() for p in model.parameters())
    cut_params = sum(p.numel() for p in cut.parameters())
    assert cut_params <= 0.6 * full_params and cut_params == plan["totals"]["model_params_kept"]
    # no other uniform combination of the report's measured candidates is better within the budget
    values = [g["candidates"] for g in report["layers"].values()] + [
        g["candidates"] for g in report["blocks"].values()
    ]
    kinds = ["gdn"] * len(report["layers"]) + [g["kind"] for g in report["blocks"].values()]
    keys = [[tuple(sorted(c["target"].items())) for c in g] for g in values]
    fixed = plan["totals"]["model_params"] - sum(g[0]["params"] for g in values)
    best = min(
        sum(values[i][p]["sensitivity"] for i, p in enumerate(picks))
        for picks, _ in _combinations(keys, kinds)
        if fixed + sum(values[i][p]["params"] for i, p in enumerate(picks))
        <= plan["budgets"]["params"]["limit"]
    )
    assert plan["predicted"]["summed_sensitivity"] == pytest.approx(best, abs=1e-12)
    # the listed uniform plans (no forward) hold the chosen one, each within the budget
    listed = uniform_plans(model, budget_params=0.6, dim_step="1/2", maximal=False)
    assert all(p["totals"]["model_params_kept"] <= 0.6 * full_params for p in listed)
    chosen = {k: v for k, v in plan["layers"].items()}
    assert any(p["layers"] == chosen for p in listed)
    maximal = uniform_plans(model, budget_params=0.6, dim_step="1/2")
    assert 0 < len(maximal) < len(listed) and all(p in listed for p in maximal)


def test_a_uniform_plan_refuses_a_kind_whose_blocks_share_no_geometry():
    from gdnprune.io.loading import slice_model
    from gdnprune.plan import check_budgets

    model = random_dense_model("qwen3_5", seed=1)
    mlps = [n for n, _ in model.named_modules() if n.endswith(".mlp")]
    hetero = slice_model(model, blocks={mlps[0]: {"intermediate_size": 37}})
    with pytest.raises(ValueError, match="mlp blocks one geometry.*different shapes"):
        check_budgets(hetero, budget_params=0.7, uniform=True, dim_step="1/2")
    # without the MLPs in `blocks`, the others are uniform
    check_budgets(hetero, budget_params=0.8, uniform=True, dim_step="1/2", blocks=["gdn", "attention"])
    # a GDN-only uniform plan as before: one geometry for all GDN layers
    check_budgets(model, budget_gdn_params=0.5, uniform=True)
    with pytest.raises(BudgetError, match="meets the budgets"):
        check_budgets(model, budget_params=0.3, uniform=True, dim_step="1/2", blocks=["gdn"])
