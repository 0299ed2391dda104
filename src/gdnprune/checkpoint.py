"""Checkpoint surgery: inspect, sort, slice and verify Hugging Face checkpoints of GDN hybrid models.

Public API (the ``gdnprune`` subcommands are thin layers over it):

* :func:`inspect_checkpoint` — every GDN layer (prefix, layout, geometry, parameters) and the totals;
* :func:`transform_checkpoint` — the one streaming engine: permute (sort) and/or cut (slice) every GDN
  layer of a checkpoint folder into a new folder;
* :func:`sort_checkpoint` / :func:`slice_checkpoint` — the two operations of the command line;
* :func:`verify_checkpoints` — load two folders with transformers and compare their logits;
* :func:`load_scores`, :func:`read_manifest`, :func:`find_gdn_layers`, :func:`open_checkpoint`.

How the engine streams. Every output shard has the same file name and holds the same tensors as the
source shard. The bytes of tensors that are not GDN tensors (attention, MLP/MoE, embeddings, vision
tower, ``mtp.*``) are copied from the source file to the output file by byte range in the kernel
(``copy_file_range``), so they come out byte-identical and never enter the process. GDN tensors are
gathered one at a time with the layout tables (:mod:`gdnprune.layouts`) and the canonical indices of
:mod:`gdnprune.geometry` — the same ones the torch API uses — as byte gathers, which need no dtype
support: a gather along rows (projections, conv, per-head vectors) writes the memory-mapped source rows,
runs of consecutive rows coalesced, with vectored ``pwritev`` calls (one kernel copy, no gathered copy in
memory); a gather along columns (``out_proj``) reads the memory-mapped source with ``numpy.take`` and
writes the result with ``pwrite``. A GDN layer whose
tensors straddle two shards needs nothing special. Each output file is written as
``[header][unchanged tensors][GDN tensors]``: the header space is reserved up front (an upper bound,
padded with spaces as safetensors allows) and filled in last.

Two threads share the work. The main thread copies the unchanged bytes of every shard; meanwhile a
worker thread validates the layers, then writes the GDN tensors one by one at their final offsets
(known in advance: the GDN part of a shard starts after its unchanged part); when the main thread is
done copying it takes GDN tensors too. The headers are written last. ``sort`` and ``slice`` do not
import torch (only numpy); peak memory is, per thread, one gathered tensor plus the mapped source pages.

Output folders are written to a temporary folder next to the output and renamed into place when
complete; a failure or an interrupt removes it. The manifest ``gdnprune.json`` records what was done.

Notes and limits:

* ``mtp.*`` (multi-token prediction) tensors are always copied unchanged. In Qwen3.5 / Qwen3-Next the
  MTP layers are full attention; should a checkpoint have GDN-looking tensors under ``mtp.``, they are
  left untouched with a warning (slicing then leaves them at the old width).
* OLMo-hybrid stores its fused conv on disk as ``q_conv1d`` / ``k_conv1d`` / ``v_conv1d`` (transformers
  writes equal thirds, whatever the q/k/v sizes). They are read as one conv (concatenated in that
  order), gathered, and written back split into the real q, k and v sizes; transformers concatenates
  them again on load.
* Quantised checkpoints (e.g. FP8 ``weight_scale_inv``) are refused: a GDN layer with a tensor that its
  layout does not know is an error.
* A scores entry may name a layer with or without the ``language_model.`` part of a vision-language
  prefix (``model.layers.3.linear_attn`` for ``model.language_model.layers.3.linear_attn``), because
  ``AutoModelForCausalLM`` loads those checkpoints without it.
"""

from __future__ import annotations

import argparse
import bisect
import collections
import datetime
import hashlib
import json
import mmap
import os
import shutil
import sys
import tempfile
import threading
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping

from . import __version__
from .safetensors_io import (
    DTYPE_BITS,
    CheckpointError,
    ShardHeader,
    TensorInfo,
    copy_range,
    encode_header,
    header_size_bound,
    read_header,
    write_vectors,
    write_all,
)

__all__ = [
    "CheckpointError",
    "ScoresError",
    "TargetError",
    "OutputError",
    "UnsortedInputWarning",
    "MissingScoresWarning",
    "PassthroughWarning",
    "Checkpoint",
    "GDNLayer",
    "open_checkpoint",
    "find_gdn_layers",
    "inspect_checkpoint",
    "load_scores",
    "read_manifest",
    "transform_checkpoint",
    "sort_checkpoint",
    "slice_checkpoint",
    "verify_checkpoints",
    "add_commands",
]

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
CONFIG_NAME = "config.json"
MANIFEST_NAME = "gdnprune.json"
#: tensors under these prefixes are never treated as GDN layers (copied unchanged)
PASSTHROUGH_PREFIXES = ("mtp.",)
#: dtypes a GDN tensor may have (the gather goes through torch)
GDN_DTYPES = ("F64", "F32", "F16", "BF16")
_TARGET_FIELDS = ("num_key_heads", "num_value_heads", "key_head_dim", "value_head_dim")

# Fused tensors that a layout stores split on disk: fused suffix -> on-disk suffixes, one per segment of
# the fused tensor's rule (in order). OLMo-hybrid's own save writes q/k/v_conv1d.
_DISK_SPLITS = {
    "olmo_hybrid": {
        "conv1d.weight": ("q_conv1d.weight", "k_conv1d.weight", "v_conv1d.weight"),
        "conv1d.bias": ("q_conv1d.bias", "k_conv1d.bias", "v_conv1d.bias"),
    },
}

# Prefix spellings of the same layer: vision-language checkpoints store the text model under
# ``model.language_model.``, which AutoModelForCausalLM loads as ``model.``.
_PREFIX_ALIASES = (("model.language_model.", "model."),)


class ScoresError(ValueError):
    """A scores file (or dict) that cannot be applied to the checkpoint."""


class TargetError(ValueError):
    """A slice target that the layers cannot be cut to."""


class OutputError(ValueError):
    """An output folder that must not be written (exists, or inside the model folder)."""


class UnsortedInputWarning(UserWarning):
    """Slicing a checkpoint that no manifest says was sorted: the kept prefix is not the important part."""


class MissingScoresWarning(UserWarning):
    """A GDN layer has no entry in the scores: it keeps its order."""


class PassthroughWarning(UserWarning):
    """GDN-looking tensors under a pass-through prefix (``mtp.``) are left untouched."""


# --------------------------------------------------------------------------------------------------------
# Reading a checkpoint folder (no torch)


def _sha256(path: Path) -> str | None:
    if not path.is_file():
        return None
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _read_json(path: Path, what: str) -> Any:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot read {what} ({exc.strerror or exc})") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{path}: {what} is not valid JSON ({exc})") from None


@dataclass
class Checkpoint:
    """A Hugging Face checkpoint folder of safetensors shards, read from the headers only.

    Attributes:
        path: the folder.
        config: ``config.json`` as a dict.
        shards: the shard headers, in file-name order (one for a single-file checkpoint).
        index: ``model.safetensors.index.json`` as a dict, or None for a single ``model.safetensors``.
        manifest: the folder's ``gdnprune.json`` (a previous gdnprune output), or None.
    """

    path: Path
    config: dict
    shards: list[ShardHeader]
    index: dict | None
    manifest: dict | None = None
    _where: dict[str, int] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        for i, shard in enumerate(self.shards):
            for name in shard.tensors:
                if name in self._where:
                    other = self.shards[self._where[name]].path
                    raise CheckpointError(f"{self.path}: tensor {name!r} is in both {other} and {shard.path}")
                self._where[name] = i

    @property
    def names(self) -> list[str]:
        """Every tensor name, shard by shard in data order."""
        return list(self._where)

    def shard_of(self, name: str) -> int:
        """Index (into :attr:`shards`) of the shard holding tensor ``name``."""
        return self._where[name]

    def tensor(self, name: str) -> TensorInfo:
        """The header entry of tensor ``name``."""
        return self.shards[self._where[name]].tensors[name]

    @property
    def total_bytes(self) -> int:
        """Size of all shard files."""
        return sum(s.file_size for s in self.shards)

    @property
    def is_sorted(self) -> bool:
        """Whether the folder's manifest says its GDN layers are sorted by importance."""
        return bool(self.manifest and self.manifest.get("sorted"))


