"""The transformers ``Trainer`` of distillation: its loss, its evaluation metrics, Ctrl-C handling.

The training loop, optimizer, schedule, checkpoints, resume (data order, optimizer and RNG state), DDP
under ``torchrun`` / ``accelerate launch`` and the progress bar are the Trainer's; this module adds the
loss against a frozen teacher (a plain module on every process), the per-window evaluation terms, the
throughput in the logs, and signal handlers (Ctrl-C, SIGTERM, SIGHUP) that make every process save and
stop at the same step.
"""

from __future__ import annotations

import contextlib
import signal
import threading
import time
from typing import Iterator

import torch
import torch.nn.functional as F
from transformers import Trainer, TrainerCallback

from ..interrupts import SIGNALS
from .loss import IGNORE_INDEX, distillation_loss, head_parameters, position_terms

__all__ = ["DistillationTrainer"]


def _final_hidden(model, input_ids: torch.Tensor) -> torch.Tensor:
    """The input of ``lm_head`` for every position (logits are computed for the last position only)."""
    out = model(input_ids=input_ids, output_hidden_states=True, use_cache=False, logits_to_keep=1)
    return out.hidden_states[-1]


def _next_token_labels(input_ids: torch.Tensor) -> torch.Tensor:
    return F.pad(input_ids[:, 1:], (0, 1), value=IGNORE_INDEX)


def as_windows(data, name: str) -> torch.Tensor:
    windows = data if isinstance(data, torch.Tensor) else torch.stack([torch.as_tensor(w) for w in data])
    if windows.dim() != 2 or windows.dtype not in (torch.int64, torch.int32) or windows.shape[1] < 2:
        raise ValueError(f"{name}: expected token windows, an integer tensor [N, seq_len >= 2], found "
                         f"{windows.dtype} {tuple(windows.shape)}")
    return windows.long()


class Windows(torch.utils.data.Dataset):
    def __init__(self, windows: torch.Tensor):
        self.windows = windows

    def __len__(self) -> int:
        return self.windows.shape[0]

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.windows[i]}


