"""Calibration windows that need memory: the plan's sensitivity sees what a cut does to recall.

A KL averaged over plain text windows barely moves when a cut loses the model's memory of what came long
before (most tokens are predicted from the last few), so a plan measured on it may remove the state that
recall needs. Two ways to make the same windows show it, both as a per-position weight of the KL
(:data:`gdnprune.model.forwards.KL_WEIGHT`), so every measurement (:class:`gdnprune.model.forwards.Forwards`)
runs as before:

* :func:`span_windows`: spans of the calibration text itself written into each window twice, once in
  its first half and again, in another order, in its second half; the KL of the second copies' tokens
  after their first few (the key: what asks for the rest) counts for ``share`` of the window's KL. A
  passkey asked again, a key-value line, a repeated span: made from the user's own text, for any tokenizer.
* :func:`context_weights`: the windows as they are, each position's KL weighted by how much the unpruned
  model's loss there falls when it sees the whole window rather than its last ``short`` tokens.

``docs/scoring.md`` says which one the plan uses, and why.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from ..model.forwards import KL_WEIGHT, input_device, model_inputs, unpack_batches

__all__ = ["RECALL_SHARE", "SPAN_COUNTS", "context_weights", "span_windows", "balance"]

#: the share of a window's KL that its recall positions carry
RECALL_SHARE = 0.5
#: how many spans a window holds (one drawn per window, in turn): one fact asked again, up to eight
SPAN_COUNTS = (1, 2, 4, 8)


def balance(weights: Sequence[torch.Tensor], recall: Sequence[torch.Tensor], share: float) -> list[torch.Tensor]:
    """Per-position KL weights: 1 at every position, plus the ``recall`` weights scaled so that over all
    windows they carry ``share`` of the total (the others ``1 - share``). ``weights``: the valid positions
    (0 or 1) of each batch."""
    if not 0 <= share < 1:
        raise ValueError(f"`share` is the recall positions' share of the KL, in [0, 1); got {share!r}")
    plain = float(sum(float((w * (r <= 0)).sum()) for w, r in zip(weights, recall)))
    wanted = float(sum(float((w * r).sum()) for w, r in zip(weights, recall)))
    scale = 0.0 if wanted <= 0 else share / (1 - share) * plain / wanted
    return [w * torch.where(r > 0, scale * r, torch.ones_like(r)) for w, r in zip(weights, recall)]


def _span_row(
    row: torch.Tensor,
    pool: torch.Tensor,
    count: int,
    rng: np.random.Generator,
    digits: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One window with ``count`` spans of ``pool`` written twice; the recall weight of each position (1 where
    the next token is a second copy's token after its key, else 0). ``digits``: the values are numbers
    written with these tokens instead of text."""
    length = row.shape[0]
    size = max(2, min(12, length // (4 * count)))  # each span: its key then its value
    count = max(1, min(count, length // (4 * size)))
    key = max(1, size // 3) if digits is None else max(1, size - 5)
    starts = rng.integers(0, max(1, pool.shape[0] - size), count)
    spans = [pool[s : s + size] for s in starts]
    if digits is not None:
        spans = [torch.cat([s[:key], digits[rng.integers(0, len(digits), size - key)]]) for s in spans]
    text = row[: length - 2 * count * size].tolist()
    half = len(text) // 2
    first = np.sort(rng.integers(0, max(1, half), count))
    second = np.sort(rng.integers(half, len(text) + 1, count))
    asked = rng.permutation(count)
    pieces: list[tuple[int, list[int], int]] = [(int(p), spans[i].tolist(), -1) for i, p in enumerate(first)]
    pieces += [(int(p), spans[i].tolist(), 1) for p, i in zip(second, asked)]
    pieces.sort(key=lambda piece: piece[0])
    out: list[int] = []
    weight: list[float] = []
    at = 0
    for where, span, copy in pieces:
        out += text[at:where]
        weight += [0.0] * (where - at)
        at = where
        weight += [0.0] * len(span)
        if copy > 0:  # the positions whose next token is the copy's value: the last key token's onward
            for t in range(len(out) + key - 1, len(out) + size - 1):
                weight[t] = 1.0
        out += span
    out += text[at:]
    weight += [0.0] * (len(text) - at)
    return torch.tensor(out, dtype=torch.long), torch.tensor(weight, dtype=torch.float64)


def span_windows(
    batches: Iterable[Any], *, seed: int = 0, share: float = RECALL_SHARE, digits: Sequence[int] | None = None
) -> list[dict[str, torch.Tensor]]:
    """The calibration batches with spans of their own text written twice into every window (one of
    :data:`SPAN_COUNTS` spans per window, in turn), as batches with the KL weight
    :data:`~gdnprune.model.forwards.KL_WEIGHT`: the second copies' tokens after their key carry ``share``
    of the KL. A batch with an attention mask is kept as it is (every position weight 1). Deterministic
    given ``seed``."""
    data = unpack_batches(batches)
    numbers = None if digits is None else torch.as_tensor(list(digits), dtype=torch.long)
    pool = torch.cat([ids.reshape(-1) if mask is None else ids[mask] for ids, mask in data])
    out, valid, recall = [], [], []
    k = 0
    for ids, mask in data:
        if mask is not None:
            out.append({"input_ids": ids, "attention_mask": mask})
            valid.append(mask.double())
            recall.append(torch.zeros_like(ids, dtype=torch.float64))
            continue
        rows, weights = [], []
        for row in ids:
            rng = np.random.default_rng([seed, k])
            made, weight = _span_row(
                row, pool, SPAN_COUNTS[k % len(SPAN_COUNTS)], rng, numbers if (k // len(SPAN_COUNTS)) % 2 == 0 else None
            )
            rows.append(made)
            weights.append(weight)
            k += 1
        out.append({"input_ids": torch.stack(rows)})
        valid.append(torch.ones(ids.shape, dtype=torch.float64))
        recall.append(torch.stack(weights))
    for batch, weight in zip(out, balance(valid, recall, share)):
        batch[KL_WEIGHT] = weight
    return out


@torch.no_grad()
def _token_losses(model: Any, ids: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """The next-token loss of every position [B, T] (0 at the last and at masked positions)."""
    logits = model(**model_inputs(ids, mask, input_device(model))).logits.float()
    loss = F.cross_entropy(logits[:, :-1].transpose(1, 2), ids[:, 1:].to(logits.device), reduction="none")
    out = torch.zeros(ids.shape, dtype=torch.float64)
    out[:, :-1] = loss.double().cpu()
    if mask is not None:
        out[:, :-1] *= (mask[:, :-1] & mask[:, 1:]).double()
    return out


@torch.no_grad()
def context_weights(
    model: Any, batches: Iterable[Any], *, short: int = 64, share: float = RECALL_SHARE
) -> list[dict[str, torch.Tensor]]:
    """The calibration batches with the KL weight :data:`~gdnprune.model.forwards.KL_WEIGHT`: each position
    weighted by how much the unpruned model's loss there falls from a context of ``short / 2`` to ``short``
    tokens (the window cut into pieces of ``short`` tokens, twice, the second time ``short / 2`` later; each
    position read in the piece where it sees more) to the whole window; these gains carry ``share`` of the
    KL."""
    data = unpack_batches(batches)
    out, valid, recall = [], [], []
    for ids, mask in data:
        whole = _token_losses(model, ids, mask)
        length = ids.shape[1]
        near = torch.zeros_like(whole)
        for offset in (0, short // 2):
            bounds = [0, *range(offset or short, length, short), length]
            for a, b in zip(bounds[:-1], bounds[1:]):
                if b - a < 2:
                    continue
                piece = _token_losses(model, ids[:, a:b], None if mask is None else mask[:, a:b])
                seen = torch.arange(a, b) - a  # context of each position inside the piece
                better = seen >= (short // 2 if offset else 0)
                if offset:
                    near[:, a:b][:, better] = piece[:, better]
                else:
                    near[:, a:b] = piece
        gain = (near - whole).clamp(min=0)
        gain[:, : short // 2] = 0  # no shorter context to compare with
        out.append({"input_ids": ids, **({} if mask is None else {"attention_mask": mask})})
        valid.append(torch.ones(ids.shape, dtype=torch.float64) if mask is None else mask.double())
        recall.append(gain)
    for batch, weight in zip(out, balance(valid, recall, share)):
        batch[KL_WEIGHT] = weight
    return out
