"""Recall probes as plain text: passkey retrieval and multi-query associative recall (MQAR).

Pure Python (no torch, no lm-eval): the generators are deterministic given ``(seed, length, index)``,
so the training mix of ``scripts/train_demo_model.py`` and the lm-eval tasks read the same text.

Lengths are in characters. Every character is ASCII, so a length is also a count of UTF-8 bytes (and of
tokens for a byte-level tokenizer). A probe is one sequence; each of its questions is a :class:`Query`:
the text before the answer (``context``) and the answer, scored by exact match. The answer of query ``i``
starts at character ``len(context)`` of the full text, ``probe.text``.
"""

from __future__ import annotations

import random
import string
from dataclasses import dataclass

__all__ = [
    "FILLER",
    "MIN_LENGTH",
    "PASSKEY_DIGITS",
    "MQAR_QUERIES",
    "Probe",
    "Query",
    "passkey",
    "mqar",
    "mqar_pairs",
    "probe",
]

#: The filler between the facts: repeated sentences that carry nothing to remember.
FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
#: Shortest probe the generators make (characters).
MIN_LENGTH = 128
PASSKEY_DIGITS = 5
#: Queries asked at the end of one MQAR probe.
MQAR_QUERIES = 8
_QUESTION = "\nWhat is the pass key? The pass key is"


@dataclass(frozen=True)
class Query:
    """One question of a probe: the answer follows ``context`` directly (exact match)."""

    context: str
    answer: str


@dataclass(frozen=True)
class Probe:
    """One probe sequence: its full text and its questions (each a prefix of the text plus its answer)."""

    kind: str
    text: str
    queries: tuple[Query, ...]


def _rng(kind: str, seed: int, length: int, index: int) -> random.Random:
    # One stream per (kind, seed, length, index): probes do not change when others are added.
    return random.Random(f"{kind}/{seed}/{length}/{index}")


def _filler(count: int, rng: random.Random) -> str:
    """``count`` characters of filler, starting at a random sentence of :data:`FILLER`."""
    starts = [0] + [i + 2 for i, c in enumerate(FILLER[:-2]) if FILLER[i : i + 2] == ". "]
    offset = rng.choice(starts)
    repeats = (count + offset) // len(FILLER) + 1
    return (FILLER * repeats)[offset : offset + count]


def _check_length(kind: str, length: int) -> None:
    if length < MIN_LENGTH:
        raise ValueError(f"{kind}: a probe needs at least {MIN_LENGTH} characters, got length {length}")


def passkey(seed: int, length: int, index: int = 0) -> Probe:
    """A number of :data:`PASSKEY_DIGITS` digits hidden at a random depth in filler, asked for at the end.

    The text is exactly ``length`` characters long; its one query's answer is ``" " + key`` (its last
    ``PASSKEY_DIGITS + 1`` characters).
    """
    _check_length("passkey", length)
    rng = _rng("passkey", seed, length, index)
    key = "".join(rng.choice(string.digits) for _ in range(PASSKEY_DIGITS))
    needle = f"The pass key is {key}. Remember it. {key} is the pass key. "
    answer = f" {key}"
    room = length - len(needle) - len(_QUESTION) - len(answer)
    filler = _filler(room, rng)
    depth = rng.randrange(room + 1)
    cut = filler.rfind(". ", 0, depth)
    depth = 0 if cut < 0 else cut + 2  # the needle starts a sentence
    context = filler[:depth] + needle + filler[depth:] + _QUESTION
    return Probe("passkey", context + answer, (Query(context, answer),))


def mqar_pairs(length: int) -> int:
    """Key-value pairs in an MQAR probe of ``length`` characters: one per 32 characters."""
    return max(MQAR_QUERIES, length // 32)


def mqar(seed: int, length: int, index: int = 0, *, pairs: int | None = None) -> Probe:
    """Multi-query associative recall: key-value pairs, filler, then :data:`MQAR_QUERIES` queries.

    Keys are two lowercase letters (distinct), values two digits; a pair is written ``ab:42 ``. After
    the pairs and the filler, queries ask keys in random order, each answered before the next is asked
    (``... cd:17 ab:`` → ``42``), so query ``i``'s context holds the earlier queries with their answers.
    ``pairs`` defaults to :func:`mqar_pairs`. The text is exactly ``length`` characters long.
    """
    _check_length("mqar", length)
    count = mqar_pairs(length) if pairs is None else pairs
    if not MQAR_QUERIES <= count <= 26 * 26:
        raise ValueError(f"mqar: pairs must be in [{MQAR_QUERIES}, {26 * 26}], got {count}")
    rng = _rng("mqar", seed, length, index)
    keys = rng.sample([a + b for a in string.ascii_lowercase for b in string.ascii_lowercase], count)
    values = [f"{rng.randrange(100):02d}" for _ in keys]
    head = "".join(f"{k}:{v} " for k, v in zip(keys, values, strict=True)) + "\n"
    asked = rng.sample(range(count), MQAR_QUERIES)
    tail_len = sum(len(keys[i]) + 1 + len(values[i]) + 1 for i in asked) - 1  # no space after the last
    room = length - len(head) - 1 - tail_len
    if room < 0:
        raise ValueError(f"mqar: {count} pairs do not fit in {length} characters")
    text = head + _filler(room, rng) + "\n"
    queries = []
    for n, i in enumerate(asked):
        text += f"{keys[i]}:"
        queries.append(Query(text, values[i]))
        text += values[i] + (" " if n < len(asked) - 1 else "")
    return Probe("mqar", text, tuple(queries))


def probe(kind: str, seed: int, length: int, index: int = 0) -> Probe:
    """The probe of ``kind`` (``passkey`` or ``mqar``)."""
    if kind == "passkey":
        return passkey(seed, length, index)
    if kind == "mqar":
        return mqar(seed, length, index)
    raise ValueError(f"probe: kind must be 'passkey' or 'mqar', got {kind!r}")
