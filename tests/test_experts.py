"""Routed experts (issue 23): sort keeps the function; a cut equals the full model with the removed experts
masked out of the router; both storage forms on disk (one tensor per expert, fused 3-D tensors).

The reference is written here from the definition of routing: a forward hook on every router recomputes
its top-k with the logits of the removed experts set to -inf (softmax over the kept experts, the same
renormalisation). No gdnprune code builds it.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from helpers import assert_same, random_dense_model, raw_tensors, token_ids
from tiny_models import cached_decode_logits, logits

from gdnprune import checkpoint as ck
from gdnprune.io.loading import load_pretrained, slice_model
from gdnprune.model.subblock_geometry import block_candidates, orders_to_payload
from gdnprune.model.subblock_shapes import ExpertShape
from gdnprune.model.subblock_surgery import find_model_blocks, random_orders

MOE_TYPES = ["qwen3_5_moe", "qwen3_next"]
pytestmark = [pytest.mark.filterwarnings("ignore::gdnprune.checkpoint.UnsortedInputWarning")]


def _experts(model):
    return [b for b in find_model_blocks(model, ("experts",))]


def _orders(model, seed=3):
    g = torch.Generator().manual_seed(seed)
    return {b.prefix: random_orders(b, generator=g) for b in _experts(model)}


def _masked(model, kept: dict[str, set[int]]):
    """A context: every router of ``model`` routes only among ``kept[prefix]`` (other logits -inf)."""
    handles = []

    def hook_for(keep):
        def hook(router, args, out):
            h = args[0].reshape(-1, router.weight.shape[1])
            logits_ = F.linear(h, router.weight)
            mask = torch.full_like(logits_, float("-inf"))
            mask[:, sorted(keep)] = 0
            probs = torch.softmax(logits_ + mask, dim=-1, dtype=torch.float)
            top, index = torch.topk(probs, router.top_k, dim=-1)
            if getattr(router, "norm_topk_prob", True):
                top = top / top.sum(dim=-1, keepdim=True)
            return logits_, top.to(logits_.dtype), index

        return hook

    class Ctx:
        def __enter__(self):
            for prefix, keep in kept.items():
                handles.append(model.get_submodule(prefix + ".gate").register_forward_hook(hook_for(keep)))
            return model

        def __exit__(self, *exc):
            for h in handles:
                h.remove()

    return Ctx()


@pytest.mark.parametrize("model_type", MOE_TYPES)
def test_sorted_experts_keep_the_function_and_a_cut_equals_masking_the_router(model_type):
    model = random_dense_model(model_type)
    orders = _orders(model)
    ids = token_ids(seed=1)
    full = logits(model, ids)
    assert_same(logits(slice_model(model, None, block_orders=orders), ids), full)

    cut = slice_model(model, None, blocks={"num_experts": 3}, block_orders=orders)
    assert all(b.shape.num_experts == 3 for b in _experts(cut))
    kept = {p: {int(e) for e in o["experts"][:3]} for p, o in orders.items()}
    with _masked(model, kept):
        reference = logits(model, ids)
    assert_same(logits(cut, ids), reference)
    assert (reference - full).abs().max() > 1e-2 * full.abs().max()  # the cut is a real cut
    # a wrong set of experts is caught: keep the complement's first three instead
    wrong = {p: {int(e) for e in o["experts"][1:4]} for p, o in orders.items()}
    with _masked(model, wrong):
        assert (logits(model, ids) - reference).abs().max() > 1e-3 * reference.abs().max()


def _fused_folder(model, folder):
    """A checkpoint with the experts fused (transformers 5's in-memory names), as some tools save it."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True)
    model.config.save_pretrained(folder)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(folder / "model.safetensors"))


