"""The estimates and bounds successive halving decides on, from KL measured on some windows (numpy only).

A candidate measured on the first ``n`` calibration windows has a partial mean (:func:`prefix_means`);
:func:`optimistic` turns it into a lower estimate of its mean over every window with a lower bound on the
ratio "mean on every window / mean on the same first windows" of the candidates already measured in full
(:func:`ratio_bound`). :func:`front`, :func:`near` and :func:`dominated` say which candidates of a layer can
still matter; :func:`budget_tables` and :func:`feasible` which ones any plan within the budgets can hold.
:mod:`gdnprune.plan.measure.halving` runs the procedure on them.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np


def near(sizes: np.ndarray, alive: np.ndarray, pick: int | None, keep: int) -> np.ndarray:
    """The ``keep`` alive candidates nearest to ``pick`` in the order of ``sizes`` (the pick included); ``pick``
    None (the layer removed, size 0): the ``keep`` smallest."""
    order = [int(c) for c in np.argsort(sizes, kind="stable") if alive[c]]
    pos = 0 if pick is None else order.index(pick)
    ranked = sorted(range(len(order)), key=lambda k: (abs(k - pos), -k))
    out = np.zeros_like(alive)
    out[[order[k] for k in ranked[:keep]]] = True
    return out


def dominated(
    kl: np.ndarray, costs: np.ndarray, alive: np.ndarray, *, z: float = 2.0, floor: float = 0.02
) -> np.ndarray:
    """Which alive candidates another alive candidate dominates, beyond the noise.

    Args:
        kl: [candidates, windows] per-window KL of every candidate on the same windows.
        costs: [candidates, budgets] what each candidate costs on every budget in play.
        alive: [candidates] bool, the candidates still in the race.
        z: paired standard errors (over the windows) by which the dominator must be better.
        floor: and by at least this share of the dominated candidate's KL.

    Returns:
        [candidates] bool: ``a`` is dominated when some alive ``b != a`` costs no more than ``a`` on every
        budget and ``mean(kl[a] - kl[b]) > max(z * se, floor * mean(kl[a]))``.
    """
    n, w = kl.shape
    out = np.zeros(n, dtype=bool)
    mean = kl.mean(1)
    for a in np.flatnonzero(alive):
        cheaper = alive & np.all(costs <= costs[a], axis=1)
        cheaper[a] = False
        for b in np.flatnonzero(cheaper):
            d = kl[a] - kl[b]
            se = d.std(ddof=1) / math.sqrt(w) if w > 1 else 0.0
            if d.mean() > max(z * se, floor * mean[a]):
                out[a] = True
                break
    return out


def prefix_means(kl: np.ndarray, seen: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """Every candidate's mean KL (``weights``: tokens per window) over the windows it was measured on (its
    first ``seen[c]``)."""
    cum = np.cumsum(kl * weights, axis=1)
    den = np.cumsum(weights)
    n = np.maximum(seen, 1) - 1
    return cum[np.arange(len(seen)), n] / np.maximum(den[n], 1e-300)


def optimistic(
    kl: Sequence[np.ndarray],
    seen: Sequence[np.ndarray],
    full: Sequence[np.ndarray],
    weights: np.ndarray,
    slack: float = 0.0,
    confidence: float | None = None,
    per_layer: bool = False,
) -> list[np.ndarray]:
    """Per layer, every candidate's KL: exact when measured on every window; else its mean on the windows
    it saw times the lowest ratio ``mean on every window / mean on the same first windows`` of the candidates
    measured on every window (of any layer): an optimistic (lower) estimate of its KL on every window.

    The windows' difficulty is shared: a hard first window raises every candidate's KL on it alike, so the
    ratio of a candidate measured in full says how far a partial mean can be off; the lowest one bounds it
    from below (1 where no candidate is measured in full yet); ``slack`` lowers it by that share more;
    ``confidence``: :func:`ratio_bound`'s. ``per_layer``: the ratios of the candidates of the same layer
    only, once at least 3 of them are measured in full (a window's difficulty differs from layer to layer:
    on olmo_hybrid, in one window order, the median ratio after one window is 1.24 on one layer and 0.86 on
    the other)."""
    total = len(weights)
    done = [(s >= total) & ~f for s, f in zip(seen, full)]
    ratios: dict[tuple[int, int], float] = {}
    out = []
    for li, (k, s, f) in enumerate(zip(kl, seen, full)):
        mean = prefix_means(k, s, weights)
        low = np.array(mean)
        for c in np.flatnonzero((s < total) & ~f):
            n = int(s[c])
            if (-1, n) not in ratios:
                ratios[-1, n] = ratio_bound(_ratios(kl, done, weights, n), confidence)
            key = (li if per_layer else -1, n)
            if key not in ratios:
                own = _ratios([k], [done[li]], weights, n)
                ratios[key] = ratio_bound(own, confidence) if len(own) >= 3 else ratios[-1, n]
            low[c] = mean[c] * ratios[key] * (1.0 - slack)
        low[f] = 0.0
        out.append(low)
    return out


def _ratios(kl: Sequence[np.ndarray], done: Sequence[np.ndarray], weights: np.ndarray, n: int) -> np.ndarray:
    """``mean on every window / mean on the first n`` of every candidate measured in full (``done``)."""
    out = []
    for k, d in zip(kl, done):
        rows = k[d]
        head = (rows[:, :n] * weights[:n]).sum(1) / max(weights[:n].sum(), 1e-300)
        whole = (rows * weights).sum(1) / max(weights.sum(), 1e-300)
        ok = head > 0
        out.append(whole[ok] / head[ok])
    return np.concatenate(out) if out else np.zeros(0)


def ratio_bound(ratios: np.ndarray, confidence: float | None = None) -> float:
    """A lower bound on a new candidate's ratio ``mean on every window / mean on its first windows``, from the
    ratios of the candidates measured in full: their lowest (``confidence`` None; 1 when there is none);
    else also at most the lower prediction bound ``exp(m - confidence * s * sqrt(1 + 1/k))`` of the log-ratios
    (mean ``m``, standard deviation ``s`` over the ``k`` candidates, at least 3 of them): a candidate not yet
    measured lies below the lowest one seen so far more often the fewer have been seen."""
    best = min(1.0, float(ratios.min())) if len(ratios) else 1.0
    if confidence is None or len(ratios) < 3:
        return best
    logs = np.log(ratios[ratios > 0])
    spread = float(logs.std(ddof=1)) * math.sqrt(1.0 + 1.0 / len(logs))
    return min(best, math.exp(float(logs.mean()) - confidence * spread))


def front(estimate: np.ndarray, table: np.ndarray, among: np.ndarray | None = None) -> np.ndarray:
    """[candidates] bool: no other candidate (of ``among``, default all; the others are not on it) costs no
    more on every budget (``table``: [candidates, budgets]) and has a lower ``estimate``."""
    if among is not None:
        estimate = np.where(among, estimate, np.inf)
    cheaper = np.all(table[None, :, :] <= table[:, None, :], axis=2)  # [a, b]: b costs no more than a
    on = ~np.any(cheaper & (estimate[None, :] < estimate[:, None]), axis=1)
    return on if among is None else on & among


def budget_tables(
    costs: Mapping[str, Sequence[Sequence[float]]], budgets: Mapping[str, float], counts: Sequence[int]
) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Per layer (``counts``: its candidates), ``[candidates, budgets]`` costs on the budgets in play, and
    every candidate's size: its summed share of the budgets."""
    names = list(budgets)
    tables = [
        np.array([[costs[name][li][c] for name in names] for c in range(n)], dtype=np.float64).reshape(
            n, len(names)
        )
        for li, n in enumerate(counts)
    ]
    scale = np.array([1.0 / max(float(budgets[name]), 1e-300) for name in names])
    return tables, [t @ scale for t in tables]


