"""Importance scoring of GatedDeltaNet layers: calibration forwards with hooks -> importance orders.

:func:`score_model` runs calibration batches through a real transformers model with hooks on every GDN
layer (found by :func:`gdnprune.layouts.find_gdn_modules`) and returns a *scores file* dict::

    {"format": "gdnprune-scores", "version": 1, "method": "projection", "num_tokens": 65536,
     "seed": 0, "layers": {"model.layers.0.linear_attn": payload, ...}}

One payload per layer, keyed by the layer's state-dict prefix, holds the four orders that
:meth:`gdnprune.gated_delta_net.GDNPermutation.from_score_payload` reads (most important first):
``key_group_order_most_important_first`` [Hk], ``value_lane_order_most_important_first`` [Hk, r] (row
``g``: lanes of old group ``g``), ``key_dim_order_most_important_first`` [Hk, dk] (row ``g``: q/k channels
of old key head ``g``) and ``value_dim_order_most_important_first`` [dv]; the raw per-element scores
``key_group_scores``, ``value_lane_scores``, ``key_dim_scores``, ``value_dim_scores`` (same shapes,
larger = more important, see ``score_kind``); and the geometry (``shape``, ``layout``).

Methods:

* ``projection`` (default). The layer output is ``y = sum_h c_h`` with ``c_h = W_h o_h``, where ``o_h``
  is value head ``h``'s slice of the ``out_proj`` input (after the gated RMSNorm) and ``W_h`` its block
  of ``out_proj.weight``. Removing a set ``R`` of heads changes ``y`` by ``-sum_{h in R} c_h``, whose
  energy over the calibration tokens is ``1^T G_RR 1`` with the Gram matrix ``G[h, k] = sum_t c_h . c_k``.
  A pre-hook on ``out_proj`` computes the per-head contributions of every batch (one extra
  ``out_proj``-sized product) and accumulates ``G`` ([Hv, Hv], float64). Orders come from a greedy
  *conditional removal* (:func:`greedy_removal_order`): repeatedly drop the element whose removal least
  increases the energy of everything dropped so far; the reverse of the removal sequence is the
  importance order. Key groups use the group-summed Gram. Lanes use, by default, a *loss-aware* Gram
  ``F[h, k] = sum_t (g_t . c_h) (g_t . c_k)``, where ``g_t`` is the gradient of token ``t``'s next-token
  loss with respect to the final residual stream (the final norm's input), taken through the final norm
  and ``lm_head`` only (the "direct path": the layers after this one are treated as the identity), so
  ``-sum_{h in R} g_t . c_h`` is the first-order loss change of removing ``R`` and ``1^T F_RR 1`` its
  energy. It is measured on one token in ``loss_token_stride`` (default 8; the next token of the same
  window is the label): a pre-hook on the final norm keeps the final hidden state, and after each forward
  the norm and ``lm_head`` are re-run on the chosen tokens, chunked so that at most ``2^25`` logits exist
  at a time, and differentiated with respect to their input only (autograd; the loss in float32). Each
  layer keeps its ``out_proj`` input at the chosen tokens until then. Lanes are removed round by round,
  one lane from every group per round, with the cross-group terms included (:func:`greedy_lane_orders`),
  which is exactly what a nested slice to ``r'`` lanes per group drops. The lanes of a group share their
  key head and often have close output energies; the loss-aware Gram separates them by what the loss
  reads of their output. In the quality benchmark (BENCHMARKS.md) it beat the energy Gram on the bundled
  model and lost to it on a second model trained with another seed; ``lane_measure="energy_gram"``
  restores the energy Gram for lanes. For key groups the energy Gram was better (``key_group_measure``).
  Models without a final norm module before ``lm_head`` (``get_decoder().norm``; e.g. Qwen4-exp, whose
  hyper-connection mixer replaces it) fall back to the energy Gram with a ``RuntimeWarning``; the scores
  file records the measures used. Value channels (one order for all heads, the norm weight is shared):
  by default each channel's projected contribution is measured per head, as its RMS over tokens
  ``|W[:, (h, e)]| RMS(o_(h, e))``, and summed over heads (an L1 over heads of per-head L2 norms), so that
  the one shared order serves every head instead of the few heads with the largest energy;
  ``value_dim_measure="energy"`` uses the energy of the contribution summed over heads,
  ``sum_t |sum_h W[:, (h, e)] o_(h, e)|^2``, ``"gram"`` the greedy on the full channel Gram (from the full
  second moment ``C = sum_t o o^T``, [Hv*dv]^2) and ``"loss_gram"`` the greedy on the loss-aware channel
  Gram (as for lanes, with channel ``e``'s contribution summed over heads). Key channels: the kernel sees ``q^ = q/|q|``
  and ``k^ = k/|k|`` per key head (after the depthwise conv and SiLU, which the hooks recompute from
  the q/k projection output and the conv weights); the hooks measure every channel's share of the
  normalised vectors, ``E[q^_d^2]`` and ``E[k^_d^2]``, as the l2 normalisation sees it (relative to
  the whole head). The default adds their square roots, ``RMS(q^_d) + RMS(k^_d)``: k^ alone drives the
  delta-rule state update (``S <- S (I - b k^ k^T) + b v k^T``) and q^ alone the read-out, so a channel
  matters when either carries energy, and summing norms again keeps one large term from deciding.
  ``key_dim_measure="qk_gram"`` instead runs the greedy on ``Cq * Ck`` (``Cq = sum_t q^ q^T``): the
  energy of the ``q^_t . k^_s`` products over all token pairs carried by the dropped channels. q's
  rescaling after a cut is absorbed by the gated RMSNorm. The benchmark (BENCHMARKS.md) compares all
  of these; q or k alone order much worse.
* ``activation``: Minitron-style magnitudes. For every channel, the mean ``|activation|`` over the
  tokens of a window, then the L2 norm over windows: of the ``out_proj`` input per (head, value channel)
  and of the post-conv q and k per key channel. Heads sum their channels, groups their heads, value
  channels sum over heads, key channels add their q and k magnitudes. Cheap; the baseline.
* ``random``: seeded random orders (:meth:`GDNPermutation.random`), for baselines; no forward passes.

All sums over tokens are accumulated in float64 (on accelerators the per-batch products run in float32
and are added to float64 accumulators), so the result does not depend on the batch size beyond float
noise. The hooks work with models dispatched by accelerate over several devices (``device_map``,
including CPU/disk offload): statistics live on the device each layer runs on.
"""

from __future__ import annotations

import inspect
import json
import math
import os
import sys
import tempfile
import warnings
from pathlib import Path
from typing import Any, Iterable, Mapping

from .geometry import ORDER_KEYS
from .layouts import find_gdn_modules

