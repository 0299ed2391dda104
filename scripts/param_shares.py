#!/usr/bin/env python
"""Where the parameters of a GDN hybrid are: the share of GDN layers, full attention, MLPs (dense MLP,
MoE shared experts, routed experts, and the routed experts a token uses), embeddings and LM head.

Computed from ``config.json`` values alone, by direct formulas (:func:`param_counts`); ``tests/test_param_shares.py``
checks them against the parameter count of tiny transformers models built from the same configs, for every
family. Applied to the benchmark models (their configs built with ``scripts/train_demo_model.py``'s
``model_config``) and to public releases (their values below, with where they were found). Counts the text
model: the vision tower of the VL releases and the multi-token-prediction (``mtp.*``) layer that some releases
ship are not part of it (transformers' causal LM does not build them).

    python scripts/param_shares.py            # the table (markdown) of docs/benchmarks/orders.md
"""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]

#: the columns of the table, in order (``routed_active``: what a token uses of the routed experts)
KINDS = ("gdn", "attention", "dense_mlp", "shared_expert", "routed_experts", "embeddings", "lm_head", "other")


def _text(config: Mapping[str, Any]) -> Mapping[str, Any]:
    """The language model's config: ``text_config`` of a VL config, else the config itself."""
    return config.get("text_config") or config


def layer_types(config: Mapping[str, Any]) -> list[str]:
    """``layer_types``, or every ``full_attention_interval``-th layer full attention (Qwen's default, 4)."""
    c = _text(config)
    if c.get("layer_types"):
        return list(c["layer_types"])
    interval = c.get("full_attention_interval", 4)
    return [
        "full_attention" if (i + 1) % interval == 0 else "linear_attention"
        for i in range(c["num_hidden_layers"])
    ]


def _sparse(config: Mapping[str, Any], i: int) -> bool:
    """Whether decoder layer ``i`` has routed experts (Qwen3-Next: ``mlp_only_layers``, ``decoder_sparse_step``)."""
    c = _text(config)
    if not c.get("num_experts"):
        return False
    family = config.get("model_type", "")
    if family.startswith("qwen3_5_moe"):
        return True
    return i not in (c.get("mlp_only_layers") or []) and (i + 1) % (c.get("decoder_sparse_step") or 1) == 0


def param_counts(config: Mapping[str, Any]) -> dict[str, float]:
    """Parameters per kind (:data:`KINDS`), ``total`` and ``active`` (per token: routed experts count
    ``num_experts_per_tok / num_experts`` of theirs), from a ``config.json`` dict (Qwen3.5, Qwen3.5-MoE, their VL
    configs, Qwen3-Next, OLMo-hybrid).

    Per layer: GDN ``h*(2*Hk*dk + 2*Hv*dv) + 2*h*Hv`` (q, k, v, z or g; a, b) ``+ (2*Hk*dk + Hv*dv)*K`` (the
    depthwise conv) ``+ Hv*dv*h`` (out) ``+ 2*Hv + dv`` (A_log, dt_bias, the per-head-dim norm); Qwen's gated
    attention ``h*2*nq*hd + 2*h*nkv*hd + nq*hd*h + 2*hd`` (q_proj holds the output gate; per-head-dim norms),
    OLMo's ``h*nq*hd + 2*h*nkv*hd + nq*hd*h + nq*hd + nkv*hd`` (norms over the whole projections); a gated MLP
    ``3*h*I``; routed experts ``E*3*h*I_e`` and their router ``E*h``; the shared expert ``3*h*I_s`` and its gate
    ``h``; two norms of ``h`` per layer and the final norm; embeddings ``V*h``, an untied LM head ``V*h``.
    """
    c = _text(config)
    olmo = config.get("model_type", "").startswith("olmo")
    h, vocab = c["hidden_size"], c["vocab_size"]
    nq, nkv = c["num_attention_heads"], c["num_key_value_heads"]
    hd = c.get("head_dim") or h // nq
    hk, hv, dk, dv = (
        c["linear_num_key_heads"],
        c["linear_num_value_heads"],
        c["linear_key_head_dim"],
        c["linear_value_head_dim"],
    )
    kernel = c.get("linear_conv_kernel_dim", 4)
    key, value = hk * dk, hv * dv
    gdn = h * (2 * key + 2 * value) + 2 * h * hv + (2 * key + value) * kernel + value * h + 2 * hv + dv
    if olmo:
        attention = h * nq * hd + 2 * h * nkv * hd + nq * hd * h + nq * hd + nkv * hd
    else:
        attention = h * 2 * nq * hd + 2 * h * nkv * hd + nq * hd * h + 2 * hd
    counts = dict.fromkeys(KINDS, 0.0)
    routed_active = 0.0
    for i, kind in enumerate(layer_types(config)):
        counts["gdn" if kind == "linear_attention" else "attention"] += (
            gdn if kind == "linear_attention" else attention
        )
        counts["other"] += 2 * h
        if _sparse(config, i):
            experts, k = c["num_experts"], c["num_experts_per_tok"]
            routed = experts * 3 * h * c["moe_intermediate_size"]
            counts["routed_experts"] += routed
            routed_active += routed * k / experts
            counts["other"] += experts * h  # the router
            if c.get("shared_expert_intermediate_size"):
                counts["shared_expert"] += 3 * h * c["shared_expert_intermediate_size"] + h
        else:
            counts["dense_mlp"] += 3 * h * c["intermediate_size"]
    counts["other"] += h  # the final norm
    counts["embeddings"] = vocab * h
    tied = config.get("tie_word_embeddings", c.get("tie_word_embeddings", False))
    counts["lm_head"] = 0 if tied else vocab * h
    counts["total"] = sum(counts[k] for k in KINDS)
    counts["routed_active"] = routed_active
    counts["active"] = counts["total"] - counts["routed_experts"] + routed_active
    return counts


