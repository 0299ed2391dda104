"""Function-preserving permutation and nested slicing of GatedDeltaNet (GDN) layers.

Geometry (:class:`GDNShape`, ``Hk`` key heads, ``Hv`` value heads, ``r = Hv // Hk`` lanes per group,
head dims ``dk`` and ``dv``) and the canonical index formulas live in :mod:`gdnprune.model.geometry` (numpy, so
that the streaming checkpoint commands need no torch); this module is the torch API around them.

A permutation (:class:`GDNPermutation`) or a nested prefix target becomes one set of canonical index
tensors (``qidx``, ``hidx``, ``vidx``, ``cidx``): ``new[i] = old[idx[i]]``. Permuting gathers with
full-length indices, slicing with prefix indices; which tensor takes which index is data, kept in
:mod:`gdnprune.model.layouts`.

Function preservation: moving whole key groups (their q/k channels and all their value heads), value
heads inside a group, q/k channels inside a key head (q and k together, conv taps follow) and the value
channels (one order for all heads, because the gated RMSNorm weight is shared) leaves the model's
function unchanged up to float summation order. Slicing is not function preserving; note that cutting
``dk`` changes the kernel's q scale ``dk**-0.5`` (q and k are l2-normalised, so no weight can undo it)
and cutting ``dv`` changes what the gated RMSNorm averages over.
"""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass, fields
from typing import Any

import numpy as np
import torch

from .model import geometry
from .model.geometry import GDNShape
from .model.geometry import as_target as _as_target
from .model.layouts import LAYOUTS, Layout, TensorRule, detect_layout, get_layout

__all__ = [
    "GDNShape",
    "GDNPermutation",
    "gated_delta_net_prefix_indices",
    "permute_gated_delta_net_state_dict",
    "slice_gated_delta_net_state_dict",
    "gather_gated_delta_net_tensor",
]


def _torch(indices: Mapping[str, np.ndarray]) -> dict[str, torch.Tensor]:
    return {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in indices.items()}


def gated_delta_net_prefix_indices(
    shape: GDNShape, target: GDNShape | Mapping[str, int]
) -> dict[str, torch.Tensor]:
    """Canonical indices that keep the nested prefix ``target`` of a layer of geometry ``shape``.

    The prefix keeps the first ``Hk'`` key groups, the first ``r'`` lanes of each, the first ``dk'`` key
    dims of each key head and the first ``dv'`` value dims. Returns ``qidx`` [Hk'*dk'], ``hidx`` [Hv'],
    ``vidx`` [Hv'*dv'] and ``cidx`` [2*Hk'*dk' + Hv'*dv'] (offsets from the full ``shape``), on the CPU.

    Raises:
        ValueError: ``target`` exceeds ``shape`` on some axis.
    """
    return _torch(geometry.prefix_indices(shape, target))


def _as_order(key: str, value: Any, expected: tuple[int, ...]) -> torch.Tensor:
    """Validate one order (list or tensor) of shape ``expected``; a long tensor on the input's device."""
    device = value.device if isinstance(value, torch.Tensor) else torch.device("cpu")
    if isinstance(value, torch.Tensor):
        if value.dtype == torch.bool or value.is_complex():
            raise ValueError(f"{key}: expected integers, found dtype {value.dtype}")
        value = value.detach().cpu()
        value = (value.double() if value.is_floating_point() else value.long()).numpy()
    return torch.from_numpy(geometry.as_order(key, value, expected)).to(device)


