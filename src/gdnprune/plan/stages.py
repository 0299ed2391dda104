"""The measure and choose stages of a plan search, over a :class:`~gdnprune.plan.measure.problem.PlanProblem`.

:func:`measure`: every candidate's sensitivity (measured in full, by successive halving, or the proxy) and
every decoder layer's removal; :func:`choose_plan`: the exact choice (heterogeneous, with removal, uniform or
servable); :func:`evolve_choice`: the evolutionary search over whole plans from it; :func:`make_report`: the
report of it all.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from ..scoring.experts import block_influence
from .choose.depth import choose_with_removal, keep_better, pool_with_removal, removal_sensitivity
from .choose.evolve import REMOVED
from .choose.servable import SERVABLE_NOTE, choose_servable
from .choose.solve import choose_among, choose_pool, choose_uniform
from .measure.bld import DEFAULT_STEPS as BLD_STEPS
from .measure.bld import bld_sensitivity
from .measure.halving import halving_sensitivity
from .measure.joint import JointKL, evolve_plan, plan_kl
from .measure.problem import PlanProblem
from .measure.sensitivity import measured_sensitivity, proxy_sensitivity
from .report.results import Choice, MeasureStats, PlanReport, Sensitivities, build_report

__all__ = [
    "check_depth",
    "check_sensitivity",
    "choose_plan",
    "choose_plans",
    "evolve_choice",
    "make_report",
    "make_servable",
    "measure",
    "uniform_choice",
]


def check_sensitivity(problem: PlanProblem, sensitivity: str) -> None:
    """Refuse the proxy where it cannot rank the candidates (sub-blocks, removals)."""
    if problem.rests and sensitivity == "proxy":
        raise ValueError(
            "the proxy sensitivity cannot rank removing a decoder layer against cutting widths (block "
            "influence, 1 - cos between a layer's input and output, is no KL): measure (sensitivity "
            '"halving", "measured" or "bld") or leave "depth" out of `blocks`'
        )
    if problem.blocks and sensitivity == "proxy":
        raise ValueError(
            "the proxy sensitivity covers GDN layers only; measure the sub-blocks (sensitivity "
            '"halving", "measured" or "bld") or let only GDN layers shrink (`blocks` ["gdn"])'
        )


def measure(
    model: Any,
    batches: list | None,
    problem: PlanProblem,
    sensitivity: str,
    *,
    progress: bool,
    servable: bool = False,
    bld_steps: int = BLD_STEPS,
) -> Sensitivities:
    """The measure stage: every candidate's sensitivity (and every removal's, with depth); successive
    halving's rungs choose as the plan will (``servable``: one geometry per kind)."""
    groups = problem.groups
    if sensitivity == "proxy":
        # the scores' own orders and raw scores, both in the unsorted indexing: right whether or not the
        # model was sorted since
        start = time.perf_counter()
        values = [
            proxy_sensitivity(problem.payload_of[layer.prefix], layer.shape, layer.candidates)
            for layer in problem.layers
        ]
        return Sensitivities(values=values, seconds=time.perf_counter() - start)
    if batches is None:
        raise ValueError("measured sensitivity needs calibration batches")
    start = time.perf_counter()
    removal = removal_sensitivity(model, batches) if problem.rests else None  # each on every window
    if sensitivity == "bld":
        measured = bld_sensitivity(model, batches, groups, steps=bld_steps, progress=progress)
    elif sensitivity == "measured" or not groups:
        measured = measured_sensitivity(model, batches, groups, progress=progress)
    else:
        chooser = _rung_chooser(problem, removal, servable)
        measured = halving_sensitivity(
            model,
            batches,
            groups,
            {k: v[: len(groups)] for k, v in problem.costs.items()},
            problem.budgets,
            choose=chooser,
            progress=progress,
        )
    halving = "survivors" in measured
    return Sensitivities(
        values=[measured["kl"][g.prefix] for g in groups],
        losses=[measured["loss"][g.prefix] for g in groups],
        windows=[measured["windows"][g.prefix] for g in groups] if halving else None,
        survivors=[measured["survivors"][g.prefix] for g in groups] if halving else None,
        removal=removal,
        stats=MeasureStats(
            base_loss=measured["base_loss"],
            tokens=measured["tokens"],
            forwards=measured["forwards"],
            rungs=measured["rungs"] if halving and groups else None,
            teacher_seconds=measured.get("teacher_seconds"),
            bld=measured.get("bld"),
        ),
        seconds=time.perf_counter() - start,
    )


