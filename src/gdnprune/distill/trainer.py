"""The transformers ``Trainer`` of distillation: its loss inside the models' forward passes, its evaluation
metrics, FSDP2 on CPUs, Ctrl-C handling.

The training loop, optimizer, schedule, checkpoints, resume (data order, optimizer and RNG state), DDP and
FSDP2 (student parameters, gradients and optimizer state sharded by accelerate) and the progress bar are
the Trainer's. This module adds the loss against a frozen teacher, computed where the weights are: the
teacher's forward, the student's forward and the student's ``lm_head`` forward are each *redirected* to
the next step of the loss (:func:`forward_redirect`), so FSDP2's hooks gather every sharded weight the
loss reads and free it afterwards, and DDP sees one forward; an embedding and ``lm_head`` sharded by
vocabulary (:func:`gdnprune.distill.fsdp.vocab_sharded`) are never gathered: the lookup and the loss read
each process's rows (:mod:`.vocab_parallel`). Only the final hidden
states are kept (the base model's ``last_hidden_state``). It also adds the per-window evaluation terms,
the throughput in the logs, and signal handlers (Ctrl-C, SIGTERM, SIGHUP) that make every process save
and stop at the same step.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin
from accelerate.utils.constants import FSDP_MODEL_NAME
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.fsdp import MixedPrecisionPolicy
from transformers import PreTrainedModel, Trainer, TrainerCallback

from ..runtime.fileio import umask, write_json_atomic
from ..runtime.interrupts import SIGNALS
from .fsdp import clip_grad_norm_in_parts, is_sharded, layer_classes, layer_parts, split_groups, vocab_sharded
from .loss import IGNORE_INDEX, distillation_loss, head_terms
from .output import check_checkpoint_keys, load_model_weights
from .records import DATA_POSITION_NAME
from .vocab_parallel import embedding

__all__ = [
    "DistillationTrainer",
    "TokenWindows",
    "RunCallback",
    "as_windows",
    "final_hidden",
    "forward_redirect",
    "freeze_outside_text",
    "signals_stop",
]


def final_hidden(model: PreTrainedModel, input_ids: torch.Tensor) -> torch.Tensor:
    """The input of ``lm_head`` for every position: the base model's ``last_hidden_state`` (after the final
    norm), so no other layer's hidden states are kept and no logits are computed. The embedding of a model
    sharded by vocabulary (:func:`vocab_sharded`) is looked up on each process's rows, not gathered."""
    base = getattr(model, model.base_model_prefix)
    if vocab_sharded(model):
        weight = model.get_input_embeddings().weight
        assert isinstance(weight, torch.Tensor)  # an nn.Embedding's parameter (for the type checker)
        embeds = embedding(input_ids, weight)
        return base(inputs_embeds=embeds, use_cache=False).last_hidden_state
    return base(input_ids=input_ids, use_cache=False).last_hidden_state


def forward_redirect(
    module: torch.nn.Module, fn: Callable, *args, via: torch.nn.Module | None = None, **kwargs
):
    """``fn(*args, **kwargs)`` run as ``module``'s forward: ``module`` (or the wrapper ``via`` around it, e.g.
    DDP) is called with its ``forward`` swapped for ``fn`` during the call, so the module's hooks run around
    ``fn``: FSDP2 gathers the parameters of ``module``'s unit before and frees them after (and hooks the
    backward), exactly as for the module's own forward. The ``forward`` of before is restored at once.
    """
    previous = module.__dict__.get("forward")  # a forward set on the instance, to put back

    def restore():
        if previous is not None:
            module.forward = previous
        else:
            module.__dict__.pop("forward", None)

    def redirected(*a, **k):
        restore()
        return fn(*a, **k)

    module.forward = redirected
    try:
        return (via or module)(*args, **kwargs)
    finally:
        restore()


