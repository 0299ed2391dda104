"""Compensated slicing of a checkpoint: after the engine has gathered every GDN tensor, the ``out_proj``
of each layer that lost value heads or value channels is refitted (:mod:`gdnprune.quality.compensate`) from the
source weights and the calibration statistics, and written over the gathered one, in place in the
temporary output. One tensor at a time, numpy only (no torch).

The statistics describe the model they were collected on, in its channel order. They apply to that very
checkpoint, or to a ``gdnprune sort`` output of it (its manifest's per-layer permutation maps the order).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from ..io.safetensors_io import write_all
from ..io.scores_file import matching_prefixes
from ..model.geometry import GDNShape, order_indices, orders_from_payload
from ..model.layouts import get_layout
from ..model.targets import TargetError
from ..quality import compensate
from ..runtime.fileio import file_sha256
from .codecs import from_float, to_float
from .folder import CONFIG_NAME, MANIFEST_NAME, Checkpoint, CheckpointError

__all__ = [
    "statistics_order",
    "refit_out_proj",
    "stats_info",
    "compensation_inputs",
    "refit_shards",
    "compensation_info",
]


def statistics_order(ckpt: Checkpoint, stats_path: str | os.PathLike) -> dict[str, np.ndarray] | None:
    """How the statistics' channel order maps onto the checkpoint's: None when they were collected on this
    checkpoint, else ``{prefix: vidx}`` (checkpoint channel ``i`` is statistics channel ``vidx[i]``) for a
    sorted output of the statistics' model.

    Raises:
        ValueError: the statistics describe another model.
    """
    described = compensate.statistics_model(stats_path) or {}
    here = {
        "config_sha256": file_sha256(ckpt.path / CONFIG_NAME),
        "manifest_sha256": file_sha256(ckpt.path / MANIFEST_NAME),
    }
    if (
        described.get("config_sha256") == here["config_sha256"]
        and described.get("manifest_sha256") == here["manifest_sha256"]
    ):
        return None
    manifest = ckpt.manifest or {}
    source = manifest.get("source") or {}
    if (
        manifest.get("operation") == "sort"
        and described.get("manifest_sha256") is None
        and source.get("config_sha256") == described.get("config_sha256")
    ):
        order = {}
        for prefix, layer in (manifest.get("layers") or {}).items():
            shape = GDNShape(**layer["shape"])
            orders = orders_from_payload(layer.get("permutation") or {}, shape)
            order[prefix] = order_indices(orders, shape)["vidx"]
        return order
    raise ValueError(
        f"{stats_path}: these compensation statistics were collected on {described.get('path')!r}, "
        f"not on {ckpt.path} nor on the model it was sorted from; collect them on this model"
    )


def _read(path: str, start: int, nbytes: int) -> bytes:
    with open(path, "rb") as f:
        f.seek(start)
        data = f.read(nbytes)
    if len(data) != nbytes:
        raise CheckpointError(
            f"{path}: input changed while reading (short read of {nbytes} bytes at {start})"
        )
    return data


# Over 80 lines with its documented keyword arguments; the code is under 60.
def refit_out_proj(
    ckpt: Checkpoint,
    plans: Mapping[str, Any],
    destinations: Mapping[str, tuple[str, int]],
    stats: Mapping[str, Mapping],
    order: Mapping[str, np.ndarray] | None,
    *,
    ridge: float = compensate.DEFAULT_RIDGE,
) -> list[str]:
    """Overwrite the gathered ``out_proj`` of every cut layer with its compensated columns.

    Args:
        ckpt: the source checkpoint.
        plans: prefix -> the engine's layer plan (layer, target, canonical indices).
        destinations: output tensor name -> (output file, absolute offset of its data).
        stats: :func:`gdnprune.quality.compensate.load_statistics` of the calibration statistics, or
            ``{prefix: {"columns": ...}}``: columns refitted in memory
            (:func:`gdnprune.quality.compensate.sequential_refit`), written as they are.
        order: :func:`statistics_order`.
        ridge: the ridge strength (relative to the mean diagonal of ``C_KK``).

    Returns the prefixes of the refitted layers.

    Raises:
        ValueError: a cut layer without statistics, or statistics of another width.
    """

    fitted = any("columns" in entry for entry in stats.values())
    done = []
    for prefix, plan in plans.items():
        layer, target = plan.layer, plan.target
        keys = matching_prefixes(prefix, stats)
        if fitted and not keys:
            continue  # refitted in memory: a layer before the first cut keeps its columns
        if not fitted and (target.num_value_heads, target.value_head_dim) == (
            layer.shape.num_value_heads,
            layer.shape.value_head_dim,
        ):
            continue  # nothing of the out_proj input was removed
        rules = get_layout(layer.layout)
        suffix = next(s for s in layer.tensors if (r := rules.rule(s)) is not None and r.axis == 1)
        if len(keys) != 1:
            raise ValueError(f"the compensation statistics have no entry for the GDN layer {prefix}")
        info = layer.tensors[suffix]
        if info.dtype not in ("F64", "F32", "F16", "BF16"):
            raise ValueError(
                f"{info.name} is {info.dtype}: least-squares compensation refits it in floating point "
                f"and is not supported for FP8 weights"
            )
        rule = rules.rule(suffix)
        if rule is None:  # cannot happen: the suffix is the layout's output projection
            raise ValueError(f"{prefix}: the {rules.name} layout has no {suffix}")
        kept = rule.gather_index(layer.shape, target, plan.indices)
        if fitted:  # columns refitted in memory, in the output's order (compensate.sequential_refit)
            columns = np.asarray(stats[keys[0]]["columns"], dtype=np.float64)
            if columns.shape != (info.shape[0], len(kept)):
                raise ValueError(
                    f"refitted columns of {prefix} are {columns.shape}, expected {(info.shape[0], len(kept))}"
                )
        else:
            moment = stats[keys[0]]["out_moment"]
            if moment.shape[0] != layer.shape.value_dim:
                raise ValueError(
                    f"compensation statistics of {prefix}: out_moment is {moment.shape}, expected "
                    f"{layer.shape.value_dim} channels ({layer.shape})"
                )
            if order is not None:
                vidx = order[prefix]
                moment = moment[np.ix_(vidx, vidx)]
            weight = to_float(
                _read(ckpt.shards[ckpt.shard_of(info.name)].path, info.start, info.nbytes),
                info.dtype,
                info.shape,
            )
            columns = compensate.compensated_columns(weight, moment, kept, ridge=ridge)
        path, offset = destinations[info.name]
        data = from_float(columns, info.dtype)
        fd = os.open(path, os.O_WRONLY)
        try:
            write_all(fd, data, offset)
        finally:
            os.close(fd)
        done.append(prefix)
    return done


def stats_info(path: str | os.PathLike) -> dict:
    """What the manifest records of a statistics file."""
    return {"path": str(Path(path).resolve()), "sha256": file_sha256(path)}


def compensation_inputs(ckpt: Checkpoint, layers: list, stats_path: Any, cut: bool) -> tuple[Any, Any]:
    """The statistics (and their channel order) an out_proj refit reads; ``(None, None)`` without one.

    Raises:
        TargetError: compensation without a cut, or of an FP8 out_proj.
    """
    if stats_path is None:
        return None, None
    if not cut:
        raise TargetError("compensation needs a cut (a target or a plan): sorting alone changes no output")
    fp8 = [
        layer.prefix
        for layer in layers
        if any(s.endswith("weight_scale_inv") and "out_proj" in s or "o_proj" in s for s in layer.scales)
    ]
    if fp8:
        raise TargetError(
            f"compensation refits out_proj in floating point and does not apply to FP8 out_proj "
            f"({fp8[:3]}); slice a BF16 copy to compensate"
        )
    if isinstance(stats_path, Mapping):  # statistics in memory, collected on this very checkpoint
        return stats_path, None
    return compensate.load_statistics(stats_path), statistics_order(ckpt, stats_path)


def refit_shards(
    ckpt: Checkpoint, plans: dict, shards: list, stats: Any, order: Any, ridge: float | None
) -> list[str]:
    """Refit the cut GDN layers' out_proj in the written shards (:func:`refit.refit_out_proj`)."""
    destinations = {
        name: (shard.dst, shard.data_start + shard.gdn_entries[name][2])
        for shard in shards
        for name in shard.gdn
    }
    ridge = compensate.DEFAULT_RIDGE if ridge is None else ridge
    return refit_out_proj(ckpt, plans, destinations, stats, order, ridge=ridge)


def compensation_info(stats_path: Any, ridge: float | None, refitted: list[str]) -> dict:
    """The manifest's ``compensation`` entry."""
    fitted = isinstance(stats_path, Mapping) and any("columns" in e for e in stats_path.values())
    return {
        "method": "sequential" if fitted else "statistics",
        "statistics": "collected in this run" if isinstance(stats_path, Mapping) else stats_info(stats_path),
        "ridge": compensate.DEFAULT_RIDGE if ridge is None else ridge,
        "layers": refitted,
        "nested": False,
        "note": "out_proj refitted by least squares per target: not nested across targets",
    }
