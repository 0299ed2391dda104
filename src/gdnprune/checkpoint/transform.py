"""Transforms of a checkpoint folder: :func:`transform_checkpoint`, and the two operations of the command
line built on it, :func:`sort_checkpoint` and :func:`slice_checkpoint`.

A transform validates the folder, checks the output path and the free space, then runs the streaming
engine (:mod:`gdnprune.checkpoint.engine`) on two threads into a temporary folder, writes the index,
config, other files and manifest (:mod:`gdnprune.checkpoint.output`) and renames the folder into place.
A failure or an interrupt removes the temporary folder. Nothing here imports torch.
"""

from __future__ import annotations

import contextlib
import copy
import os
import shutil
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

from tqdm import tqdm

from ..io.plan_file import (
    PlanError,
    constraint_violations,
    kernel_warnings,
    plan_hidden_size,
    read_plan,
    removed_layers,
    resolve_plan,
)
from ..io.scores_file import prefix_alias, read_scores, resolve_orders
from ..model import layer_removal
from ..model.geometry import apply_targets_to_config, layer_index_of, orders_to_payload
from ..model.hidden import HIDDEN_KEY
from ..model.model_config import text_config
from ..model.targets import TARGET_FIELDS, TargetError, keyword_target, resolve_target
from ..model.tiles import snap_to_tiles
from ..runtime.deprecation import renamed_keywords
from ..runtime.fileio import file_sha256, write_json_atomic
from . import hidden, output, refit, remote_code, subblocks
from .engine import GDNWork, check_unchanged, copy_unchanged, plan_layer, plan_shards, write_header
from .folder import (
    CONFIG_NAME,
    INDEX_NAME,
    MANIFEST_NAME,
    PASSTHROUGH_PREFIXES,
    Checkpoint,
    find_gdn_layers,
    open_checkpoint,
)

__all__ = [
    "UnsortedInputWarning",
    "MissingScoresWarning",
    "PassthroughWarning",
    "KernelShapeWarning",
    "transform_checkpoint",
    "sort_checkpoint",
    "slice_checkpoint",
]


class UnsortedInputWarning(UserWarning):
    """Slicing a checkpoint that no manifest says was sorted: the kept prefix is not the important part."""


class MissingScoresWarning(UserWarning):
    """A GDN layer has no entry in the scores: it keeps its order."""


class PassthroughWarning(UserWarning):
    """GDN-looking tensors under a pass-through prefix (``mtp.``) are left untouched."""


class KernelShapeWarning(UserWarning):
    """A cut head dim that flash-linear-attention's kernels cannot run (key dim < 16) or must pad."""


def _warn(category: type[Warning], message: str) -> None:
    warnings.warn(message, category, stacklevel=3)


