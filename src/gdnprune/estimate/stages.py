"""What each stage of a run costs before it runs: FLOPs, bytes read and written, host and device memory per
process, and wall time on a device (:mod:`.devices`), from the model's facts (:mod:`.inventory`) and the run's
options. No torch.

The formulas, per stage (``T`` tokens, ``f`` the forward FLOPs of one token, ``o`` the module calls of one
forward, ``B`` the checkpoint's bytes, ``n`` its tensors; a device turns FLOPs into seconds at its matrix
rate, bytes at its disk or memory bandwidth, calls and tensors at its fixed costs):

* reading a checkpoint: ``n`` tensors and ``B`` bytes (headers, then the weights into a model);
* ``score``: a forward of ``N x L`` tokens, plus the scorers' float64 statistics (a second moment of each
  attention, MLP and shared-expert input per token: ``2 n^2`` FLOPs for a width ``n``) and the routed experts'
  outputs again for the chosen ``k`` and the next one;
* ``plan`` (successive halving): a teacher pass over the plan's windows keeping every layer's input, then
  per layer its candidates (the GDN grid of key heads x lanes x key dims x value dims, the attention heads,
  the MLP and expert counts, the layer's removal) measured on the rungs' windows (the first rung sees every
  candidate on a sixteenth of the windows, each later one a quarter of the candidates on four times the
  windows); a candidate runs its own layer, and the layers after it run once for a stack of candidates;
* ``slice`` / ``sort``: every tensor read once and written once (``n`` tensors, ``2 B`` bytes);
* ``prune``: ``score`` + ``plan`` + ``slice`` on one loaded model;
* ``distill``: per step a forward and backward of the student (``3 f``) and a forward of the teacher (``f``),
  the memory of :func:`.memory.distill_memory`, under FSDP2 three passes of the parameters over the
  processes' links per step;
* ``eval``: a forward of the evaluated tokens; ``bench``: the workloads' forwards, the decode steps reading
  every weight once per step.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from fractions import Fraction

from .devices import Device
from .inventory import LayerFacts, ModelFacts
from .memory import DTYPE_BYTES, TrainedShapes, distill_memory, trained_shapes

__all__ = ["RunOptions", "StageCost", "stage_costs", "STAGES", "forward_flops", "plan_candidates"]

STAGES = ("inspect", "score", "plan", "slice", "prune", "distill", "eval", "bench")
#: the hidden sizes a plan with ``hidden`` tries by default, as fractions of the full size
#: (:func:`gdnprune.plan.measure.hidden.hidden_candidates`): one plan search each
HIDDEN_GRID = (Fraction(1), Fraction(7, 8), Fraction(3, 4))
#: the chunk length of the gated delta rule's chunked kernel
_CHUNK = 64


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


# ---- per token and per forward -------------------------------------------------------------------------


def _layer_flops(layer: LayerFacts, context: int) -> float:
    """Forward FLOPs of one token through one decoder layer at ``context`` tokens of window."""
    flops = 2.0 * layer.active_parameters
    if layer.attention:
        heads, _, head_dim = layer.attention
        flops += 2.0 * heads * head_dim * context  # scores and values over half the window on average, x2
    if layer.gdn:
        _, hv, dk, dv, _ = layer.gdn
        # per value head and token of the window padded to whole chunks: the chunk's key-key and query-key
        # products (2 C dk each), its two triangular solves (C dk + C dv), its attention over the new values
        # (2 C dv), and the state's read, correction and update (6 dk dv)
        padded = math.ceil(context / _CHUNK) * _CHUNK / context
        flops += padded * hv * (5.0 * _CHUNK * dk + 3.0 * _CHUNK * dv + 6.0 * dk * dv)
    return flops


def forward_flops(facts: ModelFacts, context: int) -> float:
    """Forward FLOPs of one token through the decoder and the head."""
    return (
        sum(_layer_flops(layer, context) for layer in facts.layers)
        + 2.0 * facts.vocab_size * facts.hidden_size
    )


def _layer_ops(layer: LayerFacts, context: int) -> float:
    """Module calls and kernels of one decoder layer's forward (norms, projections, activations; the reference
    gated delta rule loops over its chunks; a MoE runs its router, a grouped product and its shared expert)."""
    ops = 8.0
    if layer.gdn:
        ops += 30 + 6 * math.ceil(context / _CHUNK)
    if layer.attention:
        ops += 20
    ops += 20 if layer.experts else 6
    return ops


def _forward_ops(facts: ModelFacts, context: int, layers: Iterable[LayerFacts] | None = None) -> float:
    return sum(_layer_ops(layer, context) for layer in (facts.layers if layers is None else layers)) + 10


def _statistics_flops(facts: ModelFacts) -> float:
    """Float64 FLOPs per token of the scorers' second moments (attention, dense MLP and shared expert inputs)."""
    total = 0.0
    for layer in facts.layers:
        if layer.attention:
            heads, _, head_dim = layer.attention
            total += 2.0 * (heads * head_dim) ** 2
        if layer.mlp:
            total += 2.0 * layer.mlp**2
        if layer.shared_expert:
            total += 2.0 * layer.shared_expert**2
        if layer.gdn:
            _, hv, dk, dv, _ = layer.gdn
            total += 2.0 * hv * hv + 4.0 * hv * dv * dk  # head Gram, q/k moments
    return total


