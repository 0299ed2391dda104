"""Recovery training: knowledge distillation of a pruned student from its unpruned teacher.

This package owns

* the distillation loss: forward KL(teacher || student) of the next-token distributions at temperature
  ``T`` (scaled by ``T**2``, Hinton et al.), optionally mixed with the student's next-token cross entropy
  ("LM loss"): ``loss = kd_weight * KD + lm_weight * LM``, both averaged over predicted positions.
  :func:`kd_loss` is the plain formula on logits; :func:`distillation_loss` computes the same loss from
  the models' final hidden states and ``lm_head`` weights, a chunk of positions at a time, with the
  gradient computed chunk by chunk as well, so memory holds one chunk of logits, never tokens x vocabulary;
* :class:`DistillationTrainer`, a transformers ``Trainer`` whose ``compute_loss`` is that loss against
  a frozen teacher, computed inside the forward passes of the teacher, the student and the student's
  ``lm_head`` (:func:`forward_redirect`), so that FSDP2 gathers each sharded weight the loss reads and
  frees it after, except the embedding and ``lm_head``, read as each process's rows of the vocabulary
  (:mod:`.vocab_parallel`); only the final hidden states are kept (:func:`final_hidden`). The training loop,
  optimizer, schedule, checkpoints, resume (same data order, optimizer and RNG state), DDP and FSDP2 of
  the student under ``torchrun`` / ``accelerate launch`` are the Trainer's and accelerate's; the teacher
  is replicated, spread by a ``device_map``, or sharded for forward passes (:mod:`.fsdp`);
* :func:`distill` (models and token windows in memory) and :func:`distill_checkpoint` (HF folders and
  text files) on top of it: options and the output folder are checked before any model is loaded
  (:func:`check_options`, :func:`check_batch`, :func:`check_output_folder`), Ctrl-C (SIGTERM, SIGHUP) saves a checkpoint and
  returns, the final model is written tensor by tensor (:mod:`.output`), a JSON log, a PNG of the losses
  and ``gdnprune.json`` are written into the output folder, teacher and student must share a vocabulary
  (:func:`check_same_vocabulary`);
* :func:`estimate_memory` / :func:`estimate_checkpoint_memory`: the peak memory per process of a run, from
  meta-device models.

Rooms: :mod:`.vocab_parallel` (the embedding lookup and the loss terms on this process's rows of a
vocabulary sharded by FSDP2, never gathered), :mod:`.loss` (the loss), :mod:`.fsdp` (what can be sharded, the sharded teacher), :mod:`.memory`
(the estimate), :mod:`.output` (the output folder's weights, written and read back), :mod:`.options`
(:class:`DistillConfig` and its checks), :mod:`.records` (the output folder's checks, log, plot and
record), :mod:`.trainer` (the Trainer subclass, the redirects, stop signals), :mod:`.api` (the functions). The package
imports torch and transformers; the CLI imports it lazily. It never prints (progress output is the
Trainer's bar, off with ``progress=False``); user errors raise ``ValueError``. The loss needs
``logits == lm_head(final hidden state)``, true of every supported family (no logit scaling or
soft-capping). Tested on CPU with gloo: 1 process, 2-process DDP and 2-process FSDP2.
"""

from .api import distill
from .from_folder import CARRIED_PREFIXES, default_seq_len, distill_checkpoint
from .loss import DistillationLoss, distillation_loss, kd_loss
from .memory import MemoryEstimate, estimate_checkpoint_memory, estimate_memory
from .options import (
    ACCELERATE_FSDP2_CONFIG,
    MIXED_PRECISION,
    DistillConfig,
    check_batch,
    check_options,
    check_same_vocabulary,
)
from .records import LOG_NAME, PLOT_NAME, DiskFullError, OutputFolderError, check_output_folder, plot_history
from .trainer import DistillationTrainer, final_hidden, forward_redirect

__all__ = [
    "kd_loss",
    "distillation_loss",
    "DistillationLoss",
    "DistillationTrainer",
    "check_same_vocabulary",
    "distill",
    "distill_checkpoint",
    "DistillConfig",
    "DiskFullError",
    "plot_history",
    "check_batch",
    "check_options",
    "check_output_folder",
    "default_seq_len",
    "OutputFolderError",
    "final_hidden",
    "forward_redirect",
    "MemoryEstimate",
    "estimate_memory",
    "estimate_checkpoint_memory",
    "CARRIED_PREFIXES",
    "ACCELERATE_FSDP2_CONFIG",
    "LOG_NAME",
    "MIXED_PRECISION",
    "PLOT_NAME",
]
