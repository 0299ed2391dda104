"""The plan's results as objects: what was measured, what was chosen, and the plan file and report they make.

:class:`Sensitivities` is the measure stage's result (per width group and candidate: KL, loss, windows,
survivors; per decoder layer: the removal's KL), :class:`Choice` the choose stage's (a candidate per group,
None where its decoder layer is removed; the evolutionary search's record, kept under the file key
``evolution``). :func:`plan_document` writes the plan file
(:mod:`gdnprune.io.plan_file`) and :class:`PlanReport` (of :class:`GroupReport` and :class:`CandidateReport`) the
report, both as plain JSON-ready dicts.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ...io.plan_file import PLAN_FORMAT, PLAN_VERSION, kernel_warnings
from ..choose.depth import DepthCheck
from ..measure.problem import STATE_BYTES, PlanProblem, block_entry

__all__ = [
    "CandidateReport",
    "Choice",
    "GroupReport",
    "MeasureStats",
    "PlanReport",
    "RemovalReport",
    "Sensitivities",
    "plan_document",
]


@dataclass(frozen=True)
class MeasureStats:
    """What the measured sensitivity cost: the teacher's loss, tokens, partial forwards (and halving's rungs)."""

    base_loss: float
    tokens: int
    forwards: int
    rungs: list[int] | None = None
    #: the teacher pass (one forward over the calibration batches): the unit of the cost line
    teacher_seconds: float | None = None
    #: blockwise local distillation: steps, lr and every candidate's block error before and after
    bld: dict[str, Any] | None = None

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"base_loss": self.base_loss, "tokens": self.tokens, "forwards": self.forwards}
        if self.rungs is not None:
            out["rungs"] = self.rungs
        if self.teacher_seconds is not None:
            out["teacher_seconds"] = self.teacher_seconds
        if self.bld is not None:
            out["bld"] = self.bld
        return out


@dataclass
class Sensitivities:
    """The measure stage: per width group (GDN layers, then sub-blocks) and candidate, the sensitivity (KL per
    token, or the proxy) and, when measured, the loss; with successive halving, the windows each candidate was
    measured on and the survivors; with depth, per decoder layer the (KL, loss) of its removal."""

    values: list[list[float]]
    seconds: float
    losses: list[list[float]] | None = None
    windows: list[list[int]] | None = None
    survivors: list[list[bool]] | None = None
    removal: dict[int, tuple[float, float]] | None = None
    stats: MeasureStats | None = None

    def removal_kl(self) -> dict[int, float]:
        """Decoder layer -> the KL of its removal."""
        return {i: v[0] for i, v in (self.removal or {}).items()}


@dataclass
class Choice:
    """The choose stage: a candidate per group (rests included), None where its decoder layer is removed."""

    picks: list[int | None]
    removed: list[int] = field(default_factory=list)
    evolution: dict[str, Any] | None = None
    depth_check: DepthCheck | None = None  # depth against the best widths-only plan, when it removed a layer

    def width_picks(self, problem: PlanProblem) -> list[int | None]:
        """The picks of the width groups (GDN layers, then sub-blocks)."""
        return self.picks[: len(problem.groups)]


@dataclass(frozen=True)
class CandidateReport:
    """One candidate of a group in the report: its target, its costs, its sensitivity (and loss, windows)."""

    target: dict[str, int]
    costs: dict[str, float]
    sensitivity: float
    loss: float | None = None
    windows: int | None = None
    survivor: bool | None = None

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"target": self.target, **self.costs, "sensitivity": self.sensitivity}
        if self.loss is not None:
            out["loss"] = self.loss
        if self.survivor is not None:
            out.update(windows=self.windows, survivor=self.survivor)
        return out


@dataclass(frozen=True)
class GroupReport:
    """One width group in the report: its full shape, the chosen candidate (None: removed), every candidate."""

    shape: dict[str, int]
    chosen: int | None
    candidates: list[CandidateReport]
    kind: str | None = None  # sub-blocks name their kind

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {} if self.kind is None else {"kind": self.kind}
        out.update(shape=self.shape, chosen=self.chosen)
        if self.chosen is None:
            out["removed"] = True
        out["candidates"] = [c.as_dict() for c in self.candidates]
        return out


@dataclass(frozen=True)
class RemovalReport:
    """One decoder layer's removal candidate: its KL and loss, block influence, costs, and whether chosen."""

    layer: int
    removed: bool
    costs: dict[str, float]
    sensitivity: float | None = None
    loss: float | None = None
    block_influence: float | None = None

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"layer": self.layer, "removed": self.removed}
        if self.sensitivity is not None:
            out.update(sensitivity=self.sensitivity, loss=self.loss, block_influence=self.block_influence)
        out.update(self.costs)
        return out