def read_manifest(model_dir: str | os.PathLike) -> dict | None:
    """The ``gdnprune.json`` manifest of a folder written by gdnprune, or None when there is none."""
    path = Path(model_dir) / MANIFEST_NAME
    if not path.is_file():
        return None
    manifest = _read_json(path, "the gdnprune manifest")
    if not isinstance(manifest, dict):
        raise CheckpointError(f"{path}: expected a JSON object, found {type(manifest).__name__}")
    return manifest


def open_checkpoint(model_dir: str | os.PathLike) -> Checkpoint:
    """Read the config, the index and every shard header of a checkpoint folder (no tensor data).

    Accepts a sharded checkpoint (``model.safetensors.index.json``) or a single ``model.safetensors``.

    Raises:
        CheckpointError: the folder, its config, index or a shard is missing, unreadable or corrupt, or
            the index and the shards disagree.
    """
    path = Path(model_dir)
    if not path.is_dir():
        raise CheckpointError(f"{path}: not a directory" if path.exists() else f"{path}: no such directory")
    config = _read_json(path / CONFIG_NAME, "config.json") if (path / CONFIG_NAME).is_file() else None
    if not isinstance(config, dict):
        raise CheckpointError(f"{path}: no config.json (a JSON object) in the model folder")
    index = None
    if (path / INDEX_NAME).is_file():
        index = _read_json(path / INDEX_NAME, "the safetensors index")
        weight_map = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(weight_map, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()
        ):
            raise CheckpointError(f"{path / INDEX_NAME}: expected a 'weight_map' object of tensor name -> file")
        files = sorted(set(weight_map.values()))
        for name in files:
            if os.path.dirname(name) or name in ("", ".", ".."):
                raise CheckpointError(f"{path / INDEX_NAME}: shard {name!r} is not a file name in the folder")
            if not (path / name).is_file():
                raise CheckpointError(f"{path / INDEX_NAME}: lists shard {name!r}, which is missing")
        shards = [read_header(path / name) for name in files]
        for shard, name in zip(shards, files):
            listed = {k for k, v in weight_map.items() if v == name}
            if listed != set(shard.tensors):
                extra, absent = sorted(set(shard.tensors) - listed), sorted(listed - set(shard.tensors))
                raise CheckpointError(
                    f"{path / INDEX_NAME} and shard {name} disagree: "
                    + (f"tensors {absent[:3]} listed but not in the shard" if absent else "")
                    + ("; " if absent and extra else "")
                    + (f"tensors {extra[:3]} in the shard but not listed" if extra else "")
                )
    elif (path / SINGLE_NAME).is_file():
        shards = [read_header(path / SINGLE_NAME)]
    else:
        others = sorted(p.name for p in path.iterdir() if p.suffix in (".bin", ".pt", ".pth", ".safetensors"))
        hint = f" (found {others[:3]}: only safetensors checkpoints are supported)" if others else ""
        raise CheckpointError(f"{path}: no {INDEX_NAME} or {SINGLE_NAME} in the model folder{hint}")
    return Checkpoint(path, config, shards, index, read_manifest(path))


# --------------------------------------------------------------------------------------------------------
# Finding GDN layers


def _all_markers() -> frozenset[str]:
    from .layouts import LAYOUTS

    return frozenset().union(*(layout.markers for layout in LAYOUTS.values()))


def _group_gdn_tensors(names: Iterable[str], markers: frozenset[str]) -> tuple[dict[str, list[str]], list[str]]:
    """Group tensor names into GDN layers by marker suffix.

    Returns ``{prefix: [names under prefix]}`` and the sorted pass-through prefixes (``mtp.``) that
    would have been GDN layers.
    """
    names = list(names)
    depths = sorted({m.count(".") + 1 for m in markers})
    prefixes, skipped = set(), set()
    for name in names:
        parts = name.split(".")
        for c in depths:
            if len(parts) > c and ".".join(parts[-c:]) in markers:
                prefix = ".".join(parts[:-c])
                (skipped if prefix.startswith(PASSTHROUGH_PREFIXES) else prefixes).add(prefix)
    ordered = sorted(prefixes)
    for inner in ordered:
        parts = inner.split(".")
        outer = next((p for p in (".".join(parts[:i]) for i in range(1, len(parts))) if p in prefixes), None)
        if outer is not None:
            raise CheckpointError(f"GDN layer prefixes {outer!r} and {inner!r} are nested")
    by_name = sorted(names)
    members: dict[str, list[str]] = {}
    for prefix in ordered:  # names under a prefix are contiguous in sorted order
        head = prefix + "."
        i = bisect.bisect_left(by_name, head)
        j = bisect.bisect_left(by_name, prefix + "/", i)  # "/" sorts right after "."
        members[prefix] = by_name[i:j]
    return members, sorted(skipped)


@dataclass
class GDNLayer:
    """One GDN layer of a checkpoint, validated against its layout and the config's geometry.

    Attributes:
        prefix: the weight prefix, e.g. ``model.layers.0.linear_attn``.
        layout: the layout name (``qwen3_5``, ``qwen3_next``, ``olmo_hybrid``).
        shape: the layer's :class:`~gdnprune.gated_delta_net.GDNShape` (from ``config.json``).
        tensors: on-disk suffix -> header entry.
        splits: fused suffix -> on-disk suffixes, for fused tensors stored split (OLMo-hybrid conv).
    """

    prefix: str
    layout: str
    shape: Any
    tensors: dict[str, TensorInfo]
    splits: dict[str, tuple[str, ...]] = field(default_factory=dict)

    @property
    def parameters(self) -> int:
        """Number of parameters of the layer."""
        return sum(t.numel for t in self.tensors.values())

    def name(self, suffix: str) -> str:
        """Full tensor name of ``suffix``."""
        return f"{self.prefix}.{suffix}"


def _config_shape(config: Mapping, where: Path):
    from .geometry import GDNShape

    try:
        return GDNShape.from_config(config)
    except ValueError as exc:
        raise CheckpointError(f"{where / CONFIG_NAME}: {exc}") from None


def find_gdn_layers(checkpoint: Checkpoint) -> tuple[list[GDNLayer], list[str]]:
    """Every GDN layer of ``checkpoint``, checked against its layout and the config's geometry.

    Returns the layers in name order and the pass-through prefixes (``mtp.``) with GDN-looking tensors.

    Raises:
        CheckpointError: no GDN layer, tensors under ``linear_attn`` that match no known layout, a layer
            that mixes layouts, lacks a tensor, has a tensor its layout does not know (e.g. quantisation
            scales), a tensor of the wrong shape for the config's geometry, or an unsupported dtype.
    """
    from .layouts import LAYOUTS, detect_layout, get_layout

    members, skipped = _group_gdn_tensors(checkpoint.names, _all_markers())
    inside = {n for names in members.values() for n in names}
    stray = sorted(
        n for n in checkpoint.names
        if ".linear_attn." in n and n not in inside and not n.startswith(PASSTHROUGH_PREFIXES)
    )
    if stray:
        module = stray[0].split(".linear_attn.")[0] + ".linear_attn"
        found = sorted(n[len(module) + 1:] for n in stray if n.startswith(module + "."))
        raise CheckpointError(
            f"{module}: unknown GDN layout: its tensors {found[:6]} match none of the layouts "
            f"{sorted(LAYOUTS)} (marker tensors: {sorted(_all_markers())})"
        )
    if not members:
        raise CheckpointError(
            f"{checkpoint.path}: no GDN layer found: no tensor ends in one of the layouts' marker names "
            f"{sorted(_all_markers())}"
        )
    shape = _config_shape(checkpoint.config, checkpoint.path)
    layers = []
    for prefix, names in members.items():
        tensors = {n[len(prefix) + 1:]: checkpoint.tensor(n) for n in names}
        try:
            layout = detect_layout(tensors)
        except ValueError as exc:
            raise CheckpointError(f"{prefix}: {exc}") from None
        layers.append(_check_layer(prefix, get_layout(layout), shape, tensors))
    return layers, skipped


