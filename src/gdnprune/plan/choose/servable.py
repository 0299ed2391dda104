"""Servable plans: one geometry per kind of block, plus whole decoder layers removed, chosen exactly.

Stock engines (vLLM, SGLang, llama.cpp, ...) read one geometry per kind of block from a standard config, and
fewer layers as ``num_hidden_layers`` and ``layer_types`` rewritten. :func:`choose_servable` is the MILP over
that space: a binary ``x[g, c]`` per candidate of every group, ``r_l`` per removable decoder layer and
``y[k, j]`` per kind of block ``k`` and geometry ``j`` that every group of the kind has. Every group takes
one candidate or goes with its layer (``sum_c x[g, c] + r_l = 1``), every kind one geometry
(``sum_j y[k, j] = 1``), and a group's candidate of geometry ``j`` only when its kind took ``j``
(``x[g, c] <= y[k, j]``; candidates no other group of the kind has are never chosen). The costs and the
sensitivity are summed over the kept groups only, as in :func:`~gdnprune.plan.choose.depth.choose_with_removal`:
the exact best plan of one geometry per kind and any set of removed layers, under every budget.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
from scipy.optimize import LinearConstraint

from .solve import BudgetError, budgeted_milp

__all__ = ["SERVABLE_NOTE", "choose_servable"]

#: what the plan report says of a servable plan
SERVABLE_NOTE = "servable by engines that read the standard config"


def _link_rows(
    keys: Sequence[Sequence[object]], kinds: Sequence[str], starts: Sequence[int], n: int, width: int
) -> tuple[np.ndarray, list[list[int]], np.ndarray, int]:
    """The links ``(x column, y column)`` of ``x[g, c] <= y[k, j]``, per kind its ``y`` columns (numbered from
    ``width``), per candidate whether it may be chosen at all (1 or 0), and the number of ``y``."""
    upper = np.ones(n)
    links: list[tuple[int, int]] = []
    kind_rows: list[list[int]] = []
    offset = width
    for kind in dict.fromkeys(kinds):
        members = [g for g, k in enumerate(kinds) if k == kind]
        common = [key for key in keys[members[0]] if all(key in keys[g] for g in members)]
        if not common:
            raise ValueError(f"the {kind} groups share no candidate geometry, so no servable plan exists")
        y = {key: offset + j for j, key in enumerate(common)}
        kind_rows.append(list(y.values()))
        for g in members:
            for c, key in enumerate(keys[g]):
                if key in y:
                    links.append((starts[g] + c, y[key]))
                else:
                    upper[starts[g] + c] = 0
        offset += len(common)
    return np.array(links, dtype=int).reshape(-1, 2), kind_rows, upper, offset - width


# long: the MILP's rows written out one constraint family after another, as in depth.choose_with_removal
def choose_servable(
    keys: Sequence[Sequence[object]],
    sensitivity: Sequence[Sequence[float]],
    costs: Mapping[str, Sequence[Sequence[float]]],
    budgets: Mapping[str, float],
    *,
    kinds: Sequence[str],
    layer_of: Sequence[int],
    removal: Mapping[int, float],
    keep_one_of: Sequence[int] = (),
) -> tuple[list[int | None], list[int]]:
    """The candidate of every group (None where its decoder layer is removed) and the removed layers that
    minimise the summed sensitivity within ``budgets``, every kind of block taking one geometry.

    Args:
        keys: ``keys[g][c]``: the geometry of candidate ``c`` of group ``g``.
        sensitivity, costs, budgets: as :func:`~gdnprune.plan.choose.solve.choose` (per group, per candidate).
        kinds: the kind of every group (a group alone in its kind is free).
        layer_of, removal, keep_one_of: as :func:`~gdnprune.plan.choose.depth.choose_with_removal` (``layer_of``
            empty: no layer may be removed).

    Raises:
        BudgetError: no servable plan meets the budgets; ValueError: inconsistent inputs.
    """
    sizes = [len(g) for g in sensitivity]
    if len(keys) != len(sizes) or len(kinds) != len(sizes) or any(len(k) != s for k, s in zip(keys, sizes)):
        raise ValueError("`keys` and `kinds` must describe every group and candidate of `sensitivity`")
    if layer_of and len(layer_of) != len(sizes):
        raise ValueError(f"layer_of names {len(layer_of)} groups, sensitivity has {len(sizes)}")
    layers = sorted(removal) if layer_of else []
    n, m = sum(sizes), len(layers)
    starts = [int(s) for s in np.cumsum([0] + sizes[:-1])]
    links, kind_rows, upper_x, q = _link_rows(keys, kinds, starts, n, n + m)
    width = n + m + q
    one = np.zeros((len(sizes), width))
    for g, (start, size) in enumerate(zip(starts, sizes)):
        one[g, start : start + size] = 1
        if layer_of and layer_of[g] in removal:
            one[g, n + layers.index(layer_of[g])] = 1
    rows = [LinearConstraint(one, 1, 1)]
    pick = np.zeros((len(kind_rows), width))
    for k, cols in enumerate(kind_rows):
        pick[k, cols] = 1
    rows.append(LinearConstraint(pick, 1, 1))
    if len(links):
        link = np.zeros((len(links), width))
        link[np.arange(len(links)), links[:, 0]] = 1
        link[np.arange(len(links)), links[:, 1]] = -1
        rows.append(LinearConstraint(link, -np.inf, 0))
    if m:  # never every layer; one of keep_one_of stays
        rows.append(LinearConstraint(_row(width, range(n, n + m)), 0, len(set(layer_of)) - 1))
        keep = [layers.index(i) for i in keep_one_of if i in removal]
        if keep and len(keep) == len(set(keep_one_of)):
            rows.append(LinearConstraint(_row(width, [n + k for k in keep]), 0, len(keep) - 1))
    budget_rows = []
    for name, budget in budgets.items():
        row = np.zeros(width)
        row[:n] = np.concatenate([np.asarray(g, dtype=np.float64) for g in costs[name]])
        budget_rows.append((row, budget))
    c = np.zeros(width)
    c[:n] = np.concatenate([np.asarray(g, dtype=np.float64) for g in sensitivity])
    c[n : n + m] = [removal[i] for i in layers]
    upper = np.ones(width)
    upper[:n] = upper_x
    result = budgeted_milp(c, rows, budget_rows, upper)
    if result.status == 2 or result.x is None:
        raise BudgetError(
            "no servable plan (one geometry per kind of block"
            + (", any layers removed" if m else "")
            + f") meets the budgets {dict(budgets)}"
        )
    if result.status != 0:
        raise RuntimeError(f"the MILP solver stopped without an optimum: {result.message}")
    x = np.round(result.x).astype(int)
    removed = [i for k, i in enumerate(layers) if x[n + k]]
    picks: list[int | None] = []
    for g, (start, size) in enumerate(zip(starts, sizes)):
        gone = bool(layer_of) and layer_of[g] in removed
        picks.append(None if gone else int(np.flatnonzero(x[start : start + size])[0]))
    return picks, removed


def _row(width: int, columns: Sequence[int] | range) -> np.ndarray:
    row = np.zeros((1, width))
    row[0, list(columns)] = 1
    return row
