"""Layer removal (issue 23): a model with decoder layers removed equals the full model with those layers
skipped in the forward, on disk through the streaming engine, for every family.

The reference is written here: the full model with the removed decoder layers replaced by an identity module
(which returns its hidden states unchanged). No gdnprune code builds it.
"""

from __future__ import annotations

import json

import pytest
import torch
from helpers import (
    add_mtp,
    assert_same,
    mtp_tensors,
    random_dense_model,
    raw_tensors,
    skipped_model,
    token_ids,
)
from tiny_models import cached_decode_logits, logits

from gdnprune import checkpoint as ck
from gdnprune.cli import main
from gdnprune.io.loading import load_pretrained, slice_model
from gdnprune.io.plan_file import PlanError
from gdnprune.model.layer_removal import (
    DepthError,
    compose_names,
    removal_name_map,
    remove_layers_from_config,
)

FAMILIES = ["qwen3_5", "qwen3_5_vl", "qwen3_5_moe", "qwen3_next", "olmo_hybrid"]
pytestmark = [pytest.mark.filterwarnings("ignore::gdnprune.checkpoint.UnsortedInputWarning")]


@pytest.mark.parametrize("model_type", FAMILIES)
def test_removing_layers_equals_skipping_them_in_the_forward(tmp_path, model_type):
    model = random_dense_model(model_type, seed=1)
    src = tmp_path / "src"
    model.save_pretrained(src, max_shard_size="20KB")
    add_mtp(src, mtp_tensors(torch.float32))
    removed = [1, 2]  # a full-attention layer and a GDN layer
    manifest = ck.slice_checkpoint(src, tmp_path / "cut", remove_layers=removed, progress=False)
    assert manifest["removed_layers"] == removed
    config = json.loads((tmp_path / "cut" / "config.json").read_text())
    text = config.get("text_config") or config
    assert text["num_hidden_layers"] == 2 and text["layer_types"] == ["linear_attention", "full_attention"]
    cut = load_pretrained(tmp_path / "cut")
    ids = token_ids(seed=2, seq=10)
    full = logits(cut, ids)
    reference = logits(skipped_model(model, removed), ids)
    assert_same(full, reference)
    assert (reference - logits(model, ids)).abs().max() > 1e-2 * reference.abs().max()
    assert_same(cached_decode_logits(cut, ids, 4), full[:, -5:])
    # mtp.* keeps its names and bytes; layer 3's tensors are layer 1's now, byte for byte
    before, after = raw_tensors(src), raw_tensors(tmp_path / "cut")
    assert {n: v for n, v in after.items() if n.startswith("mtp.")} == {
        n: v for n, v in before.items() if n.startswith("mtp.")
    }
    moved = {
        n: n.replace("layers.3.", "layers.1.")
        for n in before
        if ".layers.3." in n and not n.startswith("mtp.")
    }
    assert moved and all(after[new] == before[old] for old, new in moved.items())
    assert not any(".layers.2." in n or ".layers.3." in n for n in after if not n.startswith("mtp."))
    index = json.loads((tmp_path / "cut" / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(after)


def test_a_depth_pruned_qwen3_5_with_its_mtp_head_generates(tmp_path):
    model = random_dense_model("qwen3_5", seed=3)
    src = tmp_path / "src"
    model.save_pretrained(src)
    add_mtp(src, mtp_tensors(torch.float32))
    assert (
        main(["slice", str(src), "--output", str(tmp_path / "cut"), "--remove-layers", "0", "--quiet"]) == 0
    )
    cut = load_pretrained(tmp_path / "cut")
    ids = token_ids(seed=4, seq=6)[:1]
    out = cut.generate(ids, max_new_tokens=5, do_sample=False)
    assert out.shape == (1, 11)
    greedy = ids
    reference = skipped_model(model, [0])
    for _ in range(5):  # greedy decoding of the skipped-layer reference, by hand
        greedy = torch.cat([greedy, logits(reference, greedy)[:, -1:].argmax(-1)], dim=1)
    assert torch.equal(out, greedy)


def test_removal_with_width_cuts_and_expert_counts_in_one_plan(tmp_path):
    model = random_dense_model("qwen3_5_moe", seed=5)
    src = tmp_path / "src"
    model.save_pretrained(src)
    plan = {
        "format": "gdnprune-plan",
        "version": 2,
        "layers": {
            "model.layers.0": {"removed": True},
            "model.layers.2.linear_attn": {"num_key_heads": 1, "num_value_heads": 2},
            "model.layers.3.mlp": {"num_experts": 3},
            "model.layers.1.mlp": {"num_experts": 2},
        },
    }
    ck.slice_checkpoint(src, tmp_path / "cut", plan=plan, progress=False)
    config = json.loads((tmp_path / "cut" / "config.json").read_text())
    assert config["num_hidden_layers"] == 3
    per_layer = {int(k): v for k, v in config["per_layer_config"].items()}
    assert config["linear_num_value_heads"] == 2  # old layer 2, the only GDN layer left
    # new layers 0, 1, 2 (old 1, 2, 3) keep 2, 4, 3 experts: the global key holds the first, the others differ
    assert config["num_experts"] == 2
    assert {i: v["num_experts"] for i, v in per_layer.items() if "num_experts" in v} == {1: 4, 2: 3}
    cut = load_pretrained(tmp_path / "cut")
    memory = slice_model(
        model,
        {"model.layers.2.linear_attn": {"num_key_heads": 1, "num_value_heads": 2}},
        blocks={"model.layers.3.mlp": {"num_experts": 3}, "model.layers.1.mlp": {"num_experts": 2}},
    )
    ids = token_ids(seed=6, seq=10)
    full = logits(cut, ids)
    assert_same(full, logits(skipped_model(memory, [0]), ids))
    assert_same(cached_decode_logits(cut, ids, 3), full[:, -4:])


def test_wrong_removals_are_refused_before_anything_is_written(tmp_path, capsys):
    model = random_dense_model("qwen3_5")
    model.save_pretrained(tmp_path / "src")
    assert model.config.layer_types[1] == model.config.layer_types[3] == "full_attention"
    for removed, message in (
        ([4], "0..3"),
        ([0, 1, 2, 3], "all 4"),
        ([1, 1], "repeated"),
        ([1, 3], "every full-attention layer"),
        ([0, 1, 3], "every full-attention layer"),
    ):
        with pytest.raises(DepthError, match=message):
            ck.slice_checkpoint(tmp_path / "src", tmp_path / "cut", remove_layers=removed, progress=False)
        assert not (tmp_path / "cut").exists()
    assert (
        main(["slice", str(tmp_path / "src"), "--output", str(tmp_path / "cut"), "--remove-layers", "a"]) == 2
    )
    assert (
        main(["slice", str(tmp_path / "src"), "--output", str(tmp_path / "cut"), "--remove-layers", "3,1"])
        == 2
    )
    assert "full-attention" in capsys.readouterr().err and not (tmp_path / "cut").exists()
    with pytest.raises(PlanError, match="removed"):
        ck.slice_checkpoint(
            tmp_path / "src",
            tmp_path / "cut",
            plan={"format": "gdnprune-plan", "version": 2, "layers": {"model.layers.1": {"removed": "yes"}}},
            progress=False,
        )


def test_names_and_configs_of_a_removal_by_hand():
    names = [
        "model.layers.0.a",
        "model.layers.1.a",
        "model.layers.2.mlp.experts.0.w",
        "mtp.layers.0.a",
        "model.norm.weight",
        "model.visual.blocks.1.w",
    ]
    assert removal_name_map(names, 3, [1]) == {
        "model.layers.1.a": None,
        "model.layers.2.mlp.experts.0.w": "model.layers.1.mlp.experts.0.w",
    }
    experts = {
        "model.layers.2.mlp.experts.3.w": "model.layers.2.mlp.experts.0.w",
        "model.layers.2.mlp.experts.0.w": None,
    }
    composed = compose_names(experts, removal_name_map([*names, "model.layers.2.mlp.experts.3.w"], 3, [1]))
    assert composed == {
        "model.layers.1.a": None,
        "model.layers.2.mlp.experts.3.w": "model.layers.1.mlp.experts.0.w",
        "model.layers.2.mlp.experts.0.w": None,
    }
    config = {
        "num_hidden_layers": 4,
        "layer_types": ["a", "b", "c", "d"],
        "num_experts": 8,
        "decoder_sparse_step": 2,
        "mlp_only_layers": [3],
        "per_layer_config": {"0": {"x": 1}, "2": {"x": 2}, "3": {"x": 3}},
    }
    out = remove_layers_from_config(config, [0])
    assert out["num_hidden_layers"] == 3 and out["layer_types"] == ["b", "c", "d"]
    assert out["per_layer_config"] == {"1": {"x": 2}, "2": {"x": 3}}
    # sparse: layers 1 (step 2) only, layer 3 is dense by mlp_only_layers -> new 0 sparse, new 1 and 2 dense
    assert out["decoder_sparse_step"] == 1 and out["mlp_only_layers"] == [1, 2]
