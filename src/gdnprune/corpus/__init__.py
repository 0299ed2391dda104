"""Training and calibration corpora: files, folders, globs and mixtures read with Hugging Face ``datasets``,
tokenised once into a ``uint32`` cache on disk and read back window by window.

* :mod:`~gdnprune.corpus.sources` — sources, their files, documents, :func:`check_data` and the errors;
* :mod:`~gdnprune.corpus.windows` — the token cache (fingerprint, lock, build), the mixture rule, windows;
* :mod:`~gdnprune.corpus.dataset` — :class:`WindowDataset` (torch), :func:`open_windows`,
  :func:`first_windows`.
"""

from typing import Any

from .sources import (
    ChatTemplateError,
    DataError,
    DataFile,
    DataSpec,
    EmptyDataError,
    EmptyShardWarning,
    MissingFieldError,
    MixtureError,
    NoMatchError,
    NotUTF8Error,
    Source,
    check_data,
    data_spec,
    data_stat,
    iter_pieces,
    source_files,
)
from .windows import (
    CorpusWindows,
    TokenStream,
    default_cache_dir,
    mixture_order,
    tokenize_corpus,
    tokenizer_fingerprint,
)

_TORCH_NAMES = ("WindowDataset", "first_windows", "open_windows")


def __getattr__(name: str) -> Any:
    if name in _TORCH_NAMES:
        # lazy: reading and checking a corpus never imports torch
        from . import dataset

        return getattr(dataset, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "ChatTemplateError",
    "CorpusWindows",
    "DataError",
    "DataFile",
    "DataSpec",
    "EmptyDataError",
    "EmptyShardWarning",
    "MissingFieldError",
    "MixtureError",
    "NoMatchError",
    "NotUTF8Error",
    "Source",
    "TokenStream",
    "WindowDataset",
    "check_data",
    "data_spec",
    "data_stat",
    "default_cache_dir",
    "first_windows",
    "iter_pieces",
    "mixture_order",
    "open_windows",
    "source_files",
    "tokenize_corpus",
    "tokenizer_fingerprint",
]
