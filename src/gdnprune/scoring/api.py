"""The scoring API: :func:`score_model` on a loaded model, :func:`score_checkpoint` on a model folder.

Calibration batches run through a real transformers model with :class:`~gdnprune.scoring.hooks.LayerScorer`
hooks on every GDN layer; the result is a scores-file dict (:mod:`gdnprune.io.scores_file`). The methods and
measures are described in ``docs/scoring.md``.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Sequence
from typing import Any

import torch

from ..model.kernels import cpu_gdn_kernels
from ..model.layouts import find_gdn_modules
from ..model.subblock_geometry import KINDS
from ..runtime.distributed import (
    all_reduce_sum,
    fail_together,
    is_distributed,
    is_main_process,
    world_size,
)
from .hidden import hidden_asked, make_hidden_scorer
from .hooks import LayerScorer
from .loss_head import default_loss_token_stride, output_head
from .passes import make_block_scorers, run_batches
from .payload import (
    DEFAULT_HIDDEN_MEASURE,
    HIDDEN_MEASURES,
    HiddenStatistics,
    LayerStatistics,
    ScoringStatistics,
    scores_from_statistics,
)

__all__ = [
    "METHODS",
    "score_model",
    "measure_statistics",
    "reduce_statistics",
    "SCORED_BLOCKS",
    "GDN_ONLY",
    "scored_kinds",
]

#: Scoring methods, the default first.
METHODS = ("projection", "activation", "random")

#: what ``blocks`` may name: the kinds of block of a plan (``depth`` has nothing to order and is accepted so
#: that ``score`` and ``plan`` take the same list); the GDN layers are always scored
SCORED_BLOCKS = ("gdn", *KINDS, "hidden", "depth")
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


@cpu_gdn_kernels()
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
    hidden_measure: str = DEFAULT_HIDDEN_MEASURE,
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
    if hidden_measure not in HIDDEN_MEASURES:
        raise ValueError(
            f"unknown hidden_measure {hidden_measure!r}; expected one of {list(HIDDEN_MEASURES)}"
        )
    block_scorers = make_block_scorers(model, scored_kinds(blocks), method, int(expert_sample_tokens))
    hidden = make_hidden_scorer(model, hidden_asked(blocks))
    if method == "random":
        layers = {}
        for prefix, module in modules:
            scorer = LayerScorer(prefix, module, method, key_dim_measure, value_dim_measure)
            layers[prefix] = LayerStatistics(scorer.shape, scorer.layout)
        return ScoringStatistics(
            method,
            int(seed),
            None,
            layers,
            {s.block.prefix: (s.block, {}) for s in block_scorers},
            None
            if hidden is None
            else HiddenStatistics(hidden.hidden.shape.hidden_size, [], {}, hidden_measure),
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
    hooked = block_scorers + ([] if hidden is None else [hidden])
    run_batches(model, batches, scorers, hooked, head, stride, int(window_offset), total, progress)
    layers = {s.prefix: LayerStatistics(s.shape, s.layout, s.statistics()) for s in scorers}
    hidden_stats = None if hidden is None else hidden.statistics(hidden_measure)
    blocks_stats = {s.block.prefix: (s.block, s.stats) for s in block_scorers}
    return ScoringStatistics(method, int(seed), measures, layers, blocks_stats, hidden_stats)


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
    hidden_measure: str = DEFAULT_HIDDEN_MEASURE,
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
        hidden_measure: how the hidden channels (the residual stream's width, scored when ``blocks`` names
            ``hidden``) are ordered
            (:data:`~gdnprune.scoring.payload.HIDDEN_MEASURES`; default ``activation``, Minitron's mean
            magnitude of the normalised activations summed over the norms, :mod:`gdnprune.scoring.hidden`);
            their payload is the scores file's top-level ``hidden`` entry.
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
        hidden_measure=hidden_measure,
    )
    if not (is_distributed() if distributed is None else distributed and is_distributed()):
        return scores_from_statistics(measure_statistics(model, batches, progress=progress, **options))
    with fail_together():
        statistics = measure_statistics(model, batches, progress=progress and is_main_process(), **options)
    reduce_statistics(statistics)
    with fail_together():
        return scores_from_statistics(statistics, world_size=world_size())