def freeze_outside_text(model: torch.nn.Module) -> None:
    """Freeze the parameters of ``model`` that text windows never reach (a vision-language student's vision
    tower: outside its decoder and its input and output embeddings). They get no gradient, so the optimizer
    keeps no state for them, and a checkpoint then lacks the state an FSDP2 resume expects for every
    parameter the optimizer holds; frozen, the optimizer does not hold them (AdamW left them unchanged
    already: it skips parameters without a gradient)."""
    get_decoder = getattr(model, "get_decoder", None)
    decoder = get_decoder() if get_decoder is not None else None
    if decoder is None:
        return
    reached = [decoder, model.get_input_embeddings(), model.get_output_embeddings()]  # type: ignore[operator]
    kept = {id(p) for m in reached if m is not None for p in m.parameters()}
    for p in model.parameters():
        if id(p) not in kept:
            p.requires_grad_(False)


def next_token_labels(input_ids: torch.Tensor) -> torch.Tensor:
    return F.pad(input_ids[:, 1:], (0, 1), value=IGNORE_INDEX)


def as_windows(data, name: str) -> torch.Tensor:
    """``data`` (a tensor or a sequence of 1-d tensors) as ``[N, seq_len]`` int64; ``ValueError`` if not windows."""
    windows = data if isinstance(data, torch.Tensor) else torch.stack([torch.as_tensor(w) for w in data])
    if windows.dim() != 2 or windows.dtype not in (torch.int64, torch.int32) or windows.shape[1] < 2:
        raise ValueError(
            f"{name}: expected token windows, an integer tensor [N, seq_len >= 2], found "
            f"{windows.dtype} {tuple(windows.shape)}"
        )
    return windows.long()


class TokenWindows(torch.utils.data.Dataset):
    """Token windows ``[N, seq_len]`` as a dataset of ``{"input_ids": window}``."""

    def __init__(self, windows: torch.Tensor):
        self.windows = windows

    def __len__(self) -> int:
        return self.windows.shape[0]

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.windows[i]}


def fsdp_requested(args) -> bool:
    """Whether the run asks for FSDP: ``TrainingArguments.fsdp`` or an ``accelerate launch`` FSDP config."""
    return bool(args.fsdp) or os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true"


