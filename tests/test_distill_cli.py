"""`gdnprune distill` from the command line: a heterogeneous student in one process, a uniform one on FSDP2
under torchrun, the memory estimate (--dry-run), the console, the output folder's record and errors."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
from pathlib import Path

import pytest
import torch
from helpers import child_env, make_source, python_command, raw_tensors

from gdnprune import load_pretrained
from gdnprune.checkpoint import slice_checkpoint
from gdnprune.cli import main
from gdnprune.distill import DistillConfig
from gdnprune.model.geometry import GDNShape
from gdnprune.model.layouts import find_gdn_modules


@pytest.fixture(scope="module", autouse=True)
def _data_cache(tmp_path_factory):
    """The tokenised corpora of these tests go to a temporary folder, not the user's datasets cache."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("GDNPRUNE_DATA_CACHE", str(tmp_path_factory.mktemp("data_cache")))
        yield


pytestmark = pytest.mark.filterwarnings("ignore::gdnprune.checkpoint.UnsortedInputWarning")

PLAN = {
    "format": "gdnprune-plan",
    "version": 1,
    "layers": {
        "model.layers.0.linear_attn": {"num_key_heads": 1, "num_value_heads": 2},
        "model.layers.2.linear_attn": {"value_head_dim": 4},
    },
}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """A teacher folder (with mtp.* tensors and a tokenizer), a heterogeneous and a uniform student, and text."""
    root = tmp_path_factory.mktemp("distill_cli")
    teacher = make_source(root / "teacher", "qwen3_5", seed=31)
    slice_checkpoint(teacher, root / "hetero", plan=PLAN, progress=False, self_contained=True)
    slice_checkpoint(teacher, root / "uniform", {"num_key_heads": 1, "num_value_heads": 2}, progress=False)
    text = root / "train.txt"
    text.write_text(" ".join(["the model sorts heads and slices them"] * 200))
    return root


def _umask():
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _mtp(folder: Path) -> dict:
    return {k: v for k, v in raw_tensors(folder).items() if k.startswith("mtp.")}


def test_distill_a_heterogeneous_student_from_the_command_line(folders, tmp_path, capsys):
    teacher, student, text = folders / "teacher", folders / "hetero", folders / "train.txt"
    out = tmp_path / "out"
    assert (
        main(
            [
                "distill",
                str(student),
                "--teacher",
                str(teacher),
                "--data",
                str(text),
                "--output",
                str(out),
                "--steps",
                "3",
                "--batch-size",
                "2",
                "--seq-len",
                "40",
                "--lr",
                "1e-3",
                "--eval-data",
                str(text),
                "--eval-samples",
                "2",
                "--eval-every",
                "3",
                "--log-every",
                "1",
                "--save-every",
                "2",
                "--keep-checkpoints",
                "--threads",
                "1",
            ]
        )
        == 0
    )
    captured = capsys.readouterr()
    # the console: the estimate, one line per log (no raw dicts, no cursor-up marks), the comparable LM losses
    assert "expected peak memory per process (1 process: student whole, teacher whole" in captured.out
    assert "3 steps" in captured.out and "eval LM loss (nats/token): student" in captured.out
    assert "step 1/3  loss " in captured.err and "step 3/3  eval loss " in captured.err
    assert "mtime" not in captured.err and "{'loss'" not in captured.err and "\x1b[A" not in captured.err
    assert "Writing model shards" not in captured.err and "Loading weights" not in captured.err
    config = json.loads((out / "config.json").read_text())
    assert config["per_layer_config"]  # still heterogeneous, in transformers' convention
    # and still self-contained (tests/test_self_contained.py): the student's modeling file and auto_map
    assert config["auto_map"] == json.loads((student / "config.json").read_text())["auto_map"]
    assert (out / "modeling_gdnprune.py").read_bytes() == (student / "modeling_gdnprune.py").read_bytes()
    model = load_pretrained(out, dtype=torch.float32)
    shapes = {p: GDNShape.from_module(m) for p, m in find_gdn_modules(model)}
    assert shapes["model.layers.0.linear_attn"].num_value_heads == 2
    assert shapes["model.layers.2.linear_attn"].value_head_dim == 4
    log = json.loads((out / "distill_log.json").read_text())
    assert log["format"] == "gdnprune-distill-log" and any("eval_kd_loss" in h for h in log["history"])
    assert (out / "tokenizer.json").is_file()
    # mtp.* weights carried over unchanged; the record of the run; permissions of the umask everywhere
    assert _mtp(out) == _mtp(student) and len(_mtp(out)) == 3
    manifest = json.loads((out / "gdnprune.json").read_text())
    assert manifest["operation"] == "distill" and manifest["steps"] == 3
    assert manifest["teacher"]["path"] == str(teacher.resolve())
    assert manifest["data"]["sha256"] == hashlib.sha256(text.read_bytes()).hexdigest()
    last_eval = [h for h in log["history"] if "eval_lm_loss" in h][-1]
    assert (
        manifest["final"]["eval"]["lm_loss"] == last_eval["eval_lm_loss"]
        and manifest["final"]["train_loss"] > 0
    )
    assert manifest["carried_over"] == sorted(_mtp(student))
    mode = 0o666 & ~_umask()
    weights = [out / "model.safetensors", *sorted((out / "checkpoint-3").glob("*"))]
    assert {p.name: oct(p.stat().st_mode & 0o777) for p in weights if p.is_file()} == {
        p.name: oct(mode) for p in weights if p.is_file()
    }
    assert main(["inspect", str(out)]) == 0 and "gdnprune output of 'distill'" in capsys.readouterr().out


