"""The trained model as a normal Hugging Face folder, written from sharded or whole parameters.

:func:`save_model_folder` gathers the parameters one tensor at a time (a DTensor's ``full_tensor()``, a
collective every process joins) and the main process writes them shard file by shard file, so no process
ever holds more than one output shard of the model. Names and layouts are those ``save_pretrained`` writes
(transformers' reverse weight conversions, e.g. fused MoE experts back to one tensor per expert); tied
weights are written once. Extra tensors (``mtp.*`` read from the student's folder) are written as they
were read, byte for byte. Every file gets the permissions of the umask.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch.distributed.tensor import DTensor
from transformers import PreTrainedModel
from transformers.core_model_loading import revert_weight_conversion

from ..runtime.fileio import umask
from .fsdp import is_sharded

__all__ = [
    "save_model_folder",
    "read_tensors",
    "load_model_weights",
    "check_checkpoint_keys",
    "CheckpointKeysError",
    "MAX_SHARD_BYTES",
]

MAX_SHARD_BYTES = 2 << 30  # 2 GiB per output file
_INDEX = "model.safetensors.index.json"


def read_tensors(folder: str | Path, prefix: str) -> dict[str, torch.Tensor]:
    """The tensors of a safetensors model folder whose names start with ``prefix`` (e.g. ``"mtp."``)."""
    folder = Path(folder)
    index = folder / _INDEX
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = sorted({f for name, f in weight_map.items() if name.startswith(prefix)})
    else:
        files = ["model.safetensors"] if (folder / "model.safetensors").is_file() else []
    found = {}
    for name in files:
        with safe_open(folder / name, "pt") as f:
            found.update({k: f.get_tensor(k) for k in f.keys() if k.startswith(prefix)})
    return found


def _plan(entries: list[tuple[str, int]], max_bytes: int) -> list[list[str]]:
    shards: list[list[str]] = [[]]
    size = 0
    for name, nbytes in entries:
        if shards[-1] and size + nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    return shards


def _gathered(value: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a DTensor shard (a collective), or the tensor itself. Shards offloaded to the CPU
    are gathered through the accelerator when there is one (NCCL gathers device memory only)."""
    if not isinstance(value, DTensor):
        return value
    local = value.to_local()
    if local.device.type == "cpu" and torch.cuda.is_available():
        value = DTensor.from_local(
            local.cuda(),
            value.device_mesh,
            value.placements,
            run_check=False,
            shape=value.shape,
            stride=value.stride(),
        )
    return value.full_tensor()