def _expert_hook_flops(facts: ModelFacts) -> float:
    """FLOPs per token of the experts scorer: the chosen experts' outputs again, and the next choice's."""
    return sum(
        6.0 * (layer.experts[1] + 1) * layer.experts[2] * layer.hidden
        for layer in facts.layers
        if layer.experts
    )


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
) -> float:
    compute = dtype_bytes if device.kind == "cuda" else 4  # a CPU computes in float32 (bf16 is upcast)
    return (
        flops / device.flops(compute)
        + flops64 / device.flops(8)
        + ops * device.op_seconds
        + tensors * device.tensor_seconds
        + disk_bytes / device.disk
        + memory_bytes / (device.bandwidth * device.bandwidth_efficiency)
    )


def _load(facts: ModelFacts, device: Device, dtype_bytes: int) -> tuple[float, float]:
    """(seconds, host bytes) of starting a command that runs a model (its imports) and reading the checkpoint
    into a model in the compute dtype."""
    held = facts.parameters * dtype_bytes
    return device.startup + _seconds(device, 0, 0, len(facts.tensors), facts.bytes), held


def _score(facts: ModelFacts, o: RunOptions, device: Device, dtype_bytes: int) -> StageCost:
    tokens = o.num_samples * o.seq_len
    batches = math.ceil(o.num_samples / o.batch_size)
    flops = tokens * (forward_flops(facts, o.seq_len) + _expert_hook_flops(facts))
    flops64 = tokens * _statistics_flops(facts)
    hooked = sum(1 + (layer.experts is not None) for layer in facts.layers)
    ops = batches * (_forward_ops(facts, o.seq_len) + 20 * hooked)
    load, held = _load(facts, device, dtype_bytes)
    stats = sum(
        8.0
        * (
            (layer.mlp or 0) ** 2
            + (layer.shared_expert or 0) ** 2
            + (layer.attention[0] ** 2 if layer.attention else 0)
        )
        for layer in facts.layers
    )
    activations = o.batch_size * o.seq_len * facts.hidden_size * dtype_bytes * 16
    share = o.processes  # under torchrun every process scores its share of the windows
    seconds = load + _seconds(
        device, flops / share, ops / share, 0, 0, flops64=flops64 / share, dtype_bytes=dtype_bytes
    )
    host = held + stats + activations if device.kind == "cpu" else held + stats
    dev = 0.0 if device.kind == "cpu" else held + activations
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
    per_layer = [_layer_flops(layer, o.seq_len) for layer in layers]
    head = 2.0 * facts.vocab_size * facts.hidden_size
    candidates = plan_candidates(facts, o)
    flops = tokens * forward_flops(facts, o.seq_len)  # the teacher pass
    ops = windows * _forward_ops(facts, o.seq_len)
    measured = 0.0
    stack = 64
    for i, layer in enumerate(layers):
        n = _halving_measurements(candidates[i], windows)
        measured += n
        rest = sum(per_layer[i + 1 :]) + head
        flops += n * o.seq_len * (per_layer[i] + rest)
        ops += n * (_layer_ops(layer, o.seq_len) + 10) + math.ceil(n / stack) * (
            _forward_ops(facts, o.seq_len, layers[i + 1 :]) + 10
        )
    kept = len(layers) * tokens * facts.hidden_size * 4.0  # every layer's input, kept in float32 on the host
    sizes = HIDDEN_GRID if "hidden" in o.blocks else (Fraction(1),)
    if len(sizes) > 1:  # one search per hidden size (its model narrower), then each whole cut model measured
        flops = flops * float(sum(sizes)) + len(sizes) * tokens * forward_flops(facts, o.seq_len)
        ops = ops * len(sizes) + len(sizes) * windows * _forward_ops(facts, o.seq_len)
    load, held = _load(facts, device, dtype_bytes)
    share = o.processes  # under torchrun every process measures its share of the candidates
    seconds = load + _seconds(device, flops / share, ops / share, 0, 0, dtype_bytes=dtype_bytes)
    host = held + kept
    dev = 0.0 if device.kind == "cpu" else held
    notes = (
        f"{sum(candidates):,} candidates over {len(layers)} layers; about {measured:,.0f} candidate-window "
        f"measurements on {windows} windows"
        + (f", at each of {len(sizes)} hidden sizes" if len(sizes) > 1 else ""),
    )
    return StageCost("plan", flops, facts.bytes, 0.0, host, dev, seconds, notes)


