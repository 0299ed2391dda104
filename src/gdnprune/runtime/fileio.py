"""Small file helpers shared by the modules that read and write files: the umask, JSON files read with one
error for every way they can be broken, and atomic files (JSON or bytes).

A JSON file that gdnprune writes (scores, plans, logs) appears whole or not at all: it is written to a
temporary file next to it and renamed into place, with the permissions that ``open(path, "w")`` would
give it under the process umask.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

__all__ = [
    "USER_ERRNOS",
    "umask",
    "read_json",
    "write_json_atomic",
    "write_bytes_atomic",
    "file_sha256",
    "check_output_file",
    "unwritable",
]


#: OSErrors that the user causes (a path that does not exist, is of the wrong kind or may not be written);
#: any other OSError (a full disk, an I/O error, ...) is the environment's.
#: The CLI exits 2 for these, 1 for the others; a rank that fails under torchrun is classified the same way.
USER_ERRNOS = frozenset(
    {
        errno.ENOENT,
        errno.ENOTDIR,
        errno.EISDIR,
        errno.EEXIST,
        errno.EACCES,
        errno.EPERM,
        errno.ENAMETOOLONG,
        errno.ELOOP,
    }
)


def umask() -> int:
    """The process umask (read from /proc where possible, so that no other thread sees it change)."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def read_json(path: str | os.PathLike, error: type[Exception] = ValueError, where: str | None = None) -> Any:
    """A JSON file's contents; ``error("{where}: ...")`` when it cannot be read, is not UTF-8 or not JSON, or
    is nested too deeply for the parser (``where`` defaults to the path)."""
    where = os.fspath(path) if where is None else where
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except OSError as exc:
        raise error(f"{where}: cannot read ({exc.strerror or exc})") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise error(f"{where}: not valid JSON ({exc})") from None
    except RecursionError:
        raise error(f"{where}: not valid JSON (nested too deeply)") from None


def write_bytes_atomic(path: str | os.PathLike, data: bytes | Callable[[IO[bytes]], object]) -> Path:
    """Write ``data`` (bytes, or a function that writes to the open binary file) through a temporary file
    next to ``path``, renamed into place: the file appears whole or not at all, with the permissions that
    ``open(path, "w")`` would give it under the umask. Missing parent folders are created; returns ``path``.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, 0o666 & ~umask())
        with os.fdopen(fd, "wb") as f:
            if callable(data):
                data(f)
            else:
                f.write(data)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return path


def write_json_atomic(path: str | os.PathLike, value: Any, *, indent: int | None = 1) -> Path:
    """Write ``value`` as JSON (final newline) atomically (:func:`write_bytes_atomic`); returns ``path``."""
    return write_bytes_atomic(path, (json.dumps(value, indent=indent) + "\n").encode("utf-8"))


def file_sha256(path: str | os.PathLike) -> str | None:
    """The sha256 of a file's bytes, or None when it is not a file."""
    path = Path(path)
    if not path.is_file():
        return None
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def check_output_file(path: str | os.PathLike, overwrite: bool) -> None:
    """Refuse to write a JSON file over a folder, or over an existing file without ``overwrite``."""
    if os.path.isdir(path):
        raise ValueError(f"output {os.fspath(path)} is a folder; give a file name such as scores.json")
    if os.path.lexists(path) and not overwrite:
        raise ValueError(
            f"output file {os.fspath(path)} already exists (pass `overwrite=True` to replace it)"
        )
    reason = unwritable(path)
    if reason is not None:
        raise ValueError(f"cannot write the output {os.fspath(path)}: {reason}")


def unwritable(out: str | os.PathLike) -> str | None:
    """Why an output at ``out`` (a folder or a file) cannot be created, or None when it can.

    The output is built next to ``out``, so what counts is the nearest existing folder above it: it must be
    a folder, on a file system mounted read-write, that this process may write (``os.access``, which also
    answers for root). Said in the user's terms, about ``out``'s own path, never a temporary folder."""
    parent = Path(os.path.abspath(out)).parent
    above = next(p for p in (parent, *parent.parents) if os.path.exists(p))  # "/" always exists
    if not above.is_dir():
        return f"{above} is a file, not a folder"
    try:
        read_only = bool(os.statvfs(above).f_flag & os.ST_RDONLY)
    except OSError:
        read_only = False
    if read_only:
        return f"{above} is on a read-only file system"
    if not os.access(above, os.W_OK | os.X_OK):
        return f"{above} may not be written (permission denied)"
    return None