@pytest.mark.parametrize("form", ["numbered", "fused"])
@pytest.mark.parametrize("model_type", MOE_TYPES)
def test_on_disk_sort_and_cut_equal_the_masked_router_in_both_storage_forms(tmp_path, model_type, form):
    model = random_dense_model(model_type, seed=2)
    src = tmp_path / "src"
    if form == "fused":
        _fused_folder(model, src)
        assert any(".experts.gate_up_proj" in n for n in raw_tensors(src))
    else:
        model.save_pretrained(src, max_shard_size="20KB")
        assert any(".experts.3.down_proj.weight" in n for n in raw_tensors(src))
    orders = _orders(model, seed=5)
    ids = token_ids(seed=2)
    ck.sort_checkpoint(
        src,
        {"layers": {p: orders_to_payload(o) for p, o in orders.items()}},
        tmp_path / "sorted",
        progress=False,
    )
    assert_same(logits(load_pretrained(tmp_path / "sorted"), ids), logits(model, ids))
    ck.slice_checkpoint(tmp_path / "sorted", tmp_path / "cut", target={"num_experts": 2}, progress=False)
    config = json.loads((tmp_path / "cut" / "config.json").read_text())
    assert config["num_experts"] == 2 and config["num_experts_per_tok"] == 2
    tensors = raw_tensors(tmp_path / "cut")
    if form == "numbered":  # renumbered 0..1, the others gone; bytes are the source expert's
        before = raw_tensors(src)
        assert not any(".experts.2." in n for n in tensors)
        first = next(iter(orders))
        e = int(orders[first]["experts"][1])
        assert (
            tensors[f"{first}.experts.1.down_proj.weight"] == before[f"{first}.experts.{e}.down_proj.weight"]
        )
        index = json.loads((tmp_path / "cut" / "model.safetensors.index.json").read_text())
        assert set(index["weight_map"]) == set(tensors)
    cut = load_pretrained(tmp_path / "cut")
    kept = {p: {int(e) for e in o["experts"][:2]} for p, o in orders.items()}
    with _masked(model, kept):
        reference = logits(model, ids)
    assert_same(logits(cut, ids), reference)


def test_per_layer_expert_counts_load_and_decode_with_a_cache(tmp_path):
    model = random_dense_model("qwen3_5_moe", seed=4)
    src = tmp_path / "src"
    model.save_pretrained(src)
    plan = {
        "format": "gdnprune-plan",
        "version": 2,
        "layers": {b.prefix: {"num_experts": 2 + i % 3} for i, b in enumerate(_experts(model))},
    }
    ck.slice_checkpoint(src, tmp_path / "cut", plan=plan, progress=False)
    config = json.loads((tmp_path / "cut" / "config.json").read_text())
    assert {v.get("num_experts") for v in config["per_layer_config"].values()} - {None}
    cut = load_pretrained(tmp_path / "cut")
    assert [b.shape.num_experts for b in _experts(cut)] == [2, 3, 4, 2]
    ids = token_ids(seed=3, seq=10)
    full = logits(cut, ids)
    assert_same(cached_decode_logits(cut, ids, 4), full[:, -5:])
    kept = {b.prefix: set(range(2 + i % 3)) for i, b in enumerate(_experts(model))}
    with _masked(model, kept):
        assert_same(full, logits(model, ids))


def test_experts_per_token_is_never_above_the_experts_kept(tmp_path):
    model = random_dense_model("qwen3_5_moe")
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        slice_model(model, None, blocks={"num_experts": 1})
    model.save_pretrained(tmp_path / "src")
    with pytest.raises(ValueError, match=r"num_experts 1 < num_experts_per_tok 2"):
        ck.slice_checkpoint(tmp_path / "src", tmp_path / "cut", target={"num_experts": 1}, progress=False)
    assert not (tmp_path / "cut").exists()
    with pytest.raises(ValueError, match="num_experts 5 > 4"):
        ck.slice_checkpoint(tmp_path / "src", tmp_path / "cut", target={"num_experts": 5}, progress=False)


def test_expert_candidates_are_counts_down_to_the_experts_per_token():
    model = random_dense_model("qwen3_5_moe")
    block = _experts(model)[0]
    counts = [c.target.num_experts for c in block_candidates(block, step=1)]
    assert counts == [4, 3, 2]
    state = model.state_dict()
    full = sum(
        v.numel()
        for k, v in state.items()
        if k.startswith(block.prefix + ".experts.") or k == block.prefix + ".gate.weight"
    )
    per_expert = full // 4
    assert [c.params for c in block_candidates(block, step=1)] == [
        4 * per_expert,
        3 * per_expert,
        2 * per_expert,
    ]
    assert isinstance(block.shape, ExpertShape)


