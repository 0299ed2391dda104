"""The scores file: read, validate, write, match its layer prefixes, turn its orders into permutations.

A scores file is a JSON object (``gdnprune score`` writes it, ``gdnprune sort`` reads it)::

    {"format": "gdnprune-scores", "version": 1, "method": "projection", "num_tokens": 65536,
     "layers": {"model.layers.0.linear_attn": payload, ...},
     "hidden": {"shape": {"hidden_size": 4096}, "channel_order_most_important_first": [...], ...},
     ...metadata}

Each payload holds the four orders of :mod:`gdnprune.model.geometry` (``*_order_most_important_first``), the
raw per-element scores, the layer's ``shape`` and ``layout``; ``hidden`` (optional) orders the hidden
channels, the residual stream's width (:mod:`gdnprune.model.hidden`). Two levels of checking:

* :func:`read_scores` — what ``sort`` accepts: an object whose ``"layers"`` maps prefixes to objects
  (a hand-written dict of orders is fine); the orders are checked against the checkpoint later;
* :func:`load_scores` / :func:`check_scores` — a file that ``gdnprune score`` wrote: also the format,
  the version and every payload's orders and shape.

Layer prefixes match with or without the ``language_model.`` part of a vision-language checkpoint
(:func:`matching_prefixes`), because ``AutoModelForCausalLM`` loads those checkpoints without it. The same
rule serves plan files. This module does not import torch.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from ..model import geometry, hidden, subblock_geometry, subblock_shapes
from ..model.geometry import ORDER_KEYS
from ..model.subblock_geometry import block_kind_of
from ..runtime.fileio import check_output_file, read_json, write_json_atomic

__all__ = [
    "SCORES_FORMAT",
    "SCORES_VERSION",
    "ScoresError",
    "read_scores",
    "check_scores",
    "load_scores",
    "save_scores",
    "matching_prefixes",
    "match_layers",
    "gdn_entries",
    "resolve_orders",
    "scores_to_permutations",
    "prefix_alias",
]

#: ``format`` field of a scores file.
SCORES_FORMAT = "gdnprune-scores"
#: ``version`` field of a scores file.
SCORES_VERSION = 1

# Prefix spellings of the same layer: vision-language checkpoints store the text model under
# ``model.language_model.``, which AutoModelForCausalLM loads as ``model.``.
_PREFIX_ALIASES = (("model.language_model.", "model."),)


class ScoresError(ValueError):
    """A scores file (or dict) that cannot be read or applied to the checkpoint."""


def read_scores(scores: str | os.PathLike | Mapping) -> dict:
    """Read a scores file (or pass a dict through the same checks): an object with a ``layers`` object.

    ``layers`` maps GDN layer prefixes to payloads (the four ``*_order_most_important_first`` keys of
    :func:`gdnprune.model.geometry.orders_from_payload`); other top-level keys are metadata. The orders are
    checked against the layers they are applied to (:func:`resolve_orders`).

    Raises:
        ScoresError: the file cannot be read, is not JSON, or lacks a ``layers`` object of objects.
    """
    where = "scores"
    if not isinstance(scores, (Mapping, str, os.PathLike)):
        raise ScoresError(f"scores must be a file path or a mapping, found {type(scores).__name__}")
    if not isinstance(scores, Mapping):
        where = f"scores file {os.fspath(scores)}"
        scores = read_json(scores, ScoresError, where)
    if not isinstance(scores, Mapping):
        raise ScoresError(f"{where}: expected a JSON object, found {type(scores).__name__}")
    layers = scores.get("layers")
    if not isinstance(layers, Mapping) or not (layers or isinstance(scores.get(hidden.HIDDEN_KEY), Mapping)):
        raise ScoresError(
            f"{where}: expected a non-empty 'layers' object mapping GDN layer prefixes to payloads"
        )
    bad = [k for k, v in layers.items() if not isinstance(k, str) or not isinstance(v, Mapping)]
    if bad:
        raise ScoresError(
            f"{where}: layers[{bad[0]!r}] is not an object of *_order_most_important_first lists"
        )
    return dict(scores)


def check_scores(scores: Any, source: str = "scores") -> Mapping[str, Any]:
    """Check that ``scores`` is a scores file as ``gdnprune score`` writes it; returns it.

    Raises:
        ScoresError: wrong ``format`` or ``version``, no ``layers``, or a payload that lacks an order or its
            ``shape``, or whose orders do not fit its shape.
    """
    if not isinstance(scores, Mapping) or scores.get("format") != SCORES_FORMAT:
        found = scores.get("format") if isinstance(scores, Mapping) else type(scores).__name__
        raise ScoresError(
            f"{source}: not a gdnprune scores file (format {found!r}, expected {SCORES_FORMAT!r})"
        )
    if scores.get("version") != SCORES_VERSION:
        raise ScoresError(
            f"{source}: unsupported scores version {scores.get('version')!r}, expected {SCORES_VERSION}"
        )
    layers = scores.get("layers")
    if not isinstance(layers, Mapping) or not layers:
        raise ScoresError(f'{source}: no "layers" in the scores file')
    if scores.get(hidden.HIDDEN_KEY) is not None:
        _check_hidden_payload(scores[hidden.HIDDEN_KEY], source)
    for prefix, payload in layers.items():
        if not isinstance(payload, Mapping):
            raise ScoresError(f"{source}: layer {prefix!r} is not an object")
        if (
            block_kind_of(prefix) is not None
        ):  # an attention or MLP sub-block (gdnprune.model.subblock_geometry)
            _check_block_payload(prefix, payload, source)
            continue
        missing = [k for k in (*ORDER_KEYS, "shape") if k not in payload]
        if missing:
            raise ScoresError(f"{source}: layer {prefix!r} lacks {missing}")
        try:
            shape = payload["shape"]
            if not isinstance(shape, Mapping):
                raise ValueError(
                    f"shape must be an object of the four GDNShape fields, found {type(shape).__name__}"
                )
            geometry.orders_from_payload(payload, geometry.GDNShape(**shape))
        except (TypeError, ValueError) as exc:
            raise ScoresError(f"{source}: layer {prefix!r}: {exc}") from None
    return scores


def _check_block_payload(prefix: str, payload: Mapping, source: str) -> None:
    """A sub-block's payload: its ``shape`` (the geometry's fields) and orders that fit it."""
    shape = payload.get("shape")
    kind = block_kind_of(prefix, shape if isinstance(shape, Mapping) else ())
    assert kind is not None  # called for the prefixes of sub-blocks only
    try:
        if not isinstance(shape, Mapping):
            raise ValueError(
                f"shape must be an object of the {kind.geometry.__name__} fields, found "
                f"{type(shape).__name__}"
            )
        block_shape = kind.geometry(**shape)
        subblock_geometry.orders_from_payload(payload, block_shape)
    except (TypeError, ValueError) as exc:
        raise ScoresError(f"{source}: sub-block {prefix!r}: {exc}") from None
    missing = [key for key in subblock_geometry.order_keys(block_shape) if key not in payload]
    if missing:
        raise ScoresError(f"{source}: sub-block {prefix!r} lacks the orders {missing}")


def _check_hidden_payload(payload: Any, source: str) -> None:
    """The hidden channels' entry: its ``shape`` (``hidden_size``) and an order that fits it."""
    try:
        if not isinstance(payload, Mapping) or not isinstance(payload.get("shape"), Mapping):
            raise ValueError("expected an object with a shape {hidden_size} and the channel order")
        shape = subblock_shapes.HiddenShape(**payload["shape"])
        if hidden.ORDER_KEY not in payload:
            raise ValueError(f"no {hidden.ORDER_KEY}")
        hidden.orders_from_payload(payload, shape)
    except (TypeError, ValueError) as exc:
        raise ScoresError(f"{source}: the hidden channels' entry: {exc}") from None