# Over 80 lines for its documented keyword arguments (the public API); the code is 22 lines.
@renamed_keywords(compensation="compensation_stats")
def transform_checkpoint(
    model_dir: str | os.PathLike,
    output_dir: str | os.PathLike,
    *,
    permutations: Mapping[str, Any] | None = None,
    target: Any = None,
    plan: str | os.PathLike | Mapping | None = None,
    tp: int | None = None,
    multiple_of: int | None = None,
    snap_quant: int | None = None,
    compensation_stats: str | os.PathLike | Mapping | None = None,
    ridge: float | None = None,
    dequantize: bool = False,
    self_contained: bool = False,
    operation: str,
    overwrite: bool = False,
    progress: bool = True,
    manifest_extra: Mapping[str, Any] | None = None,
    remove_layers: Any = None,
    rescale_norms: str | os.PathLike | Mapping | None = None,
) -> dict:
    """Permute and/or cut every GDN layer of a checkpoint folder into a new folder, streaming.

    Args:
        model_dir: the source folder (sharded or single-file safetensors; opened read-only).
        output_dir: the folder to create (must not be ``model_dir`` or inside it).
        permutations: GDN layer prefix -> :class:`~gdnprune.gated_delta_net.GDNPermutation` or score
            payload (``*_order_most_important_first`` lists). A layer without an entry keeps its order
            (:class:`MissingScoresWarning`); an entry that is not a GDN layer is a :class:`ScoresError`.
            Entries keyed by an attention / MLP sub-block's prefix (``model.layers.3.self_attn``,
            ``...mlp``, ``...mlp.shared_expert``) hold its orders (:mod:`gdnprune.model.subblock_geometry`); a sub-block
            without an entry keeps its order. The entry ``"hidden"`` holds the order of the hidden channels
            (the residual stream's width, :mod:`gdnprune.model.hidden`; a scores file's ``hidden`` payload):
            every tensor on the stream is sorted by it. None: no permutation.
        target: the nested-prefix geometry of every GDN layer, a ``GDNShape`` or a mapping of some of its
            fields (missing or None fields keep each layer's size). The mapping may also hold the
            sub-block fields ``intermediate_size``, ``shared_expert_intermediate_size``,
            ``num_attention_heads`` and ``num_key_value_heads``: every sub-block that has the field is cut
            to it (:mod:`gdnprune.checkpoint.subblocks`); ``hidden_size`` cuts the hidden size (the residual
            stream's width) of the whole model: every tensor on the stream keeps its first ``hidden_size``
            channels (:mod:`gdnprune.checkpoint.hidden`). None: no slicing.
        plan: per-layer targets instead of one ``target``: a plan file or dict (:mod:`gdnprune.io.plan_file`).
            Layers that end up with different geometries are recorded in ``config.json`` with
            transformers' ``per_layer_config``; load such a checkpoint with :func:`gdnprune.load_pretrained`.
            Its ``default`` may hold ``hidden_size``.
        tp, multiple_of: serving constraints on the cut layers (key and value heads divisible by ``tp``,
            head dims multiples of ``multiple_of``); a target that breaks one is a ``PlanError`` listing every
            such layer. Head dims that flash-linear-attention cannot run or must pad give a
            :class:`KernelShapeWarning`.
        snap_quant: tiles of a quantization scheme (e.g. 128): every width the cut changes is snapped up to
            the nearest multiple of it (:func:`gdnprune.model.tiles.snap_to_tiles`: GDN key and value widths,
            MLP channels, attention heads), so that every matrix the cut changes can be quantized; the
            manifest records it (``snap_quant``) beside the snapped targets. The hidden size is not snapped.
        compensation_stats: a calibration statistics file (:mod:`gdnprune.quality.compensate`; or the loaded statistics of
            this very checkpoint): the ``out_proj`` of every
            layer that loses value heads or value channels is refitted by least squares to reconstruct the
            full layer output (``ridge``: its strength, default ``1e-3``). Or ``{prefix: {"columns": ...}}``,
            ``out_proj`` columns refitted in memory for this very cut
            (:func:`gdnprune.quality.compensate.sequential_refit`), written as they are. Compensated outputs are not
            nested across targets; the manifest says so.
        dequantize: FP8 weights whose scale tiles the sort or cut would split are written dequantised in
            BF16 (their scales dropped, their modules added to ``modules_to_not_convert``) instead of refused.
        self_contained: also write the modeling file and ``auto_map`` with which the output loads with
            ``AutoModelForCausalLM.from_pretrained(output_dir, trust_remote_code=True)`` without gdnprune
            (:mod:`gdnprune.checkpoint.remote_code`).
        operation: the name recorded in the manifest (``"sort"``, ``"slice"``, ``"prune"``, ...).
        overwrite: replace an existing ``output_dir``.
        progress: show a tqdm progress bar over bytes written (stderr).
        manifest_extra: extra top-level entries for the manifest.
        rescale_norms: with a cut of the hidden size, the rescaled-norms correction: every RMS norm on the
            residual stream has its scale multiplied by the expected ratio of the RMS over the kept channels to
            the RMS over all of them (:func:`gdnprune.model.hidden.norm_factors`), from the ``hidden`` entry of
            these scores (file or dict; the order the input was sorted by). Not nested across hidden sizes.
        remove_layers: decoder layer numbers (as in the input) to remove (:mod:`gdnprune.model.layer_removal`): their
            tensors are dropped, later layers' tensors renumbered (bytes unchanged), ``config.json`` gets
            ``num_hidden_layers``, ``layer_types`` and ``per_layer_config`` rewritten; ``mtp.*`` is kept.

    Permuting and slicing are one gather per GDN tensor (``permutation.indices(shape, target=...)``);
    every other tensor is copied byte for byte; dtypes, shard names and the tensor-to-shard assignment are
    kept. ``config.json`` gets the target geometry; every other file of the folder is copied (except
    other weight files). Returns the manifest, also written to ``output_dir/gdnprune.json`` (the returned
    dict also has ``elapsed_seconds``).

    Raises:
        CheckpointError, ScoresError, TargetError, OutputError (all ``ValueError``): input errors; no
            output folder is left behind, as for any other failure or an interrupt.
    """
    if target is not None and plan is not None:
        raise TargetError("give a target or a plan, not both")
    src, out = Path(model_dir), Path(output_dir)
    output.clear_stale(out)
    output.check_paths(src, out, overwrite)
    if self_contained:
        manifest_extra = {"self_contained": remote_code.MODELING_NAME, **dict(manifest_extra or {})}
    if snap_quant is not None and (snap_quant < 16 or snap_quant % 16):
        raise TargetError(
            f"`snap_quant` is the tile or group size of a quantization scheme, a multiple of 16 (as "
            f"`gdnprune quantize` takes), got {snap_quant}"
        )
    if snap_quant:
        manifest_extra = {"snap_quant": snap_quant, **dict(manifest_extra or {})}
    return _transform(
        src,
        out,
        permutations,
        target,
        plan,
        (tp, multiple_of, dequantize, snap_quant),
        (compensation_stats, ridge, rescale_norms),
        operation,
        overwrite,
        progress,
        manifest_extra,
        self_contained,
        remove_layers,
    )


