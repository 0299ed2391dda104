"""The memory a distillation run needs per process, from the configs alone (models built on the meta device).

Exact for what is counted in whole tensors: the student's parameters, their gradients and AdamW state
(two moments in the parameters' dtype plus a 4-byte step per tensor), and the teacher's parameters,
each as the first process holds them (FSDP2 splits every tensor along its first dimension in ``world``
chunks of ``ceil(rows / world)``; the first process holds the largest). Approximate for what depends on
kernels: the units FSDP2 gathers whole for a forward (not the embedding and head, which it shards by
vocabulary and never gathers, except with CPU offload), DDP's gradient buckets (a second copy of the
gradients), the activations kept for the backward (a per-token rule of thumb per decoder layer; the
reference PyTorch GDN kernels of a CPU keep more), and the loss buffers (one chunk of logits and the
float32 head gradient: under FSDP2 of this process's rows of the vocabulary, a chunk holding at most one
process's positions, as many as the whole-head loss would).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import transformers
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

from ..io.loading import per_layer_gdn_modules
from .fsdp import layer_classes
from .vocab_parallel import default_positions_per_chunk

__all__ = ["MemoryEstimate", "estimate_memory", "estimate_checkpoint_memory", "meta_model", "layer_configs"]

# float32 buffers of a chunk's logits alive at once in the loss
_CHUNK_BUFFERS = 4


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per process (the first, which holds the largest shards). ``host_loading``: the memory a process
    holds while loading: its shards when it reads them straight from the files (``sharded_loading``, under
    FSDP2), else the whole student and teacher, read before they are moved or sharded."""

    processes: int
    student_sharded: bool
    teacher_sharded: bool
    student_parameters: int
    student_gradients: int
    optimizer_state: int
    teacher_parameters: int
    gathered_units: int
    activations: int
    loss_buffers: int
    ddp_buckets: int = 0
    cpu_offloaded: int = 0
    host_loading: int = 0
    sharded_loading: bool = False

    @property
    def host_training(self) -> int:
        """Host (CPU) memory a process holds while training on the CPU: everything counted; with
        ``cpu_offload``: what is offloaded. (On an accelerator the rest lives in device memory.)"""
        return self.cpu_offloaded

    @property
    def total(self) -> int:
        return (
            self.student_parameters
            + self.student_gradients
            + self.optimizer_state
            + self.teacher_parameters
            + self.gathered_units
            + self.activations
            + self.loss_buffers
            + self.ddp_buckets
            - self.cpu_offloaded
        )

    def rows(self) -> list[tuple[str, int]]:
        """``(label, bytes)`` per component, in the order they are usually shown."""
        rows = [
            ("student parameters", self.student_parameters),
            ("student gradients", self.student_gradients),
            ("optimizer state (AdamW)", self.optimizer_state),
            ("teacher parameters", self.teacher_parameters),
            ("units gathered for a forward (FSDP2)", self.gathered_units),
            ("gradient buckets (DDP)", self.ddp_buckets),
            ("activations per micro-batch (approx.)", self.activations),
            ("loss buffers (approx.)", self.loss_buffers),
        ]
        if self.cpu_offloaded:
            rows.append(("offloaded to CPU memory", -self.cpu_offloaded))
        return rows


def _itemsize(dtype) -> int:
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype.removeprefix("torch."))
    return torch.empty((), dtype=dtype).element_size()


def _local_elements(shape, world: int) -> int:
    """Elements of a tensor of ``shape`` on the first of ``world`` FSDP2 shards (dim-0 chunks)."""
    if not shape:
        return 1
    return math.ceil(shape[0] / world) * math.prod(shape[1:])


def _parameters(model: torch.nn.Module) -> list[torch.Size]:
    return [p.shape for p in model.parameters()]  # tied weights once


def _units(model: transformers.PreTrainedModel, *, vocab_apart: bool = False) -> list[int]:
    """Elements of each FSDP2 unit that is gathered whole: every decoder layer, and what is left at the top
    (embedding, head, norm; without the embedding and head when ``vocab_apart``: sharded by vocabulary in
    units of their own that are never gathered)."""
    classes = tuple(layer_classes(model))
    layers = [m for m in model.modules() if classes and isinstance(m, classes)]
    sizes = [sum(p.numel() for p in layer.parameters()) for layer in layers]
    total = sum(p.numel() for p in model.parameters())
    vocab = 0
    if vocab_apart:
        modules = (model.get_input_embeddings(), model.get_output_embeddings())
        vocab = sum({id(p): p.numel() for m in modules if m is not None for p in m.parameters()}.values())
    return sizes + [total - sum(sizes) - vocab]


