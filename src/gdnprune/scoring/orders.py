"""Importance orders from Gram matrices: the greedy conditional removal, per group and per lane round.

See ``docs/scoring.md`` for why a greedy removal on the Gram matrix of per-element contributions is the
order a nested slice wants.
"""

from __future__ import annotations

import math

import torch

__all__ = ["greedy_removal_order", "greedy_lane_orders", "descending"]


def greedy_removal_order(gram: torch.Tensor) -> torch.Tensor:
    """Importance order (most important first) of the ``n`` elements of a Gram matrix ``gram`` [..., n, n].

    ``gram[i, j] = sum_t c_i(t) . c_j(t)`` for per-element contributions ``c_i`` whose sum is the signal.
    The greedy repeatedly removes the element whose removal least increases the energy
    ``|sum_{i in R} c_i|^2 = 1^T gram_RR 1`` of everything removed so far; the returned order is the
    reverse of the removal sequence, so every prefix is the set kept by the greedy at that size. Exact
    ties are broken towards keeping the lower index first. Leading dimensions are independent problems
    (e.g. one per key head), solved together.
    """
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
    gram = torch.as_tensor(gram, dtype=torch.float64)
    Hv = gram.shape[0]
    if gram.shape != (Hv, Hv) or Hv % num_key_heads:
        raise ValueError(
            f"gram must be [Hv, Hv] with Hv a multiple of {num_key_heads}, got {list(gram.shape)}"
        )
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


def descending(scores: torch.Tensor) -> torch.Tensor:
    """Order by descending score along the last axis; ties keep index order."""
    return torch.sort(scores, dim=-1, descending=True, stable=True).indices