def _plan_layers(layers: list, permutations, target, plan, constraints) -> tuple[dict, list[str]]:
    """Every layer's plan (orders, target and serving constraints checked) and the layers without orders."""
    shapes = {layer.prefix: layer.shape for layer in layers}
    orders, missing = resolve_orders(permutations, shapes)
    if plan is not None:
        targets = resolve_plan(plan, shapes)
    else:
        targets = {prefix: resolve_target(shape, target) for prefix, shape in shapes.items()}
    tp, multiple_of, dequantize, snap_quant = constraints
    if snap_quant:
        targets = {p: snap_to_tiles(shapes[p], t, snap_quant) for p, t in targets.items()}
    cut = {prefix: t for prefix, t in targets.items() if t != shapes[prefix]}
    violations = constraint_violations(cut, tp=tp, multiple_of=multiple_of)
    if violations:
        raise PlanError(f"{len(violations)} layer(s) break the serving constraints: " + "; ".join(violations))
    for line in kernel_warnings(cut):
        _warn(KernelShapeWarning, line)
    plans = {
        layer.prefix: plan_layer(layer, targets[layer.prefix], orders.get(layer.prefix)) for layer in layers
    }
    subblocks.check_scale_grids(plans, dequantize)
    return plans, missing


# Over 80 lines: the steps in the order a failure must be found (every input check before the folder is
# made, then the writing); each step is a helper below.
def _transform(
    src: Path,
    out: Path,
    permutations,
    target,
    plan,
    constraints,
    refit_options,
    operation,
    overwrite,
    progress,
    manifest_extra,
    self_contained: bool,
    remove_layers=None,
) -> dict:
    start_time = time.time()
    # everything that can be wrong with the inputs is found before a folder is created
    ckpt = open_checkpoint(src)
    layers, skipped = find_gdn_layers(ckpt)
    (target, hidden_size), (permutations, hidden_order) = (
        hidden.split_hidden_target(target),
        hidden.split_hidden_order(permutations),
    )
    if plan is not None:
        hidden_size = plan_hidden_size(plan)
    (target, block_target), (permutations, block_orders) = (
        subblocks.split_target(target),
        subblocks.split_permutations(permutations),
    )
    removed = list(remove_layers or []) + (sorted(removed_layers(plan)) if plan is not None else [])
    removed = (
        layer_removal.check_removed(
            removed, layer_removal.num_layers_of(ckpt.config), layer_removal.attention_layers(ckpt.config)
        )
        if removed
        else []
    )
    plans, missing = _plan_layers(layers, permutations, target, plan, constraints)
    blocks = subblocks.plan_sub_blocks(
        ckpt, block_orders, block_target, plan, dequantize=constraints[2], snap_quant=constraints[3]
    )
    if removed:  # the layers that go are not gathered: their tensors are dropped, later layers renumbered
        plans = _drop_removed(ckpt, plans, blocks, removed)
        manifest_extra = {"removed_layers": removed, **dict(manifest_extra or {})}
    residual = hidden.plan_hidden(ckpt, hidden_order, hidden_size)
    if residual is not None:  # one more gather of every tensor on the stream, and a plan of the others
        plans = hidden.with_hidden(ckpt, plans, blocks.plans, blocks.names, residual, constraints[2])
        manifest_extra = {"hidden": hidden.hidden_manifest(residual), **dict(manifest_extra or {})}
    skip = {os.path.basename(s.path) for s in ckpt.shards} | {INDEX_NAME, CONFIG_NAME, MANIFEST_NAME}
    other_files, left_out = output.plan_other_files(src, skip)
    gdn_names = {p.layer.name(s) for p in (*plans.values(), *blocks.plans.values()) for s in p.layer.tensors}
    cut = target is not None or plan is not None or blocks.cut or bool(residual and residual.cut)
    unsorted_cut = cut and permutations is None and not block_orders
    _warn_inputs(src, ckpt, unsorted_cut, missing, skipped, blocks, left_out)
    if self_contained:
        remote_code.auto_map(ckpt.config)  # a family it cannot load is refused before any folder is made
    stats_path, ridge, rescale = refit_options
    factors = None if rescale is None else hidden.norm_rescaling(ckpt, rescale, residual)
    if stats_path is not None and residual is not None:
        raise TargetError(
            "compensation refits out_proj from statistics of the full hidden size; it does not combine with "
            "a sort or cut of the hidden channels"
        )
    stats, order = refit.compensation_inputs(ckpt, layers, stats_path, cut)
    _check_free_space(ckpt, out, gdn_names if cut else set())

    staging = output.Staging(out, overwrite, src=src)
    with staging as tmp:
        shards = plan_shards(ckpt, gdn_names, tmp)
        work = GDNWork(ckpt, shards, {**plans, **blocks.plans}, names=blocks.names)
        with _streaming(work, shards, operation, progress) as on_chunk:
            if stats_path is not None:
                refitted = refit.refit_shards(ckpt, plans, shards, stats, order, ridge)
                manifest_extra = {
                    "compensation": refit.compensation_info(stats_path, ridge, refitted),
                    **dict(manifest_extra or {}),
                }
            if factors:
                manifest_extra = hidden.rescale_written_norms(ckpt, shards, factors, manifest_extra)
            for shard in shards:
                on_chunk(write_header(shard))
            if blocks.plans:
                manifest_extra = {"blocks": blocks.manifest(), **dict(manifest_extra or {})}
            manifest = _finish_folder(
                ckpt,
                tmp,
                work,
                operation,
                permutations,
                cut,
                plan,
                missing,
                skipped,
                other_files,
                manifest_extra,
                blocks,
                removed,
                residual,
            )
            if self_contained:
                remote_code.make_self_contained(tmp)
            check_unchanged(ckpt)
        staging.commit()
    manifest["elapsed_seconds"] = round(time.time() - start_time, 3)
    return manifest


