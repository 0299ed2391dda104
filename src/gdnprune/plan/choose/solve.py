"""The budgeted choice: one candidate per layer, least summed sensitivity, every budget met — exactly.

It is a multiple-choice knapsack. :func:`choose` solves it as a mixed-integer linear program with scipy's
``milp`` (HiGHS): binary ``x[l, c]`` picks candidate ``c`` of layer ``l``; ``sum_c x[l, c] = 1`` for every
layer; ``sum x[l, c] * cost_k[l, c] <= budget_k`` for every budget ``k`` (parameters, recurrent state);
minimise ``sum x[l, c] * sensitivity[l, c]``. :func:`choose_uniform` picks one geometry per kind of block
(all GDN layers one, all MLPs one, ...): the same knapsack over the kinds, each geometry costing what all
the kind's blocks cost at it; :func:`uniform_choices` lists every such combination within the budgets.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import sys
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np
from scipy.optimize import Bounds, LinearConstraint, milp

from ...model.geometry import GDNShape

__all__ = [
    "BudgetError",
    "MAX_COMBINATIONS",
    "MILP_OPTIONS",
    "budgeted_milp",
    "choose",
    "choose_among",
    "choose_pool",
    "choose_uniform",
    "exact_objective",
    "nested_in",
    "no_good_cut",
    "quiet_milp",
    "silenced_stdout",
    "uniform_choices",
]


class BudgetError(ValueError):
    """No choice of candidates meets the budgets."""


def _check(sensitivity: Sequence[Sequence[float]], costs: Mapping[str, Sequence[Sequence[float]]]) -> None:
    for name, table in costs.items():
        if len(table) != len(sensitivity) or any(len(a) != len(b) for a, b in zip(table, sensitivity)):
            raise ValueError(
                f"cost {name!r} must have one value per layer and candidate, like the sensitivities"
            )


def _minimum(costs: Mapping[str, Sequence[Sequence[float]]], budgets: Mapping[str, float]) -> str:
    return "; ".join(
        f"{name}: at least {sum(min(layer) for layer in costs[name]):,.0f} needed (each layer at its "
        f"smallest candidate), budget {budgets[name]:,.0f}"
        for name in budgets
    )


#: HiGHS stops within a gap of the optimum (relative 1e-4, absolute 1e-6 by default): far too loose for KLs
#: of 1e-5 per token; with the objective scaled (:func:`exact_objective`) and this, the choice is exact
MILP_OPTIONS = {"mip_rel_gap": 1e-12}


def _flush_c_stdio() -> None:
    """Flush C's stdio buffers (``fflush(NULL)``), where the C library can be reached (not on Windows)."""
    try:
        ctypes.CDLL(None).fflush(None)
    except (OSError, AttributeError, TypeError):
        pass


@contextlib.contextmanager
def silenced_stdout() -> Iterator[None]:
    """The process's standard output (file descriptor 1) sent to the null device, and restored on the way
    out whatever happens, after C's buffers are flushed (so nothing printed inside comes out later). Where
    descriptor 1 cannot be duplicated (closed), nothing is redirected."""
    try:
        saved = os.dup(1)
    except OSError:
        yield
        return
    try:
        sys.stdout.flush()  # what Python and C printed before goes out first
    except (OSError, ValueError, AttributeError):
        pass
    _flush_c_stdio()
    null = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(null, 1)
        yield
    finally:
        _flush_c_stdio()
        os.dup2(saved, 1)
        os.close(saved)
        os.close(null)


def quiet_milp(*args: Any, **kwargs: Any) -> Any:
    """scipy's :func:`~scipy.optimize.milp` (same arguments, same result) with nothing on the standard output:
    HiGHS's MIP solver prints some lines with C's ``printf`` whatever its options say (e.g.
    ``HighsMipSolverData::transformNewIntegerFeasibleSolution tmpSolver.run();``), so descriptor 1 goes to
    the null device while it runs (:func:`silenced_stdout`)."""
    with silenced_stdout():
        return milp(*args, **kwargs)


