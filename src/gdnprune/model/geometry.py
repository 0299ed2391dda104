"""Geometry and canonical indices of GatedDeltaNet (GDN) layers, in numpy (this module does not import torch).

Geometry of one GDN layer (:class:`GDNShape`): ``Hk`` key heads (= groups), ``Hv`` value heads,
``r = Hv // Hk`` value heads ("lanes") per group, ``dk`` q/k channels per key head and ``dv`` v/z
channels per value head. Value head ``h = g*r + j`` reads key head ``g = h // r`` (``repeat_interleave``).

The canonical index formulas — the single place they are written down (:func:`canonical_indices`):

* q channel ``(g, d)``        -> ``g*dk + d``; the k channel of the same pair is ``Hk*dk + g*dk + d``
* value head ``(g, j)``       -> ``h = g*r + j``
* v / z channel ``(h, e)``    -> ``h*dv + e``
* conv / fused q-k-v channels -> ``[q | k | v]``, i.e. ``cat(qidx, Hk*dk + qidx, 2*Hk*dk + vidx)``

A permutation (four *orders*, see :func:`orders_from_payload`) or a nested prefix target becomes one set
of canonical index arrays (``qidx``, ``hidx``, ``vidx``, ``cidx``): ``new[i] = old[idx[i]]``. Which
tensor takes which index is data, kept in :mod:`gdnprune.model.layouts`.

Everything here is integer bookkeeping on small arrays, so it runs in numpy: the streaming checkpoint
commands (:mod:`gdnprune.checkpoint`) use it without loading torch, and the torch API of
:mod:`gdnprune.gated_delta_net` wraps the same functions.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass, fields
from typing import Any

import numpy as np

from .model_config import config_value, global_config_value, per_layer_overrides, text_config

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


_FIELD_OF = {key: name for name, key in _CONFIG_KEYS.items()}
_GDN_CONFIG_KEYS = frozenset(_FIELD_OF)


def _holder(config: Any) -> Any:
    """The part of a config that holds the GDN geometry: the config, or its ``text_config``."""
    return text_config(config, "linear_num_key_heads")


#: the config keys of the GDN geometry (``linear_*``)
GDN_CONFIG_KEYS = _GDN_CONFIG_KEYS


def per_layer_gdn_overrides(config: Any) -> dict[int, dict[str, int]]:
    """``{layer_index: {linear_* key: value}}``: the GDN geometry a heterogeneous config sets per layer.

    Reads transformers' ``per_layer_config`` (zero-padded string keys in JSON) from a dict config, or the
    heterogeneity spec of a config object; empty for a uniform config.

    Raises:
        ValueError: a ``per_layer_config`` that is not ``{layer index: {attribute: value}}``.
    """
    return per_layer_overrides(config, _GDN_CONFIG_KEYS, key="linear_num_key_heads")


def layer_index_of(prefix: str) -> int:
    """The decoder layer index in a GDN layer prefix (``model.layers.3.linear_attn`` -> 3)."""
    match = re.search(r"(?:^|\.)layers\.(\d+)(?:\.|$)", prefix)
    if match is None:
        raise ValueError(f"cannot tell the layer index of {prefix!r} (expected '...layers.N....')")
    return int(match.group(1))


def apply_targets_to_config(config: Mapping, targets: Mapping[int, GDNShape]) -> dict:
    """A copy of the dict ``config`` with the GDN geometry of each layer in ``targets`` (layer index -> shape).

    One geometry for all: the plain ``linear_*`` keys (:meth:`GDNShape.apply_to_config`), which every
    engine reads. Several: transformers' per-layer convention — the ``linear_*`` keys hold the most common
    geometry (ties: the lowest layer's), and ``per_layer_config`` (``{"NN": {linear_*: value}}``, zero-padded
    keys as transformers writes them) overrides the fields that differ, layer by layer; other per-layer
    overrides are kept. Such a config does not build with plain transformers (reading a per-layer attribute
    globally raises), which is the point: load it with :func:`gdnprune.load_pretrained`.
    """
    distinct = list(dict.fromkeys(targets[i] for i in sorted(targets)))
    counts = {shape: sum(1 for t in targets.values() if t == shape) for shape in distinct}
    common = max(distinct, key=lambda shape: counts[shape])  # max keeps the first of equal counts
    out: dict = common.apply_to_config(dict(config))
    if len(distinct) == 1:
        return out
    holder = _holder(out)
    overrides = {int(k): dict(v) for k, v in holder.get("per_layer_config", {}).items()}
    for index, target in targets.items():
        differ = {
            key: value
            for key, value in target.config_updates().items()
            if value != common.config_updates()[key]
        }
        if differ:
            overrides.setdefault(index, {}).update(differ)
    width = len(str(max(overrides)))
    holder["per_layer_config"] = {str(i).zfill(width): overrides[i] for i in sorted(overrides)}
    return out


def as_int(value: Any) -> int | None:
    """``value`` as a Python int when it is an integer: an int, a numpy integer, or a 0-d integer array or
    torch tensor (torch is not imported here); None for bools, floats (even 2.0) and anything else."""
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, np.integer)):
        return int(value)
    dtype, shape = getattr(value, "dtype", None), getattr(value, "shape", None)
    if dtype is None or shape is None or tuple(shape) != ():
        return None
    if isinstance(dtype, np.dtype):
        return int(value) if dtype.kind in "iu" else None
    is_floating, is_complex = getattr(dtype, "is_floating_point", True), getattr(dtype, "is_complex", True)
    if is_floating or is_complex or str(dtype) == "torch.bool":  # a torch dtype
        return None
    return int(value.item())


@dataclass(frozen=True)
class GDNShape:
    """Width geometry of one GatedDeltaNet layer.

    Attributes:
        num_key_heads: ``Hk``, key heads = groups.
        num_value_heads: ``Hv``, value heads; a multiple of ``Hk``.
        key_head_dim: ``dk``, q/k channels per key head.
        value_head_dim: ``dv``, v/z channels per value head.

    Integral numpy scalars and 0-d integer torch tensors are accepted and stored as ``int``; bools, floats
    (even ``2.0``) and anything else are refused.

    Raises:
        ValueError: a field is not a positive integer, or ``Hv % Hk != 0``.
    """

    num_key_heads: int
    num_value_heads: int
    key_head_dim: int
    value_head_dim: int

    def __post_init__(self) -> None:
        for f in fields(self):
            value = as_int(getattr(self, f.name))
            if value is None or value <= 0:
                raise ValueError(
                    f"GDNShape.{f.name} must be a positive integer, got {getattr(self, f.name)!r}"
                )
            object.__setattr__(self, f.name, value)
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

    def replace(self, **changes: int) -> GDNShape:
        """A copy with some fields changed (validated like the constructor)."""
        return GDNShape(**{**self.as_dict(), **changes})

    def as_dict(self) -> dict[str, int]:
        """The four fields as a plain dict."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def config_updates(self) -> dict[str, int]:
        """The transformers config keys (``linear_*``) that describe this geometry."""
        return {_CONFIG_KEYS[name]: value for name, value in self.as_dict().items()}

    def apply_to_config(self, config: Any) -> Any:
        """A deep copy of ``config`` (object or dict) whose GDN geometry is this shape, for every layer.

        The ``linear_*`` keys are set where :meth:`from_config` reads them: on the config itself, or on
        its ``text_config`` (vision-language models); per-layer GDN overrides of a dict config's
        ``per_layer_config`` are removed (the result is uniform).
        """
        config = copy.deepcopy(config)
        holder = _holder(config)
        for key, value in self.config_updates().items():
            if isinstance(holder, MutableMapping):
                holder[key] = value
            else:
                setattr(holder, key, value)
        if isinstance(holder, MutableMapping) and isinstance(holder.get("per_layer_config"), Mapping):
            kept = {
                k: {a: v for a, v in o.items() if a not in _GDN_CONFIG_KEYS}
                for k, o in holder["per_layer_config"].items()
                if isinstance(o, Mapping)
            }
            holder["per_layer_config"] = {k: o for k, o in kept.items() if o}
            if not holder["per_layer_config"]:
                del holder["per_layer_config"]
        return config

    @classmethod
    def from_config(cls, config: Any, *, layer_index: int | None = None) -> GDNShape:
        """Geometry from a transformers config (object or dict) with ``linear_*`` keys, or its ``text_config``.

        A heterogeneous config (transformers' ``per_layer_config`` overriding ``linear_*`` keys for some
        layers) needs ``layer_index``: the geometry of that decoder layer.
        """
        source = _holder(config)
        values = {name: global_config_value(source, key) for name, key in _CONFIG_KEYS.items()}
        overrides = per_layer_gdn_overrides(config)
        if overrides and layer_index is None:
            raise ValueError(
                f"config has a heterogeneous GDN geometry (per_layer_config sets linear_* for layers "
                f"{sorted(overrides)}); give the layer_index of the layer"
            )
        for key, value in (overrides.get(layer_index, {}) if layer_index is not None else {}).items():
            values[_FIELD_OF[key]] = value
        missing = [_CONFIG_KEYS[name] for name, value in values.items() if value is None]
        if missing:
            raise ValueError(f"config has no GDN geometry: missing {missing} (also looked in text_config)")
        return cls(**values)

    @classmethod
    def from_module(cls, module: Any) -> GDNShape:
        """Geometry of a transformers GDN module (``num_k_heads``, ``num_v_heads``, ``head_k_dim``, ``head_v_dim``)."""
        try:
            return cls(module.num_k_heads, module.num_v_heads, module.head_k_dim, module.head_v_dim)
        except AttributeError as exc:
            raise ValueError(f"{type(module).__name__} is not a GDN module: {exc}") from None

    @classmethod
    def from_mamba_config(cls, config: Any) -> GDNShape:
        """Geometry from a Mamba-style config: ``num_groups`` (Hk), ``num_heads`` (Hv), ``state_dim`` (dk), ``head_dim`` (dv)."""
        names = {
            "num_groups": ("num_groups", "n_groups"),
            "num_heads": ("num_heads",),
            "state_dim": ("state_dim", "ssm_state_size", "d_state"),
            "head_dim": ("head_dim",),
        }
        values: dict[str, Any] = {}
        for field, candidates in names.items():
            values[field] = next((v for c in candidates if (v := config_value(config, c)) is not None), None)
            if values[field] is None:
                raise ValueError(f"Mamba-style config has no {field!r} (looked for {list(candidates)})")
        return cls(values["num_groups"], values["num_heads"], values["state_dim"], values["head_dim"])


