"""The hidden size (the width of the residual stream) in a model, as data. Numpy only.

One axis couples the whole model: the residual stream's ``hidden_size`` channels. The embeddings and the LM
head, every RMS norm on the stream, every projection that reads it (GDN ``in_proj_*``, attention q/k/v,
MLP and expert gate/up, the router, the shared-expert gate, the MTP head's ``fc``) and every projection
that writes it (GDN ``out_proj``, attention ``o_proj``, MLP and expert down, a vision-language merger's
output) carry it on one axis each. Which is the table :data:`gdnprune.model.layouts.HIDDEN_RULES`; here it
is placed in a model: the tensors it names among a checkpoint's or a state dict's (:func:`find_hidden`,
every other tensor checked against :data:`~gdnprune.model.layouts.HIDDEN_FREE`), their gathers (one per axis
on the stream, FP8 scales by their tiles), the order payload of the scores file and the config of a cut.

The geometry is :class:`~gdnprune.model.subblock_shapes.HiddenShape`; a sort moves every coupled tensor's
channels with one order (the function is unchanged), a cut keeps the first ``K`` (:func:`hidden_indices`).

Some families store their RMS norms zero-centred (the weight is ``w - 1``, the norm multiplies by ``1 + w``:
Qwen3.5, Qwen3.5-MoE, Qwen3-Next, Qwen4-exp in transformers 5.23); OLMo-hybrid's multiply by ``w``.
:func:`norm_offset` says which (a norm's rescaling, :func:`rescaled_norm`, needs it).
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .geometry import as_order
from .layouts import TensorRule, hidden_free, hidden_rules, scale_rule, scaled_weight
from .model_config import global_config_value, text_config
from .subblock_shapes import HiddenShape

__all__ = [
    "HIDDEN_FIELDS",
    "HIDDEN_KEY",
    "HiddenTensors",
    "HiddenCut",
    "hidden_cut",
    "hidden_shape",
    "find_hidden",
    "hidden_indices",
    "resolve_hidden_target",
    "orders_from_payload",
    "orders_to_payload",
    "apply_hidden_to_config",
    "norm_offset",
    "is_residual_norm",
    "rescaled_norm",
    "norm_factors",
]

#: the target field of the hidden size (``slice --hidden-size``, a plan's ``default``, the config key)
HIDDEN_FIELDS = ("hidden_size",)
#: the key of the hidden channels' order: a scores file's top-level entry, an entry of ``permutations``
HIDDEN_KEY = "hidden"
#: the payload key of the order (as for the MLP channels)
ORDER_KEY = "channel_order_most_important_first"

#: model types whose RMS norms on the residual stream are zero-centred (output * (1 + weight)), checked in
#: transformers 5.23's modeling files
_ZERO_CENTRED = ("qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text", "qwen3_next", "qwen4_exp")


def hidden_shape(config: Any) -> HiddenShape:
    """The hidden size of a config (dict or object; the text part of a multimodal one)."""
    holder = text_config(config, "hidden_size")
    value = global_config_value(holder, "hidden_size")
    if value is None:
        raise ValueError("config has no hidden_size (also looked in text_config)")
    return HiddenShape(int(value), int(global_config_value(holder, "hc_count") or 1))


@dataclass
class HiddenTensors:
    """The tensors of a model that touch the residual stream: full name -> the rules of its axes on it
    (FP8 scales included, one entry per tile)."""

    shape: HiddenShape
    rules: dict[str, tuple[TensorRule, ...]] = field(default_factory=dict)

    def gathers(
        self, name: str, target: HiddenShape, indices: Mapping[str, np.ndarray]
    ) -> list[tuple[int, np.ndarray]]:
        """``(axis, source index)`` of every axis of tensor ``name`` on the stream, for a gather to ``target``
        with the canonical ``indices`` (:func:`hidden_indices`); tile indices for FP8 scales (a gather that
        would split a tile raises :class:`~gdnprune.model.layouts.TileGridError`)."""
        return [(r.axis, r.gather_index(self.shape, target, indices)) for r in self.rules.get(name, ())]

    def parameters(self, shapes: Mapping[str, tuple[int, ...]], target: HiddenShape) -> int:
        """Elements of the coupled tensors ``shapes`` after a cut to ``target`` (their other axes as given)."""
        total = 0
        for name, dims in shapes.items():
            sizes = list(dims)
            for rule in self.rules.get(name, ()):
                sizes[rule.axis] = rule.length(target)
            total += int(np.prod(sizes))
        return total


@dataclass
class HiddenCut:
    """A sort and/or cut of the hidden channels: the coupled tensors, the target, the canonical indices (and
    the order they came from, None for a cut of the unsorted channels)."""

    residual: HiddenTensors
    target: HiddenShape
    indices: dict[str, np.ndarray]
    orders: dict[str, np.ndarray] | None = None

    @property
    def cut(self) -> bool:
        return self.target != self.residual.shape

    def gathers(self, name: str) -> list[tuple[int, np.ndarray]]:
        """``(axis, source index)`` of every axis of tensor ``name`` on the stream (none for other tensors)."""
        return self.residual.gathers(name, self.target, self.indices)


def hidden_cut(
    residual: HiddenTensors, target: Any = None, orders: Mapping[str, np.ndarray] | None = None
) -> HiddenCut:
    """The :class:`HiddenCut` of ``residual`` to ``target`` (see :func:`resolve_hidden_target`) after ``orders``."""
    t = resolve_hidden_target(residual.shape, target)
    return HiddenCut(
        residual, t, hidden_indices(residual.shape, t, orders), None if orders is None else dict(orders)
    )


def find_hidden(
    shapes: Mapping[str, tuple[int, ...]], config: Any, *, tile_size: tuple[int, int] | None = None
) -> HiddenTensors:
    """Every tensor of ``shapes`` (full name -> shape) on the residual stream, checked against the config's
    hidden size; FP8 scales (``*_scale_inv`` beside their weight, ``tile_size``: the config's
    ``weight_block_size``) follow their weight.

    Raises:
        ValueError: a coupled tensor of the wrong shape, or tensors that neither the hidden-size table nor
            the list of tensors known not to touch the stream names (a family whose residual stream this
            table does not describe: its hidden size cannot be cut safely).
    """
    shape = hidden_shape(config)
    out = HiddenTensors(shape)
    unknown, wrong = [], []
    for name, dims in shapes.items():
        scaled = scaled_weight(name)
        if scaled is not None and scaled in shapes:
            weight_rules = hidden_rules(scaled)
            if weight_rules and tile_size is None:
                raise ValueError(
                    f"{name}: a scale tensor beside {scaled}, but the config has no FP8 tile size"
                )
            rules = tuple(scale_rule(r, name, tile_size) for r in weight_rules) if tile_size else ()
            if not rules and not hidden_free(scaled):
                unknown.append(name)
        else:
            rules = hidden_rules(name)
            if not rules and not hidden_free(name):
                unknown.append(name)
        for rule in rules:
            if len(dims) != rule.ndim or dims[rule.axis] != rule.length(shape):
                wrong.append(f"{name} has shape {list(dims)}, expected {rule.expected_shape(shape)}")
        if rules:
            out.rules[name] = rules
    if wrong:
        raise ValueError(
            f"tensors on the residual stream do not fit hidden_size {shape.hidden_size}: {'; '.join(wrong[:4])}"
        )
    if unknown:
        raise ValueError(
            f"the hidden size cannot be cut: {len(unknown)} tensor(s) such as {unknown[:4]} are not in the "
            f"hidden-size table (gdnprune.model.layouts.HIDDEN_RULES / HIDDEN_FREE), so whether they read or "
            f"write the residual stream is not known"
        )
    return out


def resolve_hidden_target(shape: HiddenShape, target: Any) -> HiddenShape:
    """The hidden geometry a cut keeps: ``target`` (a :class:`HiddenShape`, a mapping with ``hidden_size``,
    an int or None for no cut), checked against ``shape``. Raises ``ValueError``."""
    if target is None:
        return shape
    if isinstance(target, Mapping):
        target = target.get("hidden_size")
        if target is None:
            return shape
    t = target if isinstance(target, HiddenShape) else shape.replace(hidden_size=target)
    problems = shape.fits(t)
    if problems:
        raise ValueError(f"illegal hidden size: {'; '.join(problems)}")
    return t


def hidden_indices(
    shape: HiddenShape, target: HiddenShape, orders: Mapping[str, np.ndarray] | None = None
) -> dict[str, np.ndarray]:
    """Canonical indices of the sorted (``orders``) nested prefix ``target`` of the hidden channels."""
    return shape.indices(orders, target)


def orders_from_payload(payload: Mapping[str, Any], shape: HiddenShape) -> dict[str, np.ndarray]:
    """The hidden channels' order from a scores payload (``channel_order_most_important_first`` [H]; missing:
    identity). Raises ``ValueError`` naming the key."""
    if not isinstance(payload, Mapping):
        raise ValueError(f"the hidden order must be a mapping, got {type(payload).__name__}")
    value = payload.get(ORDER_KEY)
    if value is None:
        return {"channels": np.arange(shape.hidden_size)}
    return {"channels": as_order(ORDER_KEY, value, (shape.hidden_size,))}


def orders_to_payload(orders: Mapping[str, Any]) -> dict[str, list]:
    """The payload key of the hidden channels' order, as a JSON-ready list."""
    return {ORDER_KEY: np.asarray(orders["channels"]).tolist()}


