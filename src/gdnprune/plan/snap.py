"""Snap a heterogeneous plan to the best servable plan near it, and measure what servability costs.

The servable search (:func:`~gdnprune.plan.api.search` with ``servable``) runs under the plan's own budgets
and grid; both plans are then scored by the same measurements (their summed sensitivities) and measured as
whole cut models on the calibration windows (:class:`~gdnprune.plan.measure.joint.JointKL`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from ..io.plan_file import read_plan
from ..model.geometry import layer_index_of
from ..model.targets import TARGET_FIELDS, resolve_target
from .api import PlanOptions, search
from .choose.evolve import REMOVED
from .measure.candidates import AXES
from .measure.joint import JointKL, plan_kl
from .measure.problem import BUDGET_NAMES, PlanProblem, block_entry
from .measure.subblocks import BLOCK_NAMES
from .report.results import Sensitivities

__all__ = ["plan_picks", "snap_servable"]


def snap_servable(
    model: Any,
    batches: Iterable[Any],
    scores: str | Path | Mapping,
    plan: str | Path | Mapping,
    *,
    sensitivity: str = "halving",
    orders_applied: bool = False,
    progress: bool = True,
) -> tuple[dict, dict]:
    """The best servable plan near the heterogeneous ``plan``: under its budgets, on its grid (both read from
    the plan file), by the same sensitivity; returns ``(plan, report)``. The report's ``servability`` gives
    the cost of servability, predicted (summed sensitivities of both plans, from this search's
    measurements) and measured (the KL of each whole cut model against the unpruned one on the calibration
    windows).

    Raises:
        ValueError: a plan with no recorded budgets or grid, or one whose targets are not on the grid.
    """
    source = read_plan(plan)
    if (source.get("default") or {}).get("hidden_size") is not None:
        raise ValueError(
            "the plan cuts the hidden size; a servable plan of the hidden size is searched directly "
            "(`gdnprune plan --servable` with hidden in --blocks), not snapped"
        )
    options, grid = _snap_options(source, sensitivity)
    batches = list(batches)
    done = search(
        model,
        batches,
        scores,
        options,
        tp=grid.get("tp"),
        multiple_of=grid.get("multiple_of"),
        orders_applied=orders_applied,
        progress=progress,
    )
    problem, sens = done.problem, done.sens
    theirs = plan_picks(problem, source)
    fitness = JointKL(model, batches, problem.groups + problem.rests)
    measured = [
        plan_kl(fitness, [REMOVED if p is None else p for p in picks])
        for picks in (theirs, done.choice.picks)
    ]
    predicted = [_summed(problem, sens, picks) for picks in (theirs, done.choice.picks)]
    done.report.extra["servability"] = {
        "heterogeneous_plan": str(plan) if not isinstance(plan, Mapping) else None,
        "predicted": {
            "heterogeneous": predicted[0],
            "servable": predicted[1],
            "cost": predicted[1] - predicted[0],
        },
        "measured_kl": {
            "heterogeneous": measured[0],
            "servable": measured[1],
            "cost": measured[1] - measured[0],
        },
        "windows": len(fitness.windows),
    }
    done.plan["snapped_from"] = done.report.extra["servability"]["heterogeneous_plan"]
    return done.plan, done.report.as_dict()


def _snap_options(source: Mapping[str, Any], sensitivity: str) -> tuple[PlanOptions, dict[str, Any]]:
    """The options of a plan file's search: its budgets (as given) and grid."""
    budgets = {name: (entry or {}).get("given") for name, entry in (source.get("budgets") or {}).items()}
    grid = source.get("grid")
    if not budgets or not isinstance(grid, Mapping):
        raise ValueError(
            "--snap-servable takes a plan written by `gdnprune plan` (it records its budgets and grid); "
            "this plan has no 'budgets' or 'grid'"
        )
    unknown = sorted(set(budgets) - set(BUDGET_NAMES))
    if unknown:
        raise ValueError(f"the plan's budgets {unknown} are unknown; expected some of {list(BUDGET_NAMES)}")
    given: dict[str, Any] = {f"budget_{name}": value for name, value in budgets.items()}
    options = PlanOptions(
        **given,
        context=grid.get("context"),
        blocks=tuple(b for b in grid.get("blocks") or BLOCK_NAMES if b != "hidden"),
        sensitivity=sensitivity,
        dim_step=grid.get("dim_step", "1/8"),
        axes=tuple(grid.get("axes") or AXES),
        servable=True,
    )
    return options, dict(grid)


def plan_picks(problem: PlanProblem, plan: Mapping[str, Any]) -> list[int | None]:
    """A plan file's choice as the problem's picks (None where its decoder layer is removed).

    Raises:
        ValueError: a target that is not one of its group's candidates, or a removal the problem cannot make.
    """
    entries, default = plan["layers"], plan.get("default") or {}
    removed = set(plan.get("removed_layers") or [])
    if removed and not problem.rests:
        raise ValueError(f"the plan removes decoder layers {sorted(removed)}, but depth is not planned")
    picks: list[int | None] = []
    for i, layer in enumerate(problem.layers):
        key = problem.key_of[layer.prefix]
        fields = entries.get(key) or {k: v for k, v in default.items() if k in TARGET_FIELDS}
        want = resolve_target(layer.shape, fields) if fields else layer.shape
        picks.append(_index_of(want, [c.target for c in problem.table[i]], key, layer_index_of(key), removed))
    for b in problem.blocks:
        key = problem.key_of.get(b.prefix, b.prefix)
        full = block_entry(b, b.shape)
        want = {**full, **{k: v for k, v in default.items() if k in full}, **entries.get(key, {})}
        picks.append(
            _index_of(want, [block_entry(b, t) for t in b.candidates], key, layer_index_of(key), removed)
        )
    picks += [None if r.index in removed else 0 for r in problem.rests]
    return picks


def _index_of(want: Any, candidates: list, key: str, layer: int, removed: set[int]) -> int | None:
    if layer in removed:
        return None
    if want not in candidates:
        raise ValueError(
            f"{key}: the plan's target {want} is not on the search grid; snap a plan of this grid"
        )
    return candidates.index(want)


def _summed(problem: PlanProblem, sens: Sensitivities, picks: Sequence[int | None]) -> float:
    """The predicted (summed) sensitivity of ``picks``: the width groups' and the removals'."""
    widths = sum(v[p] for v, p in zip(sens.values, picks) if p is not None)
    gone = {problem.layer_of[g] for g, p in enumerate(picks) if p is None} if problem.layer_of else set()
    kl = sens.removal_kl()
    return float(widths + sum(kl[i] for i in gone))
