"""FSDP2 for distillation: what can be sharded, the sharded teacher, and the bytes each process holds.

The student is sharded by the Trainer (accelerate's FSDP2 preparation: one unit per decoder layer, the
embedding, the final norm with ``lm_head``, the rest in the root). The teacher is frozen and only runs
forward passes, so it is sharded here with ``torch.distributed.fsdp.fully_shard`` in the same units, with
every unit (the root included) resharded after its forward: a process holds a 1/world share of the
teacher plus, for the length of one unit's forward, that unit whole. :func:`check_shardable` says, before
any work, why a model cannot be sharded.
"""

from __future__ import annotations

import itertools
import re
import warnings
from pathlib import Path
from typing import Any

import torch
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper, checkpoint_wrapper
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
)
from torch.distributed.tensor import DTensor
from transformers import PreTrainedModel

from ..io.loading import empty_pretrained
from ..io.sharded_loading import ShardedLoadingError, load_sharded, sharded_loading_names
from ..model.forwards import final_norm

__all__ = [
    "layer_classes",
    "check_shardable",
    "shard_teacher",
    "shard_student",
    "vocab_sharded",
    "load_sharded_models",
    "student_dtype",
    "is_sharded",
    "has_checkpointed_layers",
    "local_bytes",
    "optimizer_bytes",
    "layer_parts",
    "split_groups",
    "clip_grad_norm_in_parts",
]

#: a parameter's decoder layer, from its name (``model.layers.7.mlp.experts.down_proj``: ``model.layers.7``)
_LAYER = re.compile(r"^((?:.*\.)?layers\.\d+)\.")


def layer_classes(model: torch.nn.Module) -> set[type]:
    """The decoder-layer classes of ``model`` (its ``_no_split_modules`` that occur in it; once sharded, the
    class FSDP2 derived a layer's class from)."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    found = (next((c for c in type(m).__mro__ if c.__name__ in names), None) for m in model.modules())
    return {c for c in found if c is not None}


def check_shardable(model: torch.nn.Module, name: str) -> None:
    """Raise ``ValueError`` unless FSDP2 can shard ``model``: decoder layers to wrap, one floating dtype."""
    if not layer_classes(model):
        raise ValueError(
            f"{name}: cannot shard {type(model).__name__} with FSDP2: expected decoder layer classes "
            f"named in its _no_split_modules, found {getattr(model, '_no_split_modules', None)!r}"
        )
    dtypes = sorted(
        {str(p.dtype).removeprefix("torch.") for p in model.parameters() if p.is_floating_point()}
    )
    if len(dtypes) > 1:
        raise ValueError(
            f"{name}: cannot shard {type(model).__name__} with FSDP2: expected parameters of one "
            f"dtype, found {', '.join(dtypes)} (load it with one dtype)"
        )
    if getattr(model, "hf_device_map", None) is not None:
        raise ValueError(
            f"{name}: cannot shard a model spread over devices with a device_map; load it on one "
            f"device, or keep it replicated"
        )


def is_sharded(model: torch.nn.Module) -> bool:
    """Whether ``fully_shard`` has been applied to ``model``."""

    return isinstance(model, FSDPModule)


def _layer(name: str) -> str:
    match = _LAYER.match(name)
    return match.group(1) if match else ""


def layer_parts(model: torch.nn.Module) -> list[list[torch.nn.Parameter]]:
    """The parameters of ``model`` that have a gradient, in order, one list per decoder layer (and one per run
    of parameters outside the layers).

    Under FSDP2 the optimizer step and the gradient clipping work on these lists, not on one list of every
    parameter: torch 2.13's DTensor propagates a list operation's sharding in time quadratic in the list's
    length (at 48 layers of 512 experts one AdamW step and one clipping took 13 s, profiled), and caches the
    result by the list's shapes, which repeat from one layer of a kind to the next."""
    named = [(name, p) for name, p in model.named_parameters() if p.grad is not None]
    return [[p for _, p in run] for _, run in itertools.groupby(named, key=lambda item: _layer(item[0]))]


