"""The hidden size as one global choice of a plan search, outside the per-layer problem.

Every hidden size of a grid (:func:`~gdnprune.plan.measure.hidden.hidden_candidates`) is planned as a model of
its own (the model sorted by the scores' hidden order and cut to that size): its cost tables are computed on it
and its per-layer widths measured and chosen exactly by the plan search under the FULL model's budgets as
absolute amounts; then every size's whole cut model is measured against the full model on the calibration
windows (:class:`~gdnprune.plan.measure.hidden.WholeKL`), and the least KL wins. The hidden size alone (every
layer whole) is measured too: the hidden cut's own sensitivity. The plan's ``default`` holds the hidden size
chosen and ``hidden`` every size tried; its totals are counted against the full model (:func:`whole_totals`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

from ..io.scores_file import read_scores
from ..model.hidden import HIDDEN_KEY, hidden_shape
from ..model.subblock_surgery import find_model_hidden
from .choose.solve import BudgetError
from .measure.candidates import parse_dim_step
from .measure.hidden import WholeKL, absolute_budgets, hidden_candidates, hidden_cut_model
from .measure.problem import Grid, PlanProblem, build_problem, given_budgets
from .rank import cut_model

__all__ = ["search_hidden", "hidden_problem", "whole_totals"]


def search_hidden(
    model: Any,
    batches: Iterable[Any] | None,
    scores: str | Path | Mapping,
    options: Any,
    search: Callable[..., Any],
    *,
    tp: int | None,
    multiple_of: int | None,
    orders_applied: bool,
    progress: bool,
) -> Any:
    """The search with the hidden size as one global choice (:mod:`.measure.hidden`): every hidden size of
    the grid planned (``search``: :func:`gdnprune.plan.api.search`, with ``options`` less ``hidden``) as a
    model of its own under the full model's budgets, its whole cut model measured against the full model on
    the calibration batches; the least KL kept. Returns that size's ``Search``, its plan with ``hidden``. (Only
    under a whole-model budget, as for the sub-blocks: GDN-only budgets leave ``hidden`` out.)"""
    o = options
    problem = hidden_problem(model, batches, scores, o, orders_applied)
    if problem is not None:
        raise ValueError(problem)
    assert batches is not None  # hidden_problem says so
    batches = list(batches)
    data = read_scores(scores)
    widths = replace(o, blocks=tuple(b for b in o.blocks if b != "hidden"))
    grid = Grid(parse_dim_step(o.dim_step), o.axes, tp, multiple_of, o.snap_quant)
    full = build_problem(
        model,
        given_budgets(o.keywords()),
        None,
        context=o.context,
        blocks=widths.blocks,
        grid=grid,
        orders_applied=True,
        uniform=o.uniform or o.servable,
        depth_allowed=o.servable,
        feasible=False,
    )
    inner = replace(widths, **absolute_budgets(full))
    shape = hidden_shape(model.config)
    whole = WholeKL(model, batches)
    tried: list[dict[str, Any]] = []
    best: tuple[float, int, Any] | None = None
    for size in hidden_candidates(shape, multiple_of=multiple_of, sizes=o.hidden_sizes):
        small = hidden_cut_model(model, data, size, orders_applied=orders_applied)
        entry: dict[str, Any] = {"hidden_size": size}
        try:
            done = search(
                small,
                batches,
                scores,
                inner,
                tp=tp,
                multiple_of=multiple_of,
                orders_applied=orders_applied,
                progress=progress,
            )
        except BudgetError:
            tried.append({**entry, "feasible": False})
            continue
        kl = whole(cut_model(small, done.problem, done.choice))
        entry.update(
            feasible=True,
            hidden_kl=0.0 if small is model else whole(small),
            summed_sensitivity=done.plan["predicted"]["summed_sensitivity"],
            kl=kl,
        )
        tried.append(entry)
        if best is None or kl < best[0]:
            best = (kl, size, done)
    if best is None:
        raise BudgetError(
            f"no plan meets the budgets at any hidden size tried ({[t['hidden_size'] for t in tried]})"
        )
    _, size, done = best
    plan = done.plan
    if size != shape.hidden_size:
        plan["default"] = {**(plan.get("default") or {}), "hidden_size": size}
    plan["hidden"] = {"hidden_size": size, "full_hidden_size": shape.hidden_size, "candidates": tried}
    plan["budgets"] = full.budget_record()
    plan["totals"] = whole_totals(plan["totals"], full)
    plan["grid"]["blocks"] = sorted({*plan["grid"].get("blocks", []), "hidden"})
    done.report.extra["hidden"] = plan["hidden"]
    return done


def hidden_problem(
    model: Any, batches: Any, scores: str | Path | Mapping, options: Any, orders_applied: bool
) -> str | None:
    """Why the hidden size cannot be planned with these inputs (None when it can): the options that do not
    combine with it, no calibration batches, scores without the hidden order, or a model whose residual
    stream the hidden-size table does not describe."""
    o = options
    if o.budget_latency is not None or o.evolve_generations or o.rank_by_distill or o.sensitivity == "proxy":
        return (
            "a plan of the hidden size measures every hidden size's whole cut model against the full model; "
            "it does not combine with `budget_latency`, the evolutionary search, ranking by distillation or "
            "the proxy sensitivity: leave 'hidden' out of `blocks` for those"
        )
    if batches is None:
        return "a plan of the hidden size needs calibration batches"
    if not orders_applied and read_scores(scores).get(HIDDEN_KEY) is None:
        return (
            "the scores have no order of the hidden channels (a 'hidden' entry); score this model with "
            "`blocks` naming 'hidden', or leave 'hidden' out of `blocks`"
        )
    try:
        find_model_hidden(model)
    except ValueError as exc:
        return str(exc)
    return None


def whole_totals(totals: Mapping[str, Any], full: PlanProblem) -> dict[str, Any]:
    """A plan's ``totals`` (counted on the model cut to its hidden size) against the FULL model's totals."""
    out = dict(totals)
    for name, total in (full.totals or {}).items():
        word = "memory_bytes" if name == "memory" else f"model_{name}" if name == "params" else name
        if f"{word}_kept" in out:
            out[word], out[f"{word}_fraction"] = total, out[f"{word}_kept"] / total
    if "split" in out and full.whole:  # every kind's full size, at the full hidden size
        whole = full.model_totals([0] * (len(full.groups) + len(full.rests)))["split"]
        out["split"] = {k: {**v, "params": whole[k]["params"]} for k, v in out["split"].items()}
    if full.layers and "gdn_params_kept" in out:
        out["gdn_params"] = full.gdn_totals["params"]
        out["gdn_params_fraction"] = out["gdn_params_kept"] / full.gdn_totals["params"]
    return out
