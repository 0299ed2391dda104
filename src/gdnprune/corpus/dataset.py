"""Windows as torch tensors: a map-style ``Dataset`` over the cached windows, and the first windows of a
corpus read straight from its files (no cache) for the commands that need only a few."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from ..runtime.distributed import shard_indices
from .sources import DataFile, data_spec, iter_pieces, source_files
from .windows import CorpusWindows, encode_pieces, mixture_order, tokenize_corpus

__all__ = ["WindowDataset", "open_windows", "first_windows"]


class WindowDataset(torch.utils.data.Dataset):
    """Windows ``indices`` of a :class:`~gdnprune.corpus.windows.CorpusWindows` as a dataset of
    ``{"input_ids": LongTensor [seq_len]}``; item ``k`` is window ``indices[k]`` (its data position)."""

    def __init__(self, windows: CorpusWindows, indices: range | None = None):
        self.windows = windows
        self.indices = range(len(windows)) if indices is None else indices

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, k: int) -> dict[str, torch.Tensor]:
        return {"input_ids": torch.from_numpy(self.windows.window(self.indices[k]).astype(np.int64))}

    @property
    def seq_len(self) -> int:
        return self.windows.seq_len

    def select(self, indices: range) -> WindowDataset:
        """The items at ``indices`` of this dataset (a range of a range, no copy)."""
        return WindowDataset(self.windows, self.indices[indices.start : indices.stop : indices.step])

    def shard(self, index: int, count: int) -> WindowDataset:
        """Share ``index`` of ``count``: a contiguous block (:func:`gdnprune.runtime.distributed.shard_indices`)."""
        return self.select(shard_indices(len(self), index, count))

    def tensor(self) -> torch.Tensor:
        """Every item as one ``LongTensor [len, seq_len]`` (for small datasets)."""
        return torch.from_numpy(self.windows.windows(self.indices).astype(np.int64))


def open_windows(
    data: Any,
    tokenizer: Any,
    *,
    seq_len: int,
    cache_dir: str | os.PathLike | None = None,
    files: Sequence[Sequence[DataFile]] | None = None,
    progress: bool = False,
) -> WindowDataset:
    """Every window of ``seq_len`` tokens of a corpus (a mixture's by its rule), tokenised once into
    ``cache_dir`` and reused (:func:`~gdnprune.corpus.windows.tokenize_corpus`). Every process of a run
    may call it: one tokenises while the others wait, then each reads only the windows it asks for."""
    spec = data_spec(data)
    streams = tokenize_corpus(spec, tokenizer, files=files, cache_dir=cache_dir, progress=progress)
    return WindowDataset(CorpusWindows(streams, seq_len, spec.weights))


def _stream_windows(
    files: Sequence[DataFile], text_field: str, tokenizer: Any, seq_len: int, count: int | None
):
    """The first ``count`` (all when None) windows of one stream of files, tokenised in memory."""
    limit = None if count is None else count * seq_len
    chunks = list(
        encode_pieces(iter_pieces(files, text_field=text_field, tokenizer=tokenizer), tokenizer, limit=limit)
    )
    tokens = np.concatenate(chunks) if chunks else np.zeros(0, dtype=np.uint32)
    available = tokens.size // seq_len
    keep = available if count is None else min(available, count)
    return tokens[: keep * seq_len].reshape(keep, seq_len)


def first_windows(
    data: Any,
    tokenizer: Any,
    *,
    seq_len: int,
    num_windows: int | None = None,
    files: Sequence[Sequence[DataFile]] | None = None,
) -> torch.Tensor:
    """The first ``num_windows`` windows (all when None) of a corpus as a ``LongTensor [N, seq_len]``,
    read and tokenised from its files only as far as they need (no cache): the same windows as the first
    ones of :func:`open_windows`. ``N`` may be smaller (a short corpus), also 0."""
    spec = data_spec(data)
    per_source = [list(f) for f in files] if files is not None else [source_files(s) for s in spec.sources]
    if not spec.is_mixture:
        flat = [f for fs in per_source for f in fs]
        out = _stream_windows(flat, spec.text_field, tokenizer, seq_len, num_windows)
        return torch.from_numpy(out.astype(np.int64))
    weights = spec.weights or []
    if num_windows is None:
        needed: list[int | None] = [None] * len(per_source)
    else:
        source, index = mixture_order([num_windows] * len(per_source), weights)
        source, index = source[:num_windows], index[:num_windows]
        needed = [int(index[source == i].max(initial=-1)) + 1 for i in range(len(per_source))]
    parts = [_stream_windows(fs, spec.text_field, tokenizer, seq_len, n) for fs, n in zip(per_source, needed)]
    source, index = mixture_order([p.shape[0] for p in parts], weights)
    if num_windows is not None:
        source, index = source[:num_windows], index[:num_windows]
    out = np.empty((source.size, seq_len), dtype=np.int64)
    for i, part in enumerate(parts):
        rows = source == i
        out[rows] = part[index[rows]]
    return torch.from_numpy(out)
