"""Scoring a model folder: :func:`score_checkpoint` loads the model and its tokenizer, cuts the calibration
text into windows (:func:`default_seq_len` long by default), scores them (:func:`measure_checkpoint`: this
process's share of the windows under ``torch.distributed``) and writes the scores; :class:`ScoringOptions`
holds the command's options."""

from __future__ import annotations

import hashlib
import json
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import AutoTokenizer

from ..checkpoint.folder import map_to_checkpoint
from ..corpus import data_spec, data_stat
from ..io.loading import load_causal_lm
from ..model import model_config
from ..quality.calibration import calibration_windows, iter_batches
from ..quality.compensate import collect_statistics
from ..quality.lane_search import search_lane_orders
from ..quality.recall_windows import recall_windows
from ..runtime.deprecation import renamed_keywords
from ..runtime.distributed import (
    all_reduce_sum,
    fail_together,
    is_main_process,
    local_gpus,
    rank,
    shard_indices,
    world_size,
)
from ..runtime.fileio import file_sha256
from .api import METHODS, measure_statistics, reduce_statistics, scored_kinds
from .hidden import hidden_asked, stored_norms
from .payload import (
    ScoringStatistics,
    scores_from_statistics,
)

__all__ = [
    "DEFAULT_MAX_SEQ_LEN",
    "CheckpointStatistics",
    "ScoringOptions",
    "default_seq_len",
    "measure_checkpoint",
    "score_checkpoint",
]

#: the longest calibration window ``score_checkpoint`` uses by default (cost grows with it)
DEFAULT_MAX_SEQ_LEN = 512


def default_seq_len(
    config: Mapping, tokenizer: Any = None, cap: int = DEFAULT_MAX_SEQ_LEN
) -> tuple[int, str]:
    """The calibration window a model supports: :func:`gdnprune.model.model_config.default_seq_len` capped at
    ``cap`` (default 512); and why, in words."""
    return model_config.default_seq_len(config, tokenizer, cap=cap)


@dataclass
class CheckpointStatistics:
    """What :func:`measure_checkpoint` returns: the summed statistics of one share, and where they came from.

    ``statistics`` (layer prefixes of the checkpoint's tensors), ``model`` (``path``, ``config_sha256``),
    ``data`` (``path``, ``size``, ``mtime``, ``windows_sha256`` of all calibration windows),
    ``calibration`` (what the scores file records), ``shard`` (``index``, ``count``, ``windows``: the
    share's ``[start, stop)``, ``total_windows``) and ``world_size`` (processes that computed the sums).
    With ``keep_model``, also the loaded model (``loaded``) and the batches of all windows (``windows``).
    """

    statistics: ScoringStatistics
    model: dict[str, Any]
    data: dict[str, Any]
    calibration: dict[str, Any]
    shard: dict[str, Any]
    world_size: int
    loaded: Any = None
    windows: Any = None


def _windows_sha256(windows: torch.Tensor) -> str:
    digest = hashlib.sha256(f"{list(windows.shape)}".encode())
    digest.update(windows.to(torch.int64).contiguous().numpy().tobytes())
    return digest.hexdigest()


