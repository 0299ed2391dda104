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

import torch

from ..fileio import umask
from .fsdp import is_sharded

__all__ = ["save_model_folder", "read_tensors", "MAX_SHARD_BYTES"]

MAX_SHARD_BYTES = 2 << 30  # 2 GiB per output file
_INDEX = "model.safetensors.index.json"


def read_tensors(folder: str | Path, prefix: str) -> dict[str, torch.Tensor]:
    """The tensors of a safetensors model folder whose names start with ``prefix`` (e.g. ``"mtp."``)."""
    from safetensors import safe_open

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
    shards, size = [[]], 0
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
    if not hasattr(value, "full_tensor"):
        return value
    local = value.to_local()
    if local.device.type == "cpu" and torch.cuda.is_available():
        from torch.distributed.tensor import DTensor

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
    model: torch.nn.Module,
    out: str | Path,
    *,
    main: bool = True,
    extra: Mapping[str, torch.Tensor] | None = None,
    max_shard_bytes: int = MAX_SHARD_BYTES,
) -> list[str]:
    """Write ``model`` (whole, or FSDP2-sharded over the process group) into ``out`` as ``save_pretrained``
    would: config, generation config, ``model*.safetensors`` (with an index when more than one file).

    Every process must call it (the gathers are collectives); only ``main`` writes. ``extra`` tensors are
    added as given. Returns the weight files written (by ``main``; [] elsewhere).
    """
    from safetensors.torch import save_file
    from transformers.core_model_loading import revert_weight_conversion

    out = Path(out)
    seen, entries, tensors = set(), [], {}
    for name, value in model.state_dict(keep_vars=True).items():
        if id(value) in seen:  # a tied weight: written once, under its first name (as save_pretrained does)
            continue
        seen.add(id(value))
        tensors[name] = value
        entries.append((name, value.numel() * value.element_size()))
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
                part[name] = full.to("cpu").contiguous()
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
        config.save_pretrained(out)
    generation = getattr(model, "generation_config", None)
    if generation is not None and getattr(model, "can_generate", lambda: False)():
        generation.save_pretrained(out)
    return names