@dataclass(frozen=True, eq=False)
class GDNPermutation:
    """A function-preserving reordering of one GDN layer.

    Attributes:
        key_groups: [Hk] new position ``p`` takes old key group ``key_groups[p]``.
        value_lanes: [Hk, r] row ``g``: lane order inside OLD group ``g``.
        key_dim: [Hk, dk] row ``g``: q/k channel order of OLD key head ``g``.
        value_dim: [dv] one value-channel order shared by all value heads.

    Each order lists the most important element first, so that a nested prefix keeps the most important
    part. Every row must be a permutation; ``ValueError`` otherwise.
    """

    key_groups: torch.Tensor
    value_lanes: torch.Tensor
    key_dim: torch.Tensor
    value_dim: torch.Tensor

    def __post_init__(self) -> None:
        kg = torch.as_tensor(self.key_groups)
        if kg.dim() != 1:
            raise ValueError(f"key_groups: expected a 1-D order, found shape {list(kg.shape)}")
        Hk = kg.numel()
        vl, kd = torch.as_tensor(self.value_lanes), torch.as_tensor(self.key_dim)
        vd = torch.as_tensor(self.value_dim)
        for name, t, ndim in (("value_lanes", vl, 2), ("key_dim", kd, 2), ("value_dim", vd, 1)):
            if t.dim() != ndim or (ndim == 2 and t.shape[0] != Hk):
                expected = f"[{Hk}, n]" if ndim == 2 else "[n]"
                raise ValueError(f"{name}: expected shape {expected}, found {list(t.shape)}")
        object.__setattr__(self, "key_groups", _as_order("key_groups", kg, (Hk,)))
        object.__setattr__(self, "value_lanes", _as_order("value_lanes", vl, tuple(vl.shape)))
        object.__setattr__(self, "key_dim", _as_order("key_dim", kd, tuple(kd.shape)))
        object.__setattr__(self, "value_dim", _as_order("value_dim", vd, tuple(vd.shape)))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, GDNPermutation):
            return NotImplemented
        return all(
            torch.equal(getattr(self, f.name).cpu(), getattr(other, f.name).cpu()) for f in fields(self)
        )

    __hash__ = None  # type: ignore[assignment]  # mutable tensors inside

    @property
    def shape_signature(self) -> tuple[int, int, int, int]:
        """``(Hk, r, dk, dv)`` implied by the orders."""
        return (
            self.key_groups.numel(),
            self.value_lanes.shape[1],
            self.key_dim.shape[1],
            self.value_dim.numel(),
        )

    def _check_shape(self, shape: GDNShape) -> None:
        want = (shape.num_key_heads, shape.value_heads_per_group, shape.key_head_dim, shape.value_head_dim)
        if self.shape_signature != want:
            raise ValueError(
                f"permutation is for (Hk, r, dk, dv) = {self.shape_signature}, but the layer is {shape} "
                f"(Hk, r, dk, dv) = {want}"
            )

    @classmethod
    def identity(cls, shape: GDNShape) -> GDNPermutation:
        """The permutation that changes nothing."""
        return cls(**_torch(geometry.identity_orders(shape)))

    @classmethod
    def random(cls, shape: GDNShape, *, generator: torch.Generator | None = None) -> GDNPermutation:
        """Uniformly random orders on every axis (independent per group where the axis is per group)."""
        Hk, r, dk, dv = (
            shape.num_key_heads,
            shape.value_heads_per_group,
            shape.key_head_dim,
            shape.value_head_dim,
        )
        return cls(
            torch.randperm(Hk, generator=generator),
            torch.rand(Hk, r, generator=generator).argsort(dim=-1),
            torch.rand(Hk, dk, generator=generator).argsort(dim=-1),
            torch.randperm(dv, generator=generator),
        )

    @classmethod
    def from_score_payload(cls, payload: Mapping[str, Any], shape: GDNShape) -> GDNPermutation:
        """Build from a score payload (one layer of a scores file).

        Reads ``key_group_order_most_important_first`` [Hk], ``value_lane_order_most_important_first``
        [Hk, r], ``key_dim_order_most_important_first`` [Hk, dk] and ``value_dim_order_most_important_first``
        [dv] (lists or tensors); a missing key means identity order. Other keys are ignored.

        Raises:
            ValueError: a wrong shape or an order that is not a permutation, naming the key.
        """
        return cls(**_torch(geometry.orders_from_payload(payload, shape)))

    def to_score_payload(self) -> dict[str, list]:
        """The four ``*_order_most_important_first`` keys as JSON-ready lists."""
        return geometry.orders_to_payload(self._numpy())

    def inverse(self) -> GDNPermutation:
        """The permutation that undoes this one (applied to the permuted layer)."""
        G = self.key_groups
        return GDNPermutation(
            G.argsort(),
            self.value_lanes[G].argsort(dim=-1),
            self.key_dim[G].argsort(dim=-1),
            self.value_dim.argsort(),
        )

    def indices(
        self, shape: GDNShape, *, target: GDNShape | Mapping[str, int] | None = None
    ) -> dict[str, torch.Tensor]:
        """Canonical full-width gather indices (``qidx``, ``hidx``, ``vidx``, ``cidx``) of this permutation.

        With ``target``, the indices of permute-then-slice in one gather: the nested prefix ``target`` of
        the permuted layer, expressed in the original layer's canonical indices.
        """
        self._check_shape(shape)
        return _torch(geometry.order_indices(self._numpy(), shape, target))

    def _numpy(self) -> dict[str, np.ndarray]:
        return {f.name: getattr(self, f.name).cpu().numpy() for f in fields(self)}


