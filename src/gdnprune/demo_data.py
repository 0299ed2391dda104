"""Corpus, byte tokenizer and bundled demo model for demos, tests and benchmarks.

Everything here works offline and with no training:

* **Corpus.** CPython's own documentation topics, ``pydoc_data.topics.topics`` (a dict present in
  every CPython install). The topic texts are joined in sorted key order, separated by a blank line
  (``"\\n\\n"``), and the result is cut into fixed-size blocks of :data:`BLOCK_CHARS` characters
  (the last block may be shorter). Every tenth block (block index ``i`` with
  ``i % VALIDATION_EVERY == VALIDATION_EVERY - 1``) is held out for validation; the others, in order,
  are the training text. Blocks are cut on characters, so every block is valid UTF-8 text.
  The text differs slightly between Python versions; :func:`corpus_sha256` identifies it.
* **Tokens.** Bytes: token id = UTF-8 byte value (0..255). The bundled tokenizer (built by
  :func:`build_byte_tokenizer`) uses exactly this mapping and adds one special token,
  ``<|endoftext|>`` (id 256), used as EOS and padding.
* **Model.** A tiny byte-level ``Qwen3_5ForCausalLM`` (3 GDN layers + 1 full-attention layer, about
  0.9M parameters) trained by ``scripts/train_demo_model.py`` and shipped in
  ``gdnprune/data/demo_model`` (see :func:`demo_model_path`, :func:`load_demo_model`,
  :func:`demo_training_record`).
* **Metric.** :func:`validation_loss`: mean next-token cross entropy (nats/byte) over a fixed,
  evenly spaced set of non-overlapping windows of the validation text.
"""

from __future__ import annotations

import functools
import hashlib
import json
from importlib import resources
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

__all__ = [
    "BLOCK_CHARS",
    "VALIDATION_EVERY",
    "DEFAULT_SEQ_LEN",
    "DEFAULT_NUM_WINDOWS",
    "EOS_TOKEN",
    "CORPORA",
    "corpus_text",
    "corpus_blocks",
    "train_text",
    "validation_text",
    "corpus_sha256",
    "text_to_ids",
    "byte_windows",
    "validation_loss",
    "build_byte_tokenizer",
    "demo_model_path",
    "load_demo_model",
    "demo_training_record",
]

#: Size of one corpus block in characters (the split unit for train/validation).
BLOCK_CHARS = 4096
#: Every ``VALIDATION_EVERY``-th block (the last of each run of ten) is validation text.
VALIDATION_EVERY = 10
#: Default window length (tokens = bytes) of :func:`validation_loss`.
DEFAULT_SEQ_LEN = 256
#: Default number of validation windows: 32 x 256 bytes, about 0.6 s for the demo model on 2 CPU
#: cores. ``num_windows=None`` uses all of them (about 180 windows, 46 KB).
DEFAULT_NUM_WINDOWS = 32
#: The single special token of the byte tokenizer (id 256): end of text and padding.
EOS_TOKEN = "<|endoftext|>"

_TOPIC_SEPARATOR = "\n\n"


# --------------------------------------------------------------------------------------------------
# Corpus
# --------------------------------------------------------------------------------------------------


#: The corpora :func:`corpus_text` knows, the default first.
CORPORA = ("pydoc", "docstrings")
#: Size cap of the ``docstrings`` corpus, in characters (about the size of the pydoc topics).
DOCSTRINGS_CHARS = 600_000
_DOCSTRING_SKIP = (
    "test",
    "tests",
    "idlelib",
    "lib2to3",
    "site-packages",
    "dist-packages",
    "turtledemo",
    "__pycache__",
)


@functools.lru_cache(maxsize=4)
def corpus_text(corpus: str = "pydoc") -> str:
    """Return a whole corpus.

    * ``"pydoc"`` (default): the ``pydoc_data`` topic texts in sorted key order, joined by a blank line;
    * ``"docstrings"``: the docstrings of the standard library's own source files (module, class and
      function docstrings read with :mod:`ast`, nothing imported), files in sorted path order, tests and
      IDLE left out, joined by a blank line and cut at :data:`DOCSTRINGS_CHARS` characters.
    """
    if corpus == "pydoc":
        # lazy: the corpus and tokenizer loaders need transformers only when called
        from pydoc_data.topics import topics

        return _TOPIC_SEPARATOR.join(topics[key] for key in sorted(topics))
    if corpus == "docstrings":
        return _stdlib_docstrings()
    raise ValueError(f"unknown corpus {corpus!r}; expected one of {list(CORPORA)}")


