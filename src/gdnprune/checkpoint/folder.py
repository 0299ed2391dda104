"""Reading a checkpoint folder: its config, index and shard headers, its GDN layers, and ``inspect``.

Nothing here reads tensor data or imports torch: a folder is described from its ``config.json``, its
``model.safetensors.index.json`` (or single ``model.safetensors``) and the safetensors headers.
:func:`find_gdn_layers` groups tensor names into GDN layers by the layouts' marker suffixes and checks
every layer against its layout table and the config's geometry, so that the engine never starts on a
layer it would only half transform (a missing tensor, an unknown tensor such as a quantisation scale, a
wrong shape or dtype is a :class:`CheckpointError`).
"""

from __future__ import annotations

import bisect
import functools
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..io.safetensors_io import CheckpointError, ShardHeader, TensorInfo, read_header
from ..io.scores_file import matching_prefixes
from ..model.geometry import GDNShape, layer_index_of, per_layer_gdn_overrides
from ..model.layouts import LAYOUTS, detect_layout, get_layout, scale_name, scale_rule, scaled_weight
from ..model.model_config import MTP_PREFIX, config_value, text_config
from ..model.subblock_geometry import find_blocks
from ..runtime.fileio import read_json

__all__ = [
    "INDEX_NAME",
    "SINGLE_NAME",
    "CONFIG_NAME",
    "MANIFEST_NAME",
    "PASSTHROUGH_PREFIXES",
    "GDN_DTYPES",
    "Checkpoint",
    "GDNLayer",
    "open_checkpoint",
    "read_manifest",
    "find_gdn_layers",
    "find_block_layers",
    "map_to_checkpoint",
    "tile_size",
]

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
CONFIG_NAME = "config.json"
MANIFEST_NAME = "gdnprune.json"
#: tensors under these prefixes are never treated as GDN layers (copied unchanged)
PASSTHROUGH_PREFIXES = (MTP_PREFIX,)
#: dtypes a GDN tensor may have (the gathers are byte gathers of whole elements)
GDN_DTYPES = ("F64", "F32", "F16", "BF16")
#: dtypes of block-quantised GDN weights (FP8, with a ``weight_scale_inv`` beside them) and of their scales
FP8_DTYPES = ("F8_E4M3", "F8_E5M2")
SCALE_DTYPES = ("F32", "BF16", "F16", "F8_E8M0")
SCALE_SUFFIX = "weight_scale_inv"

# Fused tensors that a layout stores split on disk: fused suffix -> on-disk suffixes, one per segment of
# the fused tensor's rule (in order). OLMo-hybrid's own save writes q/k/v_conv1d.
_DISK_SPLITS = {
    "olmo_hybrid": {
        "conv1d.weight": ("q_conv1d.weight", "k_conv1d.weight", "v_conv1d.weight"),
        "conv1d.bias": ("q_conv1d.bias", "k_conv1d.bias", "v_conv1d.bias"),
    },
}


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

    @functools.cached_property
    def shapes(self) -> dict[str, tuple[int, ...]]:
        """``{name: shape}`` of every tensor, in :attr:`names`' order (built once: the tables of sub-blocks and
        of the hidden size read it, and a 512-expert model has 75,944 tensors)."""
        return {name: self.shards[i].tensors[name].shape for name, i in self._where.items()}

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
    manifest = read_json(path, CheckpointError)
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
    config = read_json(path / CONFIG_NAME, CheckpointError) if (path / CONFIG_NAME).is_file() else None
    if not isinstance(config, dict):
        raise CheckpointError(f"{path}: no config.json (a JSON object) in the model folder")
    index = None
    if (path / INDEX_NAME).is_file():
        index = read_json(path / INDEX_NAME, CheckpointError)
        weight_map = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(weight_map, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()
        ):
            raise CheckpointError(
                f"{path / INDEX_NAME}: expected a 'weight_map' object of tensor name -> file"
            )
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

    return frozenset().union(*(layout.markers for layout in LAYOUTS.values()))