def test_fp8_experts_move_with_their_scales(tmp_path):
    from helpers import FP8_BLOCK, quantize
    from safetensors.torch import load_file, save_file

    model = random_dense_model("qwen3_5_moe", seed=6)
    src = tmp_path / "src"
    model.save_pretrained(src)
    state = load_file(src / "model.safetensors")
    for name in [n for n in state if ".mlp.experts." in n]:
        state[name], state[name[: -len("weight")] + "weight_scale_inv"] = quantize(state[name])
    save_file(state, src / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": [FP8_BLOCK, FP8_BLOCK],
    }
    (src / "config.json").write_text(json.dumps(config))
    orders = _orders(model, seed=8)
    scores = {"layers": {p: orders_to_payload(o) for p, o in orders.items()}}
    ck.sort_checkpoint(src, scores, tmp_path / "sorted", progress=False)
    ck.slice_checkpoint(tmp_path / "sorted", tmp_path / "cut", target={"num_experts": 3}, progress=False)
    before, after = raw_tensors(src), raw_tensors(tmp_path / "cut")
    moved = 0
    for prefix, o in orders.items():
        for new, old in enumerate(o["experts"][:3].tolist()):
            for part in ("gate_proj", "up_proj", "down_proj"):
                for suffix in ("weight", "weight_scale_inv"):
                    assert (
                        after[f"{prefix}.experts.{new}.{part}.{suffix}"]
                        == before[f"{prefix}.experts.{old}.{part}.{suffix}"]
                    )
                    moved += 1
        assert f"{prefix}.experts.3.up_proj.weight_scale_inv" not in after
        router = before[f"{prefix}.gate.weight"][2]  # float32 rows of 64: the kept experts' rows, in order
        assert after[f"{prefix}.gate.weight"][2] == b"".join(
            router[e * 256 : (e + 1) * 256] for e in o["experts"][:3]
        )
    assert (
        moved == 4 * 3 * 3 * 2
        and after[next(n for n in after if n.endswith(".experts.0.up_proj.weight"))][0] == "F8_E4M3"
    )


def test_fp8_fused_expert_tensors_are_gathered_with_their_scales(tmp_path):
    """Fused 3-D FP8 experts (``experts.gate_up_proj`` [E, 2I, H] float8_e4m3fn with ``gate_up_proj_scale_inv``
    [E, 2I/B, H/B], transformers' names), written by hand: a sort then ``--num-experts`` keeps exactly the kept
    experts' weights and scales, in the order of the experts kept. Reference: the source tensors indexed here."""
    from helpers import FP8_BLOCK, quantize
    from safetensors.torch import load_file, save_file

    from gdnprune.cli import main

    model = random_dense_model("qwen3_5_moe", seed=7)
    src = tmp_path / "src"
    _fused_folder(model, src)
    state = load_file(src / "model.safetensors")
    fused = [n for n in state if n.endswith((".experts.gate_up_proj", ".experts.down_proj"))]
    assert fused
    for name in fused:
        pairs = [quantize(expert) for expert in state[name]]
        state[name] = torch.stack([q for q, _ in pairs])
        state[name + "_scale_inv"] = torch.stack([s for _, s in pairs])
        assert state[name].dtype == torch.float8_e4m3fn and state[name + "_scale_inv"].shape[0] == 4
    save_file(state, src / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": [FP8_BLOCK, FP8_BLOCK],
    }
    (src / "config.json").write_text(json.dumps(config))
    orders = _orders(model, seed=9)
    ck.sort_checkpoint(
        src,
        {"layers": {p: orders_to_payload(o) for p, o in orders.items()}},
        tmp_path / "sorted",
        progress=False,
    )
    assert (
        main(["slice", str(tmp_path / "sorted"), "--num-experts", "3", "-o", str(tmp_path / "cut"), "-q"])
        == 0
    )
    before, after = load_file(src / "model.safetensors"), load_file(tmp_path / "cut" / "model.safetensors")
    checked = 0
    for prefix, o in orders.items():
        kept = torch.as_tensor(o["experts"][:3])
        for part in ("gate_up_proj", "down_proj"):
            for name in (f"{prefix}.experts.{part}", f"{prefix}.experts.{part}_scale_inv"):
                assert after[name].dtype == before[name].dtype and after[name].shape[0] == 3
                # byte-exact: FP8 compared through its bits
                assert torch.equal(
                    after[name].view(torch.uint8)
                    if after[name].dtype == torch.float8_e4m3fn
                    else after[name],
                    before[name][kept].view(torch.uint8)
                    if before[name].dtype == torch.float8_e4m3fn
                    else before[name][kept],
                )
                checked += 1
        assert torch.equal(after[f"{prefix}.gate.weight"], before[f"{prefix}.gate.weight"][kept])
    assert checked == 4 * len(orders)
    assert json.loads((tmp_path / "cut" / "config.json").read_text())["num_experts"] == 3


def test_per_layer_expert_counts_build_without_transformers_warning(capfd):
    """The MoE head reads the global expert count on purpose (its router loss): transformers' warning that it does
    must not reach the terminal through gdnprune's commands."""
    import logging

    logging.Logger.warning_once.cache_clear()  # transformers warns once per process: another test may have
    model = random_dense_model("qwen3_next", seed=4)
    blocks = {b.prefix: {"num_experts": 2 + i % 3} for i, b in enumerate(_experts(model))}
    cut = slice_model(model, None, blocks=blocks)
    assert [b.shape.num_experts for b in _experts(cut)] == [2 + i % 3 for i in range(len(blocks))]
    assert "Reading global config value" not in capfd.readouterr().err
