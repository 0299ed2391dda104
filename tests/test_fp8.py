"""FP8 block-scaled checkpoints: exact sort and head slicing, refused block-breaking cuts, transformers loading.

The synthetic checkpoints are real tiny models whose large GDN projections are quantised as Qwen's FP8
releases are (``float8_e4m3fn`` weights, float32 ``weight_scale_inv`` per block, ``quantization_config``
with ``weight_block_size`` and ``modules_to_not_convert``), with 4x4 blocks so that a head (8 rows) is two
whole blocks, as a 128-dim head is one 128-row block in the real models.
"""

from __future__ import annotations

import json

import pytest
import torch
import transformers
from helpers import FP8_BLOCK, FP8_SHAPE, FP8_TENSORS, NOT_CONVERTED, dequantize, make_fp8
from safetensors.torch import load_file
from tiny_models import build_model

from gdnprune.checkpoint import inspect_checkpoint, slice_checkpoint, sort_checkpoint
from gdnprune.cli import main
from gdnprune.gated_delta_net import (
    GDNPermutation,
    GDNShape,
    permute_gated_delta_net_state_dict,
    slice_gated_delta_net_state_dict,
)
from gdnprune.model.layouts import find_gdn_modules

pytestmark = pytest.mark.filterwarnings("ignore::gdnprune.checkpoint.UnsortedInputWarning")


