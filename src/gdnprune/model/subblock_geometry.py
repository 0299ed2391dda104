"""The sub-blocks beside GDN in a model: MLP channels, attention heads, routed experts, as data.

Numpy only (the streaming checkpoint commands use it without torch). A *sub-block* is a module of a
decoder layer whose width can shrink: the GDN layer (:mod:`gdnprune.model.geometry`), the full attention
(``self_attn``), the dense MLP (``mlp``), the MoE shared expert (``mlp.shared_expert``) and the routed
experts with their router (``experts``, also at ``mlp``). Each kind is a row of :data:`KINDS` — where it
lives (the module path), which tensors mark it, which config keys hold its geometry, which layout tables
(:mod:`gdnprune.model.layouts`) it may have — so a new kind is a new row, not a new code path.

The geometries (:class:`~gdnprune.model.subblock_shapes.MLPShape`, ``AttentionShape``, ``ExpertShape``) and their
canonical indices are :mod:`gdnprune.model.subblock_shapes`'; this module places them in a model: the kinds, the
sub-blocks found in a checkpoint's tensors (:func:`find_blocks`), their orders as score payloads, their
targets and config, and their plan candidates.
"""

from __future__ import annotations

import bisect
import copy
import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from fractions import Fraction
from typing import Any

import numpy as np

from .geometry import as_order, layer_index_of
from .layouts import get_layout, scaled_weight
from .model_config import MTP_PREFIX, global_config_value, per_layer_overrides, text_config
from .subblock_shapes import AttentionShape, ExpertShape, MLPShape, identity_orders
from .tiles import tile_problems

__all__ = [
    "numbered_name_map",
    "BlockKind",
    "KINDS",
    "BLOCK_FIELDS",
    "Block",
    "find_blocks",
    "names_under",
    "block_indices",
    "order_keys",
    "orders_from_payload",
    "orders_to_payload",
    "resolve_block_target",
    "apply_block_targets_to_config",
    "block_kind_of",
    "block_kinds_of",
    "kv_cache_elements",
    "BlockCandidate",
    "block_candidates",
]


# --------------------------------------------------------------------------------------------------------
# The kinds of sub-blocks, as data


@dataclass(frozen=True)
class BlockKind:
    """One kind of sub-block.

    Attributes:
        name: ``"attention"``, ``"mlp"``, ``"shared_expert"``.
        module: regular expression the module path (the tensors' prefix) must match.
        markers: tensor suffixes whose presence under a matching prefix makes it a block of this kind.
        geometry: the shape class.
        config_keys: target field (= the transformers config key, also the plan-file and per-layer key) ->
            shape field.
        layouts: names of the layout tables (:data:`gdnprune.model.layouts.BLOCK_LAYOUTS`) a block may have; the
            one whose tensor sizes fit the block's config geometry is chosen.
    """

    name: str
    module: str
    markers: frozenset[str]
    geometry: type
    config_keys: Mapping[str, str]
    layouts: tuple[str, ...]
    excludes: tuple[str, ...] = ()  # member suffixes of other modules under the same prefix (left alone)

    @property
    def where(self) -> str:
        """The module path in words, e.g. ``layers.N.mlp.shared_expert``."""
        return self.module.replace(_LAYER, "layers.N.").replace("\\.", ".").rstrip("$")

    def matches(self, prefix: str) -> bool:
        return re.search(self.module, prefix) is not None

    def shape_from_config(self, config: Any, layer_index: int) -> Any:
        """This kind's geometry of decoder layer ``layer_index`` (global keys, then ``per_layer_config``)."""
        holder = text_config(config, "hidden_size")
        values = {field: global_config_value(holder, key) for key, field in self.config_keys.items()}
        for key, value in (
            per_layer_overrides(config, self.config_keys, key="linear_num_key_heads")
            .get(layer_index, {})
            .items()
        ):
            values[self.config_keys[key]] = value
        if self.geometry is AttentionShape and values.get("head_dim") is None:
            hidden, heads = (
                global_config_value(holder, "hidden_size"),
                global_config_value(holder, "num_attention_heads"),
            )
            if hidden is not None and heads:
                values["head_dim"] = hidden // heads  # transformers' default when the config has no head_dim
        missing = [key for key, field in self.config_keys.items() if values.get(field) is None]
        if missing:
            raise ValueError(f"config has no {self.name} geometry for layer {layer_index}: missing {missing}")
        return self.geometry(**values)

    def config_updates(self, shape: Any) -> dict[str, int]:
        """The config keys (and values) that describe ``shape``."""
        return {key: getattr(shape, field) for key, field in self.config_keys.items()}


