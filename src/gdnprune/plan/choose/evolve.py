"""The evolutionary search over whole plans: a (1 + lambda) evolution, past the additive assumption.

The exact choice (:mod:`.solve`) minimises the *sum* of per-layer sensitivities, each measured with one
layer cut alone; the damage of a whole plan is not that sum (it grows faster, and not monotonically).
Following EvoPress (Sieberling et al., ICML 2025), :func:`evolve` starts from a plan (the exact choice)
and improves it by measuring whole plans: every generation makes ``offspring`` mutants of the current plan,
keeps the best few on the first windows of the calibration set, then the best of those on every window,
and takes it only when it beats the current plan on every window. So the result is never worse than the
seed on that measure, and the search is deterministic for a seed.

A plan is one candidate index per layer. The search knows nothing about what a candidate is: it sees each
layer's list of candidates only through their costs on every budget (``costs[name][layer][candidate]``),
so any per-layer candidate list (GDN widths today; MLP, attention, expert or depth candidates later) plugs
in unchanged, with the fitness (:func:`gdnprune.plan.measure.joint.evolve_plan`) building the cut model. A
mutation moves width between layers: one layer steps to a nearby larger or smaller candidate (ordered by
their share of the budgets), another layer gives back or takes up what that needs, and every budget holds
after every mutation. The serving constraints (``--tp``, ``--multiple-of``) hold because only listed
candidates are ever used. No torch here.

Depth (issue 23): with ``layer_of`` (the decoder layer of every group) and ``removable`` (the layers that may
go), a plan marks every group of a removed layer with :data:`REMOVED` (it costs nothing), and a quarter of
the mutations move between depth and width: a kept layer is removed and what it frees goes to another
group, or a removed layer comes back (its groups at their smallest candidates) and other groups shrink to
pay for it. At least one layer always stays.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import cast

import numpy as np

__all__ = ["REMOVED", "feasible", "mutate", "evolve", "stages"]

#: the pick of every group of a removed decoder layer
REMOVED = -1

Fitness = Callable[[Sequence[Sequence[int]], int, int], Sequence[Sequence[float]]]


def feasible(
    picks: Sequence[int], costs: Mapping[str, Sequence[Sequence[float]]], budgets: Mapping[str, float]
) -> bool:
    """Whether the plan ``picks`` (a candidate index per layer, :data:`REMOVED` costing nothing) meets every
    budget."""
    return all(
        sum(costs[name][layer][c] for layer, c in enumerate(picks) if c != REMOVED) <= limit
        for name, limit in budgets.items()
    )


def _sizes(costs: Mapping[str, Sequence[Sequence[float]]], budgets: Mapping[str, float]) -> list[np.ndarray]:
    """Each candidate's share of the budgets (summed over the budgets): the order a mutation steps along."""
    layers = len(next(iter(costs.values())))
    return [
        cast(  # an array with any budget (sum's start, 0, only without one)
            np.ndarray,
            sum(
                np.asarray(costs[name][layer], dtype=np.float64) / max(float(limit), 1e-300)
                for name, limit in budgets.items()
            ),
        )
        for layer in range(layers)
    ]


def mutate(
    picks: Sequence[int],
    costs: Mapping[str, Sequence[Sequence[float]]],
    budgets: Mapping[str, float],
    rng: np.random.Generator,
    *,
    reach: int = 3,
    layer_of: Sequence[int] | None = None,
    removable: Sequence[int] = (),
    keep_one_of: Sequence[int] = (),
) -> list[int] | None:
    """One mutation of a feasible plan: layer ``a`` steps up to ``reach`` places along its candidates ordered
    by size; when that breaks a budget, another layer shrinks to its largest candidate that restores every
    budget; when it frees budget, another layer grows to its largest candidate that still fits. With
    ``removable`` decoder layers (``layer_of``: the decoder layer of every group), a quarter of the mutations
    remove one of them or bring it back (:func:`_depth_move`; one layer of ``keep_one_of`` always stays). Returns the new plan (meeting every budget), or
    None when this draw found no such move."""
    sizes = _sizes(costs, budgets)
    if removable and rng.random() < 0.25:
        return _depth_move(picks, costs, budgets, sizes, rng, layer_of, removable, keep_one_of)
    kept = [g for g, c in enumerate(picks) if c != REMOVED]
    new = list(picks)
    a = int(kept[int(rng.integers(len(kept)))]) if len(kept) < len(picks) else int(rng.integers(len(picks)))
    order = np.argsort(sizes[a], kind="stable")
    pos = int(np.flatnonzero(order == picks[a])[0])
    steps = [s for s in range(-reach, reach + 1) if s and 0 <= pos + s < len(order)]
    if not steps:
        return None
    step = int(steps[int(rng.integers(len(steps)))])
    new[a] = int(order[pos + step])
    others = [int(b) for b in rng.permutation(len(picks)) if b != a and new[b] != REMOVED]
    if not feasible(new, costs, budgets):  # take the difference from another layer
        return _shrink_another(new, others, costs, budgets, sizes)
    if step < 0 and others:  # give what was freed to another layer
        return _grow(new, others[0], costs, budgets, sizes)
    return new


