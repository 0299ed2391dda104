"""Importance of routed experts and of whole decoder layers (issue 23), from the calibration forwards.

Experts (:class:`ExpertScorer`, a hook on the router, which gives every token's logits, and one on the
experts module, which receives every token's chosen experts and their gate weights): for expert ``e`` and
the tokens ``t`` routed to it, ``g_e(t)`` the gate weight and ``y_e(t)`` the expert's output, the
statistics are ``count_e`` (how often the router picks ``e``: the frequency baseline), ``sum_t g_e(t)
||y_e(t)||`` (REAP, Cerebras 2025: router-weighted expert activation pruning, ranks by its mean over routed
tokens, ``/ count_e``) and the **removal error** ``sum_t ||o'_e(t) - o(t)||^2``: ``o(t)`` the routed output
``sum_j g_j(t) y_j(t)`` and ``o'_e(t)`` what it becomes with ``e`` removed alone — the router then picks its
next choice ``r(t)`` (the (k+1)-th) and, as the cut router does, takes the softmax over the kept experts
(renormalised over the chosen ones when the router renormalises, detected from the weights summing to 1).
The removal error measures the layer's output change directly: it counts how often an expert is used, how
much it writes and how well the next choice stands in for it. The default order (``projection``) ranks by
the removal error (per token) times the frequency: the removal error sees one expert removed alone, and a
deep cut also removes its stand-ins, where the experts most tokens land on matter more (chosen on two
trained MoEs, BENCHMARKS.md); ``activation`` ranks by frequency; an expert never routed scores 0. All are sums over tokens
(batches, processes and partial files add up). The hook recomputes each chosen expert's output and the
next choice's (the module does not expose them): about 1 + (k+1)/k times the expert compute of a plain
pass. With ``expert_sample_tokens`` (opt-in) the hook also keeps a sample of routed tokens (router logits,
the Gram of their first experts' outputs) for the measured greedy removal (:mod:`.expert_greedy`; the
``greedy`` and ``greedy_frequency`` scores, not the default order). Orders and scores go into the scores
file under the MoE layer's prefix (``layers.N.mlp``), which ``sort`` applies (:func:`expert_payload`). Which order wins on trained MoEs: BENCHMARKS.md, "MoE experts".

Layers (:func:`block_influence`, ShortGPT's block influence): ``1 - cos(x, f(x))`` between a decoder layer's
input and output hidden states, averaged over tokens; a layer that barely turns the residual stream is
cheap to remove. A one-pass proxy of the removal sensitivity, not a measurement.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from ..model.forwards import decoder_layers, hidden_argument, input_device, unpack_batch
from ..model.subblock_geometry import orders_to_payload
from .expert_greedy import greedy_expert_removal

__all__ = ["ExpertScorer", "expert_payload", "block_influence", "EXPERT_MEASURES", "SAMPLE_TOKENS"]

#: the expert measure of each scoring method: ``projection`` (the default) -> the removal error x frequency,
#: ``activation`` -> frequency (REAP and the removal error alone are in every payload)
EXPERT_MEASURES = {"projection": "removal_frequency", "activation": "frequency"}
#: the routed tokens the greedy removal is measured on, per MoE layer, when asked (``expert_sample_tokens``
#: of ``score_model``; the benchmarks' size): ``SAMPLE_PER_WINDOW`` evenly spaced tokens of each of the first
#: calibration windows (by global index)
SAMPLE_TOKENS, SAMPLE_PER_WINDOW = 4096, 64
#: a sampled token keeps the Gram of its first ``SAMPLE_RANKS`` experts by logit (all when fewer)
SAMPLE_RANKS = 32


class ExpertScorer:
    """The hook and float64 statistics of the routed experts of one MoE layer (a loaded model's
    ``mlp.experts`` module: fused ``gate_up_proj`` [E, 2I, H], ``down_proj`` [E, H, I], ``act_fn``).

    Statistics (sums over tokens, so that batches and processes add up): ``num_tokens``, ``count`` [E],
    ``weighted_norm`` [E] (sum of gate weight x output norm over the tokens routed to each expert),
    ``removal_error`` [E] (sum of the squared change of the routed output were each expert removed alone);
    with ``projection``, the token sample of the greedy removal (:mod:`.expert_greedy`): ``sample_used`` [N],
    ``sample_logits`` [N, E], ``sample_ranks`` [N, m], ``sample_gram`` [N, m, m], ``sample_weight_sum`` [N]
    (each slot written by one token, by its global window index, so shares add up to the whole sample).
    ``sample_tokens``: N (0, the default: no sample, no greedy order; the benchmarks use :data:`SAMPLE_TOKENS`).
    """

    def __init__(
        self,
        block: Any,
        module: torch.nn.Module,
        method: str = "projection",
        sample_tokens: int = 0,
    ) -> None:
        experts = getattr(module, "experts", None)
        if experts is None or not hasattr(experts, "gate_up_proj") or not hasattr(experts, "down_proj"):
            raise ValueError(
                f"{block.prefix}: expected an MoE module with fused experts (experts.gate_up_proj, "
                f"experts.down_proj), found {type(module).__name__}"
            )
        self.block, self.method, self.experts = block, method, experts
        n = block.shape.num_experts
        self.stats: dict[str, torch.Tensor] = {
            "num_tokens": torch.zeros((), dtype=torch.int64),
            "count": torch.zeros(n, dtype=torch.float64),
            "weighted_norm": torch.zeros(n, dtype=torch.float64),
            "removal_error": torch.zeros(n, dtype=torch.float64),
        }
        router = getattr(module, "gate", None)
        if not isinstance(router, torch.nn.Module):
            raise ValueError(f"{block.prefix}: expected the MoE module's router as .gate, found none")
        self.router: torch.nn.Module = router
        self.router_logits: torch.Tensor | None = None
        self.token_mask: torch.Tensor | None = None
        #: (global index of the batch's first window, batch size, window length), set by the passes
        self.windows: tuple[int, int, int] | None = None
        if method == "projection" and sample_tokens > 0:
            m = min(n, SAMPLE_RANKS)
            self.stats.update(
                {
                    "sample_used": torch.zeros(sample_tokens, dtype=torch.int64),
                    "sample_logits": torch.zeros(sample_tokens, n, dtype=torch.float32),
                    "sample_ranks": torch.zeros(sample_tokens, m, dtype=torch.int64),
                    "sample_gram": torch.zeros(sample_tokens, m, m, dtype=torch.float32),
                    "sample_weight_sum": torch.zeros(sample_tokens, dtype=torch.float32),
                }
            )

    def attach(self) -> list[Any]:
        return [
            self.router.register_forward_hook(self._on_route),
            self.experts.register_forward_hook(self._on_forward),
        ]

    def _on_route(self, module: Any, args: tuple, output: Any) -> None:
        """Keep the router's logits (its first output) for the experts call that follows."""
        self.router_logits = output[0] if isinstance(output, tuple) else None

    @torch.no_grad()
    def _on_forward(self, module: Any, args: tuple, output: Any) -> None:
        hidden, index, weights = args[:3]
        logits, self.router_logits = self.router_logits, None
        if logits is not None and logits.shape[0] != hidden.shape[0]:
            logits = None
        if logits is not None and "sample_used" in self.stats:
            self._add_sample(module, hidden, logits, weights)
        if self.token_mask is not None:  # padding tokens are left out (the module sees tokens flattened)
            keep = self.token_mask.to(hidden.device).reshape(-1)
            if keep.numel() == hidden.shape[0]:
                hidden, index, weights = hidden[keep], index[keep], weights[keep]
                logits = None if logits is None else logits[keep.to(logits.device)]
        self.stats["num_tokens"] += hidden.shape[0]
        n = self.stats["count"].numel()
        chosen = torch.zeros(*index.shape, hidden.shape[-1], dtype=torch.float32, device=hidden.device)
        valid = (index >= 0) & (index < n)
        token, slot = torch.where(valid)
        experts = index[token, slot]
        y = expert_outputs(module, hidden[token], experts)
        chosen[token, slot] = y.float()
        g = weights[token, slot].to(torch.float64)
        self.stats["count"] += torch.bincount(experts.cpu(), minlength=n).to(torch.float64)
        norms = (g * y.to(torch.float64).norm(dim=-1)).cpu()
        self.stats["weighted_norm"].index_add_(0, experts.cpu(), norms)
        if logits is None:
            raise ValueError(
                f"{self.block.prefix}: the router's logits did not reach the experts (expected the router "
                f"{type(self.router).__name__} to return (logits, weights, index) before the experts run)"
            )
        if n > index.shape[1] and hidden.shape[0]:
            self._add_removal_error(module, logits, index, weights, chosen, hidden)

    def _sample_tokens(self, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The sampled tokens of this batch: their slots in the sample and their row in the flattened
        batch (``SAMPLE_PER_WINDOW`` evenly spaced positions per window, slot ``window * per + i``; masked
        tokens and slots past the sample's size are left out)."""
        empty = torch.zeros(0, dtype=torch.long)
        if self.windows is None or self.windows[1] * self.windows[2] != num_tokens:
            return empty, empty
        first, batch, length = self.windows
        per = min(SAMPLE_PER_WINDOW, length)
        i = torch.arange(per)
        slot = ((first + torch.arange(batch))[:, None] * SAMPLE_PER_WINDOW + i).reshape(-1)
        row = (torch.arange(batch)[:, None] * length + (i * length) // per).reshape(-1)
        take = slot < self.stats["sample_used"].numel()
        if self.token_mask is not None and self.token_mask.numel() == num_tokens:
            take &= self.token_mask.reshape(-1).bool().cpu()[row]
        return slot[take], row[take]

    def _add_sample(
        self, module: Any, hidden: torch.Tensor, logits: torch.Tensor, weights: torch.Tensor
    ) -> None:
        """Keep, for the sampled tokens, the router logits, the first experts by logit, the Gram of their
        outputs and the chosen weights' sum (1 when the router renormalises): the greedy's data."""
        slot, row = self._sample_tokens(hidden.shape[0])
        if not slot.numel():
            return
        x = hidden[row.to(hidden.device)]
        lg = logits[row.to(logits.device)].float()
        ranks = torch.topk(lg, self.stats["sample_ranks"].shape[1], dim=-1).indices
        token = torch.arange(ranks.shape[0], device=x.device).repeat_interleave(ranks.shape[1])
        y = expert_outputs(module, x[token], ranks.reshape(-1)).to(torch.float64).view(*ranks.shape, -1)
        self.stats["sample_used"][slot] = 1
        self.stats["sample_logits"][slot] = lg.cpu()
        self.stats["sample_ranks"][slot] = ranks.cpu()
        self.stats["sample_gram"][slot] = (y @ y.transpose(1, 2)).float().cpu()
        self.stats["sample_weight_sum"][slot] = weights[row.to(weights.device)].float().sum(-1).cpu()

    def _add_removal_error(
        self,
        module: Any,
        logits: torch.Tensor,
        index: torch.Tensor,
        weights: torch.Tensor,
        chosen: torch.Tensor,
        hidden: torch.Tensor,
    ) -> None:
        """Add, per expert, the squared change of the experts' output over its tokens were it removed alone:
        the router then picks its next choice ``r`` (the (k+1)-th), with the weights the cut router gives
        (the softmax over the kept experts, renormalised over the chosen if the router renormalises)."""
        n, k = self.stats["count"].numel(), index.shape[1]
        probs = torch.softmax(logits.to(hidden.device).float(), dim=-1)
        q = probs.gather(1, index)  # [T, k]
        nxt = torch.topk(probs, k + 1, dim=-1)
        q_next, e_next = nxt.values[:, k], nxt.indices[:, k]
        y_next = expert_outputs(module, hidden, e_next).float()
        w = weights.float()
        old = (w[..., None] * chosen).sum(1)  # [T, H]
        normalized = bool(torch.allclose(w.sum(-1), torch.ones_like(w[:, 0]), atol=1e-3))
        total = (q[..., None] * chosen).sum(1)  # sum_j q_j y_j
        # removing slot s: (total - q_s y_s + q_r y_r) / (Z - q_s + q_r) renormalised, else / (1 - q_s)
        z = q.sum(-1, keepdim=True) - q + q_next[:, None] if normalized else 1 - q
        new = (total[:, None] - q[..., None] * chosen + (q_next[:, None, None] * y_next[:, None])) / z[
            ..., None
        ].clamp_min(1e-30)
        err = (new - old[:, None]).to(torch.float64).pow(2).sum(-1)  # [T, k]
        valid = (index >= 0) & (index < n)
        self.stats["removal_error"].index_add_(0, index[valid].cpu(), err[valid].cpu())


def expert_outputs(experts: Any, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Each row of ``x`` through its routed expert ``ids[row]``: the SwiGLU of the fused ``gate_up_proj`` /
    ``down_proj``, for every expert at once. The rows are sorted by expert and each expert's run multiplied by
    its own weights: one grouped matrix product per projection where torch has one for the device and dtype
    (``torch.nn.functional.grouped_mm``), else a loop over the experts' runs (a slice each, never a search of
    all rows per expert: the work stays linear in the rows however many experts there are)."""
    if not ids.numel():
        return x.new_zeros(x.shape)
    order = torch.argsort(ids, stable=True)
    counts = torch.bincount(ids, minlength=experts.gate_up_proj.shape[0])
    xs = x[order]
    out = _grouped_outputs(experts, xs, counts)
    if out is None:
        out, start = torch.empty_like(xs), 0
        for e, count in enumerate(counts.tolist()):
            if count:
                rows = xs[start : start + count]
                gate, up = torch.nn.functional.linear(rows, experts.gate_up_proj[e]).chunk(2, dim=-1)
                out[start : start + count] = torch.nn.functional.linear(
                    experts.act_fn(gate) * up, experts.down_proj[e]
                )
                start += count
    y = torch.empty_like(out)
    y[order] = out
    return y


def _grouped_outputs(experts: Any, xs: torch.Tensor, counts: torch.Tensor) -> torch.Tensor | None:
    """:func:`expert_outputs` of rows sorted by expert, as two grouped matrix products; None where torch has
    no grouped kernel for the device, dtype or memory alignment."""
    grouped = getattr(torch.nn.functional, "grouped_mm", None)
    if grouped is None or xs.dtype not in (torch.float32, torch.bfloat16):
        return None
    offsets = torch.cumsum(counts, 0).to(torch.int32)
    try:
        gate, up = grouped(xs, experts.gate_up_proj.transpose(1, 2), offs=offsets).chunk(2, dim=-1)
        return grouped(experts.act_fn(gate) * up, experts.down_proj.transpose(1, 2), offs=offsets)
    except (RuntimeError, NotImplementedError):
        return None


def expert_payload(block: Any, stats: dict[str, torch.Tensor], method: str) -> dict[str, Any]:
    """The score payload of one MoE layer's experts: the order of the method's measure (removal error x
    frequency for ``projection``, frequency for ``activation``; ties keep the lower expert first) and every
    raw score (``expert_reap``, ``expert_frequency``, ``expert_removal``, ``expert_removal_frequency``; with a
    token sample the greedy orders as keep ranks, ``expert_greedy`` and ``expert_greedy_frequency``, and
    their ``..._error``)."""
    count, weighted = stats["count"].to(torch.float64), stats["weighted_norm"].to(torch.float64)
    tokens = max(int(stats["num_tokens"]), 1)
    scores = {
        "reap": torch.where(count > 0, weighted / count.clamp_min(1), torch.zeros_like(weighted)),
        "frequency": count / tokens,
    }
    if "removal_error" in stats:  # absent from the scores of older versions' partial files
        scores["removal"] = stats["removal_error"].to(torch.float64) / tokens
        scores["removal_frequency"] = scores["removal"] * scores["frequency"]
    extra: dict[str, Any] = {}
    if "sample_used" in stats and int(stats["sample_used"].sum()) > 0:
        used = stats["sample_used"] > 0
        normalized = bool(((stats["sample_weight_sum"][used].double() - 1).abs() <= 1e-3).all())
        sample = (stats["sample_logits"][used], stats["sample_ranks"][used], stats["sample_gram"][used])
        k = block.shape.num_experts_per_tok
        # greedy: each step the least increase; greedy_frequency: the least increase x frequency
        for name, scale in (("greedy", None), ("greedy_frequency", scores["frequency"])):
            order, error = greedy_expert_removal(*sample, k, normalized, scale)
            scores[name] = _keep_rank(order)
            extra[f"expert_{name}_error"] = error.tolist()
        extra["expert_greedy_tokens"] = int(used.sum())
    measure = EXPERT_MEASURES.get(method, "reap")
    if measure not in scores:
        measure = "removal_frequency" if "removal_frequency" in scores else "reap"
    order = torch.argsort(-scores[measure], stable=True)
    return {
        "kind": block.kind,
        "layout": block.layout,
        "shape": block.shape.as_dict(),
        "method": method,
        "expert_measure": measure,
        **orders_to_payload({"experts": order.numpy()}),
        "expert_scores": scores[measure].tolist(),
        **{f"expert_{name}": value.tolist() for name, value in scores.items()},
        **extra,
        "num_tokens": int(stats["num_tokens"]),
    }


def _keep_rank(order: torch.Tensor) -> torch.Tensor:
    """A keep order as a score whose descending order it is: ``n`` for the first kept down to 1."""
    n = order.numel()
    return torch.zeros(n, dtype=torch.float64).index_put_((order,), torch.arange(n, 0, -1).double())


@torch.no_grad()
def block_influence(model: torch.nn.Module, batches: Iterable[Any]) -> dict[int, float]:
    """``{layer index: mean over tokens of 1 - cos(input, output)}`` of every decoder layer (block influence),
    from one pass over ``batches`` (token ids, or ``(ids, mask)``; masked tokens are left out)."""
    layers = list(decoder_layers(model))
    sums, counts = [0.0] * len(layers), [0] * len(layers)
    state: dict[str, Any] = {}

    def hook_for(i):
        def hook(module, args, kwargs, output):
            x = hidden_argument(args, kwargs)
            y = output[0] if isinstance(output, tuple) else output
            x, y = x.to(torch.float64), y.to(torch.float64)
            cos = torch.nn.functional.cosine_similarity(x, y, dim=-1)
            mask = state.get("mask")
            if mask is not None:
                cos = cos[mask.to(cos.device)]
            sums[i] += float((1 - cos).sum())
            counts[i] += cos.numel()

        return hook

    handles = [layer.register_forward_hook(hook_for(i), with_kwargs=True) for i, layer in enumerate(layers)]
    device = input_device(model)
    try:
        for batch in batches:
            ids, mask = unpack_batch(batch)
            state["mask"] = None if mask is None else mask.bool()
            kwargs: dict[str, Any] = {"use_cache": False}
            if mask is not None:
                kwargs["attention_mask"] = mask.to(device).long()
            model(input_ids=ids.to(device), **kwargs)
    finally:
        for h in handles:
            h.remove()
    return {i: sums[i] / max(counts[i], 1) for i in range(len(layers))}
