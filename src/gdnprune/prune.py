"""``prune``: score a checkpoint folder, plan per-layer widths if asked, then sort and slice in one pass."""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable, Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

from transformers import AutoTokenizer

from .checkpoint import find_gdn_layers, open_checkpoint, transform_checkpoint
from .checkpoint.folder import map_to_checkpoint, tile_size
from .checkpoint.hidden import split_hidden_target
from .checkpoint.output import check_paths, clear_stale
from .checkpoint.remote_code import auto_map
from .checkpoint.subblocks import plan_sub_blocks, split_target
from .io.loading import empty_causal_lm, load_causal_lm, slice_model
from .io.plan_file import PlanError, plan_hidden_size, read_plan, resolve_plan, servable_problems
from .io.scores_file import load_scores
from .model.geometry import layer_index_of
from .model.hidden import HIDDEN_KEY
from .model.layouts import find_gdn_modules
from .model.targets import TargetError, keyword_target, resolve_target
from .plan import PlanOptions, check_budgets, plan_checkpoint
from .plan.measure.latency_costs import check_latency_floor
from .plan.measure.subblocks import BLOCK_NAMES
from .quality.calibration import calibration_windows, iter_batches
from .quality.compensate import sequential_refit
from .quality.recall_windows import recall_windows
from .runtime.deprecation import folded_keywords, renamed_keywords
from .runtime.distributed import fail_together, local_gpus
from .runtime.fileio import file_sha256
from .scoring import GDN_ONLY, SCORED_BLOCKS, ScoringOptions, score_checkpoint

__all__ = ["prune_checkpoint"]


