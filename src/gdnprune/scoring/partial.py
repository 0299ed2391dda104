"""Partial scores: the raw statistics of one share of the calibration windows, and their merge.

``gdnprune score --shard i/n --partial OUT_i`` runs share ``i`` of ``n`` (:func:`save_partial` of
:func:`~gdnprune.scoring.from_folder.measure_checkpoint`); ``gdnprune score --merge OUT_0 ... --output S.json``
adds the shares' sums and computes the scores file (:func:`merge_partials`), equal to a single-process
run on the same windows up to float summation order. The shares can run as separate jobs (a Slurm
array, several machines) without ``torch.distributed``.

The file is a safetensors file: every statistic of every layer as a tensor named ``PREFIX/NAME``
(float64 sums, int64 counts; exact, no pickle, readable with numpy), and one metadata entry,
``"gdnprune"``, a JSON object (:data:`PARTIAL_FORMAT`, version 1) with the share (``shard``: ``index``,
``count``, ``windows`` ``[start, stop)``, ``total_windows``), the ``world_size`` that computed it, the
``model`` (``path``, ``config_sha256``), the ``data`` (``path``, ``size``, ``mtime``, and
``windows_sha256``, the hash of all calibration windows as tokenised), the settings (``method``,
``seed``, ``measures``, ``calibration``: ``num_samples``, ``seq_len``, ``batch_size``, ``dtype``) and
the layers' ``shape`` and ``layout``, and the sub-blocks' (``blocks``: ``kind``, ``layout``, ``shape`` and
their tensor tables; their statistics are tensors ``PREFIX/NAME`` too), and the hidden channels' (``hidden``:
``hidden_size``, the ``norms`` hooked, the ``measure``; tensors ``<hidden>/NAME``). JSON lists would do for the small Grams, but not for the
``[Hv*dv]^2`` moments of ``value_dim_measure="gram"`` (hundreds of MB of text per layer), and binary
float64 round-trips by construction.

A merge checks that the set is complete (every share of ``count`` exactly once, the windows tiling
``[0, total_windows)``) and that every partial has the same model configuration, calibration windows,
settings and layers; anything else is a :class:`PartialError` that names the files and the difference.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save

from .. import __version__
from ..model.geometry import GDNShape
from ..model.subblock_geometry import KINDS, Block
from ..runtime.distributed import shard_indices
from ..runtime.fileio import check_output_file, write_bytes_atomic
from .from_folder import CheckpointStatistics
from .payload import (
    COUNTS,
    HiddenStatistics,
    LayerStatistics,
    ScoringStatistics,
    scores_from_statistics,
    statistic_shapes,
)

__all__ = [
    "PARTIAL_FORMAT",
    "PARTIAL_VERSION",
    "PartialError",
    "save_partial",
    "load_partial",
    "merge_partials",
]

PARTIAL_FORMAT = "gdnprune-partial-scores"
PARTIAL_VERSION = 1
_META_KEY = "gdnprune"
# the settings every partial of one merge must share (data and model are compared by hash)
_SAME = (
    "method",
    "seed",
    "measures",
    "calibration/num_samples",
    "calibration/seq_len",
    "calibration/batch_size",
    "calibration/dtype",
    "model/config_sha256",
    "data/windows_sha256",
    "shard/count",
    "shard/total_windows",
    "layers",
    "blocks",
    "hidden",
)


class PartialError(ValueError):
    """A partial scores file that cannot be read, or a set of partials that cannot be merged."""


def _metadata(run: CheckpointStatistics) -> dict[str, Any]:
    st = run.statistics
    calibration = {k: v for k, v in run.calibration.items() if k != "data"}
    return {
        "format": PARTIAL_FORMAT,
        "version": PARTIAL_VERSION,
        "gdnprune_version": __version__,
        "shard": dict(run.shard),
        "world_size": int(run.world_size),
        "method": st.method,
        "seed": int(st.seed),
        "measures": st.measures,
        "model": dict(run.model),
        "data": dict(run.data),
        "calibration": calibration,
        "layers": {
            p: {"shape": layer.shape.as_dict(), "layout": layer.layout} for p, layer in st.layers.items()
        },
        "blocks": {
            p: {
                "kind": block.kind,
                "layout": block.layout,
                "shape": block.shape.as_dict(),
                **{part: {k: list(v) for k, v in getattr(block, part).items()} for part in _BLOCK_TENSORS},
            }
            for p, (block, _) in st.blocks.items()
        },
        "hidden": None
        if st.hidden is None
        else {"hidden_size": st.hidden.hidden_size, "norms": st.hidden.norms, "measure": st.hidden.measure},
    }


#: the tensor tables of a :class:`~gdnprune.model.subblock_geometry.Block` (suffix -> shape), kept in a partial's metadata
_BLOCK_TENSORS = ("tensors", "fixed", "numbered")


def _read_blocks(meta: dict, tensors: dict[str, torch.Tensor], where: str) -> dict[str, tuple[Block, dict]]:
    """The sub-blocks of a partial's metadata with their statistics (tensors ``PREFIX/NAME``)."""
    out = {}
    for prefix, info in (meta.get("blocks") or {}).items():
        tables = {part: {k: tuple(v) for k, v in info[part].items()} for part in _BLOCK_TENSORS}
        block = Block(
            prefix, info["kind"], info["layout"], KINDS[info["kind"]].geometry(**info["shape"]), **tables
        )
        stats = {
            key.rpartition("/")[2]: value
            for key, value in tensors.items()
            if key.rpartition("/")[0] == prefix
        }
        if meta["method"] != "random" and not stats:
            raise PartialError(f"{where}: no statistics for sub-block {prefix}")
        out[prefix] = (block, stats)
    return out


