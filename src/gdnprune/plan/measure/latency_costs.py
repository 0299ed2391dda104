"""Latency as one more cost of the plan: every candidate block timed at a workload, summed in the one MILP.

:func:`measure_latency_costs` times, with :class:`gdnprune.model.latency.LatencyHarness` on the device the model is
on (warm-up, then the median of repeats), the unpruned model, every candidate of every width group (its cut
module called in place of the original) and, where depth is planned, every whole decoder layer. The model's
latency is then modelled as additive: a fixed part (embeddings, final norm, LM head, and what no group
covers) plus each kept group's candidate (plus each kept layer's rest: its norms, residuals and unplanned
sub-blocks). :func:`add_latency_budget` makes that a budget of the problem (``latency``: a fraction of the
unpruned model's latency), and :func:`cut_model_latency` measures the cut model as a whole, to set the
prediction beside the measurement. :func:`check_latency_floor` refuses a budget below the embeddings and LM
head before any candidate is timed (and, in ``prune``, before scoring): two whole forwards' timings.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from tqdm.auto import tqdm

from ...model.forwards import decoder_layers
from ...model.latency import LatencyHarness, Workload
from ..choose.solve import BudgetError
from .problem import PlanProblem, budget_limit
from .sensitivity import candidate_module, sorted_state

__all__ = [
    "LatencyCosts",
    "add_latency_budget",
    "check_latency_floor",
    "cut_in_place",
    "cut_model_latency",
    "fit_latency",
    "measure_latency_costs",
]

#: how many times :func:`fit_latency` may choose again, and how far over the limit a measurement may be
LATENCY_ROUNDS = 3
LATENCY_TOLERANCE = 0.02


@dataclass
class LatencyCosts:
    """Seconds per call at ``workload``: the unpruned model, the fixed part, per width group and candidate, and
    per decoder layer its rest (with depth; the layer's latency minus its groups' unpruned latencies)."""

    workload: Workload
    whole: float
    fixed: float
    groups: list[list[float]]
    rests: list[float]
    layers: list[float]

    def predicted(self, picks: Sequence[int | None], removed: Sequence[int]) -> float:
        """The additive prediction of a choice's latency (removed layers cost nothing)."""
        widths = sum(g[p] for g, p in zip(self.groups, picks) if p is not None)
        rests = sum(r for i, r in enumerate(self.rests) if i not in set(removed))
        return self.fixed + widths + rests

    def as_dict(self) -> dict[str, Any]:
        return {
            "workload": str(self.workload),
            "unpruned_seconds": self.whole,
            "fixed_seconds": self.fixed,
            "layer_seconds": self.layers,
            "rest_seconds": self.rests,
        }


def measure_latency_costs(
    model: Any,
    problem: PlanProblem,
    workload: Workload,
    *,
    repeats: int = 5,
    warmup: int = 2,
    progress: bool = True,
) -> LatencyCosts:
    """Time the unpruned model, every candidate of every width group of ``problem`` and (with depth) every
    decoder layer at ``workload``; every latency positive (a block's time is never below the timer's)."""
    harness = LatencyHarness(model, workload, repeats=repeats, warmup=warmup)
    groups = problem.groups
    text_config = model.config.get_text_config(decoder=True)
    count = sum(len(g.candidates) for g in groups) + (len(problem.rests) if problem.rests else 0) + 1
    bar = tqdm(total=count, disable=not progress, desc=f"latency at {workload}", unit="block")
    try:
        whole = harness.model_latency().seconds
        bar.update(1)
        harness.prepare([g.module for g in groups] + [r.module for r in problem.rests])
        timed = [_group_latencies(harness, group, text_config, bar.update) for group in groups]
        layers = [harness.block_latency(r.module).seconds for r in problem.rests]
        bar.update(len(layers))
    finally:
        bar.close()
    full = [t[_full_index(g)] for g, t in zip(groups, timed)]
    rests = []
    if problem.rests:
        assert problem.layer_of is not None
        for r, seconds in zip(problem.rests, layers):
            mine = sum(f for g, f in enumerate(full) if problem.layer_of[g] == r.index)
            rests.append(max(seconds - mine, 0.0))
        fixed = whole - sum(layers)
    else:
        fixed = whole - sum(full)
    return LatencyCosts(workload, whole, max(fixed, 0.0), timed, rests, layers)