def _group_gdn_tensors(
    names: Iterable[str], markers: frozenset[str]
) -> tuple[dict[str, list[str]], list[str]]:
    """Group tensor names into GDN layers by marker suffix.

    Returns ``{prefix: [names under prefix]}`` and the sorted pass-through prefixes (``mtp.``) that
    would have been GDN layers.
    """
    names = list(names)
    depths = sorted({m.count(".") + 1 for m in markers})
    prefixes: set[str] = set()
    skipped: set[str] = set()
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
        scales: FP8 scale suffix -> its block rule (:func:`gdnprune.model.layouts.scale_rule`).
    """

    prefix: str
    layout: str
    shape: Any
    tensors: dict[str, TensorInfo]
    splits: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    scales: dict[str, Any] = field(default_factory=dict)
    kind: str = "gdn"  # or a sub-block kind of gdnprune.model.subblock_geometry ("attention", "mlp", "shared_expert", "experts")
    numbered: dict = field(default_factory=dict)  # experts.N.* suffix -> shape (renamed, not gathered)

    def rule(self, suffix: str):
        """The rule of tensor ``suffix``: the layout's, or the block rule of an FP8 scale tensor (None for the
        hidden channels' tensors: their gathers are all on the hidden axis, :class:`~.engine.LayerPlan`)."""

        if self.kind == "hidden":
            return None
        return self.scales.get(suffix) or get_layout(self.layout).rule(suffix)

    @property
    def quantized(self) -> dict[str, str]:
        """``{weight suffix: "F8_E4M3, scales 128x128"}`` for the block-quantised weights of the layer."""

        return {
            weight: f"{self.tensors[weight].dtype}, "
            f"scales of {self.scales[s].block} along axis {self.scales[s].axis}"
            for s in self.scales
            if (weight := scaled_weight(s)) is not None
        }

    @property
    def parameters(self) -> int:
        """Number of parameters of the layer."""
        return sum(t.numel for t in self.tensors.values())

    @property
    def conv_kernel(self) -> int:
        """The depthwise conv's kernel size ``K`` (the last dim of ``conv1d.weight`` or its split pieces)."""
        conv = self.tensors.get("conv1d.weight") or next(
            self.tensors[p] for p in self.splits.get("conv1d.weight", ())
        )
        return conv.shape[-1]

    def name(self, suffix: str) -> str:
        """Full tensor name of ``suffix`` (the suffix itself for the hidden channels' tensors, whose
        "layer" is the whole model: prefix ``""``)."""
        return f"{self.prefix}.{suffix}" if self.prefix else suffix


def _config_shape(config: Mapping, where: Path, prefix: str | None = None):
    """The geometry ``config.json`` gives the GDN layer ``prefix`` (per-layer configs included)."""

    try:
        index = None
        if prefix is not None and per_layer_gdn_overrides(config):
            index = layer_index_of(prefix)
        return GDNShape.from_config(config, layer_index=index)
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

    members, skipped = _group_gdn_tensors(checkpoint.names, _all_markers())
    inside = {n for names in members.values() for n in names}
    stray = sorted(
        n
        for n in checkpoint.names
        if ".linear_attn." in n and n not in inside and not n.startswith(PASSTHROUGH_PREFIXES)
    )
    if stray:
        module = stray[0].split(".linear_attn.")[0] + ".linear_attn"
        found = sorted(n[len(module) + 1 :] for n in stray if n.startswith(module + "."))
        raise CheckpointError(
            f"{module}: unknown GDN layout: its tensors {found[:6]} match none of the layouts "
            f"{sorted(LAYOUTS)} (marker tensors: {sorted(_all_markers())})"
        )
    if not members:
        raise CheckpointError(
            f"{checkpoint.path}: no GDN layer found: no tensor ends in one of the layouts' marker names "
            f"{sorted(_all_markers())}"
        )
    layers = []
    for prefix, names in members.items():
        shape = _config_shape(checkpoint.config, checkpoint.path, prefix)
        tensors = {n[len(prefix) + 1 :]: checkpoint.tensor(n) for n in names}
        try:
            layout = detect_layout(tensors)
        except ValueError as exc:
            raise CheckpointError(f"{prefix}: {exc}") from None
        if layout is None:  # cannot happen: the layer was found by a layout's marker tensor
            raise CheckpointError(f"{prefix}: its tensors match no GDN layout")
        layers.append(_check_layer(prefix, get_layout(layout), shape, tensors, _block_size(checkpoint)))
    return layers, skipped


