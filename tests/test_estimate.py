"""``gdnprune estimate`` and its parts, against references that are not the estimate: the files transformers
writes (the tensor table), the memory model fed from meta-device models (the memory from headers), the plan's
own candidate generators (the candidate counts), and the real-count writer against ``save_pretrained``."""

from __future__ import annotations

import dataclasses
import json
from fractions import Fraction
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from gdnprune.checkpoint import open_checkpoint
from gdnprune.cli import main
from gdnprune.distill.memory import estimate_memory, meta_model
from gdnprune.estimate.devices import DEVICES, Device
from gdnprune.estimate.inventory import config_tensors, model_facts
from gdnprune.estimate.memory import distill_memory, trained_shapes
from gdnprune.estimate.stages import RunOptions, plan_candidates, stage_costs
from gdnprune.model.family import member, tiny_config
from gdnprune.model.subblock_geometry import block_candidates, find_blocks
from gdnprune.plan.measure.candidates import layer_candidates
from gdnprune.scale_models import build_model, write_model

#: one member of each model type, at a few layers and experts
TYPES = {
    "qwen3_next": "Qwen3-Next-80B-A3B",
    "qwen3_5_text": "Qwen3.5-4B",
    "qwen3_5_moe_text": "Qwen3.5-35B-A3B",
}


def _small(name: str) -> dict:
    return tiny_config(name, scale=1 / 16)  # 4 layers (one full attention), 16 or 32 experts


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """Per model type: the folder transformers' save_pretrained writes, and the one write_model writes."""
    root = tmp_path_factory.mktemp("estimate")
    out = {}
    for model_type, name in TYPES.items():
        config = _small(name)
        saved = root / f"{model_type}_saved"
        build_model(config, seed=3).save_pretrained(saved)
        out[model_type] = (config, saved, write_model(config, root / f"{model_type}_written", seed=3))
    return out


@pytest.mark.parametrize("model_type", TYPES)
def test_config_tensors_are_the_tensors_transformers_writes(folders, model_type):
    config, saved, _ = folders[model_type]
    ckpt = open_checkpoint(saved)
    written = {n: ckpt.tensor(n).shape for n in ckpt.names}
    table = {t.name: t.shape for t in config_tensors(config, mtp_layers=0)}
    assert table == written


@pytest.mark.parametrize("model_type", TYPES)
def test_write_model_stores_what_save_pretrained_stores_and_an_mtp_head(folders, model_type):
    config, saved, written = folders[model_type]
    reference = load_file(saved / "model.safetensors")
    ours = {}
    for file in sorted(written.glob("*.safetensors")):
        ours.update(load_file(file))
    mtp = {k for k in ours if k.startswith("mtp.")}
    assert set(ours) - mtp == set(reference)
    assert all(torch.equal(ours[k], reference[k]) for k in reference)
    assert {k for k in mtp if ".layers.0." not in k} == {
        "mtp.fc.weight",
        "mtp.norm.weight",
        "mtp.pre_fc_norm_embedding.weight",
        "mtp.pre_fc_norm_hidden.weight",
    }
    index = json.loads((written / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(ours)
    # the folder's inventory is the config's table, MTP head included
    facts = model_facts(written)
    assert {t.name: t.shape for t in facts.tensors} == {t.name: t.shape for t in config_tensors(config)}


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"processes": 2, "fsdp": True, "teacher_sharded": True},
        {"processes": 2, "gradient_checkpointing": True, "micro_batch_size": 3, "seq_len": 40},
    ],
)
def test_memory_from_headers_is_the_memory_from_meta_models(folders, options):
    for model_type in ("qwen3_next", "qwen3_5_text"):
        _, _, folder = folders[model_type]
        meta = meta_model(folder)
        expected = estimate_memory(meta, meta, **options)
        shapes = trained_shapes(model_facts(folder))
        assert distill_memory(shapes, shapes, **options) == expected, model_type


@pytest.mark.parametrize("model_type", TYPES)
def test_plan_candidates_are_the_plans(folders, model_type):
    from gdnprune.checkpoint import find_gdn_layers

    _, _, folder = folders[model_type]
    ckpt = open_checkpoint(folder)
    facts = model_facts(folder)
    for step in (Fraction(1, 8), Fraction(1, 2), Fraction(4)):
        expected = [1] * len(facts.layers)  # each layer's removal
        for layer in find_gdn_layers(ckpt)[0]:
            shapes = {s: t.shape for s, t in layer.tensors.items()}
            n = len(layer_candidates(layer.prefix, layer.shape, shapes, layer.layout, 4, dim_step=step))
            expected[int(layer.prefix.split(".")[2])] += n
        shapes = {n: ckpt.tensor(n).shape for n in ckpt.names}
        for block in find_blocks(shapes, ckpt.config):
            expected[int(block.prefix.split(".")[2])] += len(block_candidates(block))
        assert plan_candidates(facts, RunOptions(dim_step=step)) == expected, step


