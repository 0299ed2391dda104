"""The scoring API: :func:`score_model` on a loaded model, :func:`score_checkpoint` on a model folder.

Calibration batches run through a real transformers model with :class:`~gdnprune.scoring.hooks.LayerScorer`
hooks on every GDN layer; the result is a scores-file dict (:mod:`gdnprune.io.scores_file`). The methods and
measures are described in ``docs/scoring.md``.
"""

from __future__ import annotations

import hashlib
import json
import warnings
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import AutoTokenizer

from ..checkpoint.folder import map_to_checkpoint
from ..corpus import data_spec, data_stat
from ..io.loading import load_causal_lm
from ..model import model_config
from ..model.layouts import find_gdn_modules
from ..model.subblock_geometry import KINDS
from ..quality.calibration import calibration_windows, iter_batches
from ..quality.compensate import collect_statistics
from ..quality.lane_search import search_lane_orders
from ..quality.recall_windows import recall_windows
from ..runtime.deprecation import renamed_keywords
from ..runtime.distributed import (
    all_reduce_sum,
    fail_together,
    is_distributed,
    is_main_process,
    local_gpus,
    rank,
    shard_indices,
    world_size,
)
from ..runtime.fileio import file_sha256
from .hooks import LayerScorer
from .loss_head import default_loss_token_stride, output_head
from .passes import make_block_scorers, run_batches
from .payload import LayerStatistics, ScoringStatistics, scores_from_statistics

__all__ = [
    "METHODS",
    "DEFAULT_MAX_SEQ_LEN",
    "score_model",
    "measure_statistics",
    "reduce_statistics",
    "CheckpointStatistics",
    "measure_checkpoint",
    "score_checkpoint",
    "ScoringOptions",
    "default_seq_len",
    "SCORED_BLOCKS",
    "GDN_ONLY",
    "scored_kinds",
]

#: Scoring methods, the default first.
METHODS = ("projection", "activation", "random")

#: what ``blocks`` may name: the kinds of block of a plan (``depth`` has nothing to order and is accepted so
#: that ``score`` and ``plan`` take the same list); the GDN layers are always scored
SCORED_BLOCKS = ("gdn", *KINDS, "depth")
#: ``blocks`` for the GDN layers alone (the default, None, orders every kind the model has)
GDN_ONLY = ("gdn",)

_KEY_DIM_MEASURES = ("qk_rms", "qk_gram", "qk_energy", "q_energy", "k_energy")
_VALUE_DIM_MEASURES = ("head_rms", "energy", "gram", "loss_gram")
_HEAD_MEASURES = ("loss_gram", "energy_gram")


def _check_options(
    method: str,
    key_dim_measure: str,
    value_dim_measure: str,
    lane_measure: str,
    key_group_measure: str,
    loss_token_stride: int | None,
) -> None:
    if method not in METHODS:
        raise ValueError(f"unknown scoring method {method!r}; expected one of {list(METHODS)}")
    if key_dim_measure not in _KEY_DIM_MEASURES:
        raise ValueError(
            f"unknown key_dim_measure {key_dim_measure!r}; expected one of {list(_KEY_DIM_MEASURES)}"
        )
    if value_dim_measure not in _VALUE_DIM_MEASURES:
        raise ValueError(
            f"unknown value_dim_measure {value_dim_measure!r}; expected one of {list(_VALUE_DIM_MEASURES)}"
        )
    for name, value in (("lane_measure", lane_measure), ("key_group_measure", key_group_measure)):
        if value not in _HEAD_MEASURES:
            raise ValueError(f"unknown {name} {value!r}; expected one of {list(_HEAD_MEASURES)}")
    if loss_token_stride is not None and int(loss_token_stride) < 1:
        raise ValueError(f"loss_token_stride must be >= 1, got {loss_token_stride}")