__all__ = [
    "METHODS",
    "SCORES_FORMAT",
    "SCORES_VERSION",
    "score_model",
    "greedy_removal_order",
    "greedy_lane_orders",
    "scores_to_permutations",
    "save_scores",
    "load_scores",
    "score_checkpoint",
    "add_commands",
]

#: Scoring methods, the default first.
METHODS = ("projection", "activation", "random")
#: ``format`` field of a scores file.
SCORES_FORMAT = "gdnprune-scores"
#: ``version`` field of a scores file.
SCORES_VERSION = 1

_KEY_DIM_MEASURES = ("qk_rms", "qk_gram", "qk_energy", "q_energy", "k_energy")
_VALUE_DIM_MEASURES = ("head_rms", "energy", "gram", "loss_gram")
_HEAD_MEASURES = ("loss_gram", "energy_gram")

_SCORE_KIND = {
    "projection": (
        "projection: key groups (and lanes with lane_measure='energy_gram'): mean squared norm per token of "
        "the element's own contribution to the out_proj output; lanes by default (lane_measure='loss_gram'): "
        "mean over the loss tokens of (g . c_h)^2, g the next-token loss gradient at the final norm's input "
        "(orders of both come from the greedy conditional removal on the Gram matrix and account for "
        "redundancy); key dims: the key_dim_measure (default RMS(q^_d) + RMS(k^_d) of the "
        "l2-normalised q and k); value dims: the value_dim_measure (default sum over heads of "
        "RMS(W[:, (h, e)] o_(h, e)))"
    ),
    "activation": "activation: mean |activation| over each window's tokens, L2 over windows (RMS over windows)",
    "random": "random: the rank in a seeded random order (larger = earlier)",
}


# --------------------------------------------------------------------------------------------------
# Greedy conditional removal


def greedy_removal_order(gram: torch.Tensor) -> torch.Tensor:
    """Importance order (most important first) of the ``n`` elements of a Gram matrix ``gram`` [..., n, n].

    ``gram[i, j] = sum_t c_i(t) . c_j(t)`` for per-element contributions ``c_i`` whose sum is the signal.
    The greedy repeatedly removes the element whose removal least increases the energy
    ``|sum_{i in R} c_i|^2 = 1^T gram_RR 1`` of everything removed so far; the returned order is the
    reverse of the removal sequence, so every prefix is the set kept by the greedy at that size. Exact
    ties are broken towards keeping the lower index first. Leading dimensions are independent problems
    (e.g. one per key head), solved together.
    """
    import torch
    gram = torch.as_tensor(gram).to(torch.float64)
    if gram.dim() < 2 or gram.shape[-1] != gram.shape[-2]:
        raise ValueError(f"gram must be a square matrix [..., n, n], got shape {list(gram.shape)}")
    lead, n = gram.shape[:-2], gram.shape[-1]
    gram = gram.reshape(-1, n, n)
    b = gram.shape[0]
    rows = torch.arange(b, device=gram.device)
    diag = gram.diagonal(dim1=-2, dim2=-1).clone()
    cross = torch.zeros(b, n, dtype=torch.float64, device=gram.device)
    alive = torch.ones(b, n, dtype=torch.bool, device=gram.device)
    removed = torch.empty(b, n, dtype=torch.long, device=gram.device)
    inf = torch.tensor(math.inf, dtype=torch.float64, device=gram.device)
    for step in range(n):
        cost = torch.where(alive, diag + 2 * cross, inf)
        i = (n - 1) - torch.argmin(cost.flip(-1), dim=-1)  # exact ties: remove the highest index first
        removed[:, step] = i
        alive[rows, i] = False
        cross += gram[rows, :, i]
    return removed.flip(-1).reshape(*lead, n).cpu()


def greedy_lane_orders(gram: torch.Tensor, num_key_heads: int) -> torch.Tensor:
    """Lane orders [Hk, r] (row ``g``: lanes of group ``g``, most important first) from a head Gram [Hv, Hv].

    The removal runs in rounds: in each round exactly one lane of every group is removed, each time the
    lane (among groups not yet reduced in this round) whose removal least increases the energy of all
    lanes removed so far, cross-group terms included. After round ``k`` every group has lost ``k`` lanes,
    which is what a nested slice to ``r - k`` lanes per group drops, so the orders target that cut.
    """
    import torch
    gram = torch.as_tensor(gram, dtype=torch.float64)
    Hv = gram.shape[0]
    if gram.shape != (Hv, Hv) or Hv % num_key_heads:
        raise ValueError(f"gram must be [Hv, Hv] with Hv a multiple of {num_key_heads}, got {list(gram.shape)}")
    r = Hv // num_key_heads
    group = torch.arange(Hv, device=gram.device) // r
    diag = gram.diagonal().clone()
    cross = torch.zeros(Hv, dtype=torch.float64, device=gram.device)
    alive = torch.ones(Hv, dtype=torch.bool, device=gram.device)
    inf = torch.tensor(math.inf, dtype=torch.float64, device=gram.device)
    removed: list[list[int]] = [[] for _ in range(num_key_heads)]
    for _ in range(r):
        pending = torch.ones(num_key_heads, dtype=torch.bool, device=gram.device)
        for _ in range(num_key_heads):
            cost = torch.where(alive & pending[group], diag + 2 * cross, inf)
            i = int(Hv - 1 - torch.argmin(cost.flip(0)))  # exact ties: remove the highest index first
            g = i // r
            removed[g].append(i - g * r)
            alive[i] = False
            pending[g] = False
            cross += gram[:, i]
    return torch.tensor([lanes[::-1] for lanes in removed], dtype=torch.long)


def _descending(scores: torch.Tensor) -> torch.Tensor:
    """Order by descending score along the last axis; ties keep index order."""
    import torch
    return torch.sort(scores, dim=-1, descending=True, stable=True).indices


# --------------------------------------------------------------------------------------------------
# Per-layer hooks and statistics


def _materialized_weight(module: torch.nn.Module, name: str = "weight") -> torch.Tensor:
    """A parameter of ``module``, loaded from accelerate's offload map when it sits on the meta device."""
    tensor = getattr(module, name)
    if tensor is None or tensor.device.type != "meta":
        return tensor
    try:
        from accelerate.utils import align_module_device
    except ImportError:  # pragma: no cover - accelerate is what puts weights on meta
        raise ValueError(f"{type(module).__name__}.{name} is on the meta device and accelerate is missing") from None
    with align_module_device(module):
        return getattr(module, name).detach().clone()


