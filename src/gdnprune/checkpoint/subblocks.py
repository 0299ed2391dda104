"""The sub-block half of a transform: which attention / MLP / shared-expert blocks change, and how.

A transform (:mod:`gdnprune.checkpoint.transform`) hands the engine one :class:`~.engine.LayerPlan` per
changed module; GDN layers and sub-blocks are planned alike (a layout table, a geometry, canonical indices)
and the engine does not tell them apart. Here: the sub-block fields of a target (``intermediate_size``,
``shared_expert_intermediate_size``, ``num_attention_heads``, ``num_key_value_heads``), the sub-block
entries of a scores dict (keyed by the block's prefix) and of a version-2 plan become layer plans; the
config gets the new geometries (``per_layer_config`` where the layers differ); and the FP8 scale-tile
check that GDN layers and sub-blocks share. Only blocks that are sorted or cut are planned: the others
are copied byte for byte. No torch.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ..io.plan_file import plan_block_kinds, read_plan, resolve_block_plan
from ..io.scores_file import ScoresError, match_layers
from ..model.geometry import layer_index_of
from ..model.layouts import TileGridError, scaled_weight
from ..model.model_config import MTP_PREFIX
from ..model.subblock_geometry import (
    BLOCK_FIELDS,
    KINDS,
    apply_block_targets_to_config,
    block_indices,
    block_kind_of,
    block_kinds_of,
    numbered_name_map,
    orders_from_payload,
    orders_to_payload,
    resolve_block_target,
)
from ..model.targets import TargetError
from ..model.tiles import snap_to_tiles
from .engine import LayerPlan
from .folder import Checkpoint, find_block_layers

__all__ = ["SubBlockPlan", "split_target", "split_permutations", "plan_sub_blocks", "check_scale_grids"]


@dataclass
class SubBlockPlan:
    """The sub-blocks of a transform: the layer plans of those that change, and every block's target per
    kind (``{kind: {layer index: geometry}}``, for the config)."""

    plans: dict[str, LayerPlan] = field(default_factory=dict)
    targets: dict[str, dict[int, Any]] = field(default_factory=dict)
    passthrough: list[str] = field(
        default_factory=list
    )  # mtp.* modules of a kind that is cut, left as they are
    names: dict[str, str | None] = field(
        default_factory=dict
    )  # per-expert tensors renumbered (None: dropped)

    @property
    def cut(self) -> bool:
        return any(p.target != p.layer.shape for p in self.plans.values())

    def apply_to_config(self, config: Mapping) -> dict:
        """``config`` with the geometry of every kind that some block of is cut."""
        config = dict(config)
        for kind, targets in self.targets.items():
            if any(p.layer.kind == kind and p.target != p.layer.shape for p in self.plans.values()):
                config = apply_block_targets_to_config(config, kind, targets)
        return config

    def manifest(self) -> dict:
        """The ``blocks`` entry of the manifest: kind, layout, geometry, target and orders of each changed block."""
        return {
            prefix: {
                "kind": p.layer.kind,
                "layout": p.layer.layout,
                "shape": p.layer.shape.as_dict(),
                "target": p.target.as_dict(),
                "permutation": None if p.permutation is None else orders_to_payload(p.permutation),
            }
            for prefix, p in self.plans.items()
        }


def split_target(target: Any) -> tuple[Any, dict[str, int]]:
    """``(GDN part, sub-block fields)`` of a target; a GDN geometry or None has no sub-block fields."""
    if not isinstance(target, Mapping):
        return target, {}
    blocks = {k: v for k, v in target.items() if k in BLOCK_FIELDS and v is not None}
    rest = {k: v for k, v in target.items() if k not in BLOCK_FIELDS}
    return (rest if rest or not blocks else None), blocks


def split_permutations(permutations: Mapping | None) -> tuple[Mapping | None, dict]:
    """``(GDN entries, sub-block entries)`` of a scores dict's layers (sub-blocks by their module path)."""
    if permutations is None:
        return None, {}
    blocks = {k: v for k, v in permutations.items() if isinstance(k, str) and block_kind_of(k) is not None}
    gdn = {k: v for k, v in permutations.items() if k not in blocks}
    return (gdn if gdn or not blocks else None), blocks


