"""The hidden size in the plan: one global choice, each candidate measured as a model of its own.

Cutting the hidden size (the residual stream's width, :mod:`gdnprune.model.hidden`) shrinks every matrix of
the model at once, so it is not one more group of the per-layer problem: every other candidate's cost depends
on it. The plan treats it as an outer choice (:func:`gdnprune.plan.api.search`): for each of a few hidden sizes
(:func:`hidden_candidates`), the model cut to that size (:func:`hidden_cut_model`, sorted by the scores'
hidden order first) is a problem of its own, whose cost tables are computed on it (every candidate at that
hidden size) and whose per-layer widths are measured and chosen exactly under the same absolute budgets
(:func:`absolute_budgets`); each size's whole cut model is then measured against the full model
(:class:`WholeKL`, the KL per token on the calibration windows), and the least KL wins. The hidden size alone
(every layer whole) is measured too: the sensitivity of the hidden cut as a candidate of its own.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from fractions import Fraction
from typing import Any

import torch

from ...io.loading import per_layer_gdn_modules, slice_model
from ...model.forwards import input_device, model_inputs, unpack_batches
from ...model.hidden import HIDDEN_KEY, apply_hidden_to_config, hidden_shape
from ...model.subblock_shapes import HiddenShape
from .problem import BUDGET_NAMES, PlanProblem

__all__ = [
    "HIDDEN_STEP",
    "HIDDEN_LOWEST",
    "hidden_candidates",
    "absolute_budgets",
    "hidden_cut_model",
    "hidden_meta_model",
    "WholeKL",
]

#: the hidden sizes a plan tries: steps of this fraction of the full size ... (on the bundled model the plan
#: chose 7/8 at 50 % and 35 % of the parameters; 5/8 and 1/2 were never close: BENCHMARKS.md)
HIDDEN_STEP = Fraction(1, 8)
#: ... down to this fraction of it
HIDDEN_LOWEST = Fraction(3, 4)


def hidden_candidates(
    shape: HiddenShape,
    *,
    step: Fraction = HIDDEN_STEP,
    lowest: Fraction = HIDDEN_LOWEST,
    multiple_of: int | None = None,
    sizes: Sequence[int] | None = None,
) -> list[int]:
    """The hidden sizes a plan measures, largest (the full size) first: ``sizes`` when given (each at most
    the full size), else ``1, 1 - step, ...`` down to ``lowest`` of the full size (1, 7/8, 3/4), rounded down to multiples
    of ``multiple_of`` (default 8; an FP8 checkpoint's tile keeps its scales whole) and never below it."""
    full = shape.hidden_size
    if sizes is not None:
        bad = [s for s in sizes if not isinstance(s, int) or isinstance(s, bool) or not 0 < s <= full]
        if bad:
            raise ValueError(f"hidden sizes must be integers in 1..{full}, got {bad}")
        return sorted({full, *sizes}, reverse=True)
    unit = int(multiple_of or 8)
    out = {full}
    k = 1
    while 1 - k * step >= lowest:
        size = math.floor(full * (1 - k * step) / unit) * unit
        if size >= unit:
            out.add(size)
        k += 1
    return sorted(out, reverse=True)


def absolute_budgets(problem: PlanProblem) -> dict[str, float]:
    """``{"budget_<name>": limit}``: every budget of the full model's problem as an absolute amount (a
    fraction means a fraction of the FULL model, whatever hidden size a candidate has)."""
    return {f"budget_{name}": float(problem.limits[name]) for name in BUDGET_NAMES if name in problem.limits}


def hidden_cut_model(model: Any, scores: Mapping[str, Any], size: int, *, orders_applied: bool) -> Any:
    """``model`` sorted by the scores' hidden order (unless ``orders_applied``) and cut to hidden size ``size``
    (the model itself at its full size)."""
    shape = hidden_shape(model.config)
    if size == shape.hidden_size:
        return model
    order = None if orders_applied else scores.get(HIDDEN_KEY)
    if order is None and not orders_applied:
        raise ValueError(
            "the scores have no order of the hidden channels (a 'hidden' entry); score this model with the "
            "hidden channels (the default `blocks`, or `blocks` naming 'hidden') or leave 'hidden' out of "
            "`blocks`"
        )
    return slice_model(model, hidden_size=size, hidden_order=order)


def hidden_meta_model(model: Any, size: int) -> Any:
    """``model``'s structure at hidden size ``size`` on the ``meta`` device (no weight): for costs only."""
    config = apply_hidden_to_config(
        model.config.to_dict(), hidden_shape(model.config).replace(hidden_size=size)
    )
    with per_layer_gdn_modules(type(model)), torch.device("meta"):
        return type(model)(type(model.config).from_dict(config)).eval()


class WholeKL:
    """The KL per token of whole models against ``teacher`` on the calibration ``batches``: the teacher's final
    hidden states are kept once (on the CPU), each model is then run whole (its own embedding, decoder and
    head: any hidden size) and compared token by token, the logits of both computed ``max_logits`` elements
    at a time (what the measured sensitivity assumes too: logits are ``lm_head(last hidden state)``)."""

    def __init__(self, teacher: Any, batches: Iterable[Any], *, max_logits: int = 1 << 24):
        self.data = unpack_batches(batches)
        if not self.data:
            raise ValueError("the hidden size is measured on calibration batches: give at least one")
        self.head, self.max_logits = teacher.get_output_embeddings(), max_logits
        self.finals = [self._final(teacher, ids, mask).cpu() for ids, mask in self.data]

    @staticmethod
    @torch.inference_mode()
    def _final(model: Any, ids: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        inputs = model_inputs(ids, mask, input_device(model))
        return model.get_decoder()(**inputs).last_hidden_state

    @torch.inference_mode()
    def __call__(self, model: Any) -> float:
        """The KL(teacher || ``model``) per token, over every calibration window."""
        head, total, tokens = model.get_output_embeddings(), 0.0, 0
        chunk = max(1, self.max_logits // max(1, head.weight.shape[0]))
        for (ids, mask), teacher in zip(self.data, self.finals):
            student = self._final(model, ids, mask)
            valid = (torch.ones_like(ids, dtype=torch.bool) if mask is None else mask).reshape(-1)
            student, teacher = student.reshape(-1, student.shape[-1]), teacher.reshape(-1, teacher.shape[-1])
            for start in range(0, student.shape[0], chunk):
                rows = slice(start, start + chunk)
                log_s = head(student[rows]).float().log_softmax(-1)
                log_t = self.head(teacher[rows].to(self.head.weight.device)).float().log_softmax(-1)
                kl = (log_t.exp() * (log_t - log_s.to(log_t.device))).sum(-1)
                total += float(kl[valid[rows].to(kl.device)].sum())
            tokens += int(valid.sum())
        return total / max(tokens, 1)