def layer_configs(config) -> list:
    """The config of every decoder layer: ``per_layer_config[i]`` of a heterogeneous config (a gdnprune plan's
    output), else the text config itself for each layer. Read per-layer attributes (widths, expert counts)
    only through these; a heterogeneous config raises when they are read globally."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    layers = text.num_hidden_layers
    if getattr(text, "is_heterogeneous", False):
        return [text.per_layer_config[i] for i in range(layers)]
    return [text] * layers


def _inner_width(layer) -> int:
    """The MLP width of one decoder layer's activations: the active experts' and the shared expert's, or the
    dense MLP's."""
    if getattr(layer, "num_experts_per_tok", None) and getattr(layer, "moe_intermediate_size", None):
        return layer.num_experts_per_tok * layer.moe_intermediate_size + (
            getattr(layer, "shared_expert_intermediate_size", 0) or 0
        )
    return getattr(layer, "intermediate_size", None) or 4 * layer.hidden_size


def _activations_per_token(config, itemsize: int, checkpointing: bool) -> int:
    """Bytes kept for the backward per token, over all decoder layers (rule of thumb: about 16 hidden-size and
    2 intermediate-size vectors per layer, Korthikanti et al. 2022 without the attention matrix; with
    checkpointing one hidden vector per layer plus the largest layer's worth). Each layer is read from its
    own config (:func:`layer_configs`)."""
    layers = layer_configs(config)
    hidden = layers[0].hidden_size
    per_layer = [(16 * hidden + 2 * _inner_width(layer)) * itemsize for layer in layers]
    return (len(layers) * hidden * itemsize + max(per_layer)) if checkpointing else sum(per_layer)


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
    """The expected peak memory of one process of a run (see the module docstring), from ``student`` and
    ``teacher`` built on any device, meta included (only shapes are read)."""
    size, t_size = _itemsize(dtype), _itemsize(teacher_dtype or dtype)
    compute = 2 if mixed_precision in ("bf16", "fp16") else size
    world = processes if fsdp else 1
    shapes = _parameters(student)
    local = sum(_local_elements(s, world) for s in shapes)
    params = local * size
    optimizer = 2 * local * size + 4 * len(shapes)
    t_world = processes if teacher_sharded else 1
    t_params = sum(_local_elements(s, t_world) for s in _parameters(teacher)) * t_size if kd else 0
    gathered = 0
    # under FSDP2 the embedding and head are sharded by vocabulary and never gathered (the loss and the lookup
    # read each process's rows), except with CPU offload (accelerate's units: kept whole with the norm)
    vocab_parallel = fsdp and processes > 1 and not cpu_offload
    if fsdp and processes > 1:
        units = _units(student, vocab_apart=vocab_parallel)
        # the top unit (final norm; with CPU offload the embedding and head too) stays whole from forward to
        # backward, plus a layer unit and its gradient, prefetched one ahead: parameters in the compute dtype
        gathered += (units[-1] + 2 * max(units[:-1] or [0])) * compute + max(units[:-1] or [0]) * size
    if teacher_sharded and processes > 1 and kd:
        gathered += max(_units(teacher, vocab_apart=True)) * t_size
    tokens = micro_batch_size * seq_len
    config = student.config
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    activations = tokens * _activations_per_token(config, compute, gradient_checkpointing)
    head = student.get_output_embeddings().weight
    vocab, hidden = head.shape
    # vocabulary-parallel: this process's rows of the head for the positions of all processes (their hidden
    # states gathered, student and teacher, and the gradient of all of them before it is scattered back)
    rows = math.ceil(vocab / processes) if vocab_parallel else vocab
    positions = tokens * (processes if vocab_parallel else 1)
    # positions per chunk x rows: at most one process's positions per chunk, whole head or vocabulary-parallel
    chunk = default_positions_per_chunk(vocab, tokens) * rows
    states = 2 * tokens * text.hidden_size * 4
    if vocab_parallel:  # all positions' hidden states (student, teacher) and float32 hidden gradient
        states = positions * text.hidden_size * (compute + t_size + 4) + tokens * text.hidden_size * 4
    loss = _CHUNK_BUFFERS * chunk * 4 + rows * hidden * 4 + states
    offloaded = (2 * params + optimizer) if cpu_offload else 0  # FSDP2's offload: shards, gradients, AdamW
    # under FSDP2 each process reads only its shards from the files (distill_checkpoint's sharded loading;
    # a bf16/fp16 student under mixed precision into float32 master weights, as accelerate upcasts it);
    # otherwise every process reads the whole student and teacher before moving or sharding them
    sharded = fsdp and processes > 1
    low = size < 4 and mixed_precision in ("bf16", "fp16")
    loading = (local * 4 if low else params) if sharded else sum(math.prod(s) for s in shapes) * size
    if kd:
        whole_teacher = sum(math.prod(s) for s in _parameters(teacher)) * t_size
        loading += t_params if sharded and teacher_sharded else whole_teacher
    return MemoryEstimate(
        processes=processes,
        student_sharded=fsdp and processes > 1,
        teacher_sharded=teacher_sharded and processes > 1,
        student_parameters=params,
        student_gradients=params,
        optimizer_state=optimizer,
        teacher_parameters=t_params,
        gathered_units=gathered,
        activations=activations,
        loss_buffers=loss,
        ddp_buckets=params if processes > 1 and not fsdp else 0,
        cpu_offloaded=offloaded,
        host_loading=loading,
        sharded_loading=sharded,
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
