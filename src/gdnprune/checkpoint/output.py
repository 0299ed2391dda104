"""The output folder: path checks, the temporary folder, index, config, other files, manifest, atomic move.

An output folder is built in a temporary folder next to it (``.NAME.gdnprune-*``) and renamed into place
only when complete, so the output appears whole or not at all. The input folder is only ever read.

Guarantees, and how they are kept:

* the output is never the input, inside it, or above it — compared by file identity (device and inode,
  as ``os.path.samefile`` does), so bind mounts and symlinks that show one folder at two paths are seen
  through; ``--overwrite`` only ever deletes a previous *model* folder;
* a stop (exception, Ctrl-C, SIGTERM, SIGHUP) removes the temporary folder; the few operations that
  must not be cut halfway (creating and registering the temporary folder, deleting it, the final swap)
  run with signals deferred (:func:`gdnprune.runtime.interrupts.deferred_signals`);
* each temporary folder holds an owner file (pid, process start time, host, boot id); a later run next
  to the same output removes a temporary folder whose owner process is provably gone, restores a
  previous output that a killed ``--overwrite`` left aside, and mentions any other;
* new folders and files follow the process umask, as ``cp`` and ``save_pretrained`` do.
"""

from __future__ import annotations

import datetime
import errno
import json
import math
import os
import shutil
import socket
import tempfile
import warnings
from collections.abc import Mapping
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .. import __version__
from ..runtime.fileio import file_sha256, umask, unwritable, write_json_atomic
from ..runtime.interrupts import deferred_signals
from .folder import CONFIG_NAME, INDEX_NAME, MANIFEST_NAME, SINGLE_NAME, Checkpoint, CheckpointError

__all__ = [
    "OutputError",
    "StaleOutputWarning",
    "clear_stale",
    "check_paths",
    "Staging",
    "write_index",
    "plan_other_files",
    "copy_other_files",
    "build_manifest",
    "write_manifest",
]

OWNER_NAME = ".gdnprune-owner.json"
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".ckpt")


class OutputError(ValueError):
    """An output folder that must not be written (exists, is or holds the model folder, ...)."""


class StaleOutputWarning(UserWarning):
    """A temporary folder of an earlier run next to the output: removed when provably stale, else named."""


# --------------------------------------------------------------------------------------------------------
# path checks


def _same(a: Path, b: Path) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def _existing_ancestors(path: Path) -> list[Path]:
    """``path`` (when it exists) and every existing folder above it, nearest first."""
    path = Path(os.path.abspath(path))
    return [p for p in (path, *path.parents) if os.path.exists(p)]


def check_paths(src: Path, out: Path, overwrite: bool) -> None:
    """Refuse an output that is the model folder, lies inside it or holds it (by file identity, so that
    bind mounts and symlinks do not hide it), and an existing output without ``overwrite``; with
    ``overwrite``, refuse to replace anything but a model folder."""
    if not src.is_dir():
        raise CheckpointError(f"{src}: not a directory" if src.exists() else f"{src}: no such directory")
    for above in _existing_ancestors(out):
        if _same(above, src):
            where = (
                "the" if os.path.abspath(above) == os.path.abspath(out) or _same(out, src) else "inside the"
            )
            raise OutputError(
                f"output folder {out} is {where} model folder {src} (the same folder on disk); "
                f"write the output somewhere else (the input is never modified)"
            )
    if os.path.exists(out):
        for above in _existing_ancestors(src)[1:]:
            if _same(above, out):
                raise OutputError(
                    f"the model folder {src} is inside the output folder {out}; choose another output folder"
                )
    if os.path.lexists(out):
        if not overwrite:
            raise OutputError(f"output folder {out} already exists (pass `overwrite=True` to replace it)")
        _check_replaceable(out)


def _check_replaceable(out: Path, markers: frozenset = frozenset({CONFIG_NAME, MANIFEST_NAME})) -> None:
    """``overwrite`` deletes ``out``: only an earlier output (a folder holding one of ``markers``: a config or a
    gdnprune manifest for a model folder), or an empty folder."""
    what = "a model folder" if CONFIG_NAME in markers else "an earlier output"
    if os.path.islink(out) or not os.path.isdir(out):
        raise OutputError(f"output {out} exists and is not a folder; `overwrite=True` only replaces {what}")
    names = set(os.listdir(out))
    if names and not names & markers:
        raise OutputError(
            f"refusing to replace {out}: it is not {what} (no {' or '.join(sorted(markers))}); "
            f"`overwrite=True` only replaces an earlier output, remove the folder yourself"
        )


