"""MLP channels and attention heads (issue 21) on disk: streaming sort and slice through the checkpoint
engine, version-2 plans with per-layer sub-block sizes, byte-exact copies of everything else.

References: the full model with the removed channels' / heads' output columns zeroed (built here from the
definition of the orders, Qwen families), and for every family the in-memory cut of
:func:`gdnprune.slice_model`, itself checked against independent references in ``test_dense_axes``.
"""

from __future__ import annotations

import json
import subprocess
import sys
import warnings

import pytest
import torch
from helpers import (
    DENSE,
    DENSE_TARGET,
    MODEL_TYPES,
    assert_same,
    kept_by_orders,
    per_layer_fields,
    random_block_orders,
    random_dense_model,
    raw_tensors,
    zeroed_model,
)
from tiny_models import cached_decode_logits, logits

from gdnprune import checkpoint as ck
from gdnprune.cli import main
from gdnprune.io.loading import load_pretrained, slice_model
from gdnprune.io.plan_file import PlanError
from gdnprune.model.geometry import GDNShape
from gdnprune.model.subblock_geometry import KINDS, orders_to_payload
from gdnprune.model.subblock_surgery import find_model_blocks

pytestmark = [
    pytest.mark.filterwarnings("ignore::gdnprune.checkpoint.UnsortedInputWarning"),
    pytest.mark.filterwarnings("ignore::gdnprune.checkpoint.PassthroughWarning"),
]


