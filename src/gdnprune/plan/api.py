"""``plan_model``: the best per-layer widths (and removed layers) under a budget, in four stages.

Build the problem (:mod:`.problem`: candidates per group, their costs, the budgets), measure the candidates'
sensitivity and choose exactly (:mod:`.stages`), and report: the plan file (:mod:`gdnprune.io.plan_file`) and a
report of every candidate (:mod:`.report`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from ..io.plan_file import PLAN_FORMAT, PLAN_VERSION
from ..model.hidden import hidden_shape
from ..runtime.deprecation import renamed_keywords
from .choose.solve import BudgetError, uniform_choices
from .driver import search
from .measure.bld import DEFAULT_STEPS as BLD_STEPS
from .measure.candidates import AXES, parse_dim_step
from .measure.hidden import absolute_budgets, hidden_candidates, hidden_meta_model
from .measure.problem import (
    STATE_BYTES,
    Grid,
    PlanProblem,
    budget_limit,
    build_problem,
    given_budgets,
)
from .measure.subblocks import BLOCK_NAMES
from .options import SENSITIVITIES, PlanOptions
from .rank import RANK_LR, RANK_STEPS, RankCost

__all__ = [
    "PlanOptions",
    "SENSITIVITIES",
    "STATE_BYTES",
    "BudgetError",
    "budget_limit",
    "check_budgets",
    "plan_model",
    "search",
    "uniform_plans",
]


@renamed_keywords(
    refine_generations="evolve_generations", refine_offspring="evolve_offspring", refine_seed="evolve_seed"
)
def plan_model(
    model: Any,
    batches: Iterable[Any] | None,
    scores: str | Path | Mapping,
    *,
    budget_params: float | None = None,
    budget_gdn_params: float | None = None,
    budget_active_params: float | None = None,
    budget_memory: float | None = None,
    budget_state: float | None = None,
    budget_latency: float | None = None,
    workload: str | None = None,
    context: int | None = None,
    blocks: Sequence[str] = BLOCK_NAMES,
    sensitivity: str = "halving",
    dim_step: str | float | int = "1/8",
    axes: Sequence[str] = AXES,
    tp: int | None = None,
    multiple_of: int | None = None,
    uniform: bool = False,
    servable: bool = False,
    snap_quant: int | None = None,
    orders_applied: bool = False,
    evolve_generations: int = 0,
    evolve_offspring: int = 8,
    evolve_seed: int = 0,
    rank_by_distill: int = 0,
    rank_steps: int = RANK_STEPS,
    rank_lr: float = RANK_LR,
    bld_steps: int = BLD_STEPS,
    hidden_sizes: Sequence[int] | None = None,
    keep_recall: float | None = None,
    tokenizer: Any = None,
    progress: bool = True,
    on_rank_cost: Callable[[RankCost], None] | None = None,
) -> tuple[dict, dict]:
    """Choose every GDN layer's target, and every sub-block's, under the budgets; returns ``(plan, report)``.

    With only GDN budgets (``budget_gdn_params``, ``budget_state``) only GDN layers are cut. With a
    whole-model budget (``budget_params``, ``budget_active_params``, ``budget_memory``) every sub-block of
    ``blocks`` is a candidate group too (:mod:`.subblocks`: attention heads, MLP and shared-expert channels,
    routed-expert counts), and with ``"depth"`` in ``blocks`` every decoder layer may also be removed (a
    candidate of cost 0 whose sensitivity is the KL with that layer alone skipped, :mod:`.depth`); one exact
    MILP chooses all of them. A removed layer is ``{"removed": true}`` in the plan file.

    The budgets and search options are the fields of :class:`PlanOptions`, the same names and defaults, each
    documented there.

    Args:
        model: a loaded transformers model with GDN layers (the unsorted model the scores describe).
        batches: calibration batches for the measured sensitivity (unused by ``"proxy"``).
        scores: the scores file (or dict) of ``model``; its orders sort each layer before it is cut, and the
            proxy reads its raw scores.
        tp, multiple_of: serving constraints every candidate meets.
        orders_applied: the model is already sorted by these scores (e.g. a ``gdnprune sort`` output).
        tokenizer: the model's tokenizer: the recall windows are then the calibration windows made recall
            probes (passkey, MQAR) with their own text as the haystack; without it, spans of their text
            written twice.
        progress: progress bars over the measured candidates and the search's generations.
        on_rank_cost: called with the ranking's cost (:class:`~gdnprune.plan.rank.RankCost`) before it
            starts, and with the estimate in seconds after its first step.

    When the chosen plan removes a decoder layer, the KL of its whole cut model on the calibration windows is
    measured against the best widths-only plan's, and the better is kept (the report's ``depth_check``).

    Returns:
        The plan (a :mod:`gdnprune.io.plan_file` dict with the budgets, the predicted summed sensitivity and the
        totals) and the report (every candidate of every layer: target, parameters, state, sensitivity,
        loss, and the chosen one).

    Raises:
        ValueError: bad options, a scores file that does not fit the model, or budgets no plan meets
            (:class:`~gdnprune.plan.choose.solve.BudgetError`).
    """
    options = PlanOptions(
        budget_params=budget_params,
        budget_gdn_params=budget_gdn_params,
        budget_active_params=budget_active_params,
        budget_memory=budget_memory,
        budget_state=budget_state,
        budget_latency=budget_latency,
        workload=workload,
        context=context,
        blocks=blocks,
        sensitivity=sensitivity,
        dim_step=dim_step,
        axes=axes,
        uniform=uniform,
        servable=servable,
        snap_quant=snap_quant,
        evolve_generations=evolve_generations,
        evolve_offspring=evolve_offspring,
        evolve_seed=evolve_seed,
        rank_by_distill=rank_by_distill,
        rank_steps=rank_steps,
        rank_lr=rank_lr,
        bld_steps=bld_steps,
        hidden_sizes=hidden_sizes,
        keep_recall=keep_recall,
    )
    done = search(
        model,
        batches,
        scores,
        options,
        tp=tp,
        multiple_of=multiple_of,
        orders_applied=orders_applied,
        tokenizer=tokenizer,
        progress=progress,
        on_rank_cost=on_rank_cost,
    )
    return done.plan, done.report.as_dict()


def _options_problem(
    model: Any, options: Mapping[str, Any], uniform: bool, feasible: bool = True
) -> PlanProblem:
    """The problem of :func:`plan_model`'s keyword ``options`` without scores (orders taken as applied)."""
    servable = bool(options.get("servable"))
    workload = PlanOptions(
        budget_latency=options.get("budget_latency"), workload=options.get("workload")
    ).parsed_workload()
    return build_problem(
        model,
        given_budgets(options),
        None,
        context=options.get("context"),
        blocks=options.get("blocks", BLOCK_NAMES),
        grid=Grid(
            parse_dim_step(options.get("dim_step", "1/8")),
            options.get("axes", AXES),
            options.get("tp"),
            options.get("multiple_of"),
            options.get("snap_quant"),
        ),
        orders_applied=True,
        uniform=uniform or servable,
        depth_allowed=servable,
        latency=workload is not None,
        feasible=feasible,
    )