@contextlib.contextmanager
def _streaming(
    work: GDNWork, shards: list, operation: str, progress: bool
) -> Iterator[Callable[[int], None]]:
    """Write the shards' tensors: the unchanged ones copied here while a worker thread gathers the GDN ones
    (this thread helps once its copies are done), under one progress bar. Yields ``on_chunk(n)`` (raises
    a worker error, advances the bar) for the writes that follow; on any error the worker is stopped
    before the exception goes on, so that nothing writes into the folder any more."""

    def worker_main() -> None:
        try:
            work.run()
        except BaseException as exc:  # handed to the main thread
            work.error = work.error or exc

    worker = threading.Thread(target=worker_main, name="gdnprune-gdn", daemon=True)
    bar = tqdm(
        total=sum(s.data_start + s.unchanged_bytes for s in shards) + work.total_bytes,
        unit="B",
        unit_scale=True,
        unit_divisor=1024,
        desc=f"gdnprune {operation}",
        disable=not progress,
        file=sys.stderr,
        leave=False,
    )
    state = {"gdn_bytes": 0}

    def on_chunk(n: int) -> None:
        """After every written chunk: worker errors, progress."""
        if work.error is not None:
            raise work.error
        done = work.bytes_done
        bar.update(n + done - state["gdn_bytes"])
        state["gdn_bytes"] = done

    try:
        worker.start()
        for shard in shards:  # meanwhile the worker gathers GDN tensors, from the last shard
            copy_unchanged(shard, on_chunk)
        work.run(after_job=lambda: on_chunk(0))  # help with the GDN tensors that are left
        while worker.is_alive():
            worker.join(timeout=0.05)
            on_chunk(0)
        on_chunk(0)
        yield on_chunk
    except BaseException:
        work.stop.set()
        worker.join(timeout=30)  # it checks `stop` between tensors; then nothing writes into tmp
        raise
    finally:
        bar.close()
        work.stop.set()


