"""Calibration data: token windows for the commands that read the first windows of a corpus.

* :func:`iter_documents` streams a UTF-8 text file (one document, in pieces that end at a line break) or
  a JSONL file (one JSON object per line with a ``"text"`` field; blank lines are skipped);
  :func:`read_texts` collects them.
* :func:`pack_windows` tokenises documents (no special tokens added), joins them with the tokenizer's EOS
  id (when it has one) and cuts the token stream into non-overlapping windows of ``seq_len`` tokens;
  ``num_samples`` evenly spaced windows are kept, in stream order.
* :func:`calibration_windows` is what ``score``, ``plan`` and ``prune`` use: every ``--data`` form (files,
  folders, globs, mixtures; :mod:`gdnprune.corpus`), read and tokenised only as far as ``num_samples``
  windows need; the first ``num_samples`` windows are kept.
* :func:`iter_batches` yields the windows in batches.
"""

from __future__ import annotations

import codecs
import json
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from ..corpus import DataError, data_spec
from ..corpus.dataset import first_windows

__all__ = ["iter_documents", "read_texts", "pack_windows", "iter_batches", "calibration_windows"]

# a plain text file is tokenised in pieces cut at line breaks: 64 KiB first, doubling up to 1 MiB, so that a
# few windows cost a small read and a whole file a few hundred tokenizer calls
_FIRST_PIECE, _MAX_PIECE = 1 << 16, 1 << 20


def _is_jsonl(path: Path, first_line: str) -> bool:
    if path.suffix.lower() in (".jsonl", ".ndjson"):
        return True
    if path.suffix.lower() in (".txt", ".text", ".md"):
        return False
    first = first_line.strip()
    if not first.startswith("{"):
        return False
    try:
        return isinstance(json.loads(first), dict)
    except json.JSONDecodeError:
        return False


def _decoded_lines(path: Path) -> Iterator[str]:
    """The file's lines (with their line breaks) decoded as strict UTF-8, BOM removed; errors name the byte."""
    decoder = codecs.getincrementaldecoder("utf-8")("strict")
    position, first = 0, True
    with open(path, "rb") as f:
        for raw in f:
            try:
                line = decoder.decode(raw)
            except UnicodeDecodeError as exc:
                raise ValueError(
                    f"{path}: not UTF-8 text ({exc.reason} at byte {position + exc.start})"
                ) from None
            position += len(raw)
            if first and line.startswith("\ufeff"):
                line = line[1:]
            first = False
            yield line
        try:
            decoder.decode(b"", final=True)
        except UnicodeDecodeError as exc:
            raise ValueError(f"{path}: not UTF-8 text ({exc.reason} at byte {position})") from None


