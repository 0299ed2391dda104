"""Importance of MLP channels and attention heads (issue 21): the hook and float64 statistics of one
sub-block (its orders come from the statistics alone: :func:`gdnprune.scoring.payload.block_payload`).

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

:func:`gdnprune.scoring.score_model` runs these scorers beside the GDN ones with ``blocks=True``; the
payloads join the scores file under the sub-blocks' prefixes, which ``sort`` applies.
"""

from __future__ import annotations

from typing import Any

import torch

from ..model.forwards import output_projection
from ..model.subblock_geometry import Block
from ..model.subblock_shapes import AttentionShape
from .hooks import materialized_weight
from .payload import block_payload

__all__ = ["BlockScorer", "block_payload", "BLOCK_METHODS"]

BLOCK_METHODS = ("projection", "activation")


class BlockScorer:
    """Hooks (on the output projection's input) and float64 statistics of one sub-block of a loaded model.

    Statistics: ``num_tokens``; ``abs_sum`` [units] (sum over tokens of ``|a_i|``, or of ``||o_h||`` per
    head); ``gram`` [units, units] (projection method: the contribution Gram ``G``).
    """

    def __init__(self, block: Block, module: torch.nn.Module, method: str = "projection") -> None:
        if method not in BLOCK_METHODS:
            raise ValueError(
                f"unknown sub-block scoring method {method!r}; expected one of {list(BLOCK_METHODS)}"
            )
        self.block, self.method = block, method
        self.attention = isinstance(block.shape, AttentionShape)
        self.out_proj = output_projection(module)
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
        self.token_root_weight: torch.Tensor | None = None  # [B, T] square roots of the tokens' weights

    def attach(self) -> list[Any]:
        """Register the hook; returns the handles."""
        return [self.out_proj.register_forward_pre_hook(self._on_input)]

    @torch.no_grad()
    def _on_input(self, module: torch.nn.Module, args: tuple) -> None:
        x = args[0].detach()
        if self.token_root_weight is not None:  # every second moment weighs each token by its weight
            x = x * self.token_root_weight.to(x.device, x.dtype)[..., None]
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
            gram = (self._wtw.to(second.device) * second).reshape(
                self.units, self.width, self.units, self.width
            )
            self.stats["gram"] += gram.sum(dim=(1, 3)).cpu()
