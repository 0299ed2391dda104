"""``distill`` and ``distill_checkpoint``: recovery runs on models in memory and on Hugging Face folders.

Also the vocabulary check, the options check (before any model is loaded), the output folder
(checkpoints, final model, JSON log, PNG plot, the ``gdnprune.json`` record of the run) and the resume checks.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import math
import os
import shutil
import signal
import tempfile
import time
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from transformers import TrainerCallback, TrainingArguments, default_data_collator
from transformers.trainer_callback import PrinterCallback, ProgressCallback
from transformers.trainer_utils import get_last_checkpoint

from ..checkpoint.folder import MANIFEST_NAME
from ..checkpoint.output import copy_other_files, plan_other_files
from ..fileio import write_json_atomic
from .fsdp import check_shardable, is_sharded, shard_teacher
from .output import save_model_folder
from .trainer import DistillationTrainer, RunCallback, TokenWindows, as_windows, signals_stop

__all__ = [
    "check_same_vocabulary",
    "check_options",
    "distill",
    "distill_checkpoint",
    "plot_history",
    "OutputFolderError",
    "LOG_NAME",
    "PLOT_NAME",
    "MIXED_PRECISION",
    "ACCELERATE_FSDP2_CONFIG",
]

LOG_NAME = "distill_log.json"
PLOT_NAME = "distill_loss.png"


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


# options that must not change when a run is resumed (all the others only change logging and saving)
_RESUME_KEYS = (
    "steps",
    "batch_size",
    "micro_batch_size",
    "seq_len",
    "lr",
    "lr_schedule",
    "warmup",
    "weight_decay",
    "max_grad_norm",
    "temperature",
    "kd_weight",
    "lm_weight",
    "seed",
    "train_windows",
    "train_sha256",
    "fsdp",
    "mixed_precision",
)

#: the accelerate config shipped for FSDP2 runs (``accelerate launch --config_file ... -m gdnprune distill``)
ACCELERATE_FSDP2_CONFIG = Path(__file__).resolve().parent.parent / "data" / "accelerate_fsdp2.yaml"

#: the mixed-precision modes (parameters keep their dtype; forward and backward run in the low precision)
MIXED_PRECISION = ("no", "bf16", "fp16")


class OutputFolderError(ValueError):
    """The output folder cannot be used as asked. ``reason``: ``"exists"`` (not empty, neither resume nor
    overwrite asked), ``"not_ours"`` (overwrite asked of a folder that is no earlier output) or
    ``"no_checkpoint"`` (resume asked, nothing to resume)."""

    def __init__(self, message: str, *, path: Path, reason: str):
        super().__init__(message)
        self.path, self.reason = path, reason


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


def distill(
    student: torch.nn.Module,
    teacher: torch.nn.Module,
    train_data: torch.Tensor | Sequence[torch.Tensor],
    output_dir: str | Path | None = None,
    *,
    steps: int | None = None,
    tokens: int | None = None,
    batch_size: int = 16,
    micro_batch_size: int | None = None,
    lr: float = 1e-4,
    lr_schedule: str = "cosine",
    warmup: float = 0.0,
    weight_decay: float = 0.0,
    max_grad_norm: float = 1.0,
    temperature: float = 1.0,
    kd_weight: float = 1.0,
    lm_weight: float = 0.0,
    chunk_size: int | None = None,
    eval_data: torch.Tensor | Sequence[torch.Tensor] | None = None,
    eval_every: int | None = None,
    save_every: int | None = None,
    keep_checkpoints: int = 1,
    log_every: int = 10,
    resume: bool | str | Path = False,
    overwrite: bool = False,
    seed: int = 0,
    tokenizer: Any = None,
    teacher_tokenizer: Any = None,
    fsdp: bool = False,
    teacher_sharding: str | None = None,
    mixed_precision: str = "no",
    gradient_checkpointing: bool = False,
    cpu_offload: bool = False,
    extra_tensors: dict[str, torch.Tensor] | None = None,
    progress: bool = True,
    callbacks: Sequence[TrainerCallback] = (),
) -> dict[str, Any]:
    """Distil ``student`` (trained in place) from the frozen ``teacher`` on token windows.

    ``train_data`` (and ``eval_data``) are windows ``[N, seq_len]`` of token ids, e.g. from
    :func:`gdnprune.calibration.pack_windows`; every step takes ``batch_size`` of them (the global batch,
    over all processes under ``torchrun``; ``micro_batch_size`` per process and forward pass, the rest by
    gradient accumulation), reshuffled every epoch with ``seed``. Train for ``steps`` optimizer steps or
    ``tokens`` tokens (rounded up to whole steps). Optimizer: the Trainer's AdamW at ``lr`` with the
    ``lr_schedule`` of transformers (``cosine``, ``linear``, ``constant``, ...) after ``warmup`` steps
    (a float below 1: that fraction of the steps). Loss: :func:`distillation_loss` with ``temperature``,
    ``kd_weight`` and ``lm_weight``, computed inside the models' forward passes.

    Engine: data-parallel (DDP) by default. ``fsdp=True`` (or an ``accelerate launch`` FSDP config) shards
    the student's parameters, gradients and optimizer state with FSDP2 (accelerate's), checkpoints become
    per-process shards (torch DCP), and ``cpu_offload`` keeps shards and optimizer state in CPU memory.
    ``teacher_sharding``: ``"shard"`` (FSDP2, forward only; default with a sharded student) or
    ``"replicate"`` (a whole teacher per process, as given: on one device or spread by a ``device_map``).
    ``mixed_precision`` ``"bf16"`` / ``"fp16"``: forward and backward in that precision, parameters,
    optimizer and gradient reductions in the parameters' dtype (float32). ``gradient_checkpointing``
    recomputes the decoder layers in the backward pass.

    With ``output_dir``: a checkpoint every ``save_every`` steps (default: a tenth of the run) into
    ``output_dir/checkpoint-STEP`` (model, optimizer, scheduler and RNG state; the last
    ``keep_checkpoints`` are kept), the final model (gathered tensor by tensor, written by the first
    process, as ``save_pretrained`` writes it, plus ``extra_tensors`` as given) and ``tokenizer`` into
    ``output_dir``, the log :data:`LOG_NAME` and the plot :data:`PLOT_NAME`. ``resume=True`` continues from
    the last checkpoint there (or from the checkpoint folder given) with the same data order; the options
    that shape the run must be the same. Ctrl-C (or SIGTERM, SIGHUP) saves a checkpoint at the end of the
    current step and returns with ``interrupted=True`` and ``signal`` its name; a second Ctrl-C, a
    second later, raises ``KeyboardInterrupt`` at once. Without ``output_dir`` nothing is written.
    ``eval_data`` is evaluated before training and every ``eval_every`` steps (default: a tenth of the
    run) and at the end.

    Returns a dict: ``config`` (the options, ``processes``), ``steps`` done, ``tokens``, ``interrupted``,
    ``signal``, ``resumed_from``, ``checkpoint`` (last one saved), ``train_loss`` (last logged), ``eval``
    (last evaluation: ``loss``, ``kd_loss``, ``lm_loss``, ``teacher_lm_loss``), ``history`` (the Trainer's
    log history), ``seconds``, ``log`` and ``plot`` paths, and ``trainer`` (the Trainer, for its model
    and optimizer).
    """
    start = time.perf_counter()
    windows = as_windows(train_data, "train_data")
    eval_windows = None if eval_data is None else as_windows(eval_data, "eval_data")
    world = int(os.environ.get("WORLD_SIZE", "1"))  # set by torchrun / accelerate launch
    fsdp = _fsdp(fsdp)
    device_map = getattr(teacher, "hf_device_map", None)
    teacher_sharding = check_options(
        world_size=world,
        fsdp=fsdp,
        teacher_sharding=teacher_sharding,
        teacher_device_map=device_map,
        mixed_precision=mixed_precision,
        cpu_offload=cpu_offload,
    )
    steps, micro = _check_run(
        windows, steps, tokens, batch_size, micro_batch_size, world, log_every, keep_checkpoints
    )
    check_same_vocabulary(student, teacher, tokenizer, teacher_tokenizer)
    if fsdp:
        check_shardable(student, "student")
    if teacher_sharding == "shard" and not is_sharded(teacher):
        check_shardable(teacher, "teacher")
    config = dict(
        steps=steps,
        batch_size=batch_size,
        micro_batch_size=micro,
        seq_len=windows.shape[1],
        lr=lr,
        lr_schedule=lr_schedule,
        warmup=warmup,
        weight_decay=weight_decay,
        max_grad_norm=max_grad_norm,
        temperature=temperature,
        kd_weight=kd_weight,
        lm_weight=lm_weight,
        seed=seed,
        train_windows=windows.shape[0],
        train_sha256=hashlib.sha256(windows.contiguous().numpy()).hexdigest(),
        eval_windows=None if eval_windows is None else eval_windows.shape[0],
        processes=world,
        fsdp=fsdp,
        teacher_sharding=teacher_sharding,
        mixed_precision=mixed_precision,
        gradient_checkpointing=gradient_checkpointing,
        cpu_offload=cpu_offload,
    )

    temporary = tempfile.TemporaryDirectory() if output_dir is None else None
    saving, out = temporary is None, Path(temporary.name if temporary else output_dir)
    checkpoint = check_output_folder(out, resume, overwrite, config) if saving else None
    if overwrite and saving and checkpoint is None and out.exists() and int(os.environ.get("RANK", "0")) == 0:
        shutil.rmtree(out)
    every = max(1, steps // 10)
    engine: dict[str, Any] = {}
    if fsdp:
        engine = dict(
            fsdp=True,
            fsdp_config={
                "version": 2,
                "reshard_after_forward": True,
                "state_dict_type": "SHARDED_STATE_DICT",
                "cpu_offload": cpu_offload,
                "activation_checkpointing": gradient_checkpointing,
            },
        )
    elif gradient_checkpointing:
        engine = dict(activation_checkpointing=True)
    args = TrainingArguments(
        output_dir=str(out),
        max_steps=steps,
        per_device_train_batch_size=micro,
        per_device_eval_batch_size=micro,
        gradient_accumulation_steps=batch_size // (world * micro),
        learning_rate=lr,
        lr_scheduler_type=lr_schedule,
        warmup_steps=warmup,
        weight_decay=weight_decay,
        max_grad_norm=max_grad_norm,
        seed=seed,
        bf16=mixed_precision == "bf16",
        fp16=mixed_precision == "fp16",
        logging_strategy="steps",
        logging_steps=log_every,
        logging_first_step=True,
        eval_strategy="no" if eval_windows is None else "steps",
        eval_steps=eval_every or every,
        eval_on_start=eval_windows is not None and checkpoint is None,
        save_strategy="steps" if saving else "no",
        save_steps=save_every or every,
        save_total_limit=keep_checkpoints,
        label_names=["input_ids"],
        dataloader_drop_last=True,
        average_tokens_across_devices=False,
        report_to="none",
        disable_tqdm=not progress,
        use_cpu=not torch.cuda.is_available(),
        **engine,
    )
    if teacher_sharding == "shard" and not is_sharded(teacher):
        shard_teacher(teacher)  # after TrainingArguments: the process group exists
    trainer = DistillationTrainer(
        model=student,
        teacher=teacher,
        args=args,
        train_dataset=TokenWindows(windows),
        eval_dataset=None if eval_windows is None else TokenWindows(eval_windows),
        data_collator=default_data_collator,
        processing_class=tokenizer,
        temperature=temperature,
        kd_weight=kd_weight,
        lm_weight=lm_weight,
        chunk_size=chunk_size,
        callbacks=list(callbacks),
    )
    if not progress:
        trainer.remove_callback(PrinterCallback)
        trainer.remove_callback(ProgressCallback)

    def write_log(status: str) -> None:
        if saving and trainer.is_world_process_zero():
            payload = {
                "format": "gdnprune-distill-log",
                "version": 1,
                "status": status,
                "config": config,
                "history": trainer.state.log_history,
            }
            write_json_atomic(out / LOG_NAME, payload)

    run = RunCallback(trainer, lambda logs: write_log("running"), saving)
    trainer.add_callback(run)
    try:
        with signals_stop(trainer.accelerator) as signals:
            trainer.train(resume_from_checkpoint=None if checkpoint is None else str(checkpoint))
        if saving and not run.interrupted:
            save_model_folder(trainer.model, out, main=trainer.is_world_process_zero(), extra=extra_tensors)
            if tokenizer is not None and trainer.is_world_process_zero():
                tokenizer.save_pretrained(out)
        write_log("interrupted" if run.interrupted else "finished")
        written = saving and trainer.is_world_process_zero()
        plot = written and plot_history(trainer.state.log_history, out / PLOT_NAME)
        history = trainer.state.log_history
        evals = [h for h in history if "eval_loss" in h]
        return {
            "output_dir": str(out) if saving else None,
            "config": config,
            "steps": trainer.state.global_step,
            "tokens": trainer.state.global_step * batch_size * windows.shape[1],
            "interrupted": run.interrupted,
            "signal": signal.Signals(signals[0]).name if signals else None,
            "resumed_from": None if checkpoint is None else str(checkpoint),
            "checkpoint": get_last_checkpoint(str(out)) if saving else None,
            "train_loss": next((h["loss"] for h in reversed(history) if "loss" in h), None),
            "eval": {k[5:]: v for k, v in evals[-1].items() if k.startswith("eval_")} if evals else None,
            "history": history,
            "seconds": time.perf_counter() - start,
            "log": str(out / LOG_NAME) if written else None,
            "plot": str(out / PLOT_NAME) if plot else None,
            "trainer": trainer,
        }
    finally:
        if temporary is not None:
            temporary.cleanup()


def _fsdp(asked: bool) -> bool:
    """FSDP asked for, or set by ``accelerate launch`` with an FSDP config."""
    return bool(asked) or os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true"


def _check_run(windows, steps, tokens, batch_size, micro_batch_size, world, log_every, keep_checkpoints):
    """The number of steps and the per-process micro batch; ``ValueError`` for impossible options."""
    if (steps is None) == (tokens is None):
        raise ValueError(f"expected exactly one of steps and tokens, found steps={steps}, tokens={tokens}")
    if min(batch_size, micro_batch_size or 1, log_every, keep_checkpoints) < 1:
        raise ValueError(
            f"expected batch_size, micro_batch_size, log_every and keep_checkpoints >= 1, found "
            f"{batch_size}, {micro_batch_size}, {log_every} and {keep_checkpoints}"
        )
    steps = math.ceil(tokens / (batch_size * windows.shape[1])) if tokens is not None else steps
    if steps < 1:
        raise ValueError(f"expected at least one step, found steps={steps} (tokens={tokens})")
    if windows.shape[0] < batch_size:
        raise ValueError(
            f"train_data: expected at least batch_size={batch_size} windows, found {windows.shape[0]}"
        )
    micro = micro_batch_size or batch_size // world
    if micro < 1 or batch_size % (world * micro):
        raise ValueError(
            f"expected batch_size ({batch_size}) to be a multiple of processes ({world}) x "
            f"micro_batch_size ({micro})"
        )
    return steps, micro


def check_output_folder(
    out: str | Path, resume: bool | str | Path, overwrite: bool, config: dict | None = None
) -> Path | None:
    """The checkpoint to resume from, or None for a fresh run; :class:`OutputFolderError` when ``out`` cannot
    be used. With ``config`` (the run's options) a resumed run is checked against the interrupted one's.
    Cheap: call it before loading any model."""
    out = Path(out)
    if resume:
        checkpoint = Path(resume) if not isinstance(resume, bool) else None
        if checkpoint is None:
            last = get_last_checkpoint(str(out)) if out.is_dir() else None
            if last is None:
                raise OutputFolderError(
                    f"resume: expected a checkpoint-STEP folder in {out}, found none",
                    path=out,
                    reason="no_checkpoint",
                )
            checkpoint = Path(last)
        if not (checkpoint / "trainer_state.json").is_file():
            raise OutputFolderError(
                f"resume: expected a Trainer checkpoint (trainer_state.json) in {checkpoint}, found none",
                path=out,
                reason="no_checkpoint",
            )
        log = out / LOG_NAME
        previous = json.loads(log.read_text())["config"] if log.is_file() and config is not None else {}
        changed = {
            k: (previous.get(k), config[k])
            for k in _RESUME_KEYS
            if k in previous and previous[k] != config[k]
        }
        if changed:
            raise ValueError(
                "resume: expected the options of the interrupted run; found changes (before, now): "
                + ", ".join(f"{k}={a!r}->{b!r}" for k, (a, b) in changed.items())
            )
        return checkpoint
    if out.exists() and any(out.iterdir()):
        if not overwrite:
            raise OutputFolderError(
                f"output folder {out} exists and is not empty: expected a new folder, or "
                f"resume=True to continue its run, or overwrite=True to replace it",
                path=out,
                reason="exists",
            )
        if not ((out / "config.json").is_file() or (out / LOG_NAME).is_file()):
            raise OutputFolderError(
                f"refusing to replace {out}: expected an earlier output (a model folder or a "
                f"distill log), found neither; remove the folder yourself",
                path=out,
                reason="not_ours",
            )
    return None


def plot_history(history: Sequence[dict], path: str | Path) -> bool:
    """Plot train and eval loss against steps into ``path`` (PNG); False (and a warning) without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        warnings.warn(
            "matplotlib is not installed, so no loss plot was drawn; install it with "
            "`pip install matplotlib` (or `pip install gdnprune[plot]`)",
            stacklevel=2,
        )
        return False
    series = {
        "train loss": [(h["step"], h["loss"]) for h in history if "loss" in h],
        "eval loss": [(h["step"], h["eval_loss"]) for h in history if "eval_loss" in h],
        "eval LM loss (student)": [(h["step"], h["eval_lm_loss"]) for h in history if "eval_lm_loss" in h],
        "eval LM loss (teacher)": [
            (h["step"], h["eval_teacher_lm_loss"]) for h in history if "eval_teacher_lm_loss" in h
        ],
    }
    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=120)
    for (label, points), style in zip(series.items(), ("-", "o-", "s--", ":")):
        if points:
            ax.plot(*zip(*points), style, label=label, markersize=3)
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/token)")
    ax.set_title("distillation")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return True


