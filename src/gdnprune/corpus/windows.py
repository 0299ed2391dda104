"""Tokenise once, share, reuse: a corpus's tokens in a ``uint32`` file on disk, and windows over it (numpy).

**The token stream.** Documents are encoded with ``tokenizer(text, add_special_tokens=False)`` and joined
with the tokenizer's EOS id (when it has one) between documents; the pieces of one text file are joined
without. Window ``i`` of ``seq_len`` tokens is tokens ``[i * seq_len, (i + 1) * seq_len)``; the tail is
dropped. The tokens do not depend on ``seq_len``, so a new ``seq_len`` reuses them.

**The cache.** :func:`tokenize_corpus` writes each stream (all sources, or each source of a mixture) to
``<cache_dir>/<fingerprint>/tokens.u32`` with a ``meta.json``, in batches (memory does not grow with the
corpus), into a temporary folder renamed into place at the end. The fingerprint covers every input file's
path, size and modification time, the text field and the tokenizer (vocabulary, merges, normaliser,
special tokens, chat template); a matching folder is reused, anything else is a new one. One process
builds while the others wait on a lock file (``fcntl.flock``), so processes of one run, launched together
or not, tokenise once. ``cache_dir`` default: :func:`default_cache_dir`.

**The mixture rule.** With weights ``w_i`` (normalised to sum 1), window ``j`` (from 0) of source ``i`` has
the position ``(j + 1/2) / w_i``; the mixture is every window in order of position (ties: the sources in
the order given), up to the first source that runs out: window ``(i, j)`` is in when its position is
smaller than ``(n_k + 1/2) / w_k`` for every source ``k`` with ``n_k`` windows. So every prefix of the
mixture holds each source within about one window of its share, and no window repeats.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .sources import DataFile, DataSpec, EmptyDataError, Piece, data_spec, iter_pieces, source_files

__all__ = [
    "FORMAT",
    "TokenStream",
    "CorpusWindows",
    "default_cache_dir",
    "tokenizer_fingerprint",
    "stream_fingerprint",
    "tokenize_corpus",
    "encode_pieces",
    "mixture_order",
]

FORMAT = 1
TOKENS, META = "tokens.u32", "meta.json"
# documents are tokenised in batches of 64 KiB characters first, doubling up to 1 MiB (the tokenizer runs
# a batch in parallel; a few windows cost a small read)
FIRST_BATCH_CHARS, BATCH_CHARS = 1 << 16, 1 << 20


@dataclass(frozen=True)
class TokenStream:
    """One tokenised stream on disk: ``path`` holds ``num_tokens`` little-endian ``uint32`` ids."""

    path: Path
    num_tokens: int
    num_documents: int
    fingerprint: str
    reused: bool

    def tokens(self) -> np.ndarray:
        """The whole stream as a read-only memory map (no copy)."""
        if self.num_tokens == 0:
            return np.zeros(0, dtype=np.uint32)
        return np.memmap(self.path, dtype="<u4", mode="r", shape=(self.num_tokens,))


def default_cache_dir() -> Path:
    """``$GDNPRUNE_DATA_CACHE`` when set, else ``gdnprune-windows`` in the ``datasets`` cache
    (``$HF_DATASETS_CACHE``, by default ``~/.cache/huggingface/datasets``)."""
    if os.environ.get("GDNPRUNE_DATA_CACHE"):
        return Path(os.environ["GDNPRUNE_DATA_CACHE"]).expanduser()
    import datasets.config  # lazy: sources imported it already, after its offline switch

    return Path(datasets.config.HF_DATASETS_CACHE) / "gdnprune-windows"


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """A sha256 of what decides the ids: the fast tokenizer's definition (truncation and padding left out,
    they change when it is called) or the slow one's vocabulary, its class, special tokens and chat
    template."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        definition = json.loads(backend.to_str())
        definition.pop("truncation", None)
        definition.pop("padding", None)
    else:
        definition = sorted(tokenizer.get_vocab().items())
    record = dict(
        cls=type(tokenizer).__name__,
        definition=definition,
        special=getattr(tokenizer, "special_tokens_map", {}),
        eos=getattr(tokenizer, "eos_token_id", None),
        chat=getattr(tokenizer, "chat_template", None),
    )
    return hashlib.sha256(json.dumps(record, sort_keys=True, default=str).encode()).hexdigest()


def _file_record(file: DataFile) -> list:
    paths = [file.path] if file.path.is_file() else sorted(p for p in file.path.rglob("*") if p.is_file())
    out = []
    for p in paths:
        st = p.stat()
        out.append([str(p.resolve()), st.st_size, st.st_mtime_ns])
    return [file.kind, out]


def stream_fingerprint(files: Sequence[DataFile], text_field: str, tokenizer_sha: str) -> str:
    """The sha256 of one stream's inputs: every file's path, size and mtime, the text field, the tokenizer."""
    record = dict(
        format=FORMAT,
        files=[_file_record(f) for f in files],
        text_field=text_field,
        tokenizer=tokenizer_sha,
    )
    return hashlib.sha256(json.dumps(record, sort_keys=True).encode()).hexdigest()