def as_target(shape: GDNShape, target: GDNShape | Mapping[str, int]) -> GDNShape:
    """Resolve a target (a GDNShape, or a mapping of some GDNShape fields) and check it fits in ``shape``."""
    if isinstance(target, Mapping):
        unknown = set(target) - set(shape.as_dict())
        if unknown:
            raise ValueError(
                f"unknown target fields {sorted(unknown)}; expected some of {list(shape.as_dict())}"
            )
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


#: The score payload keys of the four orders of a permutation.
ORDER_KEYS = tuple(_PAYLOAD_KEYS.values())


def as_order(key: str, value: Any, expected: tuple[int, ...]) -> np.ndarray:
    """Validate one order (nested lists or an array) of shape ``expected`` whose last-axis rows are permutations.

    Returns an int64 array. Raises ``ValueError`` naming ``key`` otherwise.
    """
    try:
        a = _to_numpy(value)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{key}: not a tensor of integers ({exc})") from None
    if a.dtype.kind not in "iufbc":
        raise ValueError(f"{key}: not a tensor of integers (found {a.dtype})")
    if a.dtype.kind in "bc":
        raise ValueError(f"{key}: expected integers, found dtype {a.dtype}")
    if a.dtype.kind == "f":
        if not np.array_equal(a, np.round(a)):
            raise ValueError(f"{key}: expected integers, found non-integral values")
    a = a.astype(np.int64)
    if tuple(a.shape) != tuple(expected):
        raise ValueError(f"{key}: expected shape {list(expected)}, found {list(a.shape)}")
    n = expected[-1]
    bad = (np.sort(a, axis=-1) != np.arange(n)).any(axis=-1)
    if bad.any():
        where = "" if a.ndim == 1 else f" (row {int(np.flatnonzero(bad)[0])})"
        raise ValueError(f"{key}: not a permutation of 0..{n - 1}{where}")
    return a


