"""The memory a distillation run needs per process, from models built on the meta device: the shapes
:func:`gdnprune.estimate.memory.distill_memory` reads (gdnprune's one memory model, which the torch-free
``gdnprune estimate`` feeds from headers and configs) taken from the torch modules themselves.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import transformers
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

from ..estimate.memory import MemoryEstimate, TrainedShapes, distill_memory, inner_width
from ..io.loading import per_layer_gdn_modules
from .fsdp import layer_classes

__all__ = ["MemoryEstimate", "estimate_memory", "estimate_checkpoint_memory", "meta_model", "layer_configs"]


def _itemsize(dtype) -> int:
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype.removeprefix("torch."))
    return torch.empty((), dtype=dtype).element_size()


def layer_configs(config) -> list:
    """The config of every decoder layer: ``per_layer_config[i]`` of a heterogeneous config (a gdnprune plan's
    output), else the text config itself for each layer. Read per-layer attributes (widths, expert counts)
    only through these; a heterogeneous config raises when they are read globally."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    layers = text.num_hidden_layers
    if getattr(text, "is_heterogeneous", False):
        return [text.per_layer_config[i] for i in range(layers)]
    return [text] * layers


def _shapes(model: transformers.PreTrainedModel) -> TrainedShapes:
    """What the memory model reads of a torch model (any device, meta included: only shapes)."""
    classes = tuple(layer_classes(model))
    layers = [m for m in model.modules() if classes and isinstance(m, classes)]
    modules = (model.get_input_embeddings(), model.get_output_embeddings())
    vocab = sum({id(p): p.numel() for m in modules if m is not None for p in m.parameters()}.values())
    config = model.config
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    widths = tuple(
        inner_width(
            getattr(layer, "num_experts_per_tok", None) or 0,
            getattr(layer, "moe_intermediate_size", None) or 0,
            getattr(layer, "shared_expert_intermediate_size", 0) or 0,
            getattr(layer, "intermediate_size", None) or 0,
            layer.hidden_size,
        )
        for layer in layer_configs(config)
    )
    head = model.get_output_embeddings().weight
    return TrainedShapes(
        shapes=tuple(tuple(p.shape) for p in model.parameters()),  # tied weights once
        layer_units=tuple(sum(p.numel() for p in layer.parameters()) for layer in layers),
        vocab_elements=vocab,
        inner_widths=widths,
        hidden=text.hidden_size,
        head=(int(head.shape[0]), int(head.shape[1])),
    )


def estimate_memory(
    student: transformers.PreTrainedModel,
    teacher: transformers.PreTrainedModel,
    *,
    processes: int = 1,
    fsdp: bool = False,
    teacher_sharded: bool = False,
    dtype=torch.float32,
    teacher_dtype=None,
    mixed_precision: str = "no",
    micro_batch_size: int = 1,
    seq_len: int = 2048,
    gradient_checkpointing: bool = False,
    cpu_offload: bool = False,
    kd: bool = True,
) -> MemoryEstimate:
    """The expected peak memory of one process of a run (:func:`gdnprune.estimate.memory.distill_memory`), from
    ``student`` and ``teacher`` built on any device, meta included (only shapes are read)."""
    return distill_memory(
        _shapes(student),
        _shapes(teacher),
        processes=processes,
        fsdp=fsdp,
        teacher_sharded=teacher_sharded,
        itemsize=_itemsize(dtype),
        teacher_itemsize=_itemsize(teacher_dtype or dtype),
        mixed_precision=mixed_precision,
        micro_batch_size=micro_batch_size,
        seq_len=seq_len,
        gradient_checkpointing=gradient_checkpointing,
        cpu_offload=cpu_offload,
        kd=kd,
    )


def meta_model(path: str | Path, dtype: Any = None) -> transformers.PreTrainedModel:
    """The model of a Hugging Face folder built from its ``config.json`` on the meta device (no weights read;
    per-layer GDN geometries as :func:`gdnprune.load_pretrained` builds them), in ``dtype`` as
    ``from_pretrained`` builds it (modules the model keeps in float32 stay so; default: the config's)."""

    try:
        config = transformers.AutoConfig.from_pretrained(path)
        named = getattr(transformers, (getattr(config, "architectures", None) or [""])[0], None)
        cls = named if isinstance(named, type) else MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
        if not (isinstance(cls, type) and issubclass(cls, transformers.PreTrainedModel)):
            raise TypeError(f"{cls} is not a transformers model class")
        dtype = getattr(torch, dtype.removeprefix("torch.")) if isinstance(dtype, str) else dtype
        with torch.device("meta"), per_layer_gdn_modules(cls):
            return cls._from_config(config, **({} if dtype is None else {"dtype": dtype}))
    except (KeyError, OSError, RuntimeError, TypeError, ValueError) as exc:
        raise ValueError(
            f"{path}: transformers cannot build a model from its config.json: "
            f"{' '.join(str(exc).split())[:300]}"
        ) from None


def estimate_checkpoint_memory(student_dir: str | Path, teacher_dir: str | Path, **options) -> MemoryEstimate:
    """:func:`estimate_memory` of the models in two Hugging Face folders, built from their configs on the meta
    device (nothing but ``config.json`` is read)."""
    return estimate_memory(meta_model(student_dir), meta_model(teacher_dir), **options)
