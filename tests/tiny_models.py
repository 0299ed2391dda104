"""Tiny real transformers models with GDN layers, shared by the test suite (see shared/TINY_MODELS.md)."""

from __future__ import annotations

import torch
import transformers

from gdnprune.gated_delta_net import GDNShape
from gdnprune.model.layouts import find_gdn_modules

TEXT = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
)
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32)
VISION = dict(
    depth=1,
    hidden_size=32,
    intermediate_size=64,
    num_heads=2,
    out_hidden_size=64,
    patch_size=4,
    spatial_merge_size=2,
    temporal_patch_size=2,
    num_position_embeddings=16,
)

MODEL_TYPES = ["qwen3_5", "qwen3_5_vl", "qwen3_5_moe", "qwen3_next", "qwen4_exp", "olmo_hybrid"]
LAYOUT_OF = {
    "qwen3_5": "qwen3_5",
    "qwen3_5_vl": "qwen3_5",
    "qwen3_5_moe": "qwen3_5",
    "qwen4_exp": "qwen3_5",
    "qwen3_next": "qwen3_next",
    "olmo_hybrid": "olmo_hybrid",
}


def gdn_kwargs(shape: GDNShape) -> dict:
    return dict(**shape.config_updates(), linear_conv_kernel_dim=4)


def make_config(model_type: str, shape: GDNShape):
    """A tiny config of ``model_type`` with GDN geometry ``shape``."""
    gdn = gdn_kwargs(shape)
    if model_type == "qwen3_5":
        return transformers.Qwen3_5TextConfig(**TEXT, **gdn)
    if model_type == "qwen3_5_vl":
        return transformers.Qwen3_5Config(text_config=dict(**TEXT, **gdn), vision_config=dict(VISION))
    if model_type == "qwen3_5_moe":
        return transformers.Qwen3_5MoeTextConfig(**TEXT, **gdn, **MOE)
    if model_type == "qwen3_next":
        return transformers.Qwen3NextConfig(**TEXT, **gdn, **MOE, decoder_sparse_step=1)
    if model_type == "qwen4_exp":
        text = dict(TEXT, layer_types=["linear_attention", "indexed_attention"] * 2)
        return transformers.Qwen4ExpTextConfig(
            **text,
            **gdn,
            **MOE,
            hc_count=2,
            hc_lowrank=8,
            indexer_n_heads=2,
            indexer_kv_heads=1,
            indexer_head_dim=16,
            indexer_budget=8,
            indexer_compress_ratio=4,
        )
    if model_type == "olmo_hybrid":
        text = {k: v for k, v in TEXT.items() if k != "head_dim"}
        return transformers.OlmoHybridConfig(**text, **gdn, pad_token_id=0, eos_token_id=1)
    raise ValueError(model_type)


MODEL_CLASS = {
    "qwen3_5": "Qwen3_5ForCausalLM",
    "qwen3_5_vl": "Qwen3_5ForConditionalGeneration",
    "qwen3_5_moe": "Qwen3_5MoeForCausalLM",
    "qwen3_next": "Qwen3NextForCausalLM",
    "qwen4_exp": "Qwen4ExpForCausalLM",
    "olmo_hybrid": "OlmoHybridForCausalLM",
}


def build_model(model_type: str, shape: GDNShape, *, seed: int = 0, randomize: bool = True, config=None):
    """A tiny fp32 model in eval mode; GDN parameters get non-trivial random values when ``randomize``."""
    torch.manual_seed(seed)
    config = make_config(model_type, shape) if config is None else config
    model = getattr(transformers, MODEL_CLASS[model_type])(config).eval()
    if randomize:
        randomize_gdn(model, seed=seed)
    return model