#: the tensor-name prefix of the hidden channels' statistics (no module is called this)
_HIDDEN = "<hidden>"


def _read_hidden(meta: dict, tensors: dict[str, torch.Tensor]) -> HiddenStatistics | None:
    """The hidden channels' statistics of a partial (tensors ``<hidden>/NAME``), None when not scored."""
    info = meta.get("hidden")
    if info is None:
        return None
    stats = {k.rpartition("/")[2]: v for k, v in tensors.items() if k.rpartition("/")[0] == _HIDDEN}
    return HiddenStatistics(int(info["hidden_size"]), list(info["norms"]), stats, info["measure"])


def save_partial(run: CheckpointStatistics, path: str | os.PathLike, *, overwrite: bool = False) -> Path:
    """Write the statistics of one share (from :func:`~gdnprune.scoring.from_folder.measure_checkpoint`) to ``path``.

    Written through a temporary file renamed into place (the file appears whole or not at all), with
    the permissions a new file gets under the umask. An existing file is an error unless ``overwrite``.
    """
    check_output_file(path, overwrite)
    path = Path(path)
    tensors = {
        f"{prefix}/{name}": value.detach().cpu().contiguous()
        for prefix, layer in run.statistics.layers.items()
        for name, value in layer.stats.items()
    }
    tensors.update(
        {
            f"{prefix}/{name}": value.detach().cpu().contiguous()
            for prefix, (_, stats) in run.statistics.blocks.items()
            for name, value in stats.items()
        }
    )
    if run.statistics.hidden is not None:
        tensors.update(
            {
                f"{_HIDDEN}/{name}": v.detach().cpu().contiguous()
                for name, v in run.statistics.hidden.stats.items()
            }
        )
    blob = save(tensors, metadata={_META_KEY: json.dumps(_metadata(run), sort_keys=True)})
    return write_bytes_atomic(path, blob)


def load_partial(path: str | os.PathLike) -> tuple[dict[str, Any], ScoringStatistics]:
    """Read a partial scores file: its metadata and its statistics (checked against the layers' shapes).

    Raises:
        PartialError: not a readable safetensors file, not a gdnprune partial, an unsupported version, or a
            statistic that is missing or has the wrong shape or dtype.
    """
    where = f"partial {os.fspath(path)}"
    try:
        with safe_open(os.fspath(path), framework="pt") as f:
            raw = (f.metadata() or {}).get(_META_KEY)
            tensors = {key: f.get_tensor(key) for key in f.keys()}
    except FileNotFoundError:
        raise PartialError(f"{where}: no such file") from None
    except OSError as exc:
        raise PartialError(f"{where}: cannot read ({exc.strerror or exc})") from None
    except Exception as exc:  # safetensors raises its own error type for a file that is not safetensors
        raise PartialError(f"{where}: not a safetensors file ({' '.join(str(exc).split())[:200]})") from None
    try:
        meta = json.loads(raw) if raw is not None else None
    except json.JSONDecodeError:
        meta = None
    if not isinstance(meta, dict) or meta.get("format") != PARTIAL_FORMAT:
        raise PartialError(
            f"{where}: not a gdnprune partial scores file (the statistics of one share of the windows)"
        )
    if meta.get("version") != PARTIAL_VERSION:
        raise PartialError(
            f"{where}: unsupported partial version {meta.get('version')!r}, expected {PARTIAL_VERSION}"
        )
    try:
        layers = {}
        for prefix, info in meta["layers"].items():
            shape = GDNShape(**info["shape"])
            stats = {}
            if meta["method"] != "random":
                for name, size in statistic_shapes(shape, meta["method"], meta["measures"] or {}).items():
                    value = tensors.get(f"{prefix}/{name}")
                    dtype = torch.int64 if name in COUNTS else torch.float64
                    if value is None or tuple(value.shape) != size or value.dtype != dtype:
                        found = "nothing" if value is None else f"{value.dtype} {list(value.shape)}"
                        raise PartialError(
                            f"{where}: statistic {prefix}/{name} should be {dtype} {list(size)}, "
                            f"found {found}"
                        )
                    stats[name] = value
            layers[prefix] = LayerStatistics(shape, info["layout"], stats)
        blocks = _read_blocks(meta, tensors, where)
        statistics = ScoringStatistics(
            meta["method"], int(meta["seed"]), meta["measures"], layers, blocks, _read_hidden(meta, tensors)
        )
        start, stop = meta["shard"]["windows"]
        (
            int(meta["shard"]["index"]),
            int(meta["shard"]["count"]),
            int(meta["shard"]["total_windows"]),
            int(start),
        )
    except PartialError:
        raise
    except (KeyError, TypeError, ValueError) as exc:
        raise PartialError(f"{where}: malformed metadata ({type(exc).__name__}: {exc})") from None
    return meta, statistics