def test_output_folder_errors_name_the_flags_and_come_before_any_model_is_loaded(
    folders, tmp_path, capsys, monkeypatch
):
    import gdnprune.distill.from_folder as api

    def no_loading(*args, **kwargs):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr(api, "_load_model", no_loading)
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "x.txt").write_text("mine")
    base = [
        "distill",
        str(folders / "uniform"),
        "--teacher",
        str(folders / "teacher"),
        "--data",
        str(folders / "train.txt"),
        "--steps",
        "1",
        "-q",
    ]
    assert main([*base, "-o", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "--resume" in err and "--overwrite" in err and "resume=True" not in err
    assert main([*base, "-o", str(tmp_path / "out"), "--resume"]) == 2
    assert "--resume: expected a checkpoint-STEP folder" in capsys.readouterr().err
    assert main([*base, "-o", str(tmp_path / "new"), "--cpu-offload"]) == 2
    err = capsys.readouterr().err
    assert "--cpu-offload" in err and "--fsdp" in err and "cpu_offload" not in err
    assert main([*base, "-o", str(tmp_path / "new"), "--fsdp"]) == 2
    err = capsys.readouterr().err
    assert "--fsdp shards the student over processes" in err and "torchrun" in err
    assert (
        main(
            [
                *base,
                "-o",
                str(tmp_path / "new"),
                "--teacher-device-map",
                "auto",
                "--teacher-sharding",
                "shard",
                "--dry-run",
                "--processes",
                "2",
            ]
        )
        == 2
    )
    err = capsys.readouterr().err
    assert "--teacher-device-map" in err and "--teacher-sharding 'replicate'" in err and "teacher_" not in err
    # a step's windows that the processes cannot share: refused by the command (a dry run's --processes, or the
    # launch's WORLD_SIZE) and by the library, before the corpus is tokenised or a model loads
    shares = (
        (["--batch-size", "3"], "--batch-size (3) to be a multiple of the processes (2): each process takes"),
        (["--batch-size", "4", "--micro-batch-size", "3"], "processes (2) x --micro-batch-size (3)"),
    )
    for flags, said in shares:
        assert main([*base, "-o", str(tmp_path / "new"), "--dry-run", "--processes", "2", *flags]) == 2
        assert said in capsys.readouterr().err
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert main([*base, "-o", str(tmp_path / "new"), "--batch-size", "1"]) == 2
    assert "--batch-size (1) to be a multiple of the processes (2)" in capsys.readouterr().err
    monkeypatch.setattr(api, "open_windows", no_loading)
    for options, said in (
        ({"batch_size": 3}, r"batch_size \(3\) to be a multiple of the processes \(2\)"),
        ({"batch_size": 4, "micro_batch_size": -2}, "batch_size and micro_batch_size >= 1, found 4 and -2"),
    ):
        with pytest.raises(ValueError, match=said):
            api.distill_checkpoint(
                folders / "uniform",
                folders / "teacher",
                folders / "train.txt",
                DistillConfig(output_dir=tmp_path / "new", steps=1, **options),
            )
    assert not (tmp_path / "new").exists()
    # a teacher folder that transformers cannot load: one line, exit 2, nothing written
    monkeypatch.undo()
    broken = make_source(tmp_path / "broken", "qwen3_5", seed=32)
    config = json.loads((broken / "config.json").read_text())
    config["vocab_size"] = 99  # the weights have 128 rows
    (broken / "config.json").write_text(json.dumps(config))
    assert (
        main(
            [
                "distill",
                str(folders / "uniform"),
                "--teacher",
                str(broken),
                "--data",
                str(folders / "train.txt"),
                "--output",
                str(tmp_path / "x"),
                "--steps",
                "1",
                "--seq-len",
                "40",
                "--quiet",
            ]
        )
        == 2
    )
    assert "cannot load it" in capsys.readouterr().err and not (tmp_path / "x").exists()


def test_dry_run_prints_the_estimate_whose_parameter_and_optimizer_bytes_are_the_models(
    folders, tmp_path, capsys, monkeypatch
):
    from gdnprune.distill import distill_checkpoint, estimate_checkpoint_memory
    from gdnprune.distill.fsdp import optimizer_bytes

    student, teacher = folders / "hetero", folders / "teacher"
    args = [
        "distill",
        str(student),
        "--teacher",
        str(teacher),
        "--data",
        str(folders / "train.txt"),
        "-o",
        str(tmp_path / "out"),
        "--steps",
        "1",
        "--dry-run",
    ]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "student parameters" in out and "optimizer state (AdamW)" in out and "total" in out
    assert not (tmp_path / "out").exists()
    estimate = estimate_checkpoint_memory(student, teacher, micro_batch_size=2, seq_len=40)
    result = distill_checkpoint(
        student,
        teacher,
        folders / "train.txt",
        tmp_path / "run",
        steps=1,
        batch_size=2,
        seq_len=40,
        progress=False,
    )
    model = result["trainer"].model
    assert estimate.student_parameters == sum(p.numel() * p.element_size() for p in model.parameters())
    assert estimate.optimizer_state == optimizer_bytes(result["trainer"].optimizer)
    assert estimate.teacher_parameters == sum(
        p.numel() * p.element_size() for p in load_pretrained(teacher).parameters()
    )
    # for 2 FSDP processes the student's shares halve (the worker in test_distill_fsdp measures them)
    two = estimate_checkpoint_memory(student, teacher, processes=2, fsdp=True, teacher_sharded=True)
    assert two.student_parameters <= 0.55 * estimate.student_parameters
    # an estimate above the device's memory is said at the start
    import gdnprune.cli.distill as cli

    monkeypatch.setattr(cli, "_device_memory", lambda: (1000, "GPU"))
    assert main([*args, "--processes", "2", "--fsdp"]) == 0
    captured = capsys.readouterr()
    assert "(2 processes: student sharded (FSDP2), teacher sharded" in captured.out
    assert "warning: the estimate" in captured.err and "exceeds the GPU" in captured.err


def test_accelerate_launch_with_the_shipped_fsdp2_config_writes_a_plain_checkpoint(folders, tmp_path):
    from gdnprune.distill import ACCELERATE_FSDP2_CONFIG

    teacher, student, text = folders / "teacher", folders / "uniform", folders / "train.txt"
    config = ACCELERATE_FSDP2_CONFIG.read_text()
    assert "fsdp_version: 2" in config and "distributed_type: FSDP" in config
    cpu = tmp_path / "cpu.yaml"  # the shipped config, on 2 CPU processes in full precision
    cpu.write_text(
        config.replace("num_processes: 8", "num_processes: 2")
        .replace("use_cpu: false", "use_cpu: true")
        .replace("mixed_precision: bf16", "mixed_precision: 'no'")
    )
    out = tmp_path / "out"
    cmd = python_command(
        "accelerate.commands.launch",
        "--config_file",
        cpu,
        "-m",
        "gdnprune",
        "distill",
        str(student),
        "--teacher",
        str(teacher),
        "--data",
        str(text),
        "-o",
        str(out),
        "--steps",
        "2",
        "--batch-size",
        "4",
        "--seq-len",
        "40",
        "--lr",
        "1e-3",
        "--threads",
        "1",
        "--save-every",
        "1",
        "--keep-checkpoints",
    )
    done = subprocess.run(cmd, env=child_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    assert (
        "2 processes: student sharded (FSDP2), teacher sharded" in done.stdout
        and done.stdout.count("2 steps") == 1
    )
    assert (out / "checkpoint-2" / "pytorch_model_fsdp_0").is_dir()
    from transformers import AutoModelForCausalLM

    plain = AutoModelForCausalLM.from_pretrained(out)  # uniform: a plain checkpoint
    assert plain.config.linear_num_value_heads == 2
    assert _mtp(out) == _mtp(student)
    assert json.loads((out / "gdnprune.json").read_text())["options"]["fsdp"] is True