def _load_model(path: Path, dtype, device_map=None):
    """The model class named in ``config.json`` (whole vision-language models too), else AutoModelForCausalLM;
    per-layer GDN geometries (a gdnprune plan's output) through :func:`gdnprune.load_pretrained`."""
    from ..loading import load_pretrained

    try:
        return load_pretrained(
            path, dtype=dtype, **({} if device_map is None else {"device_map": device_map})
        )
    except (OSError, RuntimeError, ValueError) as exc:
        raise ValueError(f"{path}: transformers cannot load it: {' '.join(str(exc).split())[:500]}") from None


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


def distill_checkpoint(
    student_dir: str | Path,
    teacher_dir: str | Path,
    data: str | Path,
    output_dir: str | Path,
    *,
    seq_len: int | None = None,
    num_samples: int | None = None,
    eval_data: str | Path | None = None,
    eval_samples: int | None = None,
    dtype: str | torch.dtype = torch.float32,
    teacher_dtype: str | torch.dtype | None = None,
    teacher_device_map: Any = None,
    **options: Any,
) -> dict[str, Any]:
    """:func:`distill` on Hugging Face folders: the student in ``student_dir`` from the teacher in ``teacher_dir``.

    ``data`` (and ``eval_data``) are read with :func:`gdnprune.calibration.read_texts` (UTF-8 text or JSONL
    with a ``"text"`` field), tokenised with the student's tokenizer and packed into ``seq_len`` windows
    (default :func:`default_seq_len`; ``num_samples`` / ``eval_samples``: evenly spaced subsets). The
    student's parameters load in ``dtype`` (float32: the optimizer's master weights; ``mixed_precision``
    runs the passes in bf16), the teacher in ``teacher_dtype`` (default: the same), spread over devices by
    ``teacher_device_map`` (transformers' ``device_map``) if given. Teacher and student must share their
    tokenizer (:func:`check_same_vocabulary`). ``options`` are those of :func:`distill` (``steps``/``tokens``,
    ``lr``, ``batch_size``, ``temperature``, ``kd_weight``, ``lm_weight``, ``fsdp``, ``eval_every``,
    ``save_every``, ``resume``, ``seed``, ...). The output folder is checked before any model is loaded.

    The output is a normal HF folder: the trained weights and config (``per_layer_config`` kept), the
    student's ``mtp.*`` tensors unchanged (multi-token prediction is not distilled), the tokenizer, every
    other file of ``student_dir`` that is not a weight file (chat template, ...; subfolders too), the
    ``gdnprune.json`` record of the run (teacher, data hash, steps, final losses), plus the checkpoints, the
    log and the plot. The output may not be, or lie inside, the student or teacher folder.
    """
    from transformers import AutoTokenizer

    from ..calibration import pack_windows, read_texts
    from .output import read_tensors

    student_dir, teacher_dir, output_dir = Path(student_dir), Path(teacher_dir), Path(output_dir)
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
    check_output_folder(output_dir, options.get("resume", False), options.get("overwrite", False))
    sharding = check_options(
        world_size=int(os.environ.get("WORLD_SIZE", "1")),
        fsdp=_fsdp(options.get("fsdp", False)),
        teacher_sharding=options.get("teacher_sharding"),
        teacher_device_map=teacher_device_map,
        mixed_precision=options.get("mixed_precision", "no"),
        cpu_offload=options.get("cpu_offload", False),
    )
    tokenizer = AutoTokenizer.from_pretrained(student_dir)
    try:
        teacher_tokenizer = AutoTokenizer.from_pretrained(teacher_dir)
    except (OSError, ValueError):
        teacher_tokenizer = None
        warnings.warn(
            f"no tokenizer in {teacher_dir}: only the vocabulary sizes of teacher and student are compared",
            stacklevel=2,
        )
    check_same_vocabulary(student_tokenizer=tokenizer, teacher_tokenizer=teacher_tokenizer)
    if seq_len is None:
        from transformers import AutoConfig

        seq_len = default_seq_len(AutoConfig.from_pretrained(student_dir))
    windows = pack_windows(read_texts(data), tokenizer, seq_len=seq_len, num_samples=num_samples)
    eval_windows = (
        None
        if eval_data is None
        else pack_windows(read_texts(eval_data), tokenizer, seq_len=seq_len, num_samples=eval_samples)
    )
    if _fsdp(options.get("fsdp", False)):  # what FSDP2 cannot wrap is said before any weight is read
        from .memory import meta_model

        check_shardable(meta_model(student_dir), "student")
        if sharding == "shard":
            check_shardable(meta_model(teacher_dir), "teacher")
    student = _load_model(student_dir, dtype)
    teacher = _load_model(teacher_dir, dtype if teacher_dtype is None else teacher_dtype, teacher_device_map)
    main = int(os.environ.get("RANK", "0")) == 0
    carried = (
        {k: v for p in CARRIED_PREFIXES for k, v in read_tensors(student_dir, p).items()} if main else {}
    )
    result = distill(
        student,
        teacher,
        windows,
        output_dir,
        eval_data=eval_windows,
        tokenizer=tokenizer,
        teacher_tokenizer=teacher_tokenizer,
        extra_tensors=carried,
        **options,
    )
    if not result["interrupted"] and main:
        files, _ = plan_other_files(student_dir, skip=set(_MODEL_FILES))
        copy_other_files(student_dir, output_dir, [f for f in files if not (output_dir / f).exists()])
        manifest = _manifest(student_dir, teacher_dir, data, result, sorted(carried))
        write_json_atomic(output_dir / MANIFEST_NAME, manifest)
    return result


