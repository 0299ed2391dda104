"""Calibration data for scoring: read text or JSONL, tokenise, pack into fixed-length windows.

* :func:`read_texts` reads a UTF-8 text file (one document) or a JSONL file (one JSON object per line
  with a ``"text"`` field; blank lines are skipped).
* :func:`pack_windows` tokenises the documents with a tokenizer (no special tokens added), joins them
  with the tokenizer's EOS id (when it has one) and cuts the token stream into non-overlapping windows
  of ``seq_len`` tokens; ``num_samples`` evenly spaced windows are kept, in stream order.
* :func:`iter_batches` yields the windows in batches.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any, Iterator, Sequence

import torch

__all__ = ["read_texts", "pack_windows", "iter_batches", "calibration_windows"]


def _is_jsonl(path: Path, text: str) -> bool:
    if path.suffix.lower() in (".jsonl", ".ndjson"):
        return True
    if path.suffix.lower() in (".txt", ".text", ".md"):
        return False
    first = next((line.strip() for line in text.splitlines() if line.strip()), "")
    if not first.startswith("{"):
        return False
    try:
        return isinstance(json.loads(first), dict)
    except json.JSONDecodeError:
        return False


def read_texts(path: str | Path) -> list[str]:
    """Read calibration documents from ``path``.

    A ``.jsonl`` / ``.ndjson`` file (or any file whose first non-blank line is a JSON object, unless it
    ends in ``.txt``) is read as JSON Lines: every non-blank line must be an object with a string
    ``"text"`` field, one document per line. Anything else is one UTF-8 text document.

    Raises:
        ValueError: the file is not UTF-8, a JSONL line is not valid JSON or lacks a string ``"text"``,
            or there is no text at all.
        OSError: the file cannot be read.
    """
    path = Path(path)
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    if text.startswith("\ufeff"):
        text = text[1:]
    if not _is_jsonl(path, text):
        if not text.strip():
            raise ValueError(f"{path}: the file holds no text")
        return [text]
    docs = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}:{number}: not valid JSON ({exc.msg})") from None
        if not isinstance(record, dict) or not isinstance(record.get("text"), str):
            found = type(record.get("text")).__name__ if isinstance(record, dict) and "text" in record else "none"
            raise ValueError(f"{path}:{number}: expected a JSON object with a string \"text\" field, found {found}")
        if record["text"]:
            docs.append(record["text"])
    if not docs:
        raise ValueError(f"{path}: the JSONL file holds no non-empty \"text\" field")
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
    if seq_len < 2:
        raise ValueError(f"seq_len must be >= 2, got {seq_len}")
    if num_samples is not None and num_samples < 1:
        raise ValueError(f"num_samples must be >= 1, got {num_samples}")
    eos = getattr(tokenizer, "eos_token_id", None)
    pieces: list[torch.Tensor] = []
    for i, text in enumerate(texts):
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        if i and eos is not None:
            pieces.append(torch.tensor([eos], dtype=torch.long))
        pieces.append(torch.as_tensor(ids, dtype=torch.long).reshape(-1))
    stream = torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.long)
    available = stream.numel() // seq_len
    if available == 0:
        raise ValueError(f"the calibration text has {stream.numel()} tokens, fewer than one window of {seq_len}")
    windows = stream[: available * seq_len].view(available, seq_len)
    if num_samples is None or num_samples >= available:
        if num_samples is not None and num_samples > available and warn:
            warnings.warn(
                f"the calibration text gives {available} windows of {seq_len} tokens, fewer than the "
                f"{num_samples} requested; using all of them", UserWarning, stacklevel=3)
        return windows.clone()
    if num_samples == 1:
        return windows[:1].clone()
    index = (torch.arange(num_samples, dtype=torch.float64) * ((available - 1) / (num_samples - 1))).round().long()
    return windows[index].clone()


def iter_batches(windows: torch.Tensor, batch_size: int) -> Iterator[torch.Tensor]:
    """Yield consecutive batches ``[<=batch_size, seq_len]`` of ``windows``."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    for start in range(0, windows.shape[0], batch_size):
        yield windows[start : start + batch_size]


def calibration_windows(
    path: str | Path, tokenizer: Any, *, seq_len: int, num_samples: int | None = None, warn: bool = True
) -> torch.Tensor:
    """:func:`read_texts` then :func:`pack_windows`: the calibration windows of a data file."""
    return pack_windows(read_texts(path), tokenizer, seq_len=seq_len, num_samples=num_samples, warn=warn)
