"""Importance scoring of GatedDeltaNet layers: calibration forwards with hooks -> importance orders.

:func:`score_model` runs calibration batches through a loaded transformers model and returns a scores
file dict (:mod:`gdnprune.scores`); :func:`score_checkpoint` does the same for a model folder and a text
file. The methods (``projection``, ``activation``, ``random``) and their measures are derived in
``docs/scoring.md``.

The rooms: :mod:`.hooks` (per-layer hooks and statistics), :mod:`.orders` (greedy removal on Gram
matrices), :mod:`.loss_head` (the next-token loss gradient at the final norm), :mod:`.api` (the two
public functions). This package imports torch.
"""

from ..scores import SCORES_FORMAT, SCORES_VERSION, load_scores, save_scores, scores_to_permutations
from .api import DEFAULT_MAX_SEQ_LEN, METHODS, default_seq_len, score_checkpoint, score_model
from .orders import greedy_lane_orders, greedy_removal_order

__all__ = [
    "METHODS",
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
]