def order_shapes(shape: GDNShape) -> dict[str, tuple[int, ...]]:
    """Expected shape of each order for a layer of geometry ``shape``."""
    Hk, r, dk, dv = shape.num_key_heads, shape.value_heads_per_group, shape.key_head_dim, shape.value_head_dim
    return {"key_groups": (Hk,), "value_lanes": (Hk, r), "key_dim": (Hk, dk), "value_dim": (dv,)}


def identity_orders(shape: GDNShape) -> dict[str, np.ndarray]:
    """The four orders of the permutation that changes nothing."""
    return {name: np.broadcast_to(np.arange(s[-1]), s).copy() for name, s in order_shapes(shape).items()}


def orders_from_payload(payload: Mapping[str, Any], shape: GDNShape) -> dict[str, np.ndarray]:
    """Validated orders from a score payload (one layer of a scores file); a missing key means identity."""
    if not isinstance(payload, Mapping):
        raise ValueError(f"score payload must be a mapping, got {type(payload).__name__}")
    identity = identity_orders(shape)
    expected = order_shapes(shape)
    orders = {}
    for name, key in _PAYLOAD_KEYS.items():
        value = payload.get(key)
        orders[name] = identity[name] if value is None else as_order(key, value, expected[name])
    return orders


def orders_to_payload(orders: Mapping[str, Any]) -> dict[str, list]:
    """The four ``*_order_most_important_first`` keys as JSON-ready lists."""
    return {key: np.asarray(orders[name]).tolist() for name, key in _PAYLOAD_KEYS.items()}