def dequantized(folder) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors with every FP8 weight dequantised (float32) and the scales dropped."""
    tensors = load_file(folder / "model.safetensors")
    out = {}
    for name, tensor in tensors.items():
        if name.endswith("weight_scale_inv"):
            continue
        scale = tensors.get(name[: -len("weight")] + "weight_scale_inv")
        out[name] = tensor if scale is None else dequantize(tensor, scale)
    return out


def _permutation(seed: int, block_respecting: bool = True) -> GDNPermutation:
    g = torch.Generator().manual_seed(seed)
    perm = GDNPermutation.random(FP8_SHAPE, generator=g)
    if block_respecting:  # channels move inside their own 4-channel block only
        key_dim = torch.stack(
            [
                torch.cat([torch.randperm(4, generator=g), 4 + torch.randperm(4, generator=g)])
                for _ in range(FP8_SHAPE.num_key_heads)
            ]
        )
        value_dim = torch.cat([torch.randperm(4, generator=g), 4 + torch.randperm(4, generator=g)])
        perm = GDNPermutation(perm.key_groups, perm.value_lanes, key_dim, value_dim)
    return perm


@pytest.fixture(scope="module", params=["qwen3_5", "qwen3_next"])
def source(request, tmp_path_factory):
    return request.param, make_fp8(tmp_path_factory.mktemp("fp8") / request.param, request.param, seed=3)


def _scores(folder, model_type, block_respecting=True):
    prefixes = [p for p, _ in find_gdn_modules(build_model(model_type, FP8_SHAPE))]
    return {
        "layers": {p: _permutation(i, block_respecting).to_score_payload() for i, p in enumerate(prefixes)}
    }


def test_sort_and_head_slices_are_exact_on_fp8(source, tmp_path):
    model_type, src = source
    scores = _scores(src, model_type)
    sort_checkpoint(src, scores, tmp_path / "sorted", progress=False)
    expected = dequantized(src)
    for prefix, payload in scores["layers"].items():
        permute_gated_delta_net_state_dict(
            expected,
            prefix=prefix,
            shape=FP8_SHAPE,
            permutation=GDNPermutation.from_score_payload(payload, FP8_SHAPE),
        )
    got = dequantized(tmp_path / "sorted")
    assert got.keys() == expected.keys()
    assert all(torch.equal(got[k], expected[k]) for k in got)  # bit for bit
    raw = load_file(tmp_path / "sorted" / "model.safetensors")
    assert any(t.dtype == torch.float8_e4m3fn for t in raw.values())
    config = json.loads((tmp_path / "sorted" / "config.json").read_text())
    assert config["quantization_config"]["modules_to_not_convert"] == NOT_CONVERTED
    # whole heads (and whole 4-channel blocks of a head) cut exactly too
    for target in (GDNShape(1, 2, 8, 8), GDNShape(2, 2, 4, 4)):
        out = tmp_path / f"sliced{target.num_key_heads}{target.key_head_dim}"
        slice_checkpoint(tmp_path / "sorted", out, target, progress=False)
        want = dequantized(tmp_path / "sorted")
        for prefix in scores["layers"]:
            slice_gated_delta_net_state_dict(want, prefix=prefix, shape=FP8_SHAPE, target=target)
        have = dequantized(out)
        assert have.keys() == want.keys() and all(torch.equal(have[k], want[k]) for k in have)


def test_transformers_loads_the_sorted_fp8_checkpoint_with_the_same_logits(source, tmp_path):
    model_type, src = source
    sort_checkpoint(src, _scores(src, model_type), tmp_path / "sorted", progress=False)
    x = torch.randint(0, 128, (2, 80), generator=torch.Generator().manual_seed(0))
    logits = []
    for folder in (src, tmp_path / "sorted"):
        model, info = transformers.AutoModelForCausalLM.from_pretrained(folder, output_loading_info=True)
        assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys"))
        with torch.no_grad():
            logits.append(model.eval()(input_ids=x).logits)
    assert (logits[0] - logits[1]).abs().max() < 1e-4


def test_cuts_and_orders_that_break_the_scale_blocks_are_refused(source, tmp_path, capsys):
    model_type, src = source
    out = tmp_path / "out"
    assert main(["slice", str(src), "-o", str(out), "--key-head-dim", "6"]) == 2  # 6 of 8: splits a block
    err = capsys.readouterr().err
    assert "FP8" in err and "4-wide scale tiles" in err and not out.exists()
    (tmp_path / "scores.json").write_text(json.dumps(_scores(src, model_type, block_respecting=False)))
    assert main(["sort", str(src), "--scores", str(tmp_path / "scores.json"), "-o", str(out)]) == 2
    assert "cannot be sorted exactly" in capsys.readouterr().err and not out.exists()


def test_inspect_shows_the_quantisation(source, capsys):
    model_type, src = source
    info = inspect_checkpoint(src)
    layer = info["layers"][0]
    assert set(layer["quantized"]) == {f"{name}.weight" for name in FP8_TENSORS[model_type]}
    assert all(v.startswith("F8_E4M3") for v in layer["quantized"].values())
    assert main(["inspect", str(src)]) == 0
    assert "F8_E4M3" in capsys.readouterr().out


def test_fp8_without_its_config_or_scales_is_refused(tmp_path, capsys):
    src = make_fp8(tmp_path / "m", "qwen3_5")
    config = json.loads((src / "config.json").read_text())
    del config["quantization_config"]
    (src / "config.json").write_text(json.dumps(config))
    assert main(["inspect", str(src)]) == 2
    assert "quant_method fp8" in capsys.readouterr().err


def test_score_reads_an_fp8_checkpoint_and_its_scores_sort_it(tmp_path):
    """On a CPU transformers dequantises FP8 checkpoints as it loads them: scoring works and its prefixes and
    shapes are the checkpoint's, so the scores sort the FP8 checkpoint itself."""
    from helpers import tokenizer_files

    from gdnprune.scoring import GDN_ONLY, score_checkpoint

    src = make_fp8(tmp_path / "m", "qwen3_5", seed=4)
    tokenizer_files(src)
    text = tmp_path / "calib.txt"
    text.write_text(" ".join(["the model sorts heads and slices them"] * 200))
    scores = score_checkpoint(src, text, num_samples=2, seq_len=72, progress=False, blocks=GDN_ONLY)
    assert all(payload["shape"] == FP8_SHAPE.as_dict() for payload in scores["layers"].values())
    # here a head is two 4-channel blocks, and channel orders that mix them cannot be applied exactly (with
    # Qwen's 128-dim heads a head is one 128-row block, and every channel order stays inside it)
    for payload in scores["layers"].values():
        payload["key_dim_order_most_important_first"] = [list(range(8))] * 2
        payload["value_dim_order_most_important_first"] = list(range(8))
    sort_checkpoint(src, scores, tmp_path / "sorted", progress=False)
    assert (tmp_path / "sorted" / "model.safetensors").is_file()