def _ids(seed=0, seq=12):
    return torch.randint(0, 128, (2, seq), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """model_type -> (model, its folder with 20 KB shards and mtp.* tensors, random sub-block orders)."""
    from helpers import add_mtp, mtp_tensors

    root = tmp_path_factory.mktemp("dense_sources")
    out = {}
    for i, model_type in enumerate(MODEL_TYPES):
        model = random_dense_model(model_type, seed=i)
        folder = root / model_type
        model.save_pretrained(folder, max_shard_size="20KB")
        add_mtp(folder, mtp_tensors(torch.float32))
        out[model_type] = (model, folder, random_block_orders(model, seed=10 + i))
    return out


def _target(model):
    """The fields of DENSE_TARGET that the model has sub-blocks for."""
    kinds = {b.kind for b in find_model_blocks(model)}
    return {k: v for k, v in DENSE_TARGET.items() if any(k in KINDS[kind].config_keys for kind in kinds)}


def _scores(orders):
    return {"layers": {prefix: orders_to_payload(o) for prefix, o in orders.items()}}


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_sort_then_slice_on_disk_equals_memory_and_the_zeroed_reference(sources, tmp_path, model_type):
    model, src, orders = sources[model_type]
    ck.sort_checkpoint(src, _scores(orders), tmp_path / "sorted", progress=False)
    ids = _ids()
    sorted_model = load_pretrained(tmp_path / "sorted")
    assert_same(logits(sorted_model, ids), logits(model, ids))

    manifest = ck.slice_checkpoint(
        tmp_path / "sorted", tmp_path / "cut", target=_target(model), progress=False
    )
    assert set(manifest["blocks"]) == {b.prefix for b in find_model_blocks(model, DENSE)}
    cut = load_pretrained(tmp_path / "cut")
    memory = slice_model(model, None, blocks=_target(model), block_orders=orders)
    assert_same(logits(cut, ids), logits(memory, ids))
    blocks = [
        b for b in find_model_blocks(model, DENSE) if model_type != "olmo_hybrid" or b.kind != "attention"
    ]
    kept = {b.prefix: (b.kind, kept_by_orders(b, orders[b.prefix], DENSE_TARGET)) for b in blocks}
    if (
        model_type != "olmo_hybrid"
    ):  # OLMo's whole-projection norms: compared with the hand-built model in memory
        assert_same(logits(cut, ids), logits(zeroed_model(model, kept), ids))

    # everything outside the changed blocks is byte for byte the sorted source (GDN layers, norms, mtp.*)
    before, after = raw_tensors(tmp_path / "sorted"), raw_tensors(tmp_path / "cut")
    changed = {f"{b.prefix}.{s}" for b in find_model_blocks(model, DENSE) for s in b.tensors}
    assert set(after) == set(before)
    assert {n for n in before if n not in changed and before[n] != after[n]} == set()
    assert all(before[n][1] != after[n][1] for n in changed)
    assert any(".q_norm." in n for n in before) and all(
        before[n] == after[n] for n in before if ".q_norm." in n and model_type != "olmo_hybrid"
    )


@pytest.mark.parametrize("model_type", ["qwen3_5_vl", "qwen3_next", "olmo_hybrid"])
def test_a_version_2_plan_cuts_every_sub_block_to_its_own_size(sources, tmp_path, model_type):
    model, src, orders = sources[model_type]
    fields = per_layer_fields(model)
    gdn = (
        "model.language_model.layers.0.linear_attn"
        if model_type == "qwen3_5_vl"
        else "model.layers.0.linear_attn"
    )
    plan = {
        "format": "gdnprune-plan",
        "version": 2,
        "layers": {gdn: {"num_key_heads": 1, "num_value_heads": 2}, **fields},
    }
    ck.sort_checkpoint(src, _scores(orders), tmp_path / "sorted", progress=False)
    ck.slice_checkpoint(tmp_path / "sorted", tmp_path / "cut", plan=plan, progress=False)
    config = json.loads((tmp_path / "cut" / "config.json").read_text())
    per_layer = (config.get("text_config") or config)["per_layer_config"]
    assert any("num_attention_heads" in v for v in per_layer.values())
    cut = load_pretrained(tmp_path / "cut")
    memory = slice_model(
        model, {gdn: {"num_key_heads": 1, "num_value_heads": 2}}, blocks=fields, block_orders=orders
    )
    ids = _ids(seed=2, seq=10)
    full = logits(cut, ids)
    assert_same(full, logits(memory, ids))
    assert_same(cached_decode_logits(cut, ids, 4), full[:, -5:])


def test_plans_of_version_1_still_read_and_version_1_refuses_sub_blocks(sources, tmp_path):
    _, src, _ = sources["qwen3_5"]
    v1 = {"format": "gdnprune-plan", "version": 1, "default": {"num_key_heads": 1, "num_value_heads": 2}}
    ck.slice_checkpoint(src, tmp_path / "v1", plan=v1, progress=False)
    assert json.loads((tmp_path / "v1" / "config.json").read_text())["linear_num_key_heads"] == 1
    bad = {
        "format": "gdnprune-plan",
        "version": 1,
        "layers": {"model.layers.1.self_attn": {"num_attention_heads": 2}},
    }
    with pytest.raises(PlanError, match="plan version 1 cuts only GDN layers"):
        ck.slice_checkpoint(src, tmp_path / "bad", plan=bad, progress=False)
    wrong = {
        "format": "gdnprune-plan",
        "version": 2,
        "layers": {"model.layers.1.mlp": {"num_attention_heads": 2}},
    }
    with pytest.raises(
        ValueError,
        match=r"unknown fields \['num_attention_heads'\]; expected some of "
        r"\['intermediate_size'\]",
    ):
        ck.slice_checkpoint(src, tmp_path / "bad", plan=wrong, progress=False)
    assert not (tmp_path / "bad").exists()


def test_errors_name_the_block_and_leave_nothing_behind(sources, tmp_path):
    _, src, _ = sources["qwen3_5"]
    with pytest.raises(
        ck.TargetError, match=r"self_attn: target .* does not fit.*query heads per key-value head"
    ):
        ck.slice_checkpoint(
            src, tmp_path / "out", target={"num_attention_heads": 4, "num_key_value_heads": 1}, progress=False
        )
    with pytest.raises(ck.ScoresError, match="not a permutation"):
        ck.sort_checkpoint(
            src,
            {"layers": {"model.layers.0.mlp": {"channel_order_most_important_first": [0] * 96}}},
            tmp_path / "out",
            progress=False,
        )
    with pytest.raises(ck.ScoresError, match=r"'model.layers.0.self_attn' is not a sub-block"):
        ck.sort_checkpoint(
            src, {"layers": {"model.layers.0.self_attn": {}}}, tmp_path / "out", progress=False
        )
    assert not (tmp_path / "out").exists()


def test_slice_command_cuts_attention_and_mlp_without_torch(sources, tmp_path):
    _, src, _ = sources["qwen3_5_moe"]
    out = tmp_path / "cut"
    script = f"""
import json, sys
from gdnprune.cli import main
from gdnprune.model.geometry import GDNShape
code = main(["slice", {str(src)!r}, "-o", {str(out)!r}, "-q", "--num-attention-heads", "2", "--num-key-value-heads",
             "1", "--shared-expert-intermediate-size", "16"])
print(json.dumps({{"code": code, "loaded": sorted(m for m in ("torch", "transformers") if m in sys.modules)}}))
"""
    result = subprocess.run(
        [sys.executable, "-W", "ignore", "-c", script], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout.strip().splitlines()[-1]) == {"code": 0, "loaded": []}
    config = json.loads((out / "config.json").read_text())
    assert (
        config["num_attention_heads"],
        config["num_key_value_heads"],
        config["head_dim"],
        config["shared_expert_intermediate_size"],
    ) == (2, 1, 16, 16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = load_pretrained(out)
    assert model.model.layers[1].self_attn.q_proj.weight.shape == (2 * 2 * 16, 64)
    assert (
        main(
            [
                "slice",
                str(src),
                "-o",
                str(tmp_path / "x"),
                "-q",
                "--intermediate-size",
                "8",
                "--plan",
                "p.json",
            ]
        )
        == 2
    )


def test_inspect_gives_the_parameters_of_every_kind_of_sub_block(sources, tmp_path):
    for model_type in ("qwen3_5_moe", "olmo_hybrid"):
        model, src, _ = sources[model_type]
        info = ck.inspect_checkpoint(src)
        sd = model.state_dict()
        expected = {
            "attention": sum(v.numel() for k, v in sd.items() if ".self_attn." in k),
            "mlp": sum(
                v.numel()
                for k, v in sd.items()
                if ".mlp." in k
                and ".shared_expert." not in k
                and ".experts." not in k
                and not k.endswith("mlp.gate.weight")
                and "shared_expert_gate" not in k
            ),
            "shared_expert": sum(v.numel() for k, v in sd.items() if ".mlp.shared_expert." in k),
            "experts": sum(
                v.numel() for k, v in sd.items() if ".mlp.experts." in k or k.endswith("mlp.gate.weight")
            ),
        }
        expected = {k: v for k, v in expected.items() if v}
        by_kind = info["parameters_by_kind"]
        assert {k: v for k, v in by_kind.items() if k not in ("gdn", "other")} == expected
        assert sum(by_kind.values()) == info["total_parameters"]
        assert {b["kind"] for b in info["sub_blocks"]} == set(expected)
    from tiny_models import build_model

    build_model("qwen4_exp", GDNShape(2, 4, 8, 8)).save_pretrained(tmp_path / "q4")
    info = ck.inspect_checkpoint(tmp_path / "q4")
    (unsupported,) = [b for b in info["sub_blocks"] if "unsupported" in b]
    assert unsupported["kind"] == "attention" and "indexer" in unsupported["unsupported"]


def test_fp8_attention_heads_move_with_their_scale_blocks_and_split_blocks_are_refused(tmp_path):
    """Heads of 16 rows are four whole 4x4 blocks: a head cut is exact on the FP8 bytes; an MLP channel order
    splits blocks, which is refused (or written in BF16 with dequantize=True)."""
    from helpers import FP8_BLOCK, NOT_CONVERTED, dequantize, quantize
    from safetensors.torch import load_file, save_file

    model = random_dense_model("qwen3_5")
    state = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}
    fp8 = [
        k
        for k in state
        if k.endswith(
            (
                "q_proj.weight",
                "k_proj.weight",
                "v_proj.weight",
                "o_proj.weight",
                "down_proj.weight",
                "gate_proj.weight",
                "up_proj.weight",
            )
        )
    ]
    for name in fp8:
        state[name], state[name[: -len("weight")] + "weight_scale_inv"] = quantize(state[name])
    src = tmp_path / "src"
    model.save_pretrained(src)
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": [FP8_BLOCK, FP8_BLOCK],
        "modules_to_not_convert": [n for n in NOT_CONVERTED if n not in ("self_attn", "mlp")],
    }
    (src / "config.json").write_text(json.dumps(config))
    save_file(state, src / "model.safetensors", metadata={"format": "pt"})

    orders = {"kv_groups": [1, 0], "query_heads": [[1, 0], [0, 1]]}
    attention = ("model.layers.1.self_attn", "model.layers.3.self_attn")
    scores = {"layers": {p: orders_to_payload(orders) for p in attention}}
    ck.sort_checkpoint(src, scores, tmp_path / "sorted", progress=False)
    ck.slice_checkpoint(
        tmp_path / "sorted",
        tmp_path / "cut",
        target={"num_attention_heads": 2, "num_key_value_heads": 1},
        progress=False,
    )
    out = load_file(tmp_path / "cut" / "model.safetensors")
    hd, p = 16, "model.layers.1.self_attn"
    q = dequantize(state[f"{p}.q_proj.weight"], state[f"{p}.q_proj.weight_scale_inv"])
    o = dequantize(state[f"{p}.o_proj.weight"], state[f"{p}.o_proj.weight_scale_inv"])
    k = dequantize(state[f"{p}.k_proj.weight"], state[f"{p}.k_proj.weight_scale_inv"])
    heads = [1 * 2 + 0, 1 * 2 + 1]  # group 1 is kept, its heads in its own order (row 1: [0, 1])
    expected_q = torch.cat([q[h * 2 * hd : (h + 1) * 2 * hd] for h in heads])
    expected_o = torch.cat([o[:, h * hd : (h + 1) * hd] for h in heads], dim=1)
    assert out[f"{p}.q_proj.weight"].dtype == torch.float8_e4m3fn
    assert torch.equal(dequantize(out[f"{p}.q_proj.weight"], out[f"{p}.q_proj.weight_scale_inv"]), expected_q)
    assert torch.equal(dequantize(out[f"{p}.o_proj.weight"], out[f"{p}.o_proj.weight_scale_inv"]), expected_o)
    assert torch.equal(
        dequantize(out[f"{p}.k_proj.weight"], out[f"{p}.k_proj.weight_scale_inv"]), k[hd : 2 * hd]
    )

    swap = [4, 1, 2, 3, 0] + list(range(5, 96))  # channels 0 and 4 sit in different 4-channel blocks
    channels = {"layers": {"model.layers.0.mlp": {"channel_order_most_important_first": swap}}}
    with pytest.raises(
        ck.TargetError, match=r"model.layers.0.mlp is FP8 with 4-wide scale tiles.*dequantize=True"
    ):
        ck.sort_checkpoint(src, channels, tmp_path / "bad", progress=False)
    ck.sort_checkpoint(src, channels, tmp_path / "bf16", progress=False, dequantize=True)
    out = load_file(tmp_path / "bf16" / "model.safetensors")
    assert out["model.layers.0.mlp.down_proj.weight"].dtype == torch.bfloat16
    assert "model.layers.0.mlp.down_proj.weight_scale_inv" not in out
    config = json.loads((tmp_path / "bf16" / "config.json").read_text())
    assert "model.layers.0.mlp.down_proj" in config["quantization_config"]["modules_to_not_convert"]