def apply_hidden_to_config(config: Mapping, target: HiddenShape) -> dict:
    """A copy of the dict ``config`` with hidden size ``target``: the text config's ``hidden_size``, the
    attention ``head_dim`` written out where it followed ``hidden_size // num_attention_heads``, and a
    vision-language model's merger output (``vision_config.out_hidden_size``)."""
    out: dict = copy.deepcopy(dict(config))
    holder = text_config(out, "hidden_size")
    old = holder.get("hidden_size")
    heads = holder.get("num_attention_heads")
    if holder.get("head_dim") is None and old and heads:
        holder["head_dim"] = int(old) // int(heads)
    holder["hidden_size"] = target.hidden_size
    vision = out.get("vision_config")
    if isinstance(vision, dict) and "out_hidden_size" in vision:
        vision["out_hidden_size"] = target.hidden_size
    return out


def norm_offset(config: Any) -> float:
    """1.0 where the model's RMS norms are zero-centred (their weight is ``w - 1``: Qwen3.5, Qwen3.5-MoE,
    Qwen3-Next, Qwen4-exp), 0.0 where the weight multiplies as it is (OLMo-hybrid)."""
    kinds = {str(global_config_value(config, "model_type") or "")}
    sub = global_config_value(config, "text_config")
    if sub is not None:
        kinds.add(str(global_config_value(sub, "model_type") or ""))
    return 1.0 if kinds & set(_ZERO_CENTRED) else 0.0


