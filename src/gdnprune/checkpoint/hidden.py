"""The hidden half of a transform: the hidden size (the residual stream's width) sorted or cut on disk.

The hidden channels are one axis of the whole model (:mod:`gdnprune.model.hidden`). A transform that sorts or
cuts them gives every layer plan (GDN layers and sub-blocks) one more gather along its tensors' axes on the
stream (:attr:`~.engine.LayerPlan.hidden`), and gathers every other tensor on the stream (embeddings, LM head,
norms, the blocks that are not otherwise changed, per-expert tensors, ``mtp.*``, a vision-language merger's
output) as one more layer plan of its own, kind ``hidden``, prefix ``""`` (its tensors keyed by their full
names, :func:`residual_plan`). The engine runs them as it runs the others: one gather per axis, bytes only.
FP8 scale tiles stay whole or the weight is dequantised (or the cut refused), as for the other axes
(:func:`check_hidden_tiles`). No torch.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

from ..io.safetensors_io import write_all
from ..io.scores_file import ScoresError, matching_prefixes, read_scores
from ..model.hidden import (
    HIDDEN_FIELDS,
    HIDDEN_KEY,
    ORDER_KEY,
    HiddenCut,
    apply_hidden_to_config,
    find_hidden,
    hidden_cut,
    norm_factors,
    norm_offset,
    orders_from_payload,
    orders_to_payload,
    rescaled_norm,
)
from ..model.layouts import TileGridError, scaled_weight
from ..model.targets import TargetError
from .codecs import from_float, to_float
from .engine import LayerPlan
from .folder import Checkpoint, CheckpointError, GDNLayer, tile_size

__all__ = [
    "split_hidden_target",
    "split_hidden_order",
    "plan_hidden",
    "residual_plan",
    "check_hidden_tiles",
    "with_hidden",
    "hidden_config",
    "hidden_manifest",
    "norm_rescaling",
    "rescale_written_norms",
]


def split_hidden_target(target: Any) -> tuple[Any, int | None]:
    """``(the rest of the target, hidden_size or None)`` of a target mapping (other targets pass through)."""
    if not isinstance(target, Mapping) or not set(target) & set(HIDDEN_FIELDS):
        return target, None
    rest = {k: v for k, v in target.items() if k not in HIDDEN_FIELDS}
    return (rest or None), target.get("hidden_size")


def split_hidden_order(permutations: Mapping | None) -> tuple[Mapping | None, Any]:
    """``(the other entries, the hidden channels' order payload or None)`` of a ``permutations`` mapping: its
    ``hidden`` entry is the scores file's hidden order."""
    if permutations is None or HIDDEN_KEY not in permutations:
        return permutations, None
    rest = {k: v for k, v in permutations.items() if k != HIDDEN_KEY}
    return (rest or None), permutations[HIDDEN_KEY]


def plan_hidden(ckpt: Checkpoint, order: Any, size: int | None) -> HiddenCut | None:
    """The hidden channels' sort (``order``: a scores payload) and cut (``size``) of a checkpoint, None when
    neither is asked for.

    Raises:
        CheckpointError: a tensor the hidden-size table does not know (the stream cannot be cut safely) or of
            the wrong shape; ScoresError, TargetError: an order or a size that does not fit.
    """
    if order is None and size is None:
        return None
    try:
        residual = find_hidden(ckpt.shapes, ckpt.config, tile_size=tile_size(ckpt))
    except ValueError as exc:
        raise CheckpointError(f"{ckpt.path}: {exc}") from None
    orders = None
    if order is not None:
        try:
            orders = orders_from_payload(order, residual.shape)
        except ValueError as exc:
            raise ScoresError(f"scores for the hidden channels ({residual.shape}): {exc}") from None
    try:
        return hidden_cut(residual, size, orders)
    except ValueError as exc:
        raise TargetError(f"{ckpt.path}: {exc}") from None


def residual_plan(
    ckpt: Checkpoint, cut: HiddenCut, covered: Iterable[str], names: Mapping[str, str | None]
) -> LayerPlan:
    """The layer plan of the tensors on the stream that no other plan gathers (``covered``: their full names;
    ``names``: the transform's renames, a ``None`` tensor is dropped and not gathered)."""
    skip = set(covered)
    tensors = {n: ckpt.tensor(n) for n in cut.residual.rules if n not in skip and names.get(n, n) is not None}
    layer = GDNLayer("", "hidden", cut.residual.shape, tensors, kind="hidden")
    return LayerPlan(layer, cut.target, cut.indices, cut.orders, hidden=cut)


def with_hidden(
    ckpt: Checkpoint,
    plans: Mapping[str, LayerPlan],
    block_plans: Mapping[str, LayerPlan],
    names: Mapping[str, str | None],
    cut: HiddenCut,
    dequantize: bool,
) -> dict[str, LayerPlan]:
    """The GDN layers' ``plans`` and the sub-blocks' ``block_plans`` (in place) with the hidden gather, and the
    plan of the other tensors on the stream (prefix ``""``) added to the GDN ones; FP8 tiles checked."""
    for layer_plan in (*plans.values(), *block_plans.values()):
        layer_plan.hidden = cut
    covered = {p.layer.name(s) for p in (*plans.values(), *block_plans.values()) for s in p.layer.tensors}
    out = {**plans, "": residual_plan(ckpt, cut, covered, names)}
    check_hidden_tiles([*out.values(), *block_plans.values()], dequantize)
    return out


def check_hidden_tiles(plans: Iterable[LayerPlan], dequantize: bool) -> None:
    """FP8: a hidden gather must keep every scale tile whole (:func:`gdnprune.model.layouts.scale_rule`). With
    ``dequantize`` the weights whose tiles it would split are written in BF16 (added to each plan's
    ``dequantize``); else a TargetError."""
    for plan in plans:
        if plan.hidden is None:
            continue
        broken = set()
        for suffix in plan.layer.tensors:
            weight = scaled_weight(suffix)
            if weight is None or weight not in plan.layer.tensors:
                continue
            try:
                plan.hidden.gathers(plan.layer.name(suffix))
            except TileGridError as exc:
                if not dequantize:
                    what = (
                        "sorted"
                        if not plan.hidden.cut
                        else f"cut to hidden size {plan.hidden.target.hidden_size}"
                    )
                    raise TargetError(
                        f"{plan.layer.name(weight)} is FP8 and its hidden channels cannot be {what} exactly: "
                        f"{exc}. Order and cut the hidden channels in whole tiles, or pass `dequantize=True` "
                        f"to write such weights in BF16"
                    ) from None
                broken.add(weight)
        plan.dequantize = frozenset(plan.dequantize | broken)


def hidden_config(config: Mapping, cut: HiddenCut) -> dict:
    """``config`` with the cut's hidden size (unchanged by a sort)."""
    return apply_hidden_to_config(config, cut.target) if cut.cut else dict(config)


def hidden_manifest(cut: HiddenCut) -> dict[str, Any]:
    """The manifest's ``hidden`` entry: the geometry, the target and the order applied."""
    return {
        "shape": cut.residual.shape.as_dict(),
        "target": cut.target.as_dict(),
        "permutation": None if cut.orders is None else orders_to_payload(cut.orders),
    }


def norm_rescaling(ckpt: Checkpoint, scores: Any, cut: HiddenCut | None) -> dict[str, float]:
    """The rescaled-norms correction of a hidden cut (:func:`gdnprune.model.hidden.norm_factors`): the factor of
    every RMS norm on the stream, keyed by the checkpoint's tensor name, from the ``hidden`` entry of
    ``scores`` (a scores file or dict). The kept channels must be the first of that entry's order: the input
    is unsorted (a cut of the first channels is then that order's only when the order is the identity) or
    was sorted by it (its manifest says so), or the same transform sorts by it.

    Raises:
        TargetError: no hidden cut, scores without the norms' statistics, or an input sorted by another order.
    """
    if cut is None or not cut.cut:
        raise TargetError("rescaled norms correct a cut of the hidden size: give a hidden size to cut to")
    payload = read_scores(scores).get(HIDDEN_KEY)
    if not isinstance(payload, Mapping):
        raise TargetError("rescaled norms read the scores' hidden entry: the scores have none")
    order = list(payload.get(ORDER_KEY) or [])
    applied = None if cut.orders is None else np.asarray(cut.orders["channels"]).tolist()
    if applied is None:
        recorded = ((ckpt.manifest or {}).get("hidden") or {}).get("permutation")
        applied = None if recorded is None else list(recorded[ORDER_KEY])
    if applied is None:
        applied = list(range(cut.residual.shape.hidden_size))
    if order != applied:
        raise TargetError(
            f"{ckpt.path}: its hidden channels are not in the order of the scores given for the rescaled norms "
            f"(sort by these scores first, or give the scores it was sorted by)"
        )
    try:
        factors = norm_factors(payload, cut.target.hidden_size)
    except ValueError as exc:
        raise TargetError(str(exc)) from None
    out = {}
    for name, factor in factors.items():
        found = matching_prefixes(name, [n for n in cut.residual.rules if n.endswith("norm.weight")])
        if len(found) == 1:
            out[found[0]] = factor
    if not out:
        raise TargetError(f"{ckpt.path}: none of the scores' norms {sorted(factors)[:3]} is a tensor of it")
    return out


def rescale_written_norms(
    ckpt: Checkpoint, shards: Iterable[Any], factors: Mapping[str, float], manifest_extra: Mapping | None
) -> dict:
    """Multiply the effective scale of every written norm weight of ``factors`` (name -> factor) in place in
    the output shards (:class:`~.engine.ShardPlan`); returns ``manifest_extra`` with the factors in its
    ``hidden`` entry (and that the output is not nested)."""
    offset, done = norm_offset(ckpt.config), []
    for shard in shards:
        for name, (dtype, shape, begin, end) in shard.gdn_entries.items():
            if name not in factors:
                continue
            fd = os.open(shard.dst, os.O_RDWR)
            try:
                data = os.pread(fd, end - begin, shard.data_start + begin)
                values = rescaled_norm(to_float(data, dtype, shape), factors[name], offset)
                write_all(fd, from_float(values, dtype), shard.data_start + begin)
            finally:
                os.close(fd)
            done.append(name)
    extra = dict(manifest_extra or {})
    extra["hidden"] = {
        **extra.get("hidden", {}),
        "rescaled_norms": {n: factors[n] for n in done},
        "nested": False,
    }
    return extra
