"""Removal as a plan candidate (issue 23): the MILP with a cost-0 removal per decoder layer against brute
force; the measured removal sensitivity against a full forward with the layer skipped; expert-count
candidates in the same problem."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from gdnprune.plan.depth import choose_with_removal, removal_sensitivity
from gdnprune.plan.solve import BudgetError
from gdnprune.scoring.experts import block_influence
from test_dense_axes import _ids, _model
from test_depth import _skipped


def _brute(sensitivity, costs, budgets, layer_of, removal):
    best = (np.inf, None)
    layers = sorted(removal)
    for removed in itertools.product([False, True], repeat=len(layers)):
        gone = {l for l, r in zip(layers, removed) if r}
        options = [[None] if layer_of[g] in gone else range(len(s)) for g, s in enumerate(sensitivity)]
        for pick in itertools.product(*options):
            if any(sum(costs[name][g][c] for g, c in enumerate(pick) if c is not None) > budget + 1e-9
                   for name, budget in budgets.items()):
                continue
            value = sum(sensitivity[g][c] for g, c in enumerate(pick) if c is not None) + sum(removal[l] for l in gone)
            if value < best[0] - 1e-12:
                best = (value, (list(pick), sorted(gone)))
    return best


@pytest.mark.parametrize("seed", range(6))
def test_widths_and_removals_chosen_together_equal_brute_force(seed):
    rng = np.random.default_rng(seed)
    layer_of = [0, 0, 1, 1, 2, 2]  # two sub-blocks per decoder layer (say a mixer and an MLP / experts)
    sensitivity, params, memory = [], [], []
    for g in range(6):
        k = int(rng.integers(2, 4))
        sensitivity.append([0.0] + sorted(rng.uniform(0, 1, k - 1).tolist()))  # the full width costs nothing
        p = sorted(rng.integers(1, 20, k).tolist(), reverse=True)
        params.append(p)
        memory.append([int(v) for v in rng.integers(0, 5, k)])
    removal = {0: float(rng.uniform(0.5, 3)), 2: float(rng.uniform(0.5, 3))}  # layer 1 may not go
    costs = {"params": params, "memory": memory}
    budgets = {"params": 0.5 * sum(p[0] for p in params), "memory": 6}
    value, best = _brute(sensitivity, costs, budgets, layer_of, removal)
    if best is None:
        with pytest.raises(BudgetError):
            choose_with_removal(sensitivity, costs, budgets, layer_of=layer_of, removal=removal)
        return
    choice, removed = choose_with_removal(sensitivity, costs, budgets, layer_of=layer_of, removal=removal)
    got = sum(sensitivity[g][c] for g, c in enumerate(choice) if c is not None) + sum(removal[l] for l in removed)
    assert abs(got - value) < 1e-9
    assert all((c is None) == (layer_of[g] in removed) for g, c in enumerate(choice))
    assert sum(params[g][c] for g, c in enumerate(choice) if c is not None) <= budgets["params"]


def test_removal_is_chosen_when_it_is_the_cheapest_way_to_meet_a_budget():
    sensitivity = [[0.0, 5.0], [0.0, 5.0], [0.0, 5.0], [0.0, 5.0]]
    costs = {"params": [[10, 5], [10, 5], [10, 5], [10, 5]]}
    layer_of = [0, 0, 1, 1]
    choice, removed = choose_with_removal(sensitivity, costs, {"params": 20}, layer_of=layer_of,
                                          removal={0: 1.0, 1: 2.0})
    assert removed == [0] and choice == [None, None, 0, 0]
    choice, removed = choose_with_removal(sensitivity, costs, {"params": 20}, layer_of=layer_of, removal={})
    assert removed == [] and sum(c for c in choice) == 4  # without removal: every sub-block halved (20 of sensitivity)


def test_measured_removal_sensitivity_is_the_kl_of_the_full_model_with_the_layer_skipped():
    model = _model("qwen3_5", seed=4)
    batches = [_ids(seed=i, seq=10) for i in range(2)]
    measured = removal_sensitivity(model, batches)
    assert sorted(measured) == [0, 1, 2, 3]
    with torch.no_grad():
        for i in (1, 3):
            skipped = _skipped(model, [i])
            kl, n = 0.0, 0
            for ids in batches:
                p = torch.log_softmax(model(input_ids=ids).logits.double(), -1)
                q = torch.log_softmax(skipped(input_ids=ids).logits.double(), -1)
                kl += float((p.exp() * (p - q)).sum())
                n += ids.numel()
            assert abs(measured[i][0] - kl / n) <= 1e-4 * max(kl / n, 1e-6), (i, measured[i][0], kl / n)
    proxy = block_influence(model, batches)
    assert set(proxy) == set(measured)  # the one-pass proxy covers the same layers (how well it ranks: BENCHMARKS)
