"""Sub-blocks beside GDN in the plan search (issues 21, 23): attention heads, MLP and shared-expert channels,
routed-expert counts.

A sub-block to plan (:class:`BlockToPlan`) offers what the sensitivity measurement reads from a GDN layer
(:class:`gdnprune.plan.measure.sensitivity.LayerToPlan`) — ``prefix``, ``module``, ``shape``, ``candidates`` — and
builds its own cut modules (:meth:`BlockToPlan.sorted_state`, :meth:`BlockToPlan.build`), so the measured
and the successive-halving sensitivities run over GDN layers and sub-blocks alike: a candidate is a
(decoder layer, module builder) pair, measured with the cut module in place of the full one.

A cut sub-block is the module itself with its tensors sorted by the scores' orders and cut to the
candidate (:func:`gdnprune.model.subblock_surgery.slice_block_state_dict`, the gather a sliced checkpoint gets),
and the few attributes its forward reads from the geometry (``num_key_value_groups``; the expert count of
the router and of the experts module) updated.

The whole-model budgets (:func:`whole_model_costs`): every parameter of the model (embeddings included),
the active parameters per token (routed experts count ``num_experts_per_tok`` experts' weights, whatever
the number kept, and every router row), and the inference memory per sequence (GDN recurrent state in
float32 plus the KV cache of the attention layers at ``context`` tokens in the model's dtype). What no
candidate changes is a fixed part of every budget; with layer removal (:mod:`.depth`) the part of each
decoder layer that no candidate changes is a group of its own (:func:`decoder_layer_rests`), so a removed
layer leaves every budget whole.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from ...io.plan_file import state_elements
from ...io.scores_file import match_layers
from ...model.forwards import decoder_layers, layer_index
from ...model.geometry import GDNShape
from ...model.layouts import find_gdn_modules
from ...model.subblock_geometry import block_candidates, kv_cache_elements
from ...model.subblock_shapes import AttentionShape, ExpertShape, MLPShape
from ...model.subblock_surgery import find_model_blocks, permute_block_state_dict, slice_block_state_dict
from ...scoring.hooks import materialized_weight

__all__ = [
    "BLOCK_NAMES",
    "PLAN_BLOCK_NAMES",
    "BlockToPlan",
    "active_parameters",
    "decoder_layer_rests",
    "plannable_blocks",
    "whole_model_costs",
]

#: names of ``blocks`` (``--blocks``), all of them the default: the GDN layers, the sub-block kinds the search may
#: shrink, ``depth`` (whole decoder layers removed, :mod:`.depth`) and ``hidden`` (the hidden size, one global
#: choice measured outside the per-layer problem, :mod:`gdnprune.plan.hidden`; in the default since the
#: benchmark of issue 42, BENCHMARKS.md "The hidden size")
BLOCK_NAMES = ("gdn", "attention", "mlp", "shared_expert", "experts", "depth", "hidden")
#: every name ``blocks`` may hold (:data:`BLOCK_NAMES`)
PLAN_BLOCK_NAMES = BLOCK_NAMES
#: the names of :data:`BLOCK_NAMES` that are sub-block kinds (:data:`gdnprune.model.subblock_geometry.KINDS`)
SUB_BLOCK_NAMES = ("attention", "mlp", "shared_expert", "experts")


class BlockToPlan:
    """One sub-block of a loaded model to plan: its :class:`~gdnprune.model.subblock_geometry.Block`, module, orders, candidates."""

    def __init__(
        self, block: Any, module: torch.nn.Module, orders: Mapping[str, Any] | None, candidates: Sequence[Any]
    ):
        self.block, self.module, self.orders = block, module, orders
        self.prefix, self.shape, self.candidates = block.prefix, block.shape, list(candidates)
        self.key = block.prefix  # the prefix the scores (and the plan file) use

    def sorted_state(self) -> dict[str, torch.Tensor]:
        """The block's tensors (materialised if offloaded), keyed as in the model, sorted by its orders."""

        state = {}
        for name, _ in self.module.named_parameters():
            owner, _, leaf = name.rpartition(".")
            state[f"{self.prefix}.{name}"] = materialized_weight(
                self.module.get_submodule(owner) if owner else self.module, leaf
            ).detach()
        if self.orders is not None:
            permute_block_state_dict(state, self.block, self.orders)
        return state

    def build(self, state: Mapping[str, torch.Tensor], target: Any, device: torch.device) -> torch.nn.Module:
        """The sub-block cut to ``target``: a copy of the module holding the sorted tensors cut to it."""

        cut = dict(state)
        slice_block_state_dict(cut, self.block, target)
        module = _meta_copy(self.module)
        head = self.prefix + "."
        for name, _ in self.module.named_parameters():
            owner, _, leaf = name.rpartition(".")
            holder = module.get_submodule(owner) if owner else module
            setattr(holder, leaf, torch.nn.Parameter(cut[head + name].to(device), requires_grad=False))

        # the router and the experts module of an MoE block read their expert count in the forward
        holders = list(module.modules()) if isinstance(target, ExpertShape) else [module]
        for name, value in _geometry_attributes(target).items():
            for holder in holders:
                if hasattr(holder, name):
                    setattr(holder, name, value)
        return module.eval()