def _full_index(group: Any) -> int:
    """The index of a group's unpruned candidate (its own geometry)."""
    return next(c for c, t in enumerate(group.candidates) if t == group.shape)


@torch.no_grad()
def _group_latencies(
    harness: LatencyHarness, group: Any, text_config: Any, update: Callable[[int], Any]
) -> list[float]:
    """Seconds of every candidate of ``group``: its cut module called in place of the original."""
    state = sorted_state(group)
    device = next(iter(state.values())).device
    out = []
    for target in group.candidates:
        cut = None if target == group.shape else candidate_module(group, state, target, text_config, device)
        out.append(harness.block_latency(group.module, cut).seconds)
        update(1)
    return out


def check_latency_floor(
    model: Any, workload: Workload, fraction: float, *, repeats: int = 5, warmup: int = 2
) -> None:
    """Refuse, before any candidate is timed or any calibration forward runs, a latency budget below what
    every plan keeps: the forward with every decoder layer passed through (embeddings, rotary tables, final
    norm, LM head), timed beside the unpruned model. A lower bound only (every plan also keeps a layer or
    more), so a budget above it may still be refused by :func:`add_latency_budget` once the candidates are
    timed. Raises :class:`BudgetError`."""
    harness = LatencyHarness(model, workload, repeats=repeats, warmup=warmup)
    whole = harness.model_latency().seconds
    fixed = harness.fixed_latency().seconds
    limit = budget_limit(fraction, whole, "latency")
    assert limit is not None
    if fixed > limit:
        raise BudgetError(
            f"`budget_latency` {fraction}: no plan is that fast at {workload}: the embeddings and LM head alone, "
            f"which every plan keeps, take {fixed / whole:.1%} of the unpruned model's {whole * 1e3:.3g} ms"
        )


def add_latency_budget(problem: PlanProblem, costs: LatencyCosts, fraction: float) -> None:
    """The ``latency`` budget: at most ``fraction`` (<= 1; larger: seconds) of the unpruned model's latency,
    its fixed part taken off the limit. Raises :class:`BudgetError` when even the least the plan can reach
    (every group at its fastest candidate; with depth, every layer but the cheapest removed) is over it."""
    limit = budget_limit(fraction, costs.whole, "latency")
    assert limit is not None
    if costs.rests:
        least = costs.fixed + min(
            r + sum(min(g) for g, i in zip(costs.groups, problem.layer_of or []) if i == k)
            for k, r in enumerate(costs.rests)
        )
    else:
        least = costs.fixed + sum(min(g) for g in costs.groups)
    if least > limit:
        raise BudgetError(
            f"`budget_latency` {fraction}: no plan is that fast at {costs.workload}: the least reachable is "
            f"{least / costs.whole:.1%} of the unpruned model's {costs.whole * 1e3:.3g} ms ({costs.fixed * 1e3:.3g} "
            f"ms in what no candidate changes: embeddings, LM head)"
        )
    problem.given["latency"] = fraction
    problem.limits["latency"] = limit
    problem.budgets["latency"] = limit - costs.fixed
    problem.costs["latency"] = [list(g) for g in costs.groups] + [[r] for r in costs.rests]


