"""Corpora as users keep them: sources, the files they name, and their documents (no torch).

A corpus is one or more *sources*, each a file, a folder or a glob (:class:`Source`); with weights they
are a mixture (:class:`DataSpec`, see :mod:`gdnprune.corpus.windows` for the rule). Every format is read
by Hugging Face ``datasets`` (streaming, one file at a time, so memory does not grow with the file):

* ``.txt`` / ``.text`` / ``.md`` (also ``.gz``, ``.zst``, ``.bz2``, ``.xz`` compressed): one document per
  file, read line by line (the ``text`` builder) and handed on in pieces cut at line breaks;
* ``.jsonl`` / ``.ndjson`` / ``.json`` (also compressed): one document per row (the ``json`` builder);
* ``.parquet`` and ``.arrow``: one document per row (the ``parquet`` / ``arrow`` builders);
* a folder written by ``datasets.save_to_disk`` (``load_from_disk``, memory-mapped; of a ``DatasetDict``
  the ``train`` split);
* any other folder: every file above in it (recursively, sorted by path; hidden files and folders skipped);
* a file of another name: JSON Lines when its first non-blank line is a JSON object, else text.

A row's document is its ``text_field`` column (a string; empty and null rows are skipped) or, when the row
has no such column but a ``messages`` list, the conversation rendered with the tokenizer's chat template.
Paths are local: a source that names nothing on disk is an error, never a request to a hub.
"""

from __future__ import annotations

import codecs
import glob
import json
import math
import os
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# datasets reads this when it is first imported: gdnprune reads local files only, so nothing may be asked
# of a hub (setdefault: a user's own setting wins)
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import datasets  # noqa: E402  (after the offline switch above)

__all__ = [
    "DataError",
    "NoMatchError",
    "EmptyDataError",
    "NotUTF8Error",
    "MissingFieldError",
    "ChatTemplateError",
    "MixtureError",
    "EmptyShardWarning",
    "Source",
    "DataSpec",
    "DataFile",
    "Piece",
    "data_spec",
    "source_files",
    "check_data",
    "iter_pieces",
    "data_stat",
]

_COMPRESSIONS = (".gz", ".zst", ".bz2", ".xz")
_KINDS = {
    ".txt": "text",
    ".text": "text",
    ".md": "text",
    ".jsonl": "json",
    ".ndjson": "json",
    ".json": "json",
    ".parquet": "parquet",
    ".arrow": "arrow",
}
# a text file is handed on in pieces cut at line breaks: 64 KiB first, doubling up to 1 MiB, so that a few
# windows cost a small read and a whole file a few hundred tokenizer calls
FIRST_PIECE_CHARS, PIECE_CHARS = 1 << 16, 1 << 20
# the text builder reads this many characters at a time: a few windows cost a small read
_TEXT_CHUNK = 1 << 16


class DataError(ValueError):
    """A corpus the user gave cannot be read; the message names the file (and the row where it applies)."""


class NoMatchError(DataError):
    """A source names no file: a path that does not exist, a glob that matches nothing, an empty folder."""


class EmptyDataError(DataError):
    """Every file of the corpus is empty (holds no document)."""


class NotUTF8Error(DataError):
    """A text or JSON Lines file is not UTF-8."""


class MissingFieldError(DataError):
    """A row (or a parquet / Arrow schema) has neither the text field nor a ``messages`` list."""


class ChatTemplateError(DataError):
    """A row holds a conversation (``messages``) but the tokenizer has no chat template."""


class MixtureError(DataError):
    """Mixture weights that do not parse, or do not match the sources."""


class EmptyShardWarning(UserWarning):
    """An empty file among good ones: skipped."""


# the tokenizer :func:`check_data` reads rows with when it has none: conversations pass unrendered
_NOT_RENDERED = object()


@dataclass(frozen=True)
class Source:
    """One ``--data`` argument: a file, a folder or a glob, and its mixture weight (``None``: no mixture)."""

    pattern: str
    weight: float | None = None


@dataclass(frozen=True)
class DataSpec:
    """A corpus: its sources in order, and the column that holds a row's text."""

    sources: tuple[Source, ...]
    text_field: str = "text"

    @property
    def is_mixture(self) -> bool:
        return self.sources[0].weight is not None

    def __str__(self) -> str:
        if self.is_mixture:
            return " ".join(f"{s.pattern} (weight {s.weight:g})" for s in self.sources)
        return " ".join(s.pattern for s in self.sources)