@renamed_keywords(
    refine=("lane_search", lambda refine: refine == "lanes"), refine_samples="lane_search_samples"
)
@folded_keywords("scoring", ScoringOptions)
@keyword_target(paths=3)
def prune_checkpoint(
    model_dir: str | Path,
    data: str | Path,
    output_dir: str | Path,
    *,
    target: Any = None,
    plan: str | Path | Mapping | None = None,
    scores: str | Path | None = None,
    search: PlanOptions | None = None,
    scoring: ScoringOptions | None = None,
    plan_samples: int = 16,
    tp: int | None = None,
    multiple_of: int | None = None,
    snap_quant: int | None = None,
    compensate: bool | str | None = None,
    overwrite: bool = False,
    progress: bool = True,
    self_contained: bool = False,
    servable: bool = False,
    on_rank_cost: Callable[[Any], None] | None = None,
) -> dict[str, Any]:
    """Score ``model_dir`` on ``data``, then sort and cut every GDN layer in one streaming pass.

    The cut is one of: ``target`` (a ``GDNShape`` or some of its fields, for every layer; the sub-block
    fields ``intermediate_size``, ``shared_expert_intermediate_size``, ``num_attention_heads`` and
    ``num_key_value_heads`` also score, sort and cut the MLPs and attention layers), ``plan`` (a plan
    file or dict, :mod:`gdnprune.io.plan_file`), or ``search`` — a :class:`~gdnprune.plan.PlanOptions` (the budgets
    and search options of :func:`gdnprune.plan.plan_model`): the plan is then searched on the fresh scores
    with ``plan_samples`` calibration windows (where the search measures on recall windows,
    :meth:`~gdnprune.plan.PlanOptions.recall`, the scores are taken on them too, each window followed by a
    recall probe: the orders then keep what recall needs). ``scoring``: how the model is scored, a
    :class:`~gdnprune.scoring.ScoringOptions` (:func:`gdnprune.scoring.score_checkpoint`'s options; default:
    its defaults); its ``seq_len``, ``batch_size``, ``device``, ``dtype`` and ``device_map`` serve the plan
    search and the sequential refit too (the old keywords ``method=``, ``num_samples=``, ... still work, with
    a ``FutureWarning``). ``compensate`` (``True`` or ``"statistics"``) collects the
    least-squares statistics in the scoring pass and refits every cut layer's ``out_proj``
    (:mod:`gdnprune.quality.compensate`); ``"sequential"``, once the target or plan is known, cuts the model in
    memory and refits ``out_proj`` layer by layer on the cut model's own hidden states
    (:func:`gdnprune.quality.compensate.sequential_refit`; both models in memory, no ``device_map``), on the
    scoring run's windows, made recall windows where the scores were (the least squares weighted as the plan's
    KL: the text and the probes' answers); ``False`` or ``"none"``: no refit. The default (None) is
    ``"sequential"`` where the plan is searched on recall windows (:meth:`~gdnprune.plan.PlanOptions.recall`),
    the scores were taken on them too and the refit can run (a GDN budget alone, no ``device_map``, no
    ``snap_quant``), none elsewhere (``docs/scoring.md``).
    ``self_contained``: the output also loads with transformers alone (:mod:`gdnprune.checkpoint.remote_code`).
    ``snap_quant``: every width the cut changes fits quantization tiles of that size: a target's or a plan's
    widths are snapped up (:func:`gdnprune.checkpoint.transform_checkpoint`'s ``snap_quant``); a ``search``
    (which then takes it as its own ``snap_quant``) is run without it, then snapped to the best plan under the
    same budgets whose widths fit (:func:`gdnprune.plan.snap.snap_servable`), both measured as whole cut
    models: the report's ``snap_quant`` is what the tiles cost.
    ``servable``: the output must load from a standard config (one geometry per kind of block): a ``plan`` that
    needs ``per_layer_config`` is refused before any model loads (a ``search`` takes its own ``servable``).
    ``scores``: a scores file of ``model_dir`` to sort by instead of scoring again (a plan that records the
    sha256 of the scores it was searched on must have been searched on these; a plan that records one while
    the model is scored afresh gets a :class:`PlanScoresWarning`). The output path, the target or plan and the
    constraints are checked before the (long) scoring starts. The model is loaded once (when anything needs
    it); scoring, the plan search and the sequential refit share it. ``on_rank_cost``: the cost of a search's
    ``rank_by_distill``, before it runs (:func:`gdnprune.plan.plan_model`). Returns the manifest (with the
    searched plan under ``"plan"``).
    """
    o = scoring or ScoringOptions()
    auto, compensate = compensate is None, _default_compensation(compensate, search, o, snap_quant)
    sequential = compensate == "sequential"
    search = _check_options(target, plan, search, scores, compensate, o, snap_quant)
    clear_stale(Path(output_dir))
    check_paths(Path(model_dir), Path(output_dir), overwrite)
    sub_blocks, shapes = _check_cut(
        model_dir, target, plan, scores, search, sequential, self_contained, servable
    )
    hidden_cut = _hidden_cut(model_dir, target, plan, search)
    if search is not None:  # budgets no plan meets: said before any forward (the model on the meta device)
        check_budgets(empty_causal_lm(model_dir), tp=tp, multiple_of=multiple_of, **search.keywords())
    model = _load_once(model_dir, o, search, needed=scores is None or search is not None or sequential)
    statistics = bool(compensate) and not sequential  # least-squares statistics taken while scoring
    scored, scores_source = _scores(
        model_dir, data, scores, o, model, sub_blocks, hidden_cut, statistics, search, progress
    )
    stats = scored.pop("compensation_statistics", None)
    extra: dict[str, Any] = {"scores": {k: v for k, v in scored.items() if k != "layers"}}
    if search is not None:
        plan, extra["plan_report"] = _searched_plan(
            model_dir,
            data,
            scores_source,
            search,
            o,
            plan_samples,
            tp,
            multiple_of,
            model,
            progress,
            on_rank_cost,
        )
    # the default refits only on recall windows (on the text alone it costs recall: docs/scoring.md)
    if sequential and not (auto and not scored.get("calibration", {}).get("recall")):
        targets = _layer_targets(plan, target, shapes)
        stats = _sequential_columns(model, model_dir, data, scored, targets, progress)
        recall = bool(scored["calibration"].get("recall"))
        extra["compensation_windows"] = "recall windows" if recall else "calibration windows"
    permutations = dict(scored["layers"])
    if hidden_cut and (plan is None or plan_hidden_size(plan) is not None) and scored.get(HIDDEN_KEY):
        permutations[HIDDEN_KEY] = scored[HIDDEN_KEY]
    return transform_checkpoint(
        model_dir,
        output_dir,
        permutations=permutations,
        target=target,
        plan=plan,
        tp=tp,
        multiple_of=multiple_of,
        snap_quant=snap_quant,
        compensation_stats=stats,
        operation="prune",
        overwrite=overwrite,
        self_contained=self_contained,
        progress=progress,
        manifest_extra=extra,
    )


