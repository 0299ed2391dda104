"""scripts/param_shares.py: its per-kind parameter formulas (from config.json values alone) against the
parameters of tiny transformers models built from the same configs, every family; kinds by module name."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import transformers
from tiny_models import MODEL_CLASS, make_config

from gdnprune.model.geometry import GDNShape

_SPEC = importlib.util.spec_from_file_location(
    "param_shares", Path(__file__).parents[1] / "scripts" / "param_shares.py"
)
shares = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(shares)


def _kind(name: str) -> str:
    if ".linear_attn." in name:
        return "gdn"
    if ".self_attn." in name:
        return "attention"
    if ".mlp.experts." in name:
        return "routed_experts"
    if ".mlp.shared_expert" in name:  # the shared expert and its gate
        return "shared_expert"
    if ".mlp.gate." in name:
        return "other"  # the router
    if ".mlp." in name:
        return "dense_mlp"
    if "embed_tokens" in name:
        return "embeddings"
    if name.startswith("lm_head"):
        return "lm_head"
    return "other"  # norms


def _counted(model) -> dict[str, int]:
    """Parameters per kind of the text model (the vision tower of a VL model left out), a tied tensor once."""
    out = dict.fromkeys(shares.KINDS, 0)
    for name, p in model.named_parameters():
        if ".visual." in name or name.startswith("model.visual"):
            continue
        out[_kind(name)] += p.numel()
    return out


CASES = {
    "qwen3_5": {},
    "qwen3_5_vl": {},
    "qwen3_5_moe": {},
    "qwen3_next": {},
    "olmo_hybrid": {},
    "qwen3_next_mixed": {
        "mlp_only_layers": [0],
        "decoder_sparse_step": 2,
    },  # dense MLPs between sparse layers
    "qwen3_5_tied": {"tie_word_embeddings": True},
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_formulas_equal_the_parameters_of_a_model_built_from_the_config(case):
    family = {"qwen3_next_mixed": "qwen3_next", "qwen3_5_tied": "qwen3_5"}.get(case, case)
    config = make_config(family, GDNShape(2, 6, 8, 12))
    config.linear_conv_kernel_dim = 3
    for key, value in CASES[case].items():
        setattr(config.get_text_config(decoder=True) if key != "tie_word_embeddings" else config, key, value)
        if key == "tie_word_embeddings":
            config.get_text_config(decoder=True).tie_word_embeddings = value
    model = getattr(transformers, MODEL_CLASS[family])(config)
    expected = _counted(model)
    computed = shares.param_counts(config.to_dict())
    assert {k: computed[k] for k in shares.KINDS} == expected
    text = sum(expected.values())
    assert computed["total"] == text
    if family in ("qwen3_5_moe", "qwen3_next"):
        assert expected["routed_experts"] > 0 and computed["active"] < text
        c = config.get_text_config(decoder=True)
        assert computed["active"] == text - expected["routed_experts"] * (
            1 - c.num_experts_per_tok / c.num_experts
        )
    if case == "qwen3_next_mixed":
        assert expected["dense_mlp"] > 0 and expected["routed_experts"] > 0
    if case == "qwen3_5_tied":
        assert expected["lm_head"] == 0 and computed["lm_head"] == 0


def test_the_table_lists_the_benchmark_models_and_the_public_releases():
    configs = {**shares.benchmark_configs(), **shares.PUBLIC}
    text = shares.table(configs)
    assert all(name in text for name in configs)
    # sanity of the values: the releases' names give total and active parameters (rounded; active here without
    # embeddings and head)
    for name, total, active in (
        ("Qwen3-Next-80B-A3B", 80e9, 3e9),
        ("Qwen3.5-35B-A3B", 35e9, 3e9),
        ("Qwen3.5-122B-A10B", 122e9, 10e9),
        ("Qwen3.5-397B-A17B", 397e9, 17e9),
    ):
        c = shares.param_counts(shares.PUBLIC[name])
        assert abs(c["total"] / total - 1) < 0.05, (name, c["total"])
        assert abs((c["active"] - c["embeddings"] - c["lm_head"]) / active - 1) < 0.25, (name, c["active"])