_LAYER = r"(?:^|\.)layers\.\d+\."
KINDS: dict[str, BlockKind] = {
    kind.name: kind
    for kind in (
        BlockKind(
            "attention",
            _LAYER + r"self_attn$",
            frozenset({"q_proj.weight", "o_proj.weight"}),
            AttentionShape,
            {
                "num_attention_heads": "num_attention_heads",
                "num_key_value_heads": "num_key_value_heads",
                "head_dim": "head_dim",
            },
            ("qwen_gated_attention", "attention_whole_norm"),
        ),
        BlockKind(
            "mlp",
            _LAYER + r"mlp$",
            frozenset({"gate_proj.weight", "down_proj.weight"}),
            MLPShape,
            {"intermediate_size": "intermediate_size"},
            ("gated_mlp",),
        ),
        BlockKind(
            "shared_expert",
            _LAYER + r"mlp\.shared_expert$",
            frozenset({"gate_proj.weight", "down_proj.weight"}),
            MLPShape,
            {"shared_expert_intermediate_size": "intermediate_size"},
            ("gated_mlp",),
        ),
        BlockKind(
            "experts",
            _LAYER + r"mlp$",
            frozenset({"gate.weight"}),
            ExpertShape,
            {"num_experts": "num_experts", "num_experts_per_tok": "num_experts_per_tok"},
            ("fused_experts", "numbered_experts"),
            excludes=("shared_expert.", "shared_expert_gate."),
        ),
    )
}

#: target fields of the sub-blocks (``head_dim`` is part of the geometry but never a target)
BLOCK_FIELDS = (
    "intermediate_size",
    "shared_expert_intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "num_experts",
)


def block_kinds_of(prefix: str) -> list[BlockKind]:
    """Every kind whose module path ``prefix`` matches (``layers.N.mlp``: a dense MLP or routed experts)."""
    return [kind for kind in KINDS.values() if kind.matches(prefix)]


def block_kind_of(prefix: str, keys: Iterable[str] = ()) -> BlockKind | None:
    """The kind whose module path ``prefix`` matches, or None. Where several kinds share the path (a dense
    MLP and routed experts at ``layers.N.mlp``) the first one that has one of ``keys`` (config keys or
    geometry fields, e.g. a plan entry's or a payload shape's) is chosen, else the first."""
    matches, keys = block_kinds_of(prefix), set(keys)
    named = [k for k in matches if keys & (set(k.config_keys) | {f.name for f in fields(k.geometry)})]
    return (named or matches)[0] if named or matches else None


