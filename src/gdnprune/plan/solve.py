"""The budgeted choice: one candidate per layer, least summed sensitivity, every budget met — exactly.

It is a multiple-choice knapsack. :func:`choose` solves it as a mixed-integer linear program with scipy's
``milp`` (HiGHS): binary ``x[l, c]`` picks candidate ``c`` of layer ``l``; ``sum_c x[l, c] = 1`` for every
layer; ``sum x[l, c] * cost_k[l, c] <= budget_k`` for every budget ``k`` (parameters, recurrent state);
minimise ``sum x[l, c] * sensitivity[l, c]``. :func:`choose_uniform` picks one geometry for all layers by
evaluating every geometry the layers share.
"""

from __future__ import annotations

from typing import Mapping, Sequence

import numpy as np

__all__ = ["BudgetError", "MILP_OPTIONS", "choose", "choose_among", "choose_uniform", "exact_objective"]


class BudgetError(ValueError):
    """No choice of candidates meets the budgets."""


def _check(sensitivity: Sequence[Sequence[float]], costs: Mapping[str, Sequence[Sequence[float]]]) -> None:
    for name, table in costs.items():
        if len(table) != len(sensitivity) or any(len(a) != len(b) for a, b in zip(table, sensitivity)):
            raise ValueError(f"cost {name!r} must have one value per layer and candidate, like the sensitivities")


def _minimum(costs: Mapping[str, Sequence[Sequence[float]]], budgets: Mapping[str, float]) -> str:
    return "; ".join(f"{name}: at least {sum(min(layer) for layer in costs[name]):,.0f} needed (each layer at its "
                     f"smallest candidate), budget {budgets[name]:,.0f}" for name in budgets)


#: HiGHS stops within a gap of the optimum (relative 1e-4, absolute 1e-6 by default): far too loose for KLs
#: of 1e-5 per token; with the objective scaled (:func:`exact_objective`) and this, the choice is exact
MILP_OPTIONS = {"mip_rel_gap": 1e-12}


def exact_objective(c: np.ndarray) -> np.ndarray:
    """The objective scaled so that its largest magnitude is 1e6: HiGHS's absolute gap (1e-6) is then 1e-12 of
    it, so sums of small sensitivities (KL per token of slight cuts) are told apart."""
    top = float(np.max(np.abs(c))) if c.size else 0.0
    return c * (1e6 / top) if top > 0 else c


def choose(sensitivity: Sequence[Sequence[float]], costs: Mapping[str, Sequence[Sequence[float]]],
           budgets: Mapping[str, float]) -> list[int]:
    """The candidate index of every layer that minimises the summed sensitivity within ``budgets``.

    Args:
        sensitivity: per layer, one value per candidate (e.g. the KL divergence when that layer alone is cut).
        costs: per budget name, per layer, one cost per candidate (e.g. kept parameters).
        budgets: budget name -> the most the chosen candidates may cost in all (names as in ``costs``).

    Raises:
        BudgetError: no choice meets the budgets (the message gives the least each budget can reach).
    """
    from scipy.optimize import Bounds, LinearConstraint, milp

    _check(sensitivity, costs)
    sizes = [len(layer) for layer in sensitivity]
    n = sum(sizes)
    starts = np.cumsum([0] + sizes[:-1])
    one_each = np.zeros((len(sizes), n))
    for layer, (start, size) in enumerate(zip(starts, sizes)):
        one_each[layer, start:start + size] = 1
    constraints = [LinearConstraint(one_each, 1, 1)]
    for name, budget in budgets.items():
        row = np.concatenate([np.asarray(layer, dtype=np.float64) for layer in costs[name]])
        constraints.append(LinearConstraint(row[None, :], -np.inf, float(budget)))
    c = np.concatenate([np.asarray(layer, dtype=np.float64) for layer in sensitivity])
    result = milp(exact_objective(c), constraints=constraints, integrality=np.ones(n), bounds=Bounds(0, 1),
                  options=MILP_OPTIONS)
    if result.status == 2 or result.x is None:  # infeasible
        raise BudgetError(f"no plan meets the budgets: {_minimum(costs, budgets)}")
    if result.status != 0:
        raise RuntimeError(f"the MILP solver stopped without an optimum: {result.message}")
    x = np.round(result.x).astype(int)
    return [int(np.flatnonzero(x[start:start + size])[0]) for start, size in zip(starts, sizes)]


def choose_among(sensitivity: Sequence[Sequence[float]], costs: Mapping[str, Sequence[Sequence[float]]],
                 budgets: Mapping[str, float], allowed: Sequence[Sequence[bool]] | None = None) -> list[int]:
    """:func:`choose` over the candidates ``allowed[l][c]`` only (all when None); indices into the full lists."""
    if allowed is None:
        return choose(sensitivity, costs, budgets)
    keep = [[c for c, ok in enumerate(layer) if ok] for layer in allowed]
    if any(not k for k in keep):
        raise ValueError("every layer needs at least one allowed candidate")
    picks = choose([[sensitivity[l][c] for c in k] for l, k in enumerate(keep)],
                   {name: [[table[l][c] for c in k] for l, k in enumerate(keep)] for name, table in costs.items()},
                   budgets)
    return [k[p] for k, p in zip(keep, picks)]


def choose_uniform(keys: Sequence[Sequence[object]], sensitivity: Sequence[Sequence[float]],
                   costs: Mapping[str, Sequence[Sequence[float]]], budgets: Mapping[str, float]) -> list[int]:
    """Like :func:`choose`, but every layer takes the same geometry: ``keys[l][c]`` names candidate ``c`` of
    layer ``l`` (e.g. its target shape); only keys every layer has are tried, each one evaluated exactly."""
    _check(sensitivity, costs)
    index = [{key: c for c, key in enumerate(layer)} for layer in keys]
    common = [key for key in keys[0] if all(key in layer for layer in index)]
    best, best_value = None, np.inf
    for key in common:
        picks = [layer[key] for layer in index]
        if all(sum(costs[name][l][c] for l, c in enumerate(picks)) <= budgets[name] for name in budgets):
            value = sum(sensitivity[l][c] for l, c in enumerate(picks))
            if value < best_value:
                best, best_value = picks, value
    if best is None:
        raise BudgetError(f"no single geometry for all layers meets the budgets: {_minimum(costs, budgets)}"
                          if common else "the layers share no candidate geometry")
    return best
