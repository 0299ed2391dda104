"""Successive halving: the measured sensitivity of the candidates that can matter, at a fraction of the cost.

The exact choice (:mod:`.solve`) only ever needs each layer's *Pareto front*: a candidate that costs no
less than another one on every budget and has a higher KL is never chosen (swapping it for the other one
keeps every budget and lowers the sum). So the full measurement (:func:`.sensitivity.measured_sensitivity`,
every candidate on every calibration window) spends most of its forwards on candidates that cannot win.

A candidate that no choice within the budgets can hold (its cost plus the other layers' cheapest is over a
budget: :func:`feasible`) is never measured. Every other candidate of every layer is first measured on a few
calibration windows (one window per forward, from the layer's cached input, as the full measurement runs its
batches; on 2 windows or fewer, on all of them at once: nothing to save, :func:`rungs`). Then, rung by
rung:

* a candidate is dropped when another one of the same layer *dominates* it — costs no more on any budget
  in play and has a lower KL on the same windows by more than ``z`` paired standard errors (and by more
  than a small share of its KL) — (:func:`dominated`);
* the exact choice is made over the candidates left, on their estimates, and every layer keeps the
  ``1 / eta`` of them nearest to its choice in the order of their share of the budgets (:func:`near`):
  "more windows only for those near the solution";
* those are measured on ``grow`` times as many windows.

Then the choice is **verified** (:func:`verify`, the default; issue 31): instead of measuring every
survivor on every window, the exact choice is made over *every* candidate, on an optimistic estimate of
those not yet measured on every window (:func:`optimistic`: the mean on the windows it saw, times a lower
bound on the ratio "mean on every window / mean on the same first windows", :func:`ratio_bound`, from the
candidates of the same layer measured in full, or of every layer while fewer than 3 of its own are: the
lowest of their ratios, and at most the lower prediction bound of their log-ratios at ``confidence``
standard deviations; a window is not equally hard for every layer); each chosen candidate not measured on
every window, with its neighbours on its layer's front, moves on to the next rung's windows; again,
until the choice is
measured on every window. No candidate's optimistic estimate can then beat it, so the choice is the exact
plan's as long as those estimates are below the full measurement (true when the windows' difficulty scales
every candidate alike, nearly so on a trained model and real text; the prediction bound covers the
candidates whose ratio is lower than any seen so far, which the lowest alone missed on one benchmark case).
Without verification the last rung measures every survivor on every window, and the choice over the
survivors can miss a candidate dropped on a few windows. Every choice is made over the layers' fronts only,
and by merging them (:func:`exact_choice`: the MILP's choice, in milliseconds instead of a tenth of a second
for each of the verification's dozens of choices).

Either way a survivor (a candidate measured on every window) has exactly the full measurement's KL and
loss, and the exact choice is made over the survivors only (a dropped candidate keeps its estimate from the
windows it saw; the report says how many). Given every window in its first rung, this *is* the full
measurement.

Under ``torchrun`` the candidates of a rung are spread over the ranks (every rank holds every window), so
every rank gets the same numbers as one process.
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm

from ...model.forwards import KL_WEIGHT, Forwards, parent_and_name, unpack_batch, unpack_weight
from ...runtime import distributed
from ..choose.solve import choose_among
from .halving_bounds import (
    budget_tables,
    dominated,
    feasible,
    front,
    merged_choice,
    near,
    optimistic,
    prefix_means,
    ratio_bound,
)
from .sensitivity import LayerToPlan, candidate_module, sorted_state

__all__ = [
    "budget_tables",
    "dominated",
    "exact_choice",
    "feasible",
    "front",
    "gather_over_ranks",
    "halving_sensitivity",
    "merged_choice",
    "near",
    "optimistic",
    "prefix_means",
    "rank_share",
    "ratio_bound",
    "run_rungs",
    "rungs",
    "search",
    "token_counts",
    "verify",
    "windows_of",
]


def windows_of(batches: Iterable[Any]) -> list[dict[str, torch.Tensor]]:
    """Calibration batches split into one window per batch (``input_ids`` [1, T], ``attention_mask``, the
    KL weight :data:`~gdnprune.model.forwards.KL_WEIGHT`)."""
    out = []
    for batch in batches:
        ids, mask = unpack_batch(batch)
        weight = unpack_weight(batch)
        for row in range(ids.shape[0]):
            out.append(
                {
                    "input_ids": ids[row : row + 1],
                    **({} if mask is None else {"attention_mask": mask[row : row + 1]}),
                    **({} if weight is None else {KL_WEIGHT: weight[row : row + 1]}),
                }
            )
    return out


def token_counts(window: Mapping[str, torch.Tensor]) -> tuple[float, int]:
    """What a window counts for in the KL (its valid tokens, each times its KL weight) and in the next-token
    loss (its tokens with a next token), as the forwards count them."""
    ids = window["input_ids"]
    mask = window.get("attention_mask")
    valid = torch.ones_like(ids, dtype=torch.bool) if mask is None else mask.bool()
    weight = unpack_weight(window)
    kl = float(valid.sum()) if weight is None else float((weight * valid.double()).sum())
    return kl, int((valid[:, :-1] & valid[:, 1:]).sum())


def rungs(total: int, first: int | None = None, grow: int = 4) -> list[int]:
    """The windows seen after each rung: ``first`` (default a sixteenth of ``total``, at least 1; every window
    when that is half of them or more: the full measurement costs at most twice the first rung, nothing to
    save), then ``grow`` times as many, ..., ending with ``total``."""
    if total < 1:
        raise ValueError("successive halving needs at least one calibration window")
    if grow < 2:
        raise ValueError(f"the windows must grow by a factor of at least 2 per rung, got {grow}")
    if first is None:
        first = max(1, math.ceil(total / 16))
        first = total if 2 * first >= total else first
    n = min(total, max(1, int(first)))
    out = [n]
    while out[-1] < total:
        out.append(min(total, out[-1] * grow))
    return out


def rank_share(n: int) -> range:
    """The items (of ``n``: candidates, plans) this rank measures: all of them without a process group."""

    if not distributed.is_distributed():
        return range(n)
    return distributed.shard_indices(n, distributed.rank(), distributed.world_size())


def gather_over_ranks(values: dict) -> dict:
    """Every rank's ``{item: result}`` merged (the same dict on every rank)."""

    merged = {}
    for part in distributed.exchange(values):
        merged.update(part)
    return merged


