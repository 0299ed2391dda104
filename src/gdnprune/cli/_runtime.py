"""What commands share about threads: ``--threads``, transformers' kernel-fallback warnings, and no BLAS
threads for the commands that do no linear algebra.

transformers logs, once per kernel, that the GDN layers fall back to its reference PyTorch
implementation when flash-linear-attention and causal-conv1d are missing (always on a CPU). That is
expected here; :func:`model_runtime` replaces those lines with one note of ours that says what to do
about it, and drops it under ``--quiet``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from collections.abc import Iterator

from ._options import positive_int

_FALLBACK = "falling back to its reference PyTorch implementation"
_LOGGER = "transformers.integrations.hub_kernels"


def add_runtime_arguments(p) -> None:
    """``--threads``."""
    p.add_argument(
        "--threads",
        type=positive_int,
        default=None,
        metavar="N",
        help="CPU threads for torch (default: torch's choice; `plan` and `prune` choose from the size of "
        "their forwards and the free cores)",
    )


def default_threads(hidden_size: int, tokens: int) -> int:
    """torch threads for forwards of ``tokens`` tokens through layers of width ``hidden_size``: one per
    2**26 multiply-adds of a ``hidden x hidden`` projection (tiny forwards gain nothing from more and lose a
    lot to oversubscription on a busy machine), at most the cores that are free now (the cores this process
    may use, less the load average), at least 1."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cores = os.cpu_count() or 1
    try:
        free = cores - int(round(os.getloadavg()[0]))
    except OSError:
        free = cores
    return max(1, min(free, cores, int(hidden_size) ** 2 * int(tokens) // (1 << 26)))


class _FallbackNote(logging.Filter):
    def __init__(self, command: str, quiet: bool):
        super().__init__()
        self.command, self.quiet, self.shown = command, quiet, False

    def filter(self, record: logging.LogRecord) -> bool:
        if _FALLBACK not in record.getMessage():
            return True
        if not self.quiet and not self.shown and os.environ.get("RANK", "0") == "0":  # one note per launch
            self.shown = True
            print(
                f"gdnprune {self.command}: note: the GDN layers run transformers' reference PyTorch kernels "
                f"(correct, but slow); on a GPU, `pip install flash-linear-attention causal-conv1d` gives the "
                f"fast ones",
                file=sys.stderr,
            )
        return False


@contextlib.contextmanager
def model_runtime(args) -> Iterator[None]:
    """Apply ``--threads`` and show transformers' kernel-fallback warnings as one note; with ``--quiet``, no
    note and no progress bars of transformers (loading the weights)."""
    threads = getattr(args, "threads", None)
    if threads is not None:
        import torch

        torch.set_num_threads(threads)
    quiet = bool(getattr(args, "quiet", False))
    note = _FallbackNote(args.command, quiet)
    logger = logging.getLogger(_LOGGER)
    logger.addFilter(note)
    bars = None
    if quiet:  # transformers' own bars ("Loading weights", ...) too
        from transformers.utils import logging as hf_logging

        bars = hf_logging.is_progress_bar_enabled()
        hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        logger.removeFilter(note)
        if bars:
            hf_logging.enable_progress_bar()


def without_blas_threads() -> None:
    """Keep numpy's OpenBLAS from starting its thread pool (call before numpy is first imported).

    ``inspect``, ``sort`` and ``slice`` move bytes and never multiply matrices, yet the pool's threads spin
    for about 0.1 s of CPU after ``import numpy`` (measured for issue 11): on a busy machine that is CPU
    taken from the copy. A value the user set is kept.
    """
    if "numpy" not in sys.modules:
        os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