@dataclass
class PlanReport:
    """The plan's report (``PLAN.sensitivity.json``): how sensitivity was measured and every candidate."""

    sensitivity: str
    seconds: float
    layers: dict[str, GroupReport]
    stats: MeasureStats | None = None
    evolution: dict[str, Any] | None = None
    blocks: dict[str, GroupReport] | None = None
    removal: dict[str, RemovalReport] | None = None
    depth_check: DepthCheck | None = None
    extra: dict[str, Any] = field(default_factory=dict)  # sections added by later stages (servable, latency)

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"sensitivity": self.sensitivity, "seconds": round(self.seconds, 3)}
        if self.stats is not None:
            out.update(self.stats.as_dict())
        if self.evolution is not None:
            out["evolution"] = {k: v for k, v in self.evolution.items() if k not in ("picks", "population")}
        out["layers"] = {k: v.as_dict() for k, v in self.layers.items()}
        if self.blocks is not None:
            out["blocks"] = {k: v.as_dict() for k, v in self.blocks.items()}
        if self.removal is not None:
            out["removal"] = {k: v.as_dict() for k, v in self.removal.items()}
        if self.depth_check is not None:
            out["depth_check"] = self.depth_check.as_dict()
        out.update(self.extra)
        return out


def _candidates(
    problem: PlanProblem, sens: Sensitivities, g: int, targets: Sequence[dict], costs: Sequence[dict]
) -> list[CandidateReport]:
    """The report's candidates of width group ``g``."""
    return [
        CandidateReport(
            target=t,
            costs=c,
            sensitivity=sens.values[g][k],
            loss=None if sens.losses is None else sens.losses[g][k],
            windows=None if sens.windows is None else sens.windows[g][k],
            survivor=None if sens.survivors is None else sens.survivors[g][k],
        )
        for k, (t, c) in enumerate(zip(targets, costs))
    ]


def build_report(
    problem: PlanProblem,
    sensitivity: str,
    sens: Sensitivities,
    choice: Choice,
    influence: Mapping[int, float] | None,
) -> PlanReport:
    """The report of every candidate of every group (and of every removal, with ``influence``, the block
    influence of every decoder layer)."""
    n, picks = len(problem.layers), choice.picks
    layers = {
        problem.key_of[layer.prefix]: GroupReport(
            shape=layer.shape.as_dict(),
            chosen=picks[i],
            candidates=_candidates(
                problem,
                sens,
                i,
                [c.target.as_dict() for c in problem.table[i]],
                [{"params": c.params, "state_bytes": c.state * STATE_BYTES} for c in problem.table[i]],
            ),
        )
        for i, layer in enumerate(problem.layers)
    }
    whole_costs = problem.whole_costs or {}
    blocks = {
        problem.key_of.get(b.prefix, b.prefix): GroupReport(
            kind=b.block.kind,
            shape=b.shape.as_dict(),
            chosen=picks[n + j],
            candidates=_candidates(
                problem,
                sens,
                n + j,
                [block_entry(b, t) for t in b.candidates],
                [
                    {name: table[n + j][k] for name, table in whole_costs.items()}
                    for k in range(len(b.candidates))
                ],
            ),
        )
        for j, b in enumerate(problem.blocks)
    }
    return PlanReport(
        sensitivity=sensitivity,
        seconds=sens.seconds,
        stats=sens.stats,
        evolution=choice.evolution,
        layers=layers,
        blocks=blocks or None,
        removal=_removal_report(problem, sens, choice, influence) if problem.rests else None,
        depth_check=choice.depth_check,
    )


