"""Importance scoring: calibration forwards with hooks -> importance orders of the GatedDeltaNet layers and
of the other sub-blocks (attention heads, MLP and shared-expert channels, routed experts).

:func:`score_model` runs calibration batches through a loaded transformers model and returns a scores
file dict (:mod:`gdnprune.io.scores_file`); :func:`score_checkpoint` does the same for a model folder and a text
file. The methods (``projection``, ``activation``, ``random``) and their measures are derived in
``docs/scoring.md``.

The rooms: :mod:`.hooks` (per-layer hooks and statistics), :mod:`.payload` (orders and scores from the
statistics), :mod:`.orders` (greedy removal on Gram matrices), :mod:`.loss_head` (the next-token loss
gradient at the final norm), :mod:`.api` (scoring a loaded model), :mod:`.from_folder` (a model folder; under
``torch.distributed`` each rank scores its share of the windows and the statistics are summed, see :mod:`gdnprune.runtime.distributed`),
:mod:`.partial` (the statistics of one share in a file, and the merge of all shares). This package
imports torch.
"""

from ..io.scores_file import SCORES_FORMAT, SCORES_VERSION, load_scores, save_scores, scores_to_permutations
from .api import GDN_ONLY, METHODS, SCORED_BLOCKS, measure_statistics, reduce_statistics, score_model
from .from_folder import (
    DEFAULT_MAX_SEQ_LEN,
    CheckpointStatistics,
    ScoringOptions,
    default_seq_len,
    measure_checkpoint,
    score_checkpoint,
)
from .orders import greedy_lane_orders, greedy_removal_order
from .partial import PartialError, load_partial, merge_partials, save_partial
from .payload import ScoringStatistics, scores_from_statistics

__all__ = [
    "METHODS",
    "ScoringOptions",
    "SCORED_BLOCKS",
    "GDN_ONLY",
    "SCORES_FORMAT",
    "SCORES_VERSION",
    "score_model",
    "score_checkpoint",
    "default_seq_len",
    "DEFAULT_MAX_SEQ_LEN",
    "greedy_removal_order",
    "greedy_lane_orders",
    "scores_to_permutations",
    "save_scores",
    "load_scores",
    "measure_statistics",
    "reduce_statistics",
    "scores_from_statistics",
    "ScoringStatistics",
    "measure_checkpoint",
    "CheckpointStatistics",
    "save_partial",
    "load_partial",
    "merge_partials",
    "PartialError",
]