def test_a_cut_of_attention_warns_that_mtp_layers_keep_their_width(sources, tmp_path):
    _, src, _ = sources["qwen3_5"]  # has mtp.layers.0.self_attn.q_proj.weight (test_checkpoint._mtp_tensors)
    with pytest.warns(ck.PassthroughWarning, match=r"\['mtp.layers.0.self_attn'\] keep their width"):
        ck.slice_checkpoint(src, tmp_path / "cut", target={"num_attention_heads": 2}, progress=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error", ck.PassthroughWarning)
        ck.slice_checkpoint(src, tmp_path / "mlp", target={"intermediate_size": 32}, progress=False)


def test_a_field_that_no_sub_block_has_is_an_error(sources, tmp_path):
    _, src, _ = sources["qwen3_5"]
    with pytest.raises(ck.TargetError, match=r"no shared_expert sub-block \(at layers.N.mlp.shared_expert\)"):
        ck.slice_checkpoint(
            src, tmp_path / "out", target={"shared_expert_intermediate_size": 8}, progress=False
        )
    plan = {"format": "gdnprune-plan", "version": 2, "default": {"shared_expert_intermediate_size": 8}}
    with pytest.raises(ck.TargetError, match="nothing to cut with"):
        ck.slice_checkpoint(src, tmp_path / "out", plan=plan, progress=False)
    assert not (tmp_path / "out").exists()