def plan_sub_blocks(
    ckpt: Checkpoint,
    orders_in: Mapping,
    target: Mapping[str, int],
    plan,
    *,
    dequantize: bool,
    snap_quant: int | None = None,
) -> SubBlockPlan:
    """The layer plans of the sub-blocks that ``orders_in`` (prefix -> payload), the sub-block ``target``
    fields or ``plan`` sort or cut (``snap_quant``: each target snapped up to fit tiles of that size,
    :func:`gdnprune.model.tiles.snap_to_tiles`).

    Raises:
        CheckpointError: a sub-block of a kind asked for does not fit its layouts (e.g. an indexed attention);
        ScoresError, TargetError, PlanError: orders or targets that do not fit.
    """
    kinds = {k.name for k in KINDS.values() if set(target) & set(k.config_keys)}
    kinds |= {kind.name for p in orders_in for kind in block_kinds_of(p)}
    if plan is not None:
        kinds |= plan_block_kinds(plan)
    if not kinds:
        return SubBlockPlan()
    # the sub-blocks as the engine sees them (GDNLayer records), used as blocks.Block (kind, prefix, shape)
    layers: dict[str, Any] = {layer.prefix: layer for layer in find_block_layers(ckpt, sorted(kinds))}
    asked = set(target) | (
        set(read_plan(plan).get("default") or {}) & set(BLOCK_FIELDS) if plan is not None else set()
    )
    absent = sorted(
        f for f in asked if not any(f in KINDS[layer.kind].config_keys for layer in layers.values())
    )
    if absent:
        missing = sorted({k.name for k in KINDS.values() for f in absent if f in k.config_keys})
        raise TargetError(
            f"{ckpt.path}: nothing to cut with {absent}: the checkpoint has no {' or '.join(missing)} "
            f"sub-block (at {', '.join(KINDS[k].where for k in missing)})"
        )
    try:
        named = match_layers(orders_in, layers, what="scores")
    except ValueError as exc:
        raise ScoresError(str(exc).replace("GDN layer", "sub-block")) from None
    if plan is not None:
        targets = resolve_block_plan(plan, list(layers.values()))
    else:
        try:
            targets = {prefix: resolve_block_target(layer, target) for prefix, layer in layers.items()}
        except ValueError as exc:
            raise TargetError(str(exc)) from None
    if snap_quant:
        targets = {p: snap_to_tiles(layers[p].shape, t, snap_quant) for p, t in targets.items()}
    out = SubBlockPlan()
    for prefix, layer in layers.items():
        out.targets.setdefault(layer.kind, {})[layer_index_of(prefix)] = targets[prefix]
        orders = None
        if prefix in named:
            try:
                orders = orders_from_payload(named[prefix], layer.shape)
            except ValueError as exc:
                raise ScoresError(f"scores for sub-block {prefix!r} ({layer.shape}): {exc}") from None
        if orders is not None or targets[prefix] != layer.shape:
            indices = block_indices(layer.shape, targets[prefix], orders)
            out.plans[prefix] = LayerPlan(layer, targets[prefix], indices, orders)
            out.names.update(numbered_name_map(layer, indices))
    check_scale_grids(out.plans, dequantize)
    cut_kinds = {p.layer.kind for p in out.plans.values() if p.target != p.layer.shape}
    out.passthrough = sorted(
        {
            n.rsplit(".", 2)[0]
            for n in ckpt.names
            if n.startswith(MTP_PREFIX) and any(KINDS[k].matches(n.rsplit(".", 2)[0]) for k in cut_kinds)
        }
    )
    return out


#: how to keep FP8 scale tiles whole, per kind of block
_WHOLE = {
    "gdn": "Cut whole heads (head dims that are multiples of {b})",
    "attention": "Move and cut whole heads (head dims that are multiples of {b})",
    "mlp": "Order and cut channels in whole tiles of {b}",
    "shared_expert": "Order and cut channels in whole tiles of {b}",
    "experts": "Keep whole experts",
}


def check_scale_grids(plans: Mapping[str, LayerPlan], dequantize: bool) -> None:
    """FP8: every scale tile must stay whole (:func:`gdnprune.model.layouts.scale_rule`). With ``dequantize`` the
    weights whose tiles a gather would split are marked to be written in BF16; else a TargetError."""
    for prefix, layer_plan in plans.items():
        broken = set()
        for suffix, rule in layer_plan.layer.scales.items():
            try:
                rule.gather_index(layer_plan.layer.shape, layer_plan.target, layer_plan.indices)
            except TileGridError as exc:
                if not dequantize:
                    what = (
                        "sorted"
                        if layer_plan.target == layer_plan.layer.shape
                        else f"cut to {layer_plan.target}"
                    )
                    raise TargetError(
                        f"{prefix} is FP8 with {rule.tile}-wide scale tiles and cannot be {what} "
                        f"exactly: {exc}. {_WHOLE[layer_plan.layer.kind].format(b=rule.tile)}, or "
                        f"pass `dequantize=True` to write such weights in BF16"
                    ) from None
                broken.add(scaled_weight(suffix))
        layer_plan.dequantize = frozenset(broken)
