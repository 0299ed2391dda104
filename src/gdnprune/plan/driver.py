"""``search``: the plan search's stages one after another on a loaded model — build the problem, measure the
candidates (on recall windows where GDN layers may shrink), choose exactly (fitted to a latency budget, checked
against recall and depth), refine (evolution, ranking after recovery), and write the plan and its report."""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from ..io.scores_file import read_scores
from ..model.kernels import cpu_gdn_kernels
from ..model.latency import Workload
from ..quality.recall_windows import RECALL_SHARE
from ..runtime.fileio import file_sha256
from .choose.servable import SERVABLE_NOTE
from .hidden import hidden_problem, search_hidden
from .measure.candidates import parse_dim_step
from .measure.latency_costs import (
    LatencyCosts,
    add_latency_budget,
    check_latency_floor,
    cut_model_latency,
    fit_latency,
    measure_latency_costs,
)
from .measure.problem import Grid, PlanProblem, build_problem, check_feasible, given_budgets
from .measure.recall import RecallCheck, fit_recall, measured_windows, recall_windows_used
from .measure.subblocks import BLOCK_NAMES
from .options import SENSITIVITIES, PlanOptions
from .rank import RankCost, Ranking, check_rank_options, rank_plans
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

__all__ = ["Search", "latency_record", "search"]


@dataclass
class Search:
    """A finished plan search: its problem, measurements and choice, and the plan file and report they make."""

    problem: PlanProblem
    sens: Sensitivities
    choice: Choice
    plan: dict[str, Any]
    report: PlanReport


@cpu_gdn_kernels()
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
    """:func:`~gdnprune.plan.plan_model`'s stages (build, measure, choose, report) with its options as one
    object."""
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
    data = read_scores(scores)
    problem, workload = _checked_problem(
        model,
        batches,
        data,
        o,
        Grid(parse_dim_step(o.dim_step), o.axes, tp, multiple_of, o.snap_quant),
        orders_applied,
    )
    latency = None
    if workload is not None:  # timed before any calibration forward: an unreachable budget is said first
        assert o.budget_latency is not None
        check_latency_floor(model, workload, o.budget_latency)  # the embeddings and LM head alone: cheap
        latency = measure_latency_costs(model, problem, workload, progress=progress)
        add_latency_budget(problem, latency, o.budget_latency)
        check_feasible(problem, o.uniform or o.servable)
    rounds = Rounds(
        model, None if batches is None else list(batches), problem, o, tokenizer, latency, workload, progress
    )
    share = RECALL_SHARE if recall_windows_used(o.sensitivity, problem) else 0.0
    recall_rounds = None
    if o.keep_recall is not None:
        assert rounds.batches is not None
        check = RecallCheck.build(model, rounds.batches, tokenizer)
        choice, recall_rounds = fit_recall(check, problem, o.keep_recall, share, rounds)
    else:
        choice = rounds(share)
    depth_check = choice.depth_check
    choice, ranking = _refine(rounds, choice, on_rank_cost)
    plan = plan_document(
        problem,
        o.sensitivity,
        o.uniform or o.servable,
        rounds.sens,
        choice,
        {
            "sha256": None if isinstance(scores, Mapping) else file_sha256(scores),
            "method": data.get("method"),
        },
    )
    report = make_report(model, rounds.batches, problem, o.sensitivity, rounds.sens, choice)
    report.depth_check = depth_check  # the check of the exact choice, whichever plan the ranking kept
    _record(rounds, choice, plan, report, recall_rounds, ranking)
    return Search(problem, rounds.sens, choice, plan, report)


