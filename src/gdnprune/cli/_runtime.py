"""What commands share at run time: the paths checked before anything runs, ``--threads``, transformers'
kernel-fallback warnings, and no BLAS threads for the commands that do no linear algebra.

:func:`check_paths` runs before every command (from :func:`gdnprune.cli.main`): each model folder, input
file and output a command names (:data:`COMMAND_PATHS`) is checked before any model loads, so a typo costs
a second, not a model load; a local path that does not exist is never handed to transformers, which
would ask the Hugging Face Hub for it. The message names the flag (or positional), what was expected and
what was found.

transformers logs, once per kernel, that the GDN layers fall back to its reference PyTorch
implementation when flash-linear-attention and causal-conv1d are missing (always on a CPU). That is
expected here; :func:`model_runtime` drops those lines and, where a GPU is present, shows one note of ours
on its own line that says what to do about it (none on a CPU, where nothing can be done; none under
``--quiet``). It also keeps transformers' own progress bars ("Loading weights: 0%|...") off: the commands
show their own progress.
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import logging
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass

from tqdm import tqdm

from ..runtime.fileio import unwritable
from ._options import positive_int

_FALLBACK = "falling back to its reference PyTorch implementation"
_LOGGER = "transformers.integrations.hub_kernels"


class PathError(ValueError):
    """A path on the command line that the command cannot use (exit 2, one line naming the flag)."""


@dataclass(frozen=True)
class CommandPaths:
    """The paths a command takes, by argparse ``dest``: model folders and files it reads (dest -> what the
    file is, for the message), corpus sources (``--data``: files, folders or globs; that each names
    something on disk is checked here, their contents by :func:`gdnprune.corpus.check_data`), outputs it
    writes (a folder or a file)."""

    models: tuple[str, ...] = ()
    files: tuple[tuple[str, str], ...] = ()
    sources: tuple[str, ...] = ()
    outputs: tuple[str, ...] = ()


#: command -> its paths, checked by :func:`check_paths` before the command runs
COMMAND_PATHS = {
    "inspect": CommandPaths(models=("model_dir",)),
    "sort": CommandPaths(models=("model_dir",), files=(("scores", "a scores file"),), outputs=("output",)),
    "slice": CommandPaths(
        models=("model_dir",),
        files=(
            ("plan", "a plan file"),
            ("compensation_stats", "a statistics file from `gdnprune score`"),
            ("rescale_norms", "a scores file"),
        ),
        outputs=("output",),
    ),
    "verify": CommandPaths(models=("model_a", "model_b"), sources=("data",)),
    "score": CommandPaths(
        models=("model_dir",),
        files=(("merge", "a partial file from `gdnprune score --partial`"),),
        sources=("data",),
        outputs=("output", "partial", "compensation_stats"),
    ),
    "plan": CommandPaths(
        models=("model_dir",), files=(("scores", "a scores file"),), sources=("data",), outputs=("output",)
    ),
    "prune": CommandPaths(
        models=("model_dir",),
        files=(("plan", "a plan file"), ("scores", "a scores file")),
        sources=("data",),
        outputs=("output",),
    ),
    "distill": CommandPaths(
        models=("student", "teacher"), sources=("data", "eval_data"), outputs=("output",)
    ),
    "eval": CommandPaths(models=("models",), files=(("data", "a UTF-8 text file"),), outputs=("output",)),
    "bench": CommandPaths(models=("models",), outputs=("output",)),
    "quantize": CommandPaths(models=("model_dir",), sources=("data",), outputs=("output",)),
    "demo": CommandPaths(outputs=("output",)),
}


def _display_names(parser: argparse.ArgumentParser) -> dict[str, str]:
    """dest -> how the user wrote it: the long flag, or the positional's metavar."""
    names: dict[str, str] = {}
    for action in parser._actions:
        longs = [o for o in action.option_strings if o.startswith("--")]
        fallback = action.metavar if isinstance(action.metavar, str) else action.dest.upper()
        shown = longs[0] if longs else (action.option_strings or [fallback])[0]
        names.setdefault(action.dest, shown)
    return names


def _values(args: argparse.Namespace, dest: str) -> list[str]:
    value = getattr(args, dest, None)
    if value is None or isinstance(value, bool):
        return []
    return [str(v) for v in value] if isinstance(value, (list, tuple)) else [str(value)]


def _found(path: str, missing: str = "path") -> str:
    """What is at ``path``, in words, for a message that says what was expected instead."""
    if not os.path.lexists(path):
        return f"no such {missing} {path!r}"
    if os.path.isdir(path):
        return f"a folder {path!r}"
    return f"a file {path!r}" if os.path.exists(path) else f"a broken symlink {path!r}"


