"""Sharded loading: a model folder read straight into the shards of a model built on ``meta``.

:func:`load_sharded` builds the model as :func:`gdnprune.io.model_classes.empty_pretrained` builds it, lets the
caller shard it (FSDP2's ``fully_shard``), and fills each process's rows from the safetensors files
(``os.pread`` of their bytes): no process ever holds the whole model. :func:`sharded_loading_names` maps
every model tensor to what the folder stores (the model's own name, a name ``from_pretrained`` renames,
FP8 blocks with their scales, one tensor per expert, parts concatenated), or raises
:class:`ShardedLoadingError` when the folder cannot be read that way.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import weakref
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers.conversion_mapping import get_model_conversion_mapping
from transformers.core_model_loading import Concatenate, WeightConverter, WeightRenaming, apply_renamings

from .model_classes import empty_pretrained
from .safetensors_io import read_header

__all__ = ["load_sharded", "sharded_loading_names", "ShardedLoadingError", "StoredTensor"]


def _folder_key(path: str | os.PathLike) -> tuple[tuple[str, int, int], ...]:
    """The safetensors files of a model folder, each with its modification time and size."""
    files = sorted(Path(path).glob("*.safetensors"))
    return tuple((str(f), (st := f.stat()).st_mtime_ns, st.st_size) for f in files)


def _disk_index(path: str | os.PathLike) -> dict[str, str]:
    """``{tensor name: safetensors file}`` of a model folder (headers only; read once while its files stay
    the same: at 512 experts a folder stores 75,944 tensors)."""
    return _index_of(_folder_key(path))


@functools.lru_cache(maxsize=8)
def _index_of(key: tuple[tuple[str, int, int], ...]) -> dict[str, str]:
    index: dict[str, str] = {}
    for file, _, _ in key:
        index.update(dict.fromkeys(read_header(file).tensors, file))
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


#: sharded_loading_names's answer per model object and folder (a check before loading asks what the load asks)
_NAMES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def sharded_loading_names(path: str | os.PathLike, model: Any) -> dict[str, StoredTensor]:
    """``{model tensor name: where it is stored}`` (:class:`StoredTensor`) for every tensor of ``model`` (built
    as :func:`empty_pretrained` builds it): under its own name or the name ``from_pretrained`` renames to it
    (a vision-language prefix; tied tensors under one of their names; FP8 block-scaled weights with their
    scales), or, for an MoE layer's stacked experts, one tensor per expert, or in parts that transformers
    concatenates along dim 0 (OLMo-hybrid's ``conv1d`` from ``q_conv1d``, ``k_conv1d``, ``v_conv1d``).

    Raises :class:`ShardedLoadingError` naming the first tensor stored in no such form, and ``ValueError``
    for a quantization other than FP8 blocks (only ``from_pretrained`` with its quantizer reads those).
    """
    key = _folder_key(path)
    cached = _NAMES.get(model)
    if cached is not None and cached[0] == key:
        return cached[1]
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
    _NAMES[model] = (key, names)
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
    model: Any = None,
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
    precision, as accelerate upcasts it). ``model``: the folder's model on ``meta`` when the caller built it
    already (:func:`empty_pretrained`, e.g. to check :func:`sharded_loading_names` first), sharded and filled
    in place. Returns the model, in eval mode.
    """

    if model is None:
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
        self._header = read_header(file).tensors  # parsed once per file (safetensors_io keeps it)
        self._fd = os.open(file, os.O_RDONLY)

    def __enter__(self) -> _RowReader:
        return self

    def __exit__(self, *exc: object) -> None:
        os.close(self._fd)

    def shape(self, name: str) -> list[int]:
        return list(self._header[name].shape)

    def rows(self, name: str, first: int, count: int | None) -> Any:
        """Rows ``first .. first + count`` of tensor ``name`` (all of it when ``count`` is None)."""

        entry = self._header[name]
        dtype, shape = getattr(torch, self._DTYPES[entry.dtype]), list(entry.shape)
        begin, end = entry.start, entry.end  # absolute offsets in the file
        if count is not None and shape:
            row = (end - begin) // max(1, shape[0])
            begin, end, shape = begin + first * row, begin + (first + count) * row, [count, *shape[1:]]
        data = bytearray()
        while len(data) < end - begin:  # a read returns at most ~2 GB
            chunk = os.pread(self._fd, end - begin - len(data), begin + len(data))
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
