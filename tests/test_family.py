"""The recorded Qwen hybrid family (gdnprune.model.family): every value has a source or says why not, the docs
table is generated from it, the real configs add up to the published sizes, and the tiny real-count configs
build transformers models whose counts are the recorded ones."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest
import torch
import transformers

from gdnprune.model import family
from gdnprune.model.family import FIELDS, MEMBERS

ROOT = Path(__file__).resolve().parent.parent


def _doc_script():
    spec = importlib.util.spec_from_file_location("models_doc", ROOT / "scripts" / "models_doc.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _meta_model(config: dict):
    cls = getattr(transformers, config["architectures"][0])
    cfg = cls.config_class(**{k: v for k, v in config.items() if k not in ("architectures", "model_type")})
    with torch.device("meta"):
        return cls(cfg)


def test_every_value_has_a_source_or_says_why_not():
    for m in MEMBERS:
        for key in m.values:
            assert key in FIELDS, (m.name, key)
            assert m.sourced(key) or key in m.stand_ins, f"{m.name}: {key} has neither a source nor a reason"
        assert set(m.stand_ins) <= set(m.values)
        assert all(s.where for s in m.sources)


def test_the_docs_table_is_generated_from_the_table():
    assert _doc_script().main(["--check"]) == 0, (
        "docs/models.md is out of date: run python scripts/models_doc.py"
    )
    text = (ROOT / "docs" / "models.md").read_text()
    for m in MEMBERS:
        assert m.name in text
    assert "16*" in text  # the Qwen3.5-2B's GDN heads: found in no stored source, and marked so


def test_member_lookup():
    assert family.member("qwen/qwen3.5-397b-a17b").name == "Qwen3.5-397B-A17B"
    assert family.member("Qwen/Qwen3-Next-80B-A3B-Instruct").name == "Qwen3-Next-80B-A3B"
    with pytest.raises(ValueError, match="expected one of Qwen3-Next-80B-A3B"):
        family.member("Qwen3.5-1B")


@pytest.mark.parametrize("m", MEMBERS, ids=[m.name for m in MEMBERS])
def test_real_config_adds_up_to_the_published_size(m):
    """The text decoder transformers builds from the real config has the parameters the model's name says, less
    what the table leaves out (the vision tower, the MTP layer), with the name's rounding: within 10 % of it."""
    published = float(re.search(r"-(\d+(?:\.\d+)?)B", m.name).group(1)) * 1e9
    model = _meta_model(family.real_config(m))
    total = sum(p.numel() for p in model.parameters())
    assert 0.9 * published <= total <= 1.1 * published, (m.name, total / 1e9)


@pytest.mark.parametrize("m", MEMBERS, ids=[m.name for m in MEMBERS])
def test_tiny_config_keeps_every_count(m):
    config = family.tiny_config(m)
    model = _meta_model(config)
    real = m.values
    layers = model.model.layers
    assert len(layers) == real["num_hidden_layers"]
    full = [i for i, layer in enumerate(layers) if hasattr(layer, "self_attn")]
    assert full == list(range(real["full_attention_interval"] - 1, real["num_hidden_layers"], 4))
    assert all(hasattr(layer, "linear_attn") for i, layer in enumerate(layers) if i not in full)
    gdn = layers[0].linear_attn
    assert (gdn.num_k_heads, gdn.num_v_heads, gdn.head_k_dim, gdn.head_v_dim) == (
        real["linear_num_key_heads"],
        real["linear_num_value_heads"],
        8,
        8,
    )
    attention = layers[full[0]].self_attn
    assert attention.q_proj.out_features == 2 * real["num_attention_heads"] * 8  # query and its gate
    assert attention.k_proj.out_features == real["num_key_value_heads"] * 8
    assert model.config.hidden_size == 64
    mlp = layers[0].mlp
    if m.moe:
        assert mlp.experts.gate_up_proj.shape == (real["num_experts"], 16, 64)  # 2 x expert width 8
        assert mlp.gate.top_k == real["num_experts_per_tok"]
        assert mlp.shared_expert.gate_proj.out_features == 8
    else:
        assert mlp.gate_proj.out_features == 16
    assert config.get("mtp_num_hidden_layers", 1) == real["mtp_num_hidden_layers"]


def test_scaled_counts():
    m = family.member("Qwen3-Next-80B-A3B")
    for scale, layers, experts in ((1 / 8, 8, 64), (1 / 4, 12, 128), (1 / 2, 24, 256), (1, 48, 512)):
        config = family.tiny_config(m, scale=scale)
        assert (config["num_hidden_layers"], config["num_experts"]) == (layers, experts)
        assert config["layer_types"].count("full_attention") == layers // 4