@dataclass(frozen=True)
class DataFile:
    """A file (or ``save_to_disk`` folder) to read and how: ``text``, ``json``, ``parquet``, ``arrow`` or
    ``saved``."""

    path: Path
    kind: str


@dataclass(frozen=True)
class Piece:
    """Text read from a corpus: ``new_document`` is False for the later pieces of one text file."""

    text: str
    new_document: bool
    file: Path
    row: int


def _parse_weight(text: Any, pattern: str) -> float:
    try:
        value = float(text)
    except (TypeError, ValueError):
        value = float("nan")
    if not (value > 0) or math.isinf(value):
        raise MixtureError(f"mixture weight of {pattern}: expected a finite number > 0, found {text!r}")
    return value


def data_spec(
    data: str | os.PathLike | Sequence[str | os.PathLike] | DataSpec,
    *,
    weights: Sequence[float | str] | None = None,
    text_field: str | None = None,
) -> DataSpec:
    """A :class:`DataSpec` from what a caller gives: one path, folder or glob, a list of them, or a spec.

    ``weights``, one per source in the same order, make the sources a mixture (they need not sum to 1).
    ``text_field`` (default ``"text"``) replaces the spec's when given.

    Raises:
        MixtureError: the weights do not parse, are not > 0, or are not one per source.
    """
    if isinstance(data, DataSpec):
        spec = data
        if text_field is not None and text_field != spec.text_field:
            spec = DataSpec(spec.sources, text_field)
        if weights is None:
            return spec
        patterns = [s.pattern for s in spec.sources]
    elif isinstance(data, (str, os.PathLike)):
        patterns = [os.fspath(data)]
    else:
        patterns = [os.fspath(p) for p in data]
    if not patterns:
        raise NoMatchError("`data`: expected at least one file, folder or glob, found none")
    if weights is None:
        sources = tuple(Source(p) for p in patterns)
    else:
        if len(weights) != len(patterns):
            raise MixtureError(
                f"mixture weights: expected one per data source ({len(patterns)}: {' '.join(patterns)}), "
                f"found {len(weights)}"
            )
        sources = tuple(Source(p, _parse_weight(w, p)) for p, w in zip(patterns, weights))
    return DataSpec(sources, text_field or "text")


def _kind_of(path: Path) -> str | None:
    name = path.name.lower()
    for ending in _COMPRESSIONS:
        if name.endswith(ending):
            name = name[: -len(ending)]
            break
    return _KINDS.get(Path(name).suffix)


def _is_saved_dataset(folder: Path) -> bool:
    return (folder / "dataset_dict.json").is_file() or (
        (folder / "state.json").is_file() and (folder / "dataset_info.json").is_file()
    )


def _sniff(path: Path) -> str:
    """``json`` when the first non-blank line of an unnamed file is a JSON object, else ``text``."""
    with open(path, "rb") as f:
        for raw in f:
            line = raw.decode("utf-8", errors="replace").strip()
            if line:
                try:
                    return "json" if isinstance(json.loads(line), dict) else "text"
                except (json.JSONDecodeError, RecursionError):
                    return "text"
    return "text"


def _folder_files(folder: Path) -> list[DataFile]:
    if _is_saved_dataset(folder):
        return [DataFile(folder, "saved")]
    found: list[DataFile] = []
    for root, dirs, files in os.walk(folder):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        here = Path(root)
        for d in list(dirs):
            if _is_saved_dataset(here / d):
                found.append(DataFile(here / d, "saved"))
                dirs.remove(d)
        for name in sorted(files):
            kind = _kind_of(Path(name))
            if kind is not None and not name.startswith("."):
                found.append(DataFile(here / name, kind))
    return sorted(found, key=lambda f: str(f.path))


def _path_files(path: Path) -> list[DataFile]:
    if path.is_dir():
        return _folder_files(path)
    return [DataFile(path, _kind_of(path) or _sniff(path))]


