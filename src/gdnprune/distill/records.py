"""What a distillation run keeps in its output folder besides the model: the checks of the folder (new,
resumed, replaced), the JSON log, the loss plot, the ``gdnprune.json`` record and the losses it reports.
"""

from __future__ import annotations

import datetime
import errno
import json
import os
import shutil
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from transformers.trainer_utils import get_last_checkpoint

from .. import __version__
from ..checkpoint.folder import read_manifest
from ..runtime.fileio import file_sha256

__all__ = [
    "LOG_NAME",
    "PLOT_NAME",
    "RESUME_KEYS",
    "OutputFolderError",
    "check_output_folder",
    "plot_history",
    "loss_figure",
    "loss_summary",
    "run_manifest",
    "DiskFullError",
    "DiskFullGuard",
    "STAGING",
    "DATA_POSITION_NAME",
]

LOG_NAME = "distill_log.json"
PLOT_NAME = "distill_loss.png"
#: the file of a checkpoint that records where in the data the run is
DATA_POSITION_NAME = "data_position.json"
#: the folder inside the output that the final model is written into before its files move into place
STAGING = ".final.gdnprune-staging"

# options that must not change when a run is resumed (all the others only change logging and saving)
RESUME_KEYS = (
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


class OutputFolderError(ValueError):
    """The output folder cannot be used as asked. ``reason``: ``"exists"`` (not empty, neither resume nor
    overwrite asked), ``"not_ours"`` (overwrite asked of a folder that is no earlier output) or
    ``"no_checkpoint"`` (resume asked, nothing to resume)."""

    def __init__(self, message: str, *, path: Path, reason: str):
        super().__init__(message)
        self.path, self.reason = path, reason


def _checkpoint_to_resume(out: Path, resume: bool | str | Path) -> Path:
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
    return checkpoint


def check_output_folder(
    out: str | Path, resume: bool | str | Path, overwrite: bool, config: dict | None = None
) -> Path | None:
    """The checkpoint to resume from, or None for a fresh run; :class:`OutputFolderError` when ``out`` cannot
    be used. With ``config`` (the run's options) a resumed run is checked against the interrupted one's.
    Cheap: call it before loading any model."""
    out = Path(out)
    if resume:
        checkpoint = _checkpoint_to_resume(out, resume)
        log = out / LOG_NAME
        previous = json.loads(log.read_text())["config"] if log.is_file() and config is not None else {}
        changed = {
            k: (previous.get(k), config[k])
            for k in RESUME_KEYS
            if config is not None and k in previous and previous[k] != config[k]
        }
        if changed:
            raise ValueError(
                "resume: expected the options of the interrupted run; found changes (before, now): "
                + ", ".join(f"{k}={a!r}->{b!r}" for k, (a, b) in changed.items())
            )
        position = checkpoint / DATA_POSITION_NAME
        saved = json.loads(position.read_text()).get("data") if position.is_file() else None
        if config is not None and saved is not None and saved != config["train_sha256"]:
            raise ValueError(
                f"resume: expected the training data of {checkpoint} (windows fingerprint {saved[:12]}), "
                f"found other data ({config['train_sha256'][:12]}); give the same data, seq_len and num_samples"
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


def loss_summary(step_losses: Sequence[float], first_step: int, log_every: int) -> dict[str, Any]:
    """The train loss a finished run reports: ``last`` (its last step's), and ``window_mean`` (the mean over
    the last logging window: the steps after the last log line before the last step, the last step
    included; logs are written at step 1 and every ``log_every`` steps) with ``window`` (first, last step).
    ``step_losses``: the loss of every step this process ran, from step ``first_step`` (after a resume, the
    window starts no earlier than that)."""
    if not step_losses:
        return {"last": None, "window_mean": None, "window": None}
    last = first_step + len(step_losses) - 1
    logged = [s for s in range(1, last) if s == 1 or s % log_every == 0]
    start = max(first_step, (logged[-1] + 1) if logged else 1)
    window = step_losses[start - first_step :]
    return {"last": step_losses[-1], "window_mean": sum(window) / len(window), "window": (start, last)}


def train_loss_label(kd_weight: float, lm_weight: float) -> str:
    """What "train loss" is: the objective, in the words of its terms."""
    if lm_weight == 0 and kd_weight == 1:
        return "train loss = KL(teacher || student), the KD term"
    return f"train loss = {kd_weight:g} x KL(teacher || student) + {lm_weight:g} x LM"


def plot_history(
    history: Sequence[dict],
    path: str | Path,
    kd_weight: float = 1.0,
    lm_weight: float = 0.0,
    step_losses: Sequence[tuple[int, float]] = (),
) -> bool:
    """Plot train and eval loss against steps into ``path`` (PNG, :func:`loss_figure`); False (and a warning)
    without matplotlib."""
    fig = loss_figure(history, kd_weight, lm_weight, step_losses)
    if fig is None:
        warnings.warn(
            "matplotlib is not installed, so no loss plot was drawn; install it with "
            "`pip install matplotlib` (or `pip install gdnprune[plot]`)",
            stacklevel=2,
        )
        return False
    fig.savefig(path)
    return True


def loss_figure(
    history: Sequence[dict],
    kd_weight: float = 1.0,
    lm_weight: float = 0.0,
    step_losses: Sequence[tuple[int, float]] = (),
) -> Any:
    """Train and eval loss against steps, a ``matplotlib.figure.Figure`` drawn without pyplot; None without
    matplotlib. The legend says what the train loss is (:func:`train_loss_label`); ``step_losses``
    (``(step, loss)``) draw the loss of every step under the logged means."""
    try:
        import matplotlib  # lazy: optional extra  # noqa: F401 (absent: ImportError here)
        from matplotlib.figure import Figure  # lazy: optional extra
        from matplotlib.ticker import MaxNLocator  # lazy: optional extra
    except ImportError:
        return None
    series = {
        f"{train_loss_label(kd_weight, lm_weight)}, per step": list(step_losses),
        "train loss, mean of each logging window": [(h["step"], h["loss"]) for h in history if "loss" in h],
        "eval loss (the same objective)": [(h["step"], h["eval_loss"]) for h in history if "eval_loss" in h],
        "eval LM loss (student)": [(h["step"], h["eval_lm_loss"]) for h in history if "eval_lm_loss" in h],
        "eval LM loss (teacher)": [
            (h["step"], h["eval_teacher_lm_loss"]) for h in history if "eval_teacher_lm_loss" in h
        ],
    }
    fig = Figure(figsize=(7, 4.5), dpi=120)
    ax = fig.subplots()
    styles: tuple[dict[str, Any], ...] = (
        {"lw": 0.8, "alpha": 0.6},
        {"marker": "o", "ls": "none"},
        {"marker": "s"},
        {"marker": "^", "ls": "--"},
    )
    for (label, points), style in zip(series.items(), (*styles, {"marker": "v", "ls": ":"})):
        if points:
            ax.plot(*zip(*points), label=label, markersize=4, **style)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss (nats/token)")
    evaluated = any(points for label, points in series.items() if label.startswith("eval"))
    title = "distillation: train loss (training windows)" + (", eval losses (held-out windows)" * evaluated)
    ax.set_title(title, fontsize=10)  # eval losses only where the run evaluated
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    # fixed margins that fit these labels and six-character ticks (0.0035, 1200): tight_layout would draw the
    # figure once more (a third of the plot's time, and every distillation draws one)
    fig.subplots_adjust(left=0.13, right=0.97, top=0.92, bottom=0.11)
    return fig


def run_manifest(student_dir: Path, teacher_dir: Path, data: Any, result: dict, carried: list[str]) -> dict:
    """The output's ``gdnprune.json``: what was distilled from what, on which data (a
    :class:`gdnprune.corpus.DataSpec`), and how it ended."""
    student_manifest = read_manifest(student_dir) or {}

    def folder(path: Path, manifest: dict | None) -> dict:
        return {
            "path": str(path.resolve()),
            "config_sha256": file_sha256(path / "config.json"),
            "operation": (manifest or {}).get("operation"),
        }

    losses = result.get("losses") or {}
    return {
        "tool": "gdnprune",
        "version": __version__,
        "operation": "distill",
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "sorted": bool(student_manifest.get("sorted")),
        "student": folder(student_dir, student_manifest),
        "teacher": folder(teacher_dir, read_manifest(teacher_dir)),
        "data": _data_record(data, result),
        "steps": result["steps"],
        "tokens": result["tokens"],
        "final": {
            "train_loss": losses.get("last"),
            "train_loss_window_mean": losses.get("window_mean"),
            "train_loss_window": losses.get("window"),
            "eval": result["eval"],
        },
        "options": result["config"],
        "carried_over": carried,
        "student_manifest": student_manifest or None,
    }


def _data_record(spec: Any, result: dict) -> dict:
    """The corpus of the run: its sources (resolved), mixture weights, text field, and the windows read;
    the file's sha256 when the corpus is one file."""
    paths = [Path(s.pattern) for s in spec.sources]
    record: dict[str, Any] = {
        "path": str(paths[0].resolve()) if len(paths) == 1 else [str(p.resolve()) for p in paths],
        "weights": [s.weight for s in spec.sources] if spec.is_mixture else None,
        "text_field": spec.text_field,
        "windows_sha256": result["config"]["train_sha256"],
        "windows": result["config"]["train_windows"],
        "seq_len": result["config"]["seq_len"],
    }
    if len(paths) == 1 and paths[0].is_file():
        record["sha256"] = file_sha256(paths[0])
    return record


class DiskFullError(OSError):
    """The output folder's file system filled up: ``folder`` and the ``needed`` bytes the write asked for."""

    def __init__(self, folder: Path, needed: int, free: int, what: str):
        super().__init__(errno.ENOSPC, "No space left on device")
        self.folder, self.needed, self.free, self.what = folder, needed, free, what

    def __str__(self) -> str:
        return (
            f"no space left on the device of {self.folder}: {self.what} needs about {self.needed:,} bytes, "
            f"{self.free:,} are free; free some space or give another --output"
        )


class DiskFullGuard:
    """Turn a write that failed for want of space under ``out`` into :class:`DiskFullError`: an ``ENOSPC``, or
    any ``OSError`` / ``RuntimeError`` / ``SafetensorError`` (torch's and safetensors' writers raise those) after which the file system
    has less room than a checkpoint needs (the weights and the two AdamW moments). Removes what the failed
    write left (an incomplete ``checkpoint-STEP`` without ``trainer_state.json``, the final model's staging
    folder), so nothing is left that looks like a finished model or a checkpoint to resume from."""

    def __init__(self, out: Path | None, model: torch.nn.Module):
        self.out, self.model = out, model
        weights = sum(p.numel() * p.element_size() for p in model.parameters())
        self.what, self.needed = "a checkpoint (weights and AdamW state)", 3 * weights

    def final(self, dtype: torch.dtype | None) -> None:
        """From here on the write is the final model's (its weights, in ``dtype``)."""
        size = lambda p: p.numel() * (p.element_size() if dtype is None else dtype.itemsize)  # noqa: E731
        self.what, self.needed = "the final model", sum(size(p) for p in self.model.parameters())

    def __enter__(self):
        return self

    def __exit__(self, kind, exc, tb) -> None:
        if exc is None or self.out is None or not isinstance(exc, (OSError, RuntimeError, SafetensorError)):
            return
        free = shutil.disk_usage(self.out).free if self.out.exists() else 0
        said = getattr(exc, "errno", None) == errno.ENOSPC or "No space left on device" in str(exc)
        if not said and free >= self.needed:
            return
        if self.out.exists() and int(os.environ.get("RANK", "0")) == 0:
            broken = [c for c in self.out.glob("checkpoint-*") if not (c / "trainer_state.json").is_file()]
            for folder in [*broken, *self.out.glob(STAGING)]:
                shutil.rmtree(folder, ignore_errors=True)
            free = shutil.disk_usage(self.out).free
        raise DiskFullError(self.out, self.needed, free, self.what) from exc