def _shrink_another(new: list[int], others: Sequence[int], costs, budgets, sizes) -> list[int] | None:
    """``new`` with one of ``others`` shrunk to its largest candidate that meets every budget, or None."""
    for b in others:
        smaller = [c for c in np.argsort(-sizes[b], kind="stable") if sizes[b][c] < sizes[b][new[b]]]
        for c in smaller:
            trial = new[:b] + [int(c)] + new[b + 1 :]
            if feasible(trial, costs, budgets):
                return trial
    return None


def _grow(new: list[int], b: int, costs, budgets, sizes) -> list[int]:
    """``new`` with group ``b`` grown to its largest candidate that still meets every budget (or as it is)."""
    for c in np.argsort(-sizes[b], kind="stable"):
        if sizes[b][c] <= sizes[b][new[b]]:
            break
        trial = new[:b] + [int(c)] + new[b + 1 :]
        if feasible(trial, costs, budgets):
            return trial
    return new


def _depth_move(picks, costs, budgets, sizes, rng, layer_of, removable, keep_one_of=()) -> list[int] | None:
    """Remove a kept layer of ``removable`` (what it frees goes to another group) or bring a removed one back
    (its groups at their smallest candidates, another group shrinking when a budget needs it)."""
    layer = int(removable[int(rng.integers(len(removable)))])
    mine = [g for g, owner in enumerate(layer_of) if owner == layer]
    new = list(picks)
    others = [int(b) for b in rng.permutation(len(picks)) if layer_of[b] != layer and picks[b] != REMOVED]
    if picks[mine[0]] != REMOVED:
        if not others:  # the last layer stays
            return None
        gone = {layer_of[g] for g, p in enumerate(picks) if p == REMOVED} | {layer}
        if keep_one_of and set(keep_one_of) <= gone:  # and one of these (a full-attention layer)
            return None
        for g in mine:
            new[g] = REMOVED
        return _grow(new, others[0], costs, budgets, sizes)
    for g in mine:
        new[g] = int(np.argmin(sizes[g]))
    return new if feasible(new, costs, budgets) else _shrink_another(new, others, costs, budgets, sizes)


def stages(windows: int, offspring: int) -> list[tuple[int, int]]:
    """``(windows, survivors)`` of each selection stage: every offspring on a quarter of the windows, the best
    quarter of them on every window, the best one of those kept."""
    if windows >= 4 and offspring >= 4:
        return [(math.ceil(windows / 4), math.ceil(offspring / 4)), (windows, 1)]
    return [(windows, 1)]


def _offspring(
    parent: list[int],
    costs: Mapping[str, Sequence[Sequence[float]]],
    budgets: Mapping[str, float],
    rng: np.random.Generator,
    offspring: int,
    mutations: int,
    layer_of: Sequence[int] | None,
    removable: Sequence[int],
    keep_one_of: Sequence[int],
) -> list[list[int]]:
    """Up to ``offspring`` distinct plans within the budgets, each ``parent`` after 1 to ``mutations``
    mutations (:func:`mutate`; at most 50 tries per offspring)."""
    children: list[list[int]] = []
    for _ in range(50 * offspring):
        child = parent
        for _ in range(int(rng.integers(1, mutations + 1))):
            child = (
                mutate(
                    child,
                    costs,
                    budgets,
                    rng,
                    layer_of=layer_of,
                    removable=removable,
                    keep_one_of=keep_one_of,
                )
                or child
            )
        if child != parent and child not in children:
            children.append(child)
        if len(children) == offspring:
            break
    return children


