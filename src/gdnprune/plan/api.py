"""``plan_model``: the best per-layer widths (and removed layers) under a budget, in four stages.

Build the problem (:mod:`.problem`: candidates per group, their costs, the budgets), measure the candidates'
sensitivity and choose exactly (:mod:`.stages`), and report: the plan file (:mod:`gdnprune.io.plan_file`) and a
report of every candidate (:mod:`.report`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

from ..io.plan_file import PLAN_FORMAT, PLAN_VERSION
from ..io.scores_file import read_scores
from ..model.hidden import hidden_shape
from ..model.latency import Workload, parse_workload
from ..quality.recall_windows import RECALL_SHARE
from ..runtime.deprecation import renamed_keywords
from ..runtime.fileio import file_sha256
from .choose.servable import SERVABLE_NOTE
from .choose.solve import BudgetError, uniform_choices
from .hidden import hidden_problem, search_hidden
from .measure.bld import DEFAULT_STEPS as BLD_STEPS
from .measure.candidates import AXES, parse_dim_step
from .measure.hidden import absolute_budgets, hidden_candidates, hidden_meta_model
from .measure.latency_costs import (
    LatencyCosts,
    add_latency_budget,
    check_latency_floor,
    cut_model_latency,
    fit_latency,
    measure_latency_costs,
)
from .measure.problem import (
    STATE_BYTES,
    WHOLE,
    Grid,
    PlanProblem,
    budget_limit,
    build_problem,
    check_feasible,
    given_budgets,
)
from .measure.recall import RecallCheck, fit_recall, measured_windows, recall_windows_used
from .measure.subblocks import BLOCK_NAMES
from .rank import RANK_LR, RANK_STEPS, RankCost, check_rank_options, rank_plans
from .report.results import Choice, PlanReport, Sensitivities, plan_document
from .stages import (
    check_depth,
    check_sensitivity,
    choose_plan,
    evolve_choice,
    make_report,
    make_servable,
    measure,
)

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

#: how sensitivity is obtained, the default first (``short``: successive halving on the calibration windows
#: as they are, with no recall windows; the default before recall windows)
SENSITIVITIES = ("halving", "short", "measured", "bld", "proxy")


@dataclass(frozen=True)
class PlanOptions:
    """The budgets and search options of :func:`plan_model` (its keyword arguments, same names and defaults),
    as one object: what ``prune`` searches a plan with."""

    budget_params: float | None = None
    budget_gdn_params: float | None = None
    budget_active_params: float | None = None
    budget_memory: float | None = None
    budget_state: float | None = None
    context: int | None = None
    blocks: Sequence[str] = BLOCK_NAMES
    sensitivity: str = "halving"
    dim_step: str | float | int = "1/8"
    axes: Sequence[str] = AXES
    uniform: bool = False
    servable: bool = False
    snap_quant: int | None = None
    budget_latency: float | None = None
    workload: str | None = None
    evolve_generations: int = 0
    evolve_offspring: int = 8
    evolve_seed: int = 0
    rank_by_distill: int = 0
    rank_steps: int = RANK_STEPS
    rank_lr: float = RANK_LR
    bld_steps: int = BLD_STEPS
    hidden_sizes: Sequence[int] | None = None
    keep_recall: float | None = None

    def keywords(self) -> dict[str, Any]:
        """The options as :func:`plan_model`'s keyword arguments."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def whole(self) -> bool:
        """Whether a whole-model budget is given (then the sub-blocks are planned, and scored, too)."""
        return self.budget_latency is not None or any(
            getattr(self, f"budget_{name}") is not None for name in WHOLE
        )

    def recall(self) -> bool:
        """Whether the search measures on recall windows (and ``prune`` scores on them): GDN layers may
        shrink (a GDN budget, or a whole-model one with ``gdn`` in ``blocks``) and the sensitivity is
        measured, not ``short``."""
        gdn = self.budget_state is not None or self.budget_gdn_params is not None
        gdn = gdn or (self.whole() and "gdn" in self.blocks)
        return gdn and self.sensitivity not in ("short", "proxy")

    def parsed_workload(self) -> Workload | None:
        """The workload of the latency budget (None without one). Raises ValueError: a latency budget without
        a workload, a workload without one, or a malformed workload."""
        if self.budget_latency is None:
            if self.workload is not None:
                raise ValueError("`workload` is the workload of `budget_latency`: give both, or neither")
            return None
        if isinstance(self.budget_latency, bool) or not self.budget_latency > 0 or self.budget_latency > 1:
            raise ValueError(
                f"`budget_latency` is a fraction of the unpruned model's latency, in (0, 1]; got {self.budget_latency!r}"
            )
        if self.workload is None:
            raise ValueError(
                "`budget_latency` is a latency at a workload: give `workload` (e.g. prefill:1:2048)"
            )
        return parse_workload(self.workload)


