"""What a model is made of, without torch: every tensor (name, shape, dtype) and per decoder layer its kind,
parameters and widths, from a checkpoint folder's headers or from a config alone.

A folder is read through :mod:`gdnprune.checkpoint.folder` (``config.json`` and the shard headers). A config
alone — a ``config.json`` file, a folder holding only one, or a member of the recorded family
(:mod:`gdnprune.model.family`, e.g. ``Qwen3.5-397B-A17B``) — is turned into the tensors the released
checkpoints store, by the table :func:`config_tensors` (one row per tensor of a GDN layer, an attention
layer, a dense MLP, a routed-expert MoE, the MTP head; ``tests/test_estimate.py`` checks it against the
files transformers writes). Only the text decoder is described: a vision tower counts in a folder's bytes
when it is there, and is absent from a config-only inventory.
"""

from __future__ import annotations

import functools
import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..checkpoint.folder import CONFIG_NAME, Checkpoint, open_checkpoint
from ..io.safetensors_io import DTYPE_BITS
from ..model.family import member, real_config
from ..model.model_config import MTP_PREFIX, config_value, per_layer_overrides, text_config
from ..runtime.fileio import read_json

__all__ = ["Tensor", "LayerFacts", "ModelFacts", "model_facts", "config_tensors"]

#: safetensors dtype of a config's ``dtype`` / ``torch_dtype``
_DTYPES = {"float32": "F32", "bfloat16": "BF16", "float16": "F16"}
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")
_EXPERT = re.compile(r"\.experts\.\d+\.")


@dataclass(frozen=True)
class Tensor:
    name: str
    shape: tuple[int, ...]
    dtype: str  # safetensors' name: BF16, F32, F8_E4M3, ...

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return (self.numel * DTYPE_BITS[self.dtype] + 7) // 8


@dataclass(frozen=True)
class LayerFacts:
    """One decoder layer: ``kind`` (its ``layer_types`` entry), its parameters and tensors, and the widths the
    costs read: GDN ``(Hk, Hv, dk, dv, conv kernel)``, attention ``(heads, kv heads, head dim)``, a dense MLP's
    width, routed experts ``(experts, top-k, width)`` and the shared expert's width (0 when absent)."""

    index: int
    kind: str
    hidden: int
    parameters: int
    tensors: int
    gdn: tuple[int, int, int, int, int] | None = None
    attention: tuple[int, int, int] | None = None
    mlp: int = 0
    experts: tuple[int, int, int] | None = None
    shared_expert: int = 0

    @property
    def active_parameters(self) -> int:
        """Parameters a token goes through: of the routed experts, the top-k's share."""
        if self.experts is None:
            return self.parameters
        num, top, width = self.experts
        return self.parameters - (num - top) * 3 * width * self.hidden


@dataclass(frozen=True)
class ModelFacts:
    """A model as the cost formulas see it (:func:`model_facts`)."""

    source: str  # "folder", "config" or "member"
    name: str
    config: Mapping[str, Any]  # the text config
    tensors: tuple[Tensor, ...]
    layers: tuple[LayerFacts, ...]
    hidden_size: int
    vocab_size: int
    tied: bool
    dtype: str

    @functools.cached_property
    def parameters(self) -> int:
        return sum(t.numel for t in self.tensors)

    @functools.cached_property
    def bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BITS[self.dtype] // 8

    @property
    def decoder_parameters(self) -> int:
        return sum(layer.parameters for layer in self.layers)

    @property
    def active_parameters(self) -> int:
        """Parameters a token goes through (embedding lookup not counted, the head counted)."""
        return sum(layer.active_parameters for layer in self.layers) + self.vocab_size * self.hidden_size

    @property
    def experts(self) -> int:
        """Routed experts over all decoder layers."""
        return sum(layer.experts[0] for layer in self.layers if layer.experts)

    @property
    def mtp_tensors(self) -> int:
        return sum(1 for t in self.tensors if t.name.startswith(MTP_PREFIX))

    def parameter_shapes(self) -> list[tuple[int, ...]]:
        """The shapes of the parameters of the model transformers builds (what distillation trains and FSDP2
        shards): the decoder's and the embedding's and head's (once when tied), each MoE layer's experts as
        the two stacked tensors it holds in memory (``gate_up_proj`` [E, 2I, H], ``down_proj`` [E, H, I])
        rather than one tensor per expert as stored; the MTP head and a vision tower are not part of it."""
        shapes = [
            t.shape
            for t in self.tensors
            if not t.name.startswith(MTP_PREFIX)
            and not _EXPERT.search(t.name)
            and ("visual" not in t.name)
            and not t.name.endswith("_scale_inv")
        ]
        for layer in self.layers:
            if layer.experts:
                num, _, width = layer.experts
                shapes += [(num, 2 * width, self.hidden_size), (num, self.hidden_size, width)]
        return shapes

    def unit_elements(self) -> list[int]:
        """Elements of each FSDP2 unit as ``distill`` wraps them: every decoder layer, then what is left at
        the top (embedding, head, final norm)."""
        sizes = [layer.parameters for layer in self.layers]
        return sizes + [self.top_elements]

    @property
    def top_elements(self) -> int:
        """The embedding, the head (once when tied) and the final norm."""
        head = 0 if self.tied else self.vocab_size * self.hidden_size
        return self.vocab_size * self.hidden_size + head + self.hidden_size


