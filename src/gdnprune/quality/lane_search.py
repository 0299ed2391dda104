"""The lane search: order the value heads inside each key group by what removing them costs, measured.

Lanes (value heads sharing a key head) are the axis where a forward-only proxy is weakest
(BENCHMARKS.md). :func:`search_lane_orders` replaces the scores' lane orders with orders decided by
measurement, using the plan search's shared forwards (:class:`gdnprune.model.forwards.Forwards`: one
teacher pass, every evaluation run from the layer's cached input):

* removing a lane is exact as a mask: zeroing a value head's slice of the ``out_proj`` input removes its
  contribution and changes nothing else (each head's recurrence is its own), so every evaluation runs the
  unchanged model with a pre-hook on ``out_proj``;
* per layer, a greedy removal in rounds (as :func:`gdnprune.scoring.greedy_lane_orders` does on a Gram
  matrix): in each round every group loses one lane — the one whose removal, on top of everything removed
  so far in the layer, least increases the KL divergence from the unpruned model; the order is the
  reverse of the removal sequence;
* super-additivity across layers is handled by coordinate descent: layers are refined in order, each
  with the layers already refined cut to ``keep_lanes`` lanes per group (their input recomputed with
  those cuts), and a second sweep refines every layer again with all the others cut.

KL is summed over tokens and divided by their count, so the result does not depend on how the windows
are batched.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm

from ..io.scores_file import gdn_entries, match_layers
from ..model.forwards import Forwards, output_projection
from ..model.geometry import GDNShape
from ..model.layouts import find_gdn_modules

__all__ = ["search_lane_orders", "refine_lane_orders"]


# Over 80 lines with its documented arguments; the code is under 60.
def search_lane_orders(
    model: torch.nn.Module,
    batches: Iterable[Any],
    scores: Mapping[str, Any],
    *,
    keep_lanes: int | None = None,
    sweeps: int = 2,
    progress: bool = True,
) -> tuple[dict, dict]:
    """Scores whose lane orders come from measured KL; returns ``(new scores, report)``.

    Args:
        model: the (unsorted) model that ``scores`` describe.
        batches: calibration batches.
        scores: a scores-file dict (its other orders are kept).
        keep_lanes: lanes per group each refined layer keeps while the others are refined (default
            ``max(1, r // 2)``: the 50 % lane cut).
        sweeps: coordinate-descent sweeps over the layers (1: each layer once, with the earlier ones cut).
        progress: a progress bar over the evaluations.

    Returns:
        The new scores (``value_lane_order_most_important_first`` replaced, ``value_lane_scores`` = the KL
        per token when the lane was removed in the last sweep, ``measures.value_lane = "measured_kl"``)
        and a report (evaluations, forwards, seconds, the orders of every sweep).
    """
    if sweeps < 1:
        raise ValueError(f"sweeps must be >= 1, got {sweeps}")
    start = time.perf_counter()
    modules = find_gdn_modules(model)
    gdn = gdn_entries(scores["layers"])  # the sub-blocks' orders are kept as they are
    payloads = match_layers(gdn, [p for p, _ in modules])
    forwards = Forwards(model, batches)
    index = {prefix: forwards.decoder_index(module) for prefix, module in modules}
    forwards.teacher(index.values())

    masks, handles = _lane_masks(modules)
    shapes = {prefix: GDNShape.from_module(module) for prefix, module in modules}
    total = sweeps * sum(
        s.num_key_heads * s.value_heads_per_group * (s.value_heads_per_group + 1) // 2
        for s in shapes.values()
    )
    bar = tqdm(total=total, disable=not progress, desc="lane search", unit="eval")
    orders: dict[str, np.ndarray] = {}
    removal_kl: dict[str, np.ndarray] = {}
    history = []
    try:
        for sweep in range(sweeps):
            for prefix, _ in modules:
                shape = shapes[prefix]
                Hk, r = shape.num_key_heads, shape.value_heads_per_group
                masks[prefix].fill_(1.0)
                if sweep > 0 or any(p in orders for p in masks if p != prefix):
                    forwards.layer_inputs(index[prefix])  # with the other layers cut as they are now
                with forwards.from_layer(index[prefix]) as measure:
                    removed, kl_at = _greedy_removal(measure, masks[prefix], Hk, r, bar)
                orders[prefix] = np.asarray([lanes[::-1] for lanes in removed], dtype=np.int64)
                removal_kl[prefix] = kl_at
                # this layer now stays cut while the others are refined
                keep = max(1, r // 2) if keep_lanes is None else min(max(1, keep_lanes), r)
                masks[prefix].fill_(0.0)
                for g in range(Hk):
                    for j in orders[prefix][g, :keep]:
                        masks[prefix][g * r + int(j)] = 1.0
            history.append({p: o.tolist() for p, o in orders.items()})
    finally:
        bar.close()
        for handle in handles:
            handle.remove()

    refined = _with_lane_orders(scores, gdn, [p for p, _ in modules], payloads, orders, removal_kl)
    refined["measures"] = {**dict(scores.get("measures") or {}), "value_lane": "measured_kl"}
    report = {
        "sweeps": sweeps,
        "keep_lanes": keep_lanes,
        "evaluations": total,
        "forwards": forwards.forwards,
        "tokens": forwards.tokens,
        "seconds": round(time.perf_counter() - start, 3),
        "history": history,
    }
    refined["lane_refinement"] = {k: v for k, v in report.items() if k != "history"}
    return refined, report


def _lane_masks(modules: list[tuple[str, Any]]) -> tuple[dict[str, torch.Tensor], list[Any]]:
    """A mask of ones over the value heads of every GDN layer, multiplied into its out_proj input by a hook;
    returns the masks and the hook handles."""
    masks, handles = {}, []
    for prefix, module in modules:
        shape = GDNShape.from_module(module)
        masks[prefix] = torch.ones(shape.num_value_heads, dtype=torch.float32)
        out = output_projection(module)
        dv = shape.value_head_dim

        def hook(mod, args, mask=masks[prefix], dv=dv):
            return (args[0] * mask.repeat_interleave(dv).to(args[0].device, args[0].dtype),)

        handles.append(out.register_forward_pre_hook(hook))
    return masks, handles


def _greedy_removal(measure: Any, mask: torch.Tensor, Hk: int, r: int, bar: Any) -> tuple[list, np.ndarray]:
    """Remove the lanes of each key group one at a time, each time the one whose removal (on top of those
    removed so far) the ``measure`` finds costs the least KL; returns the removal order of each group and
    the KL at each lane's removal. ``mask`` (the layer's value heads) ends with every lane removed."""
    removed: list[list[int]] = [[] for _ in range(Hk)]
    kl_at = np.zeros((Hk, r))
    for _ in range(r):
        for g in range(Hk):
            best: tuple[float, int] | None = None
            for j in (j for j in range(r) if j not in removed[g]):
                mask[g * r + j] = 0.0
                kl, _ = measure()
                mask[g * r + j] = 1.0
                bar.update(1)
                if best is None or kl < best[0]:
                    best = (kl, j)
            assert best is not None  # r >= 1: a lane is always left to try
            removed[g].append(best[1])
            kl_at[g, best[1]] = best[0]
            mask[g * r + best[1]] = 0.0
    return removed, kl_at


def _with_lane_orders(
    scores: Mapping[str, Any],
    gdn: Mapping[str, Any],
    prefixes: list[str],
    payloads: Mapping[str, Any],
    orders: Mapping[str, np.ndarray],
    removal_kl: Mapping[str, np.ndarray],
) -> dict:
    """``scores`` with the searched lane orders (and their removal KL as lane scores) of the layers
    ``prefixes``."""
    refined = dict(scores)
    refined["layers"] = dict(scores["layers"])
    key_of = {p: k for k in gdn for p in match_layers({k: None}, prefixes)}
    for prefix in prefixes:
        payload = dict(payloads[prefix])
        payload["value_lane_order_most_important_first"] = orders[prefix].tolist()
        payload["value_lane_scores"] = removal_kl[prefix].tolist()
        refined["layers"][key_of[prefix]] = payload
    return refined


def refine_lane_orders(*args: Any, **kwargs: Any) -> tuple[dict, dict]:
    """The old name of :func:`search_lane_orders` (deprecated: it warns and calls it)."""
    warnings.warn(
        "refine_lane_orders is deprecated and will be removed; use search_lane_orders",
        FutureWarning,
        stacklevel=2,
    )
    return search_lane_orders(*args, **kwargs)