def _manifest(student_dir: Path, teacher_dir: Path, data, result: dict, carried: list[str]) -> dict:
    """The output's ``gdnprune.json``: what was distilled from what, on which data, and how it ended."""
    from .. import __version__
    from ..checkpoint.folder import read_manifest
    from ..fileio import file_sha256

    student_manifest = read_manifest(student_dir) or {}
    final = [h for h in result["history"] if "loss" in h]

    def folder(path: Path, manifest: dict | None) -> dict:
        return {
            "path": str(path.resolve()),
            "config_sha256": file_sha256(path / "config.json"),
            "operation": (manifest or {}).get("operation"),
        }

    return {
        "tool": "gdnprune",
        "version": __version__,
        "operation": "distill",
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "sorted": bool(student_manifest.get("sorted")),
        "student": folder(student_dir, student_manifest),
        "teacher": folder(teacher_dir, read_manifest(teacher_dir)),
        "data": {
            "path": str(Path(data).resolve()),
            "sha256": file_sha256(Path(data)),
            "windows_sha256": result["config"]["train_sha256"],
            "windows": result["config"]["train_windows"],
            "seq_len": result["config"]["seq_len"],
        },
        "steps": result["steps"],
        "tokens": result["tokens"],
        "final": {"train_loss": final[-1]["loss"] if final else None, "eval": result["eval"]},
        "options": result["config"],
        "carried_over": carried,
        "student_manifest": student_manifest or None,
    }
