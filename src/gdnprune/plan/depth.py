"""Depth in the plan (issue 23): removing a decoder layer is one more candidate of that layer, of cost 0.

A layer's sub-blocks (GDN or attention, MLP or experts, ...) are separate candidate groups of the MILP
(:func:`gdnprune.plan.solve.choose`: one candidate per group, additive sensitivities, linear budgets).
Removal couples them: :func:`choose_with_removal` adds one binary ``r_l`` per decoder layer and asks every
group ``g`` of layer ``l`` for ``sum_c x_gc + r_l = 1`` — either a width candidate of every sub-block or
the whole layer gone, whose sensitivity ``S_l`` enters once and whose costs are 0 (its parameters, its
recurrent state and its KV cache leave every budget). One exact MILP then chooses widths and depth together.

:func:`removal_sensitivity` measures ``S_l`` like the other candidates: the KL against the teacher of the
model with layer ``l`` alone skipped (its output is its input), from the layer's cached input
(:class:`gdnprune.forwards.Forwards`). :func:`gdnprune.scoring.experts.block_influence` is the one-pass proxy
(``1 - cos``, not a KL: it ranks layers against each other but not against width candidates, so the plan
refuses it where removal and widths compete).

In the whole-model search (:mod:`.api`) every decoder layer that may go also has a :class:`LayerRest`
group: what the layer costs beyond its planned sub-blocks (norms, sub-blocks left out of ``blocks``), one
candidate, sensitivity 0; removing the layer takes it off every budget with the rest.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np
from scipy.optimize import Bounds, LinearConstraint

from ..forwards import Forwards, hidden_argument
from .solve import MILP_OPTIONS, BudgetError, exact_objective, quiet_milp

__all__ = ["LayerRest", "choose_with_removal", "removal_sensitivity", "skipped_output"]


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


# long: its documented signature and docstring; the body is 71 lines, one step after another
def choose_with_removal(
    sensitivity: Sequence[Sequence[float]],
    costs: Mapping[str, Sequence[Sequence[float]]],
    budgets: Mapping[str, float],
    *,
    layer_of: Sequence[int],
    removal: Mapping[int, float],
    allowed: Sequence[Sequence[bool]] | None = None,
    keep_one_of: Sequence[int] = (),
) -> tuple[list[int | None], list[int]]:
    """The candidate of every group, or None where its decoder layer is removed, that minimises the summed
    sensitivity within ``budgets``; and the removed layers. At least one of the groups' layers stays.

    Args:
        sensitivity, costs, budgets: as for :func:`gdnprune.plan.solve.choose` (per group, per candidate).
        layer_of: the decoder layer of every group.
        removal: decoder layer -> the sensitivity of removing it (layers not named may not be removed).
        allowed: ``allowed[g][c]``: the candidates that may be chosen (all when None; as
            :func:`gdnprune.plan.solve.choose_among`, e.g. successive halving's survivors); removal always may.
        keep_one_of: decoder layers of which at least one stays (a hybrid model's full-attention layers:
            transformers' cache counts the sequence length on one).

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
    for name, budget in budgets.items():
        row = np.concatenate(
            [np.concatenate([np.asarray(g, dtype=np.float64) for g in costs[name]]), np.zeros(m)]
        )
        constraints.append(LinearConstraint(row[None, :], -np.inf, float(budget)))
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
    result = quiet_milp(
        exact_objective(c),
        constraints=constraints,
        integrality=np.ones(n + m),
        bounds=Bounds(0, upper),
        options=MILP_OPTIONS,
    )
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