def _drop_removed(ckpt: Checkpoint, plans: dict, blocks: subblocks.SubBlockPlan, removed: list[int]) -> dict:
    """The GDN plans without the removed layers; ``blocks`` loses them too (in place), and its name map
    renumbers the later layers."""
    blocks.plans = {p: lp for p, lp in blocks.plans.items() if layer_index_of(p) not in removed}
    blocks.targets = {k: {i: t for i, t in v.items() if i not in removed} for k, v in blocks.targets.items()}
    blocks.names = layer_removal.compose_names(
        blocks.names,
        layer_removal.removal_name_map(ckpt.names, layer_removal.num_layers_of(ckpt.config), removed),
    )
    return {p: lp for p, lp in plans.items() if layer_index_of(p) not in removed}


def _warn_inputs(
    src: Path,
    ckpt: Checkpoint,
    unsorted_cut: bool,
    missing: list[str],
    skipped: Any,
    blocks: subblocks.SubBlockPlan,
    left_out: Any,
) -> None:
    """The warnings about the inputs (an unsorted cut, layers without scores, pass-through tensors, weight
    files that are not copied), before any folder is made."""
    if unsorted_cut and not ckpt.is_sorted:
        _warn(
            UnsortedInputWarning,
            f"{src} has no {MANIFEST_NAME} manifest saying it was sorted: slicing keeps the first heads and "
            f"channels in their original order, not the most important ones (run `gdnprune sort` first)",
        )
    for prefix in missing:
        _warn(MissingScoresWarning, f"GDN layer {prefix} has no entry in the scores: it keeps its order")
    if skipped:
        _warn(
            PassthroughWarning,
            f"{skipped} look like GDN layers but are under {PASSTHROUGH_PREFIXES}: left untouched",
        )
    if blocks.passthrough:
        _warn(
            PassthroughWarning,
            f"{blocks.passthrough} keep their width while config.json's global sizes now "
            f"describe the cut layers: a server that builds the MTP head from config.json "
            f"(speculative decoding) will not load it; transformers ignores mtp.*",
        )
    if left_out:
        _warn(
            UserWarning,
            f"other weight files {left_out} of {src} are not copied (they are not part of the "
            f"safetensors checkpoint that is transformed)",
        )


def _check_free_space(ckpt: Checkpoint, out: Path, rewritten: set[str]) -> None:
    """Refuse early when the disk of ``out`` cannot hold at least the tensors that are copied unchanged."""
    at_least = sum(ckpt.tensor(n).nbytes for n in ckpt.names if n not in rewritten)
    existing = next(p for p in (out.parent, *out.parent.parents) if p.exists())
    free = shutil.disk_usage(existing).free
    if free < at_least:
        raise output.OutputError(
            f"not enough free disk space for {out}: the output needs more than "
            f"{at_least / 1e9:.2f} GB, {free / 1e9:.2f} GB free"
        )