def exact_choice(
    costs: Mapping[str, Sequence[Sequence[float]]], budgets: Mapping[str, float], *, merged: bool = True
) -> Callable[[list, list], list[int]]:
    """``pick(estimates, alive)``: the exact choice over the alive candidates within ``budgets`` (as
    :func:`~gdnprune.plan.choose.solve.choose_among`), by :func:`merged_choice` (milliseconds), or the MILP where that
    gives up (many layers and budgets), where no choice fits (the MILP's error says why) or ``merged`` is
    False."""
    limits = np.array([float(v) for v in budgets.values()])
    tables: list[np.ndarray] = []

    def pick(estimate: list, alive: list) -> list[int]:
        if not tables:
            tables.extend(budget_tables(costs, budgets, [len(e) for e in estimate])[0])
        found = merged_choice(estimate, tables, limits, alive) if merged else None
        return found if found is not None else choose_among(estimate, costs, budgets, alive)

    return pick


def verify(
    measure: Callable[[list[list[tuple[int, int]]]], None],
    kl: Sequence[np.ndarray],
    seen: Sequence[np.ndarray],
    full: Sequence[np.ndarray],
    weights: np.ndarray,
    schedule: Sequence[int],
    pick: Callable[[list, list], Sequence[int | None]],
    tables: Sequence[np.ndarray],
    sizes: Sequence[np.ndarray],
    *,
    spread: int = 2,
    slack: float = 0.0,
    confidence: float | None = None,
    jump: bool = False,
    allowed: Sequence[np.ndarray] | None = None,
    fronts: bool = False,
    per_layer: bool = False,
) -> int:
    """Choose on :func:`optimistic` estimates over every candidate; move each chosen candidate not measured on
    every window, and the ``spread`` candidates on either side of it on its layer's :func:`front` (in the
    order of ``sizes``), to the next rung's windows (``measure([[(candidate, windows), ...] per layer])``);
    again, until the choice is measured on every window. Then no candidate's optimistic estimate can improve
    on it: the choice is the exact one as long as those estimates are below the full measurement. ``jump``:
    straight to every window; ``allowed``: the candidates that may be chosen (default all); ``fronts``: each
    choice made over the allowed candidates on their layer's front only (the same choice when ``pick`` is
    the MILP over the budgets of ``tables``, from a smaller MILP); ``slack``,
    ``confidence``, ``per_layer``: as :func:`optimistic`. Returns the rounds."""
    total = len(weights)
    everyone = [np.ones(len(s), dtype=bool) for s in seen] if allowed is None else list(allowed)
    rounds = 0
    while True:
        estimate = optimistic(kl, seen, full, weights, slack, confidence, per_layer)
        among = [front(v, t, e) for e, v, t in zip(everyone, estimate, tables)] if fronts else everyone
        picks = pick(estimate, among)
        todo: list[list[tuple[int, int]]] = []
        for li, p in enumerate(picks):
            if p is None or full[li][p] or seen[li][p] >= total:
                todo.append([])
                continue
            on = front(estimate[li], tables[li], everyone[li])
            on[p] = True
            order = [int(c) for c in np.argsort(sizes[li], kind="stable") if on[c]]
            at = order.index(int(p))
            around = order[max(0, at - spread) : at + spread + 1]
            todo.append(
                [
                    (c, total if jump else next((n for n in schedule if n > seen[li][c]), total))
                    for c in around
                    if not full[li][c] and seen[li][c] < total
                ]
            )
        if not any(todo):
            return rounds
        measure(todo)
        rounds += 1


