"""Recall in the plan: the windows its sensitivity is measured on, and recall kept as a constraint.

:func:`measured_windows`: where GDN layers may shrink, the candidates are measured on recall windows
(:func:`gdnprune.quality.recall_windows.recall_windows`: with the model's tokenizer, every calibration window
followed by a passkey or MQAR probe of its length; without one, spans of the text written twice; the answers
carry :data:`~gdnprune.quality.recall_windows.RECALL_SHARE` of the KL), unless the sensitivity
is ``short`` (the calibration windows as they are). ``docs/scoring.md`` gives the measurements behind the
choice.

:class:`RecallCheck` measures the whole cut model's recall as :mod:`.latency_costs` measures its latency: the
greedy exact match of the answers of held-out recall probes as long as the calibration windows (the
built-in passkey and MQAR probes, another seed than ``gdnprune eval``'s), the cut modules swapped into the
model in place (:func:`.latency_costs.cut_in_place`);
:func:`fit_recall` chooses again, on sensitivities measured with a larger share for recall, while the cut
model keeps less than ``keep`` of the unpruned model's exact match.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ...quality.recall_windows import RECALL_SHARE, exact_match, probe_windows, recall_windows
from .latency_costs import cut_in_place
from .problem import PlanProblem

__all__ = [
    "CHECK_SEED",
    "RECALL_ROUNDS",
    "RecallCheck",
    "fit_recall",
    "measured_windows",
    "next_share",
    "recall_windows_used",
]

#: how many times :func:`fit_recall` may measure and choose again
RECALL_ROUNDS = 2
#: the seed of the recall check's probes (the sensitivity's: ``recall_windows.PROBE_SEED``; ``gdnprune eval``'s: 0)
CHECK_SEED = 43_001


def recall_windows_used(sensitivity: str, problem: PlanProblem) -> bool:
    """Whether the sensitivity is measured on recall windows: GDN layers may shrink, and it is measured (not
    ``short``, not ``proxy``)."""
    return bool(problem.layers) and sensitivity not in ("short", "proxy")


def measured_windows(batches: list | None, share: float, tokenizer: Any = None) -> list | None:
    """The batches the candidates are measured on: recall windows with ``share`` of the KL on the answers
    (0: the calibration batches as they are)."""
    if batches is None or share <= 0:
        return batches
    return recall_windows(batches, tokenizer=tokenizer, share=share)


def next_share(share: float) -> float:
    """The recall share of the next round: half way to 1 (0 goes to :data:`RECALL_SHARE`)."""
    return RECALL_SHARE if share <= 0 else (1 + share) / 2


@dataclass
class RecallCheck:
    """The recall of whole cut models: greedy exact match of the answers of recall probes as long as the
    calibration windows (seed :data:`CHECK_SEED`; passkey and MQAR with their own filler, as ``gdnprune
    eval`` asks them; without a tokenizer, spans of the calibration text written twice); ``unpruned``: the
    unpruned model's (hits, asked)."""

    model: Any
    windows: list
    unpruned: tuple[int, int]

    @classmethod
    def build(cls, model: Any, batches: list, tokenizer: Any = None) -> RecallCheck:
        if tokenizer is None:
            windows = recall_windows(batches, seed=CHECK_SEED)
        else:
            windows = probe_windows(batches, tokenizer, seed=CHECK_SEED, haystack=False)
        return cls(model, windows, exact_match(model, windows))

    def kept(
        self, problem: PlanProblem, picks: Sequence[int | None], removed: Sequence[int]
    ) -> dict[str, Any]:
        """The cut model's exact match and its share of the unpruned model's, with standard errors."""
        with cut_in_place(self.model, problem, picks, removed) as cut:
            hits, asked = exact_match(cut, self.windows)
        base_hits, base_asked = self.unpruned
        accuracy, base = hits / max(asked, 1), base_hits / max(base_asked, 1)
        return {
            "exact_match": accuracy,
            "exact_match_stderr": math.sqrt(accuracy * (1 - accuracy) / max(asked - 1, 1)),
            "unpruned_exact_match": base,
            "kept": accuracy / base if base > 0 else 1.0,
            "asked": asked,
        }


def fit_recall(
    check: RecallCheck,
    problem: PlanProblem,
    keep: float,
    share: float,
    choose: Callable[[float], Any],
    *,
    rounds: int = RECALL_ROUNDS,
) -> tuple[Any, list[dict[str, Any]]]:
    """The choice of ``choose(share)`` (sensitivities measured with ``share`` of the KL on recall, then the
    exact choice), its whole cut model's recall checked, and chosen again with a larger share
    (:func:`next_share`) while it keeps less than ``keep`` of the unpruned model's exact match, at most
    ``rounds`` times. Returns the last choice and one record per round (``share``, the check's numbers,
    ``met``)."""
    history: list[dict[str, Any]] = []
    for round_ in range(rounds + 1):
        choice = choose(share)
        record = {"share": share, **check.kept(problem, choice.picks, choice.removed)}
        record["met"] = record["kept"] >= keep
        history.append(record)
        if record["met"] or round_ == rounds:
            break
        share = next_share(share)
    return choice, history
