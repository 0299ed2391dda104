"""Distillation on FSDP2 (CPU, gloo, 2 processes: a part of the suite's shared launch, tests/launches.py): the
1-process loss curve and weights, real sharding of the student (parameters, optimizer state) and of the
teacher, the gathered output folder, the memory estimate against the tensors held, and resume from sharded
checkpoints after SIGTERM."""

import json
import os
import signal
from pathlib import Path

import pytest
import torch
from test_distill import HALF, SHAPE, pair, sliced, windows
from tiny_models import build_model, make_config
from transformers import TrainerCallback

from gdnprune import load_pretrained
from gdnprune.distill import distill, estimate_memory
from gdnprune.distill.fsdp import local_bytes, optimizer_bytes
from gdnprune.io.loading import slice_model

CASES = {  # name -> (heterogeneous student, lm_weight, tied embeddings)
    "uniform_kd": (False, 0.0, False),
    "uniform_mix": (False, 0.4, False),
    "heterogeneous_kd": (True, 0.0, False),
    "heterogeneous_mix": (True, 0.4, False),
    "tied_mix": (False, 0.4, True),
}


def make_pair(heterogeneous, tied=False):
    """A teacher and its student: the nested half of every GDN layer, or different cuts per layer; with
    ``tied``, embeddings tied to ``lm_head`` (one tensor, sharded by vocabulary and read by both the lookup
    and the loss)."""
    if tied:
        config = make_config("qwen3_5", SHAPE)
        config.tie_word_embeddings = True
        teacher = build_model("qwen3_5", SHAPE, config=config)
        student = sliced(teacher)
        assert student.lm_head.weight is student.model.embed_tokens.weight
        return teacher, student
    teacher, student = pair()
    if heterogeneous:
        student = slice_model(
            teacher,
            {
                "model.layers.0.linear_attn": {"num_key_heads": 1, "num_value_heads": 2},
                "model.layers.2.linear_attn": {"value_head_dim": 8},
            },
        )
    return teacher, student


def run_case(name, out, **options):
    heterogeneous, lm_weight, tied = CASES[name]
    teacher, student = make_pair(heterogeneous, tied)
    result = distill(
        student,
        teacher,
        windows(16),
        out,
        steps=3,
        batch_size=4,
        lr=3e-3,
        lm_weight=lm_weight,
        eval_data=windows(4, seed=5),
        eval_every=3,
        log_every=1,
        save_every=3,
        progress=False,
        **options,
    )
    return teacher, student, result


def two_processes(root: str) -> None:
    """On the 2 ranks of the suite's shared launch (tests/launches.py): every case under FSDP2, each rank's
    report in ``two/rank<R>.pt``, then the SIGTERM run and its resume in ``resume`` (:func:`resume`)."""
    rank = int(os.environ["RANK"])
    two = os.path.join(root, "two")
    report: dict = {}
    for name in CASES:
        teacher, student, result = run_case(name, os.path.join(two, name), fsdp=True)
        trainer = result["trainer"]
        fresh_teacher, fresh_student = make_pair(CASES[name][0], CASES[name][2])
        estimate = estimate_memory(fresh_student, fresh_teacher, processes=2, fsdp=True, teacher_sharded=True)
        report[name] = {
            "losses": [h["loss"] for h in result["history"] if "loss" in h],
            "eval": result["eval"],
            "config": result["config"],
            "student": local_bytes(trainer.model),
            "teacher": local_bytes(teacher),
            "optimizer": optimizer_bytes(trainer.optimizer),
            "estimate": (estimate.student_parameters, estimate.optimizer_state, estimate.teacher_parameters),
        }
    # FSDP2's activation checkpointing (a pass-through option) gives the same run
    _, _, result = run_case(
        "uniform_mix", os.path.join(two, "checkpointed"), fsdp=True, gradient_checkpointing=True
    )
    report["checkpointed"] = [h["loss"] for h in result["history"] if "loss" in h]
    torch.save(report, os.path.join(two, f"rank{rank}.pt"))
    resume(os.path.join(root, "resume"))