def _checked_problem(
    model: Any, batches: Any, data: Mapping, o: PlanOptions, grid: Grid, orders_applied: bool
) -> tuple[PlanProblem, Workload | None]:
    """The search's problem and its latency workload, every option checked against it before a forward."""
    if o.sensitivity not in SENSITIVITIES:
        raise ValueError(f"unknown sensitivity {o.sensitivity!r}; expected one of {list(SENSITIVITIES)}")
    workload = o.parsed_workload()
    problem = build_problem(
        model,
        given_budgets(o.keywords()),
        data["layers"],
        context=o.context,
        blocks=o.blocks,
        grid=grid,
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
    return problem, workload


@dataclass
class Rounds:
    """Measure and choose, as often as the recall check asks: called with the share of the KL on recall, it
    measures the sensitivities on windows with that share, makes the exact choice (fitted to the latency
    budget) and checks depth against widths; the last round's measurements stay on it."""

    model: Any
    batches: list | None
    problem: PlanProblem
    o: PlanOptions
    tokenizer: Any
    latency: LatencyCosts | None
    workload: Workload | None
    progress: bool
    sens: Any = None
    windows: Any = None
    share: float = 0.0
    fitted: list[dict[str, float]] = field(default_factory=list)
    fitted_choice: Choice | None = None  # the choice the latency fitting measured last

    def __call__(self, share: float) -> Choice:
        o, problem = self.o, self.problem
        windows = measured_windows(self.batches, share, self.tokenizer)
        sens = measure(
            self.model,
            windows,
            problem,
            o.sensitivity,
            progress=self.progress,
            servable=o.servable,
            bld_steps=o.bld_steps,
        )
        fitted: list[dict[str, float]] = []
        exact = functools.partial(choose_plan, problem, sens, uniform=o.uniform, servable=o.servable)
        if (
            self.latency is not None and self.workload is not None
        ):  # the prediction checked on the whole model
            choice, fitted = fit_latency(self.model, problem, self.latency, self.workload, exact)
        else:
            choice = exact()
        self.fitted_choice = choice
        if choice.removed and windows is not None and not (o.uniform or o.servable):
            choice = check_depth(self.model, windows, problem, choice, sens)
        self.sens, self.windows, self.fitted, self.share = sens, windows, fitted, share
        return choice


def _refine(
    rounds: Rounds, choice: Choice, on_rank_cost: Callable[[RankCost], None] | None
) -> tuple[Choice, Ranking | None]:
    """The exact choice refined: by the evolutionary search on whole cut models, then by the ranking after a
    short recovery (each when asked)."""
    o = rounds.o
    if o.evolve_generations:
        assert rounds.batches is not None
        choice = evolve_choice(
            rounds.model,
            rounds.windows,
            rounds.problem,
            choice,
            generations=o.evolve_generations,
            offspring=o.evolve_offspring,
            seed=o.evolve_seed,
            progress=rounds.progress,
        )
    if not o.rank_by_distill:
        return choice, None
    assert rounds.batches is not None
    ranking = rank_plans(
        rounds.model,
        rounds.batches,
        rounds.problem,
        rounds.sens,
        choice,
        count=o.rank_by_distill,
        steps=o.rank_steps,
        lr=o.rank_lr,
        on_cost=on_rank_cost,
    )
    return ranking.best.choice, ranking


def _record(
    rounds: Rounds,
    choice: Choice,
    plan: dict[str, Any],
    report: PlanReport,
    recall_rounds: list[dict] | None,
    ranking: Ranking | None,
) -> None:
    """What the plan and its report record of the windows, the recall check, the ranking, servability and
    latency."""
    o = rounds.o
    report.extra["windows"] = _windows_record(rounds.share, rounds.tokenizer is not None)
    if recall_rounds is not None:
        report.extra["recall"] = {
            "keep": o.keep_recall,
            "rounds": recall_rounds,
            "met": recall_rounds[-1]["met"],
        }
        plan["predicted"]["recall_kept"] = recall_rounds[-1]["kept"]
    if ranking is not None:
        report.extra["ranking"] = ranking.as_dict()
        plan["ranked"] = {
            k: report.extra["ranking"][k] for k in ("winner", "steps", "train_windows", "heldout_windows")
        }
    if o.servable:
        make_servable(plan, rounds.problem, choice)
        report.extra["servable"] = SERVABLE_NOTE
    if rounds.latency is not None and rounds.workload is not None:
        measured = _final_latency(rounds, choice)
        record = latency_record(rounds.latency, choice, measured)
        record["fitting"] = rounds.fitted
        plan["predicted"]["latency"] = {
            k: record[k] for k in ("workload", "predicted_seconds", "predicted_fraction")
        }
        report.extra["latency"] = record


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


def _final_latency(rounds: Rounds, choice: Choice) -> float:
    """The measured latency of the final choice: the fitting's last measurement when the later stages (depth
    check, evolution, ranking) kept the choice it measured, else a measurement of the new one."""
    fitted, last = rounds.fitted, rounds.fitted_choice
    if fitted and last is not None and (choice.picks, choice.removed) == (last.picks, last.removed):
        return fitted[-1]["measured_seconds"]
    assert rounds.workload is not None
    return cut_model_latency(rounds.model, rounds.problem, choice.picks, choice.removed, rounds.workload)


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
