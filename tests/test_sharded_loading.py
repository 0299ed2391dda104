"""Loading into FSDP2 shards straight from the safetensors files (gloo, 2 processes: a part of the suite's
shared launch, tests/launches.py): the
gathered weights equal a whole load tensor for tensor for a uniform student, a heterogeneous student (also
with its layers wrapped for activation checkpointing), a teacher stored in several shards (in bfloat16,
loaded in float32), an FP8 block-scaled teacher (dequantized as transformers dequantizes it), an MoE model
stored one tensor per expert (the trained tiny Qwen3.5-MoE), a vision-language model (the trained tiny
Qwen3.5-VL), a text model reading that folder's ``model.language_model.`` tensors, the trained tiny
OLMo-hybrid, a student whose hidden size was cut, and a bf16 student under
bf16 mixed precision (float32 master weights, as accelerate upcasts it); each process holds about half; a
short distillation under FSDP2 that loads this way gives the loss curve of the whole-load path, with and
without gradient checkpointing. Before any shard, a quantization other than FP8 blocks is refused and a
tensor stored in no form sharded loading reads makes its model load whole, said in one warning line."""

from __future__ import annotations

import functools
import json
import os
import shutil
import warnings
from pathlib import Path

import pytest
import torch
from accelerate import PartialState
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from test_checkpoint import make_source
from test_fp8 import make_fp8
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from transformers import AutoConfig

from gdnprune import load_pretrained
from gdnprune.checkpoint import UnsortedInputWarning, slice_checkpoint
from gdnprune.distill import DistillConfig, distill_checkpoint
from gdnprune.distill.fsdp import (
    has_checkpointed_layers,
    load_sharded_models,
    local_bytes,
    shard_student,
    shard_teacher,
)
from gdnprune.io.sharded_loading import load_sharded

pytestmark = pytest.mark.filterwarnings("ignore::gdnprune.checkpoint.UnsortedInputWarning")

PLAN = {
    "format": "gdnprune-plan",
    "version": 1,
    "layers": {
        "model.layers.0.linear_attn": {"num_key_heads": 1, "num_value_heads": 2},
        "model.layers.2.linear_attn": {"value_head_dim": 4},
    },
}
FOLDERS = {  # name: (folder, how it is sharded)
    "uniform": ("uniform", "student"),
    "hetero": ("hetero", "student"),
    "hetero_gc": ("hetero", "student_gc"),  # layers wrapped for activation checkpointing, then sharded
    "sharded_teacher": ("sharded_teacher", "teacher"),
    "fp8_teacher": ("fp8_teacher", "teacher"),
    "moe": ("moe", "student"),
    "vl": ("vl", "student"),  # a whole vision-language model, stored under its own names
    # a text model whose folder stores a vision-language model's tensors (model.language_model.*, visual.*)
    "vl_text": ("vl_text", "student"),
    # a bf16 student under bf16 mixed precision (distill's loader): float32 master weights, as accelerate
    # upcasts the whole-loaded student, from a float32 folder (so the rounding to bf16 shows)
    "bf16_mixed": ("uniform", "student_bf16_mixed"),
    "olmo": ("olmo", "student"),  # the trained tiny OLMo-hybrid (stored in bf16, A_log kept in float32)
    "hidden": ("hidden", "student"),  # the teacher with its hidden size cut (64 -> 40; mtp.* cut too)
}
TRAINED = os.path.join(os.path.dirname(__file__), "data", "trained")


