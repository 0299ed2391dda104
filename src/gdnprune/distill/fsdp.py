"""FSDP2 for distillation: what can be sharded, the sharded teacher, and the bytes each process holds.

The student is sharded by the Trainer (accelerate's FSDP2 preparation: one unit per decoder layer, the
embedding, the final norm with ``lm_head``, the rest in the root). The teacher is frozen and only runs
forward passes, so it is sharded here with ``torch.distributed.fsdp.fully_shard`` in the same units, with
every unit (the root included) resharded after its forward: a process holds a 1/world share of the
teacher plus, for the length of one unit's forward, that unit whole. :func:`check_shardable` says, before
any work, why a model cannot be sharded.
"""

from __future__ import annotations

import torch

__all__ = [
    "layer_classes",
    "check_shardable",
    "shard_teacher",
    "is_sharded",
    "local_bytes",
    "optimizer_bytes",
]


def layer_classes(model: torch.nn.Module) -> set[type]:
    """The decoder-layer classes of ``model`` (its ``_no_split_modules`` that occur in it)."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    return {type(m) for m in model.modules() if type(m).__name__ in names}


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
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def shard_teacher(teacher: torch.nn.Module, *, device: torch.device | str | None = None) -> torch.nn.Module:
    """Shard the frozen ``teacher`` in place over the default process group, for forward passes only.

    Units: every decoder layer, the input embedding (when not tied to ``lm_head``) and the root (final
    norm, ``lm_head``, the rest), each resharded after its forward. ``device``: where the shards live
    (default: the current accelerator, else the CPU). Returns ``teacher``.
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    check_shardable(teacher, "teacher")
    teacher.eval().requires_grad_(False)
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    mesh = init_device_mesh(device.type, (torch.distributed.get_world_size(),))
    classes = tuple(layer_classes(teacher))
    for module in [m for m in teacher.modules() if isinstance(m, classes)]:
        fully_shard(module, mesh=mesh, reshard_after_forward=True)
    embed, head = teacher.get_input_embeddings(), teacher.get_output_embeddings()
    if embed is not None and (head is None or head.weight is not embed.weight):
        fully_shard(embed, mesh=mesh, reshard_after_forward=True)
    fully_shard(teacher, mesh=mesh, reshard_after_forward=True)
    return teacher


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