def _dtype(config: Mapping[str, Any]) -> str:
    name = config_value(config, "dtype") or config_value(config, "torch_dtype") or "bfloat16"
    return _DTYPES.get(str(name).removeprefix("torch."), "BF16")


def _layer_values(text: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The config values of every decoder layer (``per_layer_config`` overrides applied)."""
    keys = [k for k in text if k != "per_layer_config"]
    overrides = per_layer_overrides(text, keys, key="num_hidden_layers")
    return [{**text, **overrides.get(i, {})} for i in range(int(text["num_hidden_layers"]))]


def _layer_types(text: Mapping[str, Any]) -> list[str]:
    types = text.get("layer_types")
    if types:
        return list(types)
    interval = int(text.get("full_attention_interval") or 4)
    return [
        "full_attention" if (i + 1) % interval == 0 else "linear_attention"
        for i in range(text["num_hidden_layers"])
    ]


def _moe(values: Mapping[str, Any], index: int) -> bool:
    if not values.get("num_experts"):
        return False
    if index in (values.get("mlp_only_layers") or ()):
        return False
    step = int(values.get("decoder_sparse_step") or 1)
    return (index + 1) % step == 0


def _layer_tensors(
    prefix: str, values: Mapping[str, Any], kind: str, moe: bool, model_type: str
) -> list[tuple[str, tuple[int, ...]]]:
    """The tensors of one decoder layer (or MTP layer), as the released checkpoints store them."""
    h = int(values["hidden_size"])
    out: list[tuple[str, tuple[int, ...]]] = [
        (f"{prefix}.input_layernorm.weight", (h,)),
        (f"{prefix}.post_attention_layernorm.weight", (h,)),
    ]
    if kind == "linear_attention":
        hk, hv = int(values["linear_num_key_heads"]), int(values["linear_num_value_heads"])
        dk, dv = int(values["linear_key_head_dim"]), int(values["linear_value_head_dim"])
        kernel = int(values.get("linear_conv_kernel_dim") or 4)
        conv = 2 * hk * dk + hv * dv
        g = f"{prefix}.linear_attn"
        if model_type == "qwen3_next":
            out += [
                (f"{g}.in_proj_qkvz.weight", (conv + hv * dv, h)),
                (f"{g}.in_proj_ba.weight", (2 * hv, h)),
            ]
        else:
            out += [
                (f"{g}.in_proj_qkv.weight", (conv, h)),
                (f"{g}.in_proj_z.weight", (hv * dv, h)),
                (f"{g}.in_proj_b.weight", (hv, h)),
                (f"{g}.in_proj_a.weight", (hv, h)),
            ]
        out += [
            (f"{g}.conv1d.weight", (conv, 1, kernel)),
            (f"{g}.dt_bias", (hv,)),
            (f"{g}.A_log", (hv,)),
            (f"{g}.norm.weight", (dv,)),
            (f"{g}.out_proj.weight", (h, hv * dv)),
        ]
    else:
        heads, kv = int(values["num_attention_heads"]), int(values["num_key_value_heads"])
        hd = int(values.get("head_dim") or h // heads)
        a = f"{prefix}.self_attn"
        out += [
            (f"{a}.q_proj.weight", (2 * heads * hd, h)),  # each head's query and output gate
            (f"{a}.k_proj.weight", (kv * hd, h)),
            (f"{a}.v_proj.weight", (kv * hd, h)),
            (f"{a}.o_proj.weight", (h, heads * hd)),
            (f"{a}.q_norm.weight", (hd,)),
            (f"{a}.k_norm.weight", (hd,)),
        ]
    m = f"{prefix}.mlp"
    if moe:
        num, width = int(values["num_experts"]), int(values["moe_intermediate_size"])
        out.append((f"{m}.gate.weight", (num, h)))
        for e in range(num):
            out += [
                (f"{m}.experts.{e}.gate_proj.weight", (width, h)),
                (f"{m}.experts.{e}.up_proj.weight", (width, h)),
                (f"{m}.experts.{e}.down_proj.weight", (h, width)),
            ]
        shared = int(values.get("shared_expert_intermediate_size") or 0)
        if shared:
            out += [
                (f"{m}.shared_expert.gate_proj.weight", (shared, h)),
                (f"{m}.shared_expert.up_proj.weight", (shared, h)),
                (f"{m}.shared_expert.down_proj.weight", (h, shared)),
                (f"{m}.shared_expert_gate.weight", (1, h)),
            ]
    else:
        width = int(values["intermediate_size"])
        out += [
            (f"{m}.gate_proj.weight", (width, h)),
            (f"{m}.up_proj.weight", (width, h)),
            (f"{m}.down_proj.weight", (h, width)),
        ]
    return out


def config_tensors(config: Mapping[str, Any], *, mtp_layers: int | None = None) -> list[Tensor]:
    """The tensors of the text decoder a config describes, named and shaped as the released checkpoints (and
    ``save_pretrained``) store them: experts one tensor each, ``mtp.*`` with ``mtp_layers`` layers (default:
    the config's ``mtp_num_hidden_layers``, else 1), in the config's dtype (default bfloat16)."""
    text = text_config(config)
    model_type = str(config_value(text, "model_type") or config_value(config, "model_type") or "")
    dtype = _dtype(text if config_value(text, "dtype") or config_value(text, "torch_dtype") else config)
    nested = text is not config
    base = "model.language_model" if nested else "model"
    h, vocab = int(text["hidden_size"]), int(text["vocab_size"])
    named: list[tuple[str, tuple[int, ...]]] = [(f"{base}.embed_tokens.weight", (vocab, h))]
    types = _layer_types(text)
    for i, values in enumerate(_layer_values(text)):
        named += _layer_tensors(f"{base}.layers.{i}", values, types[i], _moe(values, i), model_type)
    named.append((f"{base}.norm.weight", (h,)))
    tied = bool(config_value(text, "tie_word_embeddings", config_value(config, "tie_word_embeddings", False)))
    if not tied:
        named.append(("lm_head.weight", (vocab, h)))
    layers = int(config_value(text, "mtp_num_hidden_layers", 1) if mtp_layers is None else mtp_layers)
    if layers:
        named += [("mtp.fc.weight", (h, 2 * h))] + [
            (f"mtp.{n}.weight", (h,)) for n in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm")
        ]
        values = dict(text)
        for j in range(layers):
            named += _layer_tensors(
                f"mtp.layers.{j}", values, "full_attention", bool(values.get("num_experts")), model_type
            )
    return [Tensor(name, shape, dtype) for name, shape in named]


def _layers(text: Mapping[str, Any], tensors: list[Tensor]) -> tuple[LayerFacts, ...]:
    """Every decoder layer's facts: its parameters from the tensors, its widths from the tensors' shapes where
    they hold them (a folder's config may leave keys at transformers' defaults), else from the config."""
    sizes: dict[int, int] = {}
    counts: dict[int, int] = {}
    shapes: dict[int, dict[str, tuple[int, ...]]] = {}
    for t in tensors:
        if t.name.startswith(MTP_PREFIX):
            continue
        match = _LAYER.search(t.name)
        if match:
            i = int(match.group(1))
            sizes[i] = sizes.get(i, 0) + t.numel
            counts[i] = counts.get(i, 0) + 1
            shapes.setdefault(i, {})[t.name[match.end() :]] = t.shape
    types = _layer_types(text)
    return tuple(
        _layer(
            i,
            values,
            types[i] if i < len(types) else "",
            shapes.get(i, {}),
            sizes.get(i, 0),
            counts.get(i, 0),
        )
        for i, values in enumerate(_layer_values(text))
    )


def _find(shapes: Mapping[str, tuple[int, ...]], suffix: str) -> tuple[int, ...] | None:
    return next((shape for name, shape in shapes.items() if name.endswith(suffix)), None)


def _layer(
    i: int, values: Mapping[str, Any], kind: str, shapes: Mapping[str, tuple[int, ...]], size: int, count: int
) -> LayerFacts:
    hidden = int(values["hidden_size"])
    if not kind:
        kind = "linear_attention" if any(".linear_attn." in "." + n for n in shapes) else "full_attention"
    gdn = attention = None
    if kind == "linear_attention":
        conv = _find(shapes, "conv1d.weight")
        gdn = (
            int(values["linear_num_key_heads"]),
            int(values["linear_num_value_heads"]),
            int(values["linear_key_head_dim"]),
            int(values["linear_value_head_dim"]),
            int(conv[-1]) if conv else int(values.get("linear_conv_kernel_dim") or 4),
        )
    else:
        q, k, norm = (
            _find(shapes, "q_proj.weight"),
            _find(shapes, "k_proj.weight"),
            _find(shapes, "q_norm.weight"),
        )
        head_dim = int(norm[0]) if norm else int(values.get("head_dim") or 0)
        if q and k and head_dim:
            heads = int(values.get("num_attention_heads") or q[0] // (2 * head_dim))
            attention = (heads, k[0] // head_dim, head_dim)
        elif values.get("num_attention_heads") and (
            q or not shapes
        ):  # else a layer without attention tensors
            heads = int(values["num_attention_heads"])
            kv = int(values.get("num_key_value_heads") or heads)
            attention = (heads, kv, int(values.get("head_dim") or hidden // heads))
    experts = None
    shared = mlp = 0
    router = _find(shapes, "mlp.gate.weight")
    if router is not None or (_moe(values, i) and not shapes):
        gate = _find(shapes, "experts.0.gate_proj.weight")
        fused = _find(shapes, "experts.gate_up_proj")
        width = gate[0] if gate else fused[1] // 2 if fused else int(values["moe_intermediate_size"])
        num = router[0] if router else int(values["num_experts"])
        experts = (int(num), int(values.get("num_experts_per_tok") or 1), int(width))
        shared_gate = _find(shapes, "shared_expert.gate_proj.weight")
        shared = (
            int(shared_gate[0]) if shared_gate else int(values.get("shared_expert_intermediate_size") or 0)
        )
    else:
        dense = _find(shapes, "mlp.gate_proj.weight")
        mlp = int(dense[0]) if dense else int(values.get("intermediate_size") or 0)
    return LayerFacts(
        index=i,
        kind=kind,
        hidden=hidden,
        parameters=size,
        tensors=count,
        gdn=gdn,
        attention=attention,
        mlp=mlp,
        experts=experts,
        shared_expert=shared,
    )


def _facts(source: str, name: str, config: Mapping[str, Any], tensors: list[Tensor]) -> ModelFacts:
    text = text_config(config)
    tied = bool(config_value(text, "tie_word_embeddings", config_value(config, "tie_word_embeddings", False)))
    decoder = [t for t in tensors if not t.name.startswith(MTP_PREFIX)]
    dtype = (
        max(((sum(1 for t in decoder if t.dtype == d)), d) for d in {t.dtype for t in decoder})[1]
        if decoder
        else "BF16"
    )
    return ModelFacts(
        source=source,
        name=name,
        config=dict(text),
        tensors=tuple(tensors),
        layers=_layers(text, tensors),
        hidden_size=int(text["hidden_size"]),
        vocab_size=int(text["vocab_size"]),
        tied=tied,
        dtype=dtype,
    )


def model_facts(model: str | os.PathLike | Mapping[str, Any]) -> ModelFacts:
    """The facts of ``model``: a checkpoint folder (its headers), a ``config.json`` file or a folder holding only
    one (the tensors its config describes), a config dict, or the name of a recorded family member.

    Raises:
        ValueError (``CheckpointError`` for an unreadable folder): none of these.
    """
    if isinstance(model, Mapping):
        return _facts("config", str(model.get("_name_or_path", "config")), model, config_tensors(model))
    path = Path(model)
    if path.is_dir() and not (path / CONFIG_NAME).is_file():
        raise ValueError(f"{path}: no {CONFIG_NAME} in the folder")
    if path.is_dir() and any(path.glob("*.safetensors")):
        ckpt: Checkpoint = open_checkpoint(path)
        tensors = [Tensor(n, ckpt.tensor(n).shape, ckpt.tensor(n).dtype) for n in ckpt.names]
        return _facts("folder", str(path), ckpt.config, tensors)
    if path.is_dir() or path.is_file():
        file = path / CONFIG_NAME if path.is_dir() else path
        config = read_json(file, ValueError)
        if not isinstance(config, dict):
            raise ValueError(f"{file}: expected a JSON object (a model's config.json)")
        return _facts("config", str(file), config, config_tensors(config))
    try:
        found = member(str(model))
    except ValueError as exc:
        raise ValueError(f"{model}: not a model folder, a config.json nor {exc}") from None
    return _facts("member", found.name, real_config(found), config_tensors(real_config(found)))