def build_folders(root: Path) -> None:
    """The folders the launch loads, made in ``root`` (by tests/launches.py's shared_inputs)."""
    teacher = make_source(root / "teacher", "qwen3_5", seed=31)
    with warnings.catch_warnings():  # whichever test asks for the launch first: not its warnings
        warnings.simplefilter("ignore", UnsortedInputWarning)
        slice_checkpoint(teacher, root / "hetero", plan=PLAN, progress=False, self_contained=True)
        slice_checkpoint(
            teacher, root / "uniform", {"num_key_heads": 1, "num_value_heads": 2}, progress=False
        )
        slice_checkpoint(teacher, root / "hidden", target={"hidden_size": 40}, progress=False)
    whole = load_pretrained(teacher, dtype=torch.bfloat16)
    whole.save_pretrained(root / "sharded_teacher", max_shard_size="40KB")
    make_fp8(root / "fp8_teacher", "qwen3_5", seed=5)
    shutil.copytree(os.path.join(TRAINED, "qwen3_5_moe"), root / "moe")
    shutil.copytree(os.path.join(TRAINED, "qwen3_5_vl"), root / "vl")
    shutil.copytree(os.path.join(TRAINED, "olmo_hybrid"), root / "olmo")
    text = AutoConfig.from_pretrained(root / "vl").get_text_config()
    text.architectures = ["Qwen3_5ForCausalLM"]
    text.save_pretrained(root / "vl_text")
    shutil.copy(root / "vl" / "model.safetensors", root / "vl_text" / "model.safetensors")
    (root / "train.txt").write_text(" ".join(["the model sorts heads and slices them"] * 200))


def load_and_distill(root: str) -> None:
    """On the 2 ranks of the suite's shared launch (tests/launches.py): each folder loaded into shards and
    gathered, then the distillations; rank 0 saves the report (``report.pt``)."""
    os.environ["GDNPRUNE_DATA_CACHE"] = os.path.join(root, "cache")  # not the user's datasets cache
    PartialState()
    report: dict = {}
    shards = {
        "student": shard_student,
        "teacher": shard_teacher,
        "student_gc": functools.partial(shard_student, gradient_checkpointing=True),
    }
    mixed = DistillConfig(mixed_precision="bf16", fsdp=True)
    for name, (folder, role) in FOLDERS.items():
        path = os.path.join(root, folder)
        if role == "student_bf16_mixed":
            model, _ = load_sharded_models(
                path, path, "bfloat16", "bfloat16", config=mixed, teacher_sharded=False
            )
        else:
            model = load_sharded(path, shards[role], dtype=torch.float32)
        full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        report[name] = {
            "state": full,
            "buffers": {k: v.clone() for k, v in model.named_buffers()},
            "held": local_bytes(model),
            "tied": model.get_output_embeddings().weight is model.get_input_embeddings().weight,
            "wrapped": has_checkpointed_layers(model),
            "dtypes": sorted({str(p.dtype) for p in model.parameters()}),
        }
    config = DistillConfig(
        steps=3, batch_size=4, lr=3e-3, lm_weight=0.3, log_every=1, fsdp=True, progress=False
    )
    for mode in ("sharded", "whole", "sharded_gc", "whole_gc"):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            result = distill_checkpoint(
                os.path.join(root, "hetero"),
                os.path.join(root, "teacher"),
                os.path.join(root, "train.txt"),
                os.path.join(root, mode),
                config=config.replace(gradient_checkpointing=mode.endswith("gc")),
                seq_len=40,
                sharded_loading=mode.startswith("sharded"),
            )
        report[mode] = {
            "losses": [h["loss"] for h in result["history"] if "loss" in h],
            "warnings": [str(w.message) for w in caught if "loaded whole" in str(w.message)],
        }
    if int(os.environ["RANK"]) == 0:
        torch.save(report, os.path.join(root, "report.pt"))


@pytest.fixture(scope="module")
def run(launch, launch_inputs):
    """The folders and the first process's report of the two-process run over them: a part of the suite's
    shared launch (tests/launches.py), whose ranks have imported torch and hold a process group already."""
    root = launch_inputs / "sharded_loading"
    assert (root / "report.pt").exists(), launch.stderr[-4000:]
    return root, torch.load(root / "report.pt")


