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
from safetensors import safe_open
from transformers import (
    AutoConfig,
    AutoTokenizer,
    PreTrainedModel,
    TrainerCallback,
    TrainingArguments,
    default_data_collator,
)
from transformers.trainer_callback import PrinterCallback, ProgressCallback
from transformers.trainer_utils import get_last_checkpoint

from ..checkpoint.folder import MANIFEST_NAME
from ..checkpoint.output import copy_other_files, plan_other_files
from ..corpus import check_data, data_spec
from ..corpus.dataset import WindowDataset, first_windows, open_windows
from ..io.loading import load_pretrained
from ..runtime.fileio import write_json_atomic
from .fsdp import (
    check_shardable,
    has_checkpointed_layers,
    is_sharded,
    load_sharded_models,
    shard_student,
    shard_teacher,
    student_dtype,
)
from .memory import meta_model
from .options import DistillConfig, check_options, check_run, check_same_vocabulary, fsdp_asked
from .output import read_tensors, save_model_folder
from .records import (
    LOG_NAME,
    PLOT_NAME,
    STAGING,
    DiskFullGuard,
    check_output_folder,
    loss_summary,
    plot_history,
    run_manifest,
)
from .trainer import DistillationTrainer, RunCallback, TokenWindows, as_windows, signals_stop

__all__ = ["distill", "distill_checkpoint", "default_seq_len", "CARRIED_PREFIXES"]


def _as_config(config: Any, legacy: dict[str, Any]) -> DistillConfig:
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
    config = _as_config(config, legacy)
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
        if config.overwrite and saving and checkpoint is None and out.exists() and _rank() == 0:
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


def _rank() -> int:
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
    run = RunCallback(trainer, lambda logs: write_log("running"), out is not None, data)
    trainer.add_callback(run)
    dtype = config.output_dtype
    dtype = getattr(torch, dtype.removeprefix("torch.")) if isinstance(dtype, str) else dtype
    with DiskFullGuard(out, trainer.model) as guard:
        with signals_stop(trainer.accelerator) as signals:
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


_MAX_SEQ_LEN = 2048  # default window length of distill_checkpoint, unless the model supports less

# files of the student folder that the trained model replaces (weight files are never copied)
_MODEL_FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors.index.json",
    "pytorch_model.bin.index.json",
    "gdnprune.json",
)
#: tensors transformers does not load that the output carries over from the student unchanged
CARRIED_PREFIXES = ("mtp.",)


def _same_file(a: Path, b: Path) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def default_seq_len(config) -> int:
    """The window length :func:`distill_checkpoint` uses by default: the model's ``max_position_embeddings``,
    at most 2048."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return min(_MAX_SEQ_LEN, getattr(text, "max_position_embeddings", None) or _MAX_SEQ_LEN)


def stored_dtype(folder: str | Path) -> torch.dtype | None:
    """The dtype a model folder stores its floating-point weights in (the first such tensor's), or None."""
    for file in sorted(Path(folder).glob("*.safetensors")):
        with safe_open(file, "pt") as f:
            for name in f.keys():
                dtype = f.get_slice(name).get_dtype()
                mapped = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}.get(dtype)
                if mapped is not None:
                    return mapped
    return None


def _load_model(path: Path, dtype, device_map=None):
    """The model class named in ``config.json`` (whole vision-language models too), else AutoModelForCausalLM;
    per-layer GDN geometries (a gdnprune plan's output) through :func:`gdnprune.load_pretrained`."""
    try:
        return load_pretrained(
            path, dtype=dtype, **({} if device_map is None else {"device_map": device_map})
        )
    except (OSError, RuntimeError, ValueError) as exc:
        raise ValueError(f"{path}: transformers cannot load it: {' '.join(str(exc).split())[:500]}") from None


def _check_folders(student_dir: Path, teacher_dir: Path, output_dir: Path) -> None:
    for name, folder in (("student", student_dir), ("teacher", teacher_dir)):
        if not (folder / "config.json").is_file():
            raise ValueError(f"{name}: expected a Hugging Face model folder with config.json, found {folder}")
        if any(
            _same_file(above, folder) for above in (output_dir.absolute(), *output_dir.absolute().parents)
        ):
            raise ValueError(
                f"output folder {output_dir}: expected a folder outside the {name} folder {folder}, "
                f"found it is (or is inside) that folder"
            )