def _default_compensation(
    compensate: bool | str | None, search: PlanOptions | None, o: ScoringOptions, snap_quant: int | None
) -> bool | str:
    """``compensate`` as given (``"none"``: False); its default (None): ``"sequential"`` where the plan is
    searched on recall windows and the refit can run (GDN layers alone cut: a GDN budget, not a whole-model
    one; the model on one device; no ``snap_quant``), else none.
    On the recall models the refit on the recall windows lowers the recall-aware plan's nats/byte and keeps
    its recall, where a refit on the text alone loses recall (``docs/scoring.md``)."""
    if compensate is not None:
        return False if compensate == "none" else compensate
    if search is None or search.whole() or o.device_map is not None or snap_quant:
        return False
    return "sequential" if search.recall() else False


def _layer_targets(plan: Any, target: Any, shapes: Mapping[str, Any]) -> dict[str, Any]:
    """Every GDN layer's target under ``plan``, or under the one ``target`` of every layer."""
    if plan is not None:
        return resolve_plan(plan, shapes)
    return {prefix: resolve_target(shape, split_target(target)[0]) for prefix, shape in shapes.items()}


def _hidden_cut(model_dir: str | Path, target: Any, plan: Any, search: PlanOptions | None) -> bool:
    """Whether the hidden size may be cut: the hidden channels are then scored and sorted."""
    return (
        split_hidden_target(target)[1] is not None
        or (plan is not None and plan_hidden_size(plan) is not None)
        or (search is not None and _plans_hidden(model_dir, search))
    )


def _plans_hidden(model_dir: str | Path, search: PlanOptions) -> bool:
    """Whether the plan search may cut the hidden size (then the hidden channels are scored): ``hidden`` in
    ``blocks`` under a whole-model budget; with the default ``blocks``, not for an FP8 checkpoint (a hidden order
    would move channels across its scale tiles, which a cut refuses)."""
    if "hidden" not in search.blocks or not search.whole():
        return False
    return tuple(search.blocks) != tuple(BLOCK_NAMES) or tile_size(open_checkpoint(model_dir)) is None


def _load_once(model_dir: str | Path, o: ScoringOptions, search: PlanOptions | None, needed: bool) -> Any:
    """The one load of :func:`prune_checkpoint` when anything needs the model (scoring, the plan search and
    the sequential refit share it), its latency budget's floor checked before scoring."""
    if not needed:
        return None
    with fail_together():
        gpus = local_gpus() if o.device_map is not None else None
        model = load_causal_lm(model_dir, dtype=o.dtype, device=o.device, device_map=o.device_map, gpus=gpus)
    workload = None if search is None else search.parsed_workload()
    if workload is not None:  # a latency budget below the embeddings and LM head: said before scoring
        assert search is not None and search.budget_latency is not None
        check_latency_floor(model, workload, search.budget_latency)
    return model