@pytest.mark.parametrize("name", list(FOLDERS))
def test_the_gathered_shards_equal_a_whole_load_tensor_for_tensor(run, name):
    root, report = run
    folder, role = FOLDERS[name]
    assert report[name]["wrapped"] == (role == "student_gc")
    if name == "sharded_teacher":
        assert len(list((root / name).glob("*.safetensors"))) > 3  # several files, stored in bfloat16
    if name == "moe":  # stored one tensor per expert; the model holds them stacked
        with safe_open(str(root / name / "model.safetensors"), "pt") as f:
            assert "model.layers.0.mlp.experts.1.up_proj.weight" in set(f.keys())
    if name == "fp8_teacher":
        assert (
            json.loads((root / name / "config.json").read_text())["quantization_config"]["quant_method"]
            == "fp8"
        )
    if name == "vl_text":  # the text model's tensors are stored under the vision-language prefix
        with safe_open(str(root / name / "model.safetensors"), "pt") as f:
            assert "model.language_model.embed_tokens.weight" in set(f.keys())
    if role == "student_bf16_mixed":  # what accelerate makes of a bf16 student: float32 master weights
        reference = load_pretrained(root / folder, dtype=torch.bfloat16).float()
    else:
        reference = load_pretrained(root / folder, dtype=torch.float32)
    assert report[name]["dtypes"] == ["torch.float32"]
    want, got = reference.state_dict(), report[name]["state"]
    assert set(got) == set(want)
    for key, value in want.items():
        assert got[key].dtype == value.dtype and torch.equal(got[key], value), key
    buffers = dict(reference.named_buffers())  # the rotary frequencies, recomputed
    assert set(report[name]["buffers"]) == set(buffers)
    for key, value in buffers.items():
        assert torch.equal(report[name]["buffers"][key], value), key
    tied = reference.get_output_embeddings().weight is reference.get_input_embeddings().weight
    assert report[name]["tied"] == tied
    held, whole = report[name]["held"]
    assert held <= 0.6 * whole, (held, whole)  # each process holds its half only


def test_distillation_loading_into_shards_gives_the_loss_curve_of_whole_loading(run):
    _, report = run
    sharded, whole = report["sharded"], report["whole"]
    assert sharded["warnings"] == [] and whole["warnings"] == []  # both models took the sharded path
    assert len(sharded["losses"]) == 3 and sharded["losses"][-1] < sharded["losses"][0]
    assert sharded["losses"] == pytest.approx(whole["losses"], rel=1e-6)
    # under gradient checkpointing too (the layers wrapped before sharding, not by accelerate after)
    sharded_gc, whole_gc = report["sharded_gc"], report["whole_gc"]
    assert sharded_gc["warnings"] == [] and whole_gc["warnings"] == []
    assert sharded_gc["losses"] == pytest.approx(whole_gc["losses"], rel=1e-6)
    assert sharded_gc["losses"] == pytest.approx(sharded["losses"], rel=1e-5)  # checkpointing changes no loss


def test_a_quantization_other_than_fp8_blocks_is_refused_and_another_form_loads_whole_with_one_line(tmp_path):
    """Before any shard: a GPTQ folder is refused (one line naming what is read), and a folder storing a tensor
    under a name sharded loading does not read loads whole, said in one warning line naming the tensor."""
    config = DistillConfig(fsdp=True)
    quantized = tmp_path / "gptq"
    shutil.copytree(os.path.join(TRAINED, "recall"), quantized)
    values = json.loads((quantized / "config.json").read_text())
    values["quantization_config"] = {"quant_method": "gptq", "bits": 4}
    (quantized / "config.json").write_text(json.dumps(values))
    with pytest.raises(
        ValueError, match=r"^student: .*FP8 block-scaled.*found quant_method 'gptq'"
    ) as caught:
        load_sharded_models(quantized, quantized, "float32", "float32", config=config, teacher_sharded=False)
    assert "\n" not in str(caught.value)
    renamed = tmp_path / "renamed"
    shutil.copytree(os.path.join(TRAINED, "recall"), renamed)
    tensors = load_file(renamed / "model.safetensors")
    tensors["model.final_norm.weight"] = tensors.pop("model.norm.weight")
    save_file(tensors, renamed / "model.safetensors")
    with pytest.warns(
        UserWarning, match=r"^student: loaded whole on every process.*model\.norm\.weight"
    ) as said:
        student, teacher = load_sharded_models(
            renamed, renamed, "float32", "float32", config=config, teacher_sharded=False
        )
    assert student is None and teacher is None
    assert ["\n" in str(w.message) for w in said if "loaded whole" in str(w.message)] == [False]