def _check_layer(prefix: str, layout, shape, tensors: dict[str, TensorInfo]) -> GDNLayer:
    """Validate one layer's tensors (names, presence, shapes, dtypes) without reading data."""
    splits = {fused: pieces for fused, pieces in _DISK_SPLITS.get(layout.name, {}).items()
              if any(p in tensors for p in pieces)}
    piece_of = {p: fused for fused, pieces in splits.items() for p in pieces}
    unknown = sorted(s for s in tensors if layout.rule(s) is None and s not in piece_of)
    if unknown:
        raise CheckpointError(
            f"{prefix}: tensors {[f'{prefix}.{s}' for s in unknown]} are not part of the {layout.name} GDN "
            f"layout; refusing to change the layer (quantised checkpoints are not supported)"
        )
    for fused, pieces in splits.items():
        if fused in tensors:
            raise CheckpointError(f"{prefix}: has both {fused!r} and its split form {list(pieces)}")
        absent = [p for p in pieces if p not in tensors]
        if absent:
            raise CheckpointError(f"{prefix}: missing tensor {prefix + '.' + absent[0]!r} (the split {fused} needs "
                                  f"{list(pieces)})")
    for rule in layout.rules:
        if rule.required and rule.name not in tensors and rule.name not in splits:
            raise CheckpointError(
                f"{prefix}: missing tensor {prefix + '.' + rule.name!r} of the {layout.name} GDN layout "
                f"(expected shape {rule.expected_shape(shape)})"
            )
    for suffix, info in tensors.items():
        rule = layout.rule(suffix) or layout.rule(piece_of.get(suffix, ""))
        if info.dtype not in GDN_DTYPES:
            raise CheckpointError(f"{prefix}: tensor {info.name!r} has dtype {info.dtype}; GDN tensors must be "
                                  f"one of {list(GDN_DTYPES)}")
        if len(info.shape) != rule.ndim:
            raise CheckpointError(f"{prefix}: tensor {info.name!r} has shape {info.shape}, expected "
                                  f"{rule.ndim} dimensions {rule.expected_shape(shape)} for {shape}")
        if suffix not in piece_of and info.shape[rule.axis] != rule.length(shape):
            raise CheckpointError(f"{prefix}: tensor {info.name!r} has shape {info.shape}, expected "
                                  f"{rule.expected_shape(shape)} for {shape} (config.json geometry)")
    for fused, pieces in splits.items():
        rule = layout.rule(fused)
        infos = [tensors[p] for p in pieces]
        other = {tuple(d for a, d in enumerate(t.shape) if a != rule.axis) for t in infos}
        total = sum(t.shape[rule.axis] for t in infos)
        if len(other) != 1 or total != rule.length(shape) or len({t.dtype for t in infos}) != 1:
            raise CheckpointError(
                f"{prefix}: split tensors {[t.name for t in infos]} have shapes {[t.shape for t in infos]} and "
                f"dtypes {[t.dtype for t in infos]}; expected one dtype and {rule.length(shape)} rows in all "
                f"(= {rule.expected_shape(shape)} for {shape})"
            )
    return GDNLayer(prefix, layout.name, shape, tensors, splits)


# --------------------------------------------------------------------------------------------------------
# inspect


def inspect_checkpoint(model_dir: str | os.PathLike) -> dict:
    """Describe a checkpoint folder: every GDN layer and the parameter totals (reads headers only).

    Returns a JSON-ready dict with ``model_dir``, ``model_type``, ``format`` (``sharded`` or
    ``single-file``), ``shards``, ``dtypes`` (tensor count per dtype), ``gdn_shape``, ``layers`` (one dict
    per GDN layer: ``prefix``, ``layout``, the four geometry fields, ``parameters``, ``shards``),
    ``gdn_parameters``, ``other_parameters``, ``total_parameters``, ``total_bytes``, ``passthrough`` and
    ``manifest`` (operation and sorted flag of a gdnprune output, else None).

    Raises:
        CheckpointError: as :func:`open_checkpoint` and :func:`find_gdn_layers`.
    """
    ckpt = open_checkpoint(model_dir)
    layers, skipped = find_gdn_layers(ckpt)
    total = sum(ckpt.tensor(n).numel for n in ckpt.names)
    gdn = sum(layer.parameters for layer in layers)
    dtypes = collections.Counter(ckpt.tensor(n).dtype for n in ckpt.names)
    config = ckpt.config
    return {
        "model_dir": str(ckpt.path),
        "model_type": config.get("model_type"),
        "architectures": config.get("architectures"),
        "format": "sharded" if ckpt.index is not None else "single-file",
        "shards": len(ckpt.shards),
        "dtypes": dict(sorted(dtypes.items())),
        "gdn_shape": layers[0].shape.as_dict(),
        "layers": [
            {
                "prefix": layer.prefix,
                "layout": layer.layout,
                **layer.shape.as_dict(),
                "parameters": layer.parameters,
                "shards": sorted({os.path.basename(ckpt.shards[ckpt.shard_of(t.name)].path)
                                  for t in layer.tensors.values()}),
            }
            for layer in layers
        ],
        "gdn_parameters": gdn,
        "other_parameters": total - gdn,
        "total_parameters": total,
        "total_bytes": ckpt.total_bytes,
        "passthrough": skipped,
        "manifest": None if ckpt.manifest is None else {
            "operation": ckpt.manifest.get("operation"), "sorted": ckpt.is_sorted,
        },
    }