class _LayerScorer:
    """Hooks and float64 statistics of one GDN layer."""

    def __init__(self, prefix: str, module: torch.nn.Module, method: str, key_dim_measure: str,
                 value_dim_measure: str, lane_measure: str = "energy_gram",
                 key_group_measure: str = "energy_gram") -> None:
        import torch
        from .gated_delta_net import GDNShape
        self.prefix, self.module, self.method = prefix, module, method
        self.key_dim_measure, self.value_dim_measure = key_dim_measure, value_dim_measure
        self.lane_measure, self.key_group_measure = lane_measure, key_group_measure
        self.shape = GDNShape.from_module(module)
        children = dict(module.named_children())
        if "in_proj_qkv" in children:
            self.layout = "qwen3_5"
        elif "in_proj_qkvz" in children:
            self.layout = "qwen3_next"
        elif "q_proj" in children and "k_proj" in children:
            self.layout = "olmo_hybrid"
        else:
            raise ValueError(
                f"{prefix}: unsupported GDN module {type(module).__name__}: expected in_proj_qkv (Qwen3.5), "
                f"in_proj_qkvz (Qwen3-Next) or q_proj/k_proj (OLMo-hybrid), found {sorted(children)}"
            )
        out_name = "out_proj" if "out_proj" in children else "o_proj" if "o_proj" in children else None
        if out_name is None or "conv1d" not in children:
            raise ValueError(f"{prefix}: GDN module {type(module).__name__} has no out_proj/o_proj or conv1d")
        self.out_proj = children[out_name]
        self.conv = children["conv1d"]
        self.stats: dict[str, torch.Tensor] = {}
        self.num_tokens = 0
        self.num_windows = 0
        self.token_mask: torch.Tensor | None = None  # [B, T] bool of the current batch, None = all tokens
        self.loss_select: torch.Tensor | None = None  # [B, T] bool: tokens whose loss gradient is measured
        self.loss_tokens = 0
        self._pending_q: torch.Tensor | None = None
        self._pending_o: torch.Tensor | None = None  # out_proj input of the loss tokens [n, Hv*dv]

    @property
    def needs_loss_gradient(self) -> bool:
        """Whether an order of this layer uses the loss-aware Gram (then :meth:`on_loss_gradient` must run)."""
        return self.method == "projection" and "loss_gram" in (
            self.lane_measure, self.key_group_measure, self.value_dim_measure)

    # hooks ---------------------------------------------------------------------------------------

    def attach(self) -> list[Any]:
        """Register the hooks; returns the handles."""
        m, handles = self.module, []
        handles.append(self.out_proj.register_forward_pre_hook(self._out_hook))
        if self.layout == "qwen3_5":
            handles.append(m.in_proj_qkv.register_forward_hook(self._qkv_hook))
        elif self.layout == "qwen3_next":
            handles.append(m.in_proj_qkvz.register_forward_hook(self._qkvz_hook))
        else:
            handles.append(m.q_proj.register_forward_hook(self._q_hook))
            handles.append(m.k_proj.register_forward_hook(self._k_hook))
        return handles

    def _qkv_hook(self, module, args, output) -> None:
        self._on_qk(output[..., : 2 * self.shape.key_dim])

    def _qkvz_hook(self, module, args, output) -> None:
        import torch
        s = self.shape
        per_group = output.shape[-1] // s.num_key_heads
        grouped = output.reshape(*output.shape[:-1], s.num_key_heads, per_group)
        q = grouped[..., : s.key_head_dim].flatten(-2)
        k = grouped[..., s.key_head_dim : 2 * s.key_head_dim].flatten(-2)
        self._on_qk(torch.cat([q, k], dim=-1))

    def _q_hook(self, module, args, output) -> None:
        self._pending_q = output

    def _k_hook(self, module, args, output) -> None:
        import torch
        q, self._pending_q = self._pending_q, None
        if q is None:  # pragma: no cover - q_proj always runs first
            raise RuntimeError(f"{self.prefix}: k_proj ran before q_proj")
        self._on_qk(torch.cat([q, output.to(q.device)], dim=-1))

    def _out_hook(self, module, args) -> None:
        self._on_out(args[0])

    # statistics ----------------------------------------------------------------------------------

    def _acc(self, name: str, value: torch.Tensor) -> None:
        """Add ``value`` to the float64 accumulator ``name`` (created on ``value``'s device)."""
        import torch
        if name in self.stats:
            self.stats[name] += value
        else:
            self.stats[name] = value.to(torch.float64).clone()

    def _mask_on(self, device) -> torch.Tensor | None:
        return None if self.token_mask is None else self.token_mask.to(device)

    def _on_qk(self, qk: torch.Tensor) -> None:
        """q/k projection output [B, T, 2*Hk*dk] (canonical [q | k]) -> post-conv q, k statistics."""
        import torch
        import torch.nn.functional as F
        from transformers.activations import ACT2FN

        s = self.shape
        kd = s.key_dim
        B, T = qk.shape[0], qk.shape[1]
        weight = self.conv.weight[: 2 * kd]
        bias = None if self.conv.bias is None else self.conv.bias[: 2 * kd]
        x = qk.detach().transpose(1, 2)
        weight = weight.to(x.device)
        bias = None if bias is None else bias.to(x.device)
        kernel = weight.shape[-1]
        y = F.conv1d(x.to(weight.dtype), weight, bias, padding=kernel - 1, groups=2 * kd)[..., :T]
        y = ACT2FN[getattr(self.module, "activation", "silu")](y).float()  # [B, 2kd, T]
        mask = self._mask_on(y.device)
        if self.method == "activation":
            # per-window mean |q|, |k| over (valid) tokens, squared and summed over windows
            a = y.abs()
            if mask is None:
                means = a.mean(-1)
            else:
                m = mask[:, None, :].to(a.dtype)
                means = (a * m).sum(-1) / m.sum(-1).clamp_min(1)
            self._acc("qk_abs_mean_sq", (means.double() ** 2).sum(0))
            return
        y = y.reshape(B, 2, s.num_key_heads, s.key_head_dim, T)
        y = y * torch.rsqrt((y * y).sum(3, keepdim=True) + 1e-6)  # the kernel's l2norm
        if mask is not None:
            y = y * mask[:, None, None, None, :].to(y.dtype)
        if self.key_dim_measure != "qk_gram":  # per-channel energies of q^ and k^ suffice: [2, Hk, dk]
            self._acc("qk_sq", y.to(self._gram_dtype(y.device)).pow(2).sum((0, 4)))
            return
        # [2, Hk, dk, B*T] -> per (q|k, head) second moments [2, Hk, dk, dk]
        flat = y.permute(1, 2, 3, 0, 4).reshape(2 * s.num_key_heads, s.key_head_dim, B * T)
        flat = flat.to(self._gram_dtype(flat.device))
        moments = torch.bmm(flat, flat.transpose(1, 2)).reshape(2, s.num_key_heads, s.key_head_dim, s.key_head_dim)
        self._acc("qk_moments", moments)

    def _on_out(self, o: torch.Tensor) -> None:
        """out_proj input [B, T, Hv*dv] -> value head / value channel statistics."""
        import torch
        o = o.detach()
        B, T, V = o.shape[0], o.shape[1], o.shape[-1]
        mask = self._mask_on(o.device)
        n_valid = B * T if mask is None else int(mask.sum())
        self.num_tokens += n_valid
        self.num_windows += B
        if self.method == "activation":
            a = o.float().abs()
            if mask is None:
                means = a.mean(1)
            else:
                m = mask[:, :, None].to(a.dtype)
                means = (a * m).sum(1) / m.sum(1).clamp_min(1)
            self._acc("out_abs_mean_sq", (means.double() ** 2).sum(0))
            return
        if self.loss_select is not None:
            self._pending_o = o.reshape(B * T, V)[self.loss_select.to(o.device).reshape(-1)]
        x = o.reshape(B * T, V)
        if mask is not None:
            x = x[mask.reshape(-1)]
        x = x.to(self._gram_dtype(x.device))
        if self.value_dim_measure == "gram":
            # full second moment C = sum_t o o^T; every Gram matrix is a block sum of (W^T W) * C
            self._acc("out_moment", x.T @ x)
            return
        s = self.shape
        Hv, dv = s.num_value_heads, s.value_head_dim
        heads = x.reshape(-1, Hv, dv)
        if self.value_dim_measure == "energy":
            # same-channel cross-head moments [dv, Hv, Hv]: enough for each value channel's own energy
            per_dim = heads.permute(2, 1, 0)
            self._acc("channel_moments", torch.bmm(per_dim, per_dim.transpose(1, 2)))
        elif self.value_dim_measure == "head_rms":
            self._acc("out_sq", x.pow(2).sum(0))  # [Hv*dv]
        # per-head contributions c_h = W_h o_h [Hv, n, H] (in token chunks) -> head Gram [Hv, Hv]. Each
        # entry of c sums dv products of one token, so c is computed in float32 like out_proj itself;
        # the sum over tokens (the Gram) is taken in the Gram dtype (float64 on CPU).
        W = _materialized_weight(self.out_proj).detach().to(x.device, torch.float32)
        W_heads = W.reshape(W.shape[0], Hv, dv).permute(1, 2, 0)  # [Hv, dv, H]
        heads32 = heads.float()
        chunk = max(1, (1 << 24) // max(1, Hv * W.shape[0]))
        gram = torch.zeros(Hv, Hv, dtype=x.dtype, device=x.device)
        for start in range(0, heads.shape[0], chunk):
            c = torch.bmm(heads32[start : start + chunk].transpose(0, 1), W_heads).reshape(Hv, -1).to(x.dtype)
            gram += c @ c.T
        self._acc("head_gram", gram)

    def on_loss_gradient(self, grad: torch.Tensor) -> None:
        """Accumulate the loss-aware Grams from ``grad`` [n, H], the loss gradient at the selected tokens.

        ``grad`` is the gradient of the next-token loss with respect to the final residual stream (input
        of the final norm) at the tokens of ``loss_select``, in their order. Along the direct path a head's
        contribution ``c_h`` changes the loss by about ``g . c_h``, so removing a set ``R`` changes it by
        ``-sum_{h in R} g . c_h``, whose square summed over tokens is ``1^T F_RR 1`` with
        ``F[h, k] = sum_t (g_t . c_h(t)) (g_t . c_k(t))``; the same for value channels with the channel's
        contribution summed over heads.
        """
        import torch
        o, self._pending_o = self._pending_o, None
        if o is None or o.shape[0] == 0:
            return
        if o.shape[0] != grad.shape[0]:
            raise RuntimeError(f"{self.prefix}: {o.shape[0]} out_proj tokens kept for {grad.shape[0]} loss gradients")
        s = self.shape
        Hv, dv = s.num_value_heads, s.value_head_dim
        W = _materialized_weight(self.out_proj).detach()
        # W^T g: the gradient at the out_proj input, then times the input: per (head, channel) terms of
        # g . c_h (float32 products, like out_proj; sums over tokens in the Gram dtype)
        terms = ((grad.to(W.device, torch.float32) @ W.float()).to(o.device) * o.float()).reshape(-1, Hv, dv)
        dtype = self._gram_dtype(o.device)
        per_head = terms.sum(-1).to(dtype)  # [n, Hv]: g . c_h
        self._acc("loss_head_gram", per_head.T @ per_head)
        if self.value_dim_measure == "loss_gram":
            per_dim = terms.sum(1).to(dtype)  # [n, dv]: g . (channel e's contribution summed over heads)
            self._acc("loss_dim_gram", per_dim.T @ per_dim)
        self.loss_tokens += int(grad.shape[0])

    @staticmethod
    def _gram_dtype(device: torch.device) -> torch.dtype:
        """float64 products on CPU; float32 products (added to float64 sums) on accelerators."""
        import torch
        return torch.float64 if device.type == "cpu" else torch.float32

    # results -------------------------------------------------------------------------------------

    def payload(self) -> dict[str, Any]:
        """The layer's score payload (orders, raw scores, geometry)."""
        import torch
        if self.num_tokens == 0:
            raise ValueError(f"{self.prefix}: no calibration tokens reached this GDN layer")
        s = self.shape
        Hk, Hv, r, dk, dv = s.num_key_heads, s.num_value_heads, s.value_heads_per_group, s.key_head_dim, s.value_head_dim
        if self.method == "activation":
            n = self.num_windows
            out = (self.stats["out_abs_mean_sq"] / n).sqrt().reshape(Hv, dv)
            qk = (self.stats["qk_abs_mean_sq"] / n).sqrt().reshape(2, Hk, dk)
            lane_scores = out.sum(1).reshape(Hk, r)
            scores = {
                "key_group_scores": lane_scores.sum(1),
                "value_lane_scores": lane_scores,
                "key_dim_scores": qk.sum(0),
                "value_dim_scores": out.sum(0),
            }
            orders = {
                "key_group_order_most_important_first": _descending(scores["key_group_scores"]),
                "value_lane_order_most_important_first": _descending(scores["value_lane_scores"]),
                "key_dim_order_most_important_first": _descending(scores["key_dim_scores"]),
                "value_dim_order_most_important_first": _descending(scores["value_dim_scores"]),
            }
        else:
            N = self.num_tokens
            if self.value_dim_measure == "gram":
                C = self.stats["out_moment"]
                W = _materialized_weight(self.out_proj).detach().to(C.device, torch.float64)
                P = ((W.T @ W) * C).reshape(Hv, dv, Hv, dv)
                head_gram = P.sum((1, 3))
                dim_gram = P.sum((0, 2))
                dim_energy = dim_gram.diagonal()
                del P
            else:
                head_gram = self.stats["head_gram"]
                W = _materialized_weight(self.out_proj).detach().to(head_gram.device, torch.float64)
                if self.value_dim_measure == "energy":
                    Ce = self.stats["channel_moments"]  # [dv, Hv, Hv]
                    W_dims = W.reshape(W.shape[0], Hv, dv).permute(2, 1, 0)  # [dv, Hv, H]
                    dim_energy = (torch.bmm(W_dims, W_dims.transpose(1, 2)) * Ce).sum((1, 2))
            lane_gram = head_gram
            group_gram = head_gram.reshape(Hk, r, Hk, r).sum((1, 3))
            lane_scale = group_scale = N
            if self.needs_loss_gradient:
                if self.loss_tokens == 0:
                    raise ValueError(
                        f"{self.prefix}: no token with a next-token target reached this GDN layer (the "
                        "loss-aware Gram needs windows of at least 2 tokens)")
                loss_gram = self.stats["loss_head_gram"]
                if self.lane_measure == "loss_gram":
                    lane_gram, lane_scale = loss_gram, self.loss_tokens
                if self.key_group_measure == "loss_gram":
                    group_gram = loss_gram.reshape(Hk, r, Hk, r).sum((1, 3))
                    group_scale = self.loss_tokens
            if self.key_dim_measure == "qk_gram":
                qk = self.stats["qk_moments"]  # [2, Hk, dk, dk]
                q_energy = qk[0].diagonal(dim1=-2, dim2=-1) / N
                k_energy = qk[1].diagonal(dim1=-2, dim2=-1) / N
            else:
                q_energy, k_energy = self.stats["qk_sq"] / N  # E[q^_d^2], E[k^_d^2]: [Hk, dk] each
            key_measure = {
                "qk_rms": q_energy.sqrt() + k_energy.sqrt(),
                "qk_gram": q_energy * k_energy,
                "qk_energy": q_energy * k_energy,
                "q_energy": q_energy,
                "k_energy": k_energy,
            }[self.key_dim_measure]
            if self.value_dim_measure == "head_rms":
                # sum over heads of the RMS of each head's projected channel: |W[:, (h, e)]| * RMS(o_(h, e))
                o_sq = self.stats["out_sq"].reshape(Hv, dv) / N
                col_sq = W.pow(2).sum(0).reshape(Hv, dv)
                value_measure = (col_sq * o_sq).sqrt().sum(0)
            elif self.value_dim_measure == "loss_gram":
                value_measure = self.stats["loss_dim_gram"].diagonal() / self.loss_tokens
            else:
                value_measure = dim_energy / N
            scores = {
                "key_group_scores": group_gram.diagonal() / group_scale,
                "value_lane_scores": (lane_gram.diagonal() / lane_scale).reshape(Hk, r),
                "key_dim_scores": key_measure,
                "value_dim_scores": value_measure,
            }
            if self.key_dim_measure == "qk_gram":
                key_dims = greedy_removal_order(qk[0] * qk[1])
            else:
                key_dims = _descending(key_measure)
            if self.value_dim_measure == "gram":
                value_dims = greedy_removal_order(dim_gram)
            elif self.value_dim_measure == "loss_gram":
                value_dims = greedy_removal_order(self.stats["loss_dim_gram"])
            else:
                value_dims = _descending(value_measure)
            orders = {
                "key_group_order_most_important_first": greedy_removal_order(group_gram),
                "value_lane_order_most_important_first": greedy_lane_orders(lane_gram, Hk),
                "key_dim_order_most_important_first": key_dims,
                "value_dim_order_most_important_first": value_dims,
            }
        payload: dict[str, Any] = {k: v.cpu().tolist() for k, v in orders.items()}
        payload.update({k: v.double().cpu().tolist() for k, v in scores.items()})
        payload["shape"] = s.as_dict()
        payload["layout"] = self.layout
        payload["num_tokens"] = self.num_tokens
        if self.needs_loss_gradient:
            payload["loss_tokens"] = self.loss_tokens
        return payload


# --------------------------------------------------------------------------------------------------
# Public API


def _input_device(model: torch.nn.Module) -> torch.device:
    """Device the input ids go to: the embedding's (its accelerate execution device when offloaded)."""
    import torch
    try:
        emb = model.get_input_embeddings()
        device = emb.weight.device
    except (AttributeError, NotImplementedError):
        emb, device = None, next(model.parameters()).device
    if device.type == "meta":
        hook = getattr(emb, "_hf_hook", None)
        device = torch.device(getattr(hook, "execution_device", None) or "cpu")
    return device


def _module_device(module: torch.nn.Module) -> torch.device:
    """Device a module computes on: its accelerate execution device when it has one, else its weights'."""
    import torch
    hook_device = getattr(getattr(module, "_hf_hook", None), "execution_device", None)
    if hook_device is not None:
        return torch.device(hook_device if not isinstance(hook_device, int) else f"cuda:{hook_device}")
    for tensor in module.parameters():
        if tensor.device.type != "meta":
            return tensor.device
    return torch.device("cpu")


def _output_head(model: torch.nn.Module) -> tuple[torch.nn.Module, torch.nn.Module] | str:
    """``(final norm, lm_head)`` of a causal LM, or a string saying why they were not found.

    The final norm is the decoder's ``norm`` (``model.model.norm``; ``model.model.language_model.norm``
    for the vision-language models, found through ``get_decoder()``), the head ``get_output_embeddings()``.
    """
    import torch
    try:
        head = model.get_output_embeddings()
    except (AttributeError, NotImplementedError):
        head = None
    if head is None or getattr(head, "weight", None) is None:
        return f"{type(model).__name__} has no output embeddings (lm_head)"
    decoder = None
    for get in (lambda: model.get_decoder(), lambda: model.model, lambda: model.model.language_model):
        try:
            candidate = get()
        except (AttributeError, NotImplementedError, TypeError):
            continue
        if candidate is not None and isinstance(getattr(candidate, "norm", None), torch.nn.Module):
            decoder = candidate
            break
    if decoder is None:
        return f"{type(model).__name__} has no final norm before lm_head (decoder.norm)"
    return decoder.norm, head


def _loss_gradient(norm, head, hidden: torch.Tensor, targets: torch.Tensor, max_logits: int = 1 << 25
                   ) -> torch.Tensor:
    """Gradient of the summed next-token loss of ``lm_head(norm(hidden))`` with respect to ``hidden`` [n, H].

    Token chunks of at most ``max_logits`` logits at a time (the vocabulary may have 150K+ entries; 2^25
    float32 logits are 128 MiB, a few times that at the peak of the backward). Chunks are kept large
    because each one reads the whole ``lm_head`` weight twice: with a 248K vocabulary on CPU, 16-token
    chunks took twice as long as 64-token chunks. The cross-entropy in float32, the returned gradient
    float32 on ``hidden``'s device; only the input gradient is taken (no weight gradients).
    """
    import torch
    import torch.nn.functional as F
    vocab = head.weight.shape[0]  # known on the meta device too
    chunk = max(1, max_logits // max(1, vocab))
    head_device = _module_device(head)
    out = []
    with torch.enable_grad():
        for start in range(0, hidden.shape[0], chunk):
            x = hidden[start : start + chunk].detach().requires_grad_(True)
            logits = head(norm(x).to(head_device))
            loss = F.cross_entropy(logits.float(), targets[start : start + chunk].to(logits.device), reduction="sum")
            (grad,) = torch.autograd.grad(loss, x)
            out.append(grad.float())
    return torch.cat(out)


def _loss_positions(ids: torch.Tensor, mask: torch.Tensor | None, first_window: int, stride: int) -> torch.Tensor:
    """[B, T] bool: the tokens whose loss gradient is measured.

    A token needs a next token in its window (both unmasked). Of those, one position in ``stride`` is
    kept: position ``t`` of the window with running index ``w`` (over all calibration windows) when
    ``(t + w) % stride == 0``, so the choice depends on the windows, not on how they are batched.
    """
    import torch
    B, T = ids.shape
    valid = torch.zeros(B, T, dtype=torch.bool)
    valid[:, :-1] = True
    if mask is not None:
        m = mask.cpu()
        valid[:, :-1] &= m[:, :-1] & m[:, 1:]
    pos = torch.arange(T)[None, :] + (first_window + torch.arange(B))[:, None]
    return valid & (pos % stride == 0)


def _measure_loss_gradient(head, hidden, ids, select, scorers) -> None:
    """The loss gradient at the selected tokens of a batch, handed to every layer scorer."""
    import torch
    if hidden is None or tuple(hidden.shape[:2]) != tuple(ids.shape):
        found = None if hidden is None else list(hidden.shape)
        raise RuntimeError(f"the final norm saw hidden states {found}, expected [batch, tokens, hidden] "
                           f"for input_ids {list(ids.shape)}")
    targets = torch.zeros_like(ids)
    targets[:, :-1] = ids[:, 1:]
    flat = select.reshape(-1)
    if not bool(flat.any()):  # e.g. one-token windows: nothing to measure in this batch
        for scorer in scorers:
            scorer.on_loss_gradient(hidden.new_zeros(0, hidden.shape[-1], dtype=torch.float32))
        return
    chosen = hidden.detach().reshape(-1, hidden.shape[-1])[flat.to(hidden.device)]
    grad = _loss_gradient(head[0], head[1], chosen, targets.reshape(-1)[flat])
    for scorer in scorers:
        scorer.on_loss_gradient(grad)


def _unpack_batch(batch: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``input_ids`` [B, T] and an optional ``attention_mask`` [B, T] from a tensor or a mapping."""
    import torch
    if isinstance(batch, Mapping):
        ids, mask = batch.get("input_ids"), batch.get("attention_mask")
    else:
        ids, mask = batch, None
    ids = torch.as_tensor(ids)
    if ids.dim() == 1:
        ids = ids[None]
    if ids.dim() != 2 or ids.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"a calibration batch must be integer input_ids [B, T], got {ids.dtype} {list(ids.shape)}")
    if mask is not None:
        mask = torch.as_tensor(mask).reshape(ids.shape).bool()
        if bool(mask.all()):
            mask = None
    return ids.long(), mask


def score_model(
    model: torch.nn.Module,
    batches: Iterable[Any],
    *,
    method: str = "projection",
    progress: bool = True,
    seed: int = 0,
    total: int | None = None,
    key_dim_measure: str = "qk_rms",
    value_dim_measure: str = "head_rms",
    lane_measure: str = "loss_gram",
    key_group_measure: str = "energy_gram",
    loss_token_stride: int = 8,
) -> dict[str, Any]:
    """Score every GDN layer of ``model`` on calibration ``batches``; returns the scores-file dict.

    Args:
        model: a transformers model with GDN layers (Qwen3.5 text/VL, Qwen3.5-MoE, Qwen3-Next,
            Qwen4-exp, OLMo-hybrid), possibly dispatched over devices by accelerate.
        batches: an iterable of ``input_ids`` [B, T] tensors, or mappings with ``input_ids`` and an
            optional ``attention_mask`` (masked tokens are left out of every statistic).
        method: ``"projection"`` (default), ``"activation"`` or ``"random"`` (see the module docs).
        progress: show a tqdm progress bar over the batches.
        seed: seed of the ``random`` method (recorded for every method).
        total: number of batches for the progress bar (default ``len(batches)`` when available).
        key_dim_measure: ``projection`` only, how key channels are ordered: ``"qk_rms"`` (default; sort by
            ``RMS(q^_d) + RMS(k^_d)`` of the l2-normalised q and k), ``"qk_gram"`` (greedy on ``Cq * Ck``,
            the energy of the q^.k^ products), ``"qk_energy"`` (sort by ``E[q^_d^2] E[k^_d^2]``),
            ``"q_energy"`` or ``"k_energy"``.
        value_dim_measure: ``projection`` only, how value channels are ordered: ``"head_rms"`` (default;
            sort by ``sum_h RMS(W[:, (h, e)] o_(h, e))``), ``"energy"`` (sort by the energy of the channel's
            projected contribution summed over heads, ``sum_t |sum_h W[:, (h, e)] o_(h, e)|^2``) or
            ``"gram"`` (greedy on the full value-channel Gram; needs the full ``[Hv*dv]^2`` second moment
            of the ``out_proj`` input per layer, ``(Hv*dv)^2`` per token and as much memory) or
            ``"loss_gram"`` (greedy on the loss-aware channel Gram ``sum_t (g_t . s_e)(g_t . s_f)``, ``s_e``
            channel ``e``'s contribution summed over heads).
        lane_measure: ``projection`` only, the Gram behind the lane orders: ``"loss_gram"`` (default; the
            loss-aware Gram, see the module docs) or ``"energy_gram"`` (the contribution Gram).
        key_group_measure: ``projection`` only, the same choice for key groups (default ``"energy_gram"``).
        loss_token_stride: measure the loss gradient on one token in this many (default 8); the cost is
            two ``lm_head``-sized products per measured token, the memory each layer's ``out_proj`` input at
            the measured tokens of one batch.

    Returns:
        ``{"format", "version", "method", "num_tokens", "seed", "layers": {prefix: payload}}``, with
        ``"measures"`` (the measures used, after any fallback) for ``projection``.

    Raises:
        ValueError: unknown method or measure, a model without GDN layers, or no calibration tokens.
    """
    import torch
    from .gated_delta_net import GDNPermutation, GDNShape
    from tqdm.auto import tqdm

    if method not in METHODS:
        raise ValueError(f"unknown scoring method {method!r}; expected one of {list(METHODS)}")
    if key_dim_measure not in _KEY_DIM_MEASURES:
        raise ValueError(f"unknown key_dim_measure {key_dim_measure!r}; expected one of {list(_KEY_DIM_MEASURES)}")
    if value_dim_measure not in _VALUE_DIM_MEASURES:
        raise ValueError(f"unknown value_dim_measure {value_dim_measure!r}; expected one of {list(_VALUE_DIM_MEASURES)}")
    for name, value in (("lane_measure", lane_measure), ("key_group_measure", key_group_measure)):
        if value not in _HEAD_MEASURES:
            raise ValueError(f"unknown {name} {value!r}; expected one of {list(_HEAD_MEASURES)}")
    if int(loss_token_stride) < 1:
        raise ValueError(f"loss_token_stride must be >= 1, got {loss_token_stride}")
    modules = find_gdn_modules(model)
    if not modules:
        raise ValueError(f"{type(model).__name__} has no GatedDeltaNet layers to score")
    result: dict[str, Any] = {
        "format": SCORES_FORMAT,
        "version": SCORES_VERSION,
        "method": method,
        "num_tokens": 0,
        "seed": int(seed),
        "score_kind": _SCORE_KIND[method],
        "layers": {},
    }
    if method == "random":
        generator = torch.Generator().manual_seed(int(seed))
        for prefix, module in modules:
            shape = GDNShape.from_module(module)
            perm = GDNPermutation.random(shape, generator=generator)
            payload: dict[str, Any] = perm.to_score_payload()
            for key, order in zip(
                ("key_group_scores", "value_lane_scores", "key_dim_scores", "value_dim_scores"),
                (perm.key_groups, perm.value_lanes, perm.key_dim, perm.value_dim),
            ):
                n = order.shape[-1]
                payload[key] = (n - 1 - order.argsort(dim=-1)).double().tolist()
            payload["shape"] = shape.as_dict()
            payload["num_tokens"] = 0
            result["layers"][prefix] = payload
        return result

    head = None
    if method == "projection" and "loss_gram" in (lane_measure, key_group_measure, value_dim_measure):
        head = _output_head(model)
        if isinstance(head, str):
            warnings.warn(
                f"gdnprune score: {head}, so the loss-aware Gram cannot be computed; ordering with the energy "
                "Gram (lanes, key groups) and head_rms (value channels) instead", RuntimeWarning, stacklevel=2)
            lane_measure = "energy_gram" if lane_measure == "loss_gram" else lane_measure
            key_group_measure = "energy_gram" if key_group_measure == "loss_gram" else key_group_measure
            value_dim_measure = "head_rms" if value_dim_measure == "loss_gram" else value_dim_measure
            head = None
    if method == "projection":
        result["measures"] = {
            "key_group": key_group_measure, "value_lane": lane_measure, "key_dim": key_dim_measure,
            "value_dim": value_dim_measure,
        }
        if head is not None:
            result["measures"]["loss_token_stride"] = int(loss_token_stride)
    scorers = [_LayerScorer(p, m, method, key_dim_measure, value_dim_measure, lane_measure, key_group_measure)
               for p, m in modules]
    if total is None and hasattr(batches, "__len__"):
        total = len(batches)  # type: ignore[arg-type]
    extra = {"use_cache": False}
    try:
        if "logits_to_keep" in inspect.signature(model.forward).parameters:
            extra["logits_to_keep"] = 1  # no need for the full vocabulary projection
    except (TypeError, ValueError):  # pragma: no cover
        pass
    device = _input_device(model)
    handles = []
    final: dict[str, torch.Tensor] = {}
    windows_seen = 0
    was_training = model.training
    model.eval()
    try:
        for scorer in scorers:
            handles.extend(scorer.attach())
        if head is not None:
            handles.append(head[0].register_forward_pre_hook(lambda module, args: final.__setitem__("hidden", args[0])))
        with torch.no_grad():
            for batch in tqdm(batches, total=total, disable=not progress, desc="scoring", unit="batch"):
                ids, mask = _unpack_batch(batch)
                select = None if head is None else _loss_positions(ids, mask, windows_seen, int(loss_token_stride))
                windows_seen += ids.shape[0]
                for scorer in scorers:
                    scorer.token_mask = mask
                    scorer.loss_select = select
                kwargs = dict(extra)
                if mask is not None:
                    kwargs["attention_mask"] = mask.to(device).long()
                final.clear()
                model(input_ids=ids.to(device), **kwargs)
                if head is not None:
                    _measure_loss_gradient(head, final.pop("hidden", None), ids, select, scorers)
    finally:
        for handle in handles:
            handle.remove()
        model.train(was_training)
    for scorer in scorers:
        result["layers"][scorer.prefix] = scorer.payload()
    result["num_tokens"] = scorers[0].num_tokens
    return result


def scores_to_permutations(scores: Mapping[str, Any]) -> dict[str, GDNPermutation]:
    """``{prefix: GDNPermutation}`` from a scores-file dict (geometry read from each payload's ``shape``)."""
    from .gated_delta_net import GDNPermutation, GDNShape
    out = {}
    for prefix, payload in _check_scores(scores)["layers"].items():
        out[prefix] = GDNPermutation.from_score_payload(payload, GDNShape(**payload["shape"]))
    return out


def _check_scores(scores: Any, source: str = "scores") -> Mapping[str, Any]:
    if not isinstance(scores, Mapping) or scores.get("format") != SCORES_FORMAT:
        found = scores.get("format") if isinstance(scores, Mapping) else type(scores).__name__
        raise ValueError(f"{source}: not a gdnprune scores file (format {found!r}, expected {SCORES_FORMAT!r})")
    if scores.get("version") != SCORES_VERSION:
        raise ValueError(f"{source}: unsupported scores version {scores.get('version')!r}, expected {SCORES_VERSION}")
    layers = scores.get("layers")
    if not isinstance(layers, Mapping) or not layers:
        raise ValueError(f"{source}: no \"layers\" in the scores file")
    for prefix, payload in layers.items():
        missing = [k for k in (*ORDER_KEYS, "shape") if k not in payload]
        if missing:
            raise ValueError(f"{source}: layer {prefix!r} lacks {missing}")
    return scores


def save_scores(scores: Mapping[str, Any], path: str | Path) -> Path:
    """Write a scores dict as JSON (through a temporary file renamed into place). Returns the path."""
    path = Path(path)
    _check_scores(scores)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(scores, f, indent=1)
            f.write("\n")
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return path


def load_scores(path: str | Path) -> dict[str, Any]:
    """Read a scores file written by :func:`save_scores` / ``gdnprune score`` and check that it is one.

    Reading and the generic checks are :func:`gdnprune.checkpoint.load_scores` (what ``sort`` accepts);
    this adds the scores-file format, version and per-layer keys.
    """
    from .checkpoint import load_scores as read_scores

    return dict(_check_scores(read_scores(path), str(path)))


# --------------------------------------------------------------------------------------------------
# Command line


def _map_to_checkpoint(prefixes: list[str], model_dir: Path) -> dict[str, str]:
    """Map the model's module prefixes to the GDN layer prefixes of the checkpoint's tensors (they differ when
    a vision-language checkpoint is loaded as a text model). Unchanged when the folder has no safetensors."""
    from .checkpoint import CheckpointError, find_gdn_layers, matching_prefixes, open_checkpoint

    try:
        stored = [layer.prefix for layer in find_gdn_layers(open_checkpoint(model_dir))[0]]
    except CheckpointError:
        return {p: p for p in prefixes}
    mapping = {}
    for prefix in prefixes:
        candidates = matching_prefixes(prefix, stored)
        if len(candidates) != 1:
            raise ValueError(
                f"cannot match the model's GDN layer {prefix!r} to the checkpoint's tensor names "
                f"(candidates {sorted(candidates)})"
            )
        mapping[prefix] = candidates[0]
    return mapping


def _load_model(model_dir: Path, *, dtype: str, device: str | None, device_map: str | None):
    """Load a causal LM from ``model_dir`` for scoring (text part only for vision-language checkpoints)."""
    import torch
    import transformers

    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    kwargs: dict[str, Any] = {"dtype": torch_dtype}
    if device_map is not None:
        kwargs["device_map"] = device_map
    try:
        model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, **kwargs)
    except ValueError as first:
        config = transformers.AutoConfig.from_pretrained(model_dir)
        classes = [getattr(transformers, a, None) for a in (getattr(config, "architectures", None) or [])]
        classes = [c for c in classes if c is not None]
        if not classes:
            raise ValueError(f"{model_dir}: cannot load a causal language model ({first})") from None
        model = classes[0].from_pretrained(model_dir, **kwargs)
    if device_map is None:
        model.to(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    return model.eval()


def score_checkpoint(
    model_dir: str | Path,
    data: str | Path,
    *,
    method: str = "projection",
    num_samples: int | None = 128,
    seq_len: int = 512,
    batch_size: int = 4,
    device: str | None = None,
    dtype: str = "float32",
    device_map: str | None = None,
    seed: int = 0,
    progress: bool = True,
) -> dict[str, Any]:
    """Load a model folder, score it on the calibration file ``data`` and return the scores-file dict.

    The data file (UTF-8 text or JSONL with a ``"text"`` field) is tokenised with the folder's tokenizer
    and packed into ``num_samples`` windows of ``seq_len`` tokens; layer prefixes are those of the
    checkpoint's tensors (what ``gdnprune sort`` expects). Behind ``gdnprune score`` and ``gdnprune prune``.
    """
    from transformers import AutoTokenizer

    from .calibration import calibration_windows, iter_batches

    model_dir = Path(model_dir)
    if not (model_dir / "config.json").is_file():
        raise ValueError(f"{model_dir}: not a model folder (no config.json)")
    if batch_size < 1:
        raise ValueError(f"--batch-size must be >= 1, got {batch_size}")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    windows = calibration_windows(data, tokenizer, seq_len=seq_len, num_samples=num_samples)
    model = _load_model(model_dir, dtype=dtype, device=device, device_map=device_map)
    batches = list(iter_batches(windows, batch_size))
    scores = score_model(model, batches, method=method, seed=seed, progress=progress)
    mapping = _map_to_checkpoint(list(scores["layers"]), model_dir)
    scores["layers"] = {mapping[p]: payload for p, payload in scores["layers"].items()}
    scores["model"] = str(model_dir)
    scores["calibration"] = {
        "data": str(data),
        "num_samples": int(windows.shape[0]),
        "seq_len": int(seq_len),
        "batch_size": int(batch_size),
        "dtype": dtype,
    }
    return scores


def _cmd_score(args) -> int:
    scores = score_checkpoint(
        args.model_dir, args.data, method=args.method, num_samples=args.num_samples, seq_len=args.seq_len,
        batch_size=args.batch_size, device=args.device, dtype=args.dtype, device_map=args.device_map,
        seed=args.seed, progress=not args.quiet,
    )
    path = save_scores(scores, args.output)
    print(
        f"gdnprune score: {len(scores['layers'])} GDN layers scored with {args.method!r} on "
        f"{scores['num_tokens']} tokens -> {path}"
    )
    return 0


def add_calibration_arguments(p) -> None:
    """The calibration options shared by ``gdnprune score`` and ``gdnprune prune``."""
    p.add_argument("--data", required=True, metavar="FILE",
                   help="calibration text: a UTF-8 text file, or JSONL with a \"text\" field per line")
    p.add_argument("--method", choices=METHODS, default="projection",
                   help="projection (default): output-projection Gram + greedy removal; activation: "
                        "Minitron-style magnitudes; random: seeded random orders")
    p.add_argument("--num-samples", type=int, default=128, help="calibration windows (default 128)")
    p.add_argument("--seq-len", type=int, default=512, help="tokens per window (default 512)")
    p.add_argument("--batch-size", type=int, default=4, help="windows per forward pass (default 4)")
    p.add_argument("--device", default=None, help="cpu or cuda[:N] (default: cuda when available, else cpu)")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                   help="weights dtype for the forward passes (default float32)")
    p.add_argument("--device-map", choices=("auto", "balanced", "balanced_low_0", "sequential"), default=None,
                   help="spread the model over the GPUs and CPU of this machine through accelerate")
    p.add_argument("--seed", type=int, default=0, help="seed of --method random (default 0)")


def add_commands(subparsers) -> None:
    """Register the ``score`` subcommand on an argparse subparsers object."""
    p = subparsers.add_parser(
        "score",
        help="measure the importance of every GDN head and channel on calibration text",
        description=(
            "Run calibration text through the model with hooks on every GatedDeltaNet layer and write a "
            "scores file (importance orders per layer, most important first) for `gdnprune sort`."
        ),
    )
    p.add_argument("model_dir", metavar="MODEL_DIR", help="Hugging Face model folder (config, weights, tokenizer)")
    p.add_argument("--output", required=True, metavar="SCORES.json", help="scores file to write")
    add_calibration_arguments(p)
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=_cmd_score)
