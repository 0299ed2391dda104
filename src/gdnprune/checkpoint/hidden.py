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

from collections.abc import Iterable, Mapping
from typing import Any

from ..io.scores_file import ScoresError
from ..model.hidden import (
    HIDDEN_FIELDS,
    HIDDEN_KEY,
    HiddenCut,
    apply_hidden_to_config,
    find_hidden,
    hidden_cut,
    orders_from_payload,
    orders_to_payload,
)
from ..model.layouts import TileGridError, scaled_weight
from ..model.targets import TargetError
from .engine import LayerPlan
from .folder import Checkpoint, CheckpointError, GDNLayer, tile_size

__all__ = [
    "split_hidden_target",
    "split_hidden_order",
    "plan_hidden",
    "residual_plan",
    "check_hidden_tiles",
    "hidden_config",
    "hidden_manifest",
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
        residual = find_hidden(
            {n: ckpt.tensor(n).shape for n in ckpt.names}, ckpt.config, tile_size=tile_size(ckpt)
        )
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
