"""Calibration windows that need memory: the plan's sensitivity (and the scores) see what a cut does to recall.

A KL averaged over plain text windows barely moves when a cut loses the model's memory of what came long
before (most tokens are predicted from the last few), so a plan measured on it may remove the state that
recall needs. The windows here carry a per-position weight of the KL (:data:`gdnprune.model.forwards.KL_WEIGHT`;
scoring weighs its second moments by it too), so every measurement runs as before:

* :func:`probe_windows`: recall probes (:mod:`gdnprune.quality.probes`: passkey, MQAR) as long as the
  calibration windows, their answers weighted; their filler the window's own text, or the probes' own
  sentences; alone, or beside each calibration window (``alongside``: the text's KL from the text, the
  recall's from the probes);
* :func:`span_windows`: spans of the calibration text itself written into each window twice; the KL of the
  second copies after their key is weighted (token ids only: no tokenizer needed);
* :func:`context_weights`: the windows as they are, each position's KL weighted by how much the unpruned
  model's loss there falls when it sees the whole window rather than its last ``short`` tokens.

:func:`recall_windows` is what the plan uses (probes beside the windows with a tokenizer, spans without);
``docs/scoring.md`` gives the measurements behind the choice. :func:`exact_match` counts the answers a model
gets right (``--keep-recall``).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from ..model.forwards import KL_WEIGHT, input_device, model_inputs, unpack_batches
from . import probes

__all__ = [
    "RECALL_MASK",
    "RECALL_SHARE",
    "PROBE_SEED",
    "SPAN_COUNTS",
    "balance",
    "context_weights",
    "exact_match",
    "probe_windows",
    "recall_windows",
    "span_windows",
]

#: the share of a window's KL that its recall positions carry
RECALL_SHARE = 0.25
#: the seed of the probes of recall windows: neither ``gdnprune eval``'s (0) nor the recall models' training
#: probes' (500, 1000 and on, ``scripts/train_demo_model.py``)
PROBE_SEED = 43_000
#: the key of a recall window's mask of the positions whose next token a second copy asks for (bool [B, T])
RECALL_MASK = "recall_mask"
#: a fact: its key's tokens and its value's (the value is what the second copy asks for)
Fact = tuple[list[int], list[int]]
#: how many facts a window holds (one drawn per window, in turn): one fact asked again, up to eight
SPAN_COUNTS = (1, 2, 4, 8)


def balance(
    weights: Sequence[torch.Tensor], recall: Sequence[torch.Tensor], share: float
) -> list[torch.Tensor]:
    """Per-position KL weights: 1 at every position, plus the ``recall`` weights scaled so that over all
    windows they carry ``share`` of the total (the others ``1 - share``). ``weights``: the valid positions
    (0 or 1) of each batch."""
    if not 0 <= share < 1:
        raise ValueError(f"`share` is the recall positions' share of the KL, in [0, 1); got {share!r}")
    plain = float(sum(float((w * (r <= 0)).sum()) for w, r in zip(weights, recall)))
    wanted = float(sum(float((w * r).sum()) for w, r in zip(weights, recall)))
    scale = 0.0 if wanted <= 0 else share / (1 - share) * plain / wanted
    return [w * torch.where(r > 0, scale * r, torch.ones_like(r)) for w, r in zip(weights, recall)]


def _text_facts(pool: torch.Tensor, count: int, size: int, rng: np.random.Generator) -> list[Fact]:
    """``count`` spans of ``size`` tokens of the text: the first third is the key, the rest the value."""
    key = max(1, size // 3)
    starts = rng.integers(0, max(1, pool.shape[0] - size), count)
    return [(pool[s : s + key].tolist(), pool[s + key : s + size].tolist()) for s in starts]


def _fact_row(
    row: torch.Tensor, facts: list[Fact], rng: np.random.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """``row`` with every fact written twice (once in its first half, again, in another order, in its second;
    the text cut short to keep the length); the recall weight of each position: 1 where the next token is a
    second copy's value, else 0."""
    length = row.shape[0]
    while len(facts) > 1 and 4 * sum(len(k) + len(v) for k, v in facts) > length:
        facts = facts[:-1]  # the copies take at most half the window
    room = sum(len(k) + len(v) for k, v in facts)
    text = row[: max(0, length - 2 * room)].tolist()
    half = len(text) // 2
    first = np.sort(rng.integers(0, max(1, half), len(facts)))
    second = np.sort(rng.integers(half, len(text) + 1, len(facts)))
    asked = rng.permutation(len(facts))
    pieces = [(int(p), facts[i], False) for i, p in enumerate(first)]
    pieces += [(int(p), facts[i], True) for p, i in zip(second, asked)]
    pieces.sort(key=lambda piece: piece[0])
    out: list[int] = []
    weight: list[float] = []
    at = 0
    for where, (key, value), again in pieces:
        out += text[at:where]
        at = where
        weight += [0.0] * (len(out) - len(weight) + len(key) + len(value))
        if again:  # the positions whose next token is the value: the key's last onward
            for t in range(len(out) + len(key) - 1, len(out) + len(key) + len(value) - 1):
                weight[t] = 1.0
        out += key + value
    out += text[at:]
    weight += [0.0] * (len(out) - len(weight))
    return torch.tensor(out[:length], dtype=torch.long), torch.tensor(weight[:length], dtype=torch.float64)