def measure_checkpoint(
    model_dir: str | Path,
    data: str | Path,
    *,
    method: str = "projection",
    num_samples: int | None = 128,
    seq_len: int | None = None,
    batch_size: int = 4,
    device: str | None = None,
    dtype: str = "float32",
    device_map: str | None = None,
    seed: int = 0,
    progress: bool = True,
    shard: tuple[int, int] = (0, 1),
    keep_model: bool = False,
    blocks: Sequence[str] | bool | None = None,
    model: Any = None,
    recall: bool = False,
) -> CheckpointStatistics:
    """The forward passes of :func:`score_checkpoint` for share ``shard = (index, count)`` of the windows.

    Every process reads and tokenises the same windows; share ``index`` of ``count`` takes the contiguous
    block :func:`~gdnprune.runtime.distributed.shard_indices` gives it. Under a ``torch.distributed`` process group
    each rank takes its own block of that share, loads its own copy of the model (with ``device_map``,
    over its block of the GPUs, :func:`~gdnprune.runtime.distributed.local_gpus`; without, on GPU ``LOCAL_RANK``)
    and the sums are added over the ranks; every rank returns them. A failure on one rank raises on all.
    ``model``: the folder's model already loaded (:func:`gdnprune.io.loading.load_causal_lm`); then ``device``,
    ``device_map`` are not used and ``dtype`` is only recorded. ``recall``: every window followed by a recall
    probe of its length whose answers carry ``RECALL_SHARE`` of the pair's weight
    (:func:`gdnprune.quality.recall_windows.recall_windows`), so the orders keep what recall needs.
    """
    model_dir = Path(model_dir)
    with fail_together():
        if not (model_dir / "config.json").is_file():
            raise ValueError(f"{model_dir}: not a model folder (no config.json)")
        if batch_size < 1:
            raise ValueError(f"`batch_size` must be >= 1, got {batch_size}")
        kinds = scored_kinds(blocks)  # checked before the (long) load
        blocks = None if kinds is None else ("gdn", *kinds, *(("hidden",) if hidden_asked(blocks) else ()))
        index, count = (int(x) for x in shard)
        if not 0 <= index < count:
            raise ValueError(f"shard must be (index, count) with 0 <= index < count, got {tuple(shard)}")
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        config = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
        seq_len, source = _window_length(config, tokenizer, seq_len)
        windows = calibration_windows(
            data, tokenizer, seq_len=seq_len, num_samples=num_samples, warn=is_main_process()
        )
        share = shard_indices(windows.shape[0], index, count)
        mine = shard_indices(len(share), rank(), world_size())
        start = share.start + mine.start
        info = _run_info(
            model_dir, data, windows, (seq_len, source, batch_size, dtype), (index, count, share)
        )
    with fail_together():
        if model is None:
            gpus = (
                local_gpus() if device_map is not None else None
            )  # an exchange: first in the block, on every rank
            model = load_causal_lm(model_dir, dtype=dtype, device=device, device_map=device_map, gpus=gpus)
        batches: list[Any] = list(iter_batches(windows[start : start + len(mine)], batch_size))
        offset = start
        if recall:  # each window and its probe, one batch each; the windows before this share counted so
            batches = recall_windows(batches, tokenizer=tokenizer)
            offset = len(recall_windows(list(windows[:start].split(1)), tokenizer=tokenizer)) if start else 0
        statistics = measure_statistics(
            model,
            batches,
            method=method,
            seed=seed,
            window_offset=offset,
            progress=progress and is_main_process(),
            blocks=blocks,
        )
        mapping = map_to_checkpoint(list(statistics.layers), model_dir)
        statistics.layers = {mapping[p]: layer for p, layer in statistics.layers.items()}
        mapping = map_to_checkpoint(list(statistics.blocks), model_dir, modules=True)
        statistics.blocks = {mapping[p]: entry for p, entry in statistics.blocks.items()}
        if statistics.hidden is not None and statistics.hidden.norms:
            statistics.hidden.norms = stored_norms(model_dir, model, statistics.hidden.norms)
        if not keep_model:
            del model
    reduce_statistics(statistics)
    run = CheckpointStatistics(statistics, world_size=world_size(), **info)
    if keep_model:
        run.loaded, run.windows = model, windows[share.start : share.stop]
    return run


def _window_length(config: Mapping, tokenizer: Any, seq_len: int | None) -> tuple[int, str]:
    """The calibration window length and where it comes from (the model's limit by default); a warning
    when a given length is longer than the model supports."""
    limit, why = default_seq_len(config, tokenizer)
    if seq_len is None:
        return limit, f"default: {why}"
    if seq_len > limit and "cap" not in why and is_main_process():
        warnings.warn(
            f"`seq_len={seq_len}` is longer than the model supports ({why}); the scores "
            f"describe the model on windows it never saw in training",
            UserWarning,
            stacklevel=4,  # the frame stacklevel=3 names from measure_checkpoint
        )
    return seq_len, "given"


def _run_info(
    model_dir: Path, data: str | Path, windows: torch.Tensor, calibration: tuple, shard: tuple
) -> dict[str, Any]:
    """The records of a :class:`CheckpointStatistics`: model, data, calibration and shard."""
    seq_len, source, batch_size, dtype = calibration
    index, count, share = shard
    size, mtime = data_stat(data)
    return dict(
        model={"path": str(model_dir), "config_sha256": file_sha256(model_dir / "config.json")},
        data={
            "path": str(data_spec(data)),
            "size": size,
            "mtime": mtime,
            "windows_sha256": _windows_sha256(windows),
        },
        calibration={
            "data": str(data_spec(data)),
            "num_samples": int(windows.shape[0]),
            "seq_len": int(seq_len),
            "seq_len_source": source,
            "batch_size": int(batch_size),
            "dtype": dtype,
        },
        shard={
            "index": index,
            "count": count,
            "windows": [share.start, share.stop],
            "total_windows": int(windows.shape[0]),
        },
    )


@dataclass(frozen=True)
class ScoringOptions:
    """How a model folder is scored: :func:`score_checkpoint`'s options as one object (what
    :func:`gdnprune.prune.prune_checkpoint` takes as ``scoring``). The fields are :func:`score_checkpoint`'s
    keywords of the same names, with the same defaults; :meth:`keywords` gives them back as keywords."""

    method: str = "projection"
    num_samples: int | None = 128
    seq_len: int | None = None
    batch_size: int = 4
    device: str | None = None
    dtype: str = "float32"
    device_map: str | None = None
    seed: int = 0
    lane_search: bool = False
    lane_search_samples: int = 16

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"unknown scoring method {self.method!r}; expected one of {list(METHODS)}")

    def keywords(self) -> dict[str, Any]:
        """The options as keyword arguments of :func:`score_checkpoint`."""
        return asdict(self)


