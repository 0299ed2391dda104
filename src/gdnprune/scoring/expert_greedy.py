"""The measured greedy removal of one MoE layer's routed experts (issue 31), from a sample of routed tokens.

For a sample of calibration tokens the experts hook (:class:`gdnprune.scoring.experts.ExpertScorer`) keeps
each token's router logits ``l(t)`` [E], its ``m`` first choices ``r_1(t) .. r_m(t)`` (by logit) and the Gram
``G(t)`` [m, m] of those experts' outputs ``y_r(t)``. A routed output over kept experts is then a coefficient
vector ``a(t)`` over the token's ranks, ``o(t) = sum_i a_i(t) y_{r_i}(t)``, and any change of it is exact
from the Gram: ``||o_R(t) - o(t)||^2 = d^T G(t) d`` with ``d = a_R(t) - a(t)``. The cut router (what
``slice_model`` builds) takes, over the kept experts ``K``, the ``k`` of the highest logit, with the softmax
over ``K`` as weights (renormalised over the chosen when the router renormalises), so ``a_R`` depends on
the logits and ``K`` alone.

The greedy removes experts one at a time, each time the kept expert whose removal (given those already
removed) least increases the layer's summed squared change of the routed output over the sampled tokens;
the reverse of the removal sequence is the keep order (with a per-expert ``scale``, the frequency say,
each step removes the least increase times the scale). Removing ``j`` changes the tokens whose current
choices include ``j`` (their next kept choice takes the slot) and, without renormalisation, every token's
softmax denominator (a scalar factor on its output, in closed form). Cost per removal step: ``N k m^2``
for ``N`` sampled tokens (plus ``N E`` without renormalisation), ``E`` steps per layer (measured:
BENCHMARKS.md, issue 31); tokens whose choices run past their ``m`` first (deep cuts with ``m < E``) lose
those slots (exact when ``m = E``).
"""

from __future__ import annotations

import torch

__all__ = ["greedy_expert_removal", "routed_coefficients"]


def routed_coefficients(
    weights: torch.Tensor, kept_rank: torch.Tensor, top_k: int, normalized: bool, denominator: torch.Tensor
) -> torch.Tensor:
    """The routed output's coefficients over each token's ranks [..., m]: the first ``top_k`` kept ranks,
    weighted by ``weights`` (``exp`` of the logits at the ranks) over ``denominator`` (the sum over the kept
    experts), or over the chosen ones' sum when ``normalized``."""
    chosen = kept_rank & (torch.cumsum(kept_rank.long(), dim=-1) <= top_k)
    num = weights * chosen
    if normalized:
        return num / num.sum(-1, keepdim=True).clamp_min(1e-300)
    return num / denominator.unsqueeze(-1).clamp_min(1e-300)


def _quadratic(a: torch.Tensor, gram: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a^T G b`` per token (and per leading candidate axis): a, b [N, ..., m], gram [N, m, m]."""
    if a.dim() == 2:
        return torch.einsum("nm,nmp,np->n", a, gram, b)
    return torch.einsum("nkm,nmp,nkp->nk", a, gram, b)


# Over 80 lines: one loop with its setup and the two kinds of candidate (the chosen, the others' denominator).
@torch.no_grad()
def greedy_expert_removal(
    logits: torch.Tensor,
    ranks: torch.Tensor,
    gram: torch.Tensor,
    top_k: int,
    normalized: bool,
    scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The measured greedy removal of a layer's experts from ``N`` sampled tokens.

    Args:
        logits: the router logits [N, E].
        ranks: each token's ``m`` first experts by logit [N, m] (``ranks[:, 0]`` the top choice).
        gram: the Gram of those experts' outputs [N, m, m] (``y_{r_i} . y_{r_j}``).
        top_k: experts per token.
        normalized: the router renormalises the chosen experts' weights to sum to 1.
        scale: per expert [E], each step removes the expert of the least increase times its scale (the
            frequency, say); None: the least increase.

    Returns:
        ``(order, error)``: the keep order (most important first: the reverse of the removal sequence;
        among equal increases the higher expert goes first) and, per expert, the summed squared change of
        the routed output over the tokens, divided by ``N``, once that expert and those removed before it are
        removed.
    """
    logits, gram = logits.to(torch.float64), gram.to(torch.float64)
    n_tokens, n_experts = logits.shape
    if n_tokens == 0:
        raise ValueError("the greedy expert removal needs at least one sampled token")
    ranks = ranks.long()
    m = ranks.shape[1]
    k = min(top_k, m)
    expo = torch.exp(logits - logits.max(-1, keepdim=True).values)  # [N, E], the top choice at 1
    at_rank = expo.gather(1, ranks)  # [N, m]
    kept = torch.ones(n_experts, dtype=torch.bool)
    all_ranks = torch.ones_like(ranks, dtype=torch.bool)
    original = routed_coefficients(at_rank, all_ranks, k, normalized, expo.sum(-1))
    position = torch.arange(m)
    removal: list[int] = []
    error = torch.zeros(n_experts, dtype=torch.float64)
    for _ in range(n_experts):
        kept_rank = kept[ranks]  # [N, m]
        denominator = (expo * kept).sum(-1)  # [N]
        coef = routed_coefficients(at_rank, kept_rank, k, normalized, denominator)
        diff = coef - original
        current = _quadratic(diff, gram, diff)  # [N]
        delta = torch.zeros(n_experts, dtype=torch.float64)
        chosen = kept_rank & (torch.cumsum(kept_rank.long(), dim=-1) <= k)
        # the (at most k) chosen ranks of each token: removing that expert reroutes the token
        slot = torch.topk(chosen.long() * (m - position), k, dim=-1).indices  # [N, k] first chosen ranks
        valid = chosen.gather(1, slot)  # [N, k]
        without = kept_rank.unsqueeze(1) & (position != slot.unsqueeze(-1))  # [N, k, m]
        expert = ranks.gather(1, slot)  # [N, k]
        cut_denominator = denominator.unsqueeze(1) - expo.gather(1, expert)  # [N, k]
        new = routed_coefficients(at_rank.unsqueeze(1), without, k, normalized, cut_denominator)  # [N, k, m]
        new_diff = new - original.unsqueeze(1)
        change = _quadratic(new_diff, gram, new_diff) - current.unsqueeze(1)  # [N, k]
        delta.index_add_(0, expert[valid], change[valid])
        if not normalized:  # a kept expert not chosen scales the token's output by Z / (Z - exp(l_j))
            factor = denominator.unsqueeze(1) / (denominator.unsqueeze(1) - expo).clamp_min(1e-300) - 1
            norm2 = _quadratic(coef, gram, coef).unsqueeze(1)
            cross = _quadratic(coef, gram, diff).unsqueeze(1)
            others = factor.pow(2) * norm2 + 2 * factor * cross  # [N, E]
            is_chosen = torch.zeros(n_tokens, n_experts, dtype=torch.bool)
            is_chosen.scatter_(1, expert, valid)
            delta += torch.where(~is_chosen & kept, others, 0.0).sum(0)
        rank = delta if scale is None else delta * scale.to(delta)
        best = rank[kept].min()
        j = int(torch.nonzero(kept & (rank == best)).max())  # ties: the higher expert goes first
        kept[j] = False
        removal.append(j)
        error[j] = (current.sum() + delta[j]) / n_tokens
    return torch.tensor(removal[::-1], dtype=torch.long), error