def budgeted_milp(
    c: np.ndarray,
    constraints: Sequence[LinearConstraint],
    budget_rows: Sequence[tuple[np.ndarray, float]],
    upper: np.ndarray | float = 1.0,
) -> Any:
    """:func:`quiet_milp` over binaries ``x`` in ``[0, upper]``: minimise :func:`exact_objective` of ``c`` under
    ``constraints`` and ``budget_rows`` (``(row, budget)``: ``row @ x <= budget``), every budget met by the
    rounded choice itself. HiGHS accepts a row up to its feasibility tolerance (1e-7) over its bound: each
    budget row is divided by its budget, so that the tolerance is relative, and a choice still over a budget
    is solved again with that budget lowered by a margin (1e-6 of it, or twice the excess; four times more
    at each retry). Returns scipy's result, ``x`` rounded when optimal."""
    scales = [abs(float(b)) or 1.0 for _, b in budget_rows]
    rows = [(np.asarray(r, dtype=np.float64) / s, float(b) / s) for (r, b), s in zip(budget_rows, scales)]
    margins = [0.0] * len(rows)
    over: list[float] = []
    for _ in range(4):
        limits = [LinearConstraint(r[None, :], -np.inf, b - m) for (r, b), m in zip(rows, margins)]
        result = quiet_milp(
            exact_objective(c),
            constraints=[*constraints, *limits],
            integrality=np.ones(len(c)),
            bounds=Bounds(0, upper),
            options=MILP_OPTIONS,
        )
        if result.status != 0 or result.x is None:
            return result
        x = np.round(result.x)
        over = [float(r @ x) - float(b) for r, b in budget_rows]
        if all(o <= 0 for o in over):
            result.x = x
            return result
        margins = [max(4 * m, 2 * o / s, 1e-6) if o > 0 else m for m, o, s in zip(margins, over, scales)]
    raise RuntimeError(f"the MILP solver's choices stay over the budgets (by {over}) after 4 tries")


def exact_objective(c: np.ndarray) -> np.ndarray:
    """The objective scaled so that its largest magnitude is 1e6: HiGHS's absolute gap (1e-6) is then 1e-12 of
    it, so sums of small sensitivities (KL per token of slight cuts) are told apart."""
    top = float(np.max(np.abs(c))) if c.size else 0.0
    return c * (1e6 / top) if top > 0 else c


def _front(sensitivity: Sequence[float], costs: Sequence[Sequence[float]]) -> list[int]:
    """The candidates of one group that no other dominates (as sensitive or less, costing as much or less in every
    budget; of equal ones the first): an optimal choice is made of them alone. A group of thousands of
    candidates (a GDN layer's grid) keeps tens, and the MILP shrinks with it."""
    values = np.column_stack(
        [np.asarray(sensitivity, dtype=np.float64), *(np.asarray(c, np.float64) for c in costs)]
    )
    n = len(values)
    kept = np.ones(n, dtype=bool)
    order = np.lexsort(values.T[::-1])  # by sensitivity, then by the costs: a dominator comes first
    for start in range(0, n, 512):
        block = order[start : start + 512]
        # candidate i (of this block) is dominated by an earlier one in the order that is <= in every value
        earlier = values[order][None, :, :] <= values[block][:, None, :]
        dominated = earlier.all(-1) & (np.arange(n)[None, :] < (start + np.arange(len(block)))[:, None])
        kept[block] = ~dominated.any(1)
    return [int(i) for i in np.flatnonzero(kept)]