def feasible(
    tables: Sequence[np.ndarray], budgets: Mapping[str, float], cheapest: bool = True
) -> list[np.ndarray]:
    """Per layer, [candidates] bool: the candidates some choice within the budgets can hold (``tables``: as
    :func:`budget_tables`, on the budgets in that order): on every budget, its cost plus the other layers'
    cheapest candidates' is within it (``cheapest`` False: the others' costs counted as 0, for a choice that
    may remove a layer). Exact: no choice holds a candidate this drops, so it is never measured."""
    limits = np.array([float(v) for v in budgets.values()])
    least = [t.min(0) if cheapest and len(t) else np.zeros(len(limits)) for t in tables]
    total = np.sum(least, axis=0) if least else np.zeros(len(limits))
    slack = 1e-9 * np.maximum(np.abs(limits), 1.0)
    return [np.all(t + (total - m) <= limits + slack, axis=1) for t, m in zip(tables, least)]


def merged_choice(
    values: Sequence[np.ndarray],
    tables: Sequence[np.ndarray],
    limits: np.ndarray,
    among: Sequence[np.ndarray] | None = None,
    max_states: int = 4096,
) -> list[int] | None:
    """The choice of one candidate per layer (of ``among``, default all) with the least summed ``values``
    whose summed costs (``tables``: [candidates, budgets] per layer) are within ``limits`` on every budget:
    the MILP's exact choice, found by merging the layers' :func:`front` one layer at a time and keeping only
    the partial choices no other one beats on every cost and on the sum (a beaten partial choice is never
    part of the best choice: swapping it for the one that beats it keeps the budgets and lowers the sum).

    On a few layers with fronts of tens of candidates (successive halving's dozens of choices per plan) this
    takes milliseconds where the MILP takes a tenth of a second. Returns None where no choice is within the
    limits or the partial choices outgrow ``max_states`` (many layers, several budgets): the caller then
    solves the MILP, which says why."""
    count = len(values)
    budgets = len(limits)
    slack = 1e-9 * np.maximum(np.abs(limits), 1.0)
    if among is None:
        allowed = [np.ones(len(v), dtype=bool) for v in values]
    else:
        allowed = [np.asarray(a, dtype=bool) for a in among]
    if any(not a.any() for a in allowed):
        return None
    least = [t[a].min(0) for t, a in zip(tables, allowed)]
    rest = [np.sum(least[li + 1 :], axis=0) if li + 1 < count else np.zeros(budgets) for li in range(count)]
    cost, total, picks = np.zeros((1, budgets)), np.zeros(1), np.zeros((1, 0), dtype=np.int64)
    for li in range(count):
        value = np.asarray(values[li], dtype=np.float64)
        idx = np.flatnonzero(front(value, tables[li], allowed[li]))
        cost = (cost[:, None, :] + tables[li][idx][None, :, :]).reshape(-1, budgets)
        total = (total[:, None] + value[idx][None, :]).reshape(-1)
        picks = np.concatenate(
            [np.repeat(picks, len(idx), axis=0), np.tile(idx, len(picks))[:, None]], axis=1
        )
        fits = np.all(cost + rest[li] <= limits + slack, axis=1)
        cost, total, picks = cost[fits], total[fits], picks[fits]
        if not len(total):
            return None
        if budgets <= 1:  # cheapest first; a partial choice stays if its sum is below every cheaper one's
            order = np.lexsort((total, cost[:, 0] if budgets else np.zeros(len(total))))
            best = np.minimum.accumulate(total[order])
            keep = order[np.concatenate([[True], total[order][1:] < best[:-1]])]
        elif len(total) <= max_states:  # pairwise: [states, states, budgets]
            keep = np.flatnonzero(front(total, cost))
        else:
            return None
        cost, total, picks = cost[keep], total[keep], picks[keep]
        if len(total) > max_states:
            return None
    return [int(p) for p in picks[int(np.argmin(total))]]