@dataclass
class _Measure:
    """:func:`halving_sensitivity`'s measurement of a rung: ``measure(todo, desc)`` measures each layer's
    candidates ``todo[layer]`` (``(candidate, windows)`` pairs) up to their windows, under one bar; ``done``
    counts the partial forwards."""

    forwards: Forwards
    layers: Sequence[LayerToPlan]
    index: list[int]
    seen: list[np.ndarray]
    kl: list[np.ndarray]
    ce: list[np.ndarray]
    text_config: Any
    progress: bool
    done: int = 0

    def __call__(self, todo: list[list[tuple[int, int]]], desc: str) -> None:
        seen = self.seen
        bar = tqdm(  # one bar per rung, its total known before it starts
            total=sum(n - int(seen[li][c]) for li in range(len(self.layers)) for c, n in todo[li]),
            disable=not self.progress,
            desc=desc,
            unit="fwd",
        )
        try:
            for li, (layer, i) in enumerate(zip(self.layers, self.index)):
                if todo[li]:
                    self.done += _measure_layer(
                        self.forwards,
                        layer,
                        i,
                        sorted_state(layer),
                        todo[li],
                        seen[li],
                        self.kl[li],
                        self.ce[li],
                        self.text_config,
                        bar,
                    )
        finally:
            bar.close()