def test_estimate_answers_for_a_model_not_on_disk(capsys, tmp_path):
    config = tmp_path / "config.json"
    config.write_text(json.dumps(tiny_config("Qwen3.5-397B-A17B")))
    assert main(["estimate", str(config), "--stages", "score,plan,distill"]) == 0
    small = capsys.readouterr().out
    assert "60 layers, 30,720 routed experts" in small and "config only" in small
    assert (
        main(["estimate", "Qwen3.5-397B-A17B", "--device", "cuda", "--gpu", "h100", "--dtype", "bfloat16"])
        == 0
    )
    big = capsys.readouterr().out
    assert "recorded family member" in big and "needs more than one h100's memory" in big
    # the stages grow with the work: the real model's score costs more than its tiny-width counterpart's
    real, tiny = model_facts("Qwen3.5-397B-A17B"), model_facts(str(config))
    cpu = DEVICES["cpu"]
    (a,), (b,) = (
        stage_costs(real, RunOptions(), cpu, ["score"]),
        stage_costs(tiny, RunOptions(), cpu, ["score"]),
    )
    # a forward costs at least 2 FLOPs per active parameter and token (17B active, 65,536 tokens), and less
    # than 3x that (attention over 2,048-token windows and the scorers' own products add the rest)
    forward = 2 * 17e9 * 65_536
    assert forward < a.flops < 3 * forward and a.flops > 100 * b.flops
    assert a.seconds > b.seconds and a.host_memory > real.bytes
    assert main(["estimate", "Qwen3.5-1B"]) == 2
    assert "expected one of Qwen3-Next-80B-A3B" in capsys.readouterr().err


def test_member_facts_add_up_to_the_published_totals():
    for name, billions in (("Qwen3-Next-80B-A3B", 80), ("Qwen3.5-397B-A17B", 397), ("Qwen3.5-9B", 9)):
        facts = model_facts(name)
        assert 0.95 * billions * 1e9 <= facts.parameters <= 1.1 * billions * 1e9, name
        assert len(facts.layers) == member(name).values["num_hidden_layers"]


def _only(**costs: float) -> Device:
    """The CPU entry with every cost free but ``costs``: a stage's seconds are then that one term."""
    free = {
        f.name: (
            float("inf") if f.name in ("flops16", "flops32", "flops64", "bandwidth", "disk", "write") else 0.0
        )
        for f in dataclasses.fields(Device)
        if f.type in ("float", float)
    }
    ones = {"matmul_efficiency": 1.0, "bandwidth_efficiency": 1.0}
    return dataclasses.replace(DEVICES["cpu"], **{**free, **ones, **costs})


def test_slice_and_distill_costs_count_the_files_they_read_and_write(folders):
    """Direct formulas from the files on disk and the model's parameters (safetensors' headers, torch's numel),
    not from the estimate's facts: slice streams every tensor in and out; distill's Trainer writes the student
    and its two AdamW moments at every tenth of the run, and the student once more at the end."""
    config, _, written = folders["qwen3_5_moe_text"]
    tensors = sum(len(load_file(f)) for f in Path(written).glob("*.safetensors"))
    nbytes = sum(
        t.numel() * t.element_size()
        for f in Path(written).glob("*.safetensors")
        for t in load_file(f).values()
    )
    numel = sum(p.numel() for p in build_model(config).parameters())  # what AdamW holds two moments of
    assert tensors > 100  # the experts are stored one tensor each
    facts = model_facts(written)
    (cost,) = stage_costs(facts, RunOptions(), _only(stream_tensor_seconds=1.0), ["slice"])
    assert cost.seconds == pytest.approx(2 * tensors)
    (cost,) = stage_costs(facts, RunOptions(budget=0.5), _only(disk=1.0), ["slice"])
    assert cost.seconds == pytest.approx(1.5 * nbytes)
    for steps, saves in ((2, 2), (20, 10), (25, 12)):  # save_steps = steps // 10: saved at its multiples
        options = RunOptions(steps=steps, distill_batch_size=2, distill_seq_len=32)
        (cost,) = stage_costs(facts, options, _only(write=1.0), ["distill"], student=facts)
        assert cost.seconds == pytest.approx(saves * (nbytes + 2 * 4 * numel) + nbytes)
        (cost,) = stage_costs(facts, options, _only(convert_tensor_seconds=1.0), ["distill"], student=facts)
        assert cost.seconds == pytest.approx(2 * tensors)  # transformers' loading reads both models


def test_score_counts_the_projection_scorers_weight_grams():
    """Once per projected sub-block the scorer forms its output projection's weight Gram in float64 (2 m^2
    FLOPs per output row): summed over a real model's MLP down projections and attention output projections
    (their in_features and out_features), the score's cost that does not grow with the tokens."""
    config = _small("Qwen3.5-4B")
    model = build_model(config)
    grams = sum(
        2.0 * m.out_features * m.in_features**2
        for name, m in model.named_modules()
        if name.endswith(("mlp.down_proj", "self_attn.o_proj"))
    )
    facts, device = model_facts(config), _only(flops64=1.0)

    def seconds(samples: int) -> float:
        (cost,) = stage_costs(facts, RunOptions(num_samples=samples, seq_len=64), device, ["score"])
        return cost.seconds

    assert grams > 0 and 2 * seconds(4) - seconds(8) == pytest.approx(grams)


def test_a_read_model_holds_its_weights_and_a_measured_cost_per_tensor(folders, monkeypatch):
    """Score, plan, eval and bench hold the model read from its folder: beside its weights, the reader's objects
    for every tensor of the folder (counted here from the safetensors files), LOADED_TENSOR_BYTES each, once in
    each of these stages (prune holds the largest of its score, plan and slice)."""
    from gdnprune.estimate import stages as module

    _, _, written = folders["qwen3_5_moe_text"]
    tensors = sum(len(load_file(f)) for f in Path(written).glob("*.safetensors"))
    facts = model_facts(written)
    names = ["score", "plan", "eval", "bench"]
    with_objects = stage_costs(facts, RunOptions(), DEVICES["cpu"], names)
    monkeypatch.setattr(module, "LOADED_TENSOR_BYTES", 0.0)
    without = stage_costs(facts, RunOptions(), DEVICES["cpu"], names)
    assert tensors > 100
    for one, two in zip(with_objects, without, strict=True):
        assert one.host_memory - two.host_memory == pytest.approx(1600.0 * tensors), one.stage
