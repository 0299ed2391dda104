"""Successive halving: the measured sensitivity of the candidates that can matter, at a fraction of the cost.

The exact choice (:mod:`.solve`) only ever needs each layer's *Pareto front*: a candidate that costs no
less than another one on every budget and has a higher KL is never chosen (swapping it for the other one
keeps every budget and lowers the sum). So the full measurement (:func:`.sensitivity.measured_sensitivity`,
every candidate on every calibration window) spends most of its forwards on candidates that cannot win.

Here every candidate of every layer is first measured on a few calibration windows (one window per
forward, from the layer's cached input, as the full measurement runs its batches). Then, rung by rung:

* a candidate is dropped when another one of the same layer *dominates* it — costs no more on any budget
  in play and has a lower KL on the same windows by more than ``z`` paired standard errors (and by more
  than a small share of its KL) — (:func:`dominated`);
* the exact choice is made over the candidates left, on their estimates, and every layer keeps the
  ``1 / eta`` of them nearest to its choice in the order of their share of the budgets (:func:`near`):
  "more windows only for those near the solution";
* those are measured on ``grow`` times as many windows.

The last rung sees every window, so the survivors' KL and loss are exactly the full measurement's, and
the exact choice is made over the survivors only (a dropped candidate keeps its estimate from the windows
it saw; the report says how many). Given every window in its first rung, this *is* the full measurement.

Under ``torchrun`` the candidates of a rung are spread over the ranks (every rank holds every window), so
every rank gets the same numbers as one process.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, cast

import numpy as np
import torch
from tqdm.auto import tqdm

from .. import distributed
from ..forwards import Forwards, parent_and_name, unpack_batch
from .sensitivity import LayerToPlan, candidate_module, sorted_state
from .solve import choose_among

__all__ = [
    "dominated",
    "gather_over_ranks",
    "halving_sensitivity",
    "near",
    "rank_share",
    "rungs",
    "token_counts",
    "windows_of",
]


def windows_of(batches: Iterable[Any]) -> list[dict[str, torch.Tensor]]:
    """Calibration batches split into one window per batch (``input_ids`` [1, T], ``attention_mask``)."""
    out = []
    for batch in batches:
        ids, mask = unpack_batch(batch)
        for row in range(ids.shape[0]):
            out.append(
                {
                    "input_ids": ids[row : row + 1],
                    **({} if mask is None else {"attention_mask": mask[row : row + 1]}),
                }
            )
    return out


def token_counts(window: Mapping[str, torch.Tensor]) -> tuple[int, int]:
    """Tokens of a window that count in the KL and in the next-token loss (as the forwards count them)."""
    ids = window["input_ids"]
    mask = window.get("attention_mask")
    valid = torch.ones_like(ids, dtype=torch.bool) if mask is None else mask.bool()
    return int(valid.sum()), int((valid[:, :-1] & valid[:, 1:]).sum())


def rungs(total: int, first: int | None = None, grow: int = 4) -> list[int]:
    """The windows seen after each rung: ``first`` (default a sixteenth of ``total``, at least 1), then
    ``grow`` times as many, ..., ending with ``total``."""
    if total < 1:
        raise ValueError("successive halving needs at least one calibration window")
    if grow < 2:
        raise ValueError(f"the windows must grow by a factor of at least 2 per rung, got {grow}")
    n = min(total, max(1, math.ceil(total / 16)) if first is None else max(1, int(first)))
    out = [n]
    while out[-1] < total:
        out.append(min(total, out[-1] * grow))
    return out


def near(sizes: np.ndarray, alive: np.ndarray, pick: int | None, keep: int) -> np.ndarray:
    """The ``keep`` alive candidates nearest to ``pick`` in the order of ``sizes`` (the pick included); ``pick``
    None (the layer removed, size 0): the ``keep`` smallest."""
    order = [int(c) for c in np.argsort(sizes, kind="stable") if alive[c]]
    pos = 0 if pick is None else order.index(pick)
    ranked = sorted(range(len(order)), key=lambda k: (abs(k - pos), -k))
    out = np.zeros_like(alive)
    out[[order[k] for k in ranked[:keep]]] = True
    return out


def dominated(
    kl: np.ndarray, costs: np.ndarray, alive: np.ndarray, *, z: float = 2.0, floor: float = 0.02
) -> np.ndarray:
    """Which alive candidates another alive candidate dominates, beyond the noise.

    Args:
        kl: [candidates, windows] per-window KL of every candidate on the same windows.
        costs: [candidates, budgets] what each candidate costs on every budget in play.
        alive: [candidates] bool, the candidates still in the race.
        z: paired standard errors (over the windows) by which the dominator must be better.
        floor: and by at least this share of the dominated candidate's KL.

    Returns:
        [candidates] bool: ``a`` is dominated when some alive ``b != a`` costs no more than ``a`` on every
        budget and ``mean(kl[a] - kl[b]) > max(z * se, floor * mean(kl[a]))``.
    """
    n, w = kl.shape
    out = np.zeros(n, dtype=bool)
    mean = kl.mean(1)
    for a in np.flatnonzero(alive):
        cheaper = alive & np.all(costs <= costs[a], axis=1)
        cheaper[a] = False
        for b in np.flatnonzero(cheaper):
            d = kl[a] - kl[b]
            se = d.std(ddof=1) / math.sqrt(w) if w > 1 else 0.0
            if d.mean() > max(z * se, floor * mean[a]):
                out[a] = True
                break
    return out


def rank_share(n: int) -> range:
    """The items (of ``n``: candidates, plans) this rank measures: all of them without a process group."""

    if not distributed.is_distributed():
        return range(n)
    return distributed.shard_indices(n, distributed.rank(), distributed.world_size())


def gather_over_ranks(values: dict) -> dict:
    """Every rank's ``{item: result}`` merged (the same dict on every rank)."""

    merged = {}
    for part in distributed.exchange(values):
        merged.update(part)
    return merged


