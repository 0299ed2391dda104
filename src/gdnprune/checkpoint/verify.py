"""``verify``: load two checkpoint folders with transformers and compare their logits on the same tokens.

The one part of :mod:`gdnprune.checkpoint` that runs models (and imports torch, inside the function).
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ..model.model_config import config_value, text_config
from ..runtime.fileio import read_json
from .folder import CONFIG_NAME, CheckpointError

__all__ = ["verify_checkpoints"]


def _vocab_size(config: Mapping) -> int | None:
    return config_value(text_config(config, "vocab_size"), "vocab_size")


_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def _verify_tokens(model_dir: Path, data, vocab: int, seq_len: int, num_sequences: int, seed: int):
    import numpy as np  # lazy: as torch below, only verify reads token ids
    import torch  # lazy: checkpoint/ stays torch-free (inspect, sort, slice)

    # lazy: datasets is heavy; only verify reads text
    from ..corpus import data_spec, iter_pieces, source_files
    from ..corpus.windows import encode_pieces  # lazy: as above

    if data is None:
        g = torch.Generator().manual_seed(seed)
        return torch.randint(0, vocab, (num_sequences, seq_len), generator=g), f"random ids (seed {seed})"
    spec = data_spec(data)
    files = [f for s in spec.sources for f in source_files(s)]
    tokenizer = None
    if any((model_dir / name).is_file() for name in _TOKENIZER_FILES):
        try:
            import transformers  # lazy: checkpoint/ stays torch-free

            tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
        except Exception as exc:  # noqa: BLE001 - any tokenizer failure falls back to bytes
            warnings.warn(
                f"tokenizer of {model_dir} unusable ({exc}); using bytes", UserWarning, stacklevel=3
            )
    needed = seq_len * num_sequences
    if tokenizer is not None:
        pieces = iter_pieces(files, text_field=spec.text_field, tokenizer=tokenizer)
        chunks = list(encode_pieces(pieces, tokenizer, limit=needed))
        ids = np.concatenate(chunks).astype(np.int64) if chunks else np.zeros(0, dtype=np.int64)
        source = f"{spec} tokenised with the tokenizer of {model_dir}"
    else:
        if len(files) != 1 or files[0].kind != "text":
            raise ValueError(
                f"`data={spec}`: without a tokenizer in {model_dir}, expected one text file (read as "
                f"bytes), found {len(files)} file(s)"
            )
        try:
            with open(files[0].path, "rb") as f:
                ids = np.frombuffer(f.read(needed), dtype=np.uint8).astype(np.int64)
        except OSError as exc:
            raise ValueError(f"`data={spec}`: cannot read ({exc.strerror or exc})") from None
        source = f"{spec} as bytes mod {vocab}"
    tokens = torch.from_numpy(ids[:needed]) % vocab
    if tokens.numel() < 2:
        raise ValueError(f"`data={spec}`: gives {tokens.numel()} tokens, need at least 2")
    n = max(1, tokens.numel() // seq_len)
    length = min(seq_len, tokens.numel())
    return tokens[: n * length].reshape(n, length), source


def _load_causal_lm(path: Path):
    import torch  # lazy: checkpoint/ stays torch-free (inspect, sort, slice)
    import transformers  # lazy: checkpoint/ stays torch-free

    from ..io.loading import load_pretrained  # lazy: checkpoint/ stays torch-free

    try:
        model, info = load_pretrained(
            path, model_class=transformers.AutoModelForCausalLM, dtype=torch.float32, output_loading_info=True
        )
    except Exception as exc:  # noqa: BLE001 - whatever transformers raises, the folder is the problem
        raise CheckpointError(f"{path}: transformers cannot load it as a causal LM: {exc}") from None
    problems = {
        k: v for k, v in info.items() if k in ("missing_keys", "unexpected_keys", "mismatched_keys") and v
    }
    if problems:
        listed = "; ".join(f"{k}: {sorted(map(str, v))[:3]}" for k, v in problems.items())
        raise CheckpointError(f"{path}: does not load cleanly ({listed})")
    return model.eval()


# Over 80 lines with its documented keyword arguments; the code is under 60.
def verify_checkpoints(
    model_a: str | os.PathLike,
    model_b: str | os.PathLike,
    *,
    data: Any = None,
    tolerance: float = 1e-4,
    seq_len: int = 128,
    num_samples: int = 4,
    seed: int = 0,
    progress: bool = False,
    num_sequences: int | None = None,
) -> dict:
    """Run the same tokens through two checkpoints (transformers, fp32, CPU) and compare their logits.

    Tokens: ``data`` (any corpus :func:`gdnprune.corpus.data_spec` takes: files, folders, globs) tokenised
    with ``model_a``'s tokenizer when its folder has one, else (one text file) its bytes mod the vocabulary; without ``data``, seeded random ids. At most ``num_samples``
    windows of ``seq_len`` tokens (default 128, longer than the 64-token chunks of the GDN kernel).
    The models are loaded one after the other. A sliced model may be compared with its source (same
    vocabulary, different widths). ``num_sequences`` is the deprecated name of ``num_samples``.

    Returns a dict with ``max_abs_diff``, ``mean_abs_diff``, ``loss_a``, ``loss_b`` (next-token cross
    entropy), ``tolerance``, ``within_tolerance`` (``max_abs_diff <= tolerance``), ``tokens`` (shape) and
    ``token_source``.

    Raises:
        CheckpointError: a folder does not load cleanly with transformers, or the vocabularies differ.
    """
    import torch  # lazy: checkpoint/ stays torch-free (inspect, sort, slice)

    if num_sequences is not None:
        warnings.warn(
            "verify_checkpoints: num_sequences is deprecated, use num_samples", FutureWarning, stacklevel=2
        )
        num_samples = num_sequences
    a, b = Path(model_a), Path(model_b)
    configs = []
    for path in (a, b):
        if not (path / CONFIG_NAME).is_file():
            raise CheckpointError(f"{path}: no config.json (not a model folder)")
        configs.append(read_json(path / CONFIG_NAME, CheckpointError))
    vocab_a, vocab_b = _vocab_size(configs[0]), _vocab_size(configs[1])
    if not vocab_a or vocab_a != vocab_b:
        raise CheckpointError(f"vocabulary sizes differ or are unknown: {a}: {vocab_a}, {b}: {vocab_b}")
    ids, source = _verify_tokens(a, data, vocab_a, seq_len, num_samples, seed)

    import transformers  # lazy: checkpoint/ stays torch-free

    bars = transformers.utils.logging.is_progress_bar_enabled()
    if not progress:
        transformers.utils.logging.disable_progress_bar()
    try:
        results = []
        for path in (a, b):
            model = _load_causal_lm(path)
            with torch.no_grad():
                logits = torch.cat(
                    [model(input_ids=ids[i : i + 1]).logits.float() for i in range(ids.shape[0])]
                )
            del model
            loss = torch.nn.functional.cross_entropy(
                logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1)
            )
            results.append((logits, float(loss)))
    finally:
        if bars:
            transformers.utils.logging.enable_progress_bar()
    (la, loss_a), (lb, loss_b) = results
    if la.shape != lb.shape:
        raise CheckpointError(f"logits have different shapes: {tuple(la.shape)} vs {tuple(lb.shape)}")
    diff = (la - lb).abs()
    max_diff, mean_diff = float(diff.max()), float(diff.mean())
    return {
        "model_a": str(a),
        "model_b": str(b),
        "tokens": list(ids.shape),
        "token_source": source,
        "max_abs_diff": max_diff,
        "mean_abs_diff": mean_diff,
        "loss_a": loss_a,
        "loss_b": loss_b,
        "tolerance": tolerance,
        "within_tolerance": bool(max_diff <= tolerance),
    }