def _meta_copy(module: torch.nn.Module) -> torch.nn.Module:
    """A copy of ``module`` whose parameters are on the meta device (no weights copied)."""
    memo = {
        id(p): torch.nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=False)
        for p in module.parameters()
    }
    return copy.deepcopy(module, memo)


def _geometry_attributes(target: Any) -> dict[str, int]:

    if isinstance(target, ExpertShape):
        return {"num_experts": target.num_experts}

    if isinstance(target, AttentionShape):
        return {
            "num_key_value_groups": target.heads_per_group,
            "num_heads": target.num_attention_heads,
            "num_attention_heads": target.num_attention_heads,
            "num_key_value_heads": target.num_key_value_heads,
        }
    if isinstance(target, MLPShape):
        return {"intermediate_size": target.intermediate_size}
    return {}


def plannable_blocks(
    model: torch.nn.Module,
    kinds: Sequence[str],
    score_layers: Mapping[str, Any] | None,
    *,
    step: Any,
    tp: int | None,
    multiple_of: int | None,
    orders_applied: bool,
    snap_quant: int | None = None,
) -> list[BlockToPlan]:
    """The sub-blocks of ``kinds`` of ``model`` with their candidates (:func:`gdnprune.model.subblock_geometry.block_candidates`)
    and the scores' orders (``score_layers``: a scores file's ``layers``; ``key`` of each: its prefix there).

    Raises:
        ValueError: a sub-block the scores have no orders for (score with the sub-blocks first).
    """

    found = find_model_blocks(model, kinds) if kinds else []
    if score_layers is not None:
        score_layers = {
            k: v for k, v in score_layers.items() if isinstance(v, Mapping) and v.get("kind") in kinds
        }
    payload_of = match_layers(score_layers, [b.prefix for b in found]) if score_layers is not None else {}
    key_of = {}
    for key in score_layers or {}:
        key_of.update({p: key for p in match_layers({key: None}, [b.prefix for b in found])})
    out = []
    for block in found:
        if not orders_applied and block.prefix not in payload_of:
            raise ValueError(
                f"the scores have no orders for the {block.kind} sub-block {block.prefix}; score this "
                f"model with its sub-blocks (gdnprune score with the default --blocks, score_checkpoint(..., "
                f"blocks=None)) or leave {block.kind} out of `blocks`"
            )
        cands = [
            c.target
            for c in block_candidates(block, step=step, tp=tp, multiple_of=multiple_of, snap_quant=snap_quant)
        ]
        out.append(
            BlockToPlan(
                block,
                model.get_submodule(block.prefix),
                None if orders_applied else payload_of[block.prefix],
                cands,
            )
        )
        out[-1].key = key_of.get(block.prefix, block.prefix)
    return out


def _active_share(model: torch.nn.Module) -> dict[str, float]:
    """Routed-expert tensors' prefixes -> the share of them a token uses (``k / E``)."""

    experts = find_model_blocks(model, ("experts",))  # a layout no table knows: an error, not a full count
    return {f"{b.prefix}.experts": b.shape.num_experts_per_tok / b.shape.num_experts for b in experts}


def active_parameters(block: Any, target: Any = None) -> float:
    """Parameters a token uses of ``block`` cut to ``target`` (default: as it is). Routed experts: every
    router row (each token scores every kept expert) and ``num_experts_per_tok`` experts' weights, however
    many are kept; any other sub-block: all of them."""

    target = block.shape if target is None else target
    total = block.parameters(target)
    if not isinstance(target, ExpertShape):
        return float(total)
    router = block.tensors["gate.weight"][1] * target.num_experts
    return float(router + (total - router) * target.num_experts_per_tok / target.num_experts)


def _gdn_state(module: Any) -> int:
    """Recurrent state of one sequence in the GDN layer ``module``, in elements (``Any``: its
    ``conv_kernel_size`` is an attribute of the model's own class)."""
    return state_elements(GDNShape.from_module(module), int(module.conv_kernel_size))


def _group_costs(
    model: torch.nn.Module,
    gdn: Sequence[tuple[torch.nn.Module, Sequence[Any]]],
    blocks: Sequence[BlockToPlan],
    *,
    kv: int,
    kv_bytes: int,
    state_bytes: int,
) -> tuple[dict[str, list[list[float]]], dict[str, list[float]]]:
    """Per group (GDN layers, then ``blocks``): its cost on every whole-model budget at every candidate, and
    at its full geometry (which need not be a candidate under serving constraints)."""

    costs: dict[str, list[list[float]]] = {"params": [], "active_params": [], "memory": []}
    full: dict[str, list[float]] = {"params": [], "active_params": [], "memory": []}
    for module, cands in gdn:
        costs["params"].append([float(c.params) for c in cands])
        costs["active_params"].append([float(c.params) for c in cands])
        costs["memory"].append([float(c.state * state_bytes) for c in cands])
        size = float(sum(p.numel() for p in module.parameters()))
        full["params"].append(size)
        full["active_params"].append(size)
        full["memory"].append(float(_gdn_state(module) * state_bytes))
    for b in blocks:
        costs["params"].append([float(b.block.parameters(t)) for t in b.candidates])
        costs["active_params"].append([active_parameters(b.block, t) for t in b.candidates])
        attention = b.block.kind == "attention"
        costs["memory"].append(
            [float(kv_cache_elements(t) * kv * kv_bytes) if attention else 0.0 for t in b.candidates]
        )
        full["params"].append(float(b.block.parameters()))
        full["active_params"].append(active_parameters(b.block))
        full["memory"].append(float(kv_cache_elements(b.shape) * kv * kv_bytes) if attention else 0.0)
    return costs, full


