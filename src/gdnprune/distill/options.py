"""The options of a distillation run (:class:`DistillConfig`, as ``TrainingArguments`` is for the Trainer) and
their checks, made before any model is loaded."""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "DistillConfig",
    "check_options",
    "check_batch",
    "check_run",
    "check_same_vocabulary",
    "fsdp_asked",
    "MIXED_PRECISION",
    "ACCELERATE_FSDP2_CONFIG",
]

#: the accelerate config shipped for FSDP2 runs (``accelerate launch --config_file ... -m gdnprune distill``)
ACCELERATE_FSDP2_CONFIG = Path(__file__).resolve().parent.parent / "data" / "accelerate_fsdp2.yaml"

#: the mixed-precision modes (parameters keep their dtype; forward and backward run in the low precision)
MIXED_PRECISION = ("no", "bf16", "fp16")


@dataclass
class DistillConfig:
    """Everything that shapes a distillation run but the models and the data (see :func:`gdnprune.distill.distill`).

    Length: ``steps`` optimizer steps or ``tokens`` tokens (rounded up to whole steps); ``batch_size``
    windows per step over all processes, ``micro_batch_size`` per process and forward pass (the rest by
    gradient accumulation). Optimizer: AdamW at ``lr`` with transformers' ``lr_schedule`` after
    ``warmup`` steps (below 1: a fraction of the steps), ``weight_decay``, ``max_grad_norm``. Loss:
    ``kd_weight`` x KL at ``temperature`` + ``lm_weight`` x LM, ``chunk_size`` positions at a time.
    Output (``output_dir``; None: nothing written): a checkpoint every ``save_every`` steps (default a
    tenth of the run), the last ``keep_checkpoints`` kept while running and removed when the run finishes
    unless ``remove_checkpoints`` is False (when they are removed, the last step writes none: the final model
    holds its state); the final model in ``output_dtype`` (None: as the student is held;
    :func:`gdnprune.distill.distill_checkpoint` passes the dtype the student folder stores). A log
    line every ``log_every`` steps, an evaluation every ``eval_every`` (default a tenth of the run).
    ``resume`` (True or a checkpoint folder), ``overwrite``, ``seed`` (data order). Engine: ``fsdp``,
    ``teacher_sharding`` (``"shard"`` / ``"replicate"``; None: sharded with a sharded student),
    ``mixed_precision``, ``gradient_checkpointing``, ``cpu_offload``. ``progress``: the Trainer's bar.
    """

    output_dir: str | Path | None = None
    steps: int | None = None
    tokens: int | None = None
    batch_size: int = 16
    micro_batch_size: int | None = None
    lr: float = 1e-4
    lr_schedule: str = "cosine"
    warmup: float = 0.0
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    temperature: float = 1.0
    kd_weight: float = 1.0
    lm_weight: float = 0.0
    chunk_size: int | None = None
    eval_every: int | None = None
    save_every: int | None = None
    keep_checkpoints: int = 1
    remove_checkpoints: bool = True
    log_every: int = 10
    resume: bool | str | Path = False
    overwrite: bool = False
    seed: int = 0
    fsdp: bool = False
    teacher_sharding: str | None = None
    mixed_precision: str = "no"
    gradient_checkpointing: bool = False
    cpu_offload: bool = False
    output_dtype: str | torch.dtype | None = None
    progress: bool = True

    @classmethod
    def fields(cls) -> tuple[str, ...]:
        """The option names (the keywords of the older ``distill(..., steps=..., lr=...)`` form)."""
        return tuple(f.name for f in dataclasses.fields(cls))

    def replace(self, **changes: Any) -> DistillConfig:
        return dataclasses.replace(self, **changes)


def fsdp_asked(asked: bool) -> bool:
    """FSDP asked for, or set by ``accelerate launch`` with an FSDP config."""
    return bool(asked) or os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true"