def _hub_hint(path: str) -> str:
    parts = path.split("/")
    if len(parts) == 2 and all(parts) and not os.path.lexists(parts[0]):  # reads like ORG/NAME on the Hub
        return (
            f" (gdnprune reads local folders: download it first, e.g. `hf download {path} --local-dir DIR`)"
        )
    return ""


def _source_missing(pattern: str) -> str | None:
    """Why a corpus source names nothing on disk (None when it names something): the words of
    :func:`gdnprune.corpus.source_files`, without importing ``datasets``."""
    path = os.path.expanduser(pattern)
    if os.path.lexists(path):
        return None
    if not glob.has_magic(path):
        return "no such file or folder"
    return None if glob.glob(path, recursive=True) else "the glob matches no data file"


def check_paths(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """Raise :class:`PathError` for the first path of ``args`` that the command cannot use: a model folder
    that is missing or holds no ``config.json``, an input file that is missing, a folder or unreadable, a
    ``--data`` source that names nothing (in a single process), an output whose folder cannot be written. Cheap
    (a few ``stat`` calls), before any model loads and before torch, transformers or datasets are imported."""
    paths = COMMAND_PATHS.get(getattr(args, "command", None) or "")
    if paths is None:
        return
    names = _display_names(parser)
    for dest in paths.models:
        for path in _values(args, dest):
            if not os.path.isfile(os.path.join(path, "config.json")):
                what = (
                    _found(path, "directory")
                    if not os.path.isdir(path)
                    else f"a folder {path!r} without config.json"
                )
                raise PathError(
                    f"{names[dest]}: expected a model folder (with config.json), found {what}{_hub_hint(path)}"
                )
    for dest, noun in paths.files:
        for path in _values(args, dest):
            if not os.path.isfile(path):
                raise PathError(f"{names[dest]}: expected {noun}, found {_found(path)}")
            if not os.access(path, os.R_OK):
                raise PathError(f"{names[dest]}: expected {noun} that can be read, found {path!r} unreadable")
    # several processes (torchrun): the command checks its corpus inside the process group, so that every rank
    # stops with the message of the one whose data is missing (a rank that stopped here would leave the others
    # waiting for it)
    several = int(os.environ.get("WORLD_SIZE", "1")) > 1
    for dest in () if several else paths.sources:
        for pattern in _values(args, dest):
            reason = _source_missing(pattern)
            if reason is not None:
                raise PathError(f"{names[dest]}: {pattern}: {reason}")
    for dest in () if getattr(args, "dry_run", False) else paths.outputs:
        for path in _values(args, dest):
            reason = unwritable(path)
            if reason is not None:
                raise PathError(f"{names[dest]}: cannot write {path!r}: {reason}")


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


def _gpu_present() -> bool:
    """Whether torch (already imported by the model that logged) sees a CUDA device."""
    torch = sys.modules.get("torch")
    return bool(torch is not None and torch.cuda.is_available())


class _FallbackNote(logging.Filter):
    """Drops transformers' kernel-fallback lines; where a GPU is present (the fast kernels can be installed
    and used there), shows one note of ours instead, once, on its own line (``tqdm.write`` clears a progress
    bar first). On a CPU the reference kernels are the only ones: nothing to act on, no note."""

    def __init__(self, command: str, quiet: bool, gpu: bool | None = None):
        super().__init__()
        self.command, self.quiet, self.shown, self.gpu = command, quiet, False, gpu

    def filter(self, record: logging.LogRecord) -> bool:
        if _FALLBACK not in record.getMessage():
            return True
        if self.gpu is None:
            self.gpu = _gpu_present()
        if self.gpu and not self.quiet and not self.shown and os.environ.get("RANK", "0") == "0":
            self.shown = True  # one note per launch
            tqdm.write(
                f"gdnprune {self.command}: note: the GDN layers run transformers' reference PyTorch kernels "
                f"(correct, but slow); `pip install flash-linear-attention causal-conv1d` gives the fast ones",
                file=sys.stderr,
            )
        return False


@contextlib.contextmanager
def model_runtime(args) -> Iterator[None]:
    """Apply ``--threads``, show transformers' kernel-fallback warnings as one note (none with ``--quiet``)
    and keep transformers' own progress bars ("Loading weights", ...) off while the command runs: a command
    shows its own progress, and none under ``--quiet``."""
    threads = getattr(args, "threads", None)
    if threads is not None:
        import torch  # lazy: torch-free commands share this module

        torch.set_num_threads(threads)
    quiet = bool(getattr(args, "quiet", False))
    note = _FallbackNote(args.command, quiet)
    logger = logging.getLogger(_LOGGER)
    logger.addFilter(note)
    from transformers.utils import logging as hf_logging  # lazy: torch-free commands share this module

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