def _tokenizers(student_dir: Path, teacher_dir: Path):
    tokenizer = AutoTokenizer.from_pretrained(student_dir)
    try:
        teacher_tokenizer = AutoTokenizer.from_pretrained(teacher_dir)
    except (OSError, ValueError):
        teacher_tokenizer = None
        warnings.warn(
            f"no tokenizer in {teacher_dir}: only the vocabulary sizes of teacher and student are compared",
            stacklevel=3,
        )
    check_same_vocabulary(student_tokenizer=tokenizer, teacher_tokenizer=teacher_tokenizer)
    return tokenizer, teacher_tokenizer


def _evenly(dataset: WindowDataset, count: int | None) -> WindowDataset:
    """``count`` evenly spaced windows of ``dataset`` (all when None or more than it has)."""
    if count is None or count >= len(dataset):
        return dataset
    step = len(dataset) // count
    return dataset.select(range(0, step * count, step))


def distill_checkpoint(
    student_dir: str | Path,
    teacher_dir: str | Path,
    data: Any,
    output_dir: str | Path | None = None,
    *,
    config: DistillConfig | None = None,
    seq_len: int | None = None,
    num_samples: int | None = None,
    eval_data: Any = None,
    eval_samples: int | None = None,
    data_cache: str | Path | None = None,
    dtype: str | torch.dtype = torch.float32,
    teacher_dtype: str | torch.dtype | None = None,
    teacher_device_map: Any = None,
    callbacks: Sequence[TrainerCallback] = (),
    data_progress: bool | None = None,
    sharded_loading: bool = True,
    **legacy: Any,
) -> dict[str, Any]:
    """:func:`distill` on Hugging Face folders: the student in ``student_dir`` from the teacher in ``teacher_dir``,
    into ``output_dir`` (default ``config.output_dir``), with the options of ``config``.

    ``data`` (and ``eval_data``): files, folders, globs or a mixture (:func:`gdnprune.corpus.data_spec`),
    checked before any model loads, tokenised once with the student's tokenizer into the memory-mapped
    cache in ``data_cache`` (default :func:`gdnprune.corpus.default_cache_dir`; a bar on the first process
    unless ``data_progress`` is False, default ``config.progress``) and read window by window, each
    process only its own; ``seq_len`` tokens per window (default :func:`default_seq_len`);
    ``num_samples``: evenly spaced training windows; ``eval_samples``: the first held-out windows. A corpus
    with fewer windows than a step takes is refused before any model loads, with the numbers; one that
    the run goes over more than once is said with a warning. The student loads in ``dtype`` (the
    optimizer's master weights), the teacher in ``teacher_dtype`` (default: the same), spread by
    ``teacher_device_map`` if given. Under FSDP2 (``sharded_loading``, the default) each model is built
    on the ``meta`` device, sharded, and each process reads only its own rows from the safetensors files
    (:func:`gdnprune.io.sharded_loading.load_sharded`): no process holds a whole student or teacher. FP8 block-scaled
    weights are dequantized as read, MoE experts stored one tensor per expert are stacked as read (and
    OLMo-hybrid's ``q/k/v_conv1d`` concatenated, as transformers converts them), a text
    model reads a vision-language folder's prefixed tensors, a bf16/fp16 student under mixed precision gets
    float32 master weights (as accelerate upcasts it), and a student under gradient checkpointing has its
    layers wrapped before it is sharded. A quantization other than FP8 blocks is refused; a folder that
    stores a tensor in another form loads whole on every process and is sharded after (a warning line
    names the tensor). Teacher and student must share their tokenizer. The output folder is
    checked before any model is loaded.

    The output is a normal HF folder: the trained weights (in the dtype the student folder stores, unless
    ``config.output_dtype`` says otherwise) and config (``per_layer_config`` kept), the student's ``mtp.*``
    tensors unchanged, the tokenizer, every other file of ``student_dir`` that is not a weight file, the
    ``gdnprune.json`` record of the run, the log and the plot (and the checkpoints, if kept). The output
    may not be, or lie inside, the student or teacher folder. The older form (the options as keywords)
    warns and works for one release.
    """
    if isinstance(output_dir, DistillConfig):  # distill_checkpoint(student, teacher, data, config)
        config, output_dir = output_dir, None
    config = _as_config(config if config is not None else DistillConfig(), legacy)
    if output_dir is not None:
        config = config.replace(output_dir=output_dir)
    student_dir, teacher_dir = Path(student_dir), Path(teacher_dir)
    output_dir = Path(config.output_dir) if config.output_dir is not None else None
    if output_dir is None:
        raise ValueError("output_dir: expected the folder to write, found None")
    _check_folders(student_dir, teacher_dir, output_dir)
    check_output_folder(output_dir, config.resume, config.overwrite)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    sharding = check_options(
        world_size=world,
        fsdp=fsdp_asked(config.fsdp),
        teacher_sharding=config.teacher_sharding,
        teacher_device_map=teacher_device_map,
        mixed_precision=config.mixed_precision,
        cpu_offload=config.cpu_offload,
    )
    tokenizer, teacher_tokenizer = _tokenizers(student_dir, teacher_dir)
    spec, eval_spec = data_spec(data), None if eval_data is None else data_spec(eval_data)
    files = check_data(spec, tokenizer=tokenizer)
    eval_files = None if eval_spec is None else check_data(eval_spec, tokenizer=tokenizer)
    seq_len = seq_len or default_seq_len(AutoConfig.from_pretrained(student_dir))
    main = _rank() == 0
    windows = _evenly(
        open_windows(
            spec,
            tokenizer,
            seq_len=seq_len,
            cache_dir=data_cache,
            files=files,
            progress=main and (config.progress if data_progress is None else data_progress),
        ),
        num_samples,
    )
    _check_corpus_size(config, len(windows), seq_len, world)
    eval_windows = None
    if eval_spec is not None:
        eval_windows = first_windows(
            eval_spec, tokenizer, seq_len=seq_len, num_windows=eval_samples, files=eval_files
        )
    teacher_dtype = dtype if teacher_dtype is None else teacher_dtype
    student, teacher = _load_models(
        student_dir, teacher_dir, dtype, teacher_dtype, teacher_device_map, config, sharding, sharded_loading
    )
    carried = (
        {k: v for p in CARRIED_PREFIXES for k, v in read_tensors(student_dir, p).items()} if main else {}
    )
    if config.output_dtype is None:
        config = config.replace(output_dtype=stored_dtype(student_dir))
    result = distill(
        student,
        teacher,
        windows,
        config,
        eval_data=eval_windows,
        tokenizer=tokenizer,
        teacher_tokenizer=teacher_tokenizer,
        extra_tensors=carried,
        callbacks=callbacks,
    )
    if not result["interrupted"] and main:
        others, _ = plan_other_files(student_dir, skip=set(_MODEL_FILES))
        copy_other_files(student_dir, output_dir, [f for f in others if not (output_dir / f).exists()])
        manifest = run_manifest(student_dir, teacher_dir, spec, result, sorted(carried))
        write_json_atomic(output_dir / MANIFEST_NAME, manifest)
    return result