def _finish_folder(
    ckpt: Checkpoint,
    tmp: Path,
    work: GDNWork,
    operation,
    permutations,
    cut,
    plan,
    missing,
    skipped,
    other_files,
    manifest_extra,
    blocks: subblocks.SubBlockPlan,
    removed=(),
    residual: Any = None,
) -> dict:
    """Index, config, other files and manifest of the output folder."""
    gdn_plans = {prefix: p for prefix, p in work.plans.items() if p.layer.kind == "gdn"}

    output.write_index(
        ckpt, tmp, [e for shard in work.shards for e in shard.entries()], work.dropped, work.names
    )
    dequantized = [
        p.layer.name(suffix)[: -len(".weight")]
        for p in work.plans.values()
        for suffix in sorted(p.dequantize)
    ]
    if cut or dequantized or removed:
        config = ckpt.config
        if cut:
            config = apply_targets_to_config(
                config, {layer_index_of(prefix): p.target for prefix, p in gdn_plans.items()}
            )
            config = blocks.apply_to_config(config)
            if residual is not None:
                config = hidden.hidden_config(config, residual)
        if removed:
            config = layer_removal.remove_layers_from_config(config, removed)
        if dequantized:
            config = _not_converted(config, dequantized)
        write_json_atomic(tmp / CONFIG_NAME, config, indent=2)
    else:
        output.copy_other_files(ckpt.path, tmp, [CONFIG_NAME])
    if dequantized:
        manifest_extra = {"dequantized": dequantized, **dict(manifest_extra or {})}
    output.copy_other_files(ckpt.path, tmp, other_files)
    permuted = [p for p, layer_plan in gdn_plans.items() if layer_plan.permutation is not None]
    targets_out = {layer_plan.target for layer_plan in gdn_plans.values()}
    shapes_in = {layer_plan.layer.shape for layer_plan in gdn_plans.values()}
    if plan is not None:
        plan_info = read_plan(plan)
        extra = {
            "plan": {
                "path": None if isinstance(plan, Mapping) else str(Path(plan).resolve()),
                "sha256": None if isinstance(plan, Mapping) else file_sha256(Path(plan)),
                "metadata": {k: v for k, v in plan_info.items() if k not in ("layers", "default")},
            },
            **dict(manifest_extra or {}),
        }
        manifest_extra = extra
    manifest = output.build_manifest(
        ckpt,
        operation,
        sorted_out=all(p in permuted or ckpt.is_sorted for p in gdn_plans),
        source_shape=next(iter(shapes_in)).as_dict() if len(shapes_in) == 1 else None,
        target=next(iter(targets_out)).as_dict() if cut and len(targets_out) == 1 else None,
        layers={
            prefix: {
                "layout": lp.layer.layout,
                "shape": lp.layer.shape.as_dict(),
                "target": lp.target.as_dict(),
                "permutation": None if lp.permutation is None else orders_to_payload(lp.permutation),
            }
            for prefix, lp in gdn_plans.items()
        },
        unsorted_layers=missing if permutations is not None else None,
        passthrough=skipped,
        extra=manifest_extra,
    )
    output.write_manifest(tmp, manifest)
    return manifest


def _not_converted(config: Mapping, modules: list[str]) -> dict:
    """``config`` with ``modules`` (and their text-model spellings) added to the FP8 ``modules_to_not_convert``."""
    out = copy.deepcopy(dict(config))
    holder = text_config(out, "quantization_config")
    quant = holder.setdefault("quantization_config", {})
    names = list(quant.get("modules_to_not_convert") or [])
    for module in modules:
        for spelling in dict.fromkeys((module, prefix_alias(module))):
            if spelling not in names:
                names.append(spelling)
    quant["modules_to_not_convert"] = names
    return out