@torch.inference_mode()
def halving_sensitivity(
    model: torch.nn.Module,
    batches: Iterable[Any],
    layers: Sequence[LayerToPlan],
    costs: Mapping[str, Sequence[Sequence[float]]],
    budgets: Mapping[str, float],
    *,
    first: int | None = None,
    grow: int = 4,
    eta: int = 4,
    z: float = 2.0,
    verified: bool = True,
    spread: int = 1,
    slack: float = 0.0,
    confidence: float | None = 2.0,
    jump: bool = False,
    per_layer: bool = True,
    before: int | None = None,
    choose: Callable[[list, list], Sequence[int | None]] | None = None,
    merged: bool = True,
    progress: bool = True,
    max_logits: int = 1 << 24,
) -> dict[str, Any]:
    """KL from the unpruned model of every candidate of every layer cut alone, by successive halving.

    Every rung measures the alive candidates of every layer on more windows; then a candidate is dropped
    when another one dominates it (:func:`dominated`), the exact choice is made over the alive candidates
    on their estimates, and every layer keeps the ``1 / eta`` of its alive candidates nearest to its choice
    (in the order of their share of the budgets). The last rung sees every window. ``verified``: then
    :func:`verify` measures further until the choice over every candidate, on optimistic estimates of those
    not measured on every window, is measured on every window.

    Args:
        model, batches, layers: as :func:`~gdnprune.plan.measure.sensitivity.measured_sensitivity`.
        costs, budgets: as :func:`~gdnprune.plan.choose.solve.choose`: the budgets in play.
        first: windows of the first rung (default a sixteenth of the windows, at least 1); the number of
            windows or more measures every candidate on every window (the full measurement).
        grow: the factor by which the windows grow from rung to rung; eta: 1 / the share kept per rung.
        z: paired standard errors by which a dominator must be better to drop a candidate.
        verified: after the rungs (``before`` of them, default all but the last), measure the choice on
            optimistic estimates until it is measured in full (:func:`verify`, ``spread`` candidates of the
            front on either side of each chosen one with it, to the next rung's windows or, ``jump``, to
            every window; ``confidence``: the standard deviations of the ratios' prediction bound, None: the
            lowest ratio only; ``slack``: the optimistic estimates scaled down by that share more; both safer
            and costlier; ``per_layer``: the ratios of the candidate's own layer, as :func:`optimistic`).
        choose: ``choose(estimates, alive)`` -> a candidate per layer (None: its decoder layer removed), the
            exact choice of a rung (default :func:`exact_choice` with ``costs`` and ``budgets``: the MILP's
            choice, from merged fronts; the plan with layer removal passes :func:`~gdnprune.plan.choose.depth.choose_with_removal`'s).
        merged: the default ``choose`` by merged fronts (False: every choice by the MILP, as issue 31's third
            version did; the same choices, slower: for the benchmark).
        progress: a tqdm bar over the partial forwards (one window each).

    Returns:
        ``{"kl", "loss": {prefix: [per candidate]}, "windows": {prefix: [windows each candidate was
        measured on]}, "kl_windows": {prefix: [per candidate: its KL on each of those windows]}, "survivors":
        {prefix: [bool per candidate: measured on every window]}, "rungs", "verify_rounds", "base_loss", "tokens", "forwards", "teacher_seconds", "seconds"}``; a survivor's KL
        and loss are those of every window; a candidate never measured (no choice within the budgets can
        hold it) has windows 0, KL 0 and the base loss.
    """

    start_time = time.perf_counter()
    windows = windows_of(batches)
    total = len(windows)
    forwards = Forwards(model, windows, max_logits=max_logits, shard=False)
    config: Any = model.config  # a transformers config (nn.Module's stubs type attributes as Tensor | Module)
    text_config = config.get_text_config(decoder=True)
    index = [forwards.decoder_index(layer.module) for layer in layers]
    teacher_start = time.perf_counter()
    forwards.teacher(index)
    teacher_seconds = time.perf_counter() - teacher_start
    counts = np.array([token_counts(w) for w in windows], dtype=np.float64)  # [windows, (kl, ce)]
    schedule = rungs(total, first, grow)
    kl = [np.zeros((len(layer.candidates), total)) for layer in layers]
    ce = [np.full((len(layer.candidates), total), forwards.base_loss) for layer in layers]
    full = [np.array([t == layer.shape for t in layer.candidates]) for layer in layers]  # KL 0, not measured
    seen = [np.zeros(len(layer.candidates), dtype=int) for layer in layers]
    measure = _Measure(forwards, layers, index, seen, kl, ce, text_config, progress)
    pick = choose if choose is not None else exact_choice(costs, budgets, merged=merged)
    rounds = search(
        measure,
        kl,
        seen,
        full,
        counts[:, 0],
        costs,
        budgets,
        schedule,
        pick,
        eta=eta,
        z=z,
        verified=verified,
        spread=spread,
        slack=slack,
        confidence=confidence,
        jump=jump,
        before=before,
        plain=choose is None,
        per_layer=per_layer,
    )
    result: dict[str, Any] = {
        **_per_candidate(layers, full, seen, kl, ce, counts),
        "rungs": schedule,
        "verify_rounds": rounds,
        "base_loss": forwards.base_loss,
        "tokens": forwards.tokens,
        "forwards": measure.done,
        "teacher_seconds": teacher_seconds,
    }
    result["seconds"] = time.perf_counter() - start_time
    return result