def _check_options(
    target: Any,
    plan: Any,
    search: PlanOptions | None,
    scores: str | Path | None,
    compensate: bool | str,
    o: ScoringOptions,
    snap_quant: int | None,
) -> PlanOptions | None:
    """:func:`prune_checkpoint`'s options that do not go together, refused before anything is read; returns
    the search with ``snap_quant`` as its own."""
    sequential = compensate == "sequential"
    if compensate not in (False, True, "statistics", "sequential"):
        raise ValueError(
            f"unknown compensation {compensate!r}; expected 'statistics', 'sequential' or 'none'"
        )
    if sequential and o.device_map is not None:
        raise ValueError(
            "sequential compensation cuts the model in memory: it needs the model on one device "
            "(no device map)"
        )
    if sequential and snap_quant:
        raise ValueError(
            'compensate="sequential" refits the unsnapped cut; with `snap_quant` use compensate="statistics"'
        )
    given = [name for name, value in (("target", target), ("plan", plan), ("budget", search)) if value]
    if len(given) != 1:
        raise TargetError(
            "give exactly one of a target (`num_key_heads`, ...), `plan`, or a budget "
            f"(`budget_params`, `budget_gdn_params`, ...); got {given or 'none'}"
        )
    if scores is not None and compensate and not sequential:
        raise ValueError(
            'compensate="statistics" collects its statistics while scoring; with `scores` give '
            'compensate="sequential", or score afresh (no `scores`)'
        )
    if search is not None and snap_quant and not search.snap_quant:
        return replace(search, snap_quant=snap_quant)
    return search


def _scores(
    model_dir: str | Path,
    data: str | Path,
    scores: str | Path | None,
    o: ScoringOptions,
    model: Any,
    sub_blocks: bool,
    hidden_cut: bool,
    statistics: bool,
    search: PlanOptions | None,
    progress: bool,
) -> tuple[dict, str | Path | dict]:
    """The scores :func:`prune_checkpoint` sorts by (read from ``scores``, or taken afresh with the
    compensation ``statistics`` when asked, on recall windows where the search measures on them) and what the
    plan search reads them from."""
    if scores is not None:
        scored = load_scores(scores)
        scored["sha256"] = file_sha256(scores)
        return scored, scores
    if hidden_cut:  # the hidden channels are scored only where the hidden size may be cut
        blocks: tuple[str, ...] | None = SCORED_BLOCKS if sub_blocks else (*GDN_ONLY, "hidden")
    else:
        blocks = None if sub_blocks else GDN_ONLY
    scored = score_checkpoint(
        model_dir,
        data,
        **o.keywords(),
        progress=progress,
        compensate=statistics,
        blocks=blocks,
        model=model,
        recall=search is not None and search.recall(),
    )
    return scored, scored


def _searched_plan(
    model_dir: str | Path,
    data: str | Path,
    scores: str | Path | dict,
    search: PlanOptions,
    o: ScoringOptions,
    plan_samples: int,
    tp: int | None,
    multiple_of: int | None,
    model: Any,
    progress: bool,
    on_rank_cost: Callable[[Any], None] | None,
) -> tuple[dict, dict[str, Any]]:
    """The plan :func:`prune_checkpoint` searches on its scores (the scoring's windows, dtype and devices) and
    what its manifest keeps of the report."""
    searched = functools.partial(
        plan_checkpoint,
        model_dir,
        data,
        scores,
        num_samples=plan_samples,
        seq_len=o.seq_len,
        batch_size=o.batch_size,
        device=o.device,
        dtype=o.dtype,
        device_map=o.device_map,
        tp=tp,
        multiple_of=multiple_of,
        progress=progress,
        model=model,
    )
    if search.snap_quant:  # the plan without the tiles, then snapped to them: what they cost, measured
        unsnapped, _ = searched(on_rank_cost=on_rank_cost, **replace(search, snap_quant=None).keywords())
        plan, report = searched(snap=unsnapped, **search.keywords())
    else:
        plan, report = searched(on_rank_cost=on_rank_cost, **search.keywords())
    kept = ("servable", "latency", "ranking", "depth_check", "windows", "recall", "snap_quant")
    return plan, {
        "seconds": report["seconds"],
        "sensitivity": report["sensitivity"],
        **{k: report[k] for k in kept if k in report},
    }


