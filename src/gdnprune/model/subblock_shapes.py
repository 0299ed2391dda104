"""The geometries of the dense sub-blocks beside GDN and their canonical indices: MLP channels, attention
heads, routed experts.

Numpy only. Each geometry is a frozen dataclass of positive ints that says how big each of its segments
is, which orders it takes, whether a target fits in it, and which canonical indices keep a sorted nested
prefix (``new[i] = old[idx[i]]`` along a segment of that kind):

* :class:`MLPShape` (``I`` intermediate channels): ``"i"`` channel ``c`` -> ``c``.
* :class:`AttentionShape` (``nq`` query heads, ``nkv`` key-value heads, ``hd`` head dim, ``r = nq/nkv``
  query heads per key-value head; query head ``h = g*r + j`` reads key-value head ``g``, as
  ``repeat_kv`` does): ``"kv"`` k/v channel ``(g, e)`` -> ``g*hd + e``; ``"qo"`` query / ``o_proj`` input
  channel ``(h, e)`` -> ``h*hd + e``; ``"qg"`` row of Qwen's gated ``q_proj``, which stores per head its
  ``hd`` query rows then its ``hd`` output-gate rows (transformers ``view(..., heads, 2*hd)`` then
  ``chunk(2)``): ``(h, e)`` -> ``h*2hd + e``, ``e < 2*hd``. The head dim never changes (RoPE).
* :class:`ExpertShape` (``N`` routed experts): ``"e"`` expert ``n`` -> ``n``.

Orders, most important first (a nested prefix keeps the most important part): MLP ``channels`` [I];
attention ``kv_groups`` [nkv] and ``query_heads`` [nkv, r] (row ``g``: the query-head order inside OLD
key-value group ``g``, like GDN's value lanes); ``experts`` [N]. Moving whole key-value groups with their
query heads, and query heads inside their group, preserves the function; so does any channel order of an
MLP and any expert order (the router rows move with the experts).

Where the sub-blocks live in a model, their kinds and their plan candidates are
:mod:`gdnprune.model.subblock_geometry`'s.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import Field, dataclass, fields
from typing import Any, cast

import numpy as np

from .geometry import as_int

__all__ = ["MLPShape", "AttentionShape", "ExpertShape", "HiddenShape", "identity_orders"]


def identity_orders(shape: Any) -> dict[str, np.ndarray]:
    """The orders of the permutation that changes nothing."""
    return {name: np.broadcast_to(np.arange(s[-1]), s).copy() for name, s in shape.order_shapes().items()}


def _heads(index: np.ndarray, width: int) -> np.ndarray:
    """Rows of whole heads: ``index[:, None] * width + arange(width)``, flattened."""
    return (np.asarray(index, dtype=np.int64)[:, None] * width + np.arange(width)).reshape(-1)


class _Shape:
    """What every sub-block geometry offers (fields are positive ints, checked in ``__post_init__``)."""

    def _fields(self) -> tuple[Field, ...]:
        return fields(cast(Any, self))  # every subclass is a dataclass

    def _check(self) -> None:
        for f in self._fields():
            value = as_int(getattr(self, f.name))
            if value is None or value <= 0:
                raise ValueError(
                    f"{type(self).__name__}.{f.name} must be a positive integer, got "
                    f"{getattr(self, f.name)!r}"
                )
            object.__setattr__(self, f.name, value)

    def as_dict(self) -> dict[str, int]:
        return {f.name: getattr(self, f.name) for f in self._fields()}

    def replace(self, **changes: int):
        return type(self)(**{**self.as_dict(), **changes})


@dataclass(frozen=True)
class MLPShape(_Shape):
    """Width of a gated MLP (``gate_proj``/``up_proj`` rows, ``down_proj`` columns)."""

    intermediate_size: int

    def __post_init__(self) -> None:
        self._check()

    def segment_size(self, kind: str) -> int:
        return {"i": self.intermediate_size}[kind]

    def order_shapes(self) -> dict[str, tuple[int, ...]]:
        return {"channels": (self.intermediate_size,)}

    def fits(self, target: MLPShape) -> list[str]:
        """What of ``target`` does not fit in this geometry (empty when it fits)."""
        if target.intermediate_size > self.intermediate_size:
            return [f"intermediate_size {target.intermediate_size} > {self.intermediate_size}"]
        return []

    def indices(self, orders: Mapping[str, np.ndarray] | None, target: MLPShape) -> dict[str, np.ndarray]:
        channels = np.arange(self.intermediate_size) if orders is None else orders["channels"]
        return {"i": np.asarray(channels[: target.intermediate_size], dtype=np.int64)}


@dataclass(frozen=True)
class AttentionShape(_Shape):
    """Heads of a (GQA) attention: ``num_attention_heads`` query heads in ``num_key_value_heads`` groups."""

    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int

    def __post_init__(self) -> None:
        self._check()
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"AttentionShape: num_attention_heads ({self.num_attention_heads}) must be a multiple "
                f"of num_key_value_heads ({self.num_key_value_heads})"
            )

    @property
    def heads_per_group(self) -> int:
        """``r = nq // nkv``: query heads that share one key-value head."""
        return self.num_attention_heads // self.num_key_value_heads

    def segment_size(self, kind: str) -> int:
        nq, nkv, hd = self.num_attention_heads, self.num_key_value_heads, self.head_dim
        return {"kv": nkv * hd, "qo": nq * hd, "qg": 2 * nq * hd}[kind]

    def order_shapes(self) -> dict[str, tuple[int, ...]]:
        return {
            "kv_groups": (self.num_key_value_heads,),
            "query_heads": (self.num_key_value_heads, self.heads_per_group),
        }

    def fits(self, target: AttentionShape) -> list[str]:
        problems = []
        if target.head_dim != self.head_dim:
            problems.append(f"head_dim {target.head_dim} != {self.head_dim} (the head dim is never cut)")
        if target.num_key_value_heads > self.num_key_value_heads:
            problems.append(f"num_key_value_heads {target.num_key_value_heads} > {self.num_key_value_heads}")
        if target.heads_per_group > self.heads_per_group:
            problems.append(
                f"num_attention_heads {target.num_attention_heads} / num_key_value_heads "
                f"{target.num_key_value_heads} = {target.heads_per_group} query heads per key-value head > "
                f"{self.heads_per_group} (give num_attention_heads <= "
                f"{target.num_key_value_heads * self.heads_per_group}, a multiple of {target.num_key_value_heads})"
            )
        return problems

    def indices(
        self, orders: Mapping[str, np.ndarray] | None, target: AttentionShape
    ) -> dict[str, np.ndarray]:
        r, hd = self.heads_per_group, self.head_dim
        if orders is None:
            orders = identity_orders(self)
        groups = np.asarray(orders["kv_groups"][: target.num_key_value_heads], dtype=np.int64)
        lanes = np.asarray(orders["query_heads"], dtype=np.int64)[groups, : target.heads_per_group]
        heads = (groups[:, None] * r + lanes).reshape(-1)
        return {"kv": _heads(groups, hd), "qo": _heads(heads, hd), "qg": _heads(heads, 2 * hd)}