def whole_model_costs(
    model: torch.nn.Module,
    gdn: Sequence[tuple[torch.nn.Module, Sequence[Any]]],
    blocks: Sequence[BlockToPlan],
    *,
    context: int | None,
    state_bytes: int,
) -> tuple[dict[str, float], dict[str, list[list[float]]], dict[str, float]]:
    """``(totals, costs, fixed)`` of the whole-model budgets, per candidate group (GDN layers, then ``blocks``).

    ``gdn``: per GDN layer to plan, its module and its candidates (with ``params`` and ``state``).
    ``totals``: the full model's ``params`` (every parameter, a tied embedding once), ``active_params`` and,
    with ``context``, ``memory`` (bytes per sequence); ``costs[name][group][cand]``: what the group costs at
    that candidate; ``fixed[name]``: what the rest of the model costs (no candidate changes it).
    """
    totals = _model_totals(model, context=context, state_bytes=state_bytes)
    costs, full = _group_costs(
        model,
        gdn,
        blocks,
        kv=context or 0,
        kv_bytes=next(model.parameters()).element_size(),
        state_bytes=state_bytes,
    )
    fixed = {name: totals[name] - sum(full[name]) for name in totals}
    if context is None:
        del costs["memory"]
    return totals, costs, fixed


def _model_totals(
    model: torch.nn.Module, *, context: int | None, state_bytes: int, under: str | None = None
) -> dict[str, float]:
    """Every parameter, the active parameters and (with ``context``) the memory per sequence of ``model``, or of
    its decoder layer at module path ``under`` alone."""

    head = None if under is None else under + "."
    share = _active_share(model)
    seen, total, active = set(), 0, 0.0
    for name, p in model.named_parameters():
        if id(p) in seen or (head is not None and not name.startswith(head)):
            continue
        seen.add(id(p))
        total += p.numel()
        active += p.numel() * next((s for prefix, s in share.items() if name.startswith(prefix + ".")), 1.0)
    out = {"params": float(total), "active_params": active}
    if context is not None:
        kv_bytes = next(model.parameters()).element_size()
        inside = (lambda prefix: True) if head is None else (lambda prefix: prefix.startswith(head))
        memory = sum(_gdn_state(m) * state_bytes for prefix, m in find_gdn_modules(model) if inside(prefix))
        memory += sum(
            kv_cache_elements(b.shape) * context * kv_bytes
            for b in find_model_blocks(model, ("attention",))
            if inside(b.prefix)
        )
        out["memory"] = float(memory)
    return out


def decoder_layer_rests(
    model: torch.nn.Module,
    gdn: Sequence[tuple[torch.nn.Module, Sequence[Any]]],
    blocks: Sequence[BlockToPlan],
    *,
    context: int | None,
    state_bytes: int,
) -> tuple[list[int], list[str], dict[str, list[float]], dict[str, list[float]]]:
    """What each decoder layer costs beyond its planned groups (norms, the sub-blocks ``blocks`` leaves out):
    ``(layer_of, prefixes, rests, wholes)`` — the decoder layer of every group (GDN layers, then ``blocks``),
    every decoder layer's module path, ``rests[name][layer]`` on every whole-model budget and
    ``wholes[name][layer]``, what the whole layer costs. Removing a layer removes its groups and its rest."""

    layers = decoder_layers(model)
    names = {id(m): n for n, m in model.named_modules()}
    prefixes = [names[id(layer)] for layer in layers]
    layer_of = [layer_index(layers, m) for m, _ in gdn] + [layer_index(layers, b.module) for b in blocks]
    _, full = _group_costs(
        model,
        gdn,
        blocks,
        kv=context or 0,
        kv_bytes=next(model.parameters()).element_size(),
        state_bytes=state_bytes,
    )
    rests: dict[str, list[float]] = {}
    wholes: dict[str, list[float]] = {}
    for i, prefix in enumerate(prefixes):
        whole = _model_totals(model, context=context, state_bytes=state_bytes, under=prefix)
        for name, value in whole.items():
            planned = sum(f for f, layer in zip(full[name], layer_of) if layer == i)
            rests.setdefault(name, []).append(value - planned)
            wholes.setdefault(name, []).append(value)
    return layer_of, prefixes, rests, wholes