def evolve(
    costs: Mapping[str, Sequence[Sequence[float]]],
    budgets: Mapping[str, float],
    seed_picks: Sequence[int],
    fitness: Fitness,
    weights: Sequence[float],
    *,
    generations: int,
    offspring: int = 8,
    seed: int = 0,
    mutations: int = 2,
    on_generation: Callable[[dict], None] | None = None,
    layer_of: Sequence[int] | None = None,
    removable: Sequence[int] = (),
    keep_one_of: Sequence[int] = (),
) -> dict:
    """Improve the plan ``seed_picks`` by whole-plan fitness; returns the best plan found and the history.

    Args:
        costs, budgets: as :func:`~gdnprune.plan.choose.solve.choose`; the seed must meet the budgets.
        fitness: ``fitness(plans, lo, hi)`` -> per plan, the loss (e.g. KL per token) of each calibration
            window ``lo..hi-1``.
        weights: the weight of every calibration window (its tokens); a plan's fitness on windows ``0..n-1``
            is the weighted mean of theirs.
        generations, offspring: the search's length and the mutants tried per generation (lambda).
        seed: the random seed (the search is deterministic for a seed and a deterministic fitness).
        mutations: at most this many mutations make one offspring (drawn uniformly from 1 ..).
        on_generation: called with every generation's record.
        layer_of, removable: the decoder layer of every group and the layers that may be removed (their groups'
            picks :data:`REMOVED` in a plan; ``seed_picks`` may hold removed layers already); ``keep_one_of``:
            layers of which one always stays (a hybrid model's full-attention layers).

    Returns:
        ``{"picks", "population", "kl", "seed_kl", "history": [per generation: "kl" (the current plan's, all
        windows), "best_offspring_kl", "accepted"], "evaluations"}`` (window forwards of whole plans;
        ``population``: every distinct plan measured on every window, best first).
    """
    if not feasible(seed_picks, costs, budgets):
        raise ValueError("the evolutionary search's seed plan does not meet the budgets")
    if generations < 0 or offspring < 1:
        raise ValueError(
            f"the evolutionary search needs generations >= 0 and offspring >= 1, got {generations}, {offspring}"
        )
    window_weights = np.asarray(weights, dtype=np.float64)
    total = len(window_weights)
    rng = np.random.default_rng(seed)
    evaluations = 0

    def mean(values, n):
        return float(
            (np.asarray(values[:n]) * window_weights[:n]).sum() / max(window_weights[:n].sum(), 1e-300)
        )

    parent = [int(p) for p in seed_picks]
    per_window = {tuple(parent): np.asarray(fitness([parent], 0, total)[0], dtype=np.float64)}
    evaluations += total
    seed_kl = best_kl = mean(per_window[tuple(parent)], total)
    history = []
    for generation in range(generations):
        children = _offspring(
            parent, costs, budgets, rng, offspring, mutations, layer_of, removable, keep_one_of
        )
        best_child, best_child_kl = None, math.inf
        pool = children
        for n, keep in stages(total, len(children)) if children else []:
            todo = [c for c in pool if len(per_window.get(tuple(c), ())) < n]
            for child in todo:
                per_window.setdefault(tuple(child), np.zeros(0))
            if todo:
                lo = min(len(per_window[tuple(c)]) for c in todo)
                values = fitness(todo, lo, n)
                evaluations += len(todo) * (n - lo)
                for child, v in zip(todo, values):
                    have = per_window[tuple(child)][:lo]
                    per_window[tuple(child)] = np.concatenate([have, np.asarray(v, dtype=np.float64)])
            ranked = sorted(range(len(pool)), key=lambda i: (mean(per_window[tuple(pool[i])], n), i))
            pool = [pool[i] for i in ranked[:keep]]
            if n == total:
                best_child, best_child_kl = pool[0], mean(per_window[tuple(pool[0])], total)
        accepted = best_child is not None and best_child_kl < best_kl
        if accepted:
            assert best_child is not None  # accepted only with a best offspring
            parent, best_kl = best_child, best_child_kl
        record = {
            "generation": generation + 1,
            "kl": best_kl,
            "best_offspring_kl": best_child_kl if best_child is not None else None,
            "accepted": accepted,
            "evaluations": evaluations,
        }
        history.append(record)
        if on_generation is not None:
            on_generation(record)
    measured = [
        (mean(v, total), i, list(p)) for i, (p, v) in enumerate(per_window.items()) if len(v) == total
    ]
    return {
        "picks": parent,
        "population": [p for _, _, p in sorted(measured)],
        "kl": best_kl,
        "seed_kl": seed_kl,
        "history": history,
        "evaluations": evaluations,
    }