def _removal_report(
    problem: PlanProblem, sens: Sensitivities, choice: Choice, influence: Mapping[int, float] | None
) -> dict[str, RemovalReport]:
    """Per decoder layer: the removal candidate (KL and loss with the layer alone skipped, block influence, what
    the whole layer costs on every budget) and whether it was chosen."""
    keys, costs = problem.decoder_keys(), problem.layer_costs or {}
    out = {}
    for r in problem.rests:
        measured = sens.removal is not None
        out[keys[r.index]] = RemovalReport(
            layer=r.index,
            removed=r.index in choice.removed,
            costs={name: costs[name][r.index] for name in costs},
            sensitivity=sens.removal[r.index][0] if measured and sens.removal is not None else None,
            loss=sens.removal[r.index][1] if measured and sens.removal is not None else None,
            block_influence=(influence or {}).get(r.index) if measured else None,
        )
    return out


def plan_document(
    problem: PlanProblem,
    sensitivity: str,
    uniform: bool,
    sens: Sensitivities,
    choice: Choice,
    scores: Mapping[str, Any],
) -> dict[str, Any]:
    """The plan file (:mod:`gdnprune.io.plan_file`, version 2): the chosen targets, budgets, predicted sensitivity,
    totals, the grid and the scores it was searched on (``scores``: ``{"sha256", "method"}``)."""
    picks = choice.picks
    entries = problem.entries(picks)
    keys = problem.decoder_keys() if problem.rests else {}
    entries.update({keys[i]: {"removed": True} for i in choice.removed})
    plan: dict[str, Any] = {
        "format": PLAN_FORMAT,
        "version": PLAN_VERSION,
        "layers": entries,
        "sensitivity": sensitivity,
        "uniform": bool(uniform),
        "budgets": problem.budget_record(),
    }
    if choice.evolution:
        plan["evolved"] = {
            k: choice.evolution[k] for k in ("generations", "offspring", "seed", "seed_kl", "kl", "windows")
        }
    plan["predicted"] = _predicted(problem, sens, choice)
    plan["totals"] = problem.totals_record(picks)
    grid: dict[str, Any] = {
        "dim_step": str(problem.grid.step),
        "axes": list(problem.grid.axes),
        "tp": problem.grid.tp,
        "multiple_of": problem.grid.multiple_of,
    }
    if problem.grid.snap_quant:
        grid["snap_quant"] = problem.grid.snap_quant
    if problem.whole:
        grid.update(blocks=problem.planned_kinds(), context=problem.context)
    plan["grid"] = grid
    plan["scores"] = dict(scores)
    chosen = {
        problem.key_of[layer.prefix]: problem.table[i][p].target
        for i, (layer, p) in enumerate(zip(problem.layers, picks))
        if p is not None
    }
    plan["kernel_warnings"] = kernel_warnings(chosen)
    return plan


def _predicted(problem: PlanProblem, sens: Sensitivities, choice: Choice) -> dict[str, Any]:
    """The plan file's ``predicted``: the summed sensitivity of the choice (and the chosen losses, removals)."""
    widths = choice.width_picks(problem)
    removal_kl = sens.removal_kl()
    out: dict[str, Any] = {
        "summed_sensitivity": float(
            sum(v[p] for v, p in zip(sens.values, widths) if p is not None)
            + sum(removal_kl[i] for i in choice.removed)
        )
    }
    if sens.losses:
        out["measured_losses_of_chosen"] = [
            None if p is None else sens.losses[i][p] for i, p in enumerate(widths)
        ]
    if problem.rests:
        out["removed_layers"] = choice.removed
    return out
