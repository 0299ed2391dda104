"""Function-preserving permutation and nested slicing of GatedDeltaNet (GDN) layers.

Geometry of one GDN layer (:class:`GDNShape`): ``Hk`` key heads (= groups), ``Hv`` value heads,
``r = Hv // Hk`` value heads ("lanes") per group, ``dk`` q/k channels per key head and ``dv`` v/z
channels per value head. Value head ``h = g*r + j`` reads key head ``g = h // r`` (``repeat_interleave``).

The canonical index formulas — the single place they are written down:

* q channel ``(g, d)``        -> ``g*dk + d``; the k channel of the same pair is ``Hk*dk + g*dk + d``
* value head ``(g, j)``       -> ``h = g*r + j``
* v / z channel ``(h, e)``    -> ``h*dv + e``
* conv / fused q-k-v channels -> ``[q | k | v]``, i.e. ``cat(qidx, Hk*dk + qidx, 2*Hk*dk + vidx)``

A permutation (:class:`GDNPermutation`) or a nested prefix target becomes one set of canonical index
tensors (``qidx``, ``hidx``, ``vidx``, ``cidx``): ``new[i] = old[idx[i]]``. Permuting gathers with
full-length indices, slicing with prefix indices; which tensor takes which index is data, kept in
:mod:`gdnprune.layouts`.

Function preservation: moving whole key groups (their q/k channels and all their value heads), value
heads inside a group, q/k channels inside a key head (q and k together, conv taps follow) and the value
channels (one order for all heads, because the gated RMSNorm weight is shared) leaves the model's
function unchanged up to float summation order. Slicing is not function preserving; note that cutting
``dk`` changes the kernel's q scale ``dk**-0.5`` (q and k are l2-normalised, so no weight can undo it)
and cutting ``dv`` changes what the gated RMSNorm averages over.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, fields
from typing import Any, Mapping, MutableMapping

import torch

from .layouts import LAYOUTS, Layout, TensorRule, detect_layout, get_layout

__all__ = [
    "GDNShape",
    "GDNPermutation",
    "gated_delta_net_prefix_indices",
    "permute_gated_delta_net_state_dict",
    "slice_gated_delta_net_state_dict",
    "gather_gated_delta_net_tensor",
]

INDEX_KEYS = ("qidx", "hidx", "vidx", "cidx")

_PAYLOAD_KEYS = {
    "key_groups": "key_group_order_most_important_first",
    "value_lanes": "value_lane_order_most_important_first",
    "key_dim": "key_dim_order_most_important_first",
    "value_dim": "value_dim_order_most_important_first",
}

_CONFIG_KEYS = {
    "num_key_heads": "linear_num_key_heads",
    "num_value_heads": "linear_num_value_heads",
    "key_head_dim": "linear_key_head_dim",
    "value_head_dim": "linear_value_head_dim",
}


def _get(config: Any, key: str, default: Any = None) -> Any:
    """``config[key]`` for dicts, ``config.key`` for config objects."""
    if isinstance(config, Mapping):
        return config.get(key, default)
    return getattr(config, key, default)


@dataclass(frozen=True)
class GDNShape:
    """Width geometry of one GatedDeltaNet layer.

    Attributes:
        num_key_heads: ``Hk``, key heads = groups.
        num_value_heads: ``Hv``, value heads; a multiple of ``Hk``.
        key_head_dim: ``dk``, q/k channels per key head.
        value_head_dim: ``dv``, v/z channels per value head.

    Raises:
        ValueError: a field is not a positive integer, or ``Hv % Hk != 0``.
    """

    num_key_heads: int
    num_value_heads: int
    key_head_dim: int
    value_head_dim: int

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"GDNShape.{f.name} must be a positive integer, got {value!r}")
        if self.num_value_heads % self.num_key_heads:
            raise ValueError(
                f"GDNShape: num_value_heads ({self.num_value_heads}) must be a multiple of "
                f"num_key_heads ({self.num_key_heads})"
            )

    @property
    def value_heads_per_group(self) -> int:
        """``r = Hv // Hk``: value heads (lanes) that share one key head."""
        return self.num_value_heads // self.num_key_heads

    @property
    def key_dim(self) -> int:
        """``Hk * dk``: q (or k) channels of the layer."""
        return self.num_key_heads * self.key_head_dim

    @property
    def value_dim(self) -> int:
        """``Hv * dv``: v (or z) channels of the layer."""
        return self.num_value_heads * self.value_head_dim

    @property
    def conv_dim(self) -> int:
        """``2*Hk*dk + Hv*dv``: channels of the depthwise conv (and of the fused q-k-v projection)."""
        return 2 * self.key_dim + self.value_dim

    def replace(self, **changes: int) -> "GDNShape":
        """A copy with some fields changed (validated like the constructor)."""
        return GDNShape(**{**self.as_dict(), **changes})

    def as_dict(self) -> dict[str, int]:
        """The four fields as a plain dict."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def config_updates(self) -> dict[str, int]:
        """The transformers config keys (``linear_*``) that describe this geometry."""
        return {_CONFIG_KEYS[name]: value for name, value in self.as_dict().items()}

    def apply_to_config(self, config: Any) -> Any:
        """A deep copy of ``config`` (object or dict) whose GDN geometry is this shape.

        The ``linear_*`` keys are set where :meth:`from_config` reads them: on the config itself, or on
        its ``text_config`` (vision-language models).
        """
        config = copy.deepcopy(config)
        holder = config
        if _get(config, "linear_num_key_heads") is None and _get(config, "text_config") is not None:
            holder = _get(config, "text_config")
        for key, value in self.config_updates().items():
            if isinstance(holder, MutableMapping):
                holder[key] = value
            else:
                setattr(holder, key, value)
        return config

    @classmethod
    def from_config(cls, config: Any) -> "GDNShape":
        """Geometry from a transformers config (object or dict) with ``linear_*`` keys, or its ``text_config``."""
        source = config
        if _get(config, "linear_num_key_heads") is None and _get(config, "text_config") is not None:
            source = _get(config, "text_config")
        values = {name: _get(source, key) for name, key in _CONFIG_KEYS.items()}
        missing = [_CONFIG_KEYS[name] for name, value in values.items() if value is None]
        if missing:
            raise ValueError(f"config has no GDN geometry: missing {missing} (also looked in text_config)")
        return cls(**values)

    @classmethod
    def from_module(cls, module: Any) -> "GDNShape":
        """Geometry of a transformers GDN module (``num_k_heads``, ``num_v_heads``, ``head_k_dim``, ``head_v_dim``)."""
        try:
            return cls(module.num_k_heads, module.num_v_heads, module.head_k_dim, module.head_v_dim)
        except AttributeError as exc:
            raise ValueError(f"{type(module).__name__} is not a GDN module: {exc}") from None

    @classmethod
    def from_mamba_config(cls, config: Any) -> "GDNShape":
        """Geometry from a Mamba-style config: ``num_groups`` (Hk), ``num_heads`` (Hv), ``state_dim`` (dk), ``head_dim`` (dv)."""
        names = {"num_groups": ("num_groups", "n_groups"), "num_heads": ("num_heads",),
                 "state_dim": ("state_dim", "ssm_state_size", "d_state"), "head_dim": ("head_dim",)}
        values = {}
        for field, candidates in names.items():
            values[field] = next((v for c in candidates if (v := _get(config, c)) is not None), None)
            if values[field] is None:
                raise ValueError(f"Mamba-style config has no {field!r} (looked for {list(candidates)})")
        return cls(values["num_groups"], values["num_heads"], values["state_dim"], values["head_dim"])


def _as_target(shape: GDNShape, target: GDNShape | Mapping[str, int]) -> GDNShape:
    """Resolve a target (a GDNShape, or a mapping of some GDNShape fields) and check it fits in ``shape``."""
    if isinstance(target, Mapping):
        unknown = set(target) - set(shape.as_dict())
        if unknown:
            raise ValueError(f"unknown target fields {sorted(unknown)}; expected some of {list(shape.as_dict())}")
        target = shape.replace(**{k: v for k, v in target.items() if v is not None})
    if not isinstance(target, GDNShape):
        raise ValueError(f"target must be a GDNShape or a mapping of its fields, got {type(target).__name__}")
    too_big = [
        f"{name} {getattr(target, name)} > {getattr(shape, name)}"
        for name in ("num_key_heads", "value_heads_per_group", "key_head_dim", "value_head_dim")
        if getattr(target, name) > getattr(shape, name)
    ]
    if too_big:
        raise ValueError(f"target {target} does not fit in {shape}: {', '.join(too_big)}")
    return target


def _canonical_indices(
    shape: GDNShape, groups: torch.Tensor, lanes: torch.Tensor, key_dims: torch.Tensor, value_dims: torch.Tensor
) -> dict[str, torch.Tensor]:
    """Canonical gather indices, ``new[i] = old[idx[i]]``, from per-new-position choices.

    ``groups`` [Hk']: old key group at each new group position; ``lanes`` [Hk', r']: old lane of each new
    lane; ``key_dims`` [Hk', dk']: old q/k channel of each new one; ``value_dims`` [dv']: old value dim.
    """
    r, dk, dv = shape.value_heads_per_group, shape.key_head_dim, shape.value_head_dim
    hidx = (groups[:, None] * r + lanes).reshape(-1)
    qidx = (groups[:, None] * dk + key_dims).reshape(-1)
    vidx = (hidx[:, None] * dv + value_dims[None, :]).reshape(-1)
    cidx = torch.cat([qidx, shape.key_dim + qidx, 2 * shape.key_dim + vidx])
    return {"qidx": qidx, "hidx": hidx, "vidx": vidx, "cidx": cidx}


def gated_delta_net_prefix_indices(shape: GDNShape, target: GDNShape | Mapping[str, int]) -> dict[str, torch.Tensor]:
    """Canonical indices that keep the nested prefix ``target`` of a layer of geometry ``shape``.

    The prefix keeps the first ``Hk'`` key groups, the first ``r'`` lanes of each, the first ``dk'`` key
    dims of each key head and the first ``dv'`` value dims. Returns ``qidx`` [Hk'*dk'], ``hidx`` [Hv'],
    ``vidx`` [Hv'*dv'] and ``cidx`` [2*Hk'*dk' + Hv'*dv'] (offsets from the full ``shape``).

    Raises:
        ValueError: ``target`` exceeds ``shape`` on some axis.
    """
    target = _as_target(shape, target)
    Hk, r = target.num_key_heads, target.value_heads_per_group
    return _canonical_indices(
        shape,
        torch.arange(Hk),
        torch.arange(r).expand(Hk, r),
        torch.arange(target.key_head_dim).expand(Hk, target.key_head_dim),
        torch.arange(target.value_head_dim),
    )


def _as_order(key: str, value: Any, expected: tuple[int, ...]) -> torch.Tensor:
    """Validate one order (list or tensor) of shape ``expected`` whose last axis rows are permutations."""
    try:
        t = torch.as_tensor(value)
    except (TypeError, ValueError, RuntimeError) as exc:
        raise ValueError(f"{key}: not a tensor of integers ({exc})") from None
    if t.dtype == torch.bool or t.is_complex():
        raise ValueError(f"{key}: expected integers, found dtype {t.dtype}")
    if t.is_floating_point():
        if not torch.equal(t, t.round()):
            raise ValueError(f"{key}: expected integers, found non-integral values")
    t = t.to(torch.long)
    if tuple(t.shape) != expected:
        raise ValueError(f"{key}: expected shape {list(expected)}, found {list(t.shape)}")
    n = expected[-1]
    bad = (t.sort(dim=-1).values != torch.arange(n, device=t.device)).any(dim=-1)
    if bad.any():
        where = "" if t.dim() == 1 else f" (row {int(bad.nonzero()[0, 0])})"
        raise ValueError(f"{key}: not a permutation of 0..{n - 1}{where}")
    return t


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
        return all(torch.equal(getattr(self, f.name).cpu(), getattr(other, f.name).cpu()) for f in fields(self))

    __hash__ = None  # mutable tensors inside

    @property
    def shape_signature(self) -> tuple[int, int, int, int]:
        """``(Hk, r, dk, dv)`` implied by the orders."""
        return (self.key_groups.numel(), self.value_lanes.shape[1], self.key_dim.shape[1], self.value_dim.numel())

    def _check_shape(self, shape: GDNShape) -> None:
        want = (shape.num_key_heads, shape.value_heads_per_group, shape.key_head_dim, shape.value_head_dim)
        if self.shape_signature != want:
            raise ValueError(
                f"permutation is for (Hk, r, dk, dv) = {self.shape_signature}, but the layer is {shape} "
                f"(Hk, r, dk, dv) = {want}"
            )

    @classmethod
    def identity(cls, shape: GDNShape) -> "GDNPermutation":
        """The permutation that changes nothing."""
        Hk, r, dk, dv = shape.num_key_heads, shape.value_heads_per_group, shape.key_head_dim, shape.value_head_dim
        return cls(torch.arange(Hk), torch.arange(r).repeat(Hk, 1), torch.arange(dk).repeat(Hk, 1), torch.arange(dv))

    @classmethod
    def random(cls, shape: GDNShape, *, generator: torch.Generator | None = None) -> "GDNPermutation":
        """Uniformly random orders on every axis (independent per group where the axis is per group)."""
        Hk, r, dk, dv = shape.num_key_heads, shape.value_heads_per_group, shape.key_head_dim, shape.value_head_dim
        return cls(
            torch.randperm(Hk, generator=generator),
            torch.rand(Hk, r, generator=generator).argsort(dim=-1),
            torch.rand(Hk, dk, generator=generator).argsort(dim=-1),
            torch.randperm(dv, generator=generator),
        )

    @classmethod
    def from_score_payload(cls, payload: Mapping[str, Any], shape: GDNShape) -> "GDNPermutation":
        """Build from a score payload (one layer of a scores file).

        Reads ``key_group_order_most_important_first`` [Hk], ``value_lane_order_most_important_first``
        [Hk, r], ``key_dim_order_most_important_first`` [Hk, dk] and ``value_dim_order_most_important_first``
        [dv] (lists or tensors); a missing key means identity order. Other keys are ignored.

        Raises:
            ValueError: a wrong shape or an order that is not a permutation, naming the key.
        """
        if not isinstance(payload, Mapping):
            raise ValueError(f"score payload must be a mapping, got {type(payload).__name__}")
        Hk, r, dk, dv = shape.num_key_heads, shape.value_heads_per_group, shape.key_head_dim, shape.value_head_dim
        identity = cls.identity(shape)
        expected = {"key_groups": (Hk,), "value_lanes": (Hk, r), "key_dim": (Hk, dk), "value_dim": (dv,)}
        orders = {}
        for field, key in _PAYLOAD_KEYS.items():
            value = payload.get(key)
            orders[field] = getattr(identity, field) if value is None else _as_order(key, value, expected[field])
        return cls(**orders)

    def to_score_payload(self) -> dict[str, list]:
        """The four ``*_order_most_important_first`` keys as JSON-ready lists."""
        return {key: getattr(self, field).tolist() for field, key in _PAYLOAD_KEYS.items()}

    def inverse(self) -> "GDNPermutation":
        """The permutation that undoes this one (applied to the permuted layer)."""
        G = self.key_groups
        return GDNPermutation(
            G.argsort(), self.value_lanes[G].argsort(dim=-1), self.key_dim[G].argsort(dim=-1), self.value_dim.argsort()
        )

    def indices(self, shape: GDNShape, *, target: GDNShape | Mapping[str, int] | None = None) -> dict[str, torch.Tensor]:
        """Canonical full-width gather indices (``qidx``, ``hidx``, ``vidx``, ``cidx``) of this permutation.

        With ``target``, the indices of permute-then-slice in one gather: the nested prefix ``target`` of
        the permuted layer, expressed in the original layer's canonical indices.
        """
        self._check_shape(shape)
        t = shape if target is None else _as_target(shape, target)
        G = self.key_groups[: t.num_key_heads]
        return _canonical_indices(
            shape,
            G,
            self.value_lanes[G, : t.value_heads_per_group],
            self.key_dim[G, : t.key_head_dim],
            self.value_dim[: t.value_head_dim],
        )


# --------------------------------------------------------------------------------------------------------
# State-dict surgery: one gather per coupled tensor, driven by the layout table.


def _value_dims(indices: Mapping[str, torch.Tensor], target: GDNShape, shape: GDNShape) -> torch.Tensor:
    """Value-dim order [dv'] shared by all heads (read off the first kept head of ``vidx``)."""
    return indices["vidx"][: target.value_head_dim] % shape.value_head_dim


def _check_indices(indices: Mapping[str, torch.Tensor], shape: GDNShape, target: GDNShape) -> dict[str, torch.Tensor]:
    expected = {
        "qidx": target.key_dim,
        "hidx": target.num_value_heads,
        "vidx": target.value_dim,
    }
    out = {}
    for key, n in expected.items():
        if key not in indices:
            raise ValueError(f"indices lack {key!r}; expected keys {list(INDEX_KEYS)}")
        idx = torch.as_tensor(indices[key]).to("cpu", torch.long).reshape(-1)
        if idx.numel() != n:
            raise ValueError(f"indices[{key!r}]: expected {n} entries for target {target}, found {idx.numel()}")
        out[key] = idx
    out["didx"] = _value_dims(out, target, shape)
    return out


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
        raise ValueError(f"{prefix or '<layer>'}: tensor {name!r} is not part of the {layout.name} GDN layout")
    _check_tensor(prefix, rule, tensor, shape)
    full = _check_indices(indices, shape, target)
    return _gather(rule, tensor, shape, target, full)


def _gather(rule: TensorRule, tensor: torch.Tensor, shape: GDNShape, target: GDNShape, full) -> torch.Tensor:
    index = rule.gather_index(shape, target, full).to(tensor.device)
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
    names = {k[len(head):]: k for k in state_dict if k.startswith(head)}
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
    full = _check_indices(indices, shape, target)
    for name, key in names.items():
        _check_tensor(prefix, chosen.rule(name), state_dict[key], shape)
    updated = {key: _gather(chosen.rule(name), state_dict[key], shape, target, full) for name, key in names.items()}
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
