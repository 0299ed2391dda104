"""Tensor layouts of GatedDeltaNet layers, kept as data.

A layout is a table: for each tensor of a GDN layer (named by its suffix under the layer prefix) it says
which axis is coupled to the layer's width and which canonical index runs along that axis.

Canonical index *kinds* (the formulas live in :mod:`gdnprune.gated_delta_net`):

=====  ======================  =========================================
kind   full length             meaning
=====  ======================  =========================================
``q``  ``Hk*dk``               q channel ``g*dk + d``
``k``  ``Hk*dk``               k channel, same order as q
``v``  ``Hv*dv``               v / z channel ``h*dv + e``
``h``  ``Hv``                  value head ``h = g*r + j``
``d``  ``dv``                  value dim ``e`` (shared by all value heads)
=====  ======================  =========================================

An axis carries a concatenation of segments, e.g. ``("q", "k", "v")`` for ``in_proj_qkv`` and
``conv1d``. A *flat* axis stores the segments one after the other; a *grouped* axis (Qwen3-Next's
fused ``in_proj_qkvz`` / ``in_proj_ba``) stores, for each key group ``g``, the group's slice of every
segment in turn: ``[q_g, k_g, v_g, z_g]``. Permuting and slicing are then one gather along the axis.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import torch

# This module does not import torch: the streaming checkpoint commands use it without loading torch.

# Segment kinds and the index key each one gathers with (see gated_delta_net.indices).
_SEGMENT_INDEX = {"q": "qidx", "k": "qidx", "v": "vidx", "h": "hidx", "d": "didx"}


def segment_size(kind: str, shape) -> int:
    """Full length of one segment of kind ``kind`` for a layer of geometry ``shape`` (a sub-block geometry of
    :mod:`gdnprune.model.subblock_geometry` knows the sizes of its own kinds)."""
    if kind not in _SEGMENT_INDEX:
        return shape.segment_size(kind)
    Hk, Hv, dk, dv = shape.num_key_heads, shape.num_value_heads, shape.key_head_dim, shape.value_head_dim
    return {"q": Hk * dk, "k": Hk * dk, "v": Hv * dv, "h": Hv, "d": dv}[kind]


@dataclass(frozen=True)
class TensorRule:
    """How one tensor of a GDN layer couples to the layer's width.

    Attributes:
        name: suffix under the layer prefix, e.g. ``"in_proj_qkv.weight"``.
        axis: the coupled axis.
        segments: the canonical segments laid along ``axis``, in canonical order.
        grouped: whether the axis is interleaved per key group (Qwen3-Next fused projections).
        ndim: expected number of dimensions.
        required: whether a layer of this layout must have the tensor (biases are optional).
        tile: 1 for a tensor whose coupled axis runs over rows (or columns) of the weight itself; ``B`` for
            the scales of a tile-quantised weight (FP8 ``weight_scale_inv``, one scale per ``B`` x ``B``
            tile): one entry per ``B`` rows of the weight's coupled axis (see :func:`scale_rule`).
    """

    name: str
    axis: int
    segments: tuple[str, ...]
    grouped: bool = False
    ndim: int = 2
    required: bool = True
    tile: int = 1

    @property
    def block(self) -> int:
        """The old name of :attr:`tile` (kept for one release)."""
        return self.tile

    def length(self, shape) -> int:
        """Expected size of the coupled axis for a layer of geometry ``shape``."""
        rows = sum(segment_size(kind, shape) for kind in self.segments)
        return -(-rows // self.tile)

    def expected_shape(self, shape) -> str:
        """Human readable expected shape, ``*`` for axes the layout does not fix."""
        dims = ["*"] * self.ndim
        dims[self.axis] = str(self.length(shape))
        return "(" + ", ".join(dims) + ")"

    def canonical_rows(self, shape) -> np.ndarray:
        """Canonical index of each physical row along ``axis`` (identity for a flat axis); read-only, cached."""
        return _canonical_rows(self.segments, self.grouped, shape)

    def gather_index(self, shape, target, indices: Mapping[str, np.ndarray]) -> np.ndarray:
        """Physical rows of the source (geometry ``shape``) that make up the output (geometry ``target``).

        ``indices`` holds the canonical index arrays (``qidx``, ``hidx``, ``vidx``, ``didx``, as from
        :func:`gdnprune.model.geometry.check_indices`) built for ``shape`` -> ``target``; segment offsets are
        always taken from the full ``shape``. Returns an int64 array.
        """
        parts, base = [], 0
        for kind in self.segments:
            parts.append(np.asarray(indices[_SEGMENT_INDEX.get(kind, kind)], dtype=np.int64) + base)
            base += segment_size(kind, shape)
        canonical = np.concatenate(parts)
        rows = (
            canonical
            if not self.grouped
            else _physical_rows(self.segments, shape)[canonical[self.canonical_rows(target)]]
        )
        return rows if self.tile == 1 else _tile_index(rows, self.tile, self.name)


class TileGridError(ValueError):
    """A gather that moves rows of a tile-quantised weight out of their scale tile."""


#: the old name of :class:`TileGridError` (kept for one release)
BlockGridError = TileGridError


def _tile_index(rows: np.ndarray, tile: int, name: str) -> np.ndarray:
    """The scale tiles of the source for the output tiles of a weight gathered with ``rows``.

    Output tile ``b`` holds output rows ``[b*B, (b+1)*B)``; every one of them must come from the same source
    tile, whose scale then serves it unchanged (the dequantised weights are exactly the gathered ones).
    """
    source = rows // tile
    starts = np.arange(0, rows.size, tile)
    low, high = np.minimum.reduceat(source, starts), np.maximum.reduceat(source, starts)
    broken = np.flatnonzero(low != high)
    if broken.size:
        b = int(broken[0])
        raise TileGridError(
            f"{name}: the gather takes rows of one {tile}-row scale tile from several source tiles (output "
            f"tile {b} mixes source tiles {sorted(set(source[b * tile : (b + 1) * tile].tolist()))}); with "
            f"{tile}-wide quantisation tiles only moves and cuts of whole tiles keep the FP8 weights exact"
        )
    return low


def scale_rule(weight: TensorRule, suffix: str, tile_size: tuple[int, int]) -> TensorRule:
    """The rule of the per-tile scales ``suffix`` of the tile-quantised weight ``weight``: the same coupled
    axis and segments, one entry per tile of ``tile_size = (rows, columns)``. A fused 3-D expert tensor
    (``[E, rows, columns]``, coupled along the expert axis 0) has scales ``[E, tiles, tiles]``: one set per
    expert, gathered with its expert (tile 1 along that axis)."""
    leading = weight.ndim - 2
    tile = 1 if weight.axis < leading else int(tile_size[weight.axis - leading])
    return TensorRule(
        suffix, weight.axis, weight.segments, weight.grouped, ndim=weight.ndim, required=False, tile=tile
    )


def scale_name(weight: str) -> str:
    """The FP8 scale tensor (one scale per tile) of weight suffix ``weight``: ``x.weight`` -> ``x.weight_scale_inv``; a
    parameter not called ``weight`` (fused experts ``experts.gate_up_proj``) -> ``experts.gate_up_proj_scale_inv``
    (transformers' names)."""
    if weight == "weight" or weight.endswith(".weight"):
        return weight[: -len("weight")] + "weight_scale_inv"
    return weight + "_scale_inv"


def scaled_weight(suffix: str) -> str | None:
    """The weight an FP8 scale suffix scales (the inverse of :func:`scale_name`), None for other tensors."""
    if suffix.endswith("weight_scale_inv"):
        return suffix[: -len("weight_scale_inv")] + "weight"
    if suffix.endswith("_scale_inv"):
        return suffix[: -len("_scale_inv")]
    return None


@functools.lru_cache(maxsize=256)
def _canonical_rows(segments: tuple[str, ...], grouped: bool, shape) -> np.ndarray:
    n = sum(segment_size(kind, shape) for kind in segments)
    if not grouped:
        rows = np.arange(n)
    else:
        # physical row (g, s, i) -> canonical: segment s's start + g * (its rows per group) + i
        Hk = shape.num_key_heads
        per_group = [segment_size(kind, shape) // Hk for kind in segments]
        starts = np.cumsum([0] + [p * Hk for p in per_group[:-1]])
        g = np.arange(Hk)[:, None]
        rows = np.concatenate(
            [start + g * p + np.arange(p) for start, p in zip(starts, per_group)], axis=1
        ).reshape(-1)
    rows.setflags(write=False)
    return rows


@functools.lru_cache(maxsize=256)
def _physical_rows(segments: tuple[str, ...], shape) -> np.ndarray:
    """Inverse of a grouped axis's canonical rows: canonical index -> physical row."""
    canonical = _canonical_rows(segments, True, shape)
    rows = np.empty_like(canonical)
    rows[canonical] = np.arange(canonical.size)
    rows.setflags(write=False)
    return rows


@dataclass(frozen=True)
class Layout:
    """A GDN tensor layout: a name, a description, the tensors it couples and the tensors that identify it.

    ``markers`` are suffixes that only this layout has and that no attention layer has either (so
    ``q_proj`` is not one), used by :func:`detect_layout`.
    """

    name: str
    description: str
    rules: tuple[TensorRule, ...]
    markers: frozenset[str]
    fixed: frozenset[str] = frozenset()  # tensors of the module that no width couples (copied unchanged)
    #: numbered tensors ``{numbered}.N.<suffix>`` (one per routed expert ``N``): a gather over their NAMES
    #: (renumbered with the canonical index of segment ``numbered_segment``), their bytes copied unchanged
    numbered: str = ""
    numbered_segment: str = ""

    def rule(self, name: str) -> TensorRule | None:
        """The rule for tensor suffix ``name``, or None when the layout does not couple it."""
        return self._by_name.get(name)

    @cached_property
    def _by_name(self) -> dict[str, TensorRule]:
        return {r.name: r for r in self.rules}


def _linear(name: str, segments: tuple[str, ...], *, grouped: bool = False) -> tuple[TensorRule, ...]:
    """A Linear whose output rows are coupled: its weight (required) and bias (optional) move together."""
    return (
        TensorRule(f"{name}.weight", 0, segments, grouped, ndim=2),
        TensorRule(f"{name}.bias", 0, segments, grouped, ndim=1, required=False),
    )


_CONV = (
    TensorRule("conv1d.weight", 0, ("q", "k", "v"), ndim=3),
    TensorRule("conv1d.bias", 0, ("q", "k", "v"), ndim=1, required=False),
)
_HEAD_PARAMS = (
    TensorRule("A_log", 0, ("h",), ndim=1),
    TensorRule("dt_bias", 0, ("h",), ndim=1),
)

QWEN3_5 = Layout(
    name="qwen3_5",
    description="Qwen3.5 / Qwen3.5-MoE / Qwen4-exp split projections (in_proj_qkv, in_proj_z, in_proj_b, in_proj_a)",
    rules=(
        *_linear("in_proj_qkv", ("q", "k", "v")),
        *_linear("in_proj_z", ("v",)),
        *_linear("in_proj_b", ("h",)),
        *_linear("in_proj_a", ("h",)),
        *_CONV,
        *_HEAD_PARAMS,
        TensorRule("norm.weight", 0, ("d",), ndim=1),
        TensorRule("out_proj.weight", 1, ("v",)),
    ),
    markers=frozenset({"in_proj_qkv.weight", "in_proj_z.weight", "in_proj_b.weight", "in_proj_a.weight"}),
)

QWEN3_NEXT = Layout(
    name="qwen3_next",
    description="Qwen3-Next fused projections grouped per key head (in_proj_qkvz, in_proj_ba)",
    rules=(
        *_linear("in_proj_qkvz", ("q", "k", "v", "v"), grouped=True),
        *_linear("in_proj_ba", ("h", "h"), grouped=True),
        *_CONV,
        *_HEAD_PARAMS,
        TensorRule("norm.weight", 0, ("d",), ndim=1),
        TensorRule("out_proj.weight", 1, ("v",)),
    ),
    markers=frozenset({"in_proj_qkvz.weight", "in_proj_ba.weight"}),
)

OLMO_HYBRID = Layout(
    name="olmo_hybrid",
    description="OLMo-hybrid / flash-linear-attention separate projections (q/k/v/g/a/b_proj, o_norm, o_proj)",
    rules=(
        *_linear("q_proj", ("q",)),
        *_linear("k_proj", ("q",)),
        *_linear("v_proj", ("v",)),
        *_linear("g_proj", ("v",)),
        *_linear("a_proj", ("h",)),
        *_linear("b_proj", ("h",)),
        *_CONV,
        *_HEAD_PARAMS,
        TensorRule("o_norm.weight", 0, ("d",), ndim=1),
        TensorRule("o_proj.weight", 1, ("v",)),
    ),
    markers=frozenset({"g_proj.weight", "a_proj.weight", "b_proj.weight", "o_norm.weight"}),
)

LAYOUTS: dict[str, Layout] = {layout.name: layout for layout in (QWEN3_5, QWEN3_NEXT, OLMO_HYBRID)}

# --------------------------------------------------------------------------------------------------------
# Sub-block layouts (kinds and geometries in gdnprune.model.subblock_geometry): the same rules, other segment kinds —
# ``i`` MLP channel, ``kv`` key-value head channel, ``qo`` query head channel, ``qg`` gated q_proj row,
# ``e`` routed expert.

GATED_MLP = Layout(
    name="gated_mlp",
    description="SwiGLU MLP (gate_proj / up_proj rows, down_proj columns): dense MLPs and MoE shared experts",
    rules=(
        *_linear("gate_proj", ("i",)),
        *_linear("up_proj", ("i",)),
        TensorRule("down_proj.weight", 1, ("i",)),
    ),
    markers=frozenset({"gate_proj.weight", "down_proj.weight"}),
    fixed=frozenset({"down_proj.bias"}),
)

QWEN_GATED_ATTENTION = Layout(
    name="qwen_gated_attention",
    description="Qwen3.5 / Qwen3-Next gated attention: q_proj rows [query_h | gate_h] per head, q_norm/k_norm "
    "over the head dim (shared by all heads)",
    rules=(
        *_linear("q_proj", ("qg",)),
        *_linear("k_proj", ("kv",)),
        *_linear("v_proj", ("kv",)),
        TensorRule("o_proj.weight", 1, ("qo",)),
    ),
    markers=frozenset({"q_proj.weight", "o_proj.weight"}),
    fixed=frozenset({"q_norm.weight", "k_norm.weight", "o_proj.bias"}),
)

ATTENTION_WHOLE_NORM = Layout(
    name="attention_whole_norm",
    description="OLMo-hybrid attention: q_norm/k_norm over the whole projection (one weight per channel; "
    "sorting keeps the function, a cut changes what the norms average over)",
    rules=(
        *_linear("q_proj", ("qo",)),
        *_linear("k_proj", ("kv",)),
        *_linear("v_proj", ("kv",)),
        TensorRule("o_proj.weight", 1, ("qo",)),
        TensorRule("q_norm.weight", 0, ("qo",), ndim=1),
        TensorRule("k_norm.weight", 0, ("kv",), ndim=1),
    ),
    markers=frozenset({"q_proj.weight", "o_proj.weight"}),
    fixed=frozenset({"o_proj.bias"}),
)

# Routed experts (segment ``e``: one entry per expert). The router's rows follow the experts; transformers 5
# holds the experts fused in memory (and some tools save them so), Qwen's releases and ``save_pretrained``
# store one tensor per expert (``experts.N.gate_proj.weight``, ...): then keeping experts renumbers ``N``.
_ROUTER = TensorRule("gate.weight", 0, ("e",), ndim=2)

FUSED_EXPERTS = Layout(
    name="fused_experts",
    description="routed experts as 3-D tensors (experts.gate_up_proj [E, 2I, H], experts.down_proj [E, H, I]) "
    "and the router rows (gate.weight [E, H])",
    rules=(
        _ROUTER,
        TensorRule("experts.gate_up_proj", 0, ("e",), ndim=3),
        TensorRule("experts.down_proj", 0, ("e",), ndim=3),
    ),
    markers=frozenset({"gate.weight"}),
)

NUMBERED_EXPERTS = Layout(
    name="numbered_experts",
    description="routed experts one tensor per expert (experts.N.gate_proj.weight, ..., FP8 scales with their "
    "expert) and the router rows (gate.weight [E, H])",
    rules=(_ROUTER,),
    markers=frozenset({"gate.weight"}),
    numbered="experts",
    numbered_segment="e",
)

BLOCK_LAYOUTS: dict[str, Layout] = {
    layout.name: layout
    for layout in (GATED_MLP, QWEN_GATED_ATTENTION, ATTENTION_WHOLE_NORM, FUSED_EXPERTS, NUMBERED_EXPERTS)
}

# --------------------------------------------------------------------------------------------------------
# The hidden size (the width of the residual stream): one table for the whole model. Every tensor that reads
# the residual stream has its columns on it (segment ``hidden``), every tensor that writes it its rows; a
# tensor is named by a regular expression over its full name (``re.search``), because the same suffix means
# different things in different modules (``norm.weight``: the final norm, or a GDN layer's value-dim norm).
# ``hc`` is a hyper-connection stream bundle (``hc_count`` copies of the hidden channels, Qwen4-exp).

_L = r"(?:^|\.)layers\.\d+\."  # a decoder layer, also the MTP head's (``mtp.layers.0.``)
_GDN_READERS = r"in_proj_qkvz|in_proj_ba|in_proj_qkv|in_proj_z|in_proj_b|in_proj_a|q_proj|k_proj|v_proj|g_proj|a_proj|b_proj"
_READERS = (
    rf"linear_attn\.(?:{_GDN_READERS})|self_attn\.(?:q_proj|k_proj|v_proj)"
    r"|mlp\.(?:shared_expert\.)?(?:gate_proj|up_proj)|mlp\.experts\.\d+\.(?:gate_proj|up_proj)"
    r"|mlp\.gate|mlp\.shared_expert_gate"
)
_WRITERS = r"linear_attn\.(?:out_proj|o_proj)|self_attn\.o_proj|mlp\.(?:shared_expert\.)?down_proj|mlp\.experts\.\d+\.down_proj"
_HC = r"(?:^|\.)(?:hyper_connection_mixer|attn_hyper_connection|mlp_hyper_connection)"
_NORMS = (
    r"input_layernorm|post_attention_layernorm|pre_feedforward_layernorm|post_feedforward_layernorm"
    r"|attention_layer_norm|feedforward_layer_norm"  # OLMo-hybrid's names on disk
)


def _hidden(pattern: str, axis: int, ndim: int, segments: tuple[str, ...] = ("hidden",)) -> TensorRule:
    return TensorRule(pattern, axis, segments, ndim=ndim)


HIDDEN_RULES: tuple[TensorRule, ...] = (
    _hidden(r"(?:^|\.)embed_tokens\.weight$", 1, 2),
    _hidden(r"(?:^|\.)lm_head\.weight$", 1, 2),
    _hidden(r"(?:^|\.)(?:model|language_model|mtp)\.norm\.weight$", 0, 1),
    _hidden(rf"{_L}(?:{_NORMS})\.weight$", 0, 1),
    _hidden(rf"{_L}(?:{_READERS})\.weight$", 1, 2),
    _hidden(rf"{_L}(?:{_WRITERS})\.weight$", 0, 2),
    _hidden(rf"{_L}(?:{_WRITERS})\.bias$", 0, 1),
    _hidden(rf"{_L}mlp\.experts\.gate_up_proj$", 2, 3),  # [E, 2I, H]
    _hidden(rf"{_L}mlp\.experts\.down_proj$", 1, 3),  # [E, H, I]
    # the multi-token-prediction head: its fc reads [embedding | hidden state] and writes the residual
    _hidden(r"^mtp\.fc\.weight$", 0, 2),
    _hidden(r"^mtp\.fc\.weight$", 1, 2, ("hidden", "hidden")),
    _hidden(r"^mtp\.pre_fc_norm_(?:embedding|hidden)\.weight$", 0, 1),
    # Qwen4-exp's hyper-connections: ``hc_count`` streams of the hidden channels side by side
    _hidden(rf"{_HC}\.hc_norm\.weight$", 0, 1, ("hc",)),
    _hidden(rf"{_HC}\.input_mix_weight_down\.weight$", 1, 2, ("hc",)),
    _hidden(rf"{_HC}\.input_mix_weight_up\.weight$", 0, 2, ("hc",)),
    _hidden(rf"{_HC}\.block_inject_weight\.weight$", 1, 2, ("hc",)),
    _hidden(rf"{_L}self_attn\.indexer\.index_qk_proj\.weight$", 1, 2),
    # a vision-language model's merger writes image tokens into the residual stream
    _hidden(r"(?:^|\.)visual\.merger\.linear_fc2\.weight$", 0, 2),
    _hidden(r"(?:^|\.)visual\.merger\.linear_fc2\.bias$", 0, 1),
)
"""What reads and writes the residual stream: the hidden-size table."""

HIDDEN_FREE: tuple[str, ...] = (
    r"(?:^|\.)visual\.",  # the vision tower's own width (its merger's output is in HIDDEN_RULES)
    r"\.linear_attn\.(?:[qkv]_)?conv1d\.(?:weight|bias)$",
    r"\.linear_attn\.(?:A_log|dt_bias)$",
    r"\.linear_attn\.(?:norm|o_norm)\.weight$",
    rf"\.linear_attn\.(?:{_GDN_READERS})\.bias$",
    r"\.self_attn\.(?:q_norm|k_norm)\.weight$",
    r"\.self_attn\.(?:q_proj|k_proj|v_proj)\.bias$",
    r"\.mlp\.(?:shared_expert\.|experts\.\d+\.)?(?:gate_proj|up_proj)\.bias$",
    r"\.rotary_emb\.",
    r"\.self_attn\.indexer\.(?:q_layernorm|k_layernorm)\.weight$",
)
"""Tensors known NOT to touch the residual stream (regular expressions); a cut of the hidden size refuses a
tensor that neither table names (it could not tell whether the tensor reads or writes the stream)."""


#: a layer's or an expert's number inside a tensor name: both tables match any number there (``\d+``), so names
#: that differ only in them match the same rules (a 512-expert checkpoint's 75,944 names are a few hundred)
_NUMBER = re.compile(r"(?<=\.)\d+(?=\.)")


def hidden_rules(name: str) -> tuple[TensorRule, ...]:
    """The rules of :data:`HIDDEN_RULES` that tensor ``name`` (its full name) matches: one per axis on the
    residual stream (``mtp.fc.weight`` has two), empty for a tensor that does not touch it."""
    return _hidden_rules(_NUMBER.sub("0", name))


@functools.lru_cache(maxsize=4096)
def _hidden_rules(name: str) -> tuple[TensorRule, ...]:
    return tuple(rule for rule in HIDDEN_RULES if re.search(rule.name, name))


def hidden_free(name: str) -> bool:
    """Whether tensor ``name`` is known not to touch the residual stream (:data:`HIDDEN_FREE`)."""
    return _hidden_free(_NUMBER.sub("0", name))


@functools.lru_cache(maxsize=4096)
def _hidden_free(name: str) -> bool:
    return any(re.search(pattern, name) for pattern in HIDDEN_FREE)


def get_layout(layout: str | Layout) -> Layout:
    """Resolve a layout name, GDN or sub-block (or pass a :class:`Layout` through); unknown names raise
    ``ValueError``."""
    if isinstance(layout, Layout):
        return layout
    found = LAYOUTS.get(layout) or BLOCK_LAYOUTS.get(layout)
    if found is None:
        raise ValueError(f"unknown GDN layout {layout!r}; expected one of {sorted(LAYOUTS)}")
    return found


def detect_layout(names: Iterable[str]) -> Layout | None:
    """The layout that the tensor suffixes ``names`` belong to; None when they belong to none.

    A layout is recognised by any of its ``markers`` (``in_proj_qkv``, ``in_proj_qkvz``, ``g_proj``, ...),
    so a layer that lacks one of them is still recognised and then reported as incomplete. Raises
    ``ValueError`` when the names mix the tensors of several layouts.
    """
    names = set(names)
    hits = {layout.name: len(names & layout.markers) for layout in LAYOUTS.values()}
    found = [LAYOUTS[name] for name, n in hits.items() if n]
    if len(found) > 1:
        raise ValueError(f"tensors {sorted(names)} mix the GDN layouts {[f.name for f in found]}")
    return found[0] if found else None


def is_gdn_suffix(name: str) -> bool:
    """Whether ``name`` is a tensor suffix that some GDN layout couples."""
    return any(layout.rule(name) is not None for layout in LAYOUTS.values())


def find_gdn_modules(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """``(weight prefix, module)`` of every GDN layer of a model, in module order.

    A GDN module is one that exposes ``num_k_heads``, ``num_v_heads``, ``head_k_dim`` and ``head_v_dim``
    (all transformers GatedDeltaNet classes do). The prefix is the module's name in ``named_modules``,
    which is also the prefix of its tensors in ``model.state_dict()``.
    """
    attrs = ("num_k_heads", "num_v_heads", "head_k_dim", "head_v_dim")
    return [(name, m) for name, m in model.named_modules() if all(hasattr(m, a) for a in attrs)]
