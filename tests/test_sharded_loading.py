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

import json
import os
import shutil

import pytest
import torch
from launch_runs import FOLDERS
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from gdnprune import load_pretrained
from gdnprune.distill import DistillConfig
from gdnprune.distill.fsdp import (
    load_sharded_models,
)

pytestmark = pytest.mark.filterwarnings("ignore::gdnprune.checkpoint.UnsortedInputWarning")

TRAINED = os.path.join(os.path.dirname(__file__), "data", "trained")


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


def test_a_folder_changed_on_disk_is_read_again(tmp_path):
    """The tensor names of a folder are read once while its files stay the same (a check before loading asks
    what the load asks); a file written since is read again."""
    from gdnprune.io.model_classes import empty_pretrained
    from gdnprune.io.sharded_loading import ShardedLoadingError, sharded_loading_names

    folder = tmp_path / "model"
    shutil.copytree(os.path.join(TRAINED, "recall"), folder)
    model = empty_pretrained(folder, dtype=torch.float32)
    assert sharded_loading_names(folder, model)["model.norm.weight"].name == "model.norm.weight"
    tensors = load_file(folder / "model.safetensors")
    tensors["model.final_norm.weight"] = tensors.pop("model.norm.weight")
    save_file(tensors, folder / "model.safetensors")
    with pytest.raises(ShardedLoadingError, match=r"model\.norm\.weight"):
        sharded_loading_names(folder, model)