def _get(meta: Any, key: str) -> Any:
    for part in key.split("/"):
        meta = meta.get(part) if isinstance(meta, dict) else None
    return meta


def _describe(value: Any) -> str:
    text = json.dumps(value, sort_keys=True)
    return text if len(text) <= 80 else text[:77] + "..."


def merge_partials(paths: Sequence[str | os.PathLike]) -> dict[str, Any]:
    """Add the statistics of a complete set of partial files and return the scores-file dict.

    The result is what a single process computes on all the windows (equal orders; raw scores equal up
    to float summation order), with ``world_size`` the processes that computed the partials together and
    ``shards`` their number; ``model`` and ``calibration`` are those of the first share.

    Raises:
        PartialError: a file cannot be read; the partials differ in model configuration, calibration
            windows, settings or layers; a share is missing or given twice, or their windows do not tile the
            calibration windows.
    """
    if not paths:
        raise PartialError("nothing to merge: give the partial files of every share")
    loaded = [(os.fspath(p), *load_partial(p)) for p in paths]
    first_path, first, _ = loaded[0]
    for path, meta, _ in loaded[1:]:
        for key in _SAME:
            if _get(meta, key) != _get(first, key):
                what = {
                    "model/config_sha256": "model configurations (config.json)",
                    "data/windows_sha256": "calibration windows (data, tokenizer, `seq_len` or `num_samples`)",
                }.get(key, key)
                raise PartialError(
                    f"partials do not match: {path} and {first_path} differ in {what}: "
                    f"{_describe(_get(meta, key))} vs {_describe(_get(first, key))}"
                )
    count, total = int(first["shard"]["count"]), int(first["shard"]["total_windows"])
    by_index: dict[int, str] = {}
    for path, meta, _ in loaded:
        index = int(meta["shard"]["index"])
        if index in by_index:
            raise PartialError(
                f"overlapping partials: {by_index[index]} and {path} are both share {index} of {count}"
            )
        by_index[index] = path
        expected = shard_indices(total, index, count)
        if list(meta["shard"]["windows"]) != [expected.start, expected.stop]:
            raise PartialError(
                f"{path}: share {index} of {count} should hold windows [{expected.start}, "
                f"{expected.stop}) of {total}, found {meta['shard']['windows']}"
            )
    missing = [i for i in range(count) if i not in by_index]
    if missing:
        raise PartialError(
            f"incomplete set of partials: share(s) {', '.join(map(str, missing))} of {count} missing "
            f"(given: {', '.join(f'{i} ({by_index[i]})' for i in sorted(by_index))})"
        )
    loaded.sort(key=lambda item: int(item[1]["shard"]["index"]))
    statistics = loaded[0][2]
    for _, _, other in loaded[1:]:
        for prefix, layer in statistics.layers.items():
            for name, value in layer.stats.items():
                value += other.layers[prefix].stats[name]
        for prefix, (_, stats) in statistics.blocks.items():
            for name, value in stats.items():
                value += other.blocks[prefix][1][name]
        if statistics.hidden is not None and other.hidden is not None:
            for name, value in statistics.hidden.stats.items():
                value += other.hidden.stats[name]
    scores = scores_from_statistics(
        statistics, world_size=sum(int(meta["world_size"]) for _, meta, _ in loaded)
    )
    scores["shards"] = count
    scores["model"] = first["model"]["path"]
    scores["calibration"] = {"data": first["data"]["path"], **first["calibration"]}
    return scores
