"""Importance of MLP channels and attention heads (issue 21): hooks, float64 statistics, orders.

A sub-block's output is a sum of per-unit contributions through its output projection: MLP channel ``i``
gives ``c_i(t) = W[:, i] a_i(t)`` (``a`` the ``down_proj`` input), attention query head ``h`` gives
``c_h(t) = W[:, h*hd:(h+1)*hd] o_h(t)`` (``o`` the ``o_proj`` input, gate applied). Removing a set ``R``
of units changes the output by ``sum_{i in R} c_i``, whose energy over the calibration tokens is
``1^T G_RR 1`` with the Gram ``G_ij = sum_t c_i(t) . c_j(t)``; for the projection method (the default)
:class:`BlockScorer` accumulates ``G`` (``W^T W`` folded in per batch, so the statistics of several
batches or processes add up) and orders the units by the greedy conditional removal of
:mod:`gdnprune.scoring.orders`, as for GDN's value heads: MLP channels over the whole Gram; attention
key-value groups over the group Gram (the sum of their heads' blocks), query heads inside their group in
rounds (:func:`~gdnprune.scoring.orders.greedy_lane_orders`), which targets nested cuts to ``r'`` heads
per group. The activation baseline (Minitron) ranks by the mean ``|a_i|`` of a channel and the mean
``||o_h||`` of a head's output (a group by the sum over its heads).

Not yet wired into :func:`gdnprune.scoring.score_model` and the scores file: the payloads are those that
:mod:`gdnprune.checkpoint` sorts by (keys of :func:`gdnprune.blocks.orders_to_payload`).
"""

from __future__ import annotations

from typing import Any

import torch

from ..blocks import AttentionShape, Block, orders_to_payload
from .hooks import materialized_weight
from .orders import descending, greedy_lane_orders, greedy_removal_order

__all__ = ["BlockScorer", "block_payload", "BLOCK_METHODS"]

BLOCK_METHODS = ("projection", "activation")


class BlockScorer:
    """Hooks (on the output projection's input) and float64 statistics of one sub-block of a loaded model.

    Statistics: ``num_tokens``; ``abs_sum`` [units] (sum over tokens of ``|a_i|``, or of ``||o_h||`` per
    head); ``gram`` [units, units] (projection method: the contribution Gram ``G``).
    """

    def __init__(self, block: Block, module: torch.nn.Module, method: str = "projection") -> None:
        if method not in BLOCK_METHODS:
            raise ValueError(f"unknown sub-block scoring method {method!r}; expected one of {list(BLOCK_METHODS)}")
        self.block, self.method = block, method
        self.attention = isinstance(block.shape, AttentionShape)
        name = "o_proj" if self.attention else "down_proj"
        self.out_proj = getattr(module, name, None)
        if self.out_proj is None:
            raise ValueError(f"{block.prefix}: {type(module).__name__} has no {name}")
        self.width = block.shape.head_dim if self.attention else 1
        units = block.shape.num_attention_heads if self.attention else block.shape.intermediate_size
        self.units = units
        self.stats: dict[str, torch.Tensor] = {
            "num_tokens": torch.zeros((), dtype=torch.int64),
            "abs_sum": torch.zeros(units, dtype=torch.float64),
        }
        if method == "projection":
            self.stats["gram"] = torch.zeros(units, units, dtype=torch.float64)
        self._wtw: torch.Tensor | None = None
        self.token_mask: torch.Tensor | None = None  # [B, T] bool of the current batch, None = all tokens

    def attach(self) -> list[Any]:
        """Register the hook; returns the handles."""
        return [self.out_proj.register_forward_pre_hook(self._on_input)]

    @torch.no_grad()
    def _on_input(self, module: torch.nn.Module, args: tuple) -> None:
        x = args[0].detach()
        if self.token_mask is not None:  # masked (padding) tokens are left out of every statistic
            x = x[self.token_mask.to(x.device)]
        x = x.reshape(-1, x.shape[-1]).to(torch.float64)
        units = x.reshape(x.shape[0], self.units, self.width)
        self.stats["num_tokens"] += x.shape[0]
        self.stats["abs_sum"] += units.norm(dim=-1).sum(0).cpu()
        if self.method == "projection":
            if self._wtw is None:
                w = materialized_weight(module).detach().to(x.device, torch.float64)
                self._wtw = w.T @ w
            second = x.T @ x  # [units*width, units*width]
            gram = (self._wtw.to(second.device) * second).reshape(self.units, self.width, self.units, self.width)
            self.stats["gram"] += gram.sum(dim=(1, 3)).cpu()


def block_payload(block: Block, stats: dict[str, torch.Tensor], method: str) -> dict[str, Any]:
    """The score payload of a sub-block from its (summed) statistics: orders, raw scores, geometry."""
    n = max(int(stats["num_tokens"]), 1)
    activation = stats["abs_sum"] / n
    payload: dict[str, Any] = {"kind": block.kind, "layout": block.layout, "shape": block.shape.as_dict(),
                               "method": method}
    if block.kind == "attention":
        nkv, r = block.shape.num_key_value_heads, block.shape.heads_per_group
        if method == "projection":
            gram = stats["gram"]
            group_gram = gram.reshape(nkv, r, nkv, r).sum(dim=(1, 3))
            kv_groups = greedy_removal_order(group_gram)
            query_heads = greedy_lane_orders(gram, nkv)
            head_scores = gram.diagonal() / n
        else:
            head_scores = activation
            kv_groups = descending(head_scores.reshape(nkv, r).sum(-1))
            query_heads = descending(head_scores.reshape(nkv, r))
        payload.update(orders_to_payload({"kv_groups": kv_groups, "query_heads": query_heads}))
        payload["head_scores"] = head_scores.tolist()
    else:
        if method == "projection":
            channels = greedy_removal_order(stats["gram"])
            scores = stats["gram"].diagonal() / n
        else:
            scores = activation
            channels = descending(scores)
        payload.update(orders_to_payload({"channels": channels}))
        payload["channel_scores"] = scores.tolist()
    return payload