class _Skipped(torch.nn.Module):
    """A removed decoder layer, timed as nothing: hands on its input (the attributes the model reads kept)."""

    def __init__(self, layer: torch.nn.Module):
        super().__init__()
        for name in ("layer_type", "attention_type", "layer_idx"):
            if hasattr(layer, name):
                setattr(self, name, getattr(layer, name))

    def forward(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        return hidden_states


@contextlib.contextmanager
def cut_in_place(
    model: Any, problem: PlanProblem, picks: Sequence[int | None], removed: Sequence[int]
) -> Iterator[Any]:
    """``model`` as the cut model while the block runs: every group's chosen cut module swapped in (outer
    modules first), every removed decoder layer taken out of the forward; put back as it was on the way out."""
    text_config = model.config.get_text_config(decoder=True)
    layers = decoder_layers(model)
    path = {id(m): n for n, m in model.named_modules()}
    cuts = [(g, p) for g, p in zip(problem.groups, picks) if p is not None and g.candidates[p] != g.shape]
    cuts.sort(key=lambda gp: path[id(gp[0].module)].count("."))  # outer modules first
    swapped: list[tuple[Any, str, Any]] = []
    try:
        for group, pick in cuts:
            state = sorted_state(group)
            device = next(iter(state.values())).device
            owner, _, attr = path[id(group.module)].rpartition(".")
            parent = model.get_submodule(owner)
            swapped.append((parent, attr, getattr(parent, attr)))
            setattr(parent, attr, candidate_module(group, state, group.candidates[pick], text_config, device))
        for i in removed:
            owner, _, attr = path[id(layers[i])].rpartition(".")
            parent = model.get_submodule(owner)
            swapped.append((parent, attr, getattr(parent, attr)))
            setattr(parent, attr, _Skipped(layers[i]))
        yield model
    finally:
        for parent, attr, original in reversed(swapped):
            setattr(parent, attr, original)


@torch.no_grad()
def cut_model_latency(
    model: Any,
    problem: PlanProblem,
    picks: Sequence[int | None],
    removed: Sequence[int],
    workload: Workload,
    *,
    repeats: int = 5,
    warmup: int = 2,
) -> float:
    """The measured latency (seconds) of the whole cut model at ``workload`` (:func:`cut_in_place`); the
    model is left as it was."""
    with cut_in_place(model, problem, picks, removed):
        return LatencyHarness(model, workload, repeats=repeats, warmup=warmup).model_latency().seconds


def fit_latency(
    model: Any,
    problem: PlanProblem,
    costs: LatencyCosts,
    workload: Workload,
    choose: Callable[[], Any],
    *,
    rounds: int = LATENCY_ROUNDS,
    tolerance: float = LATENCY_TOLERANCE,
) -> tuple[Any, list[dict[str, float]]]:
    """The choice of ``choose()`` under the latency budget, measured whole, and made again while it measures
    over the limit. The additive costs miss what a cut model does as a whole (fewer, smaller kernels; the
    machine's load when each block was timed), so when the cut model measures ``m`` over the limit ``L`` with a
    prediction of ``p``, the latency the MILP plans against is scaled by ``L / m`` (from ``min(planned, p)``)
    and the choice made again, at most ``rounds`` times; a choice no plan can meet ends the fitting. The
    problem keeps the last planned latency (later stages plan against it too). Returns the choice and one
    record per measurement (``planned_seconds``, ``predicted_seconds``, ``measured_seconds``)."""
    limit = problem.limits["latency"]
    choice = choose()
    history: list[dict[str, float]] = []
    for round_ in range(rounds + 1):
        planned = problem.budgets["latency"] + costs.fixed
        predicted = costs.predicted(choice.picks, choice.removed)
        measured = cut_model_latency(model, problem, choice.picks, choice.removed, workload)
        history.append(
            {"planned_seconds": planned, "predicted_seconds": predicted, "measured_seconds": measured}
        )
        if measured <= limit * (1 + tolerance) or round_ == rounds:
            break
        problem.budgets["latency"] = min(planned, predicted) * limit / measured - costs.fixed
        try:
            choice = choose()
        except BudgetError:
            problem.budgets["latency"] = planned - costs.fixed
            break
    return choice, history