def split_groups(groups: list[dict[str, Any]], model: torch.nn.Module) -> list[dict[str, Any]]:
    """Optimizer ``groups`` cut into one group per decoder layer of ``model`` (consecutive parameters of one
    layer), each with its group's settings: AdamW then steps each layer on its own (see :func:`layer_parts`)."""
    names = {id(p): name for name, p in model.named_parameters()}
    return [
        {**group, "params": list(run)}
        for group in groups
        for _, run in itertools.groupby(group["params"], key=lambda p: _layer(names.get(id(p), "")))
    ]


def clip_grad_norm_in_parts(parts: list[list[torch.nn.Parameter]], max_norm: float) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` (2-norm) of the gradients of ``parts`` (lists of parameters, see
    :func:`layer_parts`), computed part by part: the norm of every part, their norm, then every part scaled by
    the one factor. Returns the total norm before clipping (a plain tensor, the same on every process)."""
    pieces = [(part, grads) for part in parts if (grads := [p.grad for p in part if p.grad is not None])]
    if not pieces:
        return torch.tensor(0.0)
    total = torch.linalg.vector_norm(torch.stack([torch.nn.utils.get_total_norm(g) for _, g in pieces]))
    if isinstance(total, DTensor):
        total = total.full_tensor()  # one reduction; every part is then scaled by the same replicated factor
    for part, grads in pieces:
        norm = DTensor.from_local(total, grads[0].device_mesh) if isinstance(grads[0], DTensor) else total
        torch.nn.utils.clip_grads_with_norm_(part, max_norm, norm)
    return total


def shard_teacher(teacher: PreTrainedModel, *, device: torch.device | str | None = None) -> PreTrainedModel:
    """Shard the frozen ``teacher`` in place over the default process group, for forward passes only.

    Units: every decoder layer, the embedding and ``lm_head`` (one unit when tied, never gathered by the
    loss: :func:`vocab_sharded`) and the root (final norm, the rest), each resharded after its forward.
    ``device``: where the shards live (default: the current accelerator, else the CPU). Returns ``teacher``.
    """

    check_shardable(teacher, "teacher")
    teacher.eval().requires_grad_(False)
    device = _device() if device is None else torch.device(device)
    mesh = init_device_mesh(device.type, (torch.distributed.get_world_size(),))
    classes = tuple(layer_classes(teacher))
    for module in [m for m in teacher.modules() if isinstance(m, classes)]:
        fully_shard(module, mesh=mesh, reshard_after_forward=True)
    _shard_vocabulary(teacher, mesh=mesh)
    fully_shard(teacher, mesh=mesh, reshard_after_forward=True)
    return teacher


def shard_student(
    student: PreTrainedModel,
    *,
    mixed_precision: str = "no",
    cpu_offload: bool = False,
    gradient_checkpointing: bool = False,
) -> PreTrainedModel:
    """Shard ``student`` in place over the default process group as accelerate 1.15's FSDP2 preparation
    shards it (``fsdp2_prepare_model``), so the Trainer takes it as prepared, except for the vocabulary:
    every decoder layer resharded after forward; the embedding and ``lm_head`` in units of their own (one
    when tied) that the loss never gathers (:func:`vocab_sharded`); the final norm and the rest in the root
    (with ``cpu_offload``, accelerate's units: the embedding (when not tied) resharded after forward, the
    final norm with ``lm_head`` and a tied embedding in one unit kept gathered); parameters in bf16/fp16 for the compute
    under ``mixed_precision``, gradients reduced in float32; shards on the CPU with ``cpu_offload``; with
    ``gradient_checkpointing`` every decoder layer first wrapped for activation checkpointing, as
    accelerate's ``fsdp2_apply_ac`` wraps it before sharding (the Trainer is then not asked to wrap it
    again). For a student built on the ``meta`` device (:func:`gdnprune.io.sharded_loading.load_sharded`). Returns
    ``student``.
    """

    check_shardable(student, "student")
    if gradient_checkpointing:
        _checkpoint_layers(student)
    low = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(mixed_precision)
    mesh = init_device_mesh(_device().type, (torch.distributed.get_world_size(),))
    kwargs: dict[str, Any] = dict(
        mesh=mesh,
        mp_policy=MixedPrecisionPolicy(param_dtype=low, reduce_dtype=torch.float32)
        if low
        else MixedPrecisionPolicy(),
        offload_policy=CPUOffloadPolicy() if cpu_offload else OffloadPolicy(),
    )
    classes = tuple(layer_classes(student))
    for module in [m for m in student.modules() if isinstance(m, classes)]:
        fully_shard(module, reshard_after_forward=True, **kwargs)
    if not cpu_offload:  # the loss reads the local rows where the compute is; offloaded ones are on the CPU
        _shard_vocabulary(student, **kwargs)
        fully_shard(student, **kwargs)
        return student
    embed, head = student.get_input_embeddings(), student.get_output_embeddings()
    tied = embed is not None and head is not None and head.weight is embed.weight
    if embed is not None and not tied:
        fully_shard(embed, reshard_after_forward=True, **kwargs)
    tail = [m for m in (final_norm(student), embed if tied else None, head) if m is not None]
    if tail:
        fully_shard(tail, reshard_after_forward=False, **kwargs)
    fully_shard(student, **kwargs)
    return student


_VOCAB_SHARDED = "_gdnprune_vocab_sharded"  # the instance attribute :func:`_shard_vocabulary` sets


def _shard_vocabulary(model: PreTrainedModel, **kwargs: Any) -> None:
    """The input embedding and ``lm_head`` of ``model`` sharded in units of their own (one when tied), so that
    nothing but a plain forward of those modules gathers them: the loss reads this process's rows of the
    vocabulary (:mod:`.vocab_parallel`), and says so by :func:`vocab_sharded`. Models without both keep
    the embedding in the root."""
    embed, head = model.get_input_embeddings(), model.get_output_embeddings()
    if embed is None or head is None:
        return
    if head.weight is embed.weight:
        fully_shard([embed, head], reshard_after_forward=True, **kwargs)
    else:
        fully_shard(embed, reshard_after_forward=True, **kwargs)
        fully_shard(head, reshard_after_forward=True, **kwargs)
    setattr(model, _VOCAB_SHARDED, True)


def vocab_sharded(model: torch.nn.Module) -> bool:
    """Whether ``model``'s embedding and ``lm_head`` are sharded by vocabulary in units the loss never gathers
    (:func:`shard_student` without CPU offload, :func:`shard_teacher`): the embedding is looked up and the
    loss computed on each process's rows (:mod:`.vocab_parallel`)."""
    return bool(getattr(model, _VOCAB_SHARDED, False))


def _checkpoint_layers(model: torch.nn.Module) -> None:
    """Each decoder layer of ``model`` replaced by a ``checkpoint_wrapper`` around it, as accelerate's
    ``fsdp2_apply_ac`` replaces it (no RNG state kept: the layers draw no random numbers in training)."""
    classes = tuple(layer_classes(model))
    names = [n for n, m in model.named_modules() if isinstance(m, classes)]
    for name in names:
        model.set_submodule(name, checkpoint_wrapper(model.get_submodule(name), preserve_rng_state=False))


def has_checkpointed_layers(model: torch.nn.Module) -> bool:
    """Whether ``model``'s layers are already wrapped for activation checkpointing (:func:`shard_student`)."""
    return any(isinstance(m, CheckpointWrapper) for m in model.modules())


def _device() -> torch.device:
    """The current accelerator, else the CPU: where FSDP2 keeps the shards."""
    return (
        torch.device("cuda", torch.cuda.current_device())
        if torch.cuda.is_available()
        else torch.device("cpu")
    )


def local_bytes(model: torch.nn.Module) -> tuple[int, int]:
    """``(held here, whole)``: the bytes of ``model``'s parameters in this process's shards, and in all."""
    held = whole = 0
    for p in model.parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        held += local.numel() * local.element_size()
        whole += p.numel() * p.element_size()
    return held, whole


def optimizer_bytes(optimizer: torch.optim.Optimizer) -> int:
    """The bytes of the optimizer's state tensors held by this process (local shards of DTensors)."""
    total = 0
    for state in optimizer.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor):
                local = value.to_local() if hasattr(value, "to_local") else value
                total += local.numel() * local.element_size()
    return total


def load_sharded_models(
    student_dir: Path,
    teacher_dir: Path,
    dtype: Any,
    teacher_dtype: Any,
    *,
    config: Any,  # a DistillConfig: mixed_precision, cpu_offload, gradient_checkpointing
    teacher_sharded: bool,
) -> tuple[Any, Any]:
    """``(student, teacher)`` under FSDP2, each built on ``meta``, sharded and filled with this process's rows
    straight from its files (:func:`gdnprune.io.sharded_loading.load_sharded`: tensors under the model's names or a
    vision-language prefix, FP8 blocks dequantized, MoE experts one tensor per expert stacked, parts
    concatenated as transformers concatenates them); None for
    the teacher when it is not to be sharded, and for a model whose folder stores another form (a warning
    line says which tensor; it loads whole on every process). A bf16/fp16 student under mixed precision
    gets float32 master weights, as accelerate upcasts it. A student under gradient checkpointing has its
    layers wrapped before sharding. A quantization other than FP8 blocks is refused (``ValueError``). The
    default process group must exist."""
    dtype, teacher_dtype = _torch_dtype(dtype), _torch_dtype(teacher_dtype)
    master = student_dtype(dtype, config.mixed_precision)
    device = torch.device("cpu") if config.cpu_offload else _device()
    options = dict(
        mixed_precision=config.mixed_precision,
        cpu_offload=config.cpu_offload,
        gradient_checkpointing=config.gradient_checkpointing,
    )
    student = _sharded(
        student_dir,
        master,
        lambda m: shard_student(m, **options),
        device,
        "student",
        upcast_from=dtype if master != dtype else None,
    )
    teacher = None
    if teacher_sharded:
        teacher = _sharded(teacher_dir, teacher_dtype, shard_teacher, _device(), "teacher")
    return student, teacher


def student_dtype(dtype: Any, mixed_precision: str) -> torch.dtype:
    """The dtype of a student's parameters under FSDP2 when it is loaded in ``dtype``: float32 master weights
    for a bf16/fp16 student under mixed precision (as accelerate upcasts it before sharding), else ``dtype``."""
    dtype = _torch_dtype(dtype)
    low = dtype in (torch.bfloat16, torch.float16) and mixed_precision != "no"
    return torch.float32 if low else dtype


def _torch_dtype(dtype: Any) -> torch.dtype:
    return getattr(torch, dtype.removeprefix("torch.")) if isinstance(dtype, str) else dtype


def _sharded(
    path: Path, dtype: torch.dtype, shard: Any, device: torch.device, name: str, upcast_from: Any = None
) -> Any:
    """``path`` loaded straight into its shards, or None (with a one-line warning) when its folder stores a
    tensor in another form than sharded loading reads; a quantization it cannot read is refused."""
    try:
        model = empty_pretrained(path, dtype=dtype)
    except (OSError, RuntimeError, ValueError) as exc:
        raise ValueError(f"{path}: transformers cannot load it: {' '.join(str(exc).split())[:500]}") from None
    try:
        sharded_loading_names(path, model)
    except ShardedLoadingError as exc:
        warnings.warn(f"{name}: loaded whole on every process, then sharded ({exc})", stacklevel=4)
        return None
    except ValueError as exc:  # a quantization only from_pretrained's quantizer reads
        raise ValueError(f"{name}: {exc}") from None
    try:
        return load_sharded(path, shard, dtype=dtype, device=device, upcast_from=upcast_from, model=model)
    except (OSError, RuntimeError, ValueError) as exc:
        raise ValueError(f"{path}: transformers cannot load it: {' '.join(str(exc).split())[:500]}") from None