def _stdlib_docstrings() -> str:
    # lazy: the corpus and tokenizer loaders need transformers only when called
    import ast

    # lazy: the corpus and tokenizer loaders need transformers only when called
    import sysconfig

    root = Path(sysconfig.get_paths()["stdlib"])
    parts, size = [], 0
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).parts
        if any(p in _DOCSTRING_SKIP or p.startswith("test_") for p in rel):
            continue
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, ValueError, OSError):
            continue
        nodes = [tree] + [
            n for n in ast.walk(tree) if isinstance(n, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
        ]
        for node in nodes:
            doc = ast.get_docstring(node)
            if doc and len(doc) > 40:
                parts.append(doc)
                size += len(doc) + len(_TOPIC_SEPARATOR)
        if size >= DOCSTRINGS_CHARS:
            break
    return _TOPIC_SEPARATOR.join(parts)[:DOCSTRINGS_CHARS]


def corpus_blocks(corpus: str = "pydoc") -> list[str]:
    """Return the corpus cut into consecutive blocks of :data:`BLOCK_CHARS` characters (last one shorter)."""
    text = corpus_text(corpus)
    return [text[i : i + BLOCK_CHARS] for i in range(0, len(text), BLOCK_CHARS)]


def _is_validation_block(index: int) -> bool:
    return index % VALIDATION_EVERY == VALIDATION_EVERY - 1


@functools.lru_cache(maxsize=4)
def train_text(corpus: str = "pydoc") -> str:
    """Return the training text: all blocks except every tenth one, concatenated in order."""
    return "".join(b for i, b in enumerate(corpus_blocks(corpus)) if not _is_validation_block(i))


@functools.lru_cache(maxsize=4)
def validation_text(corpus: str = "pydoc") -> str:
    """Return the validation text: every tenth block (indices 9, 19, 29, ...), concatenated in order."""
    return "".join(b for i, b in enumerate(corpus_blocks(corpus)) if _is_validation_block(i))


def corpus_sha256(corpus: str = "pydoc") -> str:
    """Return the hex SHA-256 of the UTF-8 encoded corpus (it identifies the Python version's text)."""
    return hashlib.sha256(corpus_text(corpus).encode("utf-8")).hexdigest()


# --------------------------------------------------------------------------------------------------
# Tokens and windows
# --------------------------------------------------------------------------------------------------


def text_to_ids(text: str, tokenizer: Any = None) -> torch.Tensor:
    """Encode ``text`` as a 1-D ``LongTensor`` of token ids.

    With ``tokenizer=None`` the ids are the UTF-8 bytes of the text (what the bundled byte tokenizer
    produces). Otherwise ``tokenizer(text, add_special_tokens=False)["input_ids"]`` is used.
    """
    if tokenizer is None:
        data = bytearray(text.encode("utf-8"))
        if not data:
            return torch.zeros(0, dtype=torch.long)
        return torch.frombuffer(data, dtype=torch.uint8).long()
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    return torch.tensor(ids, dtype=torch.long)


def byte_windows(
    text: str,
    seq_len: int,
    num_windows: int | None = None,
    *,
    tokenizer: Any = None,
) -> torch.Tensor:
    """Pack ``text`` into non-overlapping token windows, returned as a ``LongTensor [N, seq_len]``.

    The text is encoded with :func:`text_to_ids` (UTF-8 bytes by default) and cut into
    ``len(ids) // seq_len`` consecutive windows (the tail is dropped). If ``num_windows`` is given and
    smaller than that count, a fixed, evenly spaced subset of ``num_windows`` windows is kept, in text
    order (always including the first and the last window), so the result is deterministic and covers
    the whole text. ``num_windows`` larger than the available count raises ``ValueError``.
    """
    if seq_len < 2:
        raise ValueError(f"byte_windows: seq_len must be >= 2, got {seq_len}")
    ids = text_to_ids(text, tokenizer)
    available = ids.numel() // seq_len
    if available == 0:
        raise ValueError(
            f"byte_windows: text has {ids.numel()} tokens, fewer than one window of seq_len={seq_len}"
        )
    windows = ids[: available * seq_len].view(available, seq_len)
    if num_windows is None or num_windows == available:
        return windows.clone()
    if num_windows < 1 or num_windows > available:
        raise ValueError(
            f"byte_windows: num_windows must be in [1, {available}] for {ids.numel()} tokens and "
            f"seq_len={seq_len}, got {num_windows}"
        )
    if num_windows == 1:
        return windows[:1].clone()
    # Evenly spaced, strictly increasing indices (spacing >= 1 because num_windows <= available).
    index = (
        (torch.arange(num_windows, dtype=torch.float64) * ((available - 1) / (num_windows - 1)))
        .round()
        .long()
    )
    return windows[index].clone()


@torch.inference_mode()
def validation_loss(
    model: torch.nn.Module,
    tokenizer: Any = None,
    *,
    seq_len: int = DEFAULT_SEQ_LEN,
    num_windows: int | None = DEFAULT_NUM_WINDOWS,
    batch_size: int = 16,
    text: str | None = None,
) -> float:
    """Mean next-token cross entropy of ``model`` on the validation text, in nats per token.

    With the default ``tokenizer=None`` the tokens are UTF-8 bytes (the bundled model's ids), so the
    result is in nats/byte; a uniform guess over 256 bytes scores ``ln 256 ~ 5.545``.

    The text (default :func:`validation_text`) is cut by :func:`byte_windows` into ``num_windows``
    evenly spaced, non-overlapping windows of ``seq_len`` tokens (``None``: all windows). Each window
    is scored independently on its ``seq_len - 1`` next-token predictions, in fixed order, in batches
    of ``batch_size``, under ``torch.no_grad`` and in eval mode (the model's training flag is
    restored afterwards); the summed loss is accumulated in float64. ``model`` may be a transformers
    causal LM or any module mapping ``[B, T]`` ids to ``[B, T, V]`` logits (or an output with
    ``.logits``). Inputs go to the device of the model's first parameter.
    """
    if batch_size < 1:
        raise ValueError(f"validation_loss: batch_size must be >= 1, got {batch_size}")
    windows = byte_windows(
        validation_text() if text is None else text, seq_len, num_windows, tokenizer=tokenizer
    )
    try:
        device = next(model.parameters()).device
    except StopIteration:
        device = torch.device("cpu")
    is_hf = hasattr(model, "config") and hasattr(model, "generate")
    was_training = model.training
    model.eval()
    total = torch.zeros((), dtype=torch.float64)
    try:
        for start in range(0, windows.shape[0], batch_size):
            batch = windows[start : start + batch_size].to(device)
            out = model(input_ids=batch, use_cache=False) if is_hf else model(batch)
            logits = getattr(out, "logits", out)
            if logits.dim() != 3 or logits.shape[:2] != batch.shape:
                raise ValueError(
                    f"validation_loss: expected logits of shape [{batch.shape[0]}, {batch.shape[1]}, V], "
                    f"got {tuple(logits.shape)}"
                )
            loss = F.cross_entropy(
                logits[:, :-1].reshape(-1, logits.shape[-1]).float(),
                batch[:, 1:].reshape(-1),
                reduction="sum",
            )
            total += loss.double().cpu()
    finally:
        model.train(was_training)
    count = windows.shape[0] * (seq_len - 1)
    return float(total / count)


# --------------------------------------------------------------------------------------------------
# Tokenizer
# --------------------------------------------------------------------------------------------------


def _bytes_to_unicode() -> dict[int, str]:
    """The byte -> printable character table used by byte-level BPE pre-tokenizers (GPT-2 style).

    Printable Latin-1 bytes map to themselves; the other 68 bytes map, in increasing order, to the
    code points 256, 257, ...
    """
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("\u00a1"), ord("\u00ac") + 1))
        + list(range(ord("\u00ae"), ord("\u00ff") + 1))
    )
    table: dict[int, str] = {}
    extra = 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def build_byte_tokenizer():
    """Build the byte tokenizer: ids 0..255 are the UTF-8 byte values, id 256 is ``<|endoftext|>``.

    It is a ``tokenizers`` BPE model over the 256 byte-level symbols with no merges, a byte-level
    pre-tokenizer (no regex split, no prefix space) and a byte-level decoder, wrapped in
    ``PreTrainedTokenizerFast``; it adds no special tokens when encoding. ``save_pretrained`` writes a
    folder that ``AutoTokenizer.from_pretrained`` loads offline. Any text round-trips exactly;
    the only exception to "ids == UTF-8 bytes" is the literal string ``<|endoftext|>``, which
    encodes to the special id 256 (and decodes back to the same text).
    """
    # lazy: the corpus and tokenizer loaders need transformers only when called
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    # lazy: the corpus and tokenizer loaders need transformers only when called
    from transformers import PreTrainedTokenizerFast

    vocab = {char: byte for byte, char in _bytes_to_unicode().items()}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token=EOS_TOKEN,
        pad_token=EOS_TOKEN,
        model_max_length=1 << 20,
        clean_up_tokenization_spaces=False,
    )