# --------------------------------------------------------------------------------------------------------
# State-dict surgery: one gather per coupled tensor, driven by the layout table.


def gather_gated_delta_net_tensor(
    name: str,
    tensor: torch.Tensor,
    *,
    layout: str | Layout,
    shape: GDNShape,
    target: GDNShape,
    indices: Mapping[str, torch.Tensor],
    prefix: str = "",
) -> torch.Tensor:
    """Gather one GDN tensor (suffix ``name`` of ``layout``) from geometry ``shape`` to ``target``.

    This is the single gather behind permute and slice; streaming checkpoint surgery calls it tensor by
    tensor. ``indices`` are canonical indices for ``shape`` -> ``target`` (from
    :meth:`GDNPermutation.indices` or :func:`gated_delta_net_prefix_indices`). The result is a new,
    contiguous tensor on ``tensor``'s device with ``tensor``'s dtype.

    Raises:
        ValueError: ``name`` is not a tensor of ``layout``, or ``tensor`` does not have the shape ``shape``
            implies (the message names ``prefix``, the tensor, the expected and the actual shape).
    """
    layout = get_layout(layout)
    rule = layout.rule(name)
    if rule is None:
        raise ValueError(
            f"{prefix or '<layer>'}: tensor {name!r} is not part of the {layout.name} GDN layout"
        )
    _check_tensor(prefix, rule, tensor, shape)
    full = geometry.check_indices(indices, shape, target)
    return _gather(rule, tensor, shape, target, full)


def _gather(rule: TensorRule, tensor: torch.Tensor, shape: GDNShape, target: GDNShape, full) -> torch.Tensor:
    index = torch.from_numpy(rule.gather_index(shape, target, full)).to(tensor.device)
    return tensor.index_select(rule.axis, index).contiguous()


