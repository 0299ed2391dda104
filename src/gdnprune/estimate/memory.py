"""The memory a distillation run needs per process, from the shapes of the student's and teacher's parameters
alone: gdnprune's one memory model. No torch.

:func:`distill_memory` takes each model as a :class:`TrainedShapes` — built from a model on the meta device
(:func:`gdnprune.distill.memory.estimate_memory`, what ``distill`` prints before it trains) or from a folder's
headers or a config (:func:`trained_shapes` of :class:`~gdnprune.estimate.inventory.ModelFacts`, what
``gdnprune estimate`` and ``--dry-run`` print without torch).

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
from collections.abc import Sequence
from dataclasses import dataclass

from .inventory import ModelFacts

__all__ = [
    "MemoryEstimate",
    "TrainedShapes",
    "distill_memory",
    "trained_shapes",
    "inner_width",
    "positions_per_chunk",
    "DTYPE_BYTES",
]

#: bytes per element of the dtypes a run may name
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float64": 8}
# float32 buffers of a chunk's logits alive at once in the loss
_CHUNK_BUFFERS = 4


def positions_per_chunk(vocab: int, positions: int) -> int:
    """Positions per chunk of the loss (as many as one process has, at most ``2**25 // vocab``: the whole-head
    loss's chunk of 2**25 logits); :func:`gdnprune.distill.vocab_parallel.default_positions_per_chunk` is it."""
    return max(1, min((1 << 25) // vocab, positions))


def inner_width(
    experts_per_token: int, expert_width: int, shared_width: int, mlp_width: int, hidden: int
) -> int:
    """The MLP width of one decoder layer's activations: the active experts' and the shared expert's, or the
    dense MLP's (4 x hidden when unknown)."""
    if experts_per_token and expert_width:
        return experts_per_token * expert_width + shared_width
    return mlp_width or 4 * hidden


@dataclass(frozen=True)
class TrainedShapes:
    """What the memory model reads of a model: its parameters' shapes (tied weights once), the elements of each
    decoder layer (an FSDP2 unit each), the elements of the embedding and head (once when tied), each layer's
    MLP width (:func:`inner_width`), the hidden size and the head's ``(vocab, hidden)``."""

    shapes: tuple[tuple[int, ...], ...]
    layer_units: tuple[int, ...]
    vocab_elements: int
    inner_widths: tuple[int, ...]
    hidden: int
    head: tuple[int, int]

    @property
    def elements(self) -> int:
        return sum(math.prod(s) for s in self.shapes)

    def units(self, *, vocab_apart: bool = False) -> list[int]:
        """Elements of each FSDP2 unit gathered whole: every decoder layer, and what is left at the top
        (without the embedding and head when ``vocab_apart``: sharded by vocabulary, never gathered)."""
        top = self.elements - sum(self.layer_units) - (self.vocab_elements if vocab_apart else 0)
        return [*self.layer_units, top]

    def activations_per_token(self, itemsize: int, checkpointing: bool) -> int:
        """Bytes kept for the backward per token, over all decoder layers (rule of thumb: about 16 hidden-size
        and 2 intermediate-size vectors per layer, Korthikanti et al. 2022 without the attention matrix; with
        checkpointing one hidden vector per layer plus the largest layer's worth)."""
        per_layer = [(16 * self.hidden + 2 * width) * itemsize for width in self.inner_widths]
        if checkpointing:
            return len(per_layer) * self.hidden * itemsize + max(per_layer, default=0)
        return sum(per_layer)


def trained_shapes(facts: ModelFacts) -> TrainedShapes:
    """:class:`TrainedShapes` of the model a folder or config describes (its decoder: MTP and vision tower left
    out, as transformers' causal LM leaves them)."""
    widths = tuple(
        inner_width(
            layer.experts[1] if layer.experts else 0,
            layer.experts[2] if layer.experts else 0,
            layer.shared_expert,
            layer.mlp,
            layer.hidden,
        )
        for layer in facts.layers
    )
    vocab = facts.vocab_size * facts.hidden_size * (1 if facts.tied else 2)
    return TrainedShapes(
        shapes=tuple(facts.parameter_shapes()),
        layer_units=tuple(layer.parameters for layer in facts.layers),
        vocab_elements=vocab,
        inner_widths=widths,
        hidden=facts.hidden_size,
        head=(facts.vocab_size, facts.hidden_size),
    )


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


def _local_elements(shape: Sequence[int], world: int) -> int:
    """Elements of a tensor of ``shape`` on the first of ``world`` FSDP2 shards (dim-0 chunks)."""
    if not shape:
        return 1
    return math.ceil(shape[0] / world) * math.prod(shape[1:])


def distill_memory(
    student: TrainedShapes,
    teacher: TrainedShapes,
    *,
    processes: int = 1,
    fsdp: bool = False,
    teacher_sharded: bool = False,
    itemsize: int = 4,
    teacher_itemsize: int | None = None,
    mixed_precision: str = "no",
    micro_batch_size: int = 1,
    seq_len: int = 2048,
    gradient_checkpointing: bool = False,
    cpu_offload: bool = False,
    kd: bool = True,
) -> MemoryEstimate:
    """The expected peak memory of one process of a run (see the module docstring). ``itemsize``: bytes per
    element of the student's parameters (the teacher's: ``teacher_itemsize``, default the same)."""
    size, t_size = itemsize, teacher_itemsize or itemsize
    compute = 2 if mixed_precision in ("bf16", "fp16") else size
    world = processes if fsdp else 1
    local = sum(_local_elements(s, world) for s in student.shapes)
    params = local * size
    optimizer = 2 * local * size + 4 * len(student.shapes)
    t_world = processes if teacher_sharded else 1
    t_params = sum(_local_elements(s, t_world) for s in teacher.shapes) * t_size if kd else 0
    gathered = 0
    # under FSDP2 the embedding and head are sharded by vocabulary and never gathered (the loss and the lookup
    # read each process's rows), except with CPU offload (accelerate's units: kept whole with the norm)
    vocab_parallel = fsdp and processes > 1 and not cpu_offload
    if fsdp and processes > 1:
        units = student.units(vocab_apart=vocab_parallel)
        # the top unit (final norm; with CPU offload the embedding and head too) stays whole from forward to
        # backward, plus a layer unit and its gradient, prefetched one ahead: parameters in the compute dtype
        gathered += (units[-1] + 2 * max(units[:-1] or [0])) * compute + max(units[:-1] or [0]) * size
    if teacher_sharded and processes > 1 and kd:
        gathered += max(teacher.units(vocab_apart=True)) * t_size
    tokens = micro_batch_size * seq_len
    activations = tokens * student.activations_per_token(compute, gradient_checkpointing)
    vocab, hidden = student.head
    # vocabulary-parallel: this process's rows of the head for the positions of all processes (their hidden
    # states gathered, student and teacher, and the gradient of all of them before it is scattered back)
    rows = math.ceil(vocab / processes) if vocab_parallel else vocab
    positions = tokens * (processes if vocab_parallel else 1)
    # positions per chunk x rows: at most one process's positions per chunk, whole head or vocabulary-parallel
    chunk = positions_per_chunk(vocab, tokens) * rows
    states = 2 * tokens * student.hidden * 4
    if vocab_parallel:  # all positions' hidden states (student, teacher) and float32 hidden gradient
        states = positions * student.hidden * (compute + t_size + 4) + tokens * student.hidden * 4
    loss = _CHUNK_BUFFERS * chunk * 4 + rows * hidden * 4 + states
    offloaded = (2 * params + optimizer) if cpu_offload else 0  # FSDP2's offload: shards, gradients, AdamW
    # under FSDP2 each process reads only its shards from the files (distill_checkpoint's sharded loading;
    # a bf16/fp16 student under mixed precision into float32 master weights, as accelerate upcasts it);
    # otherwise every process reads the whole student and teacher before moving or sharding them
    sharded = fsdp and processes > 1
    low = size < 4 and mixed_precision in ("bf16", "fp16")
    loading = (local * 4 if low else params) if sharded else student.elements * size
    if kd:
        loading += t_params if sharded and teacher_sharded else teacher.elements * t_size
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