def is_residual_norm(name: str) -> bool:
    """Whether tensor ``name`` is the weight of an RMS norm over the residual stream (a 1-D entry of the
    hidden-size table over one copy of the hidden channels that is not a writer's bias)."""
    return name.endswith("norm.weight") and any(
        r.ndim == 1 and r.segments == ("hidden",) for r in hidden_rules(name)
    )


def rescaled_norm(weight: np.ndarray, factor: float, offset: float) -> np.ndarray:
    """A norm weight whose effective scale ``offset + weight`` is multiplied by ``factor``."""
    return (offset + np.asarray(weight, dtype=np.float64)) * factor - offset


def norm_factors(payload: Mapping[str, Any], size: int) -> dict[str, float]:
    """The rescaled-norms correction of a cut to ``size`` hidden channels (the first ``size`` of the payload's
    order): per RMS norm on the stream (its weight's name), ``sqrt(mean_kept E[x_i^2] / mean_all E[x_i^2])`` from
    the mean squared input of every channel the scores recorded (``norm_input_sq``). A cut norm divides by the
    RMS over the kept channels, not over all of them; multiplying its scale by the expected ratio of the two
    gives the kept channels the scale they had (``docs/scoring.md``)."""
    energies = payload.get("norm_input_sq")
    if not isinstance(energies, Mapping) or not energies:
        raise ValueError("the scores' hidden entry has no norm_input_sq (score the hidden channels again)")
    kept = np.asarray(payload[ORDER_KEY][:size], dtype=np.int64)
    out = {}
    for norm, values in energies.items():
        e = np.asarray(values, dtype=np.float64)
        out[f"{norm}.weight"] = float(np.sqrt(e[kept].mean() / max(e.mean(), 1e-30)))
    return out