@pytest.fixture(scope="module")
def launched(launch, launch_inputs) -> Path:
    """The folder of this file's part of the suite's shared launch (tests/launches.py, :func:`two_processes`):
    the cases (``two``), then the resume (``resume``)."""
    root = launch_inputs / "distill_fsdp"
    assert (root / "two" / "rank1.pt").exists() and (root / "resume" / "stopped.json").exists(), (
        launch.stderr[-4000:]
    )
    return root


def test_two_fsdp_processes_give_the_run_of_one_with_the_student_and_teacher_sharded(launched, tmp_path):
    ranks = [torch.load(launched / "two" / f"rank{r}.pt") for r in (0, 1)]
    for name, (heterogeneous, _, tied) in CASES.items():
        teacher, student, one = run_case(name, tmp_path / "one" / name)
        two = ranks[0][name]
        assert (two["config"]["processes"], two["config"]["fsdp"], two["config"]["teacher_sharding"]) == (
            2,
            True,
            "shard",
        ), name
        losses = [h["loss"] for h in one["history"] if "loss" in h]
        assert len(losses) == 3 and losses[-1] < losses[0], name
        # the head and embedding are sharded by vocabulary: the loss combines softmax statistics over the
        # processes, which rounds differently from one log-softmax (the first loss, before any update, within
        # 2e-6 here); AdamW's first steps (about +-lr per element whatever the gradient's size) amplify that:
        # KD-only runs, whose KD is small, drift to 1e-4 by the third step (2.3e-4 in evaluation)
        assert two["losses"][0] == pytest.approx(losses[0], rel=1e-5), name
        assert two["losses"] == pytest.approx(losses, rel=1e-3), name
        if name == "uniform_mix":
            assert ranks[0]["checkpointed"] == pytest.approx(losses, rel=1e-3)
        assert two["eval"]["loss"] == pytest.approx(one["eval"]["loss"], rel=1e-3), name
        assert two["eval"]["lm_loss"] == pytest.approx(one["eval"]["lm_loss"], rel=1e-3), name

        # the output folder: the trained parameters, gathered; loadable as a normal checkpoint
        out = launched / "two" / name
        loaded = load_pretrained(out, dtype=torch.float32)
        got, want = loaded.state_dict(), student.state_dict()
        start = make_pair(heterogeneous, tied)[1].state_dict()
        assert set(got) == set(want), name
        for key, value in want.items():
            # each tensor's update within 5% of the one-process update (the rounding above: at most 1.4%, the
            # embedding of uniform_kd; a wrong gradient or gather is off by about the update's size)
            moved, error = (value - start[key]).norm(), (got[key] - value).norm()
            assert error <= 5e-2 * moved + 1e-6, (name, key, float(error), float(moved))
        if not heterogeneous:
            plain = type(student).from_pretrained(out)
            assert plain.config.linear_num_value_heads == HALF.num_value_heads
        assert oct((out / "model.safetensors").stat().st_mode & 0o777) == oct(0o666 & ~_umask())

        # sharding is real: each rank holds about half of the student, its optimizer state and the teacher
        whole_optimizer = optimizer_bytes(one["trainer"].optimizer)
        for rank in ranks:
            held, whole = rank[name]["student"]
            assert held <= 0.6 * whole, (name, held, whole)
            assert rank[name]["optimizer"] <= 0.6 * whole_optimizer, name
            held, whole = rank[name]["teacher"]
            assert held <= 0.6 * whole, name
        # the estimate counts the first process's shards exactly
        params, optimizer, teacher_bytes = two["estimate"]
        assert (params, optimizer, teacher_bytes) == (
            two["student"][0],
            two["optimizer"],
            two["teacher"][0],
        ), name


def _umask():
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


