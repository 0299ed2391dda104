"""Random models with the real counts of the Qwen hybrid family at tiny widths, written as checkpoint folders
the way the released ones are laid out: shards with an index, one tensor per routed expert, an ``mtp.*`` head
of as many layers as the member has, and gdnprune's byte tokenizer. What the tests, ``benchmarks/scale.py``
and a user trying the pipeline at a real model's counts run on (``gdnprune.model.family.tiny_config`` gives
the config).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import transformers

from .demo_data import build_byte_tokenizer
from .io.safetensors_io import encode_header, write_vectors
from .model.layouts import find_gdn_modules
from .model.model_config import MTP_PREFIX

__all__ = ["build_model", "stored_tensors", "write_model"]

_INDEX = "model.safetensors.index.json"


def _config_object(config: Mapping[str, Any]) -> tuple[type, transformers.PretrainedConfig]:
    cls = getattr(transformers, config["architectures"][0])
    return cls, cls.config_class(
        **{k: v for k, v in config.items() if k not in ("architectures", "model_type")}
    )


def build_model(config: Mapping[str, Any], *, seed: int = 0) -> transformers.PreTrainedModel:
    """The transformers model of a config dict (as ``tiny_config`` returns it), in eval mode, with random weights:
    transformers' initialisation, and random GDN parameters (a fresh GDN layer is nearly symmetric)."""
    cls, cfg = _config_object(config)
    torch.manual_seed(seed)
    model = cls(cfg).eval()
    g = torch.Generator().manual_seed(seed + 1000)
    with torch.no_grad():
        for _, module in find_gdn_modules(model):
            for name, p in module.named_parameters():
                noise = torch.randn(p.shape, generator=g)
                if name.endswith("norm.weight"):
                    p.copy_(1.0 + 0.5 * noise)
                elif name == "A_log":
                    p.copy_(torch.log(torch.rand(p.shape, generator=g) * 8 + 0.5))
                elif name == "dt_bias":
                    p.copy_(noise)
    return model


def stored_tensors(model: Any) -> dict[str, torch.Tensor]:
    """The model's weights as the released checkpoints store them: an MoE layer's stacked experts
    (``gate_up_proj`` [E, 2I, H], ``down_proj`` [E, H, I]) as one ``gate_proj`` / ``up_proj`` / ``down_proj``
    tensor per expert (views, no copy), every other tensor under its own name (tied weights once)."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in model.state_dict().items():
        if name.endswith(".experts.gate_up_proj"):
            head = name.removesuffix("gate_up_proj")
            for e, (gate, up) in enumerate(t.chunk(2, dim=0) for t in tensor):
                out[f"{head}{e}.gate_proj.weight"], out[f"{head}{e}.up_proj.weight"] = gate, up
        elif name.endswith(".experts.down_proj"):
            head = name.removesuffix("down_proj")
            for e, down in enumerate(tensor):
                out[f"{head}{e}.down_proj.weight"] = down
        elif not (name == "lm_head.weight" and getattr(model.config, "tie_word_embeddings", False)):
            out[name] = tensor
    return out


_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}


def _write_shard(path: Path, tensors: Mapping[str, torch.Tensor]) -> None:
    """One safetensors file of ``tensors`` (gdnprune's header writer and one vectored write: far fewer calls
    per tensor than ``safetensors.save_file``, which tens of thousands of expert tensors feel)."""
    entries, buffers, offset = [], [], 0
    for name, tensor in tensors.items():
        data = tensor.detach().contiguous().view(torch.uint8).reshape(-1).numpy()
        entries.append((name, _DTYPES[tensor.dtype], tuple(tensor.shape), offset, offset + data.nbytes))
        buffers.append(data.data)  # the array's bytes, not copied
        offset += data.nbytes
    header = encode_header(entries, {"format": "pt"})
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        write_vectors(fd, [header, *buffers], 0)
    finally:
        os.close(fd)


def _mtp_tensors(
    config: Mapping[str, Any], layers: int, dtype: torch.dtype, seed: int
) -> dict[str, torch.Tensor]:
    """``mtp.*`` as the released checkpoints name it: ``fc`` (of the embedding and hidden state side by side),
    the two norms before it, ``layers.N`` (full-attention decoder layers, experts stored one per tensor) and
    the final ``norm``."""
    hidden = int(config["hidden_size"])
    g = torch.Generator().manual_seed(seed + 2000)
    out = {
        "mtp.fc.weight": torch.randn(hidden, 2 * hidden, generator=g) * 0.02,
        "mtp.pre_fc_norm_embedding.weight": torch.ones(hidden),
        "mtp.pre_fc_norm_hidden.weight": torch.ones(hidden),
        "mtp.norm.weight": torch.ones(hidden),
    }
    one = {**config, "num_hidden_layers": layers, "layer_types": ["full_attention"] * layers}
    for name, tensor in stored_tensors(build_model(one, seed=seed + 1)).items():
        if name.startswith("model.layers."):
            out[MTP_PREFIX + name.removeprefix("model.")] = tensor
    return {k: v.to(dtype) for k, v in out.items()}


def write_model(
    config: Mapping[str, Any],
    folder: str | os.PathLike,
    *,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    shard_bytes: int = 50 * 10**6,
) -> Path:
    """Write the random model of ``config`` (:func:`build_model`) into ``folder``, as the released checkpoints
    lay it out: shards of about ``shard_bytes`` and an index, in ``dtype``, one tensor per expert
    (:func:`stored_tensors`), the ``mtp.*`` head (``mtp_num_hidden_layers`` layers, default 1) in a shard of
    its own, the config and the byte tokenizer. Returns the folder."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    model: Any = build_model(config, seed=seed)
    model.to(dtype)  # in place, as nn.Module.to is
    model.config.save_pretrained(folder)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, tensor in stored_tensors(model).items():
        if size and size + tensor.numel() * tensor.element_size() > shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensor
        size += tensor.numel() * tensor.element_size()
    layers = int(config.get("mtp_num_hidden_layers", 1))
    if layers:
        shards.append(_mtp_tensors(config, layers, dtype, seed))
    weight_map, total = {}, 0
    for i, tensors in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        _write_shard(folder / file, tensors)
        weight_map.update(dict.fromkeys(tensors, file))
        total += sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / _INDEX).write_text(json.dumps(index, indent=2))
    build_byte_tokenizer().save_pretrained(folder)
    return folder