def _per_candidate(
    layers: Sequence[LayerToPlan], full: list, seen: list, kl: list, ce: list, counts: np.ndarray
) -> dict[str, dict[str, list]]:
    """:func:`halving_sensitivity`'s tables per layer: each candidate's KL and loss (the means over the windows
    it was measured on, every window for the uncut candidate), those windows, its KL on each, and whether it
    survived to every window."""
    total = counts.shape[0]
    out: dict[str, dict[str, list]] = {k: {} for k in ("kl", "loss", "kl_windows", "windows", "survivors")}
    for li, layer in enumerate(layers):
        n = np.where(full[li], total, seen[li])
        out["kl"][layer.prefix] = prefix_means(kl[li], n, counts[:, 0]).tolist()
        out["loss"][layer.prefix] = prefix_means(ce[li], n, counts[:, 1]).tolist()
        out["windows"][layer.prefix] = [int(s) for s in n]
        out["kl_windows"][layer.prefix] = [[float(v) for v in row[: int(m)]] for row, m in zip(kl[li], n)]
        out["survivors"][layer.prefix] = [bool(s >= total) for s in n]
    return out


def search(
    measure: Callable[[list[list[tuple[int, int]]], str], None],
    kl: Sequence[np.ndarray],
    seen: Sequence[np.ndarray],
    full: Sequence[np.ndarray],
    weights: np.ndarray,
    costs: Mapping[str, Sequence[Sequence[float]]],
    budgets: Mapping[str, float],
    schedule: Sequence[int],
    pick: Callable[[list, list], Sequence[int | None]],
    *,
    eta: int = 4,
    z: float = 2.0,
    verified: bool = True,
    spread: int = 1,
    slack: float = 0.0,
    confidence: float | None = 2.0,
    jump: bool = False,
    before: int | None = None,
    plain: bool = True,
    per_layer: bool = True,
) -> int:
    """The whole procedure on a ``measure([[(candidate, windows), ...] per layer], description)`` that fills
    ``kl`` and ``seen`` in place (real forwards in :func:`halving_sensitivity`; a table of per-window KL in a
    replay, ``benchmarks/halving_replay.py``): the candidates no choice within the budgets can hold dropped
    (:func:`feasible`; ``plain``: ``pick`` is the MILP over ``budgets`` alone, so the other layers cost at
    least their cheapest candidate, and every choice is made over the layers' :func:`front` only, the same
    choice from a smaller MILP; else a layer may be removed), the rungs (:func:`run_rungs`), then, ``verified``, the
    verification (:func:`verify`, ``per_layer`` as :func:`optimistic`) in place of the last rung, after
    ``before`` rungs (default all but the last). Returns the verification's rounds."""
    tables, sizes = budget_tables(costs, budgets, [len(k) for k in kl])
    allowed = feasible(tables, budgets, plain) if budgets else [np.ones(len(k), dtype=bool) for k in kl]
    allowed = [a | f for a, f in zip(allowed, full)]  # the layer's own geometry stays (nothing to measure)
    verifying = verified and len(schedule) > 1
    first = len(schedule) - 1 if before is None else max(1, min(int(before), len(schedule) - 1))
    run_rungs(
        measure,
        kl,
        seen,
        full,
        costs,
        budgets,
        schedule[:first] if verifying else schedule,
        pick,
        eta=eta,
        z=z,
        allowed=allowed,
        fronts=plain,
    )
    if not verifying:
        return 0
    verifying_round = itertools.count(1)  # one bar per round, each its own description and total
    return verify(
        lambda todo: measure(todo, f"sensitivity, verifying the choice (round {next(verifying_round)})"),
        kl,
        seen,
        full,
        weights,
        schedule,
        pick,
        tables,
        sizes,
        spread=spread,
        slack=slack,
        confidence=confidence,
        jump=jump,
        allowed=allowed,
        fronts=plain,
        per_layer=per_layer,
    )