def load_scores(path: str | os.PathLike) -> dict[str, Any]:
    """Read a scores file that ``gdnprune score`` / :func:`save_scores` wrote and check all of it."""
    return dict(check_scores(read_scores(path), os.fspath(path)))


def save_scores(scores: Mapping[str, Any], path: str | os.PathLike, *, overwrite: bool = True) -> Path:
    """Write a scores dict as JSON, through a temporary file renamed into place. Returns the path.

    The file gets the permissions a new file gets under the process umask (like ``open(path, "w")``).
    With ``overwrite=False`` an existing file is an error.
    """
    check_scores(scores)
    check_output_file(path, overwrite)
    return write_json_atomic(path, scores, indent=1)


def prefix_alias(prefix: str) -> str:
    """``prefix`` spelled without the ``language_model.`` part of a vision-language checkpoint."""
    for long, short in _PREFIX_ALIASES:
        if prefix.startswith(long):
            return short + prefix[len(long) :]
    return prefix


def matching_prefixes(key: str, prefixes: Iterable[str]) -> list[str]:
    """The GDN layer prefixes among ``prefixes`` that ``key`` names: ``key`` itself, else every prefix that is
    the same layer spelled with or without the ``language_model.`` part of a vision-language checkpoint."""
    prefixes = list(prefixes)
    if key in prefixes:
        return [key]
    return [p for p in prefixes if prefix_alias(p) == prefix_alias(key)]