@dataclass(frozen=True)
class ExpertShape(_Shape):
    """Routed experts of an MoE layer: ``num_experts`` experts, ``num_experts_per_tok`` of them per token.

    Segment ``"e"``: expert ``n`` -> ``n`` (router rows, the first axis of fused expert tensors, the ``N`` of
    per-expert tensor names). ``num_experts_per_tok`` is never cut and never above the experts kept.
    """

    num_experts: int
    num_experts_per_tok: int

    def __post_init__(self) -> None:
        self._check()

    def segment_size(self, kind: str) -> int:
        return {"e": self.num_experts}[kind]

    def order_shapes(self) -> dict[str, tuple[int, ...]]:
        return {"experts": (self.num_experts,)}

    def fits(self, target: ExpertShape) -> list[str]:
        problems = []
        if target.num_experts_per_tok != self.num_experts_per_tok:
            problems.append(
                f"num_experts_per_tok {target.num_experts_per_tok} != {self.num_experts_per_tok} "
                f"(the experts per token are never changed)"
            )
        if target.num_experts > self.num_experts:
            problems.append(f"num_experts {target.num_experts} > {self.num_experts}")
        if target.num_experts < self.num_experts_per_tok:
            problems.append(
                f"num_experts {target.num_experts} < num_experts_per_tok {self.num_experts_per_tok} "
                f"(keep at least as many experts as each token is routed to)"
            )
        return problems

    def indices(self, orders: Mapping[str, np.ndarray] | None, target: ExpertShape) -> dict[str, np.ndarray]:
        experts = np.arange(self.num_experts) if orders is None else orders["experts"]
        return {"e": np.asarray(experts[: target.num_experts], dtype=np.int64)}


@dataclass(frozen=True)
class HiddenShape(_Shape):
    """The residual stream's width: ``hidden_size`` channels, one axis for the whole model.

    Segment ``"hidden"``: hidden channel ``c`` -> ``c`` (the columns of every tensor that reads the stream,
    the rows of every tensor that writes it, every norm on it; the table is
    :data:`gdnprune.model.layouts.HIDDEN_RULES`); segment ``"hc"``: the ``hyper_connections`` streams of a
    model with hyper-connections (Qwen4-exp's ``hc_count``) side by side, channel ``c`` of stream ``s`` ->
    ``s * hidden_size + c`` (every stream keeps the same channels). Order ``channels`` [H]. Any order of the
    hidden channels, applied to every such tensor at once, keeps the function: RMS norms, dot products and
    sums over the channels do not see it.
    """

    hidden_size: int
    hyper_connections: int = 1

    def __post_init__(self) -> None:
        self._check()

    def segment_size(self, kind: str) -> int:
        return {"hidden": self.hidden_size, "hc": self.hyper_connections * self.hidden_size}[kind]

    def order_shapes(self) -> dict[str, tuple[int, ...]]:
        return {"channels": (self.hidden_size,)}

    def fits(self, target: HiddenShape) -> list[str]:
        """What of ``target`` does not fit in this geometry (empty when it fits)."""
        problems = []
        if target.hidden_size > self.hidden_size:
            problems.append(f"hidden_size {target.hidden_size} > {self.hidden_size}")
        if target.hyper_connections != self.hyper_connections:
            problems.append(f"hyper_connections {target.hyper_connections} != {self.hyper_connections}")
        return problems

    def indices(self, orders: Mapping[str, np.ndarray] | None, target: HiddenShape) -> dict[str, np.ndarray]:
        channels = np.arange(self.hidden_size) if orders is None else orders["channels"]
        kept = np.asarray(channels[: target.hidden_size], dtype=np.int64)
        streams = np.arange(self.hyper_connections, dtype=np.int64)[:, None] * self.hidden_size
        return {"hidden": kept, "hc": (streams + kept).reshape(-1)}
