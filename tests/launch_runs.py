"""What the suite's shared 2-process launch (tests/launches.py) runs on its ranks, one function per test module
that reads its records, with the models and data those runs use. The test modules import from here (for the
one-process reference of the same run), and so does the launch's worker; no test module imports another.

* :func:`ddp_run`: a distillation under DDP (test_distill);
* :func:`two_processes`: distillations under FSDP2 (:data:`FSDP_CASES`), then :func:`resume` after SIGTERM
  (test_distill_fsdp);
* :func:`moe_resume`: an MoE student's run stopped by SIGTERM and resumed, under DDP and FSDP2, on the student
  :func:`build_moe_student` prunes (test_distill_pipeline);
* :func:`load_and_distill`: the folders of :func:`build_folders` loaded into FSDP2 shards, then distillations
  (test_sharded_loading);
* :func:`vocab_parallel_run`: the vocabulary-parallel loss and lookup (:data:`VOCAB_CASES`; test_vocab_parallel_loss);
* :func:`fsdp_distill`: distillation under FSDP2 of a student of the real-count model :func:`build_scale` writes
  (test_scale).
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import signal
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from accelerate import PartialState
from helpers import make_fp8, make_pair, make_source, pair, windows
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from transformers import AutoConfig, TrainerCallback

from gdnprune import load_pretrained
from gdnprune.checkpoint import UnsortedInputWarning, slice_checkpoint
from gdnprune.cli import main
from gdnprune.demo_data import train_text
from gdnprune.distill import DistillConfig, distill, distill_checkpoint, distillation_loss, estimate_memory
from gdnprune.distill.fsdp import (
    has_checkpointed_layers,
    load_sharded_models,
    local_bytes,
    optimizer_bytes,
    shard_student,
    shard_teacher,
)
from gdnprune.io.sharded_loading import load_sharded
from gdnprune.model.family import tiny_config
from gdnprune.scale_models import write_model

TRAINED = Path(__file__).parent / "data" / "trained"
MOE = "qwen3_5_moe"


# ---- DDP (test_distill) ------------------------------------------------------------------------------------


def ddp_run(out: str | os.PathLike) -> None:
    """3 steps of distillation of :func:`pair` on 16 windows, evaluated on 4; rank 0 saves the losses, the
    evaluation, the weights and the config to ``out``. Under torchrun (the shared launch, tests/launches.py)
    the two ranks train one model with DDP; here, one process."""
    teacher, student = pair()
    result = distill(
        student,
        teacher,
        windows(16),
        steps=3,
        batch_size=4,
        lr=3e-3,
        lm_weight=0.3,
        eval_data=windows(4, seed=5),
        eval_every=3,
        log_every=1,
        progress=False,
    )
    if int(os.environ.get("RANK", "0")) == 0:
        losses = [h["loss"] for h in result["history"] if "loss" in h]
        record = {"losses": losses, "eval": result["eval"], "weights": student.state_dict()}
        torch.save({**record, "config": result["config"]}, out)


# ---- FSDP2 (test_distill_fsdp) -----------------------------------------------------------------------------

FSDP_CASES = {  # name -> (heterogeneous student, lm_weight, tied embeddings)
    "uniform_kd": (False, 0.0, False),
    "uniform_mix": (False, 0.4, False),
    "heterogeneous_kd": (True, 0.0, False),
    "heterogeneous_mix": (True, 0.4, False),
    "tied_mix": (False, 0.4, True),
}


def run_case(name, out, **options):
    heterogeneous, lm_weight, tied = FSDP_CASES[name]
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
    for name in FSDP_CASES:
        teacher, student, result = run_case(name, os.path.join(two, name), fsdp=True)
        trainer = result["trainer"]
        fresh_teacher, fresh_student = make_pair(FSDP_CASES[name][0], FSDP_CASES[name][2])
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


# ---- an MoE student under DDP and FSDP2 (test_distill_pipeline) --------------------------------------------


class _OncePerParameter(TrainerCallback):
    """The prepared optimizer holds every trainable parameter once (rank 1's shards of the [1, H]
    shared_expert_gate are empty: accelerate's re-pointing by address once collapsed them into one)."""

    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        held = [id(p) for g in optimizer.param_groups for p in g["params"]]
        trainable = {id(p) for p in model.parameters() if p.requires_grad}
        assert len(held) == len(set(held)) and set(held) == trainable, (len(held), len(set(held)))


def prune_args(family: str, data: Path, out: Path) -> list[str]:
    """`gdnprune prune --budget-params 0.5` of the trained ``family``; the coarsest head-dim grid (--dim-step 1/2),
    the default sensitivity on 2 plan windows (successive halving measures every candidate a budget can hold on
    both at once: the full measurement's plan and weights, measured equal on every family, from a third fewer
    forwards), the hidden size whole (one search, not one per hidden size; tests/test_hidden.py trains a cut
    hidden size): the plan's search is not what these tests check."""
    return [
        "prune", str(TRAINED / family), "--data", str(data), "--budget-params", "0.5", "--num-samples", "4",
        "--seq-len", "32", "--plan-samples", "2", "--dim-step", "1/2", "-q",
        "--blocks", "gdn,attention,mlp,shared_expert,experts,depth", "-o", str(out),
    ]  # fmt: skip


def build_moe_student(root: Path) -> None:
    """The per-layer MoE student of :func:`moe_resume` (``student``) and its data (``train.txt``), made in
    ``root`` (by tests/launches.py's shared_inputs); the tokenised windows cached in ``root / "cache"``."""
    root.mkdir()
    (root / "train.txt").write_text(train_text()[:20000])
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("GDNPRUNE_DATA_CACHE", str(root / "cache"))
        assert main(prune_args(MOE, root / "train.txt", root / "student")) == 0


def _moe_run(root: str, engine: str, out: str, callbacks=(), **extra) -> dict:
    """A run of :func:`moe_resume` with ``engine`` (ddp or fsdp) into ``root/engine/out``."""
    config = DistillConfig(
        output_dir=os.path.join(root, engine, out), steps=4, batch_size=4, lr=3e-3, lm_weight=0.3,
        save_every=10, log_every=1, progress=False, fsdp=engine == "fsdp", **extra,
    )  # fmt: skip
    student, data = os.path.join(root, "student"), os.path.join(root, "train.txt")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = distill_checkpoint(
            student, TRAINED / MOE, data, config, seq_len=32, num_samples=8,
            callbacks=[*callbacks, _OncePerParameter()],
        )  # fmt: skip
    # under FSDP2 both MoE models (experts stored one tensor per expert) load straight into shards
    assert not [w for w in caught if "loaded whole" in str(w.message)], engine
    return result


def moe_resume(root: str) -> None:
    """On the 2 ranks of the suite's shared launch (tests/launches.py), for DDP then FSDP2: the uninterrupted
    run of :func:`build_moe_student`'s student, the run SIGTERM stops after step 2, and its resume (in the same
    launch: it starts from the checkpoint folder alone, with a fresh model and trainer, as a new process
    would)."""
    os.environ["GDNPRUNE_DATA_CACHE"] = os.path.join(root, "cache")  # not the user's datasets cache
    for engine in ("ddp", "fsdp"):
        _moe_run(root, engine, "straight")
        assert _moe_run(root, engine, "run", callbacks=[_Term()])["interrupted"]
        assert _moe_run(root, engine, "run", resume=True)["steps"] == 4


# ---- loading into FSDP2 shards (test_sharded_loading) ------------------------------------------------------

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
    shutil.copytree(os.path.join(str(TRAINED), "qwen3_5_moe"), root / "moe")
    shutil.copytree(os.path.join(str(TRAINED), "qwen3_5_vl"), root / "vl")
    shutil.copytree(os.path.join(str(TRAINED), "olmo_hybrid"), root / "olmo")
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


# ---- the vocabulary-parallel loss (test_vocab_parallel_loss) -----------------------------------------------

VOCAB, HIDDEN, T_HIDDEN, POSITIONS = 13, 8, 6, (7, 5)


VOCAB_CASES = {  # name -> (temperature, kd_weight, lm_weight, bias, chunk_size, teacher sharded)
    "mix_t2_bias_chunks": (2.0, 0.7, 0.4, True, 3, True),
    "kd_only": (1.0, 1.0, 0.0, False, None, True),
    "mix_t1_teacher_whole": (1.0, 0.3, 0.6, False, 4, False),
    "lm_only": (1.5, 0.0, 1.0, True, 2, True),
}


def vocab_inputs(rank: int, bias: bool) -> dict[str, torch.Tensor]:
    """The whole weights (the same on every process) and the positions of process ``rank``."""
    g = torch.Generator().manual_seed(0)
    whole = {
        "weight": torch.randn(VOCAB, HIDDEN, generator=g),
        "t_weight": 2 * torch.randn(VOCAB, T_HIDDEN, generator=g),
        "bias": torch.randn(VOCAB, generator=g) if bias else None,
        "t_bias": torch.randn(VOCAB, generator=g) if bias else None,
    }
    g = torch.Generator().manual_seed(10 + rank)
    n = POSITIONS[rank]
    labels = torch.randint(0, VOCAB, (n,), generator=g)
    labels[torch.rand(n, generator=g) < 0.3] = -100
    labels[0] = VOCAB - 1  # the last row: on the second process's (shorter) shard
    return {
        **whole,
        "hidden": torch.randn(n, HIDDEN, generator=g),
        "t_hidden": torch.randn(n, T_HIDDEN, generator=g),
        "labels": labels,
        "ids": torch.randint(0, VOCAB, (2, n), generator=g),
        "out_grad": torch.randn(2, n, HIDDEN, generator=g),
    }


def vocab_parallel_run(root: str) -> None:
    """On the 2 ranks of the suite's shared launch (tests/launches.py), its process group already up: every case,
    the FSDP2-sharded tiny models and the embedding lookup; each rank's report in ``root/rank<R>.pt``."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from gdnprune.distill.fsdp import shard_student, shard_teacher, vocab_sharded
    from gdnprune.distill.loss import head_terms
    from gdnprune.distill.vocab_parallel import embedding

    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (2,))

    def head(weight, bias, sharded, grad):
        module = torch.nn.Module()
        split = (lambda t: distribute_tensor(t, mesh, [Shard(0)])) if sharded else (lambda t: t)
        module.weight = torch.nn.Parameter(split(weight), requires_grad=grad)
        module.bias = None if bias is None else torch.nn.Parameter(split(bias), requires_grad=grad)
        return module

    report = {}
    for name, (temperature, kd_w, lm_w, bias, chunk, teacher_sharded) in VOCAB_CASES.items():
        x = vocab_inputs(rank, bias)
        student = head(x["weight"], x["bias"], True, True)
        teacher = head(x["t_weight"], x["t_bias"], teacher_sharded, False)
        hidden = x["hidden"].clone().requires_grad_(True)
        t_hidden = x["t_hidden"] if kd_w else None
        out = distillation_loss(hidden, t_hidden, student, teacher if kd_w else None, x["labels"],
                                temperature=temperature, kd_weight=kd_w, lm_weight=lm_w, chunk_size=chunk)  # fmt: skip
        out.loss.backward()
        kd, lm, t_lm = head_terms(
            x["hidden"], student, x["t_hidden"], teacher, x["labels"], temperature, chunk
        )
        report[name] = {
            "loss": out.loss.detach(), "kd": out.kd, "lm": out.lm, "hidden_grad": hidden.grad,
            "weight_grad": student.weight.grad.full_tensor(),
            "bias_grad": None if student.bias is None else student.bias.grad.full_tensor(),
            "local_grad_rows": student.weight.grad.to_local().shape[0],
            "terms": (kd, lm, t_lm),
        }  # fmt: skip
    # FSDP2: tiny models sharded as distillation shards them, one loss and backward on each process's windows
    for tied in (False, True):
        teacher, student = make_pair(False, tied)
        shard_student(student)
        shard_teacher(teacher)
        assert vocab_sharded(student) and vocab_sharded(teacher)
        step_loss(student, teacher, windows(4)[2 * rank : 2 * rank + 2], via=student).backward()
        report[f"fsdp_tied={tied}"] = {n: p.grad.full_tensor() for n, p in student.named_parameters()}
    x = vocab_inputs(rank, False)
    table = torch.nn.Parameter(distribute_tensor(x["weight"], mesh, [Shard(0)]))
    looked_up = embedding(x["ids"], table)
    (looked_up * x["out_grad"]).sum().backward()
    report["embedding"] = {"out": looked_up.detach(), "grad": table.grad.full_tensor()}
    os.makedirs(root, exist_ok=True)
    torch.save(report, os.path.join(root, f".rank{rank}.pt"))
    os.rename(os.path.join(root, f".rank{rank}.pt"), os.path.join(root, f"rank{rank}.pt"))


def step_loss(student, teacher, ids, via=None):
    """A training step's loss as the Trainer computes it: inside the teacher's forward, then the student's
    (so FSDP2's hooks run around both), KD plus 0.4 LM."""
    from gdnprune.distill.trainer import final_hidden, forward_redirect, next_token_labels

    def in_student(t_hidden):
        hidden = final_hidden(student, ids)
        head, t_head = student.get_output_embeddings(), teacher.get_output_embeddings()
        return distillation_loss(hidden, t_hidden, head, t_head, next_token_labels(ids), lm_weight=0.4).loss

    def in_teacher():
        t_hidden = final_hidden(teacher, ids)
        with torch.enable_grad():
            return forward_redirect(student, in_student, t_hidden, via=via)

    with torch.no_grad():
        return forward_redirect(teacher, in_teacher)


#: the published model whose counts test_scale runs at (gdnprune.model.family)
SCALE_MEMBER = "Qwen3-Next-80B-A3B"
#: the routed experts per layer of the FSDP2 distillation's student (of the member's 512)
STUDENT_EXPERTS = 32


def build_scale(root: Path) -> Path:
    """The shared launch's inputs of this file (tests/launches.py writes them once per session): the real-count
    model (``model``), its calibration text, and the distillation's student (``student``: the same counts with
    32 experts per layer, as a cut to a sixteenth keeps, other random weights: the teacher's 512 are what the
    real counts ask of the run; 128 cost each rank 4 s more of loading, training and saving)."""
    root.mkdir(parents=True, exist_ok=True)
    write_model(tiny_config(SCALE_MEMBER), root / "model", seed=5)
    write_model({**tiny_config(SCALE_MEMBER), "num_experts": STUDENT_EXPERTS}, root / "student", seed=6)
    (root / "calib.txt").write_text(train_text()[:4000], encoding="utf-8")
    return root


def fsdp_distill(root: str) -> None:
    """On the 2 ranks of the suite's shared launch: a step of distillation under FSDP2 of the cut student from
    the real-count teacher, both read straight into their shards (75,944 tensors, one per expert), its
    checkpoint and the final save. One step: a second one cost the launch 2.7 s of CPU and checks nothing that
    the counts change (test_distill_fsdp runs several steps, checkpoints and resuming on small models)."""
    argv = ["distill", f"{root}/student", "--teacher", f"{root}/model", "--data", f"{root}/calib.txt"]
    argv += ["--output", f"{root}/distilled", "--steps", "1", "--batch-size", "2", "--seq-len", "16"]
    argv += ["--fsdp", "--threads", "1", "--quiet", "--save-every", "1"]
    code = main(argv)
    if int(os.environ.get("RANK", "0")) == 0:
        (Path(root) / "distill.json").write_text(json.dumps({"code": code}))
