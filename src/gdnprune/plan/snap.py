"""Snap a heterogeneous plan to the best servable plan near it (or the best plan whose cut widths fit
quantization tiles, ``snap_quant``), and measure what the constraint costs.

The constrained search (:func:`~gdnprune.plan.api.search` with ``servable`` and/or ``snap_quant``) runs under
the plan's own budgets and grid; both plans are then scored by the same measurements (their summed
sensitivities, where the plan's targets are on the constrained grid) and measured as whole cut models on
the calibration windows (:class:`~gdnprune.plan.measure.joint.JointKL`, one candidate per plan in each group).
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from ..io.plan_file import read_plan
from ..model.geometry import layer_index_of
from ..model.subblock_geometry import resolve_block_target
from ..model.targets import TARGET_FIELDS, resolve_target
from .api import PlanOptions, search
from .choose.evolve import REMOVED
from .measure.candidates import AXES
from .measure.halving import windows_of
from .measure.joint import JointKL, plan_kl
from .measure.problem import BUDGET_NAMES, PlanProblem, block_entry
from .measure.subblocks import BLOCK_NAMES
from .report.results import Sensitivities

__all__ = ["plan_picks", "plan_targets", "snap_servable"]


def snap_servable(
    model: Any,
    batches: Iterable[Any],
    scores: str | Path | Mapping,
    plan: str | Path | Mapping,
    *,
    sensitivity: str = "halving",
    orders_applied: bool = False,
    progress: bool = True,
    servable: bool = True,
    snap_quant: int | None = None,
) -> tuple[dict, dict]:
    """The best servable plan near the heterogeneous ``plan``: under its budgets, on its grid (both read from
    the plan file), by the same sensitivity; returns ``(plan, report)``. The report's ``servability`` gives
    the cost of servability, predicted (summed sensitivities of both plans, from this search's
    measurements) and measured (the KL of each whole cut model against the unpruned one on the calibration
    windows).

    ``snap_quant``: the snapped plan's cut widths also fit quantization tiles of that size
    (:mod:`gdnprune.model.tiles`); with ``servable=False`` that is the only constraint added, and the
    report's ``snap_quant`` gives its cost (predicted where the plan's own targets are on the snapped grid,
    measured always).

    Raises:
        ValueError: a plan with no recorded budgets or grid, or one whose targets are not on the grid.
    """
    source = read_plan(plan)
    if (source.get("default") or {}).get("hidden_size") is not None:
        raise ValueError(
            "the plan cuts the hidden size; a servable plan of the hidden size is searched directly "
            "(`gdnprune plan --servable` with hidden in --blocks), not snapped"
        )
    options, grid = _snap_options(source, sensitivity, servable, snap_quant)
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
    targets = [plan_targets(problem, p) for p in (source, done.plan)]
    measured = _measured(model, batches, problem, targets)
    a, b = ("heterogeneous", "servable") if servable else ("unsnapped", "snapped")
    key = "servability" if servable else "snap_quant"
    report: dict[str, Any] = {
        "heterogeneous_plan": str(plan) if not isinstance(plan, Mapping) else None,
        "predicted": None,
        "measured_kl": {a: measured[0], b: measured[1], "cost": measured[1] - measured[0]},
        "windows": len(windows_of(batches)),
    }
    try:
        summed = [_summed(problem, sens, picks) for picks in (plan_picks(problem, source), done.choice.picks)]
        report["predicted"] = {a: summed[0], b: summed[1], "cost": summed[1] - summed[0]}
    except ValueError:  # the plan's own targets are off the snapped grid: measured only
        pass
    if snap_quant:
        report["snap_quant"] = snap_quant
    done.report.extra[key] = report
    done.plan["snapped_from"] = done.report.extra[key]["heterogeneous_plan"]
    return done.plan, done.report.as_dict()


def _measured(model: Any, batches: list, problem: PlanProblem, plans: list[list[Any]]) -> list[float]:
    """The KL of each plan's whole cut model (one target per group, None where its layer is removed) on the
    calibration windows: one candidate per plan in each group (:class:`JointKL`)."""
    groups = []
    for g, group in enumerate(problem.groups):
        measured = copy.copy(group)
        measured.candidates = [group.shape if t[g] is None else t[g] for t in plans]
        groups.append(measured)
    fitness = JointKL(model, batches, groups + problem.rests)
    n = len(groups)
    return [
        plan_kl(
            fitness,
            [k if t[g] is not None else REMOVED for g in range(n)]
            + [0 if rest is not None else REMOVED for rest in t[n:]],
        )
        for k, t in enumerate(plans)
    ]


def _snap_options(
    source: Mapping[str, Any], sensitivity: str, servable: bool, snap_quant: int | None
) -> tuple[PlanOptions, dict[str, Any]]:
    """The options of a plan file's search: its budgets (as given) and grid, with the constraints asked."""
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
        servable=servable,
        snap_quant=snap_quant or grid.get("snap_quant"),
    )
    return options, dict(grid)


def plan_targets(problem: PlanProblem, plan: Mapping[str, Any]) -> list[Any]:
    """A plan file's target of every group of the problem (None where its decoder layer is removed), then
    one entry per removable layer's rest (None where removed, else the rest).

    Raises:
        ValueError: a target that does not fit its group, or a removal the problem cannot make.
    """
    plan = read_plan(plan)  # removals ({"removed": true} entries) gathered in "removed_layers"
    entries, default = plan["layers"], plan.get("default") or {}
    removed = set(plan.get("removed_layers") or [])
    if removed and not problem.rests:
        raise ValueError(f"the plan removes decoder layers {sorted(removed)}, but depth is not planned")
    out: list[Any] = []
    for layer in problem.layers:
        key = problem.key_of[layer.prefix]
        fields = entries.get(key) or {k: v for k, v in default.items() if k in TARGET_FIELDS}
        gone = layer_index_of(key) in removed
        out.append(None if gone else resolve_target(layer.shape, fields) if fields else layer.shape)
    for b in problem.blocks:
        key = problem.key_of.get(b.prefix, b.prefix)
        want = {k: v for k, v in default.items() if k in block_entry(b, b.shape)} | entries.get(key, {})
        out.append(None if layer_index_of(key) in removed else resolve_block_target(b.block, want))
    return out + [None if r.index in removed else r for r in problem.rests]


def plan_picks(problem: PlanProblem, plan: Mapping[str, Any]) -> list[int | None]:
    """A plan file's choice as the problem's picks (None where its decoder layer is removed).

    Raises:
        ValueError: a target that is not one of its group's candidates, or a removal the problem cannot make.
    """
    targets = plan_targets(problem, plan)
    picks: list[int | None] = []
    for g, group in enumerate(problem.groups):
        key = problem.key_of.get(group.prefix, group.prefix)
        if targets[g] is None:
            picks.append(None)
        elif targets[g] not in group.candidates:
            raise ValueError(
                f"{key}: the plan's target {targets[g]} is not on the search grid; snap a plan of this grid"
            )
        else:
            picks.append(group.candidates.index(targets[g]))
    return picks + [None if t is None else 0 for t in targets[len(picks) :]]


def _summed(problem: PlanProblem, sens: Sensitivities, picks: Sequence[int | None]) -> float:
    """The predicted (summed) sensitivity of ``picks``: the width groups' and the removals'."""
    widths = sum(v[p] for v, p in zip(sens.values, picks) if p is not None)
    gone = {problem.layer_of[g] for g, p in enumerate(picks) if p is None} if problem.layer_of else set()
    kl = sens.removal_kl()
    return float(widths + sum(kl[i] for i in gone))