class _Term(TrainerCallback):
    """SIGTERM to rank 1 at the end of step 2: both ranks save and stop."""

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == 2 and int(os.environ["RANK"]) == 1:
            os.kill(os.getpid(), signal.SIGTERM)


def _resume_run(out: str, **extra) -> dict:
    teacher, student = pair()
    result = distill(student, teacher, windows(12), out, steps=5, batch_size=4, lr=3e-3, lm_weight=0.3,
                     save_every=10, log_every=1, progress=False, fsdp=True, **extra)  # fmt: skip
    if not result["interrupted"] and int(os.environ["RANK"]) == 0:
        losses = [(h["step"], h["loss"]) for h in result["history"] if "loss" in h]
        torch.save(losses, os.path.join(out, "losses.pt"))
    return result


def resume(root: str) -> None:
    """On the launch's ranks (after the cases): the uninterrupted run, the run SIGTERM stops after step 2,
    what its checkpoint folder then holds (``stopped.json``, rank 0), and the resume from it. The resume runs
    in the same launch (a second launch costs more than the runs): it starts from the checkpoint folder
    alone, with a fresh model and trainer, as a new process would."""
    _resume_run(os.path.join(root, "straight"))
    result = _resume_run(os.path.join(root, "run"), callbacks=[_Term()])
    assert result["interrupted"] and result["steps"] == 2, result
    checkpoint = os.path.join(root, "run", "checkpoint-2")
    stopped = {
        "model_shards": os.path.isdir(os.path.join(checkpoint, "pytorch_model_fsdp_0")),
        "optimizer_shards": os.path.isdir(os.path.join(checkpoint, "optimizer_0")),
        "checkpoint_safetensors": os.path.exists(os.path.join(checkpoint, "model.safetensors")),
        "run_safetensors": os.path.exists(os.path.join(root, "run", "model.safetensors")),
    }
    if int(os.environ["RANK"]) == 0:
        with open(os.path.join(root, "stopped.json"), "w") as f:
            json.dump(stopped, f)
    _resume_run(os.path.join(root, "run"), resume=True)


def test_resume_from_sharded_checkpoints_after_sigterm_equals_the_uninterrupted_run(launched):
    root = launched / "resume"  # the launch's resume (:func:`resume`)
    stopped = json.loads((root / "stopped.json").read_text())
    assert stopped["model_shards"] and stopped["optimizer_shards"]  # the checkpoint after SIGTERM
    assert not stopped["checkpoint_safetensors"]  # sharded: each rank wrote its own part
    assert not stopped["run_safetensors"]
    straight, resumed = (torch.load(root / d / "losses.pt") for d in ("straight", "run"))
    assert [s for s, _ in resumed] == [1, 2, 3, 4, 5] and [s for s, _ in straight] == [1, 2, 3, 4, 5]
    assert [v for _, v in resumed] == pytest.approx([v for _, v in straight], rel=1e-5)
    a = load_pretrained(root / "straight", dtype=torch.float32).state_dict()
    b = load_pretrained(root / "run", dtype=torch.float32).state_dict()
    for key, value in a.items():
        torch.testing.assert_close(b[key], value, rtol=1e-5, atol=1e-6, msg=key)


def test_models_fsdp2_cannot_wrap_are_refused_with_the_reason():
    from gdnprune.distill.fsdp import check_shardable

    teacher, student = pair()
    check_shardable(student, "student")  # decoder layers to wrap, one dtype
    student.model.norm.to(torch.bfloat16)
    with pytest.raises(
        ValueError,
        match="student: cannot shard Qwen3_5ForCausalLM with FSDP2: expected parameters "
        "of one dtype, found bfloat16, float32",
    ):
        check_shardable(student, "student")
    teacher._no_split_modules = ["SomethingElse"]
    with pytest.raises(ValueError, match="teacher: cannot shard .* expected decoder layer classes"):
        check_shardable(teacher, "teacher")