def randomize_gdn(model: torch.nn.Module, *, seed: int = 0) -> None:
    """Give every GDN parameter random values (fresh init is nearly symmetric and hides wrong permutations)."""
    g = torch.Generator().manual_seed(seed + 1000)
    with torch.no_grad():
        for _, module in find_gdn_modules(model):
            for name, p in module.named_parameters():
                noise = torch.randn(p.shape, generator=g)
                if name.endswith("norm.weight"):
                    p.copy_(1.0 + 0.5 * noise)
                elif name == "A_log":
                    p.copy_(torch.log(torch.rand(p.shape, generator=g) * 8 + 0.5))
                elif name == "dt_bias":
                    p.copy_(noise)
                else:
                    p.copy_(noise * p.shape[-1] ** -0.5 if p.dim() > 1 else noise)


def gdn_layers(model) -> list[tuple[str, GDNShape]]:
    return [(prefix, GDNShape.from_module(m)) for prefix, m in find_gdn_modules(model)]


def config_for(config, target: GDNShape):
    """A copy of ``config`` with the GDN geometry set to ``target`` (text_config for VL models)."""
    return target.apply_to_config(config)


def clone_state_dict(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@torch.no_grad()
def logits(model, ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids).logits


@torch.no_grad()
def cached_decode_logits(model, ids: torch.Tensor, steps: int) -> torch.Tensor:
    """Prefill ``ids[:, :-steps]`` with a cache, then feed the last ``steps`` tokens one at a time."""
    out = model(input_ids=ids[:, :-steps], use_cache=True)
    cache, logits_seq = out.past_key_values, [out.logits[:, -1]]
    for t in range(ids.shape[1] - steps, ids.shape[1]):
        out = model(input_ids=ids[:, t : t + 1], past_key_values=cache, use_cache=True)
        cache = out.past_key_values
        logits_seq.append(out.logits[:, -1])
    return torch.stack(logits_seq, dim=1)


def synthetic_layer(
    layout,
    shape: GDNShape,
    *,
    prefix: str = "layer",
    hidden: int = 5,
    kernel: int = 3,
    biases: bool = False,
    seed: int = 0,
    dtype=torch.float32,
) -> dict[str, torch.Tensor]:
    """A random state dict holding one GDN layer of ``layout`` (no model needed: fast for property tests)."""
    from gdnprune.model.layouts import get_layout

    g = torch.Generator().manual_seed(seed)
    out = {}
    for rule in get_layout(layout).rules:
        if not rule.required and not biases:
            continue
        n = rule.length(shape)
        dims = {1: (n,), 2: (n, hidden) if rule.axis == 0 else (hidden, n), 3: (n, 1, kernel)}[rule.ndim]
        key = f"{prefix}.{rule.name}" if prefix else rule.name
        out[key] = torch.randn(dims, generator=g).to(dtype)
    return out


def text_config(model):
    """The config the decoder layers are built from (``text_config`` of a vision-language model)."""
    return model.config.get_text_config(decoder=True)


def cut_model(model, targets: dict, permutations: dict | None = None):
    """A copy of ``model`` whose GDN layer ``prefix`` is cut to ``targets[prefix]`` (after
    ``permutations[prefix]``), built by hand: each new GDN module is constructed from a copy of the config
    with that layer's geometry, and its tensors are picked head by head by :func:`reference.hand_cut` (no
    gdnprune index code, no per_layer_config, no load_pretrained involved). The reference that sliced models
    and per-layer checkpoints are compared with."""
    import copy

    from reference import hand_cut_state_dict

    new = copy.deepcopy(model)
    layers = {}
    for prefix, module in find_gdn_modules(new):
        shape = GDNShape.from_module(module)
        target = targets.get(prefix, shape)
        layers[prefix] = (shape, target)
        parent, name = prefix.rsplit(".", 1)
        setattr(
            new.get_submodule(parent),
            name,
            type(module)(config_for(text_config(model), target), module.layer_idx),
        )
    new.load_state_dict(hand_cut_state_dict(dict(model.state_dict()), layers, permutations), strict=True)
    return new.eval()