def choose_plan(
    problem: PlanProblem, sens: Sensitivities, *, uniform: bool, servable: bool = False
) -> Choice:
    """The choose stage: the exact choice over the measured sensitivities (servable, uniform, with removal, or
    not)."""
    if servable:
        picks: list[int | None] = _choose_servable(problem, sens.values, sens.removal)
    elif uniform:
        picks = list(
            choose_uniform(problem.keys, sens.values, problem.costs, problem.budgets, kinds=problem.kinds)
        )
    elif problem.rests:
        assert sens.removal is not None
        picks = _choose_with_removal(problem, sens.values, sens.removal, sens.survivors)
    else:
        picks = list(choose_among(sens.values, problem.costs, problem.budgets, sens.survivors))
    return Choice(picks=picks, removed=_removed(problem, picks))


def choose_plans(problem: PlanProblem, sens: Sensitivities, count: int) -> list[Choice]:
    """The ``count`` best distinct heterogeneous choices (with removal where depth is planned), best first: the
    exact choice, then each next one with those before it excluded (a solution pool; fewer when fewer meet
    the budgets). The first is :func:`choose_plan`'s."""
    if problem.rests:
        assert sens.removal is not None and problem.layer_of is not None
        rests = [[0.0]] * len(problem.rests)
        pool = pool_with_removal(
            sens.values + rests,
            problem.costs,
            problem.budgets,
            count,
            layer_of=problem.layer_of,
            removal={i: v[0] for i, v in sens.removal.items()},
            allowed=None if sens.survivors is None else sens.survivors + [[True]] * len(rests),
            keep_one_of=problem.keep_one_of,
        )
    else:
        pool = [
            list(p) for p in choose_pool(sens.values, problem.costs, problem.budgets, count, sens.survivors)
        ]
    return [Choice(picks=picks, removed=_removed(problem, picks)) for picks in pool]


def uniform_choice(problem: PlanProblem, sens: Sensitivities) -> Choice:
    """The best uniform cut under the same budgets (one geometry per kind of block, every decoder layer kept;
    :func:`~gdnprune.plan.choose.solve.choose_uniform` on the summed sensitivities)."""
    rests = len(problem.rests)
    picks = choose_uniform(
        problem.keys + [["whole"]] * rests,
        sens.values + [[0.0]] * rests,
        problem.costs,
        problem.budgets,
        kinds=problem.kinds + ["rest"] * rests,
    )
    return Choice(picks=list(picks))


def check_depth(
    model: Any, batches: list, problem: PlanProblem, choice: Choice, sens: Sensitivities
) -> Choice:
    """Depth that never loses to widths: when ``choice`` removes a decoder layer, the KL of its whole cut model
    on the calibration windows against the best widths-only plan's (solved again with no layer removable);
    the better is returned, with the check in ``choice.depth_check`` (:class:`~gdnprune.plan.choose.depth.DepthCheck`)."""
    if not choice.removed:
        return choice
    assert problem.layer_of is not None
    fitness = JointKL(model, batches, problem.groups + problem.rests)
    rests = len(problem.rests)
    picks, check = keep_better(
        choice.picks,
        choice.removed,
        sens.values + [[0.0]] * rests,
        problem.costs,
        problem.budgets,
        lambda p: plan_kl(fitness, [REMOVED if c is None else c for c in p]),
        layer_of=problem.layer_of,
        allowed=None if sens.survivors is None else sens.survivors + [[True]] * rests,
    )
    return Choice(picks=picks, removed=_removed(problem, picks), depth_check=check)


def _removed(problem: PlanProblem, picks: Sequence[int | None]) -> list[int]:
    """The decoder layers a choice removes (its groups' picks None)."""
    if not problem.rests:
        return []
    assert problem.layer_of is not None
    return sorted({problem.layer_of[g] for g, p in enumerate(picks) if p is None})


def evolve_choice(
    model: Any,
    batches: list,
    problem: PlanProblem,
    choice: Choice,
    *,
    generations: int,
    offspring: int,
    seed: int,
    progress: bool,
) -> Choice:
    """The evolutionary search over whole plans (:func:`~gdnprune.plan.measure.joint.evolve_plan`) from ``choice``."""
    evolution = evolve_plan(
        model,
        batches,
        problem.groups + problem.rests,
        problem.costs,
        problem.budgets,
        [REMOVED if p is None else p for p in choice.picks],
        generations=generations,
        offspring=offspring,
        seed=seed,
        progress=progress,
        layer_of=problem.layer_of,
        removable=[r.index for r in problem.rests],
        keep_one_of=problem.keep_one_of,
    )
    picks = [None if p == REMOVED else p for p in evolution["picks"]]
    return Choice(picks=picks, removed=_removed(problem, picks), evolution=evolution)