class DistillationTrainer(Trainer):
    """A ``Trainer`` whose loss is :func:`distillation_loss` of the model against a frozen ``teacher``.

    Batches are ``{"input_ids": [B, T]}`` windows; every position with a next token is predicted.
    Evaluation adds ``eval_kd_loss``, ``eval_lm_loss`` (student cross entropy, nats/token) and
    ``eval_teacher_lm_loss`` to ``eval_loss`` (the objective); training logs add ``tokens_per_second``.
    """

    def __init__(self, *args, teacher: torch.nn.Module, temperature: float = 1.0, kd_weight: float = 1.0,
                 lm_weight: float = 0.0, chunk_size: int | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.teacher = teacher.eval()
        if getattr(teacher, "hf_device_map", None) is None:
            self.teacher.to(self.args.device)
        self.loss_options = dict(temperature=temperature, kd_weight=kd_weight, lm_weight=lm_weight,
                                 chunk_size=chunk_size)
        self.loss_is_scaled_for_ga = False  # a per-batch mean: the Trainer divides by the accumulation steps
        self._eval_parts: list[torch.Tensor] = []
        self.reset_clock()

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        ids = inputs["input_ids"]
        labels = _next_token_labels(ids)
        hidden, t_hidden = _final_hidden(model, ids), None
        if self.loss_options["kd_weight"] or not model.training:  # LM-only fine-tuning needs no teacher
            with torch.no_grad():
                t_hidden = _final_hidden(self.teacher, ids.to(next(self.teacher.parameters()).device))
        head = self.accelerator.unwrap_model(model).get_output_embeddings()
        t_head = self.teacher.get_output_embeddings()
        if model.training:
            self._tokens += ids.numel()
            loss = distillation_loss(hidden, t_hidden, head, t_head, labels, **self.loss_options).loss
        else:
            loss = self._evaluation_loss(hidden, t_hidden, head, t_head, labels)
        return (loss, {}) if return_outputs else loss

    def _evaluation_loss(self, hidden, t_hidden, head, t_head, labels) -> torch.Tensor:
        """The objective of one eval batch; its per-window KD, LM and teacher LM means are gathered on the side."""
        o = self.loss_options
        kd, lm, t_lm, _ = position_terms(hidden.flatten(0, 1), head_parameters(head), t_hidden.flatten(0, 1),
                                         head_parameters(t_head), labels.flatten(), o["temperature"],
                                         o["chunk_size"], teacher_lm=True)
        counts = (labels != IGNORE_INDEX).sum(1)
        sums = torch.stack([x.view(labels.shape).sum(1) for x in (kd, lm, t_lm)], 1)
        # gathered per batch, as the Trainer gathers its own eval losses (duplicates of uneven shards dropped)
        self._eval_parts.append(self.accelerator.gather_for_metrics(sums / counts.clamp(min=1)[:, None]))
        return (o["kd_weight"] * sums[:, 0].sum() + o["lm_weight"] * sums[:, 1].sum()) / max(1, int(counts.sum()))

    def evaluation_loop(self, *args, **kwargs):
        self._eval_parts = []
        output = super().evaluation_loop(*args, **kwargs)
        prefix = kwargs.get("metric_key_prefix", "eval")
        if self._eval_parts:
            means = torch.cat(self._eval_parts).double().mean(0).tolist()
            for name, value in zip(("kd_loss", "lm_loss", "teacher_lm_loss"), means):
                output.metrics[f"{prefix}_{name}"] = value
        self._eval_parts = []
        return output

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        if "loss" in logs and self._tokens:
            seconds = time.perf_counter() - self._clock
            logs["tokens_per_second"] = round(self._tokens * self.args.world_size / max(seconds, 1e-9), 1)
            self.reset_clock()
        super().log(logs, start_time)

    def reset_clock(self) -> None:
        """Start a new throughput interval (evaluation and saving are not counted as training time)."""
        self._tokens, self._clock = 0, time.perf_counter()


class RunCallback(TrainerCallback):
    """A stop signal -> save and stop at the end of the step (agreed by all processes); JSON log on every log."""

    def __init__(self, trainer: DistillationTrainer, write_log, saving: bool):
        self.trainer, self.write_log, self.saving, self.interrupted = trainer, write_log, saving, False

    def on_step_end(self, args, state, control, **kwargs):
        if self.trainer.accelerator.check_trigger():
            self.interrupted = control.should_training_stop = True
            control.should_save = self.saving
        return control

    def on_log(self, args, state, control, **kwargs):
        self.write_log("running")

    def on_evaluate(self, args, state, control, **kwargs):
        self.trainer.reset_clock()

    def on_save(self, args, state, control, **kwargs):
        self.trainer.reset_clock()


@contextlib.contextmanager
def signals_stop(accelerator) -> Iterator[list[int]]:
    """While active, the first SIGINT, SIGTERM or SIGHUP asks the run to save and stop after the step.

    Yields the list of signals that did. A signal more than a second after the first goes to the handler
    that was there before (Python's: ``KeyboardInterrupt``), so a second Ctrl-C stops at once; the
    grace second absorbs the copy that ``torchrun`` forwards to workers that already got the terminal's.
    Signal handlers can only be set in the main thread; elsewhere the block runs unprotected.
    """
    received: list[int] = []
    if threading.current_thread() is not threading.main_thread():
        yield received
        return
    first: list[float] = []

    def handler(signum, frame):
        if not first:
            first.append(time.monotonic())
            received.append(signum)
            accelerator.set_trigger()
        elif time.monotonic() - first[0] > 1.0:
            for s, h in previous.items():
                signal.signal(s, h)
            signal.raise_signal(signum)

    previous = {s: signal.signal(s, handler) for s in SIGNALS}
    try:
        yield received
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