def match_layers(entries: Mapping[str, Any], prefixes: Iterable[str], what: str = "scores") -> dict[str, Any]:
    """Map every entry of ``entries`` (keyed by a layer prefix or its alias) to one of ``prefixes``.

    Returns ``{prefix: value}``. Raises :class:`ScoresError` (a ``ValueError``) for an entry that names no
    layer, or two entries that name the same layer; ``what`` names the file in the message.
    """
    known = list(prefixes)
    out: dict[str, Any] = {}
    for key, value in entries.items():
        candidates = matching_prefixes(key, known) if isinstance(key, str) else []
        if len(candidates) != 1:
            raise ScoresError(
                f"{what} entry {key!r} is not a GDN layer of this checkpoint (its {len(known)} GDN layers: "
                f"{known[:3]}{' ...' if len(known) > 3 else ''})"
            )
        prefix = candidates[0]
        if prefix in out:
            raise ScoresError(f"{what} entries {key!r} and another name the same GDN layer {prefix!r}")
        out[prefix] = value
    return out


def gdn_entries(layers: Mapping[str, Any]) -> dict[str, Any]:
    """The GDN layers' entries of a scores (or plan) file's ``layers``: every key that names no sub-block
    (:func:`gdnprune.model.subblock_geometry.block_kind_of`)."""
    return {k: v for k, v in layers.items() if not isinstance(k, str) or block_kind_of(k) is None}


def resolve_orders(
    permutations: Mapping | None, shapes: Mapping[str, geometry.GDNShape]
) -> tuple[dict[str, dict], list[str]]:
    """Validated orders (numpy, see :func:`gdnprune.model.geometry.orders_from_payload`) for the layers ``shapes``.

    ``permutations`` maps layer prefixes (aliases allowed) to score payloads or
    :class:`~gdnprune.gated_delta_net.GDNPermutation` objects. Returns ``{prefix: orders}`` and the
    prefixes of ``shapes`` that have no entry.

    Raises:
        ScoresError: an entry that names no layer (or the same layer twice), or orders that do not fit.
    """
    if permutations is None:
        return {}, []
    out: dict[str, dict] = {}
    for prefix, value in match_layers(permutations, shapes).items():
        shape = shapes[prefix]
        try:
            if hasattr(value, "to_score_payload"):  # a GDNPermutation (its torch module is not imported here)
                value.indices(shape)  # checks the orders' sizes against the layer
                out[prefix] = geometry.orders_from_payload(value.to_score_payload(), shape)
            elif isinstance(value, Mapping):
                out[prefix] = geometry.orders_from_payload(value, shape)
            else:
                raise ValueError(
                    f"expected a GDNPermutation or a score payload, found {type(value).__name__}"
                )
        except ValueError as exc:
            raise ScoresError(f"scores for GDN layer {prefix!r} ({shape}): {exc}") from None
    missing = [p for p in shapes if p not in out]
    return out, missing


def scores_to_permutations(scores: Mapping[str, Any]) -> dict:
    """``{prefix: GDNPermutation}`` of the GDN layers of a scores-file dict (geometry read from each payload's
    ``shape``; the sub-blocks' orders are :mod:`gdnprune.model.subblock_geometry`' and left out)."""
    from ..gated_delta_net import GDNPermutation  # lazy: torch; scores_file.py is torch-free

    out = {}
    for prefix, payload in gdn_entries(check_scores(scores)["layers"]).items():
        out[prefix] = GDNPermutation.from_score_payload(payload, geometry.GDNShape(**payload["shape"]))
    return out
