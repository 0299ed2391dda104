"""The output folder: path checks, the temporary folder, index, config, other files, manifest, atomic move.

An output folder is built in a temporary folder next to it (``.NAME.gdnprune-*``) and renamed into place
only when complete, so the output appears whole or not at all. The input folder is only ever read.
"""

from __future__ import annotations

import datetime
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Mapping

from .. import __version__
from ..scores import file_sha256
from .folder import CONFIG_NAME, INDEX_NAME, MANIFEST_NAME, SINGLE_NAME, Checkpoint, CheckpointError

__all__ = ["OutputError", "check_paths", "make_temp_folder", "write_json", "write_index", "copy_other_files",
           "build_manifest", "move_into_place"]


class OutputError(ValueError):
    """An output folder that must not be written (exists, or inside the model folder)."""


def check_paths(src: Path, out: Path, overwrite: bool) -> None:
    """Refuse an output that is the model folder, inside it, or holds it, or that exists without ``overwrite``."""
    if not src.is_dir():
        raise CheckpointError(f"{src}: not a directory" if src.exists() else f"{src}: no such directory")
    src_real = src.resolve()
    out_real = out.parent.resolve() / out.name
    if out_real.is_symlink():
        out_real = out_real.resolve()
    if out_real == src_real or src_real in out_real.parents:
        raise OutputError(f"output folder {out} is {'the' if out_real == src_real else 'inside the'} model folder "
                          f"{src}; write the output somewhere else (the input is never modified)")
    if out_real in src_real.parents:
        raise OutputError(f"the model folder {src} is inside the output folder {out}; choose another output folder")
    if os.path.lexists(out) and not overwrite:
        raise OutputError(f"output folder {out} already exists (pass --overwrite / overwrite=True to replace it)")


def make_temp_folder(out: Path) -> Path:
    """The temporary folder the output is built in, next to ``out`` (created, with its parents)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=f".{out.name}.gdnprune-", dir=out.parent))


def write_json(path: Path, value: Any, indent: int = 2) -> None:
    """``value`` as indented JSON with a final newline."""
    with open(path, "w", encoding="utf-8") as f:
        json.dump(value, f, indent=indent)
        f.write("\n")


def write_index(ckpt: Checkpoint, tmp: Path, entries: list[tuple]) -> None:
    """The output's safetensors index: the source index with the sizes of the output tensors ``entries``
    (``(name, dtype, shape, begin, end)``); nothing for a single-file checkpoint."""
    if ckpt.index is None:
        return
    index = json.loads(json.dumps(ckpt.index))
    metadata = index.setdefault("metadata", {})
    if not isinstance(metadata, dict):
        metadata = index["metadata"] = {}
    metadata["total_size"] = sum(e[4] - e[3] for e in entries)
    if "total_parameters" in metadata:
        metadata["total_parameters"] = sum(_numel(e[2]) for e in entries)
    write_json(tmp / INDEX_NAME, index)


_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".ckpt")


def copy_other_files(src: Path, dst: Path, skip: set[str]) -> list[str]:
    """Copy every file of the model folder except the checkpoint itself; returns weight files left out."""
    left_out = []
    for entry in sorted(os.scandir(src), key=lambda e: e.name):
        if entry.name in skip:
            continue
        if entry.is_dir():
            if entry.name == ".cache":  # download cache metadata describes the source files: not ours
                continue
            shutil.copytree(entry.path, dst / entry.name, symlinks=False)
        elif entry.name.endswith(_WEIGHT_SUFFIXES) and entry.name not in ("training_args.bin",):
            left_out.append(entry.name)
        else:
            shutil.copy2(entry.path, dst / entry.name)
    return left_out


def build_manifest(ckpt: Checkpoint, operation: str, *, sorted_out: bool, source_shape: dict, target: dict | None,
                   layers: dict, unsorted_layers: list | None, passthrough: list,
                   extra: Mapping[str, Any] | None) -> dict:
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
    write_json(tmp / MANIFEST_NAME, manifest, indent=1)


def move_into_place(tmp: Path, out: Path, overwrite: bool) -> None:
    """Rename the finished temporary folder to ``out`` (replacing an existing ``out`` when ``overwrite``)."""
    if not os.path.lexists(out):
        os.rename(tmp, out)
        return
    if not overwrite:
        raise OutputError(f"output folder {out} appeared while writing (pass --overwrite to replace it)")
    old = Path(tempfile.mkdtemp(prefix=f".{out.name}.gdnprune-old-", dir=out.parent))
    os.rename(out, old / "previous")
    try:
        os.rename(tmp, out)
    except BaseException:
        os.rename(old / "previous", out)  # put the previous output back
        shutil.rmtree(old, ignore_errors=True)
        raise
    shutil.rmtree(old, ignore_errors=True)


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