def find_block_layers(checkpoint: Checkpoint, kinds) -> list[GDNLayer]:
    """The sub-blocks of ``kinds`` (:data:`gdnprune.model.subblock_geometry.KINDS`: attention, MLP, shared expert) of
    ``checkpoint``, each checked like a GDN layer against its layout table and the config's geometry. The
    engine treats them as it treats GDN layers; the tensors a layout leaves unchanged (``fixed``) are not
    part of them and are copied byte for byte.

    Raises:
        CheckpointError: a block whose tensors fit none of its kind's layouts (e.g. an indexed attention),
            or a tensor of the wrong shape or dtype.
    """

    try:
        blocks = find_blocks(checkpoint.shapes, checkpoint.config, kinds)
    except ValueError as exc:
        raise CheckpointError(str(exc)) from None
    layers = []
    for block in blocks:
        tensors = {s: checkpoint.tensor(f"{block.prefix}.{s}") for s in block.tensors}
        layer = _check_layer(
            block.prefix, get_layout(block.layout), block.shape, tensors, _block_size(checkpoint)
        )
        layer.kind, layer.numbered = block.kind, block.numbered
        layers.append(layer)
    return layers


def tile_size(checkpoint: Checkpoint) -> tuple[int, int] | None:
    """The FP8 scale tile (``quantization_config.weight_block_size``), None when the checkpoint is not FP8."""
    return _block_size(checkpoint)


