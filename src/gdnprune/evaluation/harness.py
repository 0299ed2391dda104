"""lm-evaluation-harness for a loaded model object: quiet, and data parallel over a process group.

This module imports lm-eval (the optional extra ``gdnprune[eval]``); :mod:`.api` imports it lazily.

* **What runs.** :func:`run_tasks` does what lm-eval's ``simple_evaluate`` does for a model object (the
  seeds, each task's few-shot count and seed, then lm-eval's ``evaluate``) and returns lm-eval's
  ``results`` mapping unchanged. It leaves out what ``simple_evaluate`` adds about the run: the git commit
  (``git describe``, whose "fatal: not a git repository" reaches the terminal outside a repository) and
  the environment listing.
* **Quiet.** While lm-eval runs, its log records below ERROR are dropped ("Custom kwargs can be passed to
  `--metadata`...", the notes of each task) and what it writes to ``sys.stderr`` is held back (a bar per
  task while it builds requests). Only its request bars ("Running loglikelihood requests") reach the
  terminal, with ``progress`` and on rank 0; without ``progress`` nothing does.
* **Several processes.** lm-eval's ``HFLM`` runs one process when it is given a model object: it sets
  rank 0 of 1 and warns "Please do not launch via accelerate ... if passing an existing model"
  (``lm_eval/models/huggingface.py``); only a model it loads itself from a path splits the work, under
  ``accelerate launch`` with more than one GPU. Yet lm-eval's ``evaluate`` is written for any ``LM``: it
  gives each process the documents of its rank (``lm.rank`` of ``lm.world_size``), pads the shorter
  shares, and gathers every document's metric on rank 0 through ``lm.all_gather``, ``lm.gather_object``
  and ``lm.barrier``, which ``HFLM`` runs through ``self.accelerator``. :class:`HarnessLM` sets the rank and
  world size of the initialised process group (``torchrun``, ``accelerate launch``; see
  :mod:`gdnprune.runtime.distributed`) and gives ``HFLM`` the group's collectives in place of an ``Accelerator``,
  so a model loaded by gdnprune (per-layer geometries included) is evaluated as lm-eval evaluates its own
  models under ``accelerate launch``, on CPUs (gloo) as on GPUs. Rank 0 alone gets the results.
"""

from __future__ import annotations

import contextlib
import io
import logging
import random
import sys
from collections.abc import Iterator, Sequence
from typing import Any, TextIO

import numpy as np
import torch
import torch.distributed as dist
from lm_eval.evaluator import evaluate
from lm_eval.models.huggingface import HFLM

from ..runtime import distributed

__all__ = ["HarnessLM", "GroupCollectives", "run_tasks", "quiet_harness"]


class GroupCollectives:
    """The three calls ``HFLM`` makes on its ``accelerator`` when several processes run, on the initialised
    ``torch.distributed`` group."""

    def gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """Every rank's ``tensor`` (the same shape on each), concatenated along dim 0 in rank order (a
        0-d tensor counts as one row), as ``Accelerator.gather``."""
        rows = tensor.reshape(1) if tensor.dim() == 0 else tensor
        parts = [torch.empty_like(rows) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, rows.contiguous())
        return torch.cat(parts)

    def wait_for_everyone(self) -> None:
        dist.barrier()

    def unwrap_model(self, model: torch.nn.Module) -> torch.nn.Module:
        return model


class HarnessLM(HFLM):
    """``HFLM`` over a loaded model: its request bars only with ``progress`` (on ``stream``, by default
    ``sys.stderr`` when the object is made; rank 0 only), and
    in a process group of several processes, this process's share of the documents."""

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer: Any,
        *,
        batch_size: int,
        progress: bool = False,
        stream: TextIO | None = None,
    ):
        self._progress, self._stream = progress, sys.stderr if stream is None else stream
        with quiet_harness():  # HFLM warns that a model object means one process: this class is why not
            super().__init__(pretrained=model, tokenizer=tokenizer, batch_size=batch_size)
        if distributed.is_distributed():
            self._rank, self._world_size = distributed.rank(), distributed.world_size()
            self.accelerator = GroupCollectives()

    @contextlib.contextmanager
    def _bars(self) -> Iterator[bool]:
        """Yields whether lm-eval's bars are off; while they are on they go to ``stream``."""
        off = not self._progress or self.rank != 0
        with contextlib.redirect_stderr(self._stream) if not off else contextlib.nullcontext():
            yield off

    def loglikelihood(self, requests: list, disable_tqdm: bool = False) -> list:
        with self._bars() as off:
            return super().loglikelihood(requests, disable_tqdm=disable_tqdm or off)

    def loglikelihood_rolling(self, requests: list, disable_tqdm: bool = False) -> list:
        with self._bars() as off:
            return super().loglikelihood_rolling(requests, disable_tqdm=disable_tqdm or off)

    def generate_until(self, requests: list, disable_tqdm: bool = False) -> list:
        with self._bars() as off:
            return super().generate_until(requests, disable_tqdm=disable_tqdm or off)


@contextlib.contextmanager
def quiet_harness() -> Iterator[None]:
    """lm-eval's log records below ERROR dropped and its writes to ``sys.stderr`` held back, for a block;
    both restored after it."""
    logger = logging.getLogger("lm_eval")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            yield
    finally:
        logger.setLevel(level)


def run_tasks(
    lm: HarnessLM,
    tasks: Sequence[str],
    manager: Any,
    *,
    limit: int | float | None = None,
    num_fewshot: int | None = None,
    seed: int = 0,
) -> dict[str, Any] | None:
    """lm-eval's ``results`` mapping (task -> metric -> value) of ``lm`` on ``tasks`` (``manager``: a
    ``TaskManager``) on rank 0, None on the other ranks. The same numbers as ``simple_evaluate(model=lm,
    ..., random_seed=seed, numpy_random_seed=seed, torch_random_seed=seed, fewshot_random_seed=seed)``."""
    with quiet_harness():
        random.seed(seed)
        np.random.seed(seed)
        torch.manual_seed(seed)
        loaded = manager.load(list(tasks))
        for task in loaded["tasks"].values():  # as simple_evaluate sets each task up
            default = task.get_config("num_fewshot")
            if num_fewshot is not None and default != 0:
                task.set_config(key="num_fewshot", value=num_fewshot)
            elif num_fewshot is None and default is None:
                task.set_config(key="num_fewshot", value=0)
            task.set_fewshot_seed(seed=seed)
        out = evaluate(lm=lm, task_dict=loaded, limit=limit, log_samples=False)
    return None if out is None else dict(out["results"])