def save_model_folder(
    model: PreTrainedModel,
    out: str | Path,
    *,
    main: bool = True,
    extra: Mapping[str, torch.Tensor] | None = None,
    max_shard_bytes: int = MAX_SHARD_BYTES,
    dtype: torch.dtype | None = None,
) -> list[str]:
    """Write ``model`` (whole, or FSDP2-sharded over the process group) into ``out`` as ``save_pretrained``
    would: config, generation config, ``model*.safetensors`` (with an index when more than one file).

    Every process must call it (the gathers are collectives); only ``main`` writes. ``extra`` tensors are
    added as given. ``dtype``: the floating-point tensors are written in it (and the config says so); None:
    as held. Returns the weight files written (by ``main``; [] elsewhere).
    """
    out = Path(out)
    seen, entries, tensors = set(), [], {}
    for name, value in model.state_dict(keep_vars=True).items():
        if id(value) in seen:  # a tied weight: written once, under its first name (as save_pretrained does)
            continue
        seen.add(id(value))
        tensors[name] = value
        size = value.element_size() if dtype is None or not value.is_floating_point() else dtype.itemsize
        entries.append((name, value.numel() * size))
    extra = dict(extra or {})
    entries += [(name, t.numel() * t.element_size()) for name, t in extra.items()]
    shards = _plan(entries, max_shard_bytes)
    count = len(shards)
    names = (
        ["model.safetensors"]
        if count == 1
        else [f"model-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]
    )
    mode = 0o666 & ~umask()
    weight_map, total = {}, 0
    if main:
        out.mkdir(parents=True, exist_ok=True)
    for file, shard in zip(names, shards):
        part = {}
        for name in shard:
            if name in extra:
                continue
            full = _gathered(tensors[name].detach())
            if main:
                full = full.to("cpu")
                cast = dtype is not None and full.is_floating_point()
                part[name] = (full.to(dtype) if cast else full).contiguous()
            del full
        if not main:
            continue
        part = revert_weight_conversion(model, part) if part else part
        part.update({name: extra[name].contiguous() for name in shard if name in extra})
        save_file(part, out / file, metadata={"format": "pt"})
        os.chmod(out / file, mode)
        weight_map.update({k: file for k in part})
        total += sum(t.numel() * t.element_size() for t in part.values())
        del part
    if not main:
        return []
    if count > 1:
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (out / _INDEX).write_text(json.dumps(index, indent=2) + "\n")
    config = getattr(model, "config", None)
    if config is not None:
        # as save_pretrained does; FSDP2 subclasses the model's class as FSDP<class>
        name = type(model).__name__
        config.architectures = [name.removeprefix("FSDP") if is_sharded(model) else name]
        held = config.dtype
        if dtype is not None:
            config.dtype = dtype
        try:
            config.save_pretrained(out)
        finally:
            config.dtype = held
    generation = getattr(model, "generation_config", None)
    if generation is not None and getattr(model, "can_generate", lambda: False)():
        generation.save_pretrained(out)
    return names


class CheckpointKeysError(ValueError):
    """A checkpoint's tensors are not the model's: names missing from it, or names the model does not have."""


def _key_error(where: str, missing: set[str], unexpected: set[str]) -> CheckpointKeysError:
    def some(keys: set[str]) -> str:
        shown = sorted(keys)[:4]
        return ", ".join(shown) + (f" and {len(keys) - len(shown)} more" if len(keys) > len(shown) else "")

    return CheckpointKeysError(
        f"resume: expected the tensors of the model being trained in {where}, found "
        f"{len(missing)} missing ({some(missing) or 'none'}) and {len(unexpected)} unexpected "
        f"({some(unexpected) or 'none'}); it was written by another model"
    )


def _unique_tensors(model: torch.nn.Module) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """``({name: tensor}, {alias: name})``: the model's state, tied tensors once under their first name, and the
    other names of each tied tensor."""
    unique: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    first: dict[int, str] = {}
    for name, value in model.state_dict(keep_vars=True).items():
        if id(value) in first:
            aliases[name] = first[id(value)]
            continue
        first[id(value)] = name
        unique[name] = value
    return unique, aliases


def check_checkpoint_keys(model: torch.nn.Module, names, where: str) -> None:
    """Raise :class:`CheckpointKeysError` unless ``names`` (a sharded checkpoint's, in the model's own form) are
    the tensors of ``model``, tied tensors once."""
    unique, aliases = _unique_tensors(model)
    found = {aliases.get(n, n) for n in names}
    if found != set(unique):
        raise _key_error(where, set(unique) - found, found - set(unique))


def load_model_weights(model: torch.nn.Module, folder: str | Path) -> None:
    """Load the safetensors weights of a checkpoint folder into ``model`` in place, strictly.

    The folder may store the tensors as the model holds them, or as ``save_pretrained`` writes them (the
    reverse weight conversions of transformers, e.g. one tensor per expert where the model holds fused
    experts): the second form is mapped back element by element through the same conversions applied to
    the elements' positions, so every conversion that only moves elements is undone exactly. Any tensor
    missing from the folder, or any tensor the model lacks, raises :class:`CheckpointKeysError`; tied
    tensors need one of their names.
    """
    folder = Path(folder)
    files = sorted(folder.glob("*.safetensors"))
    state: dict[str, torch.Tensor] = {}
    for file in files:
        with safe_open(file, "pt") as f:
            state.update({k: f.get_tensor(k) for k in f.keys()})
    unique, aliases = _unique_tensors(model)
    state = {aliases.get(k, k): v for k, v in state.items()}
    if set(state) != set(unique):
        state = _to_model_form(model, unique, state, str(folder))
    with torch.no_grad():
        for name, value in unique.items():
            if tuple(state[name].shape) != tuple(value.shape):
                raise CheckpointKeysError(
                    f"resume: expected {name} of shape {tuple(value.shape)} in {folder}, found "
                    f"{tuple(state[name].shape)}"
                )
            value.copy_(state[name])


def _to_model_form(
    model: Any,  # a transformers PreTrainedModel: its weight conversions
    unique: dict[str, torch.Tensor],
    state: dict[str, torch.Tensor],
    where: str,
) -> dict[str, torch.Tensor]:
    """``state`` in ``save_pretrained``'s form as the model's tensors: each model tensor is filled with its
    elements' positions in one flat vector, converted as ``save_pretrained`` converts, so every saved
    tensor says where its elements belong."""
    offsets, positions = {}, {}
    total = 0
    for name, value in unique.items():
        offsets[name] = total
        positions[name] = torch.arange(total, total + value.numel()).view(value.shape)
        total += value.numel()
    saved = revert_weight_conversion(model, positions)
    if set(saved) != set(state):  # named after the form the folder is closer to
        expected = min((set(saved), set(unique)), key=lambda names: len(names ^ set(state)))
        raise _key_error(where, expected - set(state), set(state) - expected)
    flat = torch.empty(total, dtype=torch.float64)  # exact for every float dtype of a model
    for name, where_to in saved.items():
        flat[where_to.reshape(-1)] = state[name].reshape(-1).to(torch.float64)
    return {
        name: flat[offsets[name] : offsets[name] + value.numel()].view(value.shape).to(value.dtype)
        for name, value in unique.items()
    }