def make_report(
    model: Any,
    batches: list | None,
    problem: PlanProblem,
    sensitivity: str,
    sens: Sensitivities,
    choice: Choice,
) -> PlanReport:
    """The report stage: every candidate, every removal (with each layer's block influence)."""
    influence = (
        block_influence(model, batches)
        if problem.rests and sens.removal is not None and batches is not None
        else None
    )
    return build_report(problem, sensitivity, sens, choice, influence)


def _choose_with_removal(
    problem: PlanProblem,
    values: list,
    removal: Mapping[int, tuple[float, float]],
    allowed: list | None,
) -> list[int | None]:
    """The exact choice of widths and removed layers (:func:`.depth.choose_with_removal`) over the width groups'
    ``values`` (and ``allowed``) and the layers' rests (one candidate each, sensitivity 0)."""
    assert problem.layer_of is not None
    rests = [[0.0]] * len(problem.rests)
    picks, _ = choose_with_removal(
        values + rests,
        problem.costs,
        problem.budgets,
        layer_of=problem.layer_of,
        removal={i: v[0] for i, v in removal.items()},
        allowed=None if allowed is None else allowed + [[True]] * len(rests),
        keep_one_of=problem.keep_one_of,
    )
    return picks


def _choose_servable(
    problem: PlanProblem, values: list, removal: Mapping[int, tuple[float, float]] | None
) -> list[int | None]:
    """The exact servable choice (:func:`.servable.choose_servable`) over the width groups' ``values`` and the
    layers' rests (one candidate each, sensitivity 0; a kind of their own each)."""
    rests = problem.rests
    picks, _ = choose_servable(
        problem.keys + [[None]] * len(rests),
        values + [[0.0]] * len(rests),
        problem.costs,
        problem.budgets,
        kinds=problem.kinds + [f"rest {r.index}" for r in rests],
        layer_of=problem.layer_of or [],
        removal={i: v[0] for i, v in (removal or {}).items()} if rests else {},
        keep_one_of=problem.keep_one_of,
    )
    return picks


def _rung_chooser(
    problem: PlanProblem, removal: Mapping[int, tuple[float, float]] | None, servable: bool
) -> Callable[[Sequence[Any], Sequence[Any]], list[int | None]] | None:
    """The choice of a successive-halving rung, as the plan will choose (None: halving's own, widths only)."""
    width = len(problem.groups)

    def servable_rung(estimate: Sequence[Any], alive: Sequence[Any]) -> list[int | None]:
        return _nearest_alive(problem, _choose_servable(problem, list(estimate), removal)[:width], alive)

    def removal_rung(estimate: Sequence[Any], alive: Sequence[Any]) -> list[int | None]:
        assert removal is not None
        return _choose_with_removal(problem, list(estimate), removal, list(alive))[:width]

    return servable_rung if servable else removal_rung if problem.rests else None


def _nearest_alive(problem: PlanProblem, picks: list[int | None], alive: Sequence[Any]) -> list[int | None]:
    """Every pick moved to the alive candidate of its group nearest in cost (a servable choice may pick a
    candidate successive halving has dropped in one group: the rung then measures around its nearest)."""
    out: list[int | None] = []
    for g, pick in enumerate(picks):
        if pick is None or alive[g][pick]:
            out.append(pick)
            continue
        size = [
            sum(
                problem.costs[name][g][c] / max(abs(problem.budgets[name]), 1e-300)
                for name in problem.budgets
            )
            for c in range(len(alive[g]))
        ]
        out.append(
            min((c for c in range(len(alive[g])) if alive[g][c]), key=lambda c: abs(size[c] - size[pick]))
        )
    return out


def make_servable(plan: dict, problem: PlanProblem, choice: Choice) -> None:
    """Mark ``plan`` servable and give its geometries as ``default`` too: a layer the plan removes then has
    the kept layers' geometry, so the written config is uniform (no ``per_layer_config``)."""
    default: dict[str, int] = {}
    for entry in problem.entries(choice.picks).values():
        for name, value in entry.items():
            if default.setdefault(name, value) != value:
                raise RuntimeError(f"a servable plan gives {name} two values ({default[name]}, {value})")
    plan["default"] = default
    plan["servable"] = SERVABLE_NOTE