# ---- public releases: config.json values and where they were found --------------------------------------------
#
# - Qwen3-Next-80B-A3B: transformers 5.23's Qwen3NextConfig defaults, which its docstring gives as the
#   configuration of Qwen/Qwen3-Next-80B-A3B-Instruct (models/qwen3_next/configuration_qwen3_next.py); the
#   same values in a published copy of the release's config.json (code search: "Qwen/Qwen3-Next-80B-A3B-Instruct
#   model config": hidden 2048, head_dim 256, linear heads 16 / 32 of 128, moe_intermediate_size 512,
#   mlp_only_layers [], decoder_sparse_step 1) and in THUDM/slime scripts/models/qwen3-next-80B-A3B.sh (48 layers,
#   16 / 2 heads, 512 experts, 10 per token, shared expert 512, vocabulary 151936, untied embeddings).
#   Every layer is sparse, so the dense intermediate_size is unused.
# - Qwen3.5-27B: its model card as quoted in benchmarks/distill_scale.py (64 layers, hidden 5120, FFN 17408,
#   24 Q / 4 KV heads of 256, Gated DeltaNet 16 QK / 48 V heads of 128, vocabulary 248320); layers, widths, heads
#   and the untied embeddings also in THUDM/slime scripts/models/qwen3.5-27B.sh.
# - Qwen3.5-35B-A3B: THUDM/slime scripts/models/qwen3.5-35B-A3B.sh (40 layers, hidden 2048, 16 / 2 heads of
#   256, 256 experts of 512, 8 per token, shared expert 512, linear heads 16 / 32 of 128, vocabulary 248320,
#   untied); the same values are transformers 5.23's Qwen3_5MoeTextConfig defaults, documented as
#   Qwen/Qwen3.5-35B-A3B.
# - Qwen3.5-122B-A10B: its model card as quoted in benchmarks/distill_scale.py (48 layers, hidden 3072, 256
#   experts of 1024, 8 per token, shared 1024, 32 / 2 heads of 256, linear heads 16 / 64 of 128, vocabulary
#   248320); the same values in public engine configs found by code search (a test script's
#   "run_qwen3_5_moe_122B" config, an adapter's EXPECTED values for qwen3.5-122b-a10b; the index does not name
#   their repositories).
# - Qwen3.5-397B-A17B: THUDM/slime scripts/models/qwen3.5-397B-A17B.sh (60 layers, hidden 4096, 32 / 2 heads
#   of 256, 512 experts of 1024, 10 per token, shared 1024, vocabulary 248320, untied); the linear heads
#   (16 / 64 of 128) from public engine configs found by code search that quote the release (four agree on
#   every value above; the index does not name their repositories).
# Not found with all values from consistent sources: the small dense Qwen3.5 releases (0.8B, 2B, 4B, 9B):
# slime gives 0.8B's widths but not its linear heads, and the 4B's quoted configs disagree (16 vs 20 query
# heads, linear key head dim 128 vs 192), so they are left out rather than guessed.
_QWEN35 = dict(
    vocab_size=248320,
    head_dim=256,
    linear_key_head_dim=128,
    linear_value_head_dim=128,
    linear_conv_kernel_dim=4,
    linear_num_key_heads=16,
    full_attention_interval=4,
    tie_word_embeddings=False,
)
PUBLIC = {
    "Qwen3-Next-80B-A3B": dict(
        model_type="qwen3_next",
        vocab_size=151936,
        hidden_size=2048,
        intermediate_size=5120,
        num_hidden_layers=48,
        num_attention_heads=16,
        num_key_value_heads=2,
        head_dim=256,
        linear_num_key_heads=16,
        linear_num_value_heads=32,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        linear_conv_kernel_dim=4,
        full_attention_interval=4,
        num_experts=512,
        num_experts_per_tok=10,
        moe_intermediate_size=512,
        shared_expert_intermediate_size=512,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        tie_word_embeddings=False,
    ),
    "Qwen3.5-27B": dict(
        model_type="qwen3_5_text",
        **_QWEN35,
        hidden_size=5120,
        intermediate_size=17408,
        num_hidden_layers=64,
        num_attention_heads=24,
        num_key_value_heads=4,
        linear_num_value_heads=48,
    ),
    "Qwen3.5-35B-A3B": dict(
        model_type="qwen3_5_moe_text",
        **_QWEN35,
        hidden_size=2048,
        num_hidden_layers=40,
        num_attention_heads=16,
        num_key_value_heads=2,
        linear_num_value_heads=32,
        num_experts=256,
        num_experts_per_tok=8,
        moe_intermediate_size=512,
        shared_expert_intermediate_size=512,
    ),
    "Qwen3.5-122B-A10B": dict(
        model_type="qwen3_5_moe_text",
        **_QWEN35,
        hidden_size=3072,
        num_hidden_layers=48,
        num_attention_heads=32,
        num_key_value_heads=2,
        linear_num_value_heads=64,
        num_experts=256,
        num_experts_per_tok=8,
        moe_intermediate_size=1024,
        shared_expert_intermediate_size=1024,
    ),
    "Qwen3.5-397B-A17B": dict(
        model_type="qwen3_5_moe_text",
        **_QWEN35,
        hidden_size=4096,
        num_hidden_layers=60,
        num_attention_heads=32,
        num_key_value_heads=2,
        linear_num_value_heads=64,
        num_experts=512,
        num_experts_per_tok=10,
        moe_intermediate_size=1024,
        shared_expert_intermediate_size=1024,
    ),
}