def _slice(facts: ModelFacts, o: RunOptions, device: Device) -> StageCost:
    kept = facts.bytes * o.budget
    seconds = _seconds(device, 0, 0, 2 * len(facts.tensors), facts.bytes + kept)
    largest = max((t.nbytes for t in facts.tensors), default=0)
    return StageCost(
        "slice",
        0.0,
        facts.bytes,
        kept,
        2.0 * largest,
        0.0,
        seconds,
        (f"{len(facts.tensors):,} tensors streamed (no model loaded)",),
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
    tokens = o.distill_tokens or o.steps * o.distill_batch_size * o.distill_seq_len
    steps = max(1, math.ceil(tokens / (o.distill_batch_size * o.distill_seq_len)))
    teacher_shapes = trained_shapes(facts)
    if student is None:
        student_shapes, f_student = (
            _kept_share(teacher_shapes, o.budget),
            forward_flops(facts, o.distill_seq_len) * o.budget,
        )
        student_bytes = facts.bytes * o.budget
    else:
        student_shapes, f_student = trained_shapes(student), forward_flops(student, o.distill_seq_len)
        student_bytes = student.bytes
    f_teacher = forward_flops(facts, o.distill_seq_len)
    flops = tokens * (3.0 * f_student + f_teacher)
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
    ops = steps * micro * 4.0 * _forward_ops(facts, o.distill_seq_len)
    # FSDP2: each step gathers the parameters for the forward and the backward and scatters the gradients
    comm = 3.0 * (student_bytes + facts.bytes) * steps if o.fsdp and o.processes > 1 else 0.0
    compute = 2 if o.mixed_precision != "no" or low else 4
    seconds = device.startup + _seconds(
        device,
        flops / o.processes,
        ops,
        len(facts.tensors) * 2,
        facts.bytes + student_bytes,
        comm / o.processes,
        dtype_bytes=compute,
    )
    host = mem.host_loading if device.kind != "cpu" else max(mem.host_loading, mem.total)
    dev = 0.0 if device.kind == "cpu" else mem.total
    note = (
        f"{steps:,} steps of {o.distill_batch_size} x {o.distill_seq_len} tokens on {o.processes} process(es)"
    )
    return StageCost(
        "distill", flops, facts.bytes + student_bytes, student_bytes, host, dev, seconds, (note,)
    )


def _eval(facts: ModelFacts, o: RunOptions, device: Device, dtype_bytes: int) -> StageCost:
    tokens = o.eval_tokens or 1000 * o.seq_len
    forwards = math.ceil(tokens / (o.batch_size * o.seq_len))
    flops = tokens * forward_flops(facts, o.seq_len)
    load, held = _load(facts, device, dtype_bytes)
    share = o.processes  # under torchrun every process evaluates its share of the documents
    seconds = load + _seconds(
        device,
        flops / share,
        forwards * _forward_ops(facts, o.seq_len) / share,
        0,
        0,
        dtype_bytes=dtype_bytes,
    )
    return StageCost(
        "eval",
        flops,
        facts.bytes,
        0.0,
        held,
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
            ops += o.repeats * _forward_ops(facts, context)
        else:
            flops += o.repeats * batch * forward_flops(facts, context)
            ops += o.repeats * _forward_ops(facts, 1)
            memory += o.repeats * weights
    load, held = _load(facts, device, dtype_bytes)
    seconds = load + _seconds(device, flops, ops, 0, 0, memory, dtype_bytes=dtype_bytes)
    return StageCost(
        "bench",
        flops,
        facts.bytes,
        0.0,
        held,
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
            out.append(
                StageCost("inspect", 0.0, 0.0, 0.0, 0.0, 0.0, _seconds(device, 0, 0, len(facts.tensors), 0))
            )
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
    # a command that runs a model holds its runtime (Python, torch, transformers) beside the model
    out = [
        c
        if c.stage in ("inspect", "slice", "sort")
        else replace(c, host_memory=c.host_memory + device.runtime_memory)
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