def _lane_search_from_refine(refine: str | None) -> bool:
    """The old ``refine=`` value as ``lane_search``: ``"lanes"`` -> True, None -> False."""
    if refine not in (None, "lanes"):
        raise ValueError(f"unknown refinement {refine!r}; expected 'lanes' (now `lane_search=True`)")
    return refine == "lanes"


# Over 80 lines with its documented keyword arguments (the public API); the code is under 65.
@renamed_keywords(
    refine=("lane_search", _lane_search_from_refine),
    refine_samples="lane_search_samples",
    compensation="compensate",
)
def score_checkpoint(
    model_dir: str | Path,
    data: str | Path,
    *,
    method: str = "projection",
    num_samples: int | None = 128,
    seq_len: int | None = None,
    batch_size: int = 4,
    device: str | None = None,
    dtype: str = "float32",
    device_map: str | None = None,
    seed: int = 0,
    progress: bool = True,
    lane_search: bool = False,
    lane_search_samples: int = 16,
    compensate: bool = False,
    blocks: Sequence[str] | bool | None = None,
    model: Any = None,
    recall: bool = False,
) -> dict[str, Any]:
    """Load a model folder, score it on the calibration file ``data`` and return the scores-file dict.

    The data file (UTF-8 text or JSONL with a ``"text"`` field) is tokenised with the folder's tokenizer
    and packed into ``num_samples`` windows of ``seq_len`` tokens (only as much of the file as that needs is
    read); layer prefixes are those of the checkpoint's tensors (what ``gdnprune sort`` expects). Behind
    ``gdnprune score`` and ``gdnprune prune``.

    ``seq_len=None`` takes what the model supports, at most 512 (:func:`default_seq_len`); the value
    used, and where it came from, are recorded under ``calibration``.

    ``blocks``: the kinds of block to order; None (default, as ``gdnprune score``): every kind the model has
    (see :func:`score_model`).

    ``lane_search=True`` then decides the lane orders by measured KL on the first ``lane_search_samples``
    windows (:func:`gdnprune.quality.lane_search.search_lane_orders`). ``compensate=True`` also collects the least-squares
    compensation statistics (:mod:`gdnprune.quality.compensate`) on every window, returned under the key
    ``"compensation_statistics"`` (numpy arrays: pop it before writing the scores as JSON; the CLI writes it
    beside the scores file). ``model``: the folder's model already loaded (see :func:`measure_checkpoint`).
    ``recall``: each calibration window followed by a recall probe weighted on its answers (see
    :func:`measure_checkpoint`); recorded as ``calibration["recall"]``.

    Under an initialised ``torch.distributed`` process group (``gdnprune score`` under ``torchrun``
    creates it), the windows are split across the ranks and the sums added (:func:`measure_checkpoint`);
    every rank returns the same scores, ``world_size`` records how many processes computed them.
    """
    keep = lane_search or compensate
    run = measure_checkpoint(
        model_dir,
        data,
        method=method,
        num_samples=num_samples,
        seq_len=seq_len,
        batch_size=batch_size,
        device=device,
        dtype=dtype,
        device_map=device_map,
        seed=seed,
        progress=progress,
        keep_model=keep,
        model=model,
        blocks=blocks,
        recall=recall,
    )
    with fail_together():
        scores = scores_from_statistics(run.statistics, world_size=run.world_size)
    if lane_search:
        with fail_together():
            windows = run.windows[: max(1, int(lane_search_samples))]
            scores, _ = search_lane_orders(
                run.loaded,
                list(iter_batches(windows, batch_size)),
                scores,
                progress=progress and is_main_process(),
            )
    if compensate:
        with fail_together():
            mine = shard_indices(run.windows.shape[0], rank(), world_size())
            stats = collect_statistics(
                run.loaded, list(iter_batches(run.windows[mine.start : mine.stop], batch_size))
            )
            mapping = map_to_checkpoint(list(stats), Path(model_dir))
        if world_size() > 1:
            for entry in stats.values():
                total = [
                    torch.from_numpy(entry["out_moment"]),
                    torch.tensor([entry["tokens"]], dtype=torch.float64),
                ]
                all_reduce_sum(total)
                entry["out_moment"], entry["tokens"] = total[0].numpy(), int(total[1].item())
        scores["compensation_statistics"] = {mapping[p]: v for p, v in stats.items()}
    run.loaded = None
    scores["model"] = str(model_dir)
    scores["calibration"] = {**run.calibration, **({"recall": True} if recall else {})}
    return scores