def _check_cut(
    model_dir: str | Path,
    target: Any,
    plan: str | Path | Mapping | None,
    scores: str | Path | None,
    search: PlanOptions | None,
    sequential: bool,
    self_contained: bool,
    servable: bool = False,
) -> tuple[bool, dict[str, Any]]:
    """Check the target or plan against the checkpoint before any model loads; returns whether sub-blocks
    are cut (and so scored) and the GDN layers' shapes by checkpoint prefix."""
    ckpt = open_checkpoint(model_dir)
    layers, _ = find_gdn_layers(ckpt)
    if self_contained:
        auto_map(ckpt.config)  # a family the modeling file cannot load is refused before the scoring
    shapes = {layer.prefix: layer.shape for layer in layers}
    gdn_target, block_target = split_target(split_hidden_target(target)[0])
    if target is not None:
        for shape in shapes.values():
            resolve_target(shape, gdn_target)  # raises TargetError (a ValueError) for an illegal target
    if plan is not None:
        checked = read_plan(plan)
        gdn = resolve_plan(checked, shapes)
        _check_plan_scores(checked, scores)
        if servable:
            blocks = plan_sub_blocks(ckpt, {}, {}, plan, dequantize=True).targets
            problems = servable_problems(
                {layer_index_of(p): t for p, t in gdn.items()}, blocks, checked.get("removed_layers", [])
            )
            if problems:
                raise PlanError(
                    f"`servable`: the plan needs per_layer_config: {'; '.join(problems)}; search a servable "
                    f"plan (a budget with `servable`) or snap this one (gdnprune plan --snap-servable)"
                )
    # the sub-blocks a target or plan cuts (checked now, scored beside the GDN layers)
    sub_blocks = (search is not None and search.whole()) or bool(
        plan_sub_blocks(ckpt, {}, block_target, plan, dequantize=True).plans
    )
    if sub_blocks and sequential:
        raise TargetError(
            "sequential compensation refits GDN layers on a model whose attention and MLPs are "
            'whole; it does not support attention / MLP cuts yet (use compensate="statistics")'
        )
    return sub_blocks, shapes


class PlanScoresWarning(UserWarning):
    """A plan searched on some scores is applied with orders from a fresh scoring."""


def _check_plan_scores(plan: Mapping, scores: str | Path | None) -> None:
    """Refuse a plan searched on other scores than ``scores``; warn when the model is to be scored afresh."""
    recorded = (plan.get("scores") or {}).get("sha256")
    if not recorded:
        return
    if scores is None:
        warnings.warn(
            f"the plan was searched on the scores with sha256 {recorded[:12]}...; the model is scored "
            f"afresh, and orders that differ from those make the plan's measurements stale: give those "
            f"scores with `scores`",
            PlanScoresWarning,
            stacklevel=3,
        )
        return
    given = file_sha256(scores)
    if given is None:
        raise ValueError(f"scores {scores}: no such file")
    if given != recorded:
        raise ValueError(
            f"the plan was searched on the scores with sha256 {recorded[:12]}..., but `scores` "
            f"{scores} has sha256 {given[:12]}...: search the plan on these scores, or give the "
            f"scores it was searched on"
        )


def _sequential_columns(
    model, model_dir, data, scores: Mapping, targets: Mapping, progress: bool
) -> dict[str, dict]:
    """``{checkpoint prefix: {"columns": ...}}``: ``out_proj`` refitted in memory for ``targets`` (checkpoint
    prefix -> GDNShape) on the scoring run's calibration windows, made recall windows where the scores were
    (:func:`gdnprune.quality.compensate.sequential_refit`)."""
    calibration = scores["calibration"]
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    windows = calibration_windows(
        data, tokenizer, seq_len=calibration["seq_len"], num_samples=calibration["num_samples"], warn=False
    )
    batches: list[Any] = list(iter_batches(windows, calibration["batch_size"]))
    if calibration.get("recall"):  # each window and its probe, weighted as the plan's KL
        batches = recall_windows(batches, tokenizer=tokenizer)
    mapping = map_to_checkpoint([prefix for prefix, _ in find_gdn_modules(model)], Path(model_dir))
    layers = scores["layers"]
    small = slice_model(
        model,
        {p: targets[c] for p, c in mapping.items()},
        {p: layers[c] for p, c in mapping.items() if c in layers},
    )
    small.to(next(model.parameters()).device)
    fitted = sequential_refit(model, small, batches, progress=progress)
    return {mapping[p]: {"columns": entry["columns"]} for p, entry in fitted.items()}
