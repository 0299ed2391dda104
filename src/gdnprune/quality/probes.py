"""Recall probes as plain text: passkey retrieval (anywhere, or at a chosen depth: the needle in a
haystack), multi-query associative recall (MQAR), and two RULER-style tasks: multi-key retrieval (one
number among several needles with their own keys) and variable tracking (the names a chain of assignments
gives one value).

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
    "MIN_LENGTHS",
    "PASSKEY_DIGITS",
    "MQAR_QUERIES",
    "MQAR_MAX_PAIRS",
    "MULTIKEY_NEEDLES",
    "VARTRACK_HOPS",
    "KINDS",
    "Probe",
    "Query",
    "passkey",
    "mqar",
    "mqar_pairs",
    "multikey",
    "vartrack",
    "probe",
]

#: The filler between the facts: repeated sentences that carry nothing to remember.
FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
#: Shortest probe the generators make (characters): passkey and MQAR; the RULER-style kinds need
#: :data:`MIN_LENGTHS`.
MIN_LENGTH = 128
#: Shortest probe of each kind (characters).
MIN_LENGTHS = {"passkey": MIN_LENGTH, "mqar": MIN_LENGTH, "multikey": 256, "vartrack": 256}
PASSKEY_DIGITS = 5
#: Queries asked at the end of one MQAR probe.
MQAR_QUERIES = 8
#: Most pairs an MQAR probe holds: its keys are distinct two-letter words.
MQAR_MAX_PAIRS = 26 * 26
#: Needles of a multi-key probe (one is asked for; the others have keys of their own).
MULTIKEY_NEEDLES = 4
#: Assignments after the first in a variable-tracking chain (``VAR B = VAR A``, ...).
VARTRACK_HOPS = 4
#: every kind of probe, as :func:`probe` names them
KINDS = ("passkey", "mqar", "multikey", "vartrack")
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


def _filler(count: int, rng: random.Random, haystack: str | None = None) -> str:
    """``count`` characters of filler, starting at a random sentence of :data:`FILLER`; or the first
    ``count`` characters of ``haystack`` (repeated if shorter)."""
    if haystack:
        return (haystack * (count // len(haystack) + 1))[:count]
    starts = [0] + [i + 2 for i, c in enumerate(FILLER[:-2]) if FILLER[i : i + 2] == ". "]
    offset = rng.choice(starts)
    repeats = (count + offset) // len(FILLER) + 1
    return (FILLER * repeats)[offset : offset + count]


def _check_length(kind: str, length: int) -> None:
    if length < MIN_LENGTHS[kind]:
        raise ValueError(
            f"{kind}: a probe needs at least {MIN_LENGTHS[kind]} characters, got length {length}"
        )


def passkey(
    seed: int, length: int, index: int = 0, *, depth: float | None = None, haystack: str | None = None
) -> Probe:
    """A number of :data:`PASSKEY_DIGITS` digits hidden at a random depth in filler, asked for at the end.

    The text is exactly ``length`` characters long; its one query's answer is ``" " + key`` (its last
    ``PASSKEY_DIGITS + 1`` characters). ``depth`` (0 to 1): the needle at that share of the filler (the
    start of the sentence there) instead of a random depth: the needle-in-a-haystack grid. ``haystack``: a
    text to take the filler from instead of :data:`FILLER` (the plan's recall windows: the calibration text).
    """
    _check_length("passkey", length)
    rng = _rng("passkey", seed, length, index)
    key = "".join(rng.choice(string.digits) for _ in range(PASSKEY_DIGITS))
    needle = f"The pass key is {key}. Remember it. {key} is the pass key. "
    answer = f" {key}"
    room = length - len(needle) - len(_QUESTION) - len(answer)
    filler = _filler(room, rng, haystack)
    if depth is not None and not 0 <= depth <= 1:
        raise ValueError(f"passkey: depth is a share of the filler, in [0, 1]; got {depth!r}")
    at = rng.randrange(room + 1) if depth is None else round(depth * room)
    cut = filler.rfind(". ", 0, at + (2 if depth is not None else 0))
    at = 0 if cut < 0 else cut + 2  # the needle starts a sentence
    context = filler[:at] + needle + filler[at:] + _QUESTION
    return Probe("passkey", context + answer, (Query(context, answer),))


def mqar_pairs(length: int) -> int:
    """Key-value pairs in an MQAR probe of ``length`` characters: one per 32 characters (at most
    :data:`MQAR_MAX_PAIRS`)."""
    return min(MQAR_MAX_PAIRS, max(MQAR_QUERIES, length // 32))


def mqar(
    seed: int, length: int, index: int = 0, *, pairs: int | None = None, haystack: str | None = None
) -> Probe:
    """Multi-query associative recall: key-value pairs, filler, then :data:`MQAR_QUERIES` queries.

    Keys are two lowercase letters (distinct), values two digits; a pair is written ``ab:42 ``. After
    the pairs and the filler, queries ask keys in random order, each answered before the next is asked
    (``... cd:17 ab:`` → ``42``), so query ``i``'s context holds the earlier queries with their answers.
    ``pairs`` defaults to :func:`mqar_pairs`. The text is exactly ``length`` characters long. ``haystack``:
    the filler taken from this text (as :func:`passkey`'s).
    """
    _check_length("mqar", length)
    count = mqar_pairs(length) if pairs is None else pairs
    if not MQAR_QUERIES <= count <= MQAR_MAX_PAIRS:
        raise ValueError(f"mqar: pairs must be in [{MQAR_QUERIES}, {MQAR_MAX_PAIRS}], got {count}")
    rng = _rng("mqar", seed, length, index)
    keys = rng.sample([a + b for a in string.ascii_lowercase for b in string.ascii_lowercase], count)
    values = [f"{rng.randrange(100):02d}" for _ in keys]
    head = "".join(f"{k}:{v} " for k, v in zip(keys, values, strict=True)) + "\n"
    asked = rng.sample(range(count), MQAR_QUERIES)
    tail_len = sum(len(keys[i]) + 1 + len(values[i]) + 1 for i in asked) - 1  # no space after the last
    room = length - len(head) - 1 - tail_len
    if room < 0:
        raise ValueError(f"mqar: {count} pairs do not fit in {length} characters")
    text = head + _filler(room, rng, haystack) + "\n"
    queries = []
    for n, i in enumerate(asked):
        text += f"{keys[i]}:"
        queries.append(Query(text, values[i]))
        text += values[i] + (" " if n < len(asked) - 1 else "")
    return Probe("mqar", text, tuple(queries))


def _scatter(pieces: list[str], room: int, rng: random.Random) -> str:
    """``pieces`` in order, each at a random sentence start of ``room`` characters of filler."""
    filler = _filler(room, rng)
    starts = sorted(rng.randrange(room + 1) for _ in pieces)
    out, at = "", 0
    for piece, want in zip(pieces, starts, strict=True):
        cut = filler.rfind(". ", at, max(at, want))
        where = at if cut < 0 else cut + 2
        out += filler[at:where] + piece
        at = where
    return out + filler[at:]


def _word(rng: random.Random, size: int, letters: str = string.ascii_lowercase) -> str:
    return "".join(rng.choice(letters) for _ in range(size))


def multikey(seed: int, length: int, index: int = 0) -> Probe:
    """RULER's multi-key needle in a haystack: :data:`MULTIKEY_NEEDLES` needles ``The number of KEY is
    VALUE.`` (keys five-letter words, values of :data:`PASSKEY_DIGITS` digits) at random depths in filler;
    one key is asked for at the end, its value is the answer (``" " + value``, the text's last characters),
    the other needles are distractors. The text is exactly ``length`` characters long."""
    _check_length("multikey", length)
    rng = _rng("multikey", seed, length, index)
    keys: list[str] = []
    while len(keys) < MULTIKEY_NEEDLES:
        word = _word(rng, 5)
        if word not in keys:
            keys.append(word)
    values = [_word(rng, PASSKEY_DIGITS, string.digits) for _ in keys]
    needles = [f"The number of {k} is {v}. " for k, v in zip(keys, values, strict=True)]
    asked = rng.randrange(len(keys))
    question = f"\nWhat is the number of {keys[asked]}? The number of {keys[asked]} is"
    answer = f" {values[asked]}"
    room = length - sum(map(len, needles)) - len(question) - len(answer)
    context = _scatter(needles, room, rng) + question
    return Probe("multikey", context + answer, (Query(context, answer),))


def vartrack(seed: int, length: int, index: int = 0) -> Probe:
    """RULER's variable tracking: ``VAR A = 12345.`` then :data:`VARTRACK_HOPS` assignments ``VAR B = VAR
    A.``, ``VAR C = VAR B.``, ... (names five capital letters) at increasing random depths in filler; the
    question asks which variables hold the number, the answer names them all in the order they were assigned
    (``" A B C D E"``, the text's last characters). The text is exactly ``length`` characters long."""
    _check_length("vartrack", length)
    rng = _rng("vartrack", seed, length, index)
    names: list[str] = []
    while len(names) < VARTRACK_HOPS + 1:
        word = _word(rng, 5, string.ascii_uppercase)
        if word not in names:
            names.append(word)
    value = _word(rng, PASSKEY_DIGITS, string.digits)
    lines = [f"VAR {names[0]} = {value}. "] + [f"VAR {b} = VAR {a}. " for a, b in zip(names, names[1:])]
    question = f"\nWhich variables are {value}? They are"
    answer = "".join(f" {n}" for n in names)
    room = length - sum(map(len, lines)) - len(question) - len(answer)
    context = _scatter(lines, room, rng) + question
    return Probe("vartrack", context + answer, (Query(context, answer),))


def probe(kind: str, seed: int, length: int, index: int = 0) -> Probe:
    """The probe of ``kind`` (one of :data:`KINDS`)."""
    makers = {"passkey": passkey, "mqar": mqar, "multikey": multikey, "vartrack": vartrack}
    if kind not in makers:
        raise ValueError(f"probe: kind must be one of {list(KINDS)}, got {kind!r}")
    return makers[kind](seed, length, index)