def run_rungs(
    measure: Callable[[list[list[tuple[int, int]]], str], None],
    kl: Sequence[np.ndarray],
    seen: Sequence[np.ndarray],
    full: Sequence[np.ndarray],
    costs: Mapping[str, Sequence[Sequence[float]]],
    budgets: Mapping[str, float],
    schedule: Sequence[int],
    pick: Callable[[list, list], Sequence[int | None]],
    *,
    eta: int,
    z: float,
    allowed: Sequence[np.ndarray] | None = None,
    fronts: bool = False,
) -> list[np.ndarray]:
    """The rungs of successive halving: measure the alive candidates of every layer on the rung's windows
    (``measure([[(candidate, windows), ...] per layer], description)``), drop the dominated ones, choose on
    the estimates, keep the ``1 / eta`` nearest to the choice; returns the alive candidates after the last."""
    layers = range(len(kl))
    tables, sizes = budget_tables(costs, budgets, [len(k) for k in kl])
    alive = [np.ones(len(k), dtype=bool) for k in kl] if allowed is None else [a.copy() for a in allowed]
    total = schedule[-1]
    for rung, upto in enumerate(schedule):
        todo = [[(int(c), upto) for c in np.flatnonzero(alive[li] & ~full[li])] for li in layers]
        measure(
            todo, f"sensitivity, rung {rung + 1} of {len(schedule)} ({upto} window{'s' if upto > 1 else ''})"
        )
        if upto == total:
            break
        for li in layers:
            alive[li] &= ~dominated(kl[li][:, :upto], tables[li], alive[li], z=z)
        means = [kl[li][:, :upto].mean(1) for li in layers]
        among = [front(m, t, a) for a, m, t in zip(alive, means, tables)] if fronts else alive
        picks = pick(means, among)
        for li in layers:
            alive[li] = near(sizes[li], alive[li], picks[li], max(1, math.ceil(int(alive[li].sum()) / eta)))
    return alive


