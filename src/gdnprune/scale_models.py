"""Random models with the real counts of the Qwen hybrid family at tiny widths, written as checkpoint folders
the way the released ones are laid out: shards with an index, one tensor per routed expert, an ``mtp.*`` head
of as many layers as the member has, and gdnprune's byte tokenizer. What the tests, ``benchmarks/scale.py``
and a user trying the pipeline at a real model's counts run on (``gdnprune.model.family.tiny_config`` gives
the config).
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import transformers
from safetensors.torch import load_file, save_file

from .demo_data import build_byte_tokenizer
from .model.layouts import find_gdn_modules
from .model.model_config import MTP_PREFIX

__all__ = ["build_model", "write_model"]

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
    with tempfile.TemporaryDirectory() as tmp:
        build_model(one, seed=seed + 1).save_pretrained(tmp)  # as the decoder's: one tensor per expert
        for name, tensor in load_file(os.path.join(tmp, "model.safetensors")).items():
            if name.startswith("model.layers."):
                out[MTP_PREFIX + name.removeprefix("model.")] = tensor
    return {k: v.to(dtype) for k, v in out.items()}


def write_model(
    config: Mapping[str, Any],
    folder: str | os.PathLike,
    *,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    max_shard_size: str = "50MB",
) -> Path:
    """Write the random model of ``config`` (:func:`build_model`) into ``folder``: ``save_pretrained``'s shards
    and index in ``dtype``, the ``mtp.*`` head (``mtp_num_hidden_layers`` layers, default 1) in a shard of its
    own, and the byte tokenizer. Returns the folder."""
    folder = Path(folder)
    model: Any = build_model(config, seed=seed)
    model.to(dtype)  # in place, as nn.Module.to is
    model.save_pretrained(folder, max_shard_size=max_shard_size)
    del model
    layers = int(config.get("mtp_num_hidden_layers", 1))
    if layers:
        mtp = _mtp_tensors(config, layers, dtype, seed)
        save_file(mtp, folder / "model-mtp.safetensors", metadata={"format": "pt"})
        index_path = folder / _INDEX
        if index_path.exists():
            index = json.loads(index_path.read_text())
        else:  # one shard: give it an index so that the head's shard is listed
            single = load_file(folder / "model.safetensors")
            index = {
                "metadata": {"total_size": sum(t.nbytes for t in single.values())},
                "weight_map": dict.fromkeys(single, "model.safetensors"),
            }
        index["weight_map"].update(dict.fromkeys(mtp, "model-mtp.safetensors"))
        index["metadata"]["total_size"] += sum(t.nbytes for t in mtp.values())
        index_path.write_text(json.dumps(index, indent=2))
    build_byte_tokenizer().save_pretrained(folder)
    return folder