def span_windows(
    batches: Iterable[Any], *, seed: int = 0, share: float = RECALL_SHARE
) -> list[dict[str, torch.Tensor]]:
    """The calibration batches with spans of their own text written twice into every window (one of
    :data:`SPAN_COUNTS` spans per window, in turn; a third of a span is its key, the rest its value), as
    batches with the KL weight :data:`~gdnprune.model.forwards.KL_WEIGHT` (the second copies' values carry
    ``share`` of the KL) and the mask :data:`RECALL_MASK` of those positions. Token ids only: no tokenizer
    needed. A batch with an attention mask is kept as it is (every position weight 1). Deterministic given
    ``seed``."""
    data = unpack_batches(batches)
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
            count = SPAN_COUNTS[k % len(SPAN_COUNTS)]
            size = max(2, min(12, row.shape[0] // (4 * count)))
            count = max(1, min(count, row.shape[0] // (4 * size)))
            made, weight = _fact_row(row, _text_facts(pool, count, size, rng), rng)
            rows.append(made)
            weights.append(weight)
            k += 1
        out.append({"input_ids": torch.stack(rows)})
        valid.append(torch.ones(ids.shape, dtype=torch.float64))
        recall.append(torch.stack(weights))
    return _weighted(out, valid, recall, share)


def _weighted(
    out: list[dict],
    valid: list[torch.Tensor],
    recall: list[torch.Tensor],
    share: float,
    groups: Sequence[int] | None = None,
) -> list[dict]:
    """``out``'s batches with their KL weights (:func:`balance` over all of them, or within each group of
    ``groups``: the group of every batch) and recall masks."""
    members: dict[int, list[int]] = {}
    for i in range(len(out)):
        members.setdefault(0 if groups is None else groups[i], []).append(i)
    for picked in members.values():
        weights = balance([valid[i] for i in picked], [recall[i] for i in picked], share)
        for i, weight in zip(picked, weights):
            out[i][KL_WEIGHT] = weight
            out[i][RECALL_MASK] = recall[i] > 0
    return out


def _probe_row(
    text: str, kind: str, seed: int, index: int, tokenizer: Any, haystack: bool = True
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The probe of ``kind`` (``passkey`` or ``mqar``) as long as ``text``, ``text`` its filler (``haystack``;
    else the probes' own), tokenized; the recall weight of each position (1 where the next token is an
    answer's); None when ``text`` is too short or the answers' tokens cannot be told apart."""
    if len(text) < probes.MIN_LENGTH:
        return None
    make = probes.passkey if kind == "passkey" else probes.mqar
    made = make(seed, len(text), index, haystack=text if haystack else None)
    encoded = tokenizer(made.text, add_special_tokens=False, return_offsets_mapping=True)
    ids, offsets = encoded["input_ids"], encoded["offset_mapping"]
    weight = torch.zeros(len(ids), dtype=torch.float64)
    for query in made.queries:
        start, stop = len(query.context), len(query.context) + len(query.answer)
        inside = [t for t, (a, b) in enumerate(offsets) if start <= a < stop and b > a]
        if not inside or inside[0] == 0:
            return None
        weight[inside[0] - 1 : inside[-1]] = 1.0
    return torch.tensor(ids, dtype=torch.long), weight


def probe_windows(
    batches: Iterable[Any],
    tokenizer: Any,
    *,
    seed: int = PROBE_SEED,
    share: float = RECALL_SHARE,
    haystack: bool = True,
    alongside: bool = False,
) -> list[dict[str, torch.Tensor]]:
    """Every calibration window made a recall probe with its own text as the haystack, in turn a passkey
    (a number in a sentence, asked for again at the end) and an MQAR probe (key-value lines, the text, the
    keys asked again) of :mod:`gdnprune.quality.probes`: each window decoded with ``tokenizer``, the probe
    written as long as its text, tokenized again (so a window may come back a few tokens longer or
    shorter: each is a batch of its own). The KL weight :data:`~gdnprune.model.forwards.KL_WEIGHT` gives the
    answers' tokens ``share`` of the KL, :data:`RECALL_MASK` marks them. A window too short for a probe
    (or with a mask) is kept as it is. ``haystack`` False: the probes' own filler instead of the text (the
    probes as ``gdnprune eval`` asks them, as long as the windows). ``alongside``: every calibration window
    kept as it is, its probe after it with no weight but on the answers (the text's KL from the text, the
    recall's from the probes; twice the windows), ``share`` kept within each pair (a window's weights do not
    depend on the others'). Deterministic given ``seed``."""
    out, valid, recall, groups = [], [], [], []
    k = 0
    for ids, mask in unpack_batches(batches):
        for row in range(ids.shape[0]):
            made = None
            if mask is None:
                text = tokenizer.decode(ids[row].tolist())
                made = _probe_row(text, ("passkey", "mqar")[k % 2], seed, k, tokenizer, haystack)
            k += 1
            if made is None or alongside:
                kept = ids[row : row + 1]
                out.append(
                    {"input_ids": kept, **({} if mask is None else {"attention_mask": mask[row : row + 1]})}
                )
                valid.append(
                    torch.ones(kept.shape, dtype=torch.float64)
                    if mask is None
                    else mask[row : row + 1].double()
                )
                recall.append(torch.zeros(kept.shape, dtype=torch.float64))
                groups.append(k)
                if made is None:
                    continue
            out.append({"input_ids": made[0][None]})
            valid.append(
                made[1][None].clone() if alongside else torch.ones((1, made[0].shape[0]), dtype=torch.float64)
            )
            recall.append(made[1][None])
            groups.append(k)
    return _weighted(out, valid, recall, share, groups if alongside else None)


def recall_windows(
    batches: Iterable[Any], *, tokenizer: Any = None, seed: int = PROBE_SEED, share: float = RECALL_SHARE
) -> list[dict[str, torch.Tensor]]:
    """The recall windows of the plan and of recall-aware scores: with the model's ``tokenizer``, every
    calibration window as it is with a passkey or MQAR probe of its length after it, weighted on the answers
    only (:func:`probe_windows` with the probes' own filler, ``alongside``); without one, spans of the text
    written twice (:func:`span_windows`). ``docs/scoring.md`` gives the measurements behind the choice."""
    if tokenizer is None:
        return span_windows(batches, seed=seed, share=share)
    return probe_windows(batches, tokenizer, seed=seed, share=share, haystack=False, alongside=True)


@torch.no_grad()
def exact_match(model: Any, windows: Iterable[dict[str, torch.Tensor]]) -> tuple[int, int]:
    """(spans the model gets right, spans asked) over recall windows (:func:`span_windows`): a second copy is
    right when the model's greedy next token is the copy's at every position of its value (a run of
    :data:`RECALL_MASK`)."""
    hits = total = 0
    for batch in windows:
        ids, mask = batch["input_ids"], batch[RECALL_MASK]
        if not bool(mask.any()):
            continue
        greedy = model(**model_inputs(ids, batch.get("attention_mask"), input_device(model))).logits.argmax(
            -1
        )
        right = greedy[:, :-1].cpu() == ids[:, 1:]
        for row in range(ids.shape[0]):
            asked = mask[row, :-1]
            edges = torch.diff(
                asked.int(), prepend=torch.zeros(1, dtype=torch.int), append=torch.zeros(1, dtype=torch.int)
            )
            for start, stop in zip(
                torch.nonzero(edges == 1).flatten().tolist(), torch.nonzero(edges == -1).flatten().tolist()
            ):
                total += 1
                hits += int(bool(right[row, start:stop].all()))
    return hits, total


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