def sort_checkpoint(
    model_dir: str | os.PathLike,
    scores: str | os.PathLike | Mapping,
    output_dir: str | os.PathLike,
    *,
    dequantize: bool = False,
    self_contained: bool = False,
    overwrite: bool = False,
    progress: bool = True,
    manifest_extra: Mapping[str, Any] | None = None,
) -> dict:
    """Write the "sorted teacher": every GDN layer permuted by the orders of ``scores`` (and every sub-block,
    and the hidden channels, that the scores order); same function.

    ``scores`` is a scores file path or dict (see :func:`gdnprune.io.scores_file.read_scores`). The keyword arguments
    are those of :func:`transform_checkpoint`. Returns the manifest.
    """
    data = read_scores(scores)
    info: dict[str, Any] = {"metadata": {k: v for k, v in data.items() if k != "layers"}}
    if not isinstance(scores, Mapping):
        info = {"path": str(Path(scores).resolve()), "sha256": file_sha256(Path(scores)), **info}
    extra = {"scores": info, **dict(manifest_extra or {})}
    permutations = dict(data["layers"])
    if data.get(HIDDEN_KEY) is not None:  # the hidden channels' order (the scores file's top-level entry)
        permutations[HIDDEN_KEY] = data[HIDDEN_KEY]
    return transform_checkpoint(
        model_dir,
        output_dir,
        permutations=permutations,
        operation="sort",
        manifest_extra=extra,
        dequantize=dequantize,
        self_contained=self_contained,
        overwrite=overwrite,
        progress=progress,
    )


@keyword_target(paths=2)
@renamed_keywords(compensation="compensation_stats")
def slice_checkpoint(
    model_dir: str | os.PathLike,
    output_dir: str | os.PathLike,
    *,
    target: Any = None,
    plan: str | os.PathLike | Mapping | None = None,
    tp: int | None = None,
    multiple_of: int | None = None,
    snap_quant: int | None = None,
    compensation_stats: str | os.PathLike | Mapping | None = None,
    ridge: float | None = None,
    dequantize: bool = False,
    self_contained: bool = False,
    overwrite: bool = False,
    progress: bool = True,
    manifest_extra: Mapping[str, Any] | None = None,
    remove_layers: Any = None,
    rescale_norms: str | os.PathLike | Mapping | None = None,
) -> dict:
    """Cut every GDN layer to a nested prefix and rewrite the geometry in ``config.json``.

    ``target`` is a ``GDNShape`` or a mapping of some of its fields (``num_key_heads``,
    ``num_value_heads`` (total), ``key_head_dim``, ``value_head_dim``); missing fields keep each layer's
    size; ``intermediate_size``, ``shared_expert_intermediate_size``, ``num_attention_heads`` and
    ``num_key_value_heads`` cut the MLPs, shared experts and full-attention layers, ``num_experts`` keeps that
    many routed experts per MoE layer, ``hidden_size`` cuts the hidden size of the whole model (with
    ``rescale_norms``: the scores whose norm statistics correct the RMS norms). ``remove_layers`` removes decoder layers (numbers as in the input,
    :mod:`gdnprune.model.layer_removal`), alone or with a target or plan. ``plan`` gives every
    layer its own target instead (a plan file or dict, :mod:`gdnprune.io.plan_file`; version 2 for sub-blocks).
    Warns (:class:`UnsortedInputWarning`) when the input has no manifest saying it was sorted. Keyword
    arguments are those of :func:`transform_checkpoint`. Returns the manifest.
    """
    if target is None and plan is None and not remove_layers:
        raise TargetError("slice needs a target (at least one of " + ", ".join(TARGET_FIELDS) + ") or a plan")
    return transform_checkpoint(
        model_dir,
        output_dir,
        target=target,
        plan=plan,
        tp=tp,
        multiple_of=multiple_of,
        snap_quant=snap_quant,
        compensation_stats=compensation_stats,
        ridge=ridge,
        dequantize=dequantize,
        operation="slice",
        self_contained=self_contained,
        overwrite=overwrite,
        progress=progress,
        manifest_extra=manifest_extra,
        remove_layers=remove_layers,
        rescale_norms=rescale_norms,
    )
