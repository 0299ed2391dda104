"""The work of one token's forward through a model, from its facts (:mod:`.inventory`): the FLOPs of its
products, the activation elements its elementwise kernels write, its module calls, and the scorers' float64
statistics. No torch. :mod:`.stages` turns them into each stage's seconds."""

from __future__ import annotations

import math
from collections.abc import Iterable

from .inventory import LayerFacts, ModelFacts

__all__ = [
    "CHUNK",
    "SMALL_STATE",
    "ELEMENT_BYTES",
    "layer_flops",
    "forward_flops",
    "layer_elements",
    "forward_elements",
    "layer_ops",
    "forward_ops",
    "statistics_flops",
    "expert_hook_flops",
]

#: the chunk length of the gated delta rule's chunked kernel
CHUNK = 64
#: passes over a chunk row (``CHUNK`` elements) per value head and token in the reference chunked kernel: the
#: key-key and query-key products' outputs, the decay mask and its exp, the masked fills, the triangular
#: solve's row updates (a window is padded to whole chunks); fitted to the measured plans, whose stacked
#: candidates run it at tiny head dims (benchmarks/scale.py)
CHUNK_ROWS = 20
#: gdnprune's CPU kernel (:mod:`gdnprune.model.kernels`, which the plan search, scoring and distillation run where
#: flash-linear-attention is missing): chunks of ``SMALL_CHUNK`` tokens for head states of at most ``SMALL_STATE``
#: entries (``Dk x Dv``; tests/test_kernels.py checks it is the kernel's), no padding, and ``KERNEL_ROWS`` passes
#: per chunk row (the pairwise decays, clamped, exponentiated and masked in place; the two products' outputs and
#: their masking; the solve), fitted to the 10 prunes measured with it (benchmarks/scale.py, 4 to 48 layers, dense
#: and MoE: predicted/measured 0.76-1.15, before the plan measured in inference mode, about 9 % faster; it absorbs
#: the per-element cost of rows of 16, which vectorise worse)
SMALL_STATE, SMALL_CHUNK, KERNEL_ROWS = 1024, 16, 30


def _chunking(dk: int, dv: int, context: int, kernel: bool) -> tuple[int, float, float]:
    """``(chunk length, padding factor, passes per chunk row)`` of the gated delta rule at ``context`` tokens:
    gdnprune's CPU kernel (``kernel``) or the reference / flash-linear-attention's (chunks of 64, padded)."""
    if not kernel:
        return CHUNK, math.ceil(context / CHUNK) * CHUNK / context, CHUNK_ROWS
    chunk = min(SMALL_CHUNK if dk * dv <= SMALL_STATE else CHUNK, context)
    return chunk, 1.0, KERNEL_ROWS


def layer_flops(layer: LayerFacts, context: int, kernel: bool = False) -> float:
    """Forward FLOPs of one token through one decoder layer at ``context`` tokens of window (``kernel``:
    gdnprune's CPU gated delta rule, else the reference chunked one)."""
    flops = 2.0 * layer.active_parameters
    if layer.attention:
        heads, _, head_dim = layer.attention
        flops += 2.0 * heads * head_dim * context  # scores and values over half the window on average, x2
    if layer.gdn:
        _, hv, dk, dv, _ = layer.gdn
        # per value head and token of the window padded to whole chunks: the chunk's key-key and query-key
        # products (2 C dk each), its two triangular solves (C dk + C dv), its attention over the new values
        # (2 C dv), and the state's read, correction and update (6 dk dv)
        chunk, padded, _ = _chunking(dk, dv, context, kernel)
        flops += padded * hv * (5.0 * chunk * dk + 3.0 * chunk * dv + 6.0 * dk * dv)
    return flops


def forward_flops(facts: ModelFacts, context: int, kernel: bool = False) -> float:
    """Forward FLOPs of one token through the decoder and the head."""
    return (
        sum(layer_flops(layer, context, kernel) for layer in facts.layers)
        + 2.0 * facts.vocab_size * facts.hidden_size
    )


def layer_elements(layer: LayerFacts, context: int, kernel: bool = False) -> float:
    """Activation elements the elementwise kernels of one decoder layer write for one token (norms, residual
    adds, activations and gates, rotary, softmax, the gated delta rule's chunk rows and per-head vectors, the
    experts' gathers and weighted sum): each written once and read once by the next kernel."""
    h = layer.hidden
    total = 8.0 * h  # two norms (in, out), the residual adds
    if layer.gdn:
        hk, hv, dk, dv, _ = layer.gdn
        conv = 2 * hk * dk + hv * dv
        # the causal conv and its silu, q/k l2-norms, the decay and beta gates, per value head the chunk's rows
        # (CHUNK_ROWS passes of C) and its vectors, the gated output norm
        chunk, padded, rows = _chunking(dk, dv, context, kernel)
        total += 2 * conv + 2 * 2 * hk * dk + 4 * hv + hv * (padded * rows * chunk + 3 * dk + 4 * dv)
    if layer.attention:
        heads, kv, head_dim = layer.attention
        # q and its gate, k, v, rotary, per head the scores' softmax over the window, the gated output
        total += 4 * heads * head_dim + 4 * kv * head_dim + 3 * heads * context + 2 * heads * head_dim
    total += 3.0 * layer.mlp + 3.0 * layer.shared_expert + (2 * h if layer.shared_expert else 0)
    if layer.experts:
        num, top, width = layer.experts
        total += 3.0 * num + top * (3 * width + 3 * h)  # router softmax, top-k; per chosen expert
    return total


def forward_elements(facts: ModelFacts, context: int, kernel: bool = False) -> float:
    """Activation elements of one token's forward through the decoder and the head (:func:`layer_elements`)."""
    return sum(layer_elements(layer, context, kernel) for layer in facts.layers) + 3.0 * facts.vocab_size


#: bytes an activation element moves through memory (float32: written once, read once)
ELEMENT_BYTES = 8.0


def layer_ops(layer: LayerFacts, context: int, kernel: bool = False) -> float:
    """Module calls and kernels of one decoder layer's forward (norms, projections, activations; the reference
    gated delta rule loops over its chunks; a MoE runs its router, a grouped product and its shared expert)."""
    ops = 8.0
    if layer.gdn:
        ops += 30 + 6 * math.ceil(context / _chunking(layer.gdn[2], layer.gdn[3], context, kernel)[0])
    if layer.attention:
        ops += 20
    ops += 20 if layer.experts else 6
    return ops


def forward_ops(
    facts: ModelFacts, context: int, layers: Iterable[LayerFacts] | None = None, kernel: bool = False
) -> float:
    return (
        sum(layer_ops(layer, context, kernel) for layer in (facts.layers if layers is None else layers)) + 10
    )


def statistics_flops(facts: ModelFacts) -> float:
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


def expert_hook_flops(facts: ModelFacts) -> float:
    """FLOPs per token of the experts scorer: the chosen experts' outputs again, and the next choice's."""
    return sum(
        6.0 * (layer.experts[1] + 1) * layer.experts[2] * layer.hidden
        for layer in facts.layers
        if layer.experts
    )