def source_files(source: Source | str) -> list[DataFile]:
    """The files a source names, in reading order (a glob's matches and a folder's files sorted by path).

    Raises:
        NoMatchError: the path does not exist, the glob matches nothing, or the folder holds no data file.
    """
    pattern = source.pattern if isinstance(source, Source) else os.fspath(source)
    path = Path(pattern).expanduser()
    if path.exists():
        files = _path_files(path)
        if not files:
            raise NoMatchError(
                f"{pattern}: expected data files (.txt, .jsonl[.gz|.zst], .parquet, .arrow or a "
                f"save_to_disk folder) in the folder, found none"
            )
        return files
    if not glob.has_magic(str(path)):
        raise NoMatchError(f"{pattern}: no such file or folder")
    matches = sorted(glob.glob(str(path), recursive=True))
    files = [f for m in matches for f in _path_files(Path(m))]
    if not files:
        raise NoMatchError(f"{pattern}: the glob matches no data file")
    return files


def _stream(file: DataFile, text_field: str):
    """The rows of one file as an iterable of dicts, read by ``datasets`` (streaming where it can)."""
    if file.kind == "saved":
        loaded = datasets.load_from_disk(str(file.path))
        if isinstance(loaded, datasets.DatasetDict):
            if "train" not in loaded:
                raise DataError(
                    f"{file.path}: a saved DatasetDict without a train split (found {', '.join(loaded)}); "
                    f"give the split's folder"
                )
            loaded = loaded["train"]
        return loaded
    options: dict[str, Any] = {}
    if file.kind == "text":
        options = dict(keep_linebreaks=True, chunksize=_TEXT_CHUNK)
    return datasets.load_dataset(
        file.kind, data_files=[str(file.path)], split="train", streaming=True, **options
    )


def _columns(file: DataFile) -> list[str] | None:
    """The columns a parquet / Arrow / saved file declares in its header (None for text and JSON)."""
    if file.kind == "parquet":
        import pyarrow.parquet as pq  # lazy: only parquet headers need it

        return list(pq.read_schema(file.path).names)
    if file.kind in ("arrow", "saved"):
        features = _stream(file, "text").features
        return None if features is None else list(features)
    return None


def _document(row: dict, file: DataFile, number: int, text_field: str, tokenizer: Any) -> str | None:
    """A row's document (None: nothing to read), the conversation rendered when it is one."""
    value = row.get(text_field)
    if isinstance(value, str):
        return value
    messages = row.get("messages")
    if value is None and isinstance(messages, list):
        if tokenizer is _NOT_RENDERED:
            return "(a conversation)"
        if tokenizer is None or not getattr(tokenizer, "chat_template", None):
            raise ChatTemplateError(
                f"{file.path}:{number}: a conversation (messages) but the tokenizer has no chat "
                f"template; give rows with a {text_field!r} field or a tokenizer with a chat template"
            )
        return tokenizer.apply_chat_template(messages, tokenize=False)
    if value is not None:
        raise MissingFieldError(
            f"{file.path}:{number}: expected a string in {text_field!r}, found {type(value).__name__}"
        )
    found = sorted(k for k, v in row.items() if v is not None)
    raise MissingFieldError(
        f"{file.path}:{number}: expected a string {text_field!r} field or a messages list, found "
        f"{'columns ' + ', '.join(found) if found else 'no value'}"
    )


def _rows(file: DataFile, text_field: str, tokenizer: Any) -> Iterator[Piece]:
    """The documents of a row file (JSON, parquet, Arrow, saved), read errors named after the file."""
    number = 0
    try:
        for number, row in enumerate(_stream(file, text_field), start=1):
            text = _document(row, file, number, text_field, tokenizer)
            if text:
                yield Piece(text, True, file.path, number)
    except DataError:
        raise
    except UnicodeDecodeError as exc:
        raise NotUTF8Error(f"{file.path}: not UTF-8 ({exc.reason}, after row {number})") from None
    except Exception as exc:  # datasets / pyarrow raise many types; name the file and row, keep the reason
        if "utf" in str(exc).lower() and "invalid" in str(exc).lower():
            raise NotUTF8Error(f"{file.path}: not UTF-8 (after row {number})") from None
        raise DataError(f"{file.path}: cannot read as {file.kind} (after row {number}): {exc}") from None