def _load_models(
    student_dir: Path,
    teacher_dir: Path,
    dtype: str | torch.dtype,
    teacher_dtype: str | torch.dtype,
    teacher_device_map: Any,
    config: DistillConfig,
    sharding: str,
    sharded_loading: bool,
) -> tuple[Any, Any]:
    """The student and the teacher of :func:`distill_checkpoint`: under FSDP2 with ``sharded_loading`` read
    straight into their shards (what FSDP2 cannot wrap said first, in the run's dtypes), else loaded whole."""
    if fsdp_asked(config.fsdp):  # what FSDP2 cannot wrap is said before any weight is read
        check_shardable(meta_model(student_dir, student_dtype(dtype, config.mixed_precision)), "student")
        if sharding == "shard":
            check_shardable(meta_model(teacher_dir, teacher_dtype), "teacher")
    if fsdp_asked(config.fsdp) and sharded_loading:
        from accelerate import PartialState  # lazy: only under FSDP2

        PartialState()  # the process group the shards live on (the Trainer's arguments find it made)
        student, teacher = load_sharded_models(
            student_dir, teacher_dir, dtype, teacher_dtype, config=config, teacher_sharded=sharding == "shard"
        )
        student = student if student is not None else _load_model(student_dir, dtype)
        teacher = (
            teacher if teacher is not None else _load_model(teacher_dir, teacher_dtype, teacher_device_map)
        )
    else:
        student = _load_model(student_dir, dtype)
        teacher = _load_model(teacher_dir, teacher_dtype, teacher_device_map)
    return student, teacher


def _check_corpus_size(config: DistillConfig, windows: int, seq_len: int, world: int) -> None:
    """Refuse a corpus too small for one step, and say when the run goes over it more than once."""
    steps, _ = check_run(config, windows, seq_len, world)
    asked = steps * config.batch_size
    if asked > windows:
        warnings.warn(
            f"the training data gives {windows:,} windows of {seq_len} tokens ({windows * seq_len:,} tokens); "
            f"{steps:,} steps x {config.batch_size} windows ask for {asked:,}, so the run goes over it "
            f"{asked / windows:.1f} times",
            stacklevel=3,
        )
