"""Permute and cut the dense sub-blocks (attention heads, MLP channels) of a state dict, with torch.

Routed experts move whole (router rows with them): fused 3-D expert tensors are gathered along their
first axis, per-expert tensors (``experts.N.*``) are renumbered by name.

The geometry, the kinds and the index formulas are in :mod:`gdnprune.model.subblock_geometry` (numpy); which tensor takes
which index along which axis is in the layout tables of :mod:`gdnprune.model.layouts`. This module applies
them: one ``index_select`` per coupled tensor, as :mod:`gdnprune.gated_delta_net` does for GDN layers.

The hidden size (the residual stream's width, :mod:`gdnprune.model.hidden`) is one more axis, gathered the
same way in every tensor on the stream (:func:`slice_hidden_state_dict`), after or before the blocks' own
axes (they are other axes of the same tensors).

Function preservation: an MLP's channels may take any order (``gate_proj``/``up_proj`` rows and
``down_proj`` columns move together); attention moves whole key-value groups with their query heads, and
query heads inside their group (``q_proj`` rows — query and output gate of a head together — ``k_proj``/
``v_proj`` rows and ``o_proj`` columns; a whole-projection ``q_norm``/``k_norm`` moves with its channels).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, MutableMapping
from typing import Any

import numpy as np
import torch

from .hidden import HiddenTensors, find_hidden, hidden_indices, resolve_hidden_target
from .layouts import get_layout
from .subblock_geometry import (
    Block,
    block_indices,
    find_blocks,
    numbered_name_map,
    orders_from_payload,
    orders_to_payload,
    resolve_block_target,
)
from .subblock_shapes import HiddenShape

__all__ = [
    "find_model_blocks",
    "gather_block_tensor",
    "permute_block_state_dict",
    "slice_block_state_dict",
    "random_orders",
    "find_model_hidden",
    "slice_hidden_state_dict",
]


def find_model_blocks(model: torch.nn.Module, kinds: Iterable[str] | None = None) -> list[Block]:
    """The sub-blocks of a loaded model (prefixes as in ``model.state_dict()``), checked against its config."""
    shapes = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    return find_blocks(shapes, model.config, kinds)


def gather_block_tensor(
    block: Block, suffix: str, tensor: torch.Tensor, target: Any, indices: Mapping[str, np.ndarray]
) -> torch.Tensor:
    """Tensor ``suffix`` of ``block`` gathered from the block's geometry to ``target`` (``indices``: from
    :func:`gdnprune.model.subblock_geometry.block_indices`). Raises ``ValueError`` for a tensor of the wrong shape."""
    rule = get_layout(block.layout).rule(suffix)
    if rule is None:
        raise ValueError(f"{block.prefix}: tensor {suffix!r} is not part of the {block.layout} layout")
    if tensor.dim() != rule.ndim or tensor.shape[rule.axis] != rule.length(block.shape):
        raise ValueError(
            f"{block.prefix}: tensor {block.prefix}.{suffix} has shape {tuple(tensor.shape)}, expected "
            f"{rule.expected_shape(block.shape)} for {block.shape}"
        )
    index = torch.from_numpy(rule.gather_index(block.shape, target, indices)).to(tensor.device)
    return tensor.index_select(rule.axis, index).contiguous()


def _as_orders(block: Block, orders: Mapping[str, Any] | None) -> dict[str, np.ndarray] | None:
    """Validated orders from a score payload (``*_order_most_important_first`` keys) or from the orders
    themselves (``channels``; ``kv_groups`` and ``query_heads``)."""
    if orders is None:
        return None
    orders = {k: (v.detach().cpu().numpy() if isinstance(v, torch.Tensor) else v) for k, v in orders.items()}
    if not any(k.endswith("_most_important_first") for k in orders):
        unknown = sorted(set(orders) - set(block.shape.order_shapes()))
        if unknown:
            raise ValueError(
                f"{block.prefix}: unknown orders {unknown}; expected some of "
                f"{list(block.shape.order_shapes())}"
            )
        orders = orders_to_payload(orders)
    try:
        return orders_from_payload(orders, block.shape)
    except ValueError as exc:
        raise ValueError(f"{block.prefix}: {exc}") from None


def slice_block_state_dict(
    state_dict: MutableMapping[str, torch.Tensor],
    block: Block,
    target: Any = None,
    *,
    orders: Mapping[str, Any] | None = None,
) -> dict[str, np.ndarray]:
    """Sort (``orders``: a payload or ``{"channels": ...}`` / ``{"kv_groups": ..., "query_heads": ...}``) and
    cut (``target``: a geometry or a mapping of target fields; None keeps the size) the sub-block ``block``
    of ``state_dict``, in place, with one gather per coupled tensor. Checks everything before changing
    anything. Returns the canonical indices used."""
    if target is None or isinstance(target, Mapping):
        target = resolve_block_target(block, target)
    else:
        problems = block.shape.fits(target)
        if problems:
            raise ValueError(
                f"{block.prefix}: target {target} does not fit in {block.shape}: {'; '.join(problems)}"
            )
    indices = block_indices(block.shape, target, _as_orders(block, orders))
    head = block.prefix + "."
    missing = [s for s in (*block.tensors, *block.numbered) if head + s not in state_dict]
    if missing:
        raise ValueError(f"{block.prefix}: state dict lacks {[head + s for s in missing]}")
    updated = {
        head + s: gather_block_tensor(block, s, state_dict[head + s], target, indices) for s in block.tensors
    }
    renamed = numbered_name_map(block, indices)  # per-expert tensors: a gather over names
    moved = {new: state_dict[old] for old, new in renamed.items() if new is not None}
    for old in renamed:
        del state_dict[old]
    state_dict.update(updated)
    state_dict.update(moved)
    return indices


def permute_block_state_dict(
    state_dict: MutableMapping[str, torch.Tensor], block: Block, orders: Mapping[str, Any]
) -> dict[str, np.ndarray]:
    """Sort sub-block ``block`` of ``state_dict`` in place by ``orders`` (function preserving)."""
    return slice_block_state_dict(state_dict, block, None, orders=orders)


def random_orders(block: Block, *, generator: torch.Generator | None = None) -> dict[str, np.ndarray]:
    """Uniformly random orders of a sub-block (one query-head order per key-value group)."""
    out = {}
    for name, shape in block.shape.order_shapes().items():
        out[name] = torch.rand(shape, generator=generator).argsort(dim=-1).numpy()
    return out


def find_model_hidden(model: torch.nn.Module) -> HiddenTensors:
    """The tensors of a loaded model on its residual stream (:func:`gdnprune.model.hidden.find_hidden`)."""
    shapes = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    return find_hidden(shapes, model.config)


def slice_hidden_state_dict(
    state_dict: MutableMapping[str, torch.Tensor],
    hidden: HiddenTensors,
    target: Any = None,
    *,
    orders: Mapping[str, Any] | None = None,
) -> dict[str, np.ndarray]:
    """Sort (``orders``: ``{"channels": [H]}``) and cut (``target``: a hidden size, a
    :class:`~gdnprune.model.subblock_shapes.HiddenShape` or a mapping with ``hidden_size``; None keeps it) the
    hidden channels of every tensor of ``state_dict`` on the residual stream, in place: one ``index_select``
    per axis on the stream. Checks every tensor first. Returns the canonical indices used."""
    t: HiddenShape = resolve_hidden_target(hidden.shape, target)
    if orders is not None:
        orders = {
            k: np.asarray(v.detach().cpu() if isinstance(v, torch.Tensor) else v) for k, v in orders.items()
        }
    indices = hidden_indices(hidden.shape, t, orders)
    names = [n for n in hidden.rules if n in state_dict]
    for name in names:
        tensor = state_dict[name]
        for rule in hidden.rules[name]:
            if tensor.dim() != rule.ndim or tensor.shape[rule.axis] != rule.length(hidden.shape):
                raise ValueError(
                    f"tensor {name} has shape {tuple(tensor.shape)}, expected {rule.expected_shape(hidden.shape)}"
                )
    updated = {}
    for name in names:
        out = state_dict[name]
        for axis, index in hidden.gathers(name, t, indices):
            out = out.index_select(axis, torch.from_numpy(index).to(out.device))
        updated[name] = out.contiguous()
    state_dict.update(updated)
    return indices