def choose(
    sensitivity: Sequence[Sequence[float]],
    costs: Mapping[str, Sequence[Sequence[float]]],
    budgets: Mapping[str, float],
    *,
    exclude: Sequence[Sequence[int]] = (),
) -> list[int]:
    """The candidate index of every layer that minimises the summed sensitivity within ``budgets``.

    Args:
        sensitivity: per layer, one value per candidate (e.g. the KL divergence when that layer alone is cut).
        costs: per budget name, per layer, one cost per candidate (e.g. kept parameters).
        budgets: budget name -> the most the chosen candidates may cost in all (names as in ``costs``).
        exclude: choices (a candidate index per layer) that may not be returned: each is cut off by one
            no-good constraint (at most ``layers - 1`` of its binaries set), so the k-th call with the k - 1
            choices before excluded gives the k-th best choice (:func:`choose_pool`).

    Raises:
        BudgetError: no choice meets the budgets (the message gives the least each budget can reach).
    """

    _check(sensitivity, costs)
    if not exclude:  # the optimum never needs a dominated candidate: solve over each group's front
        fronts = [_front(sensitivity[g], [costs[b][g] for b in budgets]) for g in range(len(sensitivity))]
        if sum(map(len, fronts)) < sum(map(len, sensitivity)):
            reduced = choose(
                [[sensitivity[g][i] for i in front] for g, front in enumerate(fronts)],
                {b: [[costs[b][g][i] for i in front] for g, front in enumerate(fronts)] for b in budgets},
                budgets,
            )
            return [front[p] for front, p in zip(fronts, reduced)]
    sizes = [len(layer) for layer in sensitivity]
    n = sum(sizes)
    starts = np.cumsum([0] + sizes[:-1])
    one_each = np.zeros((len(sizes), n))
    for layer, (start, size) in enumerate(zip(starts, sizes)):
        one_each[layer, start : start + size] = 1
    constraints = [LinearConstraint(one_each, 1, 1)]
    budget_rows = [
        (np.concatenate([np.asarray(layer, dtype=np.float64) for layer in costs[name]]), budget)
        for name, budget in budgets.items()
    ]
    for picks in exclude:
        constraints.append(no_good_cut(picks, starts, n))
    c = np.concatenate([np.asarray(layer, dtype=np.float64) for layer in sensitivity])
    result = budgeted_milp(c, constraints, budget_rows)
    if result.status == 2 or result.x is None:  # infeasible
        raise BudgetError(f"no plan meets the budgets: {_minimum(costs, budgets)}")
    if result.status != 0:
        raise RuntimeError(f"the MILP solver stopped without an optimum: {result.message}")
    x = np.round(result.x).astype(int)
    return [int(np.flatnonzero(x[start : start + size])[0]) for start, size in zip(starts, sizes)]


def no_good_cut(
    picks: Sequence[int | None], starts: Sequence[int] | np.ndarray, n: int, extra: int = 0
) -> LinearConstraint:
    """The constraint that cuts one choice off a multiple-choice MILP whose group ``g``'s binaries start at
    ``starts[g]`` (``n`` of them, then ``extra`` more variables): at most ``len(picks) - 1`` of the choice's
    binaries set. ``picks[g]`` None: the group has no binary set in the choice (its layer removed; the
    caller adds the removal's own binary, see :func:`gdnprune.plan.choose.depth.choose_with_removal`)."""
    row = np.zeros(n + extra)
    chosen = [start + p for start, p in zip(starts, picks) if p is not None]
    row[chosen] = 1
    return LinearConstraint(row[None, :], -np.inf, len(chosen) - 1)


def choose_among(
    sensitivity: Sequence[Sequence[float]],
    costs: Mapping[str, Sequence[Sequence[float]]],
    budgets: Mapping[str, float],
    allowed: Sequence[Sequence[bool] | np.ndarray] | None = None,
    *,
    exclude: Sequence[Sequence[int]] = (),
) -> list[int]:
    """:func:`choose` over the candidates ``allowed[l][c]`` only (all when None); indices into the full lists.
    ``exclude``: choices not to return (as :func:`choose`; indices into the full lists)."""
    if allowed is None:
        return choose(sensitivity, costs, budgets, exclude=exclude)
    keep = [[c for c, ok in enumerate(layer) if ok] for layer in allowed]
    if any(not k for k in keep):
        raise ValueError("every layer needs at least one allowed candidate")
    position = [{c: i for i, c in enumerate(k)} for k in keep]
    reachable = [picks for picks in exclude if all(p in at for p, at in zip(picks, position))]
    picks = choose(
        [[sensitivity[g][c] for c in k] for g, k in enumerate(keep)],
        {name: [[table[g][c] for c in k] for g, k in enumerate(keep)] for name, table in costs.items()},
        budgets,
        exclude=[[at[p] for p, at in zip(picks, position)] for picks in reachable],
    )
    return [k[p] for k, p in zip(keep, picks)]