def _measure_layer(
    forwards: Any,
    layer: Any,
    index: int,
    state: dict,
    todo: list[tuple[int, int]],
    seen: np.ndarray,
    kl: np.ndarray,
    ce: np.ndarray,
    text_config: Any,
    bar: Any,
) -> int:
    """Measure ``layer``'s candidates ``todo`` (``(candidate, upto)``) on windows ``seen[c]`` to ``upto`` (spread
    over the ranks), writing their KL and loss in place; returns the partial forwards done.

    The candidates of a window run the layers after theirs together (:func:`_stacked`): a layer's candidates
    differ only in it, so the rest of the model runs once per window for a stack of them rather than once per
    candidate (a model of 48 layers and thousands of candidates a layer would otherwise run the remaining
    layers for each)."""
    device = next(iter(state.values())).device
    parent, attr = parent_and_name(forwards.decoder.layers[index], layer.module)
    mine: dict[int, list[tuple[float, float]]] = {}
    last = index == len(forwards.decoder.layers) - 1
    try:
        mine_todo = [todo[k] for k in rank_share(len(todo))]
        if last:  # nothing after it to share: each candidate's own forwards
            with forwards.from_layer(index) as measure:
                for c, upto in mine_todo:
                    setattr(
                        parent, attr, candidate_module(layer, state, layer.candidates[c], text_config, device)
                    )
                    mine[c] = [measure([w]) for w in range(int(seen[c]), upto)]
                    bar.update(upto - int(seen[c]))
        else:
            for group in _stacks(mine_todo, forwards, index, sum(int(v.numel()) for v in state.values())):
                modules = {
                    c: candidate_module(layer, state, layer.candidates[c], text_config, device)
                    for c, _ in group
                }
                mine.update(
                    _stacked(forwards, index, group, seen, modules, lambda m: setattr(parent, attr, m), bar)
                )
    finally:
        setattr(parent, attr, layer.module)
    done = 0
    for c, values in sorted(gather_over_ranks(mine).items()):
        start = int(seen[c])
        done += len(values)
        kl[c, start : start + len(values)] = [v[0] for v in values]
        ce[c, start : start + len(values)] = [v[1] for v in values]
        seen[c] = start + len(values)
    return done


#: the most candidates one stacked forward holds, and the most elements their hidden states for one window and
#: (apart) their modules may take
STACK_CANDIDATES, STACK_ELEMENTS = 64, 1 << 26


def _stacks(
    todo: list[tuple[int, int]], forwards: Any, index: int, module_elements: int
) -> list[list[tuple[int, int]]]:
    """``todo`` in groups that one stacked forward can hold: at most :data:`STACK_CANDIDATES`, their hidden states
    for one window and their modules (at most ``module_elements`` each) at most :data:`STACK_ELEMENTS` each."""
    cached = forwards.captured[0][index] if forwards.captured and forwards.data else None
    per = int(cached.numel()) if cached is not None else 1
    size = max(
        1, min(STACK_CANDIDATES, STACK_ELEMENTS // max(1, per), STACK_ELEMENTS // max(1, module_elements))
    )
    return [todo[i : i + size] for i in range(0, len(todo), size)]


def _stacked(
    forwards: Any,
    index: int,
    group: list[tuple[int, int]],
    seen: np.ndarray,
    modules: dict[int, torch.nn.Module],
    install: Callable[[torch.nn.Module], None],
    bar: Any,
) -> dict[int, list[tuple[float, float]]]:
    """The KL and loss per token of each candidate of ``group`` on its windows ``seen[c]`` to ``upto``: per
    window, each candidate's module (``modules``, put in place by ``install``) runs its layer on the kept
    input, and the layers after it run once on their outputs stacked along the batch."""
    out: dict[int, list[tuple[float, float]]] = {c: [] for c, _ in group}
    for w in range(min(int(seen[c]) for c, _ in group), max(upto for _, upto in group)):
        here = [c for c, upto in group if int(seen[c]) <= w < upto]
        if not here:
            continue
        args, kwargs = forwards.layer_call(index, w)
        layer = forwards.decoder.layers[index]
        hidden = []
        for c in here:
            install(modules[c])
            result = layer(*args, **kwargs)
            hidden.append(result[0] if isinstance(result, tuple) else result)
        sums = forwards.from_hidden(index + 1, w, torch.cat(hidden))
        for c, (a, b, n_kl, n_ce) in zip(here, sums):
            a, b, n_kl, n_ce = forwards.total(a, b, n_kl, n_ce)
            out[c].append(((a / n_kl if n_kl > 0 else 0.0), b / max(n_ce, 1)))
        bar.update(len(here))
    return out