def _block_size(checkpoint: Checkpoint) -> tuple[int, int] | None:
    """The ``weight_block_size`` of an FP8 checkpoint's ``quantization_config`` (None when it is not one)."""
    config = checkpoint.config
    quant = config_value(text_config(config, "quantization_config"), "quantization_config")
    if not isinstance(quant, Mapping) or quant.get("quant_method") != "fp8":
        return None
    block = quant.get("weight_block_size")
    if not (isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
        raise CheckpointError(
            f"{checkpoint.path / CONFIG_NAME}: quantization_config.weight_block_size must be "
            f"[rows, columns] (e.g. [128, 128]), found {block!r}"
        )
    return tuple(block)


def _check_layer(
    prefix: str, layout, shape, tensors: dict[str, TensorInfo], block_size: tuple[int, int] | None = None
) -> GDNLayer:
    """Validate one layer's tensors (names, presence, shapes, dtypes) without reading data."""

    splits = {
        fused: pieces
        for fused, pieces in _DISK_SPLITS.get(layout.name, {}).items()
        if any(p in tensors for p in pieces)
    }
    piece_of = {p: fused for fused, pieces in splits.items() for p in pieces}
    scales = {}
    for suffix in tensors:  # x.weight_scale_inv; a fused expert tensor's experts.gate_up_proj_scale_inv
        weight = layout.rule(scaled_weight(suffix)) if scaled_weight(suffix) and "." in suffix else None
        if weight is not None and block_size is not None and (weight.ndim == 2 or weight.axis == 0):
            scales[suffix] = scale_rule(weight, suffix, block_size)
    unknown = sorted(s for s in tensors if layout.rule(s) is None and s not in piece_of and s not in scales)
    if unknown:
        hint = (
            " (block-quantised weights need quantization_config with quant_method fp8 and weight_block_size "
            "in config.json)"
            if any(scaled_weight(s) for s in unknown)
            else ""
        )
        raise CheckpointError(
            f"{prefix}: tensors {[f'{prefix}.{s}' for s in unknown]} are not part of the {layout.name} GDN "
            f"layout; refusing to change the layer{hint}"
        )
    _check_scales(prefix, layout, shape, tensors, scales, block_size)
    for fused, pieces in splits.items():
        if fused in tensors:
            raise CheckpointError(f"{prefix}: has both {fused!r} and its split form {list(pieces)}")
        absent = [p for p in pieces if p not in tensors]
        if absent:
            raise CheckpointError(
                f"{prefix}: missing tensor {prefix + '.' + absent[0]!r} (the split {fused} needs "
                f"{list(pieces)})"
            )
    for rule in layout.rules:
        if rule.required and rule.name not in tensors and rule.name not in splits:
            raise CheckpointError(
                f"{prefix}: missing tensor {prefix + '.' + rule.name!r} of the {layout.name} GDN layout "
                f"(expected shape {rule.expected_shape(shape)})"
            )
    quantized = {scaled_weight(s) for s in scales}
    for suffix, info in tensors.items():
        if suffix in scales:
            continue
        rule = layout.rule(suffix) or layout.rule(piece_of.get(suffix, ""))
        if suffix in quantized and info.dtype in FP8_DTYPES:
            pass
        elif info.dtype not in GDN_DTYPES:
            raise CheckpointError(
                f"{prefix}: tensor {info.name!r} has dtype {info.dtype}; GDN tensors must be "
                f"one of {list(GDN_DTYPES)}"
            )
        if len(info.shape) != rule.ndim:
            raise CheckpointError(
                f"{prefix}: tensor {info.name!r} has shape {info.shape}, expected "
                f"{rule.ndim} dimensions {rule.expected_shape(shape)} for {shape}"
            )
        if suffix not in piece_of and info.shape[rule.axis] != rule.length(shape):
            raise CheckpointError(
                f"{prefix}: tensor {info.name!r} has shape {info.shape}, expected "
                f"{rule.expected_shape(shape)} for {shape} (config.json geometry)"
            )
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
    return GDNLayer(prefix, layout.name, shape, tensors, splits, scales)


def _check_scales(
    prefix: str,
    layout,
    shape,
    tensors: Mapping[str, TensorInfo],
    scales: Mapping[str, Any],
    block_size: tuple[int, int] | None,
) -> None:
    """FP8 weights come with their scales, of the shape the block grid gives: ``ceil(rows/B) x ceil(cols/B)``
    (``E x ...`` for a fused 3-D expert tensor: one grid per expert)."""

    for suffix, info in tensors.items():
        if info.dtype in FP8_DTYPES and scale_name(suffix) not in scales:
            raise CheckpointError(
                f"{prefix}: {info.name!r} is {info.dtype} but has no {scale_name(suffix)} beside "
                f"it (or config.json has no FP8 quantization_config)"
            )
    for suffix in scales:
        scaled = scaled_weight(suffix)
        info, weight = tensors[suffix], None if scaled is None else tensors.get(scaled)
        if weight is None or weight.dtype not in FP8_DTYPES:
            raise CheckpointError(
                f"{prefix}: {info.name!r} scales a weight that is not FP8 "
                f"({None if weight is None else weight.dtype})"
            )
        if block_size is None:
            raise CheckpointError(
                f"{prefix}: {info.name!r} is a block scale but config.json has no FP8 weight_block_size"
            )
        expected = tuple(weight.shape[:-2]) + tuple(-(-d // b) for d, b in zip(weight.shape[-2:], block_size))
        if info.shape != expected or info.dtype not in SCALE_DTYPES:
            raise CheckpointError(
                f"{prefix}: {info.name!r} is {info.dtype} {list(info.shape)}, expected one of "
                f"{list(SCALE_DTYPES)} with shape {list(expected)} (blocks of {list(block_size)} "
                f"over {list(weight.shape)})"
            )


# --------------------------------------------------------------------------------------------------------
# inspect


def map_to_checkpoint(
    prefixes: list[str], model_dir: str | os.PathLike, *, modules: bool = False
) -> dict[str, str]:
    """``{model prefix: checkpoint prefix}``: a loaded model's GDN module prefixes mapped to the GDN layer
    prefixes of the folder's tensors (they differ when a vision-language checkpoint is loaded as a text
    model). Unchanged when the folder has no safetensors. ``modules``: map to any module of the folder's
    tensors instead (the attention / MLP sub-blocks)."""

    if not prefixes:
        return {}
    try:
        ckpt = open_checkpoint(model_dir)
        stored = (
            sorted({n.rsplit(".", 2)[0] for n in ckpt.names})
            if modules
            else [layer.prefix for layer in find_gdn_layers(ckpt)[0]]
        )
    except CheckpointError:
        return {p: p for p in prefixes}
    mapping = {}
    for prefix in prefixes:
        candidates = matching_prefixes(prefix, stored)
        if len(candidates) != 1:
            raise ValueError(
                f"cannot match the model's GDN layer {prefix!r} to the checkpoint's tensor names "
                f"(candidates {sorted(candidates)})"
            )
        mapping[prefix] = candidates[0]
    return mapping