def check_output_folder(out: Path, overwrite: bool, markers: frozenset) -> None:
    """Refuse an existing ``out`` without ``overwrite``, and with it anything but an earlier output."""
    if os.path.lexists(out):
        if not overwrite:
            raise OutputError(f"output folder {out} already exists (pass `overwrite=True` to replace it)")
        _check_replaceable(Path(out), markers)


# --------------------------------------------------------------------------------------------------------
# the temporary folder and its owner


def _process_start(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _boot_id() -> str | None:
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as f:
            return f.read().strip()
    except OSError:
        return None


def _owner() -> dict:
    return {
        "pid": os.getpid(),
        "start": _process_start(os.getpid()),
        "host": socket.gethostname(),
        "boot_id": _boot_id(),
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


def _owner_gone(owner: Any) -> bool:
    """Whether the process that wrote ``owner`` has provably ended (same host; gone, or another boot)."""
    if (
        not isinstance(owner, dict)
        or owner.get("host") != socket.gethostname()
        or not isinstance(owner.get("pid"), int)
    ):
        return False
    if owner.get("boot_id") and _boot_id() and owner["boot_id"] != _boot_id():
        return True
    start = _process_start(owner["pid"])
    if start is None:
        return not os.path.exists(f"/proc/{owner['pid']}") and os.path.isdir("/proc/self")
    return owner.get("start") is not None and start != owner["start"]


def _make_folder(path: Path) -> None:
    """``mkdir`` with the permissions a new folder gets under the umask (mkdtemp's 0700 is opened up)."""
    os.chmod(path, 0o777 & ~umask())


def clear_stale(out: Path) -> None:
    """Deal with the temporary folders that earlier runs left next to ``out`` (see the module docs), with a
    :class:`StaleOutputWarning` for each. Call it before :func:`check_paths`: it may restore ``out``."""
    for note in _clean_stale(Path(out)):
        warnings.warn(note, StaleOutputWarning, stacklevel=3)


def _clean_stale(out: Path) -> list[str]:
    """Deal with the temporary folders of earlier runs next to ``out``; returns what was done, one line each."""
    notes: list[str] = []
    try:
        entries = sorted(os.scandir(out.parent), key=lambda e: e.name)
    except OSError:
        return notes
    prefix = f".{out.name}.gdnprune-"
    for entry in entries:
        if not entry.name.startswith(prefix) or not entry.is_dir(follow_symlinks=False):
            continue
        path = Path(entry.path)
        try:
            owner = json.loads((path / OWNER_NAME).read_text())
        except (OSError, ValueError):
            owner = None
        if not _owner_gone(owner):
            who = (
                f"process {owner.get('pid')} on {owner.get('host')}"
                if isinstance(owner, dict)
                else "an unknown process"
            )
            notes.append(
                f"{path} is a temporary folder of another gdnprune run ({who}, perhaps still running); "
                f"left alone: remove it yourself once that run is over"
            )
            continue
        previous = path / "previous"
        if entry.name.startswith(prefix + "old-") and previous.is_dir() and not os.path.lexists(out):
            with deferred_signals():
                os.rename(previous, out)
            notes.append(
                f"restored the previous output {out} from {path}, left aside by a run that was killed "
                f"while replacing it (process {owner['pid']})"
            )
        with deferred_signals():
            shutil.rmtree(path, ignore_errors=True)
        notes.append(
            f"removed {path}, a temporary folder left by a run that was killed (process {owner['pid']})"
        )
    return notes


@dataclass
class Staging:
    """The temporary folder an output is built in: ``with Staging(out, overwrite) as tmp: ...; commit()``.

    Entering creates the missing parents of ``out`` and the temporary folder with its owner file, with
    signals deferred. Leaving
    with an exception removes the temporary folder and the parents it created (signals deferred, and
    dropped: the run is stopping anyway). :meth:`commit` moves the finished folder into place.
    """

    out: Path
    overwrite: bool = False
    src: Path | None = None
    markers: frozenset = frozenset({CONFIG_NAME, MANIFEST_NAME})  # what makes an existing ``out`` replaceable
    tmp: Path | None = None
    created: list[Path] = field(default_factory=list)
    committed: bool = False

    def __enter__(self) -> Path:
        self.out = Path(self.out)
        reason = unwritable(self.out)
        if reason is not None:
            raise OutputError(f"cannot write the output {self.out}: {reason}")
        try:
            with deferred_signals():  # a signal held here is delivered on leaving, and cleaned up below
                missing = [p for p in Path(os.path.abspath(self.out)).parents if not os.path.exists(p)]
                for parent in reversed(missing):
                    os.mkdir(parent)
                    self.created.append(parent)
                self.tmp = Path(tempfile.mkdtemp(prefix=f".{self.out.name}.gdnprune-", dir=self.out.parent))
                _make_folder(self.tmp)
                write_json_atomic(self.tmp / OWNER_NAME, _owner(), indent=2)
        except OSError as exc:
            self._remove()
            if exc.errno in (errno.EROFS, errno.EACCES, errno.EPERM):  # e.g. remounted read-only meanwhile
                raise OutputError(f"cannot write the output {self.out}: {exc.strerror}") from None
            raise
        except BaseException:
            self._remove()
            raise
        return self.tmp

    def __exit__(self, kind, exc, tb) -> None:
        if kind is not None and not self.committed:
            self._remove()

    def _remove(self) -> None:
        """Delete the temporary folder and the parents created for it, with signals held and dropped."""
        with deferred_signals(deliver=False):
            if self.tmp is not None:
                shutil.rmtree(self.tmp, ignore_errors=True)
            for parent in reversed(self.created):
                try:
                    os.rmdir(parent)
                except OSError:
                    break

    def commit(self) -> None:
        """Rename the finished folder to ``out``, replacing an existing ``out`` only with ``overwrite``.

        The swap runs with signals deferred, so it ends with the old output or the new one in place, never
        neither. A signal that arrives during it is delivered afterwards; the exception it raises (if any)
        carries ``output_complete = str(out)``.
        """
        out, tmp = self.out, self.tmp
        assert tmp is not None  # set on entering the with block
        try:
            with deferred_signals():
                os.unlink(tmp / OWNER_NAME)
                if not os.path.lexists(out):
                    os.rename(tmp, out)
                    self.committed = True
                    return
                if not self.overwrite:
                    raise OutputError(
                        f"output folder {out} appeared while writing (pass `overwrite=True` to replace it)"
                    )
                if self.src is not None:
                    check_paths(self.src, out, overwrite=True)  # what is there now is what gets deleted
                else:
                    _check_replaceable(out, self.markers)
                old = Path(tempfile.mkdtemp(prefix=f".{out.name}.gdnprune-old-", dir=out.parent))
                write_json_atomic(old / OWNER_NAME, _owner(), indent=2)
                os.rename(out, old / "previous")
                try:
                    os.rename(tmp, out)
                except BaseException:
                    os.rename(old / "previous", out)  # put the previous output back
                    shutil.rmtree(old, ignore_errors=True)
                    raise
                self.committed = True
                shutil.rmtree(old, ignore_errors=True)
        except KeyboardInterrupt as exc:
            if self.committed:
                exc.output_complete = str(out)  # type: ignore[attr-defined]
            raise


# --------------------------------------------------------------------------------------------------------
# files of the output folder


def write_index(
    ckpt: Checkpoint,
    tmp: Path,
    entries: list[tuple],
    dropped: AbstractSet[str] = frozenset(),
    names: Mapping[str, str | None] | None = None,
) -> None:
    """The output's safetensors index: the source index with the sizes of the output tensors ``entries``
    (``(name, dtype, shape, begin, end)``), without the tensors ``dropped``, source tensors renamed by
    ``names`` (None: dropped); nothing for a single-file checkpoint."""
    if ckpt.index is None:
        return
    index = json.loads(json.dumps(ckpt.index))
    for name in dropped:
        index.get("weight_map", {}).pop(name, None)
    if names and isinstance(index.get("weight_map"), dict):
        weight_map = {
            names.get(n, n): f for n, f in index["weight_map"].items() if names.get(n, n) is not None
        }
        index["weight_map"] = dict(sorted(weight_map.items()))
    metadata = index.setdefault("metadata", {})
    if not isinstance(metadata, dict):
        metadata = index["metadata"] = {}
    metadata["total_size"] = sum(e[4] - e[3] for e in entries)
    if "total_parameters" in metadata:
        metadata["total_parameters"] = sum(math.prod(e[2]) for e in entries)
    write_json_atomic(tmp / INDEX_NAME, index, indent=2)


def plan_other_files(src: Path, skip: set[str]) -> tuple[list[str], list[str]]:
    """The other files of a model folder to copy (relative paths, subfolders included) and the weight files
    left out (weights that are not the safetensors checkpoint, at any depth).

    Symlinks to files are followed (a Hugging Face cache snapshot is made of them); a symlink to a folder
    that holds itself is refused; anything that is not a regular file or folder is skipped with a warning. Top-level ``.cache`` (download metadata of the source files) is skipped.

    Raises:
        CheckpointError: a symlink loop, or a folder that cannot be read.
    """
    files, left_out = [], []

    def walk(folder: Path, rel: str, ancestors: tuple[str, ...]) -> None:
        try:
            entries = sorted(os.scandir(folder), key=lambda e: e.name)
        except OSError as exc:
            raise CheckpointError(f"{folder}: cannot list ({exc.strerror or exc})") from None
        for entry in entries:
            name = f"{rel}{entry.name}"
            if not rel and (entry.name in skip or entry.name == ".cache"):
                continue
            if entry.is_dir():
                real = os.path.realpath(entry.path)
                if real in ancestors:
                    raise CheckpointError(
                        f"{src}: {name} is a symlink loop (-> {os.readlink(entry.path) if entry.is_symlink() else real}); "
                        f"remove it from the model folder"
                    )
                walk(Path(entry.path), f"{name}/", (*ancestors, real))
            elif entry.name.endswith(_WEIGHT_SUFFIXES) and entry.name != "training_args.bin":
                left_out.append(name)
            elif entry.is_file():
                files.append(name)
            else:  # a FIFO, socket or device (or a broken symlink): reading it could block or mean nothing
                warnings.warn(
                    f"{src}: {name} is not a regular file or folder (a FIFO, socket, device or broken "
                    f"symlink); skipped, not copied to the output",
                    UserWarning,
                    stacklevel=2,
                )

    walk(src, "", (os.path.realpath(src),))
    return files, left_out


def copy_other_files(src: Path, dst: Path, files: list[str]) -> None:
    """Copy ``files`` (relative paths from :func:`plan_other_files`) with modes as ``cp`` gives them."""
    mask = umask()
    for name in files:
        target = dst / name
        if not target.parent.is_dir():
            target.parent.mkdir(parents=True)
            _make_folder(target.parent)
        shutil.copyfile(src / name, target)
        os.chmod(target, os.stat(src / name).st_mode & 0o777 & ~mask)


def build_manifest(
    ckpt: Checkpoint,
    operation: str,
    *,
    sorted_out: bool,
    source_shape: dict | None,
    target: dict | None,
    layers: dict,
    unsorted_layers: list | None,
    passthrough: list,
    extra: Mapping[str, Any] | None,
) -> dict:
    """The ``gdnprune.json`` manifest: what was done to which source (its index and config hashes)."""
    return {
        "tool": "gdnprune",
        "version": __version__,
        "operation": operation,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "source": {
            "path": str(ckpt.path.resolve()),
            "index_sha256": file_sha256(ckpt.path / INDEX_NAME) if ckpt.index is not None else None,
            "config_sha256": file_sha256(ckpt.path / CONFIG_NAME),
            "weights_file": INDEX_NAME if ckpt.index is not None else SINGLE_NAME,
            "sorted": ckpt.is_sorted,
            "operation": ckpt.manifest.get("operation") if ckpt.manifest else None,
        },
        "sorted": sorted_out,
        "source_shape": source_shape,
        "target": target,
        "layers": layers,
        "unsorted_layers": unsorted_layers,
        "passthrough": passthrough,
        **dict(extra or {}),
    }


def write_manifest(tmp: Path, manifest: dict) -> None:
    write_json_atomic(tmp / MANIFEST_NAME, manifest, indent=1)