def choose_pool(
    sensitivity: Sequence[Sequence[float]],
    costs: Mapping[str, Sequence[Sequence[float]]],
    budgets: Mapping[str, float],
    count: int,
    allowed: Sequence[Sequence[bool] | np.ndarray] | None = None,
) -> list[list[int]]:
    """The ``count`` best distinct choices, best first (fewer when fewer meet the budgets): a solution pool
    made by solving again with every choice found so far excluded (:func:`choose_among`'s ``exclude``).

    Raises:
        BudgetError: no choice meets the budgets.
    """
    pool: list[list[int]] = []
    while len(pool) < count:
        try:
            pool.append(choose_among(sensitivity, costs, budgets, allowed, exclude=pool))
        except BudgetError:
            if not pool:
                raise
            break
    return pool


def _uniform_table(
    keys: Sequence[Sequence[object]],
    sensitivity: Sequence[Sequence[float]] | None,
    costs: Mapping[str, Sequence[Sequence[float]]],
    kinds: Sequence[str] | None,
) -> list[dict]:
    """Per kind (in order of first appearance): its groups, the geometries all of them have (in the first
    group's order), and per geometry the summed sensitivity and costs over the kind's groups."""
    kinds = [""] * len(keys) if kinds is None else list(kinds)
    if len(kinds) != len(keys):
        raise ValueError(
            f"`kinds` must name the kind of every group: {len(kinds)} kinds for {len(keys)} groups"
        )
    index = [{key: c for c, key in enumerate(group)} for group in keys]
    table = []
    for kind in dict.fromkeys(kinds):
        members = [g for g, k in enumerate(kinds) if k == kind]
        common = [key for key in keys[members[0]] if all(key in index[g] for g in members)]
        if not common:
            raise ValueError(
                f"the {kind + ' ' if kind else ''}groups share no candidate geometry, so they cannot "
                f"all take the same one (a uniform plan)"
            )
        picks = [[index[g][key] for g in members] for key in common]  # per geometry: its index in every group
        table.append(
            {
                "kind": kind,
                "groups": members,
                "keys": common,
                "picks": picks,
                "sensitivity": None
                if sensitivity is None
                else [float(sum(sensitivity[g][c] for g, c in zip(members, p))) for p in picks],
                "costs": {
                    name: [float(sum(costs[name][g][c] for g, c in zip(members, p))) for p in picks]
                    for name in costs
                },
            }
        )
    return table


def _spread(table: Sequence[dict], choice: Sequence[int], n: int) -> list[int]:
    """One geometry per kind (``choice[k]``: an index into kind ``k``'s common geometries) -> per-group picks."""
    picks = [0] * n
    for entry, j in zip(table, choice):
        for g, c in zip(entry["groups"], entry["picks"][j]):
            picks[g] = c
    return picks


def choose_uniform(
    keys: Sequence[Sequence[object]],
    sensitivity: Sequence[Sequence[float]],
    costs: Mapping[str, Sequence[Sequence[float]]],
    budgets: Mapping[str, float],
    *,
    kinds: Sequence[str] | None = None,
) -> list[int]:
    """Like :func:`choose`, but every group of one kind takes the same geometry: ``keys[g][c]`` names candidate
    ``c`` of group ``g`` (e.g. its target shape), ``kinds[g]`` the group's kind (``"gdn"``, ``"mlp"``, ...;
    None: all groups one kind). Only geometries every group of a kind has are tried. Exact: the kinds'
    geometries, each with its groups' summed sensitivity and costs, are a multiple-choice knapsack with one
    choice per kind, solved by :func:`choose`.

    Raises:
        ValueError: the groups of a kind share no geometry.
        BudgetError: no combination of one geometry per kind meets the budgets.
    """
    _check(sensitivity, costs)
    table = _uniform_table(keys, sensitivity, costs, kinds)
    try:
        choice = choose(
            [e["sensitivity"] for e in table],
            {name: [e["costs"][name] for e in table] for name in costs},
            budgets,
        )
    except BudgetError:
        least = "; ".join(
            f"{name}: at least {sum(min(e['costs'][name]) for e in table):,.0f} needed, budget "
            f"{budgets[name]:,.0f}"
            for name in budgets
        )
        raise BudgetError(f"no single geometry per kind of block meets the budgets ({least})") from None
    return _spread(table, choice, len(keys))