def scored_kinds(blocks: Sequence[str] | bool | None) -> tuple[str, ...] | None:
    """The sub-block kinds that ``blocks`` asks to score, or None for every kind the model has.

    ``blocks`` names kinds of block (:data:`SCORED_BLOCKS`) and must include ``"gdn"``. The old boolean
    (``True``: every kind, ``False``: the GDN layers alone) still works, with a ``FutureWarning``.
    """
    if blocks is None:
        return None
    if isinstance(blocks, bool):
        warnings.warn(
            f"`blocks={blocks}` is deprecated and will be removed; give the kinds of block to score, "
            f"e.g. `blocks={list(SCORED_BLOCKS[:-1]) if blocks else ['gdn']}` (default: every kind)",
            FutureWarning,
            stacklevel=3,
        )
        return tuple(KINDS) if blocks else ()
    names = [blocks] if isinstance(blocks, str) else list(blocks)
    unknown = [b for b in names if b not in SCORED_BLOCKS]
    if unknown:
        raise ValueError(f"`blocks` must name some of {list(SCORED_BLOCKS)}, got {names}")
    if "gdn" not in names:
        raise ValueError(
            f"`blocks` must include 'gdn' (a scores file always orders the GDN layers), got {names}"
        )
    return tuple(k for k in KINDS if k in names)


def measure_statistics(
    model: torch.nn.Module,
    batches: Iterable[Any],
    *,
    method: str = "projection",
    progress: bool = True,
    seed: int = 0,
    total: int | None = None,
    key_dim_measure: str = "qk_rms",
    value_dim_measure: str = "head_rms",
    lane_measure: str = "loss_gram",
    key_group_measure: str = "energy_gram",
    loss_token_stride: int | None = None,
    window_offset: int = 0,
    blocks: Sequence[str] | bool | None = None,
    expert_sample_tokens: int = 0,
) -> ScoringStatistics:
    """The forward passes of :func:`score_model` in this process alone: the sums, before any order.

    Same arguments as :func:`score_model`; nothing is exchanged with other processes. The result can be
    summed with other processes' (:func:`reduce_statistics`), stored (:mod:`gdnprune.scoring.partial`) and
    turned into a scores dict by :func:`gdnprune.scoring.payload.scores_from_statistics`. With no batches
    (an empty share), every statistic is zero.
    """
    _check_options(
        method, key_dim_measure, value_dim_measure, lane_measure, key_group_measure, loss_token_stride
    )
    modules = find_gdn_modules(model)
    if not modules:
        raise ValueError(f"{type(model).__name__} has no GatedDeltaNet layers to score")
    if int(expert_sample_tokens) < 0:
        raise ValueError(f"expert_sample_tokens must be >= 0, got {expert_sample_tokens}")
    block_scorers = make_block_scorers(model, scored_kinds(blocks), method, int(expert_sample_tokens))
    if method == "random":
        layers = {}
        for prefix, module in modules:
            scorer = LayerScorer(prefix, module, method, key_dim_measure, value_dim_measure)
            layers[prefix] = LayerStatistics(scorer.shape, scorer.layout)
        return ScoringStatistics(
            method, int(seed), None, layers, {s.block.prefix: (s.block, {}) for s in block_scorers}
        )
    head: tuple[Any, Any] | None = None
    if method == "projection" and "loss_gram" in (lane_measure, key_group_measure, value_dim_measure):
        found = output_head(model)
        if isinstance(found, str):  # without a head: the energy Gram and head_rms instead
            _warn_no_head(found)
            lane_measure = "energy_gram" if lane_measure == "loss_gram" else lane_measure
            key_group_measure = "energy_gram" if key_group_measure == "loss_gram" else key_group_measure
            value_dim_measure = "head_rms" if value_dim_measure == "loss_gram" else value_dim_measure
        else:
            head = found
    measures: dict[str, Any] | None = None
    if method == "projection":
        measures = {
            "key_group": key_group_measure,
            "value_lane": lane_measure,
            "key_dim": key_dim_measure,
            "value_dim": value_dim_measure,
        }
        if head is not None:
            if loss_token_stride is None:
                loss_token_stride = default_loss_token_stride(model, head[1])
            measures["loss_token_stride"] = int(loss_token_stride)
    scorers = [
        LayerScorer(p, m, method, key_dim_measure, value_dim_measure, lane_measure, key_group_measure)
        for p, m in modules
    ]
    if total is None and hasattr(batches, "__len__"):
        total = len(batches)  # type: ignore[arg-type]
    stride = None if head is None else int(loss_token_stride or 0)
    run_batches(model, batches, scorers, block_scorers, head, stride, int(window_offset), total, progress)
    layers = {s.prefix: LayerStatistics(s.shape, s.layout, s.statistics()) for s in scorers}
    return ScoringStatistics(
        method, int(seed), measures, layers, {s.block.prefix: (s.block, s.stats) for s in block_scorers}
    )


