"""Depth in the plan (issue 23): removing a decoder layer is one more candidate of that layer, of cost 0.

A layer's sub-blocks (GDN or attention, MLP or experts, ...) are separate candidate groups of the MILP
(:func:`gdnprune.plan.choose.solve.choose`: one candidate per group, additive sensitivities, linear budgets).
Removal couples them: :func:`choose_with_removal` adds one binary ``r_l`` per decoder layer and asks every
group ``g`` of layer ``l`` for ``sum_c x_gc + r_l = 1`` — either a width candidate of every sub-block or
the whole layer gone, whose sensitivity ``S_l`` enters once and whose costs are 0 (its parameters, its
recurrent state and its KV cache leave every budget). One exact MILP then chooses widths and depth together.

:func:`removal_sensitivity` measures ``S_l`` like the other candidates: the KL against the teacher of the
model with layer ``l`` alone skipped (its output is its input), from the layer's cached input
(:class:`gdnprune.model.forwards.Forwards`). :func:`gdnprune.scoring.experts.block_influence` is the one-pass proxy
(``1 - cos``, not a KL: it ranks layers against each other but not against width candidates, so the plan
refuses it where removal and widths compete).

In the whole-model search (:mod:`.api`) every decoder layer that may go also has a :class:`LayerRest`
group: what the layer costs beyond its planned sub-blocks (norms, sub-blocks left out of ``blocks``), one
candidate, sensitivity 0; removing the layer takes it off every budget with the rest.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from scipy.optimize import LinearConstraint

from ...model.forwards import Forwards, hidden_argument
from .solve import BudgetError, budgeted_milp

__all__ = [
    "DepthCheck",
    "LayerRest",
    "choose_with_removal",
    "keep_better",
    "pool_with_removal",
    "removal_sensitivity",
    "skipped_output",
]


class LayerRest:
    """The part of a decoder layer no candidate changes, as a candidate group: one candidate (the layer as it
    is), never cut; it goes only with the whole layer. Offers what the evolutionary search reads from a group
    (``prefix``, ``module`` — the decoder layer —, ``shape``, ``candidates``)."""

    shape = "whole"

    def __init__(self, prefix: str, module: Any, index: int):
        self.prefix, self.module, self.index = prefix, module, index
        self.candidates = [self.shape]


def skipped_output(module: Any, args: tuple, kwargs: dict, output: Any) -> Any:
    """A forward hook (``with_kwargs=True``) that makes a decoder layer hand on its input: the layer skipped."""

    hidden = hidden_argument(args, kwargs)
    return (hidden, *output[1:]) if isinstance(output, tuple) else hidden


# long: its documented signature and docstring; the body is 72 lines, one step after another
def choose_with_removal(
    sensitivity: Sequence[Sequence[float]],
    costs: Mapping[str, Sequence[Sequence[float]]],
    budgets: Mapping[str, float],
    *,
    layer_of: Sequence[int],
    removal: Mapping[int, float],
    allowed: Sequence[Sequence[bool]] | None = None,
    keep_one_of: Sequence[int] = (),
    exclude: Sequence[Sequence[int | None]] = (),
) -> tuple[list[int | None], list[int]]:
    """The candidate of every group, or None where its decoder layer is removed, that minimises the summed
    sensitivity within ``budgets``; and the removed layers. At least one of the groups' layers stays.

    Args:
        sensitivity, costs, budgets: as for :func:`gdnprune.plan.choose.solve.choose` (per group, per candidate).
        layer_of: the decoder layer of every group.
        removal: decoder layer -> the sensitivity of removing it (layers not named may not be removed).
        allowed: ``allowed[g][c]``: the candidates that may be chosen (all when None; as
            :func:`gdnprune.plan.choose.solve.choose_among`, e.g. successive halving's survivors); removal always may.
        keep_one_of: decoder layers of which at least one stays (a hybrid model's full-attention layers:
            transformers' cache counts the sequence length on one).
        exclude: choices (as returned: None where the layer is removed) that may not be returned, each cut
            off by one no-good constraint (:func:`gdnprune.plan.choose.solve.no_good_cut`, the removals' binaries
            included): the next best choice, for a solution pool (:func:`pool_with_removal`).

    Raises:
        BudgetError: no choice meets the budgets; ValueError: inconsistent inputs.
    """

    if len(layer_of) != len(sensitivity):
        raise ValueError(f"layer_of names {len(layer_of)} groups, sensitivity has {len(sensitivity)}")
    for name, per_group in costs.items():
        if len(per_group) != len(sensitivity) or any(
            len(a) != len(b) for a, b in zip(per_group, sensitivity)
        ):
            raise ValueError(f"costs[{name!r}] must have one cost per candidate of every group")
    unknown = sorted(set(removal) - set(layer_of))
    if unknown:
        raise ValueError(f"removal names layers {unknown} that no group belongs to")
    layers = sorted(removal)
    sizes = [len(g) for g in sensitivity]
    n, m = sum(sizes), len(layers)
    starts = np.cumsum([0] + sizes[:-1])
    rows = np.zeros((len(sizes), n + m))
    for g, (start, size) in enumerate(zip(starts, sizes)):
        rows[g, start : start + size] = 1
        if layer_of[g] in removal:
            rows[g, n + layers.index(layer_of[g])] = 1
    constraints = [LinearConstraint(rows, 1, 1)]
    if m:  # never every layer
        constraints.append(
            LinearConstraint(np.concatenate([np.zeros(n), np.ones(m)])[None, :], 0, len(set(layer_of)) - 1)
        )
    keep = [layers.index(layer) for layer in keep_one_of if layer in removal]
    if keep and len(keep) == len(set(keep_one_of)):  # every one of them could go: one stays
        row = np.zeros(n + m)
        row[[n + k for k in keep]] = 1
        constraints.append(LinearConstraint(row[None, :], 0, len(keep) - 1))
    budget_rows = [
        (np.concatenate([*(np.asarray(g, dtype=np.float64) for g in costs[name]), np.zeros(m)]), b)
        for name, b in budgets.items()
    ]
    for picks in exclude:
        constraints.append(_removal_cut(picks, starts, n, layers, layer_of))
    c = np.concatenate(
        [
            np.concatenate([np.asarray(g, dtype=np.float64) for g in sensitivity]),
            np.asarray([removal[layer] for layer in layers], dtype=np.float64),
        ]
    )
    upper = np.ones(n + m)
    if allowed is not None:
        if len(allowed) != len(sizes) or any(len(a) != size for a, size in zip(allowed, sizes)):
            raise ValueError("`allowed` must have one flag per candidate of every group")
        upper[:n] = np.concatenate([np.asarray(a, dtype=np.float64) for a in allowed])
    result = budgeted_milp(c, constraints, budget_rows, upper)
    if result.status == 2 or result.x is None:
        least = {
            name: float(sum(min(g) for g, layer in zip(costs[name], layer_of) if layer not in removal))
            for name in budgets
        }
        raise BudgetError(
            f"no plan meets the budgets even with every allowed layer removed: least reachable {least}, "
            f"budgets {dict(budgets)}"
        )
    if result.status != 0:
        raise RuntimeError(f"the MILP solver stopped without an optimum: {result.message}")
    x = np.round(result.x).astype(int)
    removed = [layer for k, layer in enumerate(layers) if x[n + k]]
    choice: list[int | None] = []
    for g, (start, size) in enumerate(zip(starts, sizes)):
        picked = np.flatnonzero(x[start : start + size])
        choice.append(None if layer_of[g] in removed else int(picked[0]))
    return choice, removed


def _removal_cut(
    picks: Sequence[int | None],
    starts: Sequence[int] | np.ndarray,
    n: int,
    layers: Sequence[int],
    layer_of: Sequence[int],
) -> LinearConstraint:
    """The no-good constraint of one choice of :func:`choose_with_removal` (as
    :func:`gdnprune.plan.choose.solve.no_good_cut`): its width binaries and the binaries of the layers it removes,
    at most all of them but one set."""
    row = np.zeros(n + len(layers))
    row[[start + p for start, p in zip(starts, picks) if p is not None]] = 1
    row[
        [n + layers.index(layer) for layer in sorted({layer_of[g] for g, p in enumerate(picks) if p is None})]
    ] = 1
    return LinearConstraint(row[None, :], -np.inf, float(row.sum()) - 1)


def pool_with_removal(
    sensitivity: Sequence[Sequence[float]],
    costs: Mapping[str, Sequence[Sequence[float]]],
    budgets: Mapping[str, float],
    count: int,
    **options: Any,
) -> list[list[int | None]]:
    """The ``count`` best distinct choices of :func:`choose_with_removal` (``options``: its keywords), best
    first; fewer when fewer meet the budgets."""
    pool: list[list[int | None]] = []
    while len(pool) < count:
        try:
            pool.append(choose_with_removal(sensitivity, costs, budgets, exclude=pool, **options)[0])
        except BudgetError:
            if not pool:
                raise
            break
    return pool


@dataclass(frozen=True)
class DepthCheck:
    """Depth that never loses to widths: the measured loss (KL of the whole cut model on the calibration
    windows) of the plan that removes ``removed`` and of the best widths-only plan (None: no widths-only plan
    meets the budgets), and which was ``kept`` (``"depth"`` or ``"widths"``)."""

    removed: list[int]
    depth_kl: float
    widths_kl: float | None
    kept: str

    def as_dict(self) -> dict[str, Any]:
        return {
            "removed_layers": self.removed,
            "depth_kl": self.depth_kl,
            "widths_only_kl": self.widths_kl,
            "kept": self.kept,
        }


def keep_better(
    with_depth: Sequence[int | None],
    removed: Sequence[int],
    sensitivity: Sequence[Sequence[float]],
    costs: Mapping[str, Sequence[Sequence[float]]],
    budgets: Mapping[str, float],
    measure: Callable[[Sequence[int | None]], float],
    *,
    layer_of: Sequence[int],
    allowed: Sequence[Sequence[bool]] | None = None,
) -> tuple[list[int | None], DepthCheck]:
    """The better of the choice ``with_depth`` (which removes the layers ``removed``) and the best widths-only
    choice (:func:`choose_with_removal` with no layer removable), by ``measure`` (a choice -> its loss, e.g.
    the KL of the whole cut model on the calibration windows; the summed sensitivities that chose both are
    additive estimates, which removal breaks most). Equal losses keep the widths-only choice."""
    depth_kl = float(measure(with_depth))
    try:
        widths, _ = choose_with_removal(
            sensitivity, costs, budgets, layer_of=layer_of, removal={}, allowed=allowed
        )
    except BudgetError:
        return list(with_depth), DepthCheck(list(removed), depth_kl, None, "depth")
    widths_kl = float(measure(widths))
    if widths_kl <= depth_kl:
        return widths, DepthCheck(list(removed), depth_kl, widths_kl, "widths")
    return list(with_depth), DepthCheck(list(removed), depth_kl, widths_kl, "depth")


def removal_sensitivity(
    model: Any, batches: Iterable[Any], layers: Iterable[int] | None = None
) -> dict[int, tuple[float, float]]:
    """``{layer: (KL per token, loss per token)}`` of the model with that decoder layer alone skipped (its
    output replaced by its input), against the unchanged model, from one teacher pass and the cached layer
    inputs (each measurement runs only the layers from the skipped one on)."""

    forwards = Forwards(model, batches)
    indices = list(range(len(forwards.decoder.layers))) if layers is None else sorted(set(layers))
    forwards.teacher(indices)
    out = {}
    for i in indices:
        layer = forwards.decoder.layers[i]
        with forwards.from_layer(i) as measure:
            handle = layer.register_forward_hook(skipped_output, with_kwargs=True)
            try:
                out[i] = measure()
            finally:
                handle.remove()
    return out