# long: the docstring documents every option; the body gathers them into PlanOptions for search()
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

    Args:
        model: a loaded transformers model with GDN layers (the unsorted model the scores describe).
        batches: calibration batches for the measured sensitivity (unused by ``"proxy"``).
        scores: the scores file (or dict) of ``model``; its orders sort each layer before it is cut, and the
            proxy reads its raw scores.
        budget_params: every parameter of the model (embeddings included) kept: a fraction (<= 1) or a count.
        budget_gdn_params: GDN parameters kept: a fraction of the GDN layers' (<= 1) or a count.
        budget_active_params: parameters used per token (routed experts count ``num_experts_per_tok`` experts'
            weights and every kept router row; without MoE the same as ``budget_params``): a fraction or a count.
        budget_memory: inference memory per sequence, GDN recurrent state (float32) plus the attention
            layers' KV cache at ``context`` tokens (in the model's dtype): a fraction or bytes.
        budget_state: recurrent-state bytes per sequence (float32) kept: a fraction (<= 1) or bytes.
        budget_latency: the latency kept at ``workload``, a fraction (<= 1) of the unpruned model's: every
            candidate block is timed on the model's device (:mod:`.latency_costs`; a whole-model budget); the
            report gives the predicted latency beside the measured latency of the cut model.
        workload: ``PHASE:BATCH:CONTEXT`` of ``budget_latency`` (:func:`gdnprune.model.latency.parse_workload`).
        context: tokens per sequence of ``budget_memory``'s KV cache.
        blocks: what may shrink under a whole-model budget (:data:`~gdnprune.plan.measure.subblocks.BLOCK_NAMES`, all of
            them by default: ``gdn``, ``attention``, ``mlp``, ``shared_expert``, ``experts``, and ``depth`` —
            whole decoder layers removed); also ``hidden``: the hidden size (the residual stream's width, one
            global choice): each size of ``hidden_sizes`` is planned as a model of its own under the same
            budgets, its whole cut model measured against the full model, the least KL kept
            (:mod:`gdnprune.plan.measure.hidden`; the plan's ``default`` then holds ``hidden_size``).
        sensitivity: ``"halving"`` (KL of real cuts, by successive halving: every candidate on a few windows,
            the choice verified on every window, :mod:`.halving`), ``"short"`` (the same on the calibration
            windows as they are; the others, where GDN layers may shrink, measure on recall windows: facts
            of the calibration text written twice into each window, the KL of the second copies counting
            for half, :mod:`.measure.recall`), ``"measured"`` (every candidate on every
            window: the exact reference; removals are measured on every window either way), ``"bld"`` (every
            candidate trained ``bld_steps`` steps to reproduce its unpruned block's output, then measured as
            ``"measured"``: the choice sums recovered losses, :mod:`.bld`) or ``"proxy"`` (output energy
            removed, from the scores; GDN layers only).
        dim_step: head-dim grid step: a fraction of the dim (``"1/8"``) or a channel count.
        axes: the axes the search may cut (:data:`~gdnprune.plan.measure.candidates.AXES`).
        tp, multiple_of: serving constraints every candidate meets.
        snap_quant: tiles of a quantization scheme (e.g. 128): every width a candidate cuts (GDN key and value
            widths, MLP channels, attention heads) is a multiple of it (:mod:`gdnprune.model.tiles`), so that
            every matrix of the plan can be quantized at that size.
        uniform: one geometry per kind of block (all GDN layers one, all MLPs one, all attention layers one,
            ...): the best combination under the budgets (:func:`~gdnprune.plan.choose.solve.choose_uniform`). Its
            choice is exact over the sensitivities it is given; successive halving's rungs serve the
            heterogeneous choice, so ``sensitivity="measured"`` is the exact reference of a uniform plan.
        servable: only plans that stock engines load from a standard config: one geometry per kind of block,
            plus whole decoder layers removed where ``blocks`` has ``depth`` (one full-attention layer kept);
            the exact best such plan (:func:`~gdnprune.plan.choose.servable.choose_servable`). The plan file gives
            the geometries as its ``default``, so a removed layer's blocks do not make the config heterogeneous.
        orders_applied: the model is already sorted by these scores (e.g. a ``gdnprune sort`` output).
        evolve_generations: generations of the evolutionary search over whole plans (:mod:`.evolve`, fitness
            the KL of the whole cut model on the calibration batches) that starts from the exact choice; its
            mutations also remove decoder layers and bring them back when ``depth`` is planned; 0: none.
            (``refine_generations``, ``refine_offspring``, ``refine_seed``: the old names, with a
            ``FutureWarning``.)
        evolve_offspring, evolve_seed: plans tried per generation, and the search's random seed.
        rank_by_distill: rank after a short recovery (:mod:`.rank`): the MILP's ``rank_by_distill`` best
            distinct plans (with the evolutionary search: its best plans), and the best uniform cut, are each distilled
            ``rank_steps`` steps (AdamW at ``rank_lr``) from the model on three quarters of the calibration
            windows; the least KL on the last quarter wins. 0: the exact choice as it is. The report's
            ``ranking`` lists every candidate with its one-shot and recovered KL.
        bld_steps: the blockwise local distillation steps of every candidate with ``sensitivity="bld"``.
        hidden_sizes: with ``hidden`` in ``blocks``, the hidden sizes to try (default: the full size, 7/8 and 3/4
            of it, multiples of ``multiple_of`` or 8; :func:`~gdnprune.plan.measure.hidden.hidden_candidates`).
        keep_recall: the share (in (0, 1]) of the unpruned model's recall the cut model keeps: the greedy
            exact match of the asked-again facts of held-out recall windows, measured on the whole cut model
            (:class:`~gdnprune.plan.measure.recall.RecallCheck`); when the choice keeps less, the
            sensitivities are measured again with a larger share of the KL on recall and the choice made
            again (at most twice); the report's ``recall`` lists every round.
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


@dataclass
class Search:
    """A finished plan search: its problem, measurements and choice, and the plan file and report they make."""

    problem: PlanProblem
    sens: Sensitivities
    choice: Choice
    plan: dict[str, Any]
    report: PlanReport


# long: the stages one after another (build, measure, choose, check depth, evolve, rank, report), each one call
def search(
    model: Any,
    batches: Iterable[Any] | None,
    scores: str | Path | Mapping,
    options: PlanOptions,
    *,
    tp: int | None = None,
    multiple_of: int | None = None,
    orders_applied: bool = False,
    tokenizer: Any = None,
    progress: bool = True,
    on_rank_cost: Callable[[RankCost], None] | None = None,
) -> Search:
    """:func:`plan_model`'s four stages (build, measure, choose, report) with its options as one object."""
    if "hidden" in options.blocks and options.whole():  # the hidden size: an outer choice, each size below
        why = hidden_problem(model, batches, scores, options, orders_applied)
        if why is not None and tuple(options.blocks) != tuple(BLOCK_NAMES):  # asked for by name
            raise ValueError(why)
        if why is None:
            return search_hidden(
                model,
                batches,
                scores,
                options,
                search,
                tp=tp,
                multiple_of=multiple_of,
                orders_applied=orders_applied,
                progress=progress,
            )
    # the default `blocks` leaves the hidden size out where it cannot be planned (hidden_problem says why)
    o = replace(options, blocks=tuple(b for b in options.blocks if b != "hidden"))
    if o.sensitivity not in SENSITIVITIES:
        raise ValueError(f"unknown sensitivity {o.sensitivity!r}; expected one of {list(SENSITIVITIES)}")
    workload = o.parsed_workload()
    data = read_scores(scores)
    problem = build_problem(
        model,
        given_budgets(o.keywords()),
        data["layers"],
        context=o.context,
        blocks=o.blocks,
        grid=Grid(parse_dim_step(o.dim_step), o.axes, tp, multiple_of, o.snap_quant),
        orders_applied=orders_applied,
        uniform=o.uniform or o.servable,
        depth_allowed=o.servable,
        latency=workload is not None,
    )
    check_sensitivity(problem, o.sensitivity)
    if o.evolve_generations and (o.uniform or o.servable or o.sensitivity == "proxy" or batches is None):
        raise ValueError(
            "the evolutionary search (evolve_generations) needs calibration batches, measured sensitivities "
            "and a heterogeneous plan (not --uniform or --servable)"
        )
    _check_keep_recall(o, batches)
    check_rank_options(
        o.rank_by_distill,
        o.rank_steps,
        o.rank_lr,
        heterogeneous=not (o.uniform or o.servable),
        measured=batches is not None and o.sensitivity != "proxy",
    )
    latency = None
    if workload is not None:  # timed before any calibration forward: an unreachable budget is said first
        assert o.budget_latency is not None
        check_latency_floor(model, workload, o.budget_latency)  # the embeddings and LM head alone: cheap
        latency = measure_latency_costs(model, problem, workload, progress=progress)
        add_latency_budget(problem, latency, o.budget_latency)
        check_feasible(problem, o.uniform or o.servable)
    batches = None if batches is None else list(batches)
    share = RECALL_SHARE if recall_windows_used(o.sensitivity, problem) else 0.0
    done: dict[str, Any] = {}

    def measure_and_choose(share: float) -> Choice:
        """The sensitivities on windows with ``share`` of the KL on recall, the exact choice (fitted to the
        latency budget), and depth checked against widths."""
        windows = measured_windows(batches, share, tokenizer)
        sens = measure(
            model,
            windows,
            problem,
            o.sensitivity,
            progress=progress,
            servable=o.servable,
            bld_steps=o.bld_steps,
        )
        fitted: list[dict[str, float]] = []
        if latency is not None and workload is not None:  # the additive prediction checked on the whole model
            choice, fitted = fit_latency(
                model,
                problem,
                latency,
                workload,
                lambda: choose_plan(problem, sens, uniform=o.uniform, servable=o.servable),
            )
        else:
            choice = choose_plan(problem, sens, uniform=o.uniform, servable=o.servable)
        fitted_choice = choice  # the choice the latency fitting measured last
        if choice.removed and windows is not None and not (o.uniform or o.servable):
            choice = check_depth(model, windows, problem, choice, sens)
        done.update(sens=sens, windows=windows, fitted=fitted, fitted_choice=fitted_choice, share=share)
        return choice

    recall_rounds = None
    if o.keep_recall is not None:
        assert batches is not None
        check = RecallCheck.build(model, batches, tokenizer)
        choice, recall_rounds = fit_recall(check, problem, o.keep_recall, share, measure_and_choose)
    else:
        choice = measure_and_choose(share)
    sens, windows = done["sens"], done["windows"]
    fitted, fitted_choice = done["fitted"], done["fitted_choice"]
    if o.evolve_generations:
        assert batches is not None
        choice = evolve_choice(
            model,
            windows,
            problem,
            choice,
            generations=o.evolve_generations,
            offspring=o.evolve_offspring,
            seed=o.evolve_seed,
            progress=progress,
        )
    ranking, depth_check = None, choice.depth_check
    if o.rank_by_distill:
        assert batches is not None
        ranking = rank_plans(
            model,
            batches,
            problem,
            sens,
            choice,
            count=o.rank_by_distill,
            steps=o.rank_steps,
            lr=o.rank_lr,
            on_cost=on_rank_cost,
        )
        choice = ranking.best.choice
    plan = plan_document(
        problem,
        o.sensitivity,
        o.uniform or o.servable,
        sens,
        choice,
        {"sha256": _scores_hash(scores), "method": data.get("method")},
    )
    report = make_report(model, batches, problem, o.sensitivity, sens, choice)
    report.extra["windows"] = _windows_record(done["share"], tokenizer is not None)
    if recall_rounds is not None:
        report.extra["recall"] = {
            "keep": o.keep_recall,
            "rounds": recall_rounds,
            "met": recall_rounds[-1]["met"],
        }
        plan["predicted"]["recall_kept"] = recall_rounds[-1]["kept"]
    report.depth_check = depth_check  # the check of the exact choice, whichever plan the ranking kept
    if ranking is not None:
        report.extra["ranking"] = ranking.as_dict()
        plan["ranked"] = {
            k: report.extra["ranking"][k] for k in ("winner", "steps", "train_windows", "heldout_windows")
        }
    if o.servable:
        make_servable(plan, problem, choice)
        report.extra["servable"] = SERVABLE_NOTE
    if latency is not None and workload is not None:
        measured = _final_latency(model, problem, choice, workload, fitted_choice, fitted)
        record = latency_record(latency, choice, measured)
        record["fitting"] = fitted
        plan["predicted"]["latency"] = {
            k: record[k] for k in ("workload", "predicted_seconds", "predicted_fraction")
        }
        report.extra["latency"] = record
    return Search(problem, sens, choice, plan, report)


def _check_keep_recall(o: PlanOptions, batches: Any) -> None:
    """``keep_recall``: a share in (0, 1], measured on calibration windows, of the exact choice as it is."""
    if o.keep_recall is None:
        return
    if isinstance(o.keep_recall, bool) or not 0 < o.keep_recall <= 1:
        raise ValueError(
            f"`keep_recall` is a share of the unpruned model's recall, in (0, 1]; got {o.keep_recall!r}"
        )
    if batches is None or o.sensitivity == "proxy":
        raise ValueError(
            "`keep_recall` measures the cut model's recall: it needs calibration batches and a measured sensitivity (not proxy)"
        )
    if o.evolve_generations or o.rank_by_distill:
        raise ValueError(
            "`keep_recall` checks the exact choice; the evolutionary search and the ranking would replace it "
            "after the check: give `keep_recall` without `evolve_generations` and `rank_by_distill`"
        )


def _windows_record(share: float, probes: bool) -> dict[str, Any]:
    """The report's ``windows``: what the sensitivities were measured on (``probes``: the calibration windows
    made recall probes, else spans of their text written twice)."""
    if share <= 0:
        return {"kind": "calibration", "recall_share": 0.0}
    return {"kind": "probes" if probes else "spans", "recall_share": share}


def _final_latency(
    model: Any,
    problem: PlanProblem,
    choice: Choice,
    workload: Workload,
    fitted_choice: Choice | None,
    fitted: list[dict[str, float]],
) -> float:
    """The measured latency of the final choice: the fitting's last measurement when the later stages (depth
    check, evolution, ranking) kept the choice it measured, else a measurement of the new one."""
    if fitted and fitted_choice is not None:
        if (choice.picks, choice.removed) == (fitted_choice.picks, fitted_choice.removed):
            return fitted[-1]["measured_seconds"]
    return cut_model_latency(model, problem, choice.picks, choice.removed, workload)


def latency_record(latency: LatencyCosts, choice: Choice, measured: float) -> dict[str, Any]:
    """The report's ``latency``: the unpruned, predicted and measured latency of the cut model, the speed-ups."""
    predicted = latency.predicted(choice.picks, choice.removed)
    return {
        **latency.as_dict(),
        "predicted_seconds": predicted,
        "measured_seconds": measured,
        "predicted_fraction": predicted / latency.whole,
        "measured_fraction": measured / latency.whole,
        "predicted_speedup": latency.whole / predicted,
        "measured_speedup": latency.whole / measured,
    }


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


def _scores_hash(scores: Any) -> str | None:
    return None if isinstance(scores, Mapping) else file_sha256(scores)