def _warn_no_head(why: str) -> None:
    warnings.warn(
        f"gdnprune score: {why}, so the loss-aware Gram cannot be computed; ordering with the energy "
        "Gram (lanes, key groups) and head_rms (value channels) instead",
        RuntimeWarning,
        stacklevel=4,  # the frame stacklevel=3 names from measure_statistics
    )


def reduce_statistics(statistics: ScoringStatistics, *, group: Any = None) -> ScoringStatistics:
    """Sum the statistics over the ranks of the process group, in place (a no-op with one process)."""
    all_reduce_sum(statistics.tensors(), group=group)
    return statistics


# Over 80 lines with its documented keyword arguments (the public API); the code is under 65.
def score_model(
    model: torch.nn.Module,
    batches: Iterable[Any],
    *,
    method: str = "projection",
    progress: bool = True,
    seed: int = 0,
    total: int | None = None,
    key_dim_measure: str = "qk_rms",
    value_dim_measure: str = "head_rms",
    lane_measure: str = "loss_gram",
    key_group_measure: str = "energy_gram",
    loss_token_stride: int | None = None,
    window_offset: int = 0,
    distributed: bool | None = None,
    blocks: Sequence[str] | bool | None = None,
    expert_sample_tokens: int = 0,
) -> dict[str, Any]:
    """Score every GDN layer of ``model`` (and, by default, its other sub-blocks) on calibration ``batches``;
    returns the scores-file dict.

    Args:
        model: a transformers model with GDN layers (Qwen3.5 text/VL, Qwen3.5-MoE, Qwen3-Next,
            Qwen4-exp, OLMo-hybrid), possibly dispatched over devices by accelerate.
        batches: an iterable of ``input_ids`` [B, T] tensors, or mappings with ``input_ids`` and an
            optional ``attention_mask`` (masked tokens are left out of every statistic).
        method: ``"projection"`` (default), ``"activation"`` or ``"random"`` (see the module docs).
        progress: show a tqdm progress bar over the batches (on rank 0 only).
        seed: seed of the ``random`` method (recorded for every method).
        total: number of batches for the progress bar (default ``len(batches)`` when available).
        key_dim_measure: ``projection`` only, how key channels are ordered: ``"qk_rms"`` (default; sort by
            ``RMS(q^_d) + RMS(k^_d)`` of the l2-normalised q and k), ``"qk_gram"`` (greedy on ``Cq * Ck``,
            the energy of the q^.k^ products), ``"qk_energy"`` (sort by ``E[q^_d^2] E[k^_d^2]``),
            ``"q_energy"`` or ``"k_energy"``.
        value_dim_measure: ``projection`` only, how value channels are ordered: ``"head_rms"`` (default;
            sort by ``sum_h RMS(W[:, (h, e)] o_(h, e))``), ``"energy"`` (sort by the energy of the channel's
            projected contribution summed over heads, ``sum_t |sum_h W[:, (h, e)] o_(h, e)|^2``) or
            ``"gram"`` (greedy on the full value-channel Gram; needs the full ``[Hv*dv]^2`` second moment
            of the ``out_proj`` input per layer, ``(Hv*dv)^2`` per token and as much memory) or
            ``"loss_gram"`` (greedy on the loss-aware channel Gram ``sum_t (g_t . s_e)(g_t . s_f)``, ``s_e``
            channel ``e``'s contribution summed over heads).
        lane_measure: ``projection`` only, the Gram behind the lane orders: ``"loss_gram"`` (default; the
            loss-aware Gram, see the module docs) or ``"energy_gram"`` (the contribution Gram).
        key_group_measure: ``projection`` only, the same choice for key groups (default ``"energy_gram"``).
        loss_token_stride: measure the loss gradient on one token in this many; the cost is two
            ``lm_head``-sized products per measured token, the memory each layer's ``out_proj`` input at
            the measured tokens of one batch. Default (None): 8, raised to a larger power of two when the
            vocabulary products would cost more than an eighth of the forward pass
            (:func:`~gdnprune.scoring.loss_head.default_loss_token_stride`).
        window_offset: the running index of the first window of ``batches`` among all calibration windows,
            when ``batches`` is one share of them (the loss tokens are chosen by the global index).
        blocks: the kinds of block to order (:data:`SCORED_BLOCKS`: ``gdn``, ``attention``, ``mlp``,
            ``shared_expert``, ``experts``; ``gdn`` always; ``depth`` orders nothing); None (default): every
            kind the model has, as ``gdnprune score`` and ``plan_model`` default to; :data:`GDN_ONLY`: the
            GDN layers alone. The sub-blocks are scored in the same forward passes
            (:mod:`gdnprune.scoring.subblocks`, :mod:`gdnprune.scoring.experts`); their payloads join ``layers``
            under the sub-blocks' prefixes (``random``: random orders). Kinds whose modules fit no layout
            (Qwen4-exp's indexed attention) are left out (with a warning when named).
        expert_sample_tokens: ``projection`` only, keep up to this many routed tokens per MoE layer
            (:data:`~gdnprune.scoring.experts.SAMPLE_TOKENS` is the benchmarks' 4096) for the measured
            greedy removal of the experts (payload ``expert_greedy``, ``expert_greedy_error``; not the
            default order, :mod:`gdnprune.scoring.expert_greedy`); 0 (default): none.
        distributed: sum the statistics over the ranks of the initialised ``torch.distributed`` process
            group before the orders are computed (default None: when a group with more than one process
            is initialised). Each rank passes its own share of the windows
            (:func:`gdnprune.runtime.distributed.shard_indices`) and its ``window_offset``; every rank returns
            the same scores. A failure on one rank raises on every rank
            (:func:`gdnprune.runtime.distributed.fail_together`).

    Returns:
        ``{"format", "version", "method", "num_tokens", "world_size", "seed", "layers": {prefix: payload}}``,
        with ``"measures"`` (the measures used, after any fallback) for ``projection``.

    Raises:
        ValueError: unknown method or measure, a model without GDN layers, or no calibration tokens.
    """
    options: dict[str, Any] = dict(
        method=method,
        seed=seed,
        total=total,
        key_dim_measure=key_dim_measure,
        value_dim_measure=value_dim_measure,
        lane_measure=lane_measure,
        key_group_measure=key_group_measure,
        loss_token_stride=loss_token_stride,
        window_offset=window_offset,
        blocks=blocks,
        expert_sample_tokens=expert_sample_tokens,
    )
    if not (is_distributed() if distributed is None else distributed and is_distributed()):
        return scores_from_statistics(measure_statistics(model, batches, progress=progress, **options))
    with fail_together():
        statistics = measure_statistics(model, batches, progress=progress and is_main_process(), **options)
    reduce_statistics(statistics)
    with fail_together():
        return scores_from_statistics(statistics, world_size=world_size())


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
    probe of its length whose answers weigh as much as the window
    (:func:`gdnprune.quality.recall_windows.recall_windows`), so the orders keep what recall needs.
    """
    model_dir = Path(model_dir)
    with fail_together():
        if not (model_dir / "config.json").is_file():
            raise ValueError(f"{model_dir}: not a model folder (no config.json)")
        if batch_size < 1:
            raise ValueError(f"`batch_size` must be >= 1, got {batch_size}")
        kinds = scored_kinds(blocks)  # checked before the (long) load
        blocks = None if kinds is None else ("gdn", *kinds)
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