class DistillationTrainer(Trainer):
    """A ``Trainer`` whose loss is :func:`distillation_loss` of the model against a frozen ``teacher``.

    Batches are ``{"input_ids": [B, T]}`` windows; every position with a next token is predicted.
    Evaluation adds ``eval_kd_loss``, ``eval_lm_loss`` (student cross entropy, nats/token) and
    ``eval_teacher_lm_loss`` to ``eval_loss`` (the objective); training logs add ``tokens_per_second``.
    The teacher is used as given (a plain module, FSDP2-sharded by :func:`gdnprune.distill.fsdp.shard_teacher`,
    or spread with a ``device_map``). Under FSDP2 mixed precision the gradients are reduced in float32.
    """

    def __init__(
        self,
        *args,
        teacher: PreTrainedModel,
        temperature: float = 1.0,
        kd_weight: float = 1.0,
        lm_weight: float = 0.0,
        chunk_size: int | None = None,
        **kwargs,
    ):
        super().__init__(*args, **kwargs)
        if self.model is not None:
            freeze_outside_text(self.model)
        self.teacher = teacher.eval()
        self.teacher.requires_grad_(False)
        if getattr(teacher, "hf_device_map", None) is None and not is_sharded(teacher):
            self.teacher.to(self.args.device)
        self.loss_options: dict[str, Any] = dict(
            temperature=temperature, kd_weight=kd_weight, lm_weight=lm_weight, chunk_size=chunk_size
        )
        self.loss_is_scaled_for_ga = False  # a per-batch mean: the Trainer divides by the accumulation steps
        self._eval_parts: list[torch.Tensor] = []
        self._micro_losses: list[torch.Tensor] = []
        self.step_losses: list[torch.Tensor] = []  # this process's loss of every step it ran
        self.reset_clock()

    def create_accelerator_and_postprocess(self) -> None:
        super().create_accelerator_and_postprocess()
        state = self.accelerator.state
        if fsdp_requested(self.args) and getattr(state, "fsdp_plugin", None) is None:
            # accelerate turns FSDP on for accelerator devices only; on CPUs (gloo) it is the same engine

            plugin = FullyShardedDataParallelPlugin(**(self.args.fsdp_plugin_args or {"fsdp_version": 2}))
            state.fsdp_plugin, state.distributed_type = plugin, DistributedType.FSDP
            self.is_fsdp_enabled = True
        plugin = getattr(state, "fsdp_plugin", None)
        if plugin is not None and self.model is not None and not plugin.transformer_cls_names_to_wrap:
            # _no_split_modules may name classes the model lacks (a text model lists its vision blocks); a
            # student loaded into its shards has FSDP2's layer classes (accelerate looks them up by name)
            classes = tuple(layer_classes(self.model))
            plugin.transformer_cls_names_to_wrap = sorted(
                {type(m).__name__ for m in self.model.modules() if isinstance(m, classes)}
            )
        if plugin is not None and self.accelerator.mixed_precision in ("bf16", "fp16"):
            low = torch.bfloat16 if self.accelerator.mixed_precision == "bf16" else torch.float16
            plugin.mixed_precision_policy = MixedPrecisionPolicy(param_dtype=low, reduce_dtype=torch.float32)

    def _loss_in_forwards(self, model, ids: torch.Tensor, terms: Callable) -> Any:
        """``terms(hidden, t_hidden, student_head, teacher_head)`` computed inside the teacher's forward, the
        student's forward and the student head's forward (see the module docstring); ``t_hidden`` None when
        no teacher is needed (LM-only training)."""
        student = self.accelerator.unwrap_model(model)
        head, t_head = student.get_output_embeddings(), self.teacher.get_output_embeddings()
        grad = torch.is_grad_enabled()

        def in_head(hidden, t_hidden):
            return terms(hidden, t_hidden, head, t_head)

        def in_student(t_hidden):
            with self.accelerator.autocast():
                hidden = final_hidden(student, ids)
            if vocab_sharded(student):  # the loss reads the head's local rows: nothing to gather
                return in_head(hidden, t_hidden)
            return forward_redirect(head, in_head, hidden, t_hidden)

        def in_teacher():
            with self.accelerator.autocast():
                t_hidden = final_hidden(self.teacher, ids.to(self.teacher.device))
            with torch.set_grad_enabled(grad):
                return forward_redirect(student, in_student, t_hidden, via=model)

        if not (self.loss_options["kd_weight"] or not model.training):  # LM-only fine-tuning needs no teacher
            return forward_redirect(student, in_student, None, via=model)
        with torch.no_grad():
            return forward_redirect(self.teacher, in_teacher)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        ids = inputs["input_ids"]
        labels = next_token_labels(ids)
        if model.training:
            self._tokens += ids.numel()

            def terms(hidden, t_hidden, head, t_head):
                loss = distillation_loss(hidden, t_hidden, head, t_head, labels, **self.loss_options).loss
                self._micro_losses.append(loss.detach())
                return loss
        else:

            def terms(hidden, t_hidden, head, t_head):
                return self._evaluation_loss(hidden, t_hidden, head, t_head, labels)

        loss = self._loss_in_forwards(model, ids, terms)
        return (loss, {}) if return_outputs else loss

    def _evaluation_loss(self, hidden, t_hidden, head, t_head, labels) -> torch.Tensor:
        """The objective of one eval batch; its per-window KD, LM and teacher LM means are gathered on the side."""
        o = self.loss_options
        kd, lm, t_lm = head_terms(
            hidden.flatten(0, 1),
            head,
            t_hidden.flatten(0, 1),
            t_head,
            labels.flatten(),
            o["temperature"],
            o["chunk_size"],
        )
        counts = (labels != IGNORE_INDEX).sum(1)
        sums = torch.stack([x.view(labels.shape).sum(1) for x in (kd, lm, t_lm)], 1)
        # gathered per batch, as the Trainer gathers its own eval losses (duplicates of uneven shards dropped)
        self._eval_parts.append(self.accelerator.gather_for_metrics(sums / counts.clamp(min=1)[:, None]))
        return (o["kd_weight"] * sums[:, 0].sum() + o["lm_weight"] * sums[:, 1].sum()) / max(
            1, int(counts.sum())
        )

    def evaluation_loop(self, *args, **kwargs):
        self._eval_parts = []
        output = super().evaluation_loop(*args, **kwargs)
        prefix = kwargs.get("metric_key_prefix", "eval")
        if self._eval_parts and output.metrics is not None:
            means = torch.cat(self._eval_parts).double().mean(0).tolist()
            for name, value in zip(("kd_loss", "lm_loss", "teacher_lm_loss"), means):
                output.metrics[f"{prefix}_{name}"] = value
        self._eval_parts = []
        return output

    def create_optimizer(self, model=None):
        """The Trainer's optimizer; for a student sharded before the Trainer (sharded loading), the parameters
        of its groups are kept to be put back after accelerate's FSDP2 preparation (:meth:`create_scheduler`).
        That preparation re-points an optimizer's parameters by the address of their local shards, and every
        empty shard (a tensor with fewer rows than processes, e.g. an MoE layer's ``shared_expert_gate``) has
        address 0: such parameters collapse into one, whose AdamW step count then advances once per collapsed
        parameter and is saved in the checkpoint, so a resumed run differs from the uninterrupted one."""
        optimizer = super().create_optimizer(model)
        target = model if model is not None else self.model
        sharded = isinstance(target, torch.nn.Module) and is_sharded(target)
        if isinstance(target, torch.nn.Module) and (sharded or self.is_fsdp_enabled):
            optimizer.param_groups[:] = split_groups(optimizer.param_groups, target)  # a group per layer
        self._presharded_groups = [list(g["params"]) for g in optimizer.param_groups] if sharded else None
        return optimizer

    def _clip_grad_norm(self, model):
        """Under FSDP2, the Trainer's clipping layer by layer (:func:`~.fsdp.clip_grad_norm_in_parts`);
        otherwise the Trainer's own."""
        if not is_sharded(model) or self._has_mixed_mesh_grads(model):
            return super()._clip_grad_norm(model)
        return clip_grad_norm_in_parts(layer_parts(model), self.args.max_grad_norm)

    def _get_grad_norm(self, model, grad_norm=None):
        """The norm the Trainer logs; without clipping (``max_grad_norm`` 0) under FSDP2, layer by layer too."""
        if grad_norm is None and is_sharded(model) and not self._has_mixed_mesh_grads(model):
            grad_norm = clip_grad_norm_in_parts(layer_parts(model), float("inf"))
        return super()._get_grad_norm(model, grad_norm)

    def create_scheduler(self, num_training_steps: int, optimizer=None):
        """The Trainer's schedule, created once the optimizer is prepared: first the parameters of a pre-sharded
        student's optimizer groups are put back as they were (:meth:`create_optimizer`), when the prepared
        model still holds them all (accelerate leaves a model it finds sharded as it is)."""
        groups = getattr(self, "_presharded_groups", None)
        if groups is not None and self.optimizer is not None and self.model is not None:
            held = {id(p) for p in self.model.parameters()}
            if all(id(p) in held for params in groups for p in params):
                for group, params in zip(self.optimizer.param_groups, groups, strict=True):
                    group["params"] = params
            self._presharded_groups = None
        return super().create_scheduler(num_training_steps, optimizer)

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model=None) -> None:
        """Strict: a tensor missing from the checkpoint, or one the model lacks, is an error (transformers only
        warns). A whole model reads the checkpoint's safetensors in either form (the model's own, or
        ``save_pretrained``'s, e.g. one tensor per expert; :func:`load_model_weights`); a sharded one has its
        DCP checkpoint's names checked, then loads it as accelerate does."""
        target = self.accelerator.unwrap_model(model if model is not None else self.model)
        if not self.is_fsdp_enabled:
            load_model_weights(target, resume_from_checkpoint)
            return
        folders = sorted(Path(resume_from_checkpoint).glob(f"{FSDP_MODEL_NAME}*"))
        if folders and folders[0].is_dir():
            metadata = FileSystemReader(str(folders[0])).read_metadata().state_dict_metadata
            names = {k.removeprefix("model.") for k in metadata if k.startswith("model.")}
            check_checkpoint_keys(target, names, str(folders[0]))
        super()._load_from_checkpoint(resume_from_checkpoint, model)

    def end_step(self) -> None:
        """Close a step's loss: the mean over its micro-batches (the Trainer's logged loss averages these)."""
        if self._micro_losses:
            self.step_losses.append(torch.stack(self._micro_losses).float().mean())
        self._micro_losses = []

    def gathered_step_losses(self) -> list[float]:
        """The loss of every step run here, averaged over the processes (a collective: every process calls
        it), as the Trainer averages its logged loss."""
        if not self.step_losses:
            return []
        local = torch.stack(self.step_losses).to(self.args.device)
        return self.accelerator.reduce(local, reduction="mean").tolist()

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
    """A stop signal -> save and stop at the end of the step (agreed by all processes); ``on_log(logs)`` on
    every log; checkpoint files get the umask's permissions; every checkpoint records its data position
    (:data:`DATA_POSITION_NAME`: the data's fingerprint ``data``, the windows per step, the steps done, the
    epoch and the windows of it already read; the Trainer resumes there through its seeded sampler).
    ``keep_last`` False: the last step writes no checkpoint (the finished run's checkpoints are removed, and
    its final model is saved anyway); a stop signal at that step still saves one."""

    def __init__(
        self,
        trainer: DistillationTrainer,
        on_log: Callable[[dict], None],
        saving: bool,
        data: dict[str, Any] | None = None,
        keep_last: bool = True,
    ):
        self.trainer, self.log, self.saving, self.interrupted = trainer, on_log, saving, False
        self.data, self.keep_last = dict(data or {}), keep_last

    def on_step_end(self, args, state, control, **kwargs):
        self.trainer.end_step()
        if self.trainer.accelerator.check_trigger():
            self.interrupted = control.should_training_stop = True
            control.should_save = self.saving
        elif state.global_step >= state.max_steps and not self.keep_last:
            control.should_save = False
        return control

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.log(dict(logs or {}, step=state.global_step))

    def on_evaluate(self, args, state, control, **kwargs):
        self.trainer.reset_clock()

    def on_save(self, args, state, control, **kwargs):

        if (
            self.trainer.is_local_process_zero()
        ):  # safetensors writes 0600 files; everything else follows the umask
            mode = 0o666 & ~umask()
            for path in args.output_dir and _checkpoints(args.output_dir, state.global_step):
                os.chmod(path, mode)
        if self.trainer.is_world_process_zero() and args.output_dir and self.data:
            per_step, windows = self.data["windows_per_step"], self.data["windows"]
            steps_per_epoch = max(1, windows // per_step)  # the last partial batch is dropped
            position = {
                **self.data,
                "steps": state.global_step,
                "epoch": state.global_step // steps_per_epoch,
                "windows_read_in_epoch": (state.global_step % steps_per_epoch) * per_step,
            }
            folder = os.path.join(args.output_dir, f"checkpoint-{state.global_step}")
            write_json_atomic(os.path.join(folder, DATA_POSITION_NAME), position)
        self.trainer.reset_clock()


def _checkpoints(output_dir: str, step: int) -> Iterator[str]:
    folder = os.path.join(output_dir, f"checkpoint-{step}")
    for root, _, files in os.walk(folder):
        for name in files:
            yield os.path.join(root, name)


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