def test_dequantize_writes_the_split_blocks_in_bf16(source, tmp_path, capsys):
    model_type, src = source
    out = tmp_path / "deq"
    assert main(["slice", str(src), "-o", str(out), "--key-head-dim", "6", "--dequantize", "-q"]) == 0
    raw = load_file(out / "model.safetensors")
    config = json.loads((out / "config.json").read_text())
    not_converted = config["quantization_config"]["modules_to_not_convert"]
    expected = dequantized(src)
    target = FP8_SHAPE.replace(key_head_dim=6)
    for prefix, _ in find_gdn_modules(build_model(model_type, FP8_SHAPE)):
        slice_gated_delta_net_state_dict(expected, prefix=prefix, shape=FP8_SHAPE, target=target)
        # the projections that carry q/k rows lose part of a block: BF16 now; out_proj keeps its blocks: FP8
        qk = FP8_TENSORS[model_type][0]
        assert (
            raw[f"{prefix}.{qk}.weight"].dtype == torch.bfloat16
            and f"{prefix}.{qk}.weight_scale_inv" not in raw
        )
        assert f"{prefix}.{qk}" in not_converted
        assert raw[f"{prefix}.out_proj.weight"].dtype == torch.float8_e4m3fn
        got = raw[f"{prefix}.{qk}.weight"].float()
        assert torch.allclose(got, expected[f"{prefix}.{qk}.weight"], rtol=2**-8, atol=0)
    model, info = transformers.AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys"))
    index = out / "model.safetensors.index.json"
    assert not index.exists() or all(
        not k.endswith(f"{FP8_TENSORS[model_type][0]}.weight_scale_inv")
        for k in json.loads(index.read_text())["weight_map"]
    )


def test_the_hidden_size_of_an_fp8_checkpoint_is_cut_in_whole_tiles_or_dequantized(tmp_path, capsys):
    """A cut of the hidden size keeps the FP8 weights (their scales cut with them: a partial last tile keeps
    its scale) and equals the float model cut by hand; an order that moves channels across 4-channel tiles
    is refused, or written in BF16 with ``dequantize``."""
    src = make_fp8(tmp_path / "m", "qwen3_5", seed=3)
    weight = "model.layers.0.linear_attn.in_proj_qkv.weight"
    scale = weight[: -len("weight")] + "weight_scale_inv"
    full = dequantized(src)
    for size in (40, 42):
        slice_checkpoint(src, tmp_path / f"cut{size}", target={"hidden_size": size}, progress=False)
        raw = load_file(tmp_path / f"cut{size}" / "model.safetensors")
        assert raw[weight].dtype == torch.float8_e4m3fn and raw[weight].shape[1] == size
        assert raw[scale].shape[1] == -(-size // FP8_BLOCK)
        for name, tensor in dequantized(
            tmp_path / f"cut{size}"
        ).items():  # the first `size` of every hidden axis
            want = full[name]
            for axis, (a, b) in enumerate(zip(want.shape, tensor.shape)):
                if a != b:
                    want = want.narrow(axis, 0, b)
            assert torch.equal(tensor, want), name
    order = torch.randperm(64, generator=torch.Generator().manual_seed(2)).tolist()
    scores = tmp_path / "scores.json"
    scores.write_text(
        json.dumps(
            {
                "layers": {},
                "hidden": {"shape": {"hidden_size": 64}, "channel_order_most_important_first": order},
            }
        )
    )
    assert main(["sort", str(src), "--scores", str(scores), "-o", str(tmp_path / "x"), "-q"]) == 2
    assert "hidden channels cannot be sorted exactly" in capsys.readouterr().err
    sort_checkpoint(src, json.loads(scores.read_text()), tmp_path / "bf16", dequantize=True, progress=False)
    raw = load_file(tmp_path / "bf16" / "model.safetensors")
    assert raw[weight].dtype == torch.bfloat16 and scale not in raw
    config = json.loads((tmp_path / "bf16" / "config.json").read_text())
    assert "model.layers.0.linear_attn.in_proj_qkv" in config["quantization_config"]["modules_to_not_convert"]
    kept = torch.tensor(order)
    assert torch.allclose(raw[weight].float(), full[weight][:, kept], rtol=2**-8, atol=0)  # BF16 rounding
    out_proj = "model.layers.0.linear_attn.out_proj.weight"
    assert torch.allclose(raw[out_proj].float(), full[out_proj][kept], rtol=2**-8, atol=0)
    _, info = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "bf16", output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys"))