def _format_inspect(info: dict) -> str:
    rows = [("prefix", "layout", "Hk", "Hv", "dk", "dv", "parameters")]
    for layer in info["layers"]:
        rows.append((layer["prefix"], layer["layout"], str(layer["num_key_heads"]), str(layer["num_value_heads"]),
                     str(layer["key_head_dim"]), str(layer["value_head_dim"]), f"{layer['parameters']:,}"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = [
        f"{info['model_dir']}: {info['model_type']}, {info['format']}, {info['shards']} shard(s), "
        f"dtypes {info['dtypes']}",
    ]
    if info["manifest"]:
        lines.append(f"gdnprune output of '{info['manifest']['operation']}', sorted: {info['manifest']['sorted']}")
    for r in rows:
        lines.append("  ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))))
    total = info["total_parameters"]
    lines.append(
        f"{len(info['layers'])} GDN layers: {info['gdn_parameters']:,} parameters "
        f"({100 * info['gdn_parameters'] / max(total, 1):.1f}%); other: {info['other_parameters']:,}; "
        f"total: {total:,}"
    )
    if info["passthrough"]:
        lines.append(f"left untouched (pass-through): {info['passthrough']}")
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------------------
# Scores, targets, permutations


def load_scores(scores: str | os.PathLike | Mapping) -> dict:
    """Read and check a scores file (or pass a dict through the same checks).

    A scores file is a JSON object whose ``"layers"`` maps GDN layer prefixes to score payloads (the
    four ``*_order_most_important_first`` keys of
    :meth:`gdnprune.gated_delta_net.GDNPermutation.from_score_payload`); other top-level keys are
    metadata. The orders themselves are checked against the checkpoint by :func:`transform_checkpoint`.

    Raises:
        ScoresError: the file cannot be read, is not JSON, or lacks a ``layers`` object of objects.
    """
    where = "scores"
    if not isinstance(scores, Mapping):
        where = f"scores file {os.fspath(scores)}"
        try:
            with open(scores, encoding="utf-8") as f:
                scores = json.load(f)
        except OSError as exc:
            raise ScoresError(f"{where}: cannot read ({exc.strerror or exc})") from None
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ScoresError(f"{where}: not valid JSON ({exc})") from None
    if not isinstance(scores, Mapping):
        raise ScoresError(f"{where}: expected a JSON object, found {type(scores).__name__}")
    layers = scores.get("layers")
    if not isinstance(layers, Mapping) or not layers:
        raise ScoresError(f"{where}: expected a non-empty 'layers' object mapping GDN layer prefixes to payloads")
    bad = [k for k, v in layers.items() if not isinstance(k, str) or not isinstance(v, Mapping)]
    if bad:
        raise ScoresError(f"{where}: layers[{bad[0]!r}] is not an object of *_order_most_important_first lists")
    return dict(scores)


def _alias(prefix: str) -> str:
    for long, short in _PREFIX_ALIASES:
        if prefix.startswith(long):
            return short + prefix[len(long):]
    return prefix


def matching_prefixes(key: str, prefixes: Iterable[str]) -> list[str]:
    """The GDN layer prefixes among ``prefixes`` that ``key`` names: ``key`` itself, else every prefix that is
    the same layer spelled with or without the ``language_model.`` part of a vision-language checkpoint."""
    prefixes = list(prefixes)
    if key in prefixes:
        return [key]
    return [p for p in prefixes if _alias(p) == _alias(key)]


def _resolve_permutations(permutations: Mapping | None, layers: list[GDNLayer]) -> tuple[dict, list[str]]:
    """Map every entry to a layer (aliases allowed) and validate its orders; also the layers lacking one.

    Returns prefix -> the four orders (numpy, see :func:`gdnprune.geometry.orders_from_payload`).
    """
    from . import geometry

    if permutations is None:
        return {}, []
    by_prefix = {layer.prefix: layer for layer in layers}
    # a GDNPermutation can only exist if its (torch) module was imported: no need to import it here
    core = sys.modules.get("gdnprune.gated_delta_net")
    out: dict[str, Any] = {}
    for key, value in permutations.items():
        candidates = matching_prefixes(key, by_prefix) if isinstance(key, str) else []
        if len(candidates) != 1:
            known = list(by_prefix)
            raise ScoresError(
                f"scores entry {key!r} is not a GDN layer of this checkpoint (its {len(known)} GDN layers: "
                f"{known[:3]}{' ...' if len(known) > 3 else ''})"
            )
        prefix = candidates[0]
        if prefix in out:
            raise ScoresError(f"scores entries {key!r} and another name the same GDN layer {prefix!r}")
        shape = by_prefix[prefix].shape
        try:
            if core is not None and isinstance(value, core.GDNPermutation):
                value.indices(shape)  # checks the orders' sizes against the layer
                out[prefix] = value._numpy()
            elif isinstance(value, Mapping):
                out[prefix] = geometry.orders_from_payload(value, shape)
            else:
                raise ValueError(f"expected a GDNPermutation or a score payload, found {type(value).__name__}")
        except ValueError as exc:
            raise ScoresError(f"scores for GDN layer {key!r} ({shape}): {exc}") from None
    missing = [layer.prefix for layer in layers if layer.prefix not in out]
    return out, missing


def _resolve_target(shape, target):
    """The target GDNShape (``shape`` when None), validated against ``shape``."""
    from .geometry import GDNShape

    if target is None:
        return shape
    if isinstance(target, GDNShape):
        t = target
    elif isinstance(target, Mapping):
        unknown = sorted(set(target) - set(_TARGET_FIELDS))
        if unknown:
            raise TargetError(f"unknown target fields {unknown}; expected some of {list(_TARGET_FIELDS)}")
        try:
            t = shape.replace(**{k: v for k, v in target.items() if v is not None})
        except ValueError as exc:
            raise TargetError(f"illegal target for layers of {shape}: {exc}") from None
    else:
        raise TargetError(f"target must be a GDNShape or a mapping of its fields, got {type(target).__name__}")
    problems = []
    if t.num_key_heads > shape.num_key_heads:
        problems.append(f"num_key_heads {t.num_key_heads} > {shape.num_key_heads}")
    if t.value_heads_per_group > shape.value_heads_per_group:
        problems.append(
            f"num_value_heads {t.num_value_heads} / num_key_heads {t.num_key_heads} = {t.value_heads_per_group} "
            f"value heads per key head > {shape.value_heads_per_group} (give num_value_heads <= "
            f"{t.num_key_heads * shape.value_heads_per_group}, a multiple of {t.num_key_heads})"
        )
    if t.key_head_dim > shape.key_head_dim:
        problems.append(f"key_head_dim {t.key_head_dim} > {shape.key_head_dim}")
    if t.value_head_dim > shape.value_head_dim:
        problems.append(f"value_head_dim {t.value_head_dim} > {shape.value_head_dim}")
    if problems:
        raise TargetError(f"illegal target {t.as_dict()} for layers of {shape}: {'; '.join(problems)}")
    return t


# --------------------------------------------------------------------------------------------------------
# The streaming engine


@dataclass
class _LayerPlan:
    layer: GDNLayer
    target: Any
    indices: dict  # canonical indices for shape -> target, with didx (gdnprune.geometry.check_indices)
    permutation: Any  # the four orders (numpy) or None


@dataclass
class _ShardPlan:
    """One output shard, laid out as ``[header (reserved)][unchanged tensors][GDN tensors]``.

    The unchanged part is known from the source header; ``gdn_entries`` (name -> dtype, shape, begin,
    end, relative to the data section) is filled in by :class:`_GDNWork` once the GDN shapes are known.
    """

    index: int
    src: ShardHeader
    dst: str
    unchanged: list[TensorInfo]
    gdn: list[str]
    reserve: int
    gdn_entries: dict = field(default_factory=dict)

    @property
    def data_start(self) -> int:
        return 8 + self.reserve

    @property
    def unchanged_bytes(self) -> int:
        return sum(t.nbytes for t in self.unchanged)

    def entries(self) -> list[tuple]:
        """``(name, dtype, shape, begin, end)`` of every output tensor, in file order."""
        out, position = [], 0
        for t in self.unchanged:
            out.append((t.name, t.dtype, t.shape, position, position + t.nbytes))
            position += t.nbytes
        return out + [(name, *self.gdn_entries[name]) for name in self.gdn]


def _plan_shards(ckpt: Checkpoint, gdn_names: set[str], tmp: Path) -> list[_ShardPlan]:
    """Output plan of every shard; GDN tensors go last, larger dtypes first (keeps tensors aligned)."""
    max_value = 2 * ckpt.total_bytes + 1  # bounds every offset and dimension of the output headers
    plans = []
    for i, shard in enumerate(ckpt.shards):
        unchanged = [t for t in shard.tensors.values() if t.name not in gdn_names]
        gdn = sorted((n for n in shard.tensors if n in gdn_names),
                     key=lambda n: (-DTYPE_BITS[shard.tensors[n].dtype], shard.tensors[n].start))
        bound_entries = [(t.name, t.dtype, t.shape) for t in unchanged]
        bound_entries += [(n, shard.tensors[n].dtype, [None] * len(shard.tensors[n].shape)) for n in gdn]
        reserve = header_size_bound(bound_entries, shard.metadata, max_value=max_value)
        plans.append(_ShardPlan(i, shard, str(tmp / os.path.basename(shard.path)), unchanged, gdn, reserve))
    return plans


def _copy_unchanged(plan: _ShardPlan, on_chunk: Callable[[int], None]) -> None:
    """Copy the unchanged tensors of one shard in the kernel, coalescing runs contiguous in the source."""
    fd = os.open(plan.dst, os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        src = os.open(plan.src.path, os.O_RDONLY)
        try:
            os.lseek(fd, plan.data_start, os.SEEK_SET)
            runs: list[list[int]] = []
            for t in plan.unchanged:
                if runs and runs[-1][1] == t.start:
                    runs[-1][1] = t.end
                else:
                    runs.append([t.start, t.end])
            for begin, end in runs:
                copy_range(src, fd, begin, end - begin, on_chunk=on_chunk)
        finally:
            os.close(src)
    finally:
        os.close(fd)


def _write_header(plan: _ShardPlan) -> int:
    """Write the shard's header into its reserved space (last, when every tensor is in place)."""
    entries = plan.entries()
    try:
        header = encode_header(entries, plan.src.metadata, size=plan.reserve)
    except ValueError as exc:  # the reserve is an upper bound: this would be a bug
        raise RuntimeError(f"internal error: {exc}") from None
    fd = os.open(plan.dst, os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        write_all(fd, header, 0)
        os.ftruncate(fd, plan.data_start + (entries[-1][4] if entries else 0))
    finally:
        os.close(fd)
    return len(header)


class _GDNWork:
    """The GDN half of a transform.

    :meth:`prepare` (worker thread) checks the copy plan against the layout tables, resolves permutations
    and target, and places every output GDN tensor in its shard. Then :meth:`run` may be called from
    several threads: each takes the next job (one on-disk tensor, or all pieces of a fused tensor stored
    split) and writes it at its final offset (see :func:`_write_job`). No torch: the indices come from
    :mod:`gdnprune.geometry` and the gathers are byte gathers on memory-mapped numpy views.
    """

    def __init__(self, ckpt: Checkpoint, shards: list[_ShardPlan], gdn_names: set[str], permutations, target):
        self.ckpt, self.shards, self.gdn_names = ckpt, shards, gdn_names
        self.permutations, self.target = permutations, target
        self.lock = threading.Lock()
        self.ready = threading.Event()
        self.stop = threading.Event()
        self.error: BaseException | None = None
        self.plans: dict[str, _LayerPlan] = {}
        self.skipped: list[str] = []
        self.missing: list[str] = []
        self.target_shape = None
        self.jobs: list[tuple[_LayerPlan, str]] = []
        self.next_job = 0
        self.bytes_done = 0
        self.total_bytes = 0
        self._shard_of: dict[str, _ShardPlan] = {}

    def prepare(self) -> None:
        from . import geometry

        layers, self.skipped = find_gdn_layers(self.ckpt)
        if {layer.name(s) for layer in layers for s in layer.tensors} != self.gdn_names:
            raise RuntimeError("internal error: the copy plan and the GDN layers disagree")
        perms, self.missing = _resolve_permutations(self.permutations, layers)
        self.target_shape = _resolve_target(layers[0].shape, self.target)
        owner = {}
        for layer in layers:
            t = _resolve_target(layer.shape, self.target_shape.as_dict())
            orders = perms.get(layer.prefix)
            if orders is None:
                indices = geometry.prefix_indices(layer.shape, t)
            else:
                indices = geometry.order_indices(orders, layer.shape, t)
            plan = self.plans[layer.prefix] = _LayerPlan(layer, t, geometry.check_indices(indices, layer.shape, t),
                                                         orders)
            owner.update({layer.name(s): (plan, s) for s in layer.tensors})
        jobs_seen = set()
        for shard in self.shards:
            position = shard.unchanged_bytes
            for name in shard.gdn:
                plan, suffix = owner[name]
                dtype = shard.src.tensors[name].dtype
                shape = _out_shape(plan.layer, suffix, plan.target)
                nbytes = _numel(shape) * DTYPE_BITS[dtype] // 8
                shard.gdn_entries[name] = (dtype, shape, position, position + nbytes)
                position += nbytes
                self.total_bytes += nbytes
                self._shard_of[name] = shard
                job = (plan.layer.prefix, _fused_of(plan.layer, suffix) or suffix)
                if job not in jobs_seen:  # the pieces of a split fused tensor are one job
                    jobs_seen.add(job)
                    self.jobs.append((plan, job[1]))
        # The main thread copies the unchanged bytes shard by shard from the first; the GDN jobs start from
        # the last shard, so that the two threads write different files (writes to one file serialise,
        # presumably on its inode lock: measured 1.9 s of waiting on the benchmark checkpoint) until they meet.
        self.jobs.reverse()

    def run(self, after_job: Callable[[], None] | None = None) -> None:
        """Run jobs until none is left, :attr:`stop` is set or some thread failed."""
        files = _SourceFiles(self.ckpt)
        try:
            while not self.stop.is_set() and self.error is None:
                with self.lock:
                    if self.next_job >= len(self.jobs):
                        return
                    plan, suffix = self.jobs[self.next_job]
                    self.next_job += 1
                written = _write_job(plan, suffix, files, self._destination)
                with self.lock:
                    self.bytes_done += written
                if after_job is not None:
                    after_job()
        finally:
            files.close()

    def _destination(self, plan: _LayerPlan, suffix: str) -> tuple[str, int, tuple[int, ...]]:
        """Output file, absolute offset and planned shape of on-disk tensor ``suffix`` of a layer."""
        name = plan.layer.name(suffix)
        shard = self._shard_of[name]
        _, shape, begin, _ = shard.gdn_entries[name]
        return shard.dst, shard.data_start + begin, shape


class _SourceFiles:
    """Read-only memory maps of the source shards, at most two open at a time (one set per thread)."""

    def __init__(self, ckpt: Checkpoint):
        self.ckpt = ckpt
        self.open: dict[int, mmap.mmap] = {}

    def get(self, name: str) -> tuple[TensorInfo, mmap.mmap]:
        """The header entry of tensor ``name`` and the memory map of its shard."""
        i = self.ckpt.shard_of(name)
        if i not in self.open:
            if len(self.open) >= 2:
                self._close(next(iter(self.open)))
            fd = os.open(self.ckpt.shards[i].path, os.O_RDONLY)
            try:
                self.open[i] = mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
            finally:
                os.close(fd)  # the map keeps its own reference to the file
        return self.ckpt.tensor(name), self.open[i]

    def _close(self, i: int) -> None:
        try:
            self.open.pop(i).close()
        except BufferError:  # a view of it is still alive somewhere: the map is unmapped when that dies
            pass

    def close(self) -> None:
        for i in list(self.open):
            self._close(i)


def _byte_view(info: TensorInfo, mm: mmap.mmap, axis: int):
    """A zero-copy numpy view of a tensor's bytes in which gathering along ``axis`` is a byte gather.

    Axis 0: ``[rows, row bytes]`` of uint8; other axes: the tensor's shape with an unsigned integer of the
    dtype's width (GDN tensors are F16/BF16/F32/F64, checked by :func:`find_gdn_layers`).
    """
    import numpy as np

    if axis == 0:
        return np.frombuffer(mm, dtype=np.uint8, count=info.nbytes, offset=info.start).reshape(info.shape[0], -1)
    width = DTYPE_BITS[info.dtype] // 8
    return np.frombuffer(mm, dtype=f"<u{width}", count=info.numel, offset=info.start).reshape(info.shape)


def _write_job(plan: _LayerPlan, suffix: str, files: _SourceFiles, destination) -> int:
    """Gather on-disk tensor ``suffix`` of a layer (or all pieces of the split fused tensor ``suffix``) to
    the plan's target and write it at its place in the output; returns the bytes written.

    A row gather (axis 0) is written straight from the memory-mapped source rows, runs of consecutive rows
    coalesced, with vectored writes (:func:`~gdnprune.safetensors_io.write_vectors`: one kernel copy, no
    gathered copy in memory); a column gather (``out_proj``) and a split fused tensor are gathered with
    ``numpy.take`` and written with ``pwrite``.
    """
    import numpy as np

    from .layouts import get_layout, segment_size

    layer = plan.layer
    rule = get_layout(layer.layout).rule(suffix)
    index = rule.gather_index(layer.shape, plan.target, plan.indices)
    pieces = layer.splits.get(suffix, (suffix,))
    infos = [files.get(layer.name(p)) for p in pieces]  # shapes and dtypes were checked by find_gdn_layers
    if len(pieces) == 1:
        info, mm = infos[0]
        dst, offset, shape = destination(plan, suffix)
        if index.size != shape[rule.axis]:
            raise RuntimeError(f"internal error: {info.name} gathers {index.size} rows, planned {shape}")
        if rule.axis == 0:
            row = info.nbytes // info.shape[0]
            starts = np.flatnonzero(np.diff(index, prepend=-2) != 1)  # where a run of consecutive rows begins
            lengths = np.diff(starts, append=index.size) * row
            begin = info.start + index[starts] * row
            runs = list(map(memoryview(mm).__getitem__, map(slice, begin.tolist(), (begin + lengths).tolist())))
            fd = os.open(dst, os.O_WRONLY | os.O_CREAT, 0o644)
            try:
                return write_vectors(fd, runs, offset)
            finally:
                os.close(fd)
        out = {suffix: np.take(_byte_view(info, mm, rule.axis), index, axis=rule.axis)}
    else:  # a fused tensor stored split (OLMo-hybrid's q/k/v conv): gather the concatenation, split again
        whole = np.concatenate([_byte_view(info, mm, rule.axis) for info, mm in infos], axis=rule.axis)
        gathered = np.take(whole, index, axis=rule.axis)
        bounds = np.cumsum([segment_size(kind, plan.target) for kind in rule.segments])[:-1]
        out = dict(zip(pieces, np.split(gathered, bounds, axis=rule.axis)))
    written = 0
    for p, array in out.items():
        dst, offset, shape = destination(plan, p)
        if array.shape[rule.axis] != shape[rule.axis]:
            raise RuntimeError(f"internal error: {layer.name(p)} gathered to {array.shape}, planned {shape}")
        data = np.ascontiguousarray(array)
        fd = os.open(dst, os.O_WRONLY | os.O_CREAT, 0o644)
        try:
            written += write_all(fd, data.reshape(-1).view(np.uint8), offset)
        finally:
            os.close(fd)
    return written


def _fused_of(layer: GDNLayer, suffix: str) -> str | None:
    """The fused tensor that on-disk tensor ``suffix`` is a piece of, or None."""
    return next((fused for fused, pieces in layer.splits.items() if suffix in pieces), None)


def _out_shape(layer: GDNLayer, suffix: str, target) -> tuple[int, ...]:
    """Shape of on-disk tensor ``suffix`` of ``layer`` after the gather to geometry ``target``."""
    from .layouts import get_layout, segment_size

    layout = get_layout(layer.layout)
    fused = _fused_of(layer, suffix)
    if fused is None:
        rule = layout.rule(suffix)
        length = rule.length(target)
    else:
        rule = layout.rule(fused)
        length = segment_size(rule.segments[layer.splits[fused].index(suffix)], target)
    shape = list(layer.tensors[suffix].shape)
    shape[rule.axis] = length
    return tuple(shape)


def _check_paths(src: Path, out: Path, overwrite: bool) -> None:
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


_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".ckpt")


def _copy_other_files(src: Path, dst: Path, skip: set[str]) -> list[str]:
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


def _warn(category: type[Warning], message: str) -> None:
    warnings.warn(message, category, stacklevel=3)


def transform_checkpoint(
    model_dir: str | os.PathLike,
    output_dir: str | os.PathLike,
    *,
    permutations: Mapping[str, Any] | None = None,
    target: Any = None,
    operation: str,
    overwrite: bool = False,
    progress: bool = True,
    manifest_extra: Mapping[str, Any] | None = None,
) -> dict:
    """Permute and/or cut every GDN layer of a checkpoint folder into a new folder, streaming.

    Args:
        model_dir: the source folder (sharded or single-file safetensors; opened read-only).
        output_dir: the folder to create (must not be ``model_dir`` or inside it).
        permutations: GDN layer prefix -> :class:`~gdnprune.gated_delta_net.GDNPermutation` or score
            payload (``*_order_most_important_first`` lists). A layer without an entry keeps its order
            (:class:`MissingScoresWarning`); an entry that is not a GDN layer is a :class:`ScoresError`.
            None: no permutation.
        target: the nested-prefix geometry of every GDN layer, a ``GDNShape`` or a mapping of some of its
            fields (missing or None fields keep their size). None: no slicing.
        operation: the name recorded in the manifest (``"sort"``, ``"slice"``, ``"prune"``, ...).
        overwrite: replace an existing ``output_dir``.
        progress: show a tqdm progress bar over bytes written (stderr).
        manifest_extra: extra top-level entries for the manifest.

    Permuting and slicing are one gather per GDN tensor (``permutation.indices(shape, target=...)``);
    every other tensor is copied byte for byte; dtypes, shard names and the tensor-to-shard assignment are
    kept. ``config.json`` gets the target geometry; every other file of the folder is copied (except
    other weight files). Returns the manifest, also written to ``output_dir/gdnprune.json`` (the returned
    dict also has ``elapsed_seconds``).

    Raises:
        CheckpointError, ScoresError, TargetError, OutputError (all ``ValueError``): input errors; no
            output folder is left behind, as for any other failure or an interrupt.
    """
    src, out = Path(model_dir), Path(output_dir)
    _check_paths(src, out, overwrite)
    return _transform(src, out, permutations, target, operation, overwrite, progress, manifest_extra)


def _transform(src: Path, out: Path, permutations, target, operation, overwrite, progress, manifest_extra) -> dict:
    start_time = time.time()
    ckpt = open_checkpoint(src)
    members, _ = _group_gdn_tensors(ckpt.names, _all_markers())
    gdn_names = {n for names in members.values() for n in names}
    if not gdn_names:
        find_gdn_layers(ckpt)  # raises the precise error (no GDN layer / unknown layout)
    if target is not None and permutations is None and not ckpt.is_sorted:
        _warn(UnsortedInputWarning,
              f"{src} has no {MANIFEST_NAME} manifest saying it was sorted: slicing keeps the first heads and "
              f"channels in their original order, not the most important ones (run `gdnprune sort` first)")
    at_least = sum(ckpt.tensor(n).nbytes for n in ckpt.names if target is None or n not in gdn_names)
    existing = next(p for p in (out.parent, *out.parent.parents) if p.exists())
    free = shutil.disk_usage(existing).free
    if free < at_least:
        raise OutputError(f"not enough free disk space for {out}: the output needs more than "
                          f"{at_least / 1e9:.2f} GB, {free / 1e9:.2f} GB free")

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.gdnprune-", dir=out.parent))
    shards = _plan_shards(ckpt, gdn_names, tmp)
    work = _GDNWork(ckpt, shards, gdn_names, permutations, target)

    def worker_main() -> None:
        try:
            work.prepare()
            work.ready.set()
            work.run()
        except BaseException as exc:  # handed to the main thread
            work.error = work.error or exc

    worker = threading.Thread(target=worker_main, name="gdnprune-gdn", daemon=True)
    from tqdm import tqdm

    bar = tqdm(total=ckpt.total_bytes, unit="B", unit_scale=True, unit_divisor=1024, desc=f"gdnprune {operation}",
               disable=not progress, file=sys.stderr, leave=False)
    state = {"warned": False, "gdn_bytes": 0}

    def on_chunk(n: int) -> None:
        """After every written chunk: worker errors, warnings, progress."""
        if work.error is not None:
            raise work.error
        if not state["warned"] and work.ready.is_set():
            state["warned"] = True
            for prefix in work.missing:
                _warn(MissingScoresWarning, f"GDN layer {prefix} has no entry in the scores: it keeps its order")
            if work.skipped:
                _warn(PassthroughWarning, f"{work.skipped} look like GDN layers but are under {PASSTHROUGH_PREFIXES}: "
                                          f"left untouched")
            bar.total = sum(s.data_start + s.unchanged_bytes for s in shards) + work.total_bytes
            bar.refresh()
        done = work.bytes_done
        bar.update(n + done - state["gdn_bytes"])
        state["gdn_bytes"] = done

    def wait_for(event_done: Callable[[], bool]) -> None:
        while not event_done():
            worker.join(timeout=0.05)
            on_chunk(0)

    try:
        worker.start()
        for shard in shards:  # meanwhile the worker imports torch, then gathers
            _copy_unchanged(shard, on_chunk)
        wait_for(lambda: work.ready.is_set() or not worker.is_alive())
        on_chunk(0)
        work.run(after_job=lambda: on_chunk(0))  # help with the GDN tensors that are left
        wait_for(lambda: not worker.is_alive())
        on_chunk(0)
        for shard in shards:
            on_chunk(_write_header(shard))
        manifest = _finish_folder(ckpt, tmp, work, operation, permutations, target, manifest_extra)
        _move_into_place(tmp, out, overwrite)
    except BaseException:
        work.stop.set()
        try:
            worker.join(timeout=30)  # it checks `stop` between tensors; then nothing writes into tmp
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        bar.close()
        work.stop.set()
    manifest["elapsed_seconds"] = round(time.time() - start_time, 3)
    return manifest


def _finish_folder(ckpt: Checkpoint, tmp: Path, work: _GDNWork, operation, permutations, target,
                   manifest_extra) -> dict:
    """Index, config, other files and manifest of the output folder."""
    from .geometry import orders_to_payload

    skip = {os.path.basename(s.path) for s in ckpt.shards} | {INDEX_NAME, CONFIG_NAME, MANIFEST_NAME}
    if ckpt.index is not None:
        index = json.loads(json.dumps(ckpt.index))
        entries = [e for shard in work.shards for e in shard.entries()]
        metadata = index.setdefault("metadata", {})
        if not isinstance(metadata, dict):
            metadata = index["metadata"] = {}
        metadata["total_size"] = sum(e[4] - e[3] for e in entries)
        if "total_parameters" in metadata:
            metadata["total_parameters"] = sum(_numel(e[2]) for e in entries)
        with open(tmp / INDEX_NAME, "w", encoding="utf-8") as f:
            json.dump(index, f, indent=2)
            f.write("\n")
    if target is not None:
        with open(tmp / CONFIG_NAME, "w", encoding="utf-8") as f:
            json.dump(work.target_shape.apply_to_config(ckpt.config), f, indent=2)
            f.write("\n")
    else:
        shutil.copy2(ckpt.path / CONFIG_NAME, tmp / CONFIG_NAME)
    left_out = _copy_other_files(ckpt.path, tmp, skip)
    if left_out:
        _warn(UserWarning, f"other weight files {left_out} of {ckpt.path} were not copied (they are not part of "
                           f"the safetensors checkpoint that was transformed)")
    permuted = [p for p, plan in work.plans.items() if plan.permutation is not None]
    sorted_out = all(p in permuted or ckpt.is_sorted for p in work.plans)
    manifest = {
        "tool": "gdnprune",
        "version": __version__,
        "operation": operation,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "source": {
            "path": str(ckpt.path.resolve()),
            "index_sha256": _sha256(ckpt.path / INDEX_NAME) if ckpt.index is not None else None,
            "config_sha256": _sha256(ckpt.path / CONFIG_NAME),
            "weights_file": INDEX_NAME if ckpt.index is not None else SINGLE_NAME,
            "sorted": ckpt.is_sorted,
            "operation": ckpt.manifest.get("operation") if ckpt.manifest else None,
        },
        "sorted": sorted_out,
        "source_shape": next(iter(work.plans.values())).layer.shape.as_dict(),
        "target": work.target_shape.as_dict() if target is not None else None,
        "layers": {
            prefix: {
                "layout": plan.layer.layout,
                "shape": plan.layer.shape.as_dict(),
                "target": plan.target.as_dict(),
                "permutation": None if plan.permutation is None else orders_to_payload(plan.permutation),
            }
            for prefix, plan in work.plans.items()
        },
        "unsorted_layers": work.missing if permutations is not None else None,
        "passthrough": work.skipped,
        **dict(manifest_extra or {}),
    }
    with open(tmp / MANIFEST_NAME, "w", encoding="utf-8") as f:
        json.dump(manifest, f, indent=1)
        f.write("\n")
    return manifest


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _move_into_place(tmp: Path, out: Path, overwrite: bool) -> None:
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


def sort_checkpoint(model_dir: str | os.PathLike, scores: str | os.PathLike | Mapping, output_dir: str | os.PathLike,
                    **kwargs) -> dict:
    """Write the "sorted teacher": every GDN layer permuted by the orders of ``scores``; same function.

    ``scores`` is a scores file path or dict (see :func:`load_scores`). Keyword arguments are those of
    :func:`transform_checkpoint` (``overwrite``, ``progress``, ``manifest_extra``). Returns the manifest.
    """
    data = load_scores(scores)
    info = {"metadata": {k: v for k, v in data.items() if k != "layers"}}
    if not isinstance(scores, Mapping):
        info = {"path": str(Path(scores).resolve()), "sha256": _sha256(Path(scores)), **info}
    extra = {"scores": info, **dict(kwargs.pop("manifest_extra", None) or {})}
    return transform_checkpoint(model_dir, output_dir, permutations=data["layers"], operation="sort",
                                manifest_extra=extra, **kwargs)


def slice_checkpoint(model_dir: str | os.PathLike, output_dir: str | os.PathLike, target: Any, **kwargs) -> dict:
    """Cut every GDN layer to the nested prefix ``target`` and rewrite the geometry in ``config.json``.

    ``target`` is a ``GDNShape`` or a mapping of some of its fields (``num_key_heads``,
    ``num_value_heads`` (total), ``key_head_dim``, ``value_head_dim``); missing fields keep their size.
    Warns (:class:`UnsortedInputWarning`) when the input has no manifest saying it was sorted. Keyword
    arguments are those of :func:`transform_checkpoint`. Returns the manifest.
    """
    if target is None:
        raise TargetError("slice needs a target (at least one of " + ", ".join(_TARGET_FIELDS) + ")")
    return transform_checkpoint(model_dir, output_dir, target=target, operation="slice", **kwargs)


# --------------------------------------------------------------------------------------------------------
# verify


def _vocab_size(config: Mapping) -> int | None:
    value = config.get("vocab_size")
    if value is None and isinstance(config.get("text_config"), Mapping):
        value = config["text_config"].get("vocab_size")
    return value


_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def _verify_tokens(model_dir: Path, data, vocab: int, seq_len: int, num_sequences: int, seed: int):
    import torch

    if data is None:
        g = torch.Generator().manual_seed(seed)
        return torch.randint(0, vocab, (num_sequences, seq_len), generator=g), f"random ids (seed {seed})"
    try:
        raw = Path(data).read_bytes()
    except OSError as exc:
        raise ValueError(f"--data {data}: cannot read ({exc.strerror or exc})") from None
    ids, source = None, None
    if any((model_dir / name).is_file() for name in _TOKENIZER_FILES):
        try:
            import transformers

            tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
            text = raw.decode("utf-8", errors="replace")
            ids = tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"]
            source = f"{data} tokenised with the tokenizer of {model_dir}"
        except Exception as exc:  # noqa: BLE001 - any tokenizer failure falls back to bytes
            print(f"gdnprune verify: warning: tokenizer of {model_dir} unusable ({exc}); using bytes", file=sys.stderr)
    if ids is None:
        ids, source = list(raw), f"{data} as bytes mod {vocab}"
    ids = torch.tensor(ids[: seq_len * num_sequences], dtype=torch.long) % vocab
    if ids.numel() < 2:
        raise ValueError(f"--data {data}: gives {ids.numel()} tokens, need at least 2")
    n = max(1, ids.numel() // seq_len)
    length = min(seq_len, ids.numel())
    return ids[: n * length].reshape(n, length), source


def _load_causal_lm(path: Path):
    import torch
    import transformers

    try:
        model, info = transformers.AutoModelForCausalLM.from_pretrained(
            path, dtype=torch.float32, output_loading_info=True
        )
    except Exception as exc:  # noqa: BLE001 - whatever transformers raises, the folder is the problem
        raise CheckpointError(f"{path}: transformers cannot load it as a causal LM: {exc}") from None
    problems = {k: v for k, v in info.items() if k in ("missing_keys", "unexpected_keys", "mismatched_keys") and v}
    if problems:
        listed = "; ".join(f"{k}: {sorted(map(str, v))[:3]}" for k, v in problems.items())
        raise CheckpointError(f"{path}: does not load cleanly ({listed})")
    return model.eval()


def verify_checkpoints(
    model_a: str | os.PathLike,
    model_b: str | os.PathLike,
    *,
    data: str | os.PathLike | None = None,
    tolerance: float = 1e-4,
    seq_len: int = 128,
    num_sequences: int = 4,
    seed: int = 0,
    progress: bool = False,
) -> dict:
    """Run the same tokens through two checkpoints (transformers, fp32, CPU) and compare their logits.

    Tokens: ``data`` (a text file) tokenised with ``model_a``'s tokenizer when its folder has one, else
    its bytes mod the vocabulary; without ``data``, seeded random ids. At most ``num_sequences``
    sequences of ``seq_len`` tokens (default 128, longer than the 64-token chunks of the GDN kernel).
    The models are loaded one after the other. A sliced model may be compared with its source (same
    vocabulary, different widths).

    Returns a dict with ``max_abs_diff``, ``mean_abs_diff``, ``loss_a``, ``loss_b`` (next-token cross
    entropy), ``tolerance``, ``within_tolerance`` (``max_abs_diff <= tolerance``), ``tokens`` (shape) and
    ``token_source``.

    Raises:
        CheckpointError: a folder does not load cleanly with transformers, or the vocabularies differ.
    """
    import torch

    a, b = Path(model_a), Path(model_b)
    configs = []
    for path in (a, b):
        if not (path / CONFIG_NAME).is_file():
            raise CheckpointError(f"{path}: no config.json (not a model folder)")
        configs.append(_read_json(path / CONFIG_NAME, "config.json"))
    vocab_a, vocab_b = _vocab_size(configs[0]), _vocab_size(configs[1])
    if not vocab_a or vocab_a != vocab_b:
        raise CheckpointError(f"vocabulary sizes differ or are unknown: {a}: {vocab_a}, {b}: {vocab_b}")
    ids, source = _verify_tokens(a, data, vocab_a, seq_len, num_sequences, seed)

    import transformers

    bars = transformers.utils.logging.is_progress_bar_enabled()
    if not progress:
        transformers.utils.logging.disable_progress_bar()
    try:
        results = []
        for path in (a, b):
            model = _load_causal_lm(path)
            with torch.no_grad():
                logits = torch.cat([model(input_ids=ids[i : i + 1]).logits.float() for i in range(ids.shape[0])])
            del model
            loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
            results.append((logits, float(loss)))
    finally:
        if bars:
            transformers.utils.logging.enable_progress_bar()
    (la, loss_a), (lb, loss_b) = results
    if la.shape != lb.shape:
        raise CheckpointError(f"logits have different shapes: {tuple(la.shape)} vs {tuple(lb.shape)}")
    diff = (la - lb).abs()
    max_diff, mean_diff = float(diff.max()), float(diff.mean())
    return {
        "model_a": str(a),
        "model_b": str(b),
        "tokens": list(ids.shape),
        "token_source": source,
        "max_abs_diff": max_diff,
        "mean_abs_diff": mean_diff,
        "loss_a": loss_a,
        "loss_b": loss_b,
        "tolerance": tolerance,
        "within_tolerance": bool(max_diff <= tolerance),
    }


# --------------------------------------------------------------------------------------------------------
# Command line


class _StderrWarnings:
    """Show warnings as one ``gdnprune CMD: warning: ...`` line on stderr during a command."""

    def __init__(self, command: str):
        self.command = command
        self._ctx = warnings.catch_warnings()

    def __enter__(self):
        self._ctx.__enter__()
        warnings.simplefilter("always", UserWarning)

        def show(message, category, filename, lineno, file=None, line=None):
            print(f"gdnprune {self.command}: warning: {message}", file=sys.stderr)

        warnings.showwarning = show
        return self

    def __exit__(self, *exc):
        return self._ctx.__exit__(*exc)


def _summary(manifest: dict, out: str) -> str:
    layers = manifest["layers"]
    target = manifest.get("target")
    what = f"cut to {target}" if target else "permuted"
    return (f"wrote {out}: {len(layers)} GDN layers {what}, sorted: {manifest['sorted']} "
            f"({manifest['elapsed_seconds']:.1f} s)")


def _cmd_inspect(args) -> int:
    with _StderrWarnings("inspect"):
        info = inspect_checkpoint(args.model_dir)
    print(json.dumps(info, indent=2) if args.json else _format_inspect(info))
    return 0


def _cmd_sort(args) -> int:
    with _StderrWarnings("sort"):
        manifest = sort_checkpoint(args.model_dir, args.scores, args.output, overwrite=args.overwrite,
                                   progress=not args.quiet)
    print(_summary(manifest, args.output))
    return 0


def add_target_arguments(p) -> None:
    """The nested-target options shared by ``gdnprune slice`` and ``gdnprune prune``."""
    p.add_argument("--num-key-heads", dest="num_key_heads", type=_positive_int, metavar="N")
    p.add_argument("--num-value-heads", dest="num_value_heads", type=_positive_int, metavar="N",
                   help="total value heads, a multiple of the key heads")
    p.add_argument("--key-head-dim", dest="key_head_dim", type=_positive_int, metavar="N")
    p.add_argument("--value-head-dim", dest="value_head_dim", type=_positive_int, metavar="N")


def target_from_args(args) -> dict[str, int]:
    """The target fields given on the command line (an axis not given keeps its size)."""
    target = {f: getattr(args, f) for f in _TARGET_FIELDS if getattr(args, f) is not None}
    if not target:
        raise TargetError("nothing to slice: give at least one of --num-key-heads, --num-value-heads, "
                          "--key-head-dim, --value-head-dim")
    return target


def _cmd_slice(args) -> int:
    target = target_from_args(args)
    with _StderrWarnings("slice"):
        manifest = slice_checkpoint(args.model_dir, args.output, target, overwrite=args.overwrite,
                                    progress=not args.quiet)
    print(_summary(manifest, args.output))
    return 0


def _cmd_verify(args) -> int:
    with _StderrWarnings("verify"):
        r = verify_checkpoints(args.model_a, args.model_b, data=args.data, tolerance=args.tolerance,
                               seq_len=args.seq_len, num_sequences=args.num_sequences, seed=args.seed)
    print(f"tokens: {r['tokens'][0]} x {r['tokens'][1]} ({r['token_source']})")
    print(f"loss A: {r['loss_a']:.6f}  ({r['model_a']})")
    print(f"loss B: {r['loss_b']:.6f}  ({r['model_b']})")
    verdict = "OK" if r["within_tolerance"] else "EXCEEDS tolerance"
    print(f"max |logit diff|: {r['max_abs_diff']:.3e}  mean: {r['mean_abs_diff']:.3e}  "
          f"tolerance: {r['tolerance']:.1e}  {verdict}")
    return 0 if r["within_tolerance"] else 1


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def add_commands(subparsers) -> None:
    """Register the ``inspect``, ``sort``, ``slice`` and ``verify`` subcommands."""
    p = subparsers.add_parser("inspect", help="list the GDN layers of a checkpoint folder",
                              description="A table of every GDN layer (prefix, layout, geometry, parameters) "
                                          "and the parameter totals. Reads the safetensors headers only.")
    p.add_argument("model_dir", metavar="MODEL_DIR")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(func=_cmd_inspect)

    def output_args(p):
        p.add_argument("--output", "-o", required=True, metavar="OUT_DIR", help="folder to create")
        p.add_argument("--overwrite", action="store_true", help="replace OUT_DIR if it exists")
        p.add_argument("--quiet", "-q", action="store_true", help="no progress bar")

    p = subparsers.add_parser("sort", help="permute every GDN layer by importance (same function)",
                              description="Apply the importance orders of a scores file to every GDN layer: "
                                          "the output computes the same function (the sorted teacher).")
    p.add_argument("model_dir", metavar="MODEL_DIR")
    p.add_argument("--scores", required=True, metavar="SCORES.json",
                   help='JSON object with "layers": {prefix: {*_order_most_important_first: ...}}')
    output_args(p)
    p.set_defaults(func=_cmd_sort)

    p = subparsers.add_parser("slice", help="cut every GDN layer to a nested prefix",
                              description="Keep the first key heads, value heads, key dims and value dims of "
                                          "every GDN layer and rewrite the geometry in config.json. An axis "
                                          "not given keeps its size. Sort first so that the prefix is the "
                                          "most important part.")
    p.add_argument("model_dir", metavar="MODEL_DIR")
    output_args(p)
    add_target_arguments(p)
    p.set_defaults(func=_cmd_slice)

    p = subparsers.add_parser("verify", help="compare the logits of two checkpoints",
                              description="Load both folders with transformers (fp32), run the same tokens and "
                                          "print the max and mean absolute logit difference and each model's "
                                          "loss. Exit 0 within tolerance, 1 otherwise.")
    p.add_argument("model_a", metavar="MODEL_A")
    p.add_argument("model_b", metavar="MODEL_B")
    p.add_argument("--data", metavar="TEXT_FILE", help="text to run (default: seeded random token ids)")
    p.add_argument("--tolerance", type=float, default=1e-4, help="max |logit diff| allowed (default 1e-4)")
    p.add_argument("--seq-len", dest="seq_len", type=_positive_int, default=128, help="tokens per sequence (128)")
    p.add_argument("--num-sequences", dest="num_sequences", type=_positive_int, default=4, help="sequences (4)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random ids (0)")
    p.set_defaults(func=_cmd_verify)