def iter_documents(path: str | Path) -> Iterator[tuple[str, bool]]:
    """Stream the calibration text of ``path`` as ``(text, starts_a_document)`` pieces.

    A ``.jsonl`` / ``.ndjson`` file (or any file whose first non-blank line is a JSON object, unless it
    ends in ``.txt``) is read as JSON Lines: every non-blank line must be an object with a string
    ``"text"`` field, one document per line. Anything else is one UTF-8 text document, yielded in pieces
    that end at a line break (64 KiB, then doubling up to 1 MiB; only the first starts the document).

    Raises:
        ValueError: the file is not UTF-8, a JSONL line is not valid JSON or lacks a string ``"text"``,
            or there is no text at all.
        OSError: the file cannot be read.
    """
    path = Path(path)
    lines = _decoded_lines(path)
    head: list[str] = []
    for line in lines:  # look for the first non-blank line to tell JSONL from text
        head.append(line)
        if line.strip():
            break
    jsonl = _is_jsonl(path, head[-1] if head else "")
    found = False
    if jsonl:
        for number, line in enumerate(_chain(head, lines), start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{number}: not valid JSON ({exc.msg})") from None
            except RecursionError:
                raise ValueError(f"{path}:{number}: not valid JSON (nested too deeply)") from None
            if not isinstance(record, dict) or not isinstance(record.get("text"), str):
                found_type = (
                    type(record.get("text")).__name__
                    if isinstance(record, dict) and "text" in record
                    else "none"
                )
                raise ValueError(
                    f'{path}:{number}: expected a JSON object with a string "text" field, found {found_type}'
                )
            if record["text"]:
                found = True
                yield record["text"], True
        if not found:
            raise ValueError(f'{path}: the JSONL file holds no non-empty "text" field')
        return
    piece: list[str] = []
    size, first, limit = 0, True, _FIRST_PIECE
    for line in _chain(head, lines):
        piece.append(line)
        size += len(line)
        if size >= limit:
            text = "".join(piece)
            found = found or bool(text.strip())
            yield text, first
            piece, size, first, limit = [], 0, False, min(2 * limit, _MAX_PIECE)
    text = "".join(piece)
    found = found or bool(text.strip())
    if not found:
        raise ValueError(f"{path}: the file holds no text")
    if text:
        yield text, first


def _chain(head: list[str], rest: Iterator[str]) -> Iterator[str]:
    yield from head
    yield from rest


def read_texts(path: str | Path) -> list[str]:
    """Read the calibration documents of ``path`` (see :func:`iter_documents`) into a list of strings."""
    docs: list[str] = []
    for text, new in iter_documents(path):
        if new or not docs:
            docs.append(text)
        else:
            docs[-1] += text
    return docs


def pack_windows(
    texts: Sequence[str],
    tokenizer: Any,
    *,
    seq_len: int,
    num_samples: int | None = None,
    warn: bool = True,
) -> torch.Tensor:
    """Tokenise ``texts`` and pack them into windows, a ``LongTensor [N, seq_len]``.

    Documents are encoded with ``tokenizer(text, add_special_tokens=False)`` and concatenated, separated
    by ``tokenizer.eos_token_id`` when the tokenizer has one; the stream is cut into consecutive windows
    of ``seq_len`` tokens (the tail is dropped). With ``num_samples`` smaller than the number of windows,
    a fixed, evenly spaced subset is kept (first and last included), in stream order; with fewer windows
    than requested, all are used (with a ``UserWarning`` when ``warn``).

    Raises:
        ValueError: ``seq_len`` < 2, ``num_samples`` < 1, or the text is shorter than one window.
    """
    _check_sizes(seq_len, num_samples)
    windows = _windows(_token_stream(((text, True) for text in texts), tokenizer, None), seq_len, None)
    _warn_if_short(windows.shape[0], seq_len, num_samples, warn)
    if num_samples is None or num_samples >= windows.shape[0]:
        return windows
    if num_samples == 1:
        return windows[:1].clone()
    available = windows.shape[0]
    index = (
        (torch.arange(num_samples, dtype=torch.float64) * ((available - 1) / (num_samples - 1)))
        .round()
        .long()
    )
    return windows[index].clone()


def calibration_windows(
    path: Any,
    tokenizer: Any,
    *,
    seq_len: int,
    num_samples: int | None = None,
    warn: bool = True,
    text_field: str | None = None,
) -> torch.Tensor:
    """The first ``num_samples`` windows of ``seq_len`` tokens of a corpus, a ``LongTensor [N, seq_len]``.

    ``path`` is anything :func:`gdnprune.corpus.data_spec` takes: a file, folder or glob, a list of them,
    or a :class:`~gdnprune.corpus.DataSpec` (a mixture, a text field); every ``--data`` form of the CLI.
    The files are read and tokenised as a stream and only until the windows are full (no cache), so a
    large corpus costs no more than what is used; they are the first windows of
    :func:`gdnprune.corpus.open_windows` on the same corpus. ``num_samples=None`` uses the whole corpus.

    Raises:
        gdnprune.corpus.DataError: a file cannot be read, or the corpus is shorter than one window.
    """
    _check_sizes(seq_len, num_samples)
    spec = data_spec(path, text_field=text_field)
    windows = first_windows(spec, tokenizer, seq_len=seq_len, num_windows=num_samples)
    if windows.shape[0] == 0:
        raise DataError(f"{spec}: the calibration text gives fewer than one window of {seq_len} tokens")
    _warn_if_short(windows.shape[0], seq_len, num_samples, warn)
    return windows


def _check_sizes(seq_len: int, num_samples: int | None) -> None:
    if seq_len < 2:
        raise ValueError(f"seq_len must be >= 2, got {seq_len}")
    if num_samples is not None and num_samples < 1:
        raise ValueError(f"num_samples must be >= 1, got {num_samples}")


def _token_stream(pieces, tokenizer: Any, needed: int | None) -> torch.Tensor:
    """Token ids of text pieces, EOS between documents, stopping once ``needed`` tokens are there."""
    eos = getattr(tokenizer, "eos_token_id", None)
    parts: list[torch.Tensor] = []
    count = 0
    for i, (text, new_document) in enumerate(pieces):
        if i and new_document and eos is not None:
            parts.append(torch.tensor([eos], dtype=torch.long))
            count += 1
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        parts.append(torch.as_tensor(ids, dtype=torch.long).reshape(-1))
        count += parts[-1].numel()
        if needed is not None and count >= needed:
            break
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long)


def _warn_if_short(available: int, seq_len: int, num_samples: int | None, warn: bool) -> None:
    if num_samples is not None and num_samples > available and warn:
        warnings.warn(
            f"the calibration text gives {available} windows of {seq_len} tokens, fewer than the "
            f"{num_samples} requested; using all of them",
            UserWarning,
            stacklevel=4,
        )


def _windows(stream: torch.Tensor, seq_len: int, num_samples: int | None) -> torch.Tensor:
    """The first ``num_samples`` (all when None) windows of ``seq_len`` tokens of ``stream``."""
    available = stream.numel() // seq_len
    if available == 0:
        raise ValueError(
            f"the calibration text has {stream.numel()} tokens, fewer than one window of {seq_len}"
        )
    keep = available if num_samples is None else min(available, num_samples)
    return stream[: keep * seq_len].view(keep, seq_len).clone()


def iter_batches(windows: torch.Tensor, batch_size: int) -> Iterator[torch.Tensor]:
    """Yield consecutive batches ``[<=batch_size, seq_len]`` of ``windows``."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    for start in range(0, windows.shape[0], batch_size):
        yield windows[start : start + batch_size]