def _key(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _check_tensor(prefix: str, rule: TensorRule, tensor: torch.Tensor, shape: GDNShape) -> None:
    ok = tensor.dim() == rule.ndim and tensor.shape[rule.axis] == rule.length(shape)
    if not ok:
        raise ValueError(
            f"{prefix or '<layer>'}: tensor {_key(prefix, rule.name)!r} has shape {tuple(tensor.shape)}, "
            f"expected {rule.expected_shape(shape)} for {shape}"
        )


def _gather_layer(
    state_dict: MutableMapping[str, torch.Tensor],
    prefix: str,
    shape: GDNShape,
    target: GDNShape,
    indices: Mapping[str, torch.Tensor],
    layout: str | Layout | None,
    strict: bool,
) -> None:
    """Validate the whole layer first, then replace every coupled tensor; on error nothing changes."""
    if not isinstance(shape, GDNShape):
        raise ValueError(f"shape must be a GDNShape, got {type(shape).__name__}")
    prefix = prefix.rstrip(".")
    head = prefix + "." if prefix else ""
    names = {k[len(head) :]: k for k in state_dict if k.startswith(head)}
    if layout is None:
        if not strict:
            raise ValueError("strict=False needs an explicit layout= (detection needs the whole layer)")
        if not names:
            raise ValueError(f"{prefix or '<root>'}: no tensors under this prefix (is it a GDN layer?)")
        chosen = detect_layout(names)
        if chosen is None:
            raise ValueError(
                f"{prefix or '<root>'}: no GDN tensors found (tensors {sorted(names)[:8]} match none of the "
                f"layouts {sorted(LAYOUTS)})"
            )
    else:
        chosen = get_layout(layout)
    unknown = sorted(n for n in names if chosen.rule(n) is None)
    if unknown:
        raise ValueError(
            f"{prefix or '<root>'}: tensors {[_key(prefix, n) for n in unknown]} are not part of the "
            f"{chosen.name} GDN layout; refusing a partial permutation (quantisation scales are not supported)"
        )
    missing = [r for r in chosen.rules if r.required and r.name not in names]
    if strict and missing:
        r = missing[0]
        raise ValueError(
            f"{prefix or '<root>'}: missing tensor {_key(prefix, r.name)!r} of the {chosen.name} GDN layout "
            f"(expected shape {r.expected_shape(shape)}); also missing: {[m.name for m in missing[1:]]}"
        )
    if not names:
        raise ValueError(f"{prefix or '<root>'}: no tensors under this prefix")
    full = geometry.check_indices(indices, shape, target)
    rules = {name: rule for name in names if (rule := chosen.rule(name)) is not None}  # all: none unknown
    for name, key in names.items():
        _check_tensor(prefix, rules[name], state_dict[key], shape)
    updated = {key: _gather(rules[name], state_dict[key], shape, target, full) for name, key in names.items()}
    state_dict.update(updated)


def _on_device_of(indices: dict[str, torch.Tensor], state_dict: Mapping[str, torch.Tensor], prefix: str):
    prefix = prefix.rstrip(".")
    head = prefix + "." if prefix else ""
    device = next((v.device for k, v in state_dict.items() if k.startswith(head)), torch.device("cpu"))
    return {k: v.to(device) for k, v in indices.items()}


def permute_gated_delta_net_state_dict(
    state_dict: MutableMapping[str, torch.Tensor],
    *,
    prefix: str,
    shape: GDNShape,
    permutation: GDNPermutation,
    layout: str | Layout | None = None,
    strict: bool = True,
) -> dict[str, torch.Tensor]:
    """Permute the GDN layer at ``prefix`` in place (its entries are replaced), preserving the function.

    Every coupled tensor of the layer (``<prefix>.<suffix>`` keys; biases move with their rows) is
    gathered with ``permutation.indices(shape)``. The layout is detected from the keys unless ``layout``
    (``"qwen3_5"``, ``"qwen3_next"``, ``"olmo_hybrid"``) is given. With ``strict=False`` (which requires
    ``layout``) a partial state dict is accepted and only the tensors present are permuted.

    Returns the canonical indices (``qidx``, ``hidx``, ``vidx``, ``cidx``) on the layer's device.

    Raises:
        ValueError: no GDN tensors under ``prefix``, a missing coupled tensor, a tensor of the wrong
            shape, or a tensor the layout does not know; the state dict is then left unchanged.
    """
    if not isinstance(permutation, GDNPermutation):
        raise ValueError(f"permutation must be a GDNPermutation, got {type(permutation).__name__}")
    indices = permutation.indices(shape)
    _gather_layer(state_dict, prefix, shape, shape, indices, layout, strict)
    return _on_device_of(indices, state_dict, prefix)


def slice_gated_delta_net_state_dict(
    state_dict: MutableMapping[str, torch.Tensor],
    *,
    prefix: str,
    shape: GDNShape,
    target: GDNShape | Mapping[str, int],
    layout: str | Layout | None = None,
    strict: bool = True,
    permutation: GDNPermutation | None = None,
) -> dict[str, torch.Tensor]:
    """Cut the GDN layer at ``prefix`` to the nested prefix ``target``, in place.

    Keeps the first ``Hk'`` key groups, the first ``r'`` lanes of each, the first ``dk'`` key dims and
    the first ``dv'`` value dims on every coupled tensor. With ``permutation``, the layer is permuted and
    sliced in one gather (equal to permuting first, then slicing). ``layout`` and ``strict`` as in
    :func:`permute_gated_delta_net_state_dict`. The model's config must be edited to ``target`` before
    loading the result (see :meth:`GDNShape.config_updates`).

    Returns the canonical indices used, on the layer's device.

    Raises:
        ValueError: as :func:`permute_gated_delta_net_state_dict`, or ``target`` exceeds ``shape``.
    """
    if not isinstance(shape, GDNShape):
        raise ValueError(f"shape must be a GDNShape, got {type(shape).__name__}")
    target = _as_target(shape, target)
    if permutation is None:
        indices = gated_delta_net_prefix_indices(shape, target)
    else:
        indices = permutation.indices(shape, target=target)
    _gather_layer(state_dict, prefix, shape, target, indices, layout, strict)
    return _on_device_of(indices, state_dict, prefix)