def _text_pieces(file: DataFile) -> Iterator[Piece]:
    """One text file as one document, in pieces cut at line breaks (64 KiB, doubling up to 1 MiB)."""
    lines: list[str] = []
    size, first, number, limit = 0, True, 0, FIRST_PIECE_CHARS
    try:
        for number, row in enumerate(_stream(file, "text"), start=1):
            line = row["text"]
            if first and not lines and line.startswith("\ufeff"):
                line = line[1:]
            lines.append(line)
            size += len(line)
            if size >= limit:
                yield Piece("".join(lines), first, file.path, number)
                lines, size, first, limit = [], 0, False, min(2 * limit, PIECE_CHARS)
    except UnicodeDecodeError as exc:
        raise NotUTF8Error(f"{file.path}: not UTF-8 ({exc.reason}, after line {number})") from None
    text = "".join(lines)
    if text and (not first or text.strip()):
        yield Piece(text, first, file.path, number)


def iter_pieces(
    files: Sequence[DataFile], *, text_field: str = "text", tokenizer: Any = None
) -> Iterator[Piece]:
    """The documents of ``files`` in order, as :class:`Piece` s; an empty file is skipped.

    Raises:
        DataError: a file cannot be read (the message names it, and the row where it applies).
    """
    for file in files:
        if file.kind == "text":
            yield from _text_pieces(file)
        else:
            yield from _rows(file, text_field, tokenizer)


def _utf8_head(path: Path, size: int = 1 << 16) -> None:
    """Raise :class:`NotUTF8Error` when the first ``size`` bytes of a text or JSON file (decompressed) are
    not UTF-8."""
    from fsspec import open as fs_open  # lazy: only the header check decompresses by hand

    with fs_open(str(path), "rb", compression="infer") as f:
        head = f.read(size)
    decoder = codecs.getincrementaldecoder("utf-8")("strict")
    try:
        decoder.decode(head, final=len(head) < size)
    except UnicodeDecodeError as exc:
        raise NotUTF8Error(f"{path}: not UTF-8 ({exc.reason} at byte {exc.start})") from None


def _check_file(file: DataFile, text_field: str, tokenizer: Any, rows: int) -> bool:
    """Cheap checks of one file: UTF-8 head, schema, first rows. False: the file holds no document."""
    if file.kind != "saved" and file.path.stat().st_size == 0:
        return False
    if file.kind in ("text", "json"):
        _utf8_head(file.path)
    columns = _columns(file)
    if columns is not None and text_field not in columns and "messages" not in columns:
        raise MissingFieldError(
            f"{file.path}: expected a {text_field!r} column (or messages), found columns "
            f"{', '.join(columns) or 'none'}"
        )
    pieces = _text_pieces(file) if file.kind == "text" else _rows(file, text_field, tokenizer)
    found = False
    for i, _ in enumerate(pieces):
        found = True
        if i + 1 >= rows:
            break
    return found


def check_data(
    data: str | os.PathLike | Sequence[str | os.PathLike] | DataSpec,
    *,
    tokenizer: Any = None,
    rows: int = 8,
) -> list[list[DataFile]]:
    """Check a corpus before any model loads, cheaply: every source names files, every file's head is
    UTF-8, its schema has the text column, its first ``rows`` rows give documents (conversations only with
    a chat template when ``tokenizer`` is given; without one they are not rendered). Returns the files of every source, empty files left out
    (each with an :class:`EmptyShardWarning`).

    Raises:
        NoMatchError, EmptyDataError, NotUTF8Error, MissingFieldError, ChatTemplateError, MixtureError.
    """
    spec = data_spec(data)
    result = []
    for source in spec.sources:
        files, empty = [], []
        for file in source_files(source):
            reader = _NOT_RENDERED if tokenizer is None else tokenizer
            (files if _check_file(file, spec.text_field, reader, rows) else empty).append(file)
        if not files:
            raise EmptyDataError(
                f"{source.pattern}: every file is empty ({', '.join(str(f.path) for f in empty)})"
            )
        for file in empty:
            warnings.warn(f"{file.path}: empty, skipped", EmptyShardWarning, stacklevel=2)
        result.append(files)
    return result


def data_stat(data: str | os.PathLike | Sequence[str | os.PathLike] | DataSpec) -> tuple[int, float]:
    """The total size in bytes and the newest modification time (seconds) of every file of a corpus."""
    size, mtime = 0, 0.0
    for source in data_spec(data).sources:
        for file in source_files(source):
            paths = [file.path] if file.path.is_file() else [p for p in file.path.rglob("*") if p.is_file()]
            for p in paths:
                st = p.stat()
                size, mtime = size + st.st_size, max(mtime, st.st_mtime)
    return size, mtime