def _sizes(shape: object) -> tuple | None:
    """The nested sizes of a geometry (a smaller geometry is a nested prefix when no size is larger), or None."""

    if isinstance(shape, GDNShape):
        return (shape.num_key_heads, shape.value_heads_per_group, shape.key_head_dim, shape.value_head_dim)
    if isinstance(shape, (int, float)) and not isinstance(shape, bool):
        return (shape,)
    return None


def nested_in(small: object, large: object) -> bool:
    """Whether geometry ``small`` is a nested prefix of ``large`` (``large`` keeps all of it, and more or as
    much): GDN shapes by key heads, lanes and head dims; sub-block shapes by their ``fits``; numbers by size;
    anything else only when equal."""
    if small == large:
        return True
    if hasattr(large, "fits") and type(small) is type(large):
        return not large.fits(small)
    a, b = _sizes(small), _sizes(large)
    return a is not None and b is not None and len(a) == len(b) and all(x <= y for x, y in zip(a, b))


#: the most combinations :func:`uniform_choices` enumerates
MAX_COMBINATIONS = 20_000_000


def uniform_choices(
    keys: Sequence[Sequence[object]],
    costs: Mapping[str, Sequence[Sequence[float]]],
    budgets: Mapping[str, float],
    *,
    kinds: Sequence[str] | None = None,
    maximal: bool = True,
) -> list[list[int]]:
    """Every uniform plan that meets the budgets: per-group picks, one geometry per kind (as in
    :func:`choose_uniform`), in the order of the kinds' common geometries (the first kind's slowest).

    With ``maximal`` (the default) only the maximal ones: a combination is maximal when no single kind can
    take a strictly larger geometry (one its current geometry is a nested prefix of, :func:`nested_in`) and
    still meet every budget. Every feasible combination is at most as good as some maximal one when a cut
    never lowers the sensitivity, so these are the uniform candidates worth evaluating.

    Raises:
        ValueError: the groups of a kind share no geometry, or more than :data:`MAX_COMBINATIONS`
            combinations (a coarser grid will do).
    """
    zeros = [[0.0] * len(group) for group in keys]
    _check(zeros, costs)
    table = _uniform_table(keys, None, costs, kinds)
    sizes = [len(e["keys"]) for e in table]
    if int(np.prod(sizes, dtype=np.float64)) > MAX_COMBINATIONS:
        raise ValueError(
            f"{' x '.join(map(str, sizes))} uniform combinations are too many to list (at most "
            f"{MAX_COMBINATIONS:,}): use a coarser grid"
        )
    feasible = np.ones(sizes, dtype=bool)
    for name, budget in budgets.items():
        total = np.zeros(sizes)
        for axis, entry in enumerate(table):
            shape = [1] * len(sizes)
            shape[axis] = sizes[axis]
            total = total + np.asarray(entry["costs"][name]).reshape(shape)
        feasible &= total <= budget
    keep = feasible.copy()
    if maximal:
        for axis, entry in enumerate(table):
            for j, key in enumerate(entry["keys"]):
                larger = [
                    i
                    for i, other in enumerate(entry["keys"])
                    if i != j and nested_in(key, other) and other != key
                ]
                if larger:
                    grows = np.take(feasible, larger, axis=axis).any(axis=axis)
                    index: list[slice | int] = [slice(None)] * len(sizes)
                    index[axis] = j
                    keep[tuple(index)] &= ~grows
    return [_spread(table, choice, len(keys)) for choice in zip(*(a.tolist() for a in np.nonzero(keep)))]