# long: its documented signature and docstring; the body is 81 lines, one step after another
@torch.no_grad()
# long: a 40-line docstring; the rung loop stays in one place (one candidate's measurement: _measure_layer)
def halving_sensitivity(
    model: torch.nn.Module,
    batches: Iterable[Any],
    layers: Sequence[LayerToPlan],
    costs: Mapping[str, Sequence[Sequence[float]]],
    budgets: Mapping[str, float],
    *,
    first: int | None = None,
    grow: int = 4,
    eta: int = 2,
    z: float = 2.0,
    choose: Callable[[list, list], Sequence[int | None]] | None = None,
    progress: bool = True,
    max_logits: int = 1 << 24,
) -> dict[str, Any]:
    """KL from the unpruned model of every candidate of every layer cut alone, by successive halving.

    Every rung measures the alive candidates of every layer on more windows; then a candidate is dropped
    when another one dominates it (:func:`dominated`), the exact choice is made over the alive candidates
    on their estimates, and every layer keeps the ``1 / eta`` of its alive candidates nearest to its choice
    (in the order of their share of the budgets). The last rung sees every window.

    Args:
        model, batches, layers: as :func:`~gdnprune.plan.sensitivity.measured_sensitivity`.
        costs, budgets: as :func:`~gdnprune.plan.solve.choose`: the budgets in play.
        first: windows of the first rung (default a sixteenth of the windows, at least 1); the number of
            windows or more measures every candidate on every window (the full measurement).
        grow: the factor by which the windows grow from rung to rung; eta: 1 / the share kept per rung.
        z: paired standard errors by which a dominator must be better to drop a candidate.
        choose: ``choose(estimates, alive)`` -> a candidate per layer (None: its decoder layer removed), the
            exact choice of a rung (default :func:`~gdnprune.plan.solve.choose_among` with ``costs`` and
            ``budgets``; the plan with layer removal passes :func:`~gdnprune.plan.depth.choose_with_removal`'s).
        progress: a tqdm bar over the partial forwards (one window each).

    Returns:
        ``{"kl", "loss": {prefix: [per candidate]}, "windows": {prefix: [windows each candidate was
        measured on]}, "survivors": {prefix: [bool per candidate]}, "rungs", "base_loss", "tokens",
        "forwards", "teacher_seconds", "seconds"}``; a survivor's KL and loss are those of every window.
    """

    start_time = time.perf_counter()
    windows = windows_of(batches)
    total = len(windows)
    forwards = Forwards(model, windows, max_logits=max_logits, shard=False)
    config: Any = model.config  # a transformers config (nn.Module's stubs type attributes as Tensor | Module)
    text_config = config.get_text_config(decoder=True)
    index = [forwards.decoder_index(layer.module) for layer in layers]
    teacher_start = time.perf_counter()
    forwards.teacher(index)
    teacher_seconds = time.perf_counter() - teacher_start
    counts = np.array([token_counts(w) for w in windows], dtype=np.float64)  # [windows, (kl, ce)]
    schedule = rungs(total, first, grow)
    names = list(budgets)
    sizes = [
        cast(  # an array with any budget (sum's start, 0, only without one)
            np.ndarray,
            sum(
                np.asarray(costs[name][li], dtype=np.float64) / max(float(budgets[name]), 1e-300)
                for name in names
            ),
        )
        for li in range(len(layers))
    ]
    tables = [
        np.array([[costs[name][li][c] for name in names] for c in range(len(layer.candidates))])
        for li, layer in enumerate(layers)
    ]
    kl = [np.zeros((len(layer.candidates), total)) for layer in layers]
    ce = [np.full((len(layer.candidates), total), forwards.base_loss) for layer in layers]
    full = [np.array([t == layer.shape for t in layer.candidates]) for layer in layers]  # KL 0, not measured
    alive = [np.ones(len(layer.candidates), dtype=bool) for layer in layers]
    seen = [np.zeros(len(layer.candidates), dtype=int) for layer in layers]
    states: dict[int, dict] = {}
    done = 0
    for rung, upto in enumerate(schedule):
        todo = [[int(c) for c in np.flatnonzero(alive[li] & ~full[li])] for li in range(len(layers))]
        bar = tqdm(  # one bar per rung, its total known before it starts
            total=sum(upto - int(seen[li][c]) for li in range(len(layers)) for c in todo[li]),
            disable=not progress,
            desc=f"sensitivity, rung {rung + 1} of {len(schedule)} ({upto} window{'s' if upto > 1 else ''})",
            unit="fwd",
        )
        try:
            for li, (layer, i) in enumerate(zip(layers, index)):
                if li not in states:
                    states[li] = sorted_state(layer)
                done += _measure_layer(
                    forwards, layer, i, states[li], todo[li], seen[li], upto, kl[li], ce[li], text_config, bar
                )
                if upto == total:
                    del states[li]
        finally:
            bar.close()
        if upto == total:
            break
        for li in range(len(layers)):
            alive[li] &= ~dominated(kl[li][:, :upto], tables[li], alive[li], z=z)
        estimate = [kl[li][:, :upto].mean(1) for li in range(len(layers))]
        picks = (
            choose(estimate, alive) if choose is not None else choose_among(estimate, costs, budgets, alive)
        )
        for li in range(len(layers)):
            alive[li] = near(sizes[li], alive[li], picks[li], max(1, math.ceil(int(alive[li].sum()) / eta)))
    result: dict[str, Any] = {
        "kl": {},
        "loss": {},
        "windows": {},
        "survivors": {},
        "rungs": schedule,
        "base_loss": forwards.base_loss,
        "tokens": forwards.tokens,
        "forwards": done,
        "teacher_seconds": teacher_seconds,
    }
    w_kl, w_ce = counts[:, 0], counts[:, 1]
    for li, layer in enumerate(layers):
        n = np.where(full[li], total, seen[li])
        result["kl"][layer.prefix] = [
            float((kl[li][c, :s] * w_kl[:s]).sum() / max(w_kl[:s].sum(), 1)) for c, s in enumerate(n)
        ]
        result["loss"][layer.prefix] = [
            float((ce[li][c, :s] * w_ce[:s]).sum() / max(w_ce[:s].sum(), 1)) for c, s in enumerate(n)
        ]
        result["windows"][layer.prefix] = [int(s) for s in n]
        result["survivors"][layer.prefix] = [bool(a) for a in alive[li]]
    result["seconds"] = time.perf_counter() - start_time
    return result