def _batches(pieces: Iterator[Piece]) -> Iterator[list[Piece]]:
    batch: list[Piece] = []
    size, limit = 0, FIRST_BATCH_CHARS
    for piece in pieces:
        batch.append(piece)
        size += len(piece.text)
        if size >= limit:
            yield batch
            batch, size, limit = [], 0, min(2 * limit, BATCH_CHARS)
    if batch:
        yield batch


def encode_pieces(
    pieces: Iterator[Piece], tokenizer: Any, *, limit: int | None = None
) -> Iterator[np.ndarray]:
    """The token stream of ``pieces`` as ``uint32`` arrays, one per batch (64 KiB of
    characters first, doubling up to 1 MiB) (EOS before every document but the first); stops once ``limit`` tokens are out."""
    eos = getattr(tokenizer, "eos_token_id", None)
    started, count = False, 0
    for batch in _batches(pieces):
        ids = tokenizer([p.text for p in batch], add_special_tokens=False)["input_ids"]
        parts = []
        for piece, piece_ids in zip(batch, ids):
            if started and piece.new_document and eos is not None:
                parts.append(np.array([eos], dtype=np.uint32))
            parts.append(np.asarray(piece_ids, dtype=np.uint32))
            started = True
        out = np.concatenate(parts)
        count += out.size
        yield out
        if limit is not None and count >= limit:
            return


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _read_meta(folder: Path) -> dict | None:
    try:
        meta = json.loads((folder / META).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    size = (folder / TOKENS).stat().st_size if (folder / TOKENS).is_file() else -1
    return meta if meta.get("format") == FORMAT and size == 4 * meta.get("num_tokens", -1) else None


def _build(
    folder: Path, files: Sequence[DataFile], fingerprint: str, text_field: str, tokenizer: Any, bar: Any
) -> dict:
    """Tokenise ``files`` into a temporary folder next to ``folder`` and rename it into place."""
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.tmp-", dir=folder.parent))
    try:
        num_tokens = 0
        documents = 0
        done_bytes = 0
        current: Path | None = None
        sizes = {f.path: _size(f) for f in files}
        base = bar.n if bar is not None else 0

        def counted() -> Iterator[Piece]:
            nonlocal documents, done_bytes, current
            for piece in iter_pieces(files, text_field=text_field, tokenizer=tokenizer):
                if piece.file != current:
                    if current is not None:
                        done_bytes += sizes[current]
                    current = piece.file
                documents += piece.new_document
                if bar is not None:
                    bar.update(min(len(piece.text), max(0, base + done_bytes + sizes[piece.file] - bar.n)))
                yield piece

        with open(tmp / TOKENS, "wb") as out:
            for chunk in encode_pieces(counted(), tokenizer):
                out.write(chunk.astype("<u4", copy=False).tobytes())
                num_tokens += chunk.size
            out.flush()
            os.fsync(out.fileno())
        meta = dict(
            format=FORMAT,
            fingerprint=fingerprint,
            num_tokens=num_tokens,
            num_documents=documents,
            files=[str(f.path) for f in files],
            text_field=text_field,
            eos_token_id=getattr(tokenizer, "eos_token_id", None),
            built=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        )
        (tmp / META).write_text(json.dumps(meta, indent=1), encoding="utf-8")
        if folder.exists():
            shutil.rmtree(folder)
        os.rename(tmp, folder)
        return meta
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def _size(file: DataFile) -> int:
    if file.path.is_file():
        return file.path.stat().st_size
    return sum(p.stat().st_size for p in file.path.rglob("*") if p.is_file())


def _open_stream(
    files: Sequence[DataFile], text_field: str, tokenizer: Any, tokenizer_sha: str, cache: Path, bar: Any
) -> TokenStream:
    fingerprint = stream_fingerprint(files, text_field, tokenizer_sha)
    folder = cache / fingerprint[:40]
    meta = _read_meta(folder)
    reused = meta is not None and meta.get("fingerprint") == fingerprint
    if not reused:
        with _locked(cache / f".{fingerprint[:40]}.lock"):
            meta = _read_meta(folder)  # another process may have built it while this one waited
            reused = meta is not None and meta.get("fingerprint") == fingerprint
            if not reused:
                meta = _build(folder, files, fingerprint, text_field, tokenizer, bar)
    assert meta is not None
    return TokenStream(folder / TOKENS, meta["num_tokens"], meta["num_documents"], fingerprint, reused)


def tokenize_corpus(
    data: Any,
    tokenizer: Any,
    *,
    files: Sequence[Sequence[DataFile]] | None = None,
    cache_dir: str | os.PathLike | None = None,
    progress: bool = False,
) -> list[TokenStream]:
    """The token streams of a corpus, built once and reused (see the module notes): one stream for all the
    sources in order, or one per source of a mixture. ``files``: the files of every source as
    :func:`~gdnprune.corpus.check_data` returned them (default: every file the sources name).
    ``progress``: a tqdm bar over the input bytes while tokenising.

    Raises:
        DataError: a file cannot be read; EmptyDataError when a stream holds no token.
        OSError: the cache folder cannot be written.
    """
    spec: DataSpec = data_spec(data)
    per_source = [list(f) for f in files] if files is not None else [source_files(s) for s in spec.sources]
    groups = per_source if spec.is_mixture else [[f for fs in per_source for f in fs]]
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    cache.mkdir(parents=True, exist_ok=True)
    tokenizer_sha = tokenizer_fingerprint(tokenizer)
    bar = None
    if progress:
        from tqdm.auto import tqdm  # lazy: only a visible bar needs it

        total = sum(_size(f) for group in groups for f in group)
        bar = tqdm(total=total, unit="B", unit_scale=True, desc="tokenising", leave=False)
    streams, done = [], 0
    try:
        for group in groups:
            streams.append(_open_stream(group, spec.text_field, tokenizer, tokenizer_sha, cache, bar))
            done += sum(_size(f) for f in group)
            if bar is not None:
                bar.update(max(0, done - bar.n))
    finally:
        if bar is not None:
            bar.close()
    for group, stream in zip(groups, streams):
        if stream.num_tokens == 0:
            raise EmptyDataError(f"{', '.join(str(f.path) for f in group)}: no text to tokenise")
    return streams


def mixture_order(counts: Sequence[int], weights: Sequence[float]) -> tuple[np.ndarray, np.ndarray]:
    """The windows of a mixture by the module's rule: ``(source, index)`` arrays, in mixture order."""
    w = np.asarray(weights, dtype=np.float64)
    w = w / w.sum()
    n = np.asarray(counts, dtype=np.int64)
    limit = np.min((n + 0.5) / w)
    sources, indices, keys = [], [], []
    for i, (count, weight) in enumerate(zip(n, w)):
        j = np.arange(count, dtype=np.int64)
        key = (j + 0.5) / weight
        keep = key < limit
        sources.append(np.full(int(keep.sum()), i, dtype=np.int64))
        indices.append(j[keep])
        keys.append(key[keep])
    source, index, key = np.concatenate(sources), np.concatenate(indices), np.concatenate(keys)
    order = np.lexsort((source, key))
    return source[order], index[order]


class CorpusWindows:
    """Windows of ``seq_len`` tokens over token streams (a mixture when ``weights`` are given): random access
    by window index, read from disk (``os.pread``: nothing but the asked windows enters the process)."""

    def __init__(self, streams: Sequence[TokenStream], seq_len: int, weights: Sequence[float] | None = None):
        if seq_len < 2:
            raise ValueError(f"`seq_len` must be >= 2, got {seq_len}")
        self.streams = list(streams)
        self.seq_len = seq_len
        counts = [s.num_tokens // seq_len for s in self.streams]
        if weights is None:
            if len(self.streams) != 1:
                raise ValueError(f"expected one token stream without weights, found {len(self.streams)}")
            self._source = self._index = None
            self._length = counts[0]
        else:
            self._source, self._index = mixture_order(counts, weights)
            self._length = int(self._source.size)
        self._fds: dict[int, int] = {}
        self._pid = os.getpid()

    def __len__(self) -> int:
        return self._length

    def locate(self, i: int) -> tuple[int, int]:
        """``(stream, window of that stream)`` of mixture window ``i``."""
        if not -self._length <= i < self._length:
            raise IndexError(f"window {i} out of range for {self._length} windows")
        i %= self._length
        if self._source is None:
            return 0, i
        return int(self._source[i]), int(self._index[i])

    def _fd(self, stream: int) -> int:
        if self._pid != os.getpid():  # a forked worker opens its own files
            self._fds, self._pid = {}, os.getpid()
        if stream not in self._fds:
            self._fds[stream] = os.open(self.streams[stream].path, os.O_RDONLY)
        return self._fds[stream]

    def window(self, i: int) -> np.ndarray:
        """Window ``i`` as ``uint32 [seq_len]``."""
        stream, j = self.locate(i)
        size = 4 * self.seq_len
        raw = os.pread(self._fd(stream), size, j * size)
        if len(raw) != size:
            raise OSError(f"{self.streams[stream].path}: short read at window {j} (the cache file changed?)")
        return np.frombuffer(raw, dtype="<u4")

    def windows(self, indices: Sequence[int] | range) -> np.ndarray:
        """Windows at ``indices`` as ``uint32 [len(indices), seq_len]``."""
        out = np.empty((len(indices), self.seq_len), dtype=np.uint32)
        for row, i in enumerate(indices):
            out[row] = self.window(i)
        return out

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state["_fds"] = {}
        return state

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds = {}

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            if self._pid == os.getpid():
                self.close()