def check_options(
    *,
    world_size: int = 1,
    fsdp: bool = False,
    teacher_sharding: str | None = None,
    teacher_device_map: Any = None,
    mixed_precision: str = "no",
    cpu_offload: bool = False,
) -> str:
    """Check the engine options before any work; return the teacher sharding (``"shard"`` / ``"replicate"``).

    ``teacher_sharding`` None: sharded when the student is (FSDP2 over more than one process), else
    replicated. A ``teacher_device_map`` spreads a replicated teacher over one process's devices.
    """
    if mixed_precision not in MIXED_PRECISION:
        raise ValueError(
            f"mixed_precision: expected one of {', '.join(MIXED_PRECISION)}, found {mixed_precision!r}"
        )
    if teacher_sharding not in (None, "shard", "replicate"):
        raise ValueError(f"teacher_sharding: expected 'shard' or 'replicate', found {teacher_sharding!r}")
    if fsdp and world_size < 2:
        raise ValueError(
            "fsdp=True shards the student over processes: expected a run over several processes "
            "(torchrun / accelerate launch), found 1"
        )
    if cpu_offload and not fsdp:
        raise ValueError("cpu_offload offloads FSDP2 shards: expected fsdp=True with it, found fsdp=False")
    if teacher_sharding == "shard" and world_size < 2:
        raise ValueError(
            f"teacher_sharding='shard': expected a run over several processes (torchrun / accelerate "
            f"launch), found {world_size}"
        )
    if teacher_device_map is not None and teacher_sharding == "shard":
        raise ValueError(
            "teacher_device_map spreads a whole teacher over one process's devices: expected "
            "teacher_sharding='replicate' with it, found 'shard'"
        )
    if teacher_sharding is None:
        teacher_sharding = "shard" if fsdp and world_size > 1 and teacher_device_map is None else "replicate"
    return teacher_sharding


def check_run(config: DistillConfig, windows: int, seq_len: int, world: int) -> tuple[int, int]:
    """The number of steps and the per-process micro batch of ``config`` on ``windows`` training windows of
    ``seq_len`` tokens over ``world`` processes; ``ValueError`` for impossible options, and for a corpus
    too small for the steps asked (with the numbers)."""
    c = config
    if (c.steps is None) == (c.tokens is None):
        raise ValueError(
            f"expected exactly one of steps and tokens, found steps={c.steps}, tokens={c.tokens}"
        )
    if min(c.batch_size, c.micro_batch_size or 1, c.log_every, c.keep_checkpoints) < 1:
        raise ValueError(
            f"expected batch_size, micro_batch_size, log_every and keep_checkpoints >= 1, found "
            f"{c.batch_size}, {c.micro_batch_size}, {c.log_every} and {c.keep_checkpoints}"
        )
    steps = math.ceil(c.tokens / (c.batch_size * seq_len)) if c.tokens is not None else int(c.steps or 0)
    if steps < 1:
        raise ValueError(f"expected at least one step, found steps={steps} (tokens={c.tokens})")
    if windows < c.batch_size:
        raise ValueError(
            f"train_data: expected at least batch_size={c.batch_size} windows of {seq_len} tokens for one "
            f"step, found {windows} ({windows * seq_len:,} tokens)"
        )
    return steps, check_batch(c.batch_size, c.micro_batch_size, world)


def check_batch(batch_size: int, micro_batch_size: int | None, world: int) -> int:
    """The per-process micro batch: ``micro_batch_size``, or by default each process's share of the
    ``batch_size`` windows of a step; ``ValueError`` unless the processes' micro batches add up to it."""
    if batch_size < 1 or (micro_batch_size or 1) < 1:
        raise ValueError(
            f"expected batch_size and micro_batch_size >= 1, found {batch_size} and {micro_batch_size}"
        )
    if not micro_batch_size:
        if batch_size < world or batch_size % world:
            raise ValueError(
                f"expected batch_size ({batch_size}) to be a multiple of the processes ({world}): each "
                f"process takes an equal share of a step's windows"
            )
        return batch_size // world
    if batch_size % (world * micro_batch_size):
        raise ValueError(
            f"expected batch_size ({batch_size}) to be a multiple of processes ({world}) x "
            f"micro_batch_size ({micro_batch_size})"
        )
    return micro_batch_size


def check_same_vocabulary(student=None, teacher=None, student_tokenizer=None, teacher_tokenizer=None) -> None:
    """Raise ``ValueError`` unless student and teacher predict the same vocabulary.

    The models' output (lm_head) sizes must be equal and, when both tokenizers are given, so must their
    token -> id maps. Either pair may be None (not compared).
    """
    if student is not None and teacher is not None:
        sizes = [m.get_output_embeddings().weight.shape[0] for m in (student, teacher)]
        if sizes[0] != sizes[1]:
            raise ValueError(
                f"teacher and student must share a vocabulary: expected the student's lm_head to have "
                f"the teacher's {sizes[1]} outputs, found {sizes[0]}"
            )
    if student_tokenizer is not None and teacher_tokenizer is not None:
        vocabs = [t.get_vocab() for t in (student_tokenizer, teacher_tokenizer)]
        if vocabs[0] != vocabs[1]:
            differ = sorted(set(vocabs[0].items()) ^ set(vocabs[1].items()), key=lambda kv: kv[1])
            raise ValueError(
                f"teacher and student must share a tokenizer: expected equal vocabularies, found "
                f"{len(vocabs[0])} and {len(vocabs[1])} tokens, {len(differ)} (token, id) pairs in "
                f"only one of them, e.g. {differ[:3]}"
            )