def _measure_layer(
    forwards: Any,
    layer: Any,
    index: int,
    state: dict,
    todo: list[int],
    seen: np.ndarray,
    upto: int,
    kl: np.ndarray,
    ce: np.ndarray,
    text_config: Any,
    bar: Any,
) -> int:
    """Measure ``layer``'s candidates ``todo`` on windows ``seen[c]`` to ``upto`` (spread over the ranks),
    writing their KL and loss in place; returns the partial forwards done."""
    device = next(iter(state.values())).device
    parent, attr = parent_and_name(forwards.decoder.layers[index], layer.module)
    mine = {}
    with forwards.from_layer(index) as measure:
        try:
            for c in (todo[k] for k in rank_share(len(todo))):
                setattr(
                    parent, attr, candidate_module(layer, state, layer.candidates[c], text_config, device)
                )
                mine[c] = [measure([w]) for w in range(int(seen[c]), upto)]
                bar.update(upto - int(seen[c]))
        finally:
            setattr(parent, attr, layer.module)
    done = 0
    for c, values in sorted(gather_over_ranks(mine).items()):
        done += upto - int(seen[c])
        kl[c, seen[c] : upto] = [v[0] for v in values]
        ce[c, seen[c] : upto] = [v[1] for v in values]
        seen[c] = upto
    return done
