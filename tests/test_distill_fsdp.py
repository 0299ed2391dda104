"""Distillation on FSDP2 (CPU, gloo, 2 processes: a part of the suite's shared launch, tests/launches.py): the
1-process loss curve and weights, real sharding of the student (parameters, optimizer state) and of the
teacher, the gathered output folder, the memory estimate against the tensors held, and resume from sharded
checkpoints after SIGTERM."""

import json
import os
from pathlib import Path

import pytest
import torch
from helpers import DISTILL_SHAPE, HALF, make_pair, pair
from launch_runs import FSDP_CASES, run_case
from tiny_models import build_model

from gdnprune import load_pretrained
from gdnprune.distill.fsdp import clip_grad_norm_in_parts, layer_parts, optimizer_bytes, split_groups


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
    for name, (heterogeneous, _, tied) in FSDP_CASES.items():
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


# ---- the optimizer and the clipping layer by layer (DTensor's list operations are quadratic in length) ------


def _model_with_gradients(seed: int = 0):
    model = build_model("qwen3_5_moe", DISTILL_SHAPE, seed=seed)
    generator = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=generator) * 0.3
    return model


def test_layer_parts_hold_every_parameter_with_a_gradient_once_each_part_one_layer():
    model = _model_with_gradients()
    named = [(n, p) for n, p in model.named_parameters() if p.grad is not None]
    parts = layer_parts(model)
    assert [id(p) for part in parts for p in part] == [id(p) for _, p in named]
    name_of = {id(p): n for n, p in named}
    # the layer of a name written out: "model.layers.<i>." + the rest, else outside the layers
    layer = [
        {n.split(".")[2] if n.startswith("model.layers.") else None for n in map(name_of.get, map(id, part))}
        for part in parts
    ]
    assert all(len(one) == 1 for one in layer)
    indices = [next(iter(one)) for one in layer if next(iter(one)) is not None]
    assert indices == [str(i) for i in range(model.config.num_hidden_layers)]  # one part per layer, in order


def test_clipping_layer_by_layer_gives_torchs_clipping():
    for max_norm in (0.5, 1e6, float("inf")):  # clipped, left as it is, the norm alone (max_grad_norm 0)
        model, reference = _model_with_gradients(1), _model_with_gradients(1)
        total = clip_grad_norm_in_parts(layer_parts(model), max_norm)
        expected = torch.nn.utils.clip_grad_norm_(reference.parameters(), max_norm)
        torch.testing.assert_close(total, expected)
        for p, q in zip(model.parameters(), reference.parameters(), strict=True):
            torch.testing.assert_close(p.grad, q.grad)


def test_adamw_on_one_group_per_layer_steps_as_on_the_whole_groups():
    model, reference = _model_with_gradients(2), _model_with_gradients(2)

    def groups(m):  # the Trainer's two groups: with and without weight decay
        named = list(m.named_parameters())
        return [
            {"params": [p for n, p in named if p.ndim > 1], "weight_decay": 0.1},
            {"params": [p for n, p in named if p.ndim <= 1], "weight_decay": 0.0},
        ]

    split = split_groups(groups(model), model)
    assert len(split) > 2 and all(g["weight_decay"] in (0.1, 0.0) for g in split)
    assert [id(p) for g in split for p in g["params"]] == [id(p) for g in groups(model) for p in g["params"]]
    for opt in (torch.optim.AdamW(split, lr=1e-2), torch.optim.AdamW(groups(reference), lr=1e-2)):
        opt.step()
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p, q)