@dataclass
class Block:
    """One sub-block found among a model's tensors: where, which kind and layout, its geometry, its tensors.

    ``tensors`` maps the coupled suffixes to their shapes (what the layout gathers); ``fixed`` maps the
    block's tensors the layout leaves unchanged (``q_norm`` of a per-head norm, ``o_proj.bias``) to theirs.
    """

    prefix: str
    kind: str
    layout: str
    shape: Any
    tensors: dict[str, tuple[int, ...]]
    fixed: dict[str, tuple[int, ...]] = field(default_factory=dict)
    numbered: dict[str, tuple[int, ...]] = field(default_factory=dict)  # experts.N.* of a numbered layout

    def parameters(self, target: Any = None) -> int:
        """Elements of the block's tensors after a cut to ``target`` (default: as it is), from the tensors'
        shapes and the layout table: the coupled axis of each tensor takes its length for ``target``. The
        cost a plan candidate has (FP8 scales count as elements too)."""

        layout, target = get_layout(self.layout), self.shape if target is None else target
        total = sum(math.prod(dims) for dims in self.fixed.values())
        if self.numbered:
            kept = target.segment_size(layout.numbered_segment)
            total += sum(math.prod(d) for s, d in self.numbered.items() if int(s.split(".")[1]) < kept)
        for suffix, dims in self.tensors.items():
            rule = layout.rule(suffix)
            if rule is None:  # an FP8 scale: one entry per block of its weight's rows or columns
                scaled = scaled_weight(suffix)
                weight = layout.rule(scaled) if scaled is not None else None
                if weight is None:
                    raise ValueError(
                        f"{self.prefix}.{suffix} is neither coupled nor the scale of a coupled weight"
                    )
                full, cut = weight.length(self.shape), weight.length(target)
                axis = weight.axis
                sizes = list(dims)
                sizes[axis] = -(-sizes[axis] * cut // full)
            else:
                sizes = list(dims)
                sizes[rule.axis] = rule.length(target)
            total += math.prod(sizes)
        return total


def kv_cache_elements(shape: AttentionShape) -> int:
    """KV cache of one token in one attention layer, in elements: keys and values, ``2 * nkv * hd``."""
    return 2 * shape.num_key_value_heads * shape.head_dim


def names_under(ordered: Sequence[str], prefix: str) -> Sequence[str]:
    """The names in ``ordered`` (sorted) that start with ``prefix + "."``: one slice, found by bisection (a
    model of 512 experts per layer has tens of thousands of tensors, and every block looks up its own)."""
    head = prefix + "."
    start = bisect.bisect_left(ordered, head)
    return ordered[start : bisect.bisect_left(ordered, prefix + "/", lo=start)]  # "/" sorts right after "."


def find_blocks(
    shapes: Mapping[str, tuple[int, ...]], config: Any, kinds: Iterable[str] | None = None
) -> list[Block]:
    """Every sub-block of ``kinds`` (default: all) among tensors ``shapes`` (name -> shape), checked.

    A prefix is a block of a kind when it matches the kind's module path and holds one of its marker
    tensors; its geometry comes from ``config`` (per-layer entries included); its layout is the candidate
    table whose tensor sizes fit. Tensors under ``mtp.`` are left alone.

    Raises:
        ValueError: a block whose tensors fit none of its kind's layouts (the message lists them, the
            expected and the found shapes) or has tensors no layout knows (e.g. Qwen4-exp's indexer).
    """

    wanted = [KINDS[k] for k in (KINDS if kinds is None else kinds)]
    prefixes: dict[str, BlockKind] = {}
    for name in shapes:
        if name.startswith(MTP_PREFIX):
            continue
        for kind in wanted:
            for marker in kind.markers:
                if name.endswith("." + marker):
                    prefix = name[: -len(marker) - 1]
                    if kind.matches(prefix):
                        prefixes[prefix] = kind
    blocks = []
    ordered = sorted(shapes)
    for prefix in sorted(prefixes, key=lambda p: (layer_index_of(p), p)):
        kind = prefixes[prefix]
        head = prefix + "."
        members = {
            n[len(head) :]: tuple(shapes[n])
            for n in names_under(ordered, prefix)
            if not n[len(head) :].startswith(kind.excludes)
        }
        shape = kind.shape_from_config(config, layer_index_of(prefix))
        blocks.append(_fit_layout(prefix, kind, shape, members))
    return blocks


def _fit_layout(prefix: str, kind: BlockKind, shape: Any, members: Mapping[str, tuple[int, ...]]) -> Block:

    reports = []
    for name in kind.layouts:
        layout = get_layout(name)
        numbered, problems = _numbered_members(layout, shape, members)
        for suffix, dims in members.items():
            if scaled_weight(suffix) is not None and suffix not in numbered:
                continue  # FP8 scales: checked with their weights (checkpoint.folder)
            if suffix in numbered:
                continue
            rule = layout.rule(suffix)
            if rule is None:
                if suffix not in layout.fixed:
                    problems.append(f"{suffix} is not part of it")
            elif len(dims) != rule.ndim or dims[rule.axis] != rule.length(shape):
                problems.append(f"{suffix} has shape {list(dims)}, expected {rule.expected_shape(shape)}")
        problems += [f"{r.name} is missing" for r in layout.rules if r.required and r.name not in members]
        if not problems:
            coupled = {s: d for s, d in members.items() if s not in layout.fixed and s not in numbered}
            fixed = {s: d for s, d in sorted(members.items()) if s in layout.fixed}
            return Block(prefix, kind.name, layout.name, shape, coupled, fixed, numbered)
        reports.append(f"{name}: {'; '.join(problems)}")
    raise ValueError(f"{prefix}: its tensors fit no {kind.name} layout for {shape} ({' | '.join(reports)})")


_NUMBER = re.compile(r"^([A-Za-z_]+)\.(\d+)\.(.+)$")


def _numbered_members(
    layout: Any, shape: Any, members: Mapping[str, tuple[int, ...]]
) -> tuple[dict[str, tuple[int, ...]], list[str]]:
    """The ``{numbered}.N.<suffix>`` members of a numbered layout and what is wrong with them: every suffix
    must exist for every ``N`` below the segment's size, with one shape for all ``N``."""
    if not layout.numbered:
        return {}, []
    count = shape.segment_size(layout.numbered_segment)
    found: dict[str, dict[int, Any]] = {}
    problems: list[str] = []
    for suffix, dims in members.items():
        m = _NUMBER.match(suffix)
        if m and m.group(1) == layout.numbered:
            found.setdefault(m.group(3), {})[int(m.group(2))] = dims
    if not found:
        problems.append(f"no {layout.numbered}.N.* tensors")
    for rest, by_number in sorted(found.items()):
        if sorted(by_number) != list(range(count)):
            problems.append(
                f"{layout.numbered}.N.{rest} exists for N in {sorted(by_number)}, expected 0..{count - 1}"
            )
        elif len(set(by_number.values())) != 1:
            problems.append(
                f"{layout.numbered}.N.{rest} has several shapes {sorted(set(by_number.values()))}"
            )
    numbered = {
        f"{layout.numbered}.{n}.{rest}": d for rest, by_number in found.items() for n, d in by_number.items()
    }
    return numbered, problems


def numbered_name_map(block: Block, indices: Mapping[str, np.ndarray]) -> dict[str, str | None]:
    """The gather over tensor NAMES of a numbered layout: full source name -> full output name (``None``:
    dropped). Output ``{numbered}.i.<suffix>`` is source ``{numbered}.idx[i].<suffix>`` (``idx``: the canonical
    index of the layout's numbered segment); a sort renumbers, a cut also drops. Empty for other layouts."""

    layout = get_layout(block.layout)
    if not block.numbered:
        return {}
    new_number = {
        int(old): new for new, old in enumerate(np.asarray(indices[layout.numbered_segment]).tolist())
    }
    out: dict[str, str | None] = {}
    for suffix in block.numbered:
        m = _NUMBER.match(suffix)
        if m is None:  # find_blocks files only numbered names here
            continue
        _, number, rest = m.groups()
        new = new_number.get(int(number))
        out[f"{block.prefix}.{suffix}"] = (
            None if new is None else f"{block.prefix}.{layout.numbered}.{new}.{rest}"
        )
    return out


# --------------------------------------------------------------------------------------------------------
# Orders, targets, indices, configs


def _payload_key(name: str) -> str:
    return f"{name[:-1] if name.endswith('s') else name}_order_most_important_first"


def order_keys(shape: Any) -> list[str]:
    """The payload keys of a sub-block's orders (``channel_order_most_important_first``, ...)."""
    return [_payload_key(name) for name in shape.order_shapes()]


def orders_from_payload(payload: Mapping[str, Any], shape: Any) -> dict[str, np.ndarray]:
    """Validated orders of a sub-block from a score payload: ``channel_order_most_important_first`` [I] for
    an MLP, ``kv_group_order_most_important_first`` [nkv] and ``query_head_order_most_important_first``
    [nkv, r] for attention; a missing key means identity. Raises ``ValueError`` naming the key."""
    if not isinstance(payload, Mapping):
        raise ValueError(f"score payload must be a mapping, got {type(payload).__name__}")
    identity = identity_orders(shape)
    out = {}
    for name, expected in shape.order_shapes().items():
        value = payload.get(_payload_key(name))
        out[name] = identity[name] if value is None else as_order(_payload_key(name), value, expected)
    return out


def orders_to_payload(orders: Mapping[str, Any]) -> dict[str, list]:
    """The ``*_order_most_important_first`` keys of a sub-block's orders, as JSON-ready lists."""
    return {_payload_key(name): np.asarray(value).tolist() for name, value in orders.items()}


def resolve_block_target(block: Block, target: Mapping[str, int] | None) -> Any:
    """The geometry ``block`` is cut to: ``target``'s fields of its kind (others ignored), checked.

    Raises:
        ValueError: the target does not fit the block (the message names the prefix and what is too big).
    """
    kind = KINDS[block.kind]
    changes = {
        kind.config_keys[k]: v for k, v in (target or {}).items() if k in kind.config_keys and v is not None
    }
    if "head_dim" in changes:
        raise ValueError(f"{block.prefix}: the head dim is never cut")
    try:
        t = block.shape.replace(**changes)
    except ValueError as exc:
        raise ValueError(f"{block.prefix}: illegal target {changes} for {block.shape}: {exc}") from None
    problems = block.shape.fits(t)
    if problems:
        raise ValueError(f"{block.prefix}: target {t} does not fit in {block.shape}: {'; '.join(problems)}")
    return t


def block_indices(
    block_shape: Any, target: Any, orders: Mapping[str, np.ndarray] | None = None
) -> dict[str, np.ndarray]:
    """Canonical indices (one array per segment kind) of the sorted (``orders``) nested prefix ``target``."""
    return block_shape.indices(orders, target)


def apply_block_targets_to_config(config: Mapping, kind: str, targets: Mapping[int, Any]) -> dict:
    """A copy of the dict ``config`` with the geometry of every block of ``kind`` (layer index -> target).

    As for GDN (:func:`gdnprune.model.geometry.apply_targets_to_config`): the global keys hold the most common
    value (ties: the lowest layer's), ``per_layer_config`` overrides the layers that differ (zero-padded
    keys); attention always writes ``head_dim`` so that the head dim no longer follows ``hidden_size //
    num_attention_heads``.
    """
    block_kind = KINDS[kind]
    out: dict = copy.deepcopy(dict(config))
    holder = text_config(out, "hidden_size")
    overrides = {int(k): dict(v) for k, v in (holder.get("per_layer_config") or {}).items()}
    for key in block_kind.config_keys:
        values = {i: block_kind.config_updates(t)[key] for i, t in sorted(targets.items())}
        if not values:
            continue
        counts: dict[int, int] = {}
        for v in values.values():
            counts[v] = counts.get(v, 0) + 1
        common = max(counts, key=lambda v: counts[v])  # the first of equal counts
        holder[key] = common
        for i, v in values.items():
            overrides.setdefault(i, {}).pop(key, None)
            if v != common:
                overrides[i][key] = v
    overrides = {i: o for i, o in overrides.items() if o}
    if overrides:
        width = len(str(max(overrides)))
        holder["per_layer_config"] = {str(i).zfill(width): overrides[i] for i in sorted(overrides)}
    else:
        holder.pop("per_layer_config", None)
    return out


@dataclass(frozen=True)
class BlockCandidate:
    """One nested-prefix geometry of one sub-block: its parameters and its KV cache per token (elements)."""

    target: Any
    params: int
    cache_per_token: int


def block_candidates(
    block: Block,
    *,
    step: Any = None,
    tp: int | None = None,
    multiple_of: int | None = None,
    snap_quant: int | None = None,
) -> list[BlockCandidate]:
    """Every candidate of a sub-block, largest first, for a plan's grid.

    MLP: intermediate sizes in steps of ``step`` (a ``fractions.Fraction`` of the full size, default 1/8,
    or a channel count), multiples of ``multiple_of`` and divisible by ``tp`` (tensor-parallel shards cut
    the channels). Experts: expert counts in the same steps, never below ``num_experts_per_tok``.
    Attention: every count of key-value heads and of query heads per key-value head, with
    the query heads divisible by ``tp`` and the key-value heads divisible by ``tp`` or dividing it (vLLM
    replicates key-value heads when ``tp`` exceeds them). The full geometry is always a candidate when it
    meets the constraints. ``snap_quant``: every width a candidate cuts fits tiles of that size
    (:func:`gdnprune.model.tiles.tile_problems`).

    Raises:
        ValueError: no candidate meets the constraints.
    """

    shape, out = block.shape, []
    if isinstance(shape, AttentionShape):
        for nkv in range(shape.num_key_value_heads, 0, -1):
            for r in range(shape.heads_per_group, 0, -1):
                target = AttentionShape(nkv * r, nkv, shape.head_dim)
                if tp and (target.num_attention_heads % tp or (nkv % tp and tp % nkv)):
                    continue
                if snap_quant and tile_problems(shape, target, snap_quant):
                    continue
                out.append(BlockCandidate(target, block.parameters(target), kv_cache_elements(target)))
    elif isinstance(shape, ExpertShape):
        full, k = shape.num_experts, shape.num_experts_per_tok
        step = Fraction(1, 8) if step is None else step
        if isinstance(step, Fraction) and step < 1:
            counts = {max(k, math.ceil(full * step * i)) for i in range(1, math.ceil(1 / step) + 1)}
        else:
            counts = set(range(max(k, int(step)), full + 1, int(step)))
        for count in sorted({c for c in counts if c <= full} | {full}, reverse=True):
            if (multiple_of and count % multiple_of) or (tp and count % tp):
                continue
            target = shape.replace(num_experts=count)
            out.append(BlockCandidate(target, block.parameters(target), 0))
    else:
        full = shape.intermediate_size
        step = Fraction(1, 8) if step is None else step
        if isinstance(step, Fraction) and step < 1:
            sizes = {max(1, math.ceil(full * step * k)) for k in range(1, math.ceil(1 / step) + 1)}
        else:
            sizes = set(range(int(step), full + 1, int(step)))
        sizes = {v for v in sizes if v <= full} | {full}
        for size in sorted(sizes, reverse=True):
            if (multiple_of and size % multiple_of) or (tp and size % tp):
                continue
            mlp = MLPShape(size)
            if snap_quant and tile_problems(shape, mlp, snap_quant):
                continue
            out.append(BlockCandidate(mlp, block.parameters(mlp), 0))
    if not out:
        raise ValueError(
            f"{block.prefix}: no candidate geometry of {shape} meets the constraints (tp={tp}, "
            f"multiple_of={multiple_of}, snap_quant={snap_quant})"
        )
    return out
