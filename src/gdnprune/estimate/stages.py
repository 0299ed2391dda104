"""What each stage of a run costs before it runs: FLOPs, bytes read and written, host and device memory per
process, and wall time on a device (:mod:`.devices`), from the model's facts (:mod:`.inventory`) and the run's
options. No torch.

A stage's seconds are the sum of what it does, each at the device's rate for it: FLOPs at its matrix rate
(float64 ones at its float64 rate), the activation elements its elementwise kernels write and read at its
memory bandwidth, its module calls and kernels at a fixed cost each, the tensors of a checkpoint at a fixed
cost each (read into a model, streamed from file to file, or converted by transformers' own loading), bytes
read from disk and bytes serialized, and the start of its process (imports; lm-eval's harness for ``eval``;
the launch of several processes). Per stage (``T`` tokens, ``f`` the forward FLOPs of one token, ``e`` its
activation elements, ``o`` the module calls of one forward, ``B`` the checkpoint's bytes, ``n`` its tensors):

* reading a checkpoint: ``n`` tensors and ``B`` bytes (headers, then the weights into a model);
* ``inspect``: a light start and ``n`` headers; ``slice`` / ``sort``: a light start, every tensor streamed in
  and out (``2 n``) and its bytes read and written;
* ``score``: a forward of ``N x L`` tokens (``T f``, ``T e``, ``o`` per batch), plus the scorers' float64
  statistics (a second moment of each attention, MLP and shared-expert input per token: ``2 m^2`` FLOPs for a
  width ``m``; the projection scorer's weight Gram once per sub-block, ``2 hidden m^2``, its product with
  the moment per batch, ``m^2`` elements, and the greedy removal order of its units, a step per unit) and the
  routed experts' outputs again for the chosen ``k`` and the next one;
* ``plan`` (successive halving): a teacher pass over the plan's windows keeping every layer's input, then
  per layer its candidates (the GDN grid of key heads x lanes x key dims x value dims, the attention heads,
  the MLP and expert counts, the layer's removal) measured on the rungs' windows (the first rung sees every
  candidate on a sixteenth of the windows, each later one a quarter of the candidates on four times the
  windows); a candidate runs its own layer, and the layers after it run once for a stack of candidates; one
  search per hidden size when the blocks hold ``hidden``;
* ``prune``: ``score`` + ``plan`` + ``slice`` on one loaded model;
* ``distill``: both models loaded by transformers (every tensor converted), per step a forward and backward
  of the student (``3 f``, ``3 e``) and a forward of the teacher, AdamW's passes over the student's
  parameters, gradients and moments, the Trainer's checkpoints (every tenth of the run: the student and its
  two moments) and the output written; under FSDP2 the models read straight into their shards and three
  passes of the parameters over the processes' links per step; the memory of :func:`.memory.distill_memory`;
* ``eval``: a forward of the evaluated tokens; ``bench``: the workloads' forwards, the decode steps reading
  every weight once per step.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from fractions import Fraction

from .devices import Device
from .inventory import ModelFacts
from .memory import DTYPE_BYTES, TrainedShapes, distill_memory, trained_shapes
from .work import (
    ELEMENT_BYTES,
    expert_hook_flops,
    forward_elements,
    forward_flops,
    forward_ops,
    layer_elements,
    layer_flops,
    layer_ops,
    statistics_flops,
)

__all__ = ["RunOptions", "StageCost", "stage_costs", "STAGES", "forward_flops", "plan_candidates"]

STAGES = ("inspect", "score", "plan", "slice", "prune", "distill", "eval", "bench")
#: the hidden sizes a plan with ``hidden`` tries by default, as fractions of the full size
#: (:func:`gdnprune.plan.measure.hidden.hidden_candidates`): one plan search each
HIDDEN_GRID = (Fraction(1), Fraction(7, 8), Fraction(3, 4))
#: host bytes each command holds before any model: Python, torch, transformers and what the command imports
#: (scipy's solver for a plan, lm-eval's harness for eval), measured at the 4-layer, 8-expert model
#: (benchmarks/scale.py, the CPU build: a CUDA build's context holds more)
RUNTIME_MEMORY = {
    stage: mib * 2**20
    for stage, mib in (
        ("score", 500),
        ("plan", 680),
        ("prune", 680),
        ("distill", 540),
        ("eval", 535),
        ("bench", 430),
    )
}
#: host bytes of a command that runs no model (``inspect``, ``slice``, ``sort``: Python and the checkpoint
#: reader), and per tensor whose header it holds parsed
LIGHT_MEMORY, HEADER_BYTES = 40 * 2**20, 1000.0
#: host bytes per checkpoint tensor that reading a model leaves allocated besides its weights (the reader's
#: name maps and per-expert pieces; measured at the real counts: 1.3-2.4 KB per tensor, 1.6 KB at 94,631)
LOADED_TENSOR_BYTES = 1600.0
#: module calls and kernels of one candidate's measurement on a window beside its layer's forward (the
#: candidate's weights cut from the layer's, its KL against the teacher's output, the halving's bookkeeping);
#: fitted to the measured prunes (benchmarks/scale.py)
_CANDIDATE_OPS = 10


@dataclass(frozen=True)
class RunOptions:
    """The options of the commands that the costs depend on (their defaults are the commands')."""

    num_samples: int = 128  # score's windows
    seq_len: int = 512  # score's and plan's window (their default cap)
    batch_size: int = 4
    plan_samples: int = 16
    dim_step: Fraction = Fraction(1, 8)
    blocks: tuple[str, ...] = ("gdn", "attention", "mlp", "shared_expert", "experts", "depth", "hidden")
    budget: float = 0.5  # of the parameters kept (for the pruned model's size)
    dtype: str = "float32"  # the compute dtype of score, plan, eval and bench (their default)
    distill_tokens: int = 0  # 0: steps x batch x seq_len
    steps: int = 1000
    distill_batch_size: int = 16
    distill_seq_len: int = 2048
    processes: int = 1
    fsdp: bool = False
    mixed_precision: str = "no"
    gradient_checkpointing: bool = False
    eval_tokens: int = 0  # tokens lm-eval runs (0: 1000 documents of seq_len tokens)
    workloads: tuple[tuple[str, int, int], ...] = (("prefill", 1, 2048), ("decode", 8, 4096))
    repeats: int = 10


@dataclass(frozen=True)
class StageCost:
    stage: str
    flops: float
    bytes_read: float
    bytes_written: float
    host_memory: float
    device_memory: float
    seconds: float
    notes: tuple[str, ...] = field(default_factory=tuple)


# ---- plan candidates -------------------------------------------------------------------------------------


def _values(full: int, step: Fraction, least: int = 1) -> int:
    """How many sizes the plan's grid tries for an axis of ``full``, none below ``least`` (the count of
    ``dim_values`` and of ``block_candidates``' sizes)."""
    if step >= 1:
        return len({v for v in range(max(least, int(step)), full + 1, int(step))} | {full})
    return len({max(least, math.ceil(full * step * k)) for k in range(1, math.ceil(1 / step) + 1)} | {full})


def plan_candidates(facts: ModelFacts, options: RunOptions) -> list[int]:
    """The candidates of every decoder layer in the plan's grid (its blocks' candidates, and its removal)."""
    out = []
    blocks = set(options.blocks)
    for layer in facts.layers:
        count = 0
        if layer.gdn and "gdn" in blocks:
            hk, hv, dk, dv, _ = layer.gdn
            count += hk * (hv // hk) * _values(dk, options.dim_step) * _values(dv, options.dim_step)
        if layer.attention and "attention" in blocks:
            heads, kv, _ = layer.attention
            count += kv * (heads // kv)
        if layer.mlp and "mlp" in blocks:
            count += _values(layer.mlp, Fraction(1, 8))
        if layer.shared_expert and "shared_expert" in blocks:
            count += _values(layer.shared_expert, Fraction(1, 8))
        if layer.experts and "experts" in blocks:
            count += _values(layer.experts[0], Fraction(1, 8), least=layer.experts[1])
        count += 1 if "depth" in blocks else 0
        out.append(count)
    return out


def _halving_measurements(candidates: int, windows: int) -> float:
    """Candidate-window measurements of one layer's successive halving: every candidate on the first rung's
    windows, then a quarter of the survivors on four times the windows, ..., all windows at the end."""
    first = max(1, math.ceil(windows / 16))
    first = windows if 2 * first >= windows else first
    seen, alive, total = 0, float(candidates), 0.0
    upto = first
    while True:
        total += alive * (upto - seen)
        if upto >= windows:
            return total
        seen, upto, alive = upto, min(windows, upto * 4), max(1.0, math.ceil(alive / 4))


# ---- the stages ------------------------------------------------------------------------------------------


def _seconds(
    device: Device,
    flops: float,
    ops: float,
    tensors: float,
    disk_bytes: float,
    memory_bytes: float = 0.0,
    flops64: float = 0.0,
    dtype_bytes: int = 2,
    *,
    streamed: float = 0.0,
    converted: float = 0.0,
    written: float = 0.0,
) -> float:
    """Seconds of a stage's work: its FLOPs at the device's matrix rate, its module calls and tensors at their
    fixed costs (``tensors`` read into a model, ``streamed`` from file to file, ``converted`` by transformers'
    own loading), ``disk_bytes`` read, ``memory_bytes`` passed through memory and ``written`` bytes serialized."""
    compute = dtype_bytes if device.kind == "cuda" else 4  # a CPU computes in float32 (bf16 is upcast)
    return (
        flops / device.flops(compute)
        + flops64 / device.flops(8)
        + ops * device.op_seconds
        + tensors * device.tensor_seconds
        + streamed * device.stream_tensor_seconds
        + converted * device.convert_tensor_seconds
        + disk_bytes / device.disk
        + memory_bytes / (device.bandwidth * device.bandwidth_efficiency)
        + written / device.write
    )


def _load(facts: ModelFacts, device: Device, dtype_bytes: int) -> tuple[float, float]:
    """(seconds, host bytes) of starting a command that runs a model (its imports) and reading the checkpoint
    into a model in the compute dtype."""
    held = facts.parameters * dtype_bytes
    return device.startup + _seconds(device, 0, 0, len(facts.tensors), facts.bytes), held


def _loaded(facts: ModelFacts) -> float:
    """Host bytes that reading the model leaves beside its weights (:data:`LOADED_TENSOR_BYTES` per tensor)."""
    return LOADED_TENSOR_BYTES * len(facts.tensors)


def _projected(facts: ModelFacts) -> list[tuple[int, int]]:
    """``(units, input width)`` of every sub-block the projection scorer measures at its output projection's
    input (a dense MLP's and a shared expert's channels, an attention's heads)."""
    out = []
    for layer in facts.layers:
        out += [(w, w) for w in (layer.mlp, layer.shared_expert) if w]
        if layer.attention:
            heads, _, head_dim = layer.attention
            out.append((heads, heads * head_dim))
    return out


def _score(facts: ModelFacts, o: RunOptions, device: Device, dtype_bytes: int) -> StageCost:
    tokens = o.num_samples * o.seq_len
    batches = math.ceil(o.num_samples / o.batch_size)
    kernel = device.kind == "cpu"  # gdnprune's CPU gated delta rule (model.kernels)
    flops = tokens * (forward_flops(facts, o.seq_len, kernel) + expert_hook_flops(facts))
    elements = tokens * forward_elements(facts, o.seq_len, kernel)
    projected = _projected(facts)
    # the projection scorer: per sub-block of input width m, once its weight's Gram (2 hidden m^2), per batch
    # the input's second moment times it (m^2 elements, three passes) summed into the units' Gram, and at the
    # end the greedy removal order of its units (a step per unit over the Gram's columns)
    flops64 = tokens * statistics_flops(facts) + sum(2.0 * facts.hidden_size * m * m for _, m in projected)
    memory = sum(batches * 3.0 * 8 * m * m + 25.0 * 8 * u * u for u, m in projected)
    hooked = sum(1 + (layer.experts is not None) for layer in facts.layers)
    ops = batches * (forward_ops(facts, o.seq_len, kernel=kernel) + 20 * hooked) + sum(
        6.0 * u for u, _ in projected
    )
    load, held = _load(facts, device, dtype_bytes)
    # float64: each sub-block's weight Gram (kept), its units' Gram, and the largest batch's product transients
    # float64: each sub-block's units' Gram (summed on the host), its weight Gram (kept where the model runs,
    # for the whole run) and the largest batch's moment and product (transient, there too)
    grams = sum(8.0 * u * u for u, _ in projected)
    beside = sum(8.0 * m * m for _, m in projected) + 16.0 * max((m * m for _, m in projected), default=0)
    activations = o.batch_size * o.seq_len * facts.hidden_size * dtype_bytes * 16
    share = o.processes  # under torchrun every process scores its share of the windows
    seconds = load + _seconds(
        device,
        flops / share,
        ops / share,
        0,
        0,
        (memory + elements * ELEMENT_BYTES) / share,
        flops64=flops64 / share,
        dtype_bytes=dtype_bytes,
    )
    on_model = held + beside + activations
    host = (grams + on_model if device.kind == "cpu" else held + grams) + _loaded(facts)
    dev = 0.0 if device.kind == "cpu" else on_model
    return StageCost(
        "score",
        flops + flops64,
        facts.bytes,
        0.0,
        host,
        dev,
        seconds,
        (f"{tokens:,} calibration tokens in {batches} forwards",),
    )


def _plan(facts: ModelFacts, o: RunOptions, device: Device, dtype_bytes: int) -> StageCost:
    windows = o.plan_samples
    tokens = windows * o.seq_len
    layers = facts.layers
    kernel = device.kind == "cpu"  # gdnprune's CPU gated delta rule (model.kernels)
    per_layer = [layer_flops(layer, o.seq_len, kernel) for layer in layers]
    per_layer_elements = [layer_elements(layer, o.seq_len, kernel) for layer in layers]
    head = 2.0 * facts.vocab_size * facts.hidden_size
    candidates = plan_candidates(facts, o)
    flops = tokens * forward_flops(facts, o.seq_len, kernel)  # the teacher pass
    elements = tokens * forward_elements(facts, o.seq_len, kernel)
    ops = windows * forward_ops(facts, o.seq_len, kernel=kernel)
    measured = 0.0
    stack = 64
    for i, layer in enumerate(layers):
        n = _halving_measurements(candidates[i], windows)
        measured += n
        rest = sum(per_layer[i + 1 :]) + head
        flops += n * o.seq_len * (per_layer[i] + rest)
        elements += n * o.seq_len * (sum(per_layer_elements[i:]) + 3.0 * facts.vocab_size)
        ops += n * (layer_ops(layer, o.seq_len, kernel) + _CANDIDATE_OPS) + math.ceil(n / stack) * (
            forward_ops(facts, o.seq_len, layers[i + 1 :], kernel) + 10
        )
    kept = len(layers) * tokens * facts.hidden_size * 4.0  # every layer's input, kept in float32 on the host
    sizes = HIDDEN_GRID if "hidden" in o.blocks else (Fraction(1),)
    if len(sizes) > 1:  # one search per hidden size (its model narrower), then each whole cut model measured
        flops = flops * float(sum(sizes)) + len(sizes) * tokens * forward_flops(facts, o.seq_len, kernel)
        elements = elements * float(sum(sizes)) + len(sizes) * tokens * forward_elements(
            facts, o.seq_len, kernel
        )
        ops = ops * len(sizes) + len(sizes) * windows * forward_ops(facts, o.seq_len, kernel=kernel)
    load, held = _load(facts, device, dtype_bytes)
    share = o.processes  # under torchrun every process measures its share of the candidates
    memory = elements * ELEMENT_BYTES / share
    seconds = load + _seconds(device, flops / share, ops / share, 0, 0, memory, dtype_bytes=dtype_bytes)
    host = held + kept + _loaded(facts)
    dev = 0.0 if device.kind == "cpu" else held
    notes = (
        f"{sum(candidates):,} candidates over {len(layers)} layers; about {measured:,.0f} candidate-window "
        f"measurements on {windows} windows"
        + (f", at each of {len(sizes)} hidden sizes" if len(sizes) > 1 else ""),
    )
    return StageCost("plan", flops, facts.bytes, 0.0, host, dev, seconds, notes)


def _slice(facts: ModelFacts, o: RunOptions, device: Device) -> StageCost:
    kept = facts.bytes * o.budget
    n = len(facts.tensors)
    seconds = device.light_startup + _seconds(device, 0, 0, 0, facts.bytes + kept, streamed=2 * n)
    largest = max((t.nbytes for t in facts.tensors), default=0)
    return StageCost(
        "slice",
        0.0,
        facts.bytes,
        kept,
        LIGHT_MEMORY + 2.0 * HEADER_BYTES * n + o.budget * largest,  # both headers, one tensor's kept rows
        0.0,
        seconds,
        (f"{n:,} tensors streamed (no model loaded)",),
    )


def _kept_share(shapes: TrainedShapes, budget: float) -> TrainedShapes:
    """A student of ``budget`` of the decoder's parameters (each decoder tensor's rows cut to that share; the
    embedding and head whole): the student a pruned model of that budget trains."""
    vocab = {shapes.head, (shapes.head[0], shapes.hidden)}
    cut = tuple(
        s if tuple(s[:2]) in vocab or not s else (max(1, math.ceil(s[0] * budget)), *s[1:])
        for s in shapes.shapes
    )
    return replace(shapes, shapes=cut, layer_units=tuple(int(u * budget) for u in shapes.layer_units))


def _distill(facts: ModelFacts, o: RunOptions, device: Device, student: ModelFacts | None) -> StageCost:
    kernel = device.kind == "cpu"  # gdnprune's CPU gated delta rule (model.kernels)
    tokens = o.distill_tokens or o.steps * o.distill_batch_size * o.distill_seq_len
    steps = max(1, math.ceil(tokens / (o.distill_batch_size * o.distill_seq_len)))
    teacher_shapes = trained_shapes(facts)
    if student is None:
        student_shapes, f_student = (
            _kept_share(teacher_shapes, o.budget),
            forward_flops(facts, o.distill_seq_len, kernel) * o.budget,
        )
        student_bytes = facts.bytes * o.budget
    else:
        student_shapes, f_student = trained_shapes(student), forward_flops(student, o.distill_seq_len, kernel)
        student_bytes = student.bytes
    f_teacher = forward_flops(facts, o.distill_seq_len, kernel)
    flops = tokens * (3.0 * f_student + f_teacher)
    e_teacher = forward_elements(facts, o.distill_seq_len, kernel)
    e_student = (
        e_teacher * o.budget if student is None else forward_elements(student, o.distill_seq_len, kernel)
    )
    elements = tokens * (3.0 * e_student + e_teacher)
    low = o.dtype == "bfloat16" and o.mixed_precision == "no"
    itemsize = 2 if low else 4
    mem = distill_memory(
        student_shapes,
        teacher_shapes,
        processes=o.processes,
        fsdp=o.fsdp,
        teacher_sharded=o.fsdp,
        itemsize=itemsize,
        teacher_itemsize=DTYPE_BYTES.get(o.dtype, 4),
        mixed_precision=o.mixed_precision,
        micro_batch_size=max(1, o.distill_batch_size // o.processes),
        seq_len=o.distill_seq_len,
        gradient_checkpointing=o.gradient_checkpointing,
    )
    micro = max(1, o.distill_batch_size // o.processes)
    # one micro batch per process and step: the teacher's forward, the student's forward and backward (3x)
    ops = (
        steps
        * math.ceil(o.distill_batch_size / (micro * o.processes))
        * 4.0
        * forward_ops(facts, o.distill_seq_len, kernel=kernel)
    )
    # FSDP2: each step gathers the parameters for the forward and the backward and scatters the gradients
    comm = 3.0 * (student_bytes + facts.bytes) * steps if o.fsdp and o.processes > 1 else 0.0
    compute = 2 if o.mixed_precision != "no" or low else 4
    student_elements = student_shapes.elements
    # AdamW reads the parameters, gradients and both moments and writes three of them back, every step
    optimizer = 7.0 * itemsize * student_elements * steps
    # the Trainer's checkpoints (every tenth of the run: the student and its AdamW moments) and the output;
    # each process writes its share under FSDP2
    saves = steps // max(1, steps // 10)
    written = saves * (student_bytes + 2.0 * itemsize * student_elements) + student_bytes
    # transformers' own loading reads both models, converting every tensor (sharded loading under FSDP2 reads
    # each process's rows straight into the model)
    tensors = len(facts.tensors) + (len(student.tensors) if student else len(facts.tensors))
    sharded = o.fsdp and o.processes > 1
    seconds = device.startup + _seconds(
        device,
        flops / o.processes,
        ops,
        tensors if sharded else 0,
        facts.bytes + student_bytes,
        (comm + optimizer + elements * ELEMENT_BYTES) / o.processes,
        dtype_bytes=compute,
        converted=0 if sharded else tensors,
        written=written / o.processes,
    )
    host = (mem.host_loading if device.kind != "cpu" else max(mem.host_loading, mem.total)) + (
        0 if sharded else tensors * device.convert_tensor_bytes
    )
    dev = 0.0 if device.kind == "cpu" else mem.total
    note = (
        f"{steps:,} steps of {o.distill_batch_size} x {o.distill_seq_len} tokens on {o.processes} process(es)"
    )
    return StageCost("distill", flops, facts.bytes + student_bytes, written, host, dev, seconds, (note,))


def _eval(facts: ModelFacts, o: RunOptions, device: Device, dtype_bytes: int) -> StageCost:
    tokens = o.eval_tokens or 1000 * o.seq_len
    forwards = math.ceil(tokens / (o.batch_size * o.seq_len))
    flops = tokens * forward_flops(facts, o.seq_len)
    elements = tokens * forward_elements(facts, o.seq_len)
    load, held = _load(facts, device, dtype_bytes)
    share = o.processes  # under torchrun every process evaluates its share of the documents
    seconds = (
        load
        + device.harness_startup
        + _seconds(
            device,
            flops / share,
            forwards * forward_ops(facts, o.seq_len) / share,
            0,
            0,
            elements * ELEMENT_BYTES / share,
            dtype_bytes=dtype_bytes,
        )
    )
    return StageCost(
        "eval",
        flops,
        facts.bytes,
        0.0,
        held + _loaded(facts),
        0.0 if device.kind == "cpu" else held,
        seconds,
        (f"{tokens:,} tokens evaluated",),
    )


def _bench(facts: ModelFacts, o: RunOptions, device: Device, dtype_bytes: int) -> StageCost:
    flops = ops = memory = 0.0
    weights = facts.parameters * dtype_bytes
    for phase, batch, context in o.workloads:
        if phase == "prefill":
            flops += o.repeats * batch * context * forward_flops(facts, context)
            memory += o.repeats * batch * context * forward_elements(facts, context) * ELEMENT_BYTES
            ops += o.repeats * forward_ops(facts, context)
        else:
            flops += o.repeats * batch * forward_flops(facts, context)
            ops += o.repeats * forward_ops(facts, 1)
            memory += o.repeats * (weights + batch * forward_elements(facts, context) * ELEMENT_BYTES)
    load, held = _load(facts, device, dtype_bytes)
    seconds = load + _seconds(device, flops, ops, 0, 0, memory, dtype_bytes=dtype_bytes)
    return StageCost(
        "bench",
        flops,
        facts.bytes,
        0.0,
        held + _loaded(facts),
        0.0 if device.kind == "cpu" else held,
        seconds,
        (f"{len(o.workloads)} workload(s), {o.repeats} repeats each",),
    )


def stage_costs(
    facts: ModelFacts,
    options: RunOptions,
    device: Device,
    stages: Iterable[str] = STAGES,
    *,
    student: ModelFacts | None = None,
) -> list[StageCost]:
    """The cost of each of ``stages`` (:data:`STAGES`) of a run of ``options`` on ``device``; ``facts``: the model
    the stages read (for ``distill`` the teacher; its student is ``student``, default a model of
    ``options.budget`` of its decoder)."""
    dtype_bytes = DTYPE_BYTES.get(options.dtype, 4)
    out = []
    for stage in stages:
        if stage == "inspect":
            seconds = device.light_startup + _seconds(device, 0, 0, len(facts.tensors), 0)
            host = LIGHT_MEMORY + HEADER_BYTES * len(facts.tensors)
            out.append(StageCost("inspect", 0.0, 0.0, 0.0, host, 0.0, seconds))
        elif stage == "score":
            out.append(_score(facts, options, device, dtype_bytes))
        elif stage == "plan":
            out.append(_plan(facts, options, device, dtype_bytes))
        elif stage in ("slice", "sort"):
            out.append(replace(_slice(facts, options, device), stage=stage))
        elif stage == "prune":
            parts = [
                _score(facts, options, device, dtype_bytes),
                _plan(facts, options, device, dtype_bytes),
                _slice(facts, options, device),
            ]
            load, _ = _load(facts, device, dtype_bytes)
            out.append(
                StageCost(
                    "prune",
                    sum(p.flops for p in parts),
                    facts.bytes + parts[2].bytes_read,
                    parts[2].bytes_written,
                    max(p.host_memory for p in parts),
                    max(p.device_memory for p in parts),
                    sum(p.seconds for p in parts) - load,  # the model is loaded once
                    tuple(n for p in parts for n in p.notes),
                )
            )
        elif stage == "distill":
            out.append(_distill(facts, options, device, student))
        elif stage == "eval":
            out.append(_eval(facts, options, device, dtype_bytes))
        elif stage == "bench":
            out.append(_bench(facts, options, device, dtype_bytes))
        else:
            raise ValueError(f"unknown stage {stage!r}; expected some of {', '.join(STAGES)}")
    # a command that runs a model holds its runtime (Python, torch, transformers) beside the model; a run of
    # several processes pays its launch
    launch = device.launch if options.processes > 1 else 0.0
    out = [
        c
        if c.stage in ("inspect", "slice", "sort")
        else replace(c, host_memory=c.host_memory + RUNTIME_MEMORY[c.stage], seconds=c.seconds + launch)
        for c in out
    ]
    if device.memory:
        out = [
            replace(
                c,
                notes=(
                    *c.notes,
                    f"needs more than one {device.name}'s memory ({device.memory / 1e9:.0f} GB): "
                    "a --device-map over several, or FSDP2 for distill",
                ),
            )
            if c.device_memory > device.memory
            else c
            for c in out
        ]
    return out
