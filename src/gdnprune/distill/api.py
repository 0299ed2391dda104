"""``distill`` and ``distill_checkpoint``: recovery runs on models in memory and on Hugging Face folders.

:func:`distill` checks a :class:`DistillConfig` against the data and the engine, builds the Trainer's
``TrainingArguments`` from it and runs the Trainer; the output folder (checkpoints, final model, log,
plot) follows :mod:`.records` and :mod:`.output`. :func:`distill_checkpoint` reads the models and the
text from folders and files, carries the student's ``mtp.*`` tensors and other files over and writes
``gdnprune.json``.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import tempfile
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import (
    PreTrainedModel,
    TrainerCallback,
    TrainingArguments,
    default_data_collator,
)
from transformers.trainer_callback import PrinterCallback, ProgressCallback
from transformers.trainer_utils import get_last_checkpoint

from ..corpus.dataset import WindowDataset
from ..model.kernels import cpu_gdn_kernels
from ..runtime.fileio import write_json_atomic
from .fsdp import (
    check_shardable,
    has_checkpointed_layers,
    is_sharded,
    shard_student,
    shard_teacher,
)
from .options import DistillConfig, check_options, check_run, check_same_vocabulary, fsdp_asked
from .output import save_model_folder
from .records import (
    LOG_NAME,
    PLOT_NAME,
    STAGING,
    DiskFullGuard,
    check_output_folder,
    loss_summary,
    plot_history,
)
from .trainer import DistillationTrainer, RunCallback, TokenWindows, as_windows, signals_stop

__all__ = ["as_config", "distill", "process_rank"]


def as_config(config: Any, legacy: dict[str, Any]) -> DistillConfig:
    """``config`` as a :class:`DistillConfig`; the older form (``output_dir`` in its place and the options as
    keywords) still works for one release, with a ``FutureWarning``."""
    if isinstance(config, DistillConfig) and not legacy:
        return config
    warnings.warn(
        "distill(student, teacher, data, output_dir, steps=..., ...) is deprecated and will be removed in "
        "the next release: pass the options as one DistillConfig, distill(student, teacher, data, "
        "DistillConfig(output_dir=..., steps=..., ...))",
        FutureWarning,
        stacklevel=3,
    )
    if isinstance(config, DistillConfig):
        return config.replace(**legacy)
    return DistillConfig(output_dir=config, **legacy)


# long: its documented signature and docstring; the body is 44 lines, one step after another
def distill(
    student: PreTrainedModel,
    teacher: PreTrainedModel,
    train_data: torch.Tensor | Sequence[torch.Tensor] | WindowDataset,
    config: DistillConfig | str | Path | None = None,
    *,
    eval_data: torch.Tensor | Sequence[torch.Tensor] | None = None,
    tokenizer: Any = None,
    teacher_tokenizer: Any = None,
    extra_tensors: dict[str, torch.Tensor] | None = None,
    callbacks: Sequence[TrainerCallback] = (),
    **legacy: Any,
) -> dict[str, Any]:
    """Distil ``student`` (trained in place) from the frozen ``teacher`` on token windows, as ``config`` says.

    ``train_data`` (and ``eval_data``) are windows ``[N, seq_len]`` of token ids, e.g. from
    :func:`gdnprune.quality.calibration.pack_windows`; every step takes ``config.batch_size`` of them (over all
    processes under ``torchrun``), reshuffled every epoch with ``config.seed``. The loss
    (:func:`distillation_loss`) is computed inside the models' forward passes. Engine: DDP by default,
    FSDP2 with ``config.fsdp`` (or an ``accelerate launch`` FSDP config); see :class:`DistillConfig`.

    With ``config.output_dir``: checkpoints ``checkpoint-STEP`` (removed when the run finishes unless
    ``config.remove_checkpoints`` is False), the final model (gathered tensor by tensor, written by the
    first process as ``save_pretrained`` writes it, in ``config.output_dtype``, plus ``extra_tensors``) and
    ``tokenizer``, the log :data:`LOG_NAME` and the plot :data:`PLOT_NAME`. ``config.resume`` continues
    from the last checkpoint (same data order; the options that shape the run must be the same). Ctrl-C
    (SIGTERM, SIGHUP) saves a checkpoint at the end of the step and returns with ``interrupted=True``; a
    second Ctrl-C a second later raises ``KeyboardInterrupt``. A full disk raises :class:`DiskFullError`
    and leaves no final model. ``eval_data`` is evaluated before training, every ``config.eval_every``
    steps and at the end.

    Returns a dict: ``config`` (the options, ``processes``), ``steps`` done, ``tokens``, ``interrupted``,
    ``signal``, ``resumed_from``, ``checkpoint`` (last one kept), ``checkpoints_removed``, ``train_loss``
    (the last step's), ``losses`` (:func:`loss_summary`), ``eval`` (last evaluation: ``loss``,
    ``kd_loss``, ``lm_loss``, ``teacher_lm_loss``), ``history`` (the Trainer's log history), ``seconds``,
    ``log`` and ``plot`` paths, and ``trainer``.

    The older form ``distill(student, teacher, data, output_dir, steps=..., ...)`` still works for one
    release and warns (``FutureWarning``).
    """
    start = time.perf_counter()
    config = as_config(config, legacy)
    windows = _as_windows(train_data, "train_data")
    eval_windows = None if eval_data is None else _as_windows(eval_data, "eval_data")
    record, steps, micro = _checked_run(
        config, student, teacher, windows, eval_windows, tokenizer, teacher_tokenizer
    )
    temporary = tempfile.TemporaryDirectory() if config.output_dir is None else None
    saving = temporary is None
    out = Path(temporary.name if temporary is not None else str(config.output_dir))
    try:
        checkpoint = check_output_folder(out, config.resume, config.overwrite, record) if saving else None
        if config.overwrite and saving and checkpoint is None and out.exists() and process_rank() == 0:
            shutil.rmtree(out)
        if fsdp_asked(config.fsdp) and not is_sharded(student) and not _upcast_by_accelerate(student, config):
            _shard_whole_student(student, config)
        args = _training_arguments(config, out, steps, micro, saving, eval_windows is not None, checkpoint,
                                   checkpoint_wrapped=has_checkpointed_layers(student))  # fmt: skip
        if record["teacher_sharding"] == "shard" and not is_sharded(teacher):
            shard_teacher(teacher)  # after TrainingArguments: the process group exists
        trainer = DistillationTrainer(
            model=student,
            teacher=teacher,
            args=args,
            train_dataset=windows.dataset,
            eval_dataset=None if eval_windows is None else eval_windows.dataset,
            data_collator=default_data_collator,
            processing_class=tokenizer,
            temperature=config.temperature,
            kd_weight=config.kd_weight,
            lm_weight=config.lm_weight,
            chunk_size=config.chunk_size,
            callbacks=list(callbacks),
        )
        if not config.progress:
            trainer.remove_callback(PrinterCallback)
            trainer.remove_callback(ProgressCallback)
        result = _train(
            trainer, config, record, out if saving else None, checkpoint, tokenizer, extra_tensors
        )
        result.update(
            tokens=result["steps"] * config.batch_size * windows.seq_len, seconds=time.perf_counter() - start
        )
        return result
    finally:
        if temporary is not None:
            temporary.cleanup()


def _upcast_by_accelerate(student: torch.nn.Module, config: DistillConfig) -> bool:
    """Whether accelerate's FSDP2 preparation must shard ``student``: a low-precision one under mixed
    precision, which it upcasts to float32 first."""
    low = any(p.dtype in (torch.bfloat16, torch.float16) for p in student.parameters())
    return low and config.mixed_precision != "no"


def _shard_whole_student(student: PreTrainedModel, config: DistillConfig) -> None:
    """``student`` sharded in place as sharded loading shards it (:func:`shard_student`: the vocabulary in
    units the loss never gathers), rather than by accelerate's preparation."""
    from accelerate import PartialState  # lazy: only under FSDP2

    PartialState()  # the process group the shards live on
    shard_student(
        student,
        mixed_precision=config.mixed_precision,
        cpu_offload=config.cpu_offload,
        gradient_checkpointing=config.gradient_checkpointing,
    )


@dataclass(frozen=True)
class _Windows:
    """Training or eval windows as the Trainer reads them: a dataset of ``{"input_ids"}``, its size, window
    length and a fingerprint of its content (a hash of the tokens in memory; of the cache streams, the
    window length and the selection for a corpus on disk)."""

    dataset: torch.utils.data.Dataset
    count: int
    seq_len: int
    sha256: str


def _as_windows(data: Any, name: str) -> _Windows:
    if isinstance(data, WindowDataset):
        streams = [s.fingerprint for s in data.windows.streams]
        r = data.indices
        key = json.dumps([streams, data.seq_len, [r.start, r.stop, r.step]])
        return _Windows(data, len(data), data.seq_len, hashlib.sha256(key.encode()).hexdigest())
    windows = as_windows(data, name)
    sha = hashlib.sha256(windows.contiguous().numpy().tobytes()).hexdigest()
    return _Windows(TokenWindows(windows), windows.shape[0], windows.shape[1], sha)


def process_rank() -> int:
    """This process's rank under a launcher (``RANK``), 0 alone."""
    return int(os.environ.get("RANK", "0"))


def _checked_run(config, student, teacher, windows, eval_windows, tokenizer, teacher_tokenizer):
    """The run's record of options (``config`` of the log), its steps and micro batch, after every check that
    needs no work."""
    world = int(os.environ.get("WORLD_SIZE", "1"))  # set by torchrun / accelerate launch
    fsdp = fsdp_asked(config.fsdp)
    teacher_sharding = check_options(
        world_size=world,
        fsdp=fsdp,
        teacher_sharding=config.teacher_sharding,
        teacher_device_map=getattr(teacher, "hf_device_map", None),
        mixed_precision=config.mixed_precision,
        cpu_offload=config.cpu_offload,
    )
    steps, micro = check_run(config, windows.count, windows.seq_len, world)
    check_same_vocabulary(student, teacher, tokenizer, teacher_tokenizer)
    if fsdp:
        check_shardable(student, "student")
    if teacher_sharding == "shard" and not is_sharded(teacher):
        check_shardable(teacher, "teacher")
    c = config
    record = dict(
        steps=steps,
        batch_size=c.batch_size,
        micro_batch_size=micro,
        seq_len=windows.seq_len,
        lr=c.lr,
        lr_schedule=c.lr_schedule,
        warmup=c.warmup,
        weight_decay=c.weight_decay,
        max_grad_norm=c.max_grad_norm,
        temperature=c.temperature,
        kd_weight=c.kd_weight,
        lm_weight=c.lm_weight,
        seed=c.seed,
        train_windows=windows.count,
        train_sha256=windows.sha256,
        eval_windows=None if eval_windows is None else eval_windows.count,
        processes=world,
        fsdp=fsdp,
        teacher_sharding=teacher_sharding,
        mixed_precision=c.mixed_precision,
        gradient_checkpointing=c.gradient_checkpointing,
        cpu_offload=c.cpu_offload,
        output_dtype=None if c.output_dtype is None else str(c.output_dtype).removeprefix("torch."),
    )
    return record, steps, micro


def _training_arguments(config: DistillConfig, out: Path, steps: int, micro: int, saving: bool,
                        evaluating: bool, checkpoint: Path | None, *,
                        checkpoint_wrapped: bool = False) -> TrainingArguments:  # fmt: skip
    """The Trainer's arguments of the run: the engine (DDP or FSDP2), the schedule, logging and saving.
    ``checkpoint_wrapped``: the student's layers are already wrapped for activation checkpointing (sharded
    loading wraps them before sharding), so accelerate does not wrap them again."""
    c, world = config, int(os.environ.get("WORLD_SIZE", "1"))
    every = max(1, steps // 10)
    engine: dict[str, Any] = {}
    if fsdp_asked(c.fsdp):
        engine = dict(
            fsdp=True,
            fsdp_config={
                "version": 2,
                "reshard_after_forward": True,
                "state_dict_type": "SHARDED_STATE_DICT",
                "cpu_offload": c.cpu_offload,
                "activation_checkpointing": c.gradient_checkpointing and not checkpoint_wrapped,
            },
        )
    elif c.gradient_checkpointing:
        engine = dict(activation_checkpointing=True)
    return TrainingArguments(
        output_dir=str(out),
        max_steps=steps,
        per_device_train_batch_size=micro,
        per_device_eval_batch_size=micro,
        gradient_accumulation_steps=c.batch_size // (world * micro),
        learning_rate=c.lr,
        lr_scheduler_type=c.lr_schedule,
        warmup_steps=c.warmup,
        weight_decay=c.weight_decay,
        max_grad_norm=c.max_grad_norm,
        seed=c.seed,
        bf16=c.mixed_precision == "bf16",
        fp16=c.mixed_precision == "fp16",
        logging_strategy="steps",
        logging_steps=c.log_every,
        logging_first_step=True,
        eval_strategy="steps" if evaluating else "no",
        eval_steps=c.eval_every or every,
        eval_on_start=evaluating and checkpoint is None,
        save_strategy="steps" if saving else "no",
        save_steps=c.save_every or every,
        save_total_limit=c.keep_checkpoints,
        label_names=["input_ids"],
        dataloader_drop_last=True,
        average_tokens_across_devices=False,
        report_to="none",
        disable_tqdm=not c.progress,
        use_cpu=not torch.cuda.is_available(),
        **engine,
    )


def _train(trainer, config: DistillConfig, record: dict, out: Path | None, checkpoint, tokenizer, extra):
    """Run the Trainer, then write the final model, the log and the plot into ``out`` (None: nothing)."""
    main = trainer.is_world_process_zero()

    def write_log(status: str) -> None:
        if out is not None and main:
            payload = {"format": "gdnprune-distill-log", "version": 1, "status": status, "config": record}
            write_json_atomic(out / LOG_NAME, {**payload, "history": trainer.state.log_history})

    data = {"data": record["train_sha256"], "windows": record["train_windows"]}
    data["windows_per_step"] = config.batch_size
    run = RunCallback(
        trainer, lambda logs: write_log("running"), out is not None, data, not config.remove_checkpoints
    )
    trainer.add_callback(run)
    dtype = config.output_dtype
    dtype = getattr(torch, dtype.removeprefix("torch.")) if isinstance(dtype, str) else dtype
    with DiskFullGuard(out, trainer.model) as guard:
        with signals_stop(trainer.accelerator) as signals, cpu_gdn_kernels():
            trainer.train(resume_from_checkpoint=None if checkpoint is None else str(checkpoint))
        if out is not None and not run.interrupted:
            guard.final(dtype)
            _save_final(trainer, out, dtype, tokenizer, extra)
        write_log("interrupted" if run.interrupted else "finished")
    removed = []
    if out is not None and not run.interrupted and config.remove_checkpoints:
        trainer.accelerator.wait_for_everyone()
        removed = sorted(out.glob("checkpoint-*")) if main else []
        for folder in removed:
            shutil.rmtree(folder, ignore_errors=True)
    first = (trainer.state.global_step - len(trainer.step_losses) + 1) if trainer.step_losses else 1
    per_step = trainer.gathered_step_losses()  # a collective: before any process returns
    losses = loss_summary(per_step, first, config.log_every)
    drawn, history = [(first + i, v) for i, v in enumerate(per_step)], trainer.state.log_history
    plot = out is not None and main
    plot = (
        plot
        and out is not None
        and plot_history(history, out / PLOT_NAME, config.kd_weight, config.lm_weight, drawn)
    )
    evals = [h for h in history if "eval_loss" in h]
    return {
        "output_dir": None if out is None else str(out),
        "config": record,
        "steps": trainer.state.global_step,
        "interrupted": run.interrupted,
        "signal": signal.Signals(signals[0]).name if signals else None,
        "resumed_from": None if checkpoint is None else str(checkpoint),
        "checkpoint": get_last_checkpoint(str(out)) if out is not None and out.is_dir() else None,
        "checkpoints_removed": [str(p) for p in removed],
        "train_loss": losses["last"],
        "losses": losses,
        "eval": {k[5:]: v for k, v in evals[-1].items() if k.startswith("eval_")} if evals else None,
        "history": history,
        "log": str(out / LOG_NAME) if out is not None and main else None,
        "plot": str(out / PLOT_NAME) if plot and out is not None else None,
        "trainer": trainer,
    }


def _save_final(trainer, out: Path, dtype: torch.dtype | None, tokenizer, extra) -> None:
    """The final model (and tokenizer) into ``out``, through a staging folder inside it: the weight files and
    the config are moved into place only once all of them are written (the config last), so a failed
    write leaves no folder that looks like a finished model."""
    main = trainer.is_world_process_zero()
    staging = out / STAGING
    if main:
        shutil.rmtree(staging, ignore_errors=True)
    try:
        save_model_folder(trainer.model, staging, main=main, extra=extra, dtype=dtype)
        if tokenizer is not None and main:
            tokenizer.save_pretrained(staging)
        if main:
            names = sorted(p.name for p in staging.iterdir())
            for name in sorted(names, key=lambda n: n == "config.json"):  # the config last
                os.replace(staging / name, out / name)
    finally:
        if main:
            shutil.rmtree(staging, ignore_errors=True)