# --------------------------------------------------------------------------------------------------
# Bundled model
# --------------------------------------------------------------------------------------------------


def demo_model_path() -> Path:
    """Return the folder of the bundled demo model (``gdnprune/data/demo_model``, an HF model folder).

    Found through ``importlib.resources``, so it works from a source checkout and from an installed
    package. Raises ``FileNotFoundError`` if the folder or its ``config.json`` is missing.
    """
    path = Path(str(resources.files("gdnprune").joinpath("data").joinpath("demo_model")))
    if not (path / "config.json").is_file():
        raise FileNotFoundError(
            f"bundled demo model not found: expected {path / 'config.json'} "
            "(build it with scripts/train_demo_model.py)"
        )
    return path


def load_demo_model(dtype: torch.dtype = torch.float32):
    """Load the bundled demo model and its tokenizer; return ``(model, tokenizer)``, model in eval mode."""
    # lazy: the corpus and tokenizer loaders need transformers only when called
    from transformers import AutoTokenizer, Qwen3_5ForCausalLM

    path = demo_model_path()
    model = Qwen3_5ForCausalLM.from_pretrained(path, dtype=dtype)
    model.eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    return model, tokenizer


def demo_training_record() -> dict:
    """Return the bundled model's ``training.json`` (command, seed, steps, losses, corpus sha256, ...)."""
    return json.loads((demo_model_path() / "training.json").read_text(encoding="utf-8"))