def canonical_indices(
    shape: GDNShape, groups: np.ndarray, lanes: np.ndarray, key_dims: np.ndarray, value_dims: np.ndarray
) -> dict[str, np.ndarray]:
    """Canonical gather indices, ``new[i] = old[idx[i]]``, from per-new-position choices.

    ``groups`` [Hk']: old key group at each new group position; ``lanes`` [Hk', r']: old lane of each new
    lane; ``key_dims`` [Hk', dk']: old q/k channel of each new one; ``value_dims`` [dv']: old value dim.
    """
    r, dk, dv = shape.value_heads_per_group, shape.key_head_dim, shape.value_head_dim
    hidx = (groups[:, None] * r + lanes).reshape(-1)
    qidx = (groups[:, None] * dk + key_dims).reshape(-1)
    vidx = (hidx[:, None] * dv + value_dims[None, :]).reshape(-1)
    cidx = np.concatenate([qidx, shape.key_dim + qidx, 2 * shape.key_dim + vidx])
    return {"qidx": qidx, "hidx": hidx, "vidx": vidx, "cidx": cidx}


def prefix_indices(shape: GDNShape, target: GDNShape | Mapping[str, int]) -> dict[str, np.ndarray]:
    """Canonical indices that keep the nested prefix ``target`` (see ``gated_delta_net_prefix_indices``)."""
    target = as_target(shape, target)
    Hk, r, dk = target.num_key_heads, target.value_heads_per_group, target.key_head_dim
    return canonical_indices(
        shape,
        np.arange(Hk),
        np.broadcast_to(np.arange(r), (Hk, r)),
        np.broadcast_to(np.arange(dk), (Hk, dk)),
        np.arange(target.value_head_dim),
    )


def order_indices(
    orders: Mapping[str, np.ndarray], shape: GDNShape, target: GDNShape | Mapping[str, int] | None = None
) -> dict[str, np.ndarray]:
    """Canonical indices of the permutation ``orders`` (validated, for ``shape``), cut to ``target`` if given."""
    t = shape if target is None else as_target(shape, target)
    G = orders["key_groups"][: t.num_key_heads]
    return canonical_indices(
        shape,
        G,
        orders["value_lanes"][G, : t.value_heads_per_group],
        orders["key_dim"][G, : t.key_head_dim],
        orders["value_dim"][: t.value_head_dim],
    )


def check_indices(indices: Mapping[str, Any], shape: GDNShape, target: GDNShape) -> dict[str, np.ndarray]:
    """``qidx``, ``hidx``, ``vidx`` of ``indices`` as flat int64 arrays (sizes checked) plus ``didx`` [dv'].

    ``indices`` may hold numpy arrays, lists or torch tensors (any device).
    """
    expected = {"qidx": target.key_dim, "hidx": target.num_value_heads, "vidx": target.value_dim}
    out = {}
    for key, n in expected.items():
        if key not in indices:
            raise ValueError(f"indices lack {key!r}; expected keys {list(INDEX_KEYS)}")
        idx = _to_numpy(indices[key]).astype(np.int64, copy=False).reshape(-1)
        if idx.size != n:
            raise ValueError(f"indices[{key!r}]: expected {n} entries for target {target}, found {idx.size}")
        out[key] = idx
    # the value-dim order [dv'] shared by all heads, read off the first kept head of vidx
    out["didx"] = out["vidx"][: target.value_head_dim] % shape.value_head_dim
    return out


def _to_numpy(value: Any) -> np.ndarray:
    """An array from a list, a numpy array or a torch tensor (moved to the CPU; torch is not imported here)."""
    if hasattr(value, "detach") and hasattr(value, "cpu"):
        value = value.detach().cpu().numpy()
    return np.asarray(value)