def uniform_plans(model: Any, *, maximal: bool = True, **options: Any) -> list[dict]:
    """Every uniform plan of ``model`` that meets the budgets, without a forward (weights not needed: a
    ``meta`` model will do): one geometry per kind of block (:func:`~gdnprune.plan.choose.solve.uniform_choices`;
    with ``maximal``, only those where no single kind can take a larger geometry within the budgets).

    ``options``: the budgets and grid options of :func:`plan_model` (``budget_params``, ``blocks``,
    ``dim_step``, ``context``, ...); the others are ignored. Each plan is a plan-file dict (``layers`` keyed
    by the model's module prefixes; ``slice_model`` or ``gdnprune slice --plan`` take it) with its
    ``totals`` (kept amounts per budget, the split over sub-blocks) and no sensitivity.
    """
    problem = _options_problem(model, options, uniform=True)
    plans = []
    for picks in uniform_choices(
        problem.keys, problem.costs, problem.budgets, kinds=problem.kinds, maximal=maximal
    ):
        totals = problem.model_totals(picks)
        if problem.layers:
            kept = problem.gdn_kept(picks)
            totals.update(
                gdn_params=problem.gdn_totals["params"],
                gdn_params_kept=kept["params"],
                state_bytes=problem.gdn_totals["state"],
                state_bytes_kept=kept["state"],
            )
        plans.append(
            {
                "format": PLAN_FORMAT,
                "version": PLAN_VERSION,
                "layers": problem.entries(picks),
                "uniform": True,
                "budgets": problem.budget_record(),
                "totals": totals,
            }
        )
    return plans


def check_budgets(model: Any, *, uniform: bool = False, **options: Any) -> None:
    """Raise :class:`~gdnprune.plan.choose.solve.BudgetError` when no plan of ``model`` (weights not needed: a
    ``meta`` model will do) meets the budgets; ``options``: those of :func:`plan_model` (budgets, ``context``,
    ``blocks``, ``dim_step``, ``axes``, ``tp``, ``multiple_of``), the others are ignored. With ``hidden`` in
    ``blocks``, a plan at the smallest hidden size of the grid will do."""
    try:
        _options_problem(model, options, uniform=uniform)
    except BudgetError:
        if "hidden" not in options.get("blocks", BLOCK_NAMES):
            raise
        full = _options_problem(model, options, uniform=uniform, feasible=False)
        sizes = hidden_candidates(
            hidden_shape(model.config),
            multiple_of=options.get("multiple_of"),
            sizes=options.get("hidden_sizes"),
        )
        _options_problem(hidden_meta_model(model, sizes[-1]), {**options, **absolute_budgets(full)}, uniform)