def benchmark_configs() -> dict[str, dict]:
    """The bundled demo model's config.json and the benchmark models' configs (``train_demo_model.model_config``
    with the demo's byte tokenizer: 257 tokens, end of text 256)."""
    sys.path.insert(0, str(ROOT / "scripts"))
    from train_demo_model import model_config

    demo = json.loads((ROOT / "src" / "gdnprune" / "data" / "demo_model" / "config.json").read_text())
    deep = model_config(257, 256, layer_types="GGGAGGGA", key_heads=2, value_heads=8).to_dict()
    moe = model_config(
        257,
        256,
        family="qwen3_5_moe",
        layer_types="GGGA",
        num_experts=16,
        experts_per_token=2,
        expert_size=64,
    ).to_dict()
    return {
        "demo model (bundled)": demo,
        "deeper benchmark model (GGGAGGGA)": deep,
        "MoE benchmark model (16 experts, 2 per token)": moe,
    }


def _size(n: float) -> str:
    return f"{n / 1e9:.1f}B" if n >= 1e9 else f"{n / 1e6:.2f}M"


def table(configs: Mapping[str, Mapping]) -> str:
    """A markdown table: parameters (all, active per token) and the share of each kind in all of them."""
    head = (
        "| model | params | active | GDN | attention | dense MLP | shared experts | routed experts | "
        "routed, active | embeddings | LM head | other |"
    )
    lines = [head, "|---|" + "---:|" * (head.count("|") - 2)]
    for name, config in configs.items():
        c = param_counts(config)
        share = lambda k, c=c: f"{c[k] / c['total']:.1%}" if c[k] else "–"  # noqa: E731
        lines.append(
            f"| {name} | {_size(c['total'])} | {_size(c['active'])} | {share('gdn')} | {share('attention')} "
            f"| {share('dense_mlp')} | {share('shared_expert')} | {share('routed_experts')} | "
            f"{share('routed_active')} | {share('embeddings')} | {share('lm_head')} | {share('other')} |"
        )
    return "\n".join(lines)


def active_table(configs: Mapping[str, Mapping]) -> str:
    """A markdown table of the MoE models: the share of each kind in the parameters a token uses."""
    head = "| model | active | GDN | attention | shared experts | routed experts (active) | embeddings + LM head | other |"
    lines = [head, "|---|" + "---:|" * (head.count("|") - 2)]
    for name, config in configs.items():
        c = param_counts(config)
        if not c["routed_experts"]:
            continue
        share = lambda v, c=c: f"{v / c['active']:.1%}"  # noqa: E731
        lines.append(
            f"| {name} | {_size(c['active'])} | {share(c['gdn'])} | {share(c['attention'])} | "
            f"{share(c['shared_expert'])} | {share(c['routed_active'])} | "
            f"{share(c['embeddings'] + c['lm_head'])} | {share(c['other'])} |"
        )
    return "\n".join(lines)


def main() -> int:
    configs = {**benchmark_configs(), **PUBLIC}
    print(table(configs))
    print(
        "\nShares of all parameters; 'routed, active': the routed experts a token uses (num_experts_per_tok / "
        "num_experts of them); 'other': norms and MoE routers. Text model only (no vision tower, no mtp.* layer)."
    )
    print("\nShares of the parameters a token uses (MoE models):\n")
    print(active_table(configs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
