"""``load_pretrained``: a normal transformers model from a checkpoint whose GDN layers differ in width.

A per-layer plan writes transformers' own convention into ``config.json``: ``per_layer_config``
(``{layer index: {linear_*: value}}``, transformers' ``HeterogeneousConfigMixin``). transformers 5.x
parses it, but its Qwen and OLMo modeling still builds every GDN layer from the global config, and
reading a per-layer attribute globally raises ``AmbiguousGlobalPerLayerAttributeError`` — so plain
``from_pretrained`` fails loudly instead of loading wrong shapes. :func:`load_pretrained` builds each GDN
module from its own layer's config (``config.per_layer_config[i]``) for the duration of
``from_pretrained``, then returns the model: every other module, the weight loading, dtypes, device maps,
the cache and ``save_pretrained`` are transformers' own. The recurrent cache sizes its conv and delta-rule
states from the tensors each layer passes it, so cached generation works with per-layer shapes.

A checkpoint with one GDN geometry loads exactly as ``from_pretrained`` loads it.
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import os
import struct
import sys
import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import transformers
from accelerate.utils import get_max_memory
from safetensors import safe_open
from transformers.conversion_mapping import get_model_conversion_mapping
from transformers.core_model_loading import Concatenate, WeightConverter, WeightRenaming, apply_renamings

from .distributed import launch_info
from .gated_delta_net import GDNPermutation, slice_gated_delta_net_state_dict
from .geometry import GDN_CONFIG_KEYS, GDNShape, apply_targets_to_config, layer_index_of
from .layouts import find_gdn_modules
from .model_config import per_layer_overrides, text_config
from .subblock_geometry import (
    BLOCK_FIELDS,
    KINDS,
    apply_block_targets_to_config,
    block_kinds_of,
    resolve_block_target,
)
from .subblock_surgery import find_model_blocks, slice_block_state_dict
from .targets import resolve_target

__all__ = [
    "load_pretrained",
    "load_sharded",
    "empty_pretrained",
    "sharded_loading_names",
    "ShardedLoadingError",
    "StoredTensor",
    "load_causal_lm",
    "empty_causal_lm",
    "slice_model",
    "per_layer_gdn_modules",
]

_LOCK = threading.RLock()


def _gdn_classes(model_class: type) -> list[type]:
    """The GatedDeltaNet module classes of the modeling file that defines ``model_class``."""
    return _classes(model_class, "GatedDeltaNet")


def _classes(model_class: type, suffix: str) -> list[type]:
    module = sys.modules[model_class.__module__]
    return [obj for name, obj in vars(module).items() if isinstance(obj, type) and name.endswith(suffix)]


@contextlib.contextmanager
def per_layer_gdn_modules(model_class: type) -> Iterator[None]:
    """While inside, the GDN modules and the decoder layers (so their attention and MLP too) of
    ``model_class``'s family are built from their layer's own config when the model config is
    heterogeneous (``config.per_layer_config[layer_idx]``)."""
    classes = _gdn_classes(model_class)
    layers = _classes(model_class, "DecoderLayer")
    if not classes:
        raise ValueError(
            f"{model_class.__name__}: no GatedDeltaNet module class in {model_class.__module__}; "
            f"per-layer GDN geometries are supported for the Qwen3.5, Qwen3-Next and OLMo-hybrid "
            f"families"
        )
    heads = [
        c
        for c in _classes(model_class, "ForCausalLM") + _classes(model_class, "ForConditionalGeneration")
        if "__init__" in c.__dict__
    ]
    with _LOCK:
        originals = {cls: cls.__dict__["__init__"] for cls in classes + layers if "__init__" in cls.__dict__}
        globals_ = {cls: cls.__dict__["__init__"] for cls in heads}
        for cls, original in globals_.items():

            @functools.wraps(original)
            def head_init(self, config, *args, _original=original, **kwargs):
                # MoE heads read num_experts globally (router aux loss): the most common count, as config.json's
                # global key holds it; the aux loss of per-layer expert counts is not defined (leave
                # output_router_logits off)
                text = text_config(config)
                before = {
                    id(c): c.__dict__.get("allow_global_per_layer_attribute_access") for c in (config, text)
                }
                for c in (config, text):
                    c.__dict__["allow_global_per_layer_attribute_access"] = True
                try:
                    _original(self, config, *args, **kwargs)
                finally:
                    for c in (config, text):
                        if before[id(c)] is None:
                            c.__dict__.pop("allow_global_per_layer_attribute_access", None)
                        else:
                            c.__dict__["allow_global_per_layer_attribute_access"] = before[id(c)]

            setattr(cls, "__init__", head_init)  # noqa: B010  (mypy: assigning __init__ is unsound)
        originals.update(globals_)
        for cls, original in originals.items():
            if cls in globals_:
                continue

            @functools.wraps(original)
            def init(self, config, layer_idx=None, *args, _original=original, **kwargs):
                if layer_idx is not None and getattr(config, "is_heterogeneous", False):
                    config = config.per_layer_config[layer_idx]
                _original(self, config, layer_idx, *args, **kwargs)

            setattr(cls, "__init__", init)  # noqa: B010
        try:
            yield
        finally:
            for cls, original in originals.items():
                setattr(cls, "__init__", original)  # noqa: B010


def _resolve_class(config: Any, model_class: Any) -> tuple[Any, type]:
    """The class to call ``from_pretrained`` on, and the concrete model class it builds (the same class
    unless ``model_class`` is an Auto class)."""
    if model_class is None:
        names = getattr(config, "architectures", None) or []
        found = [getattr(transformers, name, None) for name in names]
        model_class = next((c for c in found if c is not None), transformers.AutoModelForCausalLM)
    mapping = getattr(model_class, "_model_mapping", None)
    if mapping is not None:  # an Auto class: the concrete class it picks for this config
        try:
            return model_class, mapping[type(config)]
        except KeyError:
            raise ValueError(f"{model_class.__name__} cannot load a {type(config).__name__}") from None
    return model_class, model_class


def _heterogeneous(config: Any) -> bool:
    """Whether ``config`` sets a GDN, attention or MLP geometry per layer."""
    keys = set(GDN_CONFIG_KEYS).union(*(kind.config_keys for kind in KINDS.values()))
    return bool(per_layer_overrides(config, keys, key="linear_num_key_heads"))


def load_pretrained(
    path: str | os.PathLike, *, model_class: Any = None, **from_pretrained_kwargs: Any
) -> Any:
    """Load a Hugging Face model folder, with per-layer GDN geometries when ``config.json`` has them.

    Args:
        path: the model folder (a gdnprune output or any checkpoint ``from_pretrained`` reads).
        model_class: the transformers class to load with (default: the config's ``architectures`` entry,
            e.g. ``Qwen3_5ForConditionalGeneration`` for a vision-language checkpoint, else
            ``AutoModelForCausalLM``). An Auto class works too.
        **from_pretrained_kwargs: passed to ``from_pretrained`` (``dtype``, ``device_map``,
            ``output_loading_info``, ...).

    Returns:
        What ``model_class.from_pretrained`` returns: a normal transformers model whose GDN modules have
        their own geometry (``module.num_v_heads`` etc.), and whose config keeps ``per_layer_config``.
    """
    config = from_pretrained_kwargs.pop("config", None) or transformers.AutoConfig.from_pretrained(path)
    loader, concrete = _resolve_class(config, model_class)
    text = text_config(config)
    if not _heterogeneous(text) and not _heterogeneous(config):
        return loader.from_pretrained(path, config=config, **from_pretrained_kwargs)
    with per_layer_gdn_modules(concrete):
        return loader.from_pretrained(path, config=config, **from_pretrained_kwargs)


def load_causal_lm(
    model_dir: str | os.PathLike,
    *,
    dtype: str = "float32",
    device: str | None = None,
    device_map: str | None = None,
    gpus: list[int] | None = None,
) -> Any:
    """A causal LM from ``model_dir`` in eval mode, for calibration forwards (the text part of a
    vision-language checkpoint; per-layer GDN geometries as :func:`load_pretrained` reads them).

    ``dtype``: ``"float32"`` or ``"bfloat16"``. ``device``: where the model goes without a ``device_map``
    (default: the local rank's GPU when CUDA is available, else cpu). ``gpus``: with a ``device_map``, the
    only GPUs it may use (this rank's block, :func:`gdnprune.distributed.local_gpus`).
    """
    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    kwargs: dict[str, Any] = {"dtype": torch_dtype}
    if device_map is not None:
        kwargs["device_map"] = device_map
        if gpus is not None:
            available = get_max_memory()
            kwargs["max_memory"] = {k: v for k, v in available.items() if not isinstance(k, int) or k in gpus}
    try:
        model = load_pretrained(model_dir, model_class=transformers.AutoModelForCausalLM, **kwargs)
    except ValueError as first:
        try:
            model = load_pretrained(model_dir, **kwargs)  # the class in config.json's architectures
        except ValueError:
            raise ValueError(f"{model_dir}: cannot load a causal language model ({first})") from None
    if device_map is None:
        model.to(device or _default_device())
    return model.eval()


def empty_causal_lm(model_dir: str | os.PathLike) -> Any:
    """The causal LM that :func:`load_causal_lm` would load, built on the ``meta`` device from the folder's
    config alone: every module with its shapes and per-layer GDN geometry, no weight read or allocated.
    For what needs the structure only (the plan's proxy sensitivity)."""
    config = transformers.AutoConfig.from_pretrained(model_dir)
    text = text_config(config)
    try:
        loader, concrete = _resolve_class(config, transformers.AutoModelForCausalLM)
    except ValueError as first:
        try:
            loader, concrete = _resolve_class(config, None)  # the class in config.json's architectures
        except ValueError:
            raise ValueError(f"{model_dir}: cannot build a causal language model ({first})") from None
    per_layer = _heterogeneous(text) or _heterogeneous(config)
    with per_layer_gdn_modules(concrete) if per_layer else contextlib.nullcontext(), torch.device("meta"):
        model = loader.from_config(config) if loader is not concrete else concrete(config)
    return model.eval()


def empty_pretrained(path: str | os.PathLike, *, model_class: Any = None, dtype: Any = None) -> Any:
    """The model :func:`load_pretrained` would load (same class choice), built on the ``meta`` device from
    the folder's config alone, in ``dtype`` (default: float32), weights tied as the config says. Built as
    ``from_pretrained`` builds it: parameters created in ``dtype``, buffers that transformers computes in
    float32 (the rotary frequencies) kept in float32, ``config.dtype`` set to ``dtype``."""

    config = transformers.AutoConfig.from_pretrained(path)
    _, concrete = _resolve_class(config, model_class)
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    per_layer = _heterogeneous(text) or _heterogeneous(config)
    with per_layer_gdn_modules(concrete) if per_layer else contextlib.nullcontext(), torch.device("meta"):
        model = concrete._from_config(config, dtype=dtype or torch.float32)  # type: ignore[attr-defined]
    return model.eval()


def _disk_index(path: str | os.PathLike) -> dict[str, str]:
    """``{tensor name: safetensors file}`` of a model folder (headers only)."""

    index: dict[str, str] = {}
    for file in sorted(Path(path).glob("*.safetensors")):
        with safe_open(str(file), "pt") as f:
            index.update(dict.fromkeys(f.keys(), str(file)))
    return index


def _state(model: Any) -> dict[str, Any]:
    """``{name: tensor}``: the model's persistent state, a tied tensor under each of its names (the same object)."""
    return dict(model.state_dict(keep_vars=True))


@dataclass(frozen=True)
class StoredTensor:
    """Where a model tensor lies in a folder: under ``name`` (FP8 weights with their block scales
    ``NAME_scale_inv`` beside them are dequantized as read), or, for the stacked experts of an MoE layer
    stored one tensor per expert, ``experts[e]``: the names whose tensors, concatenated along dim 0, are
    expert ``e``'s row of the model's tensor (``gate_up_proj`` from ``gate_proj`` and ``up_proj``)."""

    name: str | None = None
    experts: tuple[tuple[str, ...], ...] = ()
    #: the names whose tensors, concatenated along dim 0, are the model's tensor (a transformers converter that
    #: only concatenates, e.g. OLMo-hybrid's ``conv1d`` from ``q_conv1d``, ``k_conv1d`` and ``v_conv1d``)
    parts: tuple[str, ...] = ()


# the stacked expert tensors of transformers' MoE layers, and the per-expert tensors each concatenates
_STACKED_EXPERTS = {"gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}


def _per_expert(name: str, experts: int, stored: Mapping[str, str]) -> StoredTensor | None:
    prefix, _, last = name.rpartition(".")
    if last not in _STACKED_EXPERTS or not prefix.endswith(".experts"):
        return None
    parts = tuple(tuple(f"{prefix}.{e}.{p}.weight" for p in _STACKED_EXPERTS[last]) for e in range(experts))
    if not all(n in stored for names in parts for n in names):
        return None
    return StoredTensor(experts=tuple(tuple(stored[n] for n in names) for names in parts))


def _concatenations(model: Any) -> list[tuple[str, tuple[str, ...]]]:
    """``(model name ending, stored name endings)`` of the transformers converters of ``model`` that only
    concatenate plain-named stored tensors along dim 0 (``Concatenate(dim=0)``)."""
    found = []
    for t in get_model_conversion_mapping(model):
        if not isinstance(t, WeightConverter) or len(t.target_patterns) != 1:
            continue
        ops = t.operations
        plain = not any("*" in p for p in [*t.source_patterns, *t.target_patterns])
        if plain and len(ops) == 1 and isinstance(ops[0], Concatenate) and ops[0].dim == 0:
            found.append((t.target_patterns[0], tuple(t.source_patterns)))
    return found


def _concatenated(
    name: str, concatenations: list[tuple[str, tuple[str, ...]]], stored: Mapping[str, str]
) -> StoredTensor | None:
    for target, sources in concatenations:
        if name.endswith("." + target):
            parts = [name.removesuffix(target) + source for source in sources]
            if all(p in stored for p in parts):
                return StoredTensor(parts=tuple(stored[p] for p in parts))
    return None


def _quant_method(config: Any) -> str | None:
    quant = getattr(config, "quantization_config", None)
    quant = quant if quant is None or isinstance(quant, dict) else quant.to_dict()
    return None if quant is None else str(quant.get("quant_method"))


def _fp8(config: Any) -> bool:
    return _quant_method(config) == "fp8"


class ShardedLoadingError(ValueError):
    """A folder that sharded loading cannot read: it stores a tensor of the model in a form only a whole
    ``from_pretrained`` converts. The message names the first such tensor."""


def _model_names(model: Any, disk: Mapping[str, str]) -> dict[str, str]:
    """``{name in the model's form: name stored}`` for every tensor of ``disk``: each stored name renamed as
    ``from_pretrained`` renames it for ``model`` (transformers' ``WeightRenaming`` and ``PrefixChange``
    entries of its conversion mapping, e.g. a text model reading a vision-language folder's
    ``model.language_model.`` tensors as ``model.``); a name stored as the model names it stays itself."""
    renamings = [t for t in get_model_conversion_mapping(model) if isinstance(t, WeightRenaming)]
    names = {apply_renamings(stored, renamings): stored for stored in disk} if renamings else {}
    names.update({stored: stored for stored in disk})
    return names


def sharded_loading_names(path: str | os.PathLike, model: Any) -> dict[str, StoredTensor]:
    """``{model tensor name: where it is stored}`` (:class:`StoredTensor`) for every tensor of ``model`` (built
    as :func:`empty_pretrained` builds it): under its own name or the name ``from_pretrained`` renames to it
    (a vision-language prefix; tied tensors under one of their names; FP8 block-scaled weights with their
    scales), or, for an MoE layer's stacked experts, one tensor per expert, or in parts that transformers
    concatenates along dim 0 (OLMo-hybrid's ``conv1d`` from ``q_conv1d``, ``k_conv1d``, ``v_conv1d``).

    Raises :class:`ShardedLoadingError` naming the first tensor stored in no such form, and ``ValueError``
    for a quantization other than FP8 blocks (only ``from_pretrained`` with its quantizer reads those).
    """
    method = _quant_method(model.config)
    if method is not None and method != "fp8":
        raise ValueError(
            f"{path}: expected plain or FP8 block-scaled weights (quant_method 'fp8') to load into shards, "
            f"found quant_method {method!r}; dequantize the checkpoint first"
        )
    stored = _model_names(model, _disk_index(path))
    concatenations = _concatenations(model)
    state = _state(model)
    groups: dict[int, list[str]] = {}
    for name, value in state.items():
        groups.setdefault(id(value), []).append(name)
    names: dict[str, StoredTensor] = {}
    for group in groups.values():
        found = next((n for n in group if n in stored), None)
        value = state[group[0]]
        where = (
            StoredTensor(stored[found])
            if found
            else _per_expert(group[0], value.shape[0] if value.dim() else 0, stored)
            or _concatenated(group[0], concatenations, stored)
        )
        if where is None:
            raise ShardedLoadingError(
                f"{path}: {group[0]} is stored in no form sharded loading reads (its own name or one "
                f"transformers renames to it, FP8 blocks, one tensor per expert, parts concatenated)"
            )
        names.update(dict.fromkeys(group, where))
    return names


def _rows(value: Any) -> tuple[Any, int]:
    """``(local tensor, first global row)`` of a parameter: a DTensor sharded on dim 0 (FSDP2's placement:
    ``torch.chunk`` of the rows over the mesh), or a plain tensor (all rows, from 0)."""
    if not hasattr(value, "to_local"):
        return value, 0
    local = value.to_local()
    if local.dim() == 0:
        return local, 0
    world, rank = value.device_mesh.size(), value.device_mesh.get_local_rank()
    chunk = -(-value.shape[0] // world)
    return local, min(rank * chunk, value.shape[0])


def load_sharded(
    path: str | os.PathLike,
    shard: Any,
    *,
    model_class: Any = None,
    dtype: Any = None,
    device: Any = "cpu",
    upcast_from: Any = None,
) -> Any:
    """Load a model folder straight into shards: no process ever holds the whole model.

    The model is built on the ``meta`` device (:func:`empty_pretrained`), ``shard(model)`` shards it in
    place (e.g. ``torch.distributed.fsdp.fully_shard`` per decoder layer and the root: parameters become
    DTensors sharded on dim 0), its storage is allocated on ``device`` (each process only its shards),
    and each process reads from the safetensors files only the rows it owns (``os.pread`` of their bytes),
    cast to ``dtype`` as ``from_pretrained`` casts. Non-persistent buffers (rotary frequencies) are
    recomputed as transformers initialises them. The folder must store every tensor under the model's
    own name, FP8 weights with their block scales (dequantized into ``dtype`` as ``from_pretrained``
    dequantizes them where FP8 cannot run), an MoE layer's experts one tensor per expert, or parts that
    ``from_pretrained`` concatenates, under the model's names or those ``from_pretrained`` renames to them (:func:`sharded_loading_names`), else
    :class:`ShardedLoadingError`. ``upcast_from``: the floating-point weights as a model loaded in this
    dtype and then cast to ``dtype`` holds them (a bf16 student's float32 master weights under mixed
    precision, as accelerate upcasts it). Returns the model, in eval mode.
    """

    model = empty_pretrained(path, model_class=model_class, dtype=dtype)
    names = sharded_loading_names(path, model)
    shard(model)
    model.to_empty(device=device)
    index = _disk_index(path)
    done: set[int] = set()
    with torch.no_grad(), contextlib.ExitStack() as stack:
        files = _Folder(index, {f: stack.enter_context(_RowReader(f)) for f in set(index.values())})
        for name, value in _state(model).items():
            if id(value) in done:
                continue
            done.add(id(value))
            local, first = _rows(value)
            read = local.dtype if upcast_from is None or not local.is_floating_point() else upcast_from
            rows = files.rows(names[name], first, local.shape[0] if local.dim() else None, read)
            local.copy_(rows.to(read).to(local.dtype).reshape(local.shape))
        _init_non_persistent_buffers(model)
    if _fp8(model.config):  # dequantized, as from_pretrained dequantizes FP8 weights where it cannot run them
        model.config.quantization_config = None
    return model.eval()


class _Folder:
    """The rows of a model tensor from a folder's files: as stored, dequantized from FP8 blocks, stacked
    from one tensor per expert, or concatenated from parts."""

    def __init__(self, index: dict[str, str], readers: dict[str, _RowReader]) -> None:
        self._index, self._readers = index, readers

    def rows(self, stored: StoredTensor, first: int, count: int | None, dtype: torch.dtype) -> Any:
        if stored.parts:
            return self._concatenated_rows(stored.parts, first, count, dtype)
        if not stored.experts:
            return self._tensor(str(stored.name), first, count, dtype)
        chosen = stored.experts[first : None if count is None else first + count]
        parts = [torch.cat([self._tensor(n, 0, None, dtype) for n in names]) for names in chosen]
        return torch.stack(parts) if parts else torch.empty(0, dtype=dtype)

    def _concatenated_rows(
        self, parts: tuple[str, ...], first: int, count: int | None, dtype: torch.dtype
    ) -> Any:
        """Rows ``first .. first + count`` of the parts' tensors concatenated along dim 0 (all when None)."""
        pieces, offset = [], 0
        for name in parts:
            rows = self._readers[self._index[name]].shape(name)[0]
            low = max(first, offset)
            high = offset + rows if count is None else min(first + count, offset + rows)
            if high > low:
                pieces.append(self._tensor(name, low - offset, high - low, dtype))
            offset += rows
        return torch.cat(pieces) if pieces else torch.empty(0, dtype=dtype)

    def _tensor(self, name: str, first: int, count: int | None, dtype: torch.dtype) -> Any:
        reader = self._readers[self._index[name]]
        data = reader.rows(name, first, count)
        scale = name.removesuffix("weight") + "weight_scale_inv"  # FP8 block scales (only beside a weight)
        if scale not in self._index:
            if data.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
                raise ValueError(f"{name}: FP8 weights without their block scales ({scale}) beside them")
            return data
        # transformers' FP8 dequantization, on these rows only: each block of rows x columns times its
        # scale, in float32, then cast to the parameter's dtype (its Fp8Dequantize)
        rows, cols = reader.shape(name)
        scale_rows, scale_cols = reader.shape(scale)
        if rows % scale_rows or cols % scale_cols or not data.is_floating_point():
            raise ValueError(
                f"{name}: expected FP8 weights in whole blocks of its scales, found {rows} x {cols}"
            )
        block, width = rows // scale_rows, cols // scale_cols
        first = first if count is not None else 0
        count = count if count is not None else rows
        top = first // block
        scales = self._readers[self._index[scale]].rows(scale, top, -(-(first + count) // block) - top)
        scales = scales.float() if scales.dtype != torch.uint8 else (scales.float() - 127.0).exp2()
        grid = scales.repeat_interleave(block, 0)[first - top * block :][:count].repeat_interleave(width, 1)
        return (data.float() * grid).to(dtype)


class _RowReader:
    """Rows of the tensors of one safetensors file, read with ``os.pread``: safetensors' own reader maps the
    file, and the pages a process touches then count in its resident memory until it closes the file; a
    read copies only the bytes asked for. The format: an 8-byte little-endian header length, a JSON header
    (``dtype``, ``shape``, ``data_offsets`` of each tensor), the row-major data."""

    _DTYPES = {
        "F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64",
        "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool",
        "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2",
    }  # fmt: skip

    def __init__(self, file: str) -> None:

        self._fd = os.open(file, os.O_RDONLY)
        (size,) = struct.unpack("<Q", os.pread(self._fd, 8, 0))
        self._header = json.loads(os.pread(self._fd, size, 8))
        self._start = 8 + size

    def __enter__(self) -> _RowReader:
        return self

    def __exit__(self, *exc: object) -> None:
        os.close(self._fd)

    def shape(self, name: str) -> list[int]:
        return list(self._header[name]["shape"])

    def rows(self, name: str, first: int, count: int | None) -> Any:
        """Rows ``first .. first + count`` of tensor ``name`` (all of it when ``count`` is None)."""

        entry = self._header[name]
        dtype, shape = getattr(torch, self._DTYPES[entry["dtype"]]), list(entry["shape"])
        begin, end = entry["data_offsets"]
        if count is not None and shape:
            row = (end - begin) // max(1, shape[0])
            begin, end, shape = begin + first * row, begin + (first + count) * row, [count, *shape[1:]]
        data = bytearray()
        while len(data) < end - begin:  # a read returns at most ~2 GB
            chunk = os.pread(self._fd, end - begin - len(data), self._start + begin + len(data))
            if not chunk:
                raise OSError(f"{name}: the file ends before its data ({end - begin} bytes expected)")
            data += chunk
        if math.prod(shape) == 0:
            return torch.empty(shape, dtype=dtype)
        return torch.frombuffer(data, dtype=dtype).view(shape)


def _init_non_persistent_buffers(model: Any) -> None:
    """Recompute the non-persistent buffers (left empty by ``to_empty``) as transformers' ``_init_weights``
    does: the rotary embeddings' frequencies. Any other kind raises ``ValueError``."""
    for name, module in model.named_modules():
        buffers = [
            b
            for b in getattr(module, "_non_persistent_buffers_set", ())
            if module._buffers.get(b) is not None
        ]
        if not buffers:
            continue
        if "RotaryEmbedding" not in type(module).__name__:
            raise ValueError(
                f"{name}: cannot recompute its non-persistent buffers {buffers} after sharded loading"
            )
        model._init_weights(module)


def _default_device() -> str:
    """cuda (the local rank's GPU under a launcher) when CUDA is available, else cpu."""
    if not torch.cuda.is_available():
        return "cpu"
    info = launch_info()
    return f"cuda:{(info.local_rank if info else 0) % max(1, torch.cuda.device_count())}"


def slice_model(
    model: Any, targets: Any = None, permutations: Any = None, *, blocks: Any = None, block_orders: Any = None
) -> Any:
    """A new model: ``model`` with every GDN layer sorted by ``permutations`` and cut to its target, in memory,
    and its attention and MLP sub-blocks sorted by ``block_orders`` and cut to ``blocks``.

    Args:
        model: a loaded transformers model with GDN layers.
        targets: one target for every GDN layer (a ``GDNShape`` or a mapping of some of its fields), or
            ``{module prefix: target}`` (layers not named keep their geometry); None: GDN layers keep theirs.
        permutations: ``{module prefix: GDNPermutation or score payload}`` (None: no sorting).
        blocks: sub-block target fields (``intermediate_size``, ``shared_expert_intermediate_size``,
            ``num_attention_heads``, ``num_key_value_heads``) for every sub-block that has them, or
            ``{sub-block prefix: fields}`` (e.g. ``"model.layers.3.self_attn"``); None: no cut.
        block_orders: ``{sub-block prefix: orders or score payload}`` (:mod:`gdnprune.subblock_surgery`).

    The new model's config records the per-layer geometry as a sliced checkpoint does (the plain keys
    when the layers agree, ``per_layer_config`` when they differ), so ``save_pretrained`` writes a folder
    that :func:`load_pretrained` reads back.
    """
    modules = find_gdn_modules(model)
    per_layer = (
        isinstance(targets, dict)
        and all(isinstance(v, (GDNShape, dict)) for v in targets.values())
        and set(targets) <= {p for p, _ in modules}
    )
    state = dict(model.state_dict())
    chosen = {}
    for prefix, module in modules:
        shape = GDNShape.from_module(module)
        target = resolve_target(shape, (targets or {}).get(prefix) if per_layer else targets)
        perm = None if permutations is None else permutations.get(prefix)
        if isinstance(perm, dict):
            perm = GDNPermutation.from_score_payload(perm, shape)
        slice_gated_delta_net_state_dict(state, prefix=prefix, shape=shape, target=target, permutation=perm)
        chosen[layer_index_of(prefix)] = target
    config = apply_targets_to_config(model.config.to_dict(), chosen)
    if blocks is not None or block_orders:
        per_block = isinstance(blocks, Mapping) and not set(blocks) <= set(BLOCK_FIELDS)
        named = set(block_orders or {}) | (set(blocks) if per_block else set())
        kinds = {kind.name for p in named for kind in block_kinds_of(p)}
        kinds |= {k.name for k in KINDS.values() if not per_block and set(blocks or {}) & set(k.config_keys)}
        found = find_model_blocks(model, sorted(kinds))  # only the kinds asked for: others may be unsupported
        by_prefix = {b.prefix: b for b in found}
        unknown = sorted(named - set(by_prefix))
        absent = (
            []
            if per_block
            else sorted(f for f in (blocks or {}) if not any(f in KINDS[b.kind].config_keys for b in found))
        )
        if absent:
            raise ValueError(
                f"no sub-block of this model has {absent} (its sub-blocks: "
                f"{sorted({b.kind for b in found}) or 'none'})"
            )
        if unknown:
            raise ValueError(
                f"{unknown} are not sub-blocks of this model (its sub-blocks: {sorted(by_prefix)[:4]} ...)"
            )
        cut: dict[str, dict[int, Any]] = {}
        for block in found:
            fields = (blocks or {}).get(block.prefix) if per_block else blocks
            target = resolve_block_target(block, fields)
            slice_block_state_dict(state, block, target, orders=(block_orders or {}).get(block.prefix))
            cut.setdefault(block.kind, {})[layer_index_of(block.prefix)] = target
        for kind, kind_targets in cut.items():
            config = apply_block_targets_to_config(config, kind, kind_targets)
    config = type(model.config).from_dict(config)
    with per_layer_gdn_modules(type(model)):
        new = type(model)(config)
    new.load_state_dict(state, strict=True)
    return new.to(next(model.parameters()).dtype).eval()
