"""A layer's score payload from its statistics: the step after the sums, the same for one process, many
processes (sums added over ranks) and merged partial files (sums added over shares).

The statistics of one GDN layer are a flat dict of tensors (:func:`statistic_shapes` lists them), every
one a sum over calibration tokens or windows: float64 sums, and ``int64`` counts (``num_tokens``,
``num_windows``, ``loss_tokens``). Whatever depends on the weights (``out_proj`` column norms, the
``W^T W`` of the full channel Gram) is already folded in linearly by
:meth:`~gdnprune.scoring.hooks.LayerScorer.statistics`, so the statistics of several shares add up to
those of their union and :func:`layer_payload` needs no model. The measures are derived in
``docs/scoring.md``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from ..gated_delta_net import GDNPermutation
from ..io.scores_file import SCORES_FORMAT, SCORES_VERSION
from ..model.geometry import GDNShape
from ..model.hidden import orders_to_payload as orders_to_hidden_payload
from ..model.subblock_geometry import orders_to_payload
from ..model.subblock_surgery import random_orders
from .experts import expert_payload
from .orders import descending, greedy_lane_orders, greedy_removal_order

__all__ = [
    "COUNTS",
    "SCORE_KIND",
    "LayerStatistics",
    "ScoringStatistics",
    "statistic_shapes",
    "needs_loss_gradient",
    "layer_payload",
    "random_payload",
    "scores_from_statistics",
    "block_payload",
    "HIDDEN_MEASURES",
    "DEFAULT_HIDDEN_MEASURE",
    "HiddenStatistics",
    "hidden_scores",
    "hidden_payload",
]

#: what the raw ``*_scores`` of each method are, recorded in the scores file
SCORE_KIND = {
    "projection": (
        "projection: key groups (and lanes with lane_measure='energy_gram'): mean squared norm per token of "
        "the element's own contribution to the out_proj output; lanes by default (lane_measure='loss_gram'): "
        "mean over the loss tokens of (g . c_h)^2, g the next-token loss gradient at the final norm's input "
        "(orders of both come from the greedy conditional removal on the Gram matrix and account for "
        "redundancy); key dims: the key_dim_measure (default RMS(q^_d) + RMS(k^_d) of the "
        "l2-normalised q and k); value dims: the value_dim_measure (default sum over heads of "
        "RMS(W[:, (h, e)] o_(h, e)))"
    ),
    "activation": "activation: mean |activation| over each window's tokens, L2 over windows (RMS over windows)",
    "random": "random: the rank in a seeded random order (larger = earlier)",
}

#: the integer statistics of every layer
COUNTS = ("num_tokens", "num_windows", "loss_tokens")


def needs_loss_gradient(method: str, measures: Mapping[str, Any]) -> bool:
    """Whether an order uses the loss-aware Gram (``measures`` as the scores file records them)."""
    return method == "projection" and "loss_gram" in (
        measures.get("value_lane"),
        measures.get("key_group"),
        measures.get("value_dim"),
    )


def statistic_shapes(shape: GDNShape, method: str, measures: Mapping[str, Any]) -> dict[str, tuple[int, ...]]:
    """The statistics of one layer and their shapes (counts are 0-d), for ``activation`` or ``projection``.

    ``measures``: ``{"key_group", "value_lane", "key_dim", "value_dim"}`` as in the scores file.
    """
    Hk, Hv, dk, dv = shape.num_key_heads, shape.num_value_heads, shape.key_head_dim, shape.value_head_dim
    out: dict[str, tuple[int, ...]] = {name: () for name in COUNTS}
    if method == "activation":
        out.update(out_abs_mean_sq=(Hv * dv,), qk_abs_mean_sq=(2 * Hk * dk,))
        return out
    if method != "projection":
        raise ValueError(f"method {method!r} has no statistics; expected 'projection' or 'activation'")
    out["head_gram"] = (Hv, Hv)
    if measures["key_dim"] == "qk_gram":
        out["qk_moments"] = (2, Hk, dk, dk)
    else:
        out["qk_sq"] = (2, Hk, dk)
    out[
        {
            "head_rms": "value_col_energy",
            "energy": "value_dim_energy",
            "gram": "value_dim_gram",
            "loss_gram": "loss_dim_gram",
        }[measures["value_dim"]]
    ] = {"head_rms": (Hv, dv), "energy": (dv,), "gram": (dv, dv), "loss_gram": (dv, dv)}[
        measures["value_dim"]
    ]
    if needs_loss_gradient(method, measures):
        out["loss_head_gram"] = (Hv, Hv)
    return out


def _check(stats: Mapping[str, torch.Tensor], expected: Mapping[str, tuple[int, ...]], prefix: str) -> None:
    for name, size in expected.items():
        value = stats.get(name)
        if value is None or tuple(value.shape) != tuple(size):
            found = None if value is None else list(value.shape)
            raise ValueError(f"{prefix}: statistic {name!r} should have shape {list(size)}, found {found}")


def layer_payload(
    stats: Mapping[str, torch.Tensor],
    *,
    prefix: str,
    shape: GDNShape,
    layout: str,
    method: str,
    measures: Mapping[str, Any],
) -> dict[str, Any]:
    """The score payload of one layer (four orders, raw scores, geometry, token counts) from its statistics.

    Raises:
        ValueError: a statistic is missing or has the wrong shape, no calibration token reached the layer,
            or the loss-aware Gram has no token with a next-token target.
    """
    _check(stats, statistic_shapes(shape, method, measures), prefix)
    st = {k: v.detach().cpu() for k, v in stats.items()}
    num_tokens, num_windows, loss_tokens = (int(st[k]) for k in COUNTS)
    if num_tokens == 0:
        raise ValueError(f"{prefix}: no calibration tokens reached this GDN layer")
    if method == "activation":
        scores, orders = _activation_orders(st, shape, num_windows)
    else:
        scores, orders = _projection_orders(st, shape, method, measures, prefix)
    payload: dict[str, Any] = {k: v.cpu().tolist() for k, v in orders.items()}
    payload.update({k: v.double().cpu().tolist() for k, v in scores.items()})
    payload["shape"] = shape.as_dict()
    payload["layout"] = layout
    payload["num_tokens"] = num_tokens
    if needs_loss_gradient(method, measures):
        payload["loss_tokens"] = loss_tokens
    return payload


def _activation_orders(
    st: Mapping[str, torch.Tensor], shape: GDNShape, num_windows: int
) -> tuple[dict, dict]:
    """The raw scores and orders of the ``activation`` method: RMS magnitudes, in descending order."""
    Hk, Hv, r = shape.num_key_heads, shape.num_value_heads, shape.value_heads_per_group
    dk, dv = shape.key_head_dim, shape.value_head_dim
    out = (st["out_abs_mean_sq"] / num_windows).sqrt().reshape(Hv, dv)
    qk = (st["qk_abs_mean_sq"] / num_windows).sqrt().reshape(2, Hk, dk)
    lane_scores = out.sum(1).reshape(Hk, r)
    scores = {
        "key_group_scores": lane_scores.sum(1),
        "value_lane_scores": lane_scores,
        "key_dim_scores": qk.sum(0),
        "value_dim_scores": out.sum(0),
    }
    orders = {
        "key_group_order_most_important_first": descending(scores["key_group_scores"]),
        "value_lane_order_most_important_first": descending(scores["value_lane_scores"]),
        "key_dim_order_most_important_first": descending(scores["key_dim_scores"]),
        "value_dim_order_most_important_first": descending(scores["value_dim_scores"]),
    }
    return scores, orders


def _projection_orders(
    st: Mapping[str, torch.Tensor], shape: GDNShape, method: str, measures: Mapping[str, Any], prefix: str
) -> tuple[dict, dict]:
    """The raw scores and orders of the ``projection`` method: the Gram diagonals of lanes and key groups
    (energy or loss-aware) with their greedy removal orders, the key and value channel measures."""
    N, _, loss_tokens = (int(st[k]) for k in COUNTS)
    Hk, r = shape.num_key_heads, shape.value_heads_per_group
    head_gram = st["head_gram"]
    lane_gram, group_gram = head_gram, head_gram.reshape(Hk, r, Hk, r).sum((1, 3))
    lane_scale = group_scale = N
    if needs_loss_gradient(method, measures):
        if loss_tokens == 0:
            raise ValueError(
                f"{prefix}: no token with a next-token target reached this GDN layer (the "
                "loss-aware Gram needs windows of at least 2 tokens)"
            )
        loss_gram = st["loss_head_gram"]
        if measures["value_lane"] == "loss_gram":
            lane_gram, lane_scale = loss_gram, loss_tokens
        if measures["key_group"] == "loss_gram":
            group_gram, group_scale = loss_gram.reshape(Hk, r, Hk, r).sum((1, 3)), loss_tokens
    key_measure, key_dims = _key_dim_scores(st, measures["key_dim"], N)
    value_measure, value_dims = _value_dim_scores(st, measures["value_dim"], N, loss_tokens)
    scores = {
        "key_group_scores": group_gram.diagonal() / group_scale,
        "value_lane_scores": (lane_gram.diagonal() / lane_scale).reshape(Hk, r),
        "key_dim_scores": key_measure,
        "value_dim_scores": value_measure,
    }
    orders = {
        "key_group_order_most_important_first": greedy_removal_order(group_gram),
        "value_lane_order_most_important_first": greedy_lane_orders(lane_gram, Hk),
        "key_dim_order_most_important_first": key_dims,
        "value_dim_order_most_important_first": value_dims,
    }
    return scores, orders


def _key_dim_scores(
    st: Mapping[str, torch.Tensor], key_dim: str, N: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The q/k channels' raw scores [Hk, dk] under the ``key_dim`` measure, and their order."""
    if key_dim == "qk_gram":
        qk = st["qk_moments"]  # [2, Hk, dk, dk]
        q_energy = qk[0].diagonal(dim1=-2, dim2=-1) / N
        k_energy = qk[1].diagonal(dim1=-2, dim2=-1) / N
    else:
        q_energy, k_energy = st["qk_sq"] / N  # E[q^_d^2], E[k^_d^2]: [Hk, dk] each
    key_measure = {
        "qk_rms": lambda: q_energy.sqrt() + k_energy.sqrt(),
        "qk_gram": lambda: q_energy * k_energy,
        "qk_energy": lambda: q_energy * k_energy,
        "q_energy": lambda: q_energy,
        "k_energy": lambda: k_energy,
    }[key_dim]()
    key_dims = greedy_removal_order(qk[0] * qk[1]) if key_dim == "qk_gram" else descending(key_measure)
    return key_measure, key_dims


def _value_dim_scores(
    st: Mapping[str, torch.Tensor], value_dim: str, N: int, loss_tokens: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The value channels' raw scores [dv] under the ``value_dim`` measure, and their order."""
    if value_dim == "head_rms":
        # sum over heads of the RMS of each head's projected channel: sqrt(|W[:, (h, e)]|^2 E[o_(h, e)^2])
        value_measure = (st["value_col_energy"] / N).sqrt().sum(0)
    elif value_dim == "energy":
        value_measure = st["value_dim_energy"] / N
    elif value_dim == "gram":
        value_measure = st["value_dim_gram"].diagonal() / N
    else:
        value_measure = st["loss_dim_gram"].diagonal() / loss_tokens
    if value_dim == "gram":
        return value_measure, greedy_removal_order(st["value_dim_gram"])
    if value_dim == "loss_gram":
        return value_measure, greedy_removal_order(st["loss_dim_gram"])
    return value_measure, descending(value_measure)


def random_payload(shape: GDNShape, generator: torch.Generator) -> dict[str, Any]:
    """The payload of the ``random`` method: seeded random orders, raw scores = rank (larger = earlier)."""
    perm = GDNPermutation.random(shape, generator=generator)
    payload: dict[str, Any] = perm.to_score_payload()
    for key, order in zip(
        ("key_group_scores", "value_lane_scores", "key_dim_scores", "value_dim_scores"),
        (perm.key_groups, perm.value_lanes, perm.key_dim, perm.value_dim),
    ):
        n = order.shape[-1]
        payload[key] = (n - 1 - order.argsort(dim=-1)).double().tolist()
    payload["shape"] = shape.as_dict()
    payload["num_tokens"] = 0
    return payload


HIDDEN_MEASURES = (
    "activation",
    "activation_l2",
    "activation_layer",
    "activation_max",
    "stream",
    "projection",
)
"""How the hidden channels are scored (:mod:`gdnprune.scoring.hidden`, derived in ``docs/scoring.md``)."""
#: the measure the scores file's hidden order uses by default (the benchmark's winner, ``docs/scoring.md``)
DEFAULT_HIDDEN_MEASURE = "activation"


@dataclass
class HiddenStatistics:
    """The hidden channels' sums (:class:`gdnprune.scoring.hidden.HiddenScorer`): the hidden size, the norms
    hooked (the rows of the per-norm sums), the sums, and the measure that orders them."""

    hidden_size: int
    norms: list[str]
    stats: dict[str, torch.Tensor]
    measure: str = DEFAULT_HIDDEN_MEASURE


def hidden_scores(stats: Mapping[str, torch.Tensor], measure: str) -> torch.Tensor:
    """The score of every hidden channel under ``measure`` (:data:`HIDDEN_MEASURES`) from the summed statistics."""
    n = max(int(stats["num_tokens"]), 1)
    if measure == "activation":
        return (stats["norm_abs"] / n).sum(0)
    if measure == "activation_l2":
        return (stats["norm_sq"] / n).sqrt().sum(0)
    per_norm = stats["norm_abs"] / n
    shares = per_norm / per_norm.mean(-1, keepdim=True).clamp_min(1e-30)
    if measure == "activation_layer":
        return shares.sum(0)
    if measure == "activation_max":
        return shares.max(0).values
    if measure == "stream":
        return (stats["unit_sq"] / n).sum(0)
    if measure == "projection":
        return stats["reader_sq"] / n
    raise ValueError(f"unknown hidden measure {measure!r}; expected one of {list(HIDDEN_MEASURES)}")


def hidden_payload(hidden: HiddenStatistics, method: str, seed: int = 0) -> dict[str, Any]:
    """The scores file's ``hidden`` entry: the order (most important first), the channels' scores, the
    measure, and per norm the mean squared input of every channel (``norm_input_sq``: what a rescaled cut,
    :func:`gdnprune.model.hidden.rescaled_norm`, reads)."""
    stats, size = hidden.stats, hidden.hidden_size
    if method == "random":  # a seeded random order, scores its ranks (as for the GDN layers)
        order = torch.randperm(size, generator=torch.Generator().manual_seed(int(seed) + 1))
        payload = orders_to_hidden_payload({"channels": order})
        return {"kind": "hidden", "shape": {"hidden_size": size}, "method": method, **payload}
    n = max(int(stats["num_tokens"]), 1)
    scores = hidden_scores(stats, hidden.measure)
    return {
        "kind": "hidden",
        "shape": {"hidden_size": size},
        "method": method,
        "measure": hidden.measure,
        "num_tokens": int(stats["num_tokens"]),
        **orders_to_hidden_payload({"channels": descending(scores)}),
        "channel_scores": scores.tolist(),
        "norm_input_sq": {name: (stats["input_sq"][i] / n).tolist() for i, name in enumerate(hidden.norms)},
    }


@dataclass
class LayerStatistics:
    """One GDN layer: its geometry, layout and statistics (empty for ``random``)."""

    shape: GDNShape
    layout: str
    stats: dict[str, torch.Tensor] = field(default_factory=dict)


@dataclass
class ScoringStatistics:
    """The sums of a scoring run before any order is computed: what ranks add up and partial files store.

    ``measures`` is the scores file's ``measures`` object (``projection`` only: the four measures and,
    with a loss-aware Gram, ``loss_token_stride``); ``layers`` maps layer prefixes to their statistics.
    """

    method: str
    seed: int
    measures: dict[str, Any] | None
    layers: dict[str, LayerStatistics]
    #: attention / MLP sub-blocks (:mod:`gdnprune.scoring.subblocks`): prefix -> (its Block, its statistics)
    blocks: dict[str, tuple[Any, dict[str, torch.Tensor]]] = field(default_factory=dict)
    #: the hidden channels (:mod:`gdnprune.scoring.hidden`), None when they are not scored
    hidden: HiddenStatistics | None = None

    def tensors(self) -> list[torch.Tensor]:
        """Every statistic, layer by layer in a fixed order (the order ranks sum them in), sub-blocks, then
        the hidden channels, last."""
        hidden = [] if self.hidden is None else [self.hidden.stats[n] for n in sorted(self.hidden.stats)]
        return (
            [layer.stats[name] for layer in self.layers.values() for name in sorted(layer.stats)]
            + [stats[name] for _, stats in self.blocks.values() for name in sorted(stats)]
            + hidden
        )


def scores_from_statistics(statistics: ScoringStatistics, *, world_size: int = 1) -> dict[str, Any]:
    """The scores-file dict (:mod:`gdnprune.io.scores_file`) from (summed) statistics: payloads, orders, counts.

    ``world_size`` is recorded beside ``num_tokens``: how many processes computed the sums.
    """
    method = statistics.method
    result: dict[str, Any] = {
        "format": SCORES_FORMAT,
        "version": SCORES_VERSION,
        "method": method,
        "num_tokens": 0,
        "world_size": int(world_size),
        "seed": int(statistics.seed),
        "score_kind": SCORE_KIND[method],
        "layers": {},
    }
    if statistics.measures is not None:
        result["measures"] = dict(statistics.measures)
    if statistics.hidden is not None:
        result["hidden"] = hidden_payload(statistics.hidden, method, int(statistics.seed))
    if method == "random":
        generator = torch.Generator().manual_seed(int(statistics.seed))
        for prefix, layer in statistics.layers.items():
            result["layers"][prefix] = random_payload(layer.shape, generator)
        for prefix, (block, _) in statistics.blocks.items():
            result["layers"][prefix] = {
                "kind": block.kind,
                "layout": block.layout,
                "shape": block.shape.as_dict(),
                "method": method,
                **orders_to_payload(random_orders(block, generator=generator)),
            }
        return result
    for prefix, layer in statistics.layers.items():
        result["layers"][prefix] = layer_payload(
            layer.stats,
            prefix=prefix,
            shape=layer.shape,
            layout=layer.layout,
            method=method,
            measures=statistics.measures or {},
        )
    result["num_tokens"] = next(iter(result["layers"].values()))["num_tokens"] if result["layers"] else 0
    if statistics.blocks:
        for prefix, (block, stats) in statistics.blocks.items():
            result["layers"][prefix] = block_payload(block, stats, method)
    return result


def block_payload(block: Any, stats: dict[str, torch.Tensor], method: str) -> dict[str, Any]:
    """The score payload of a sub-block (a :class:`gdnprune.model.subblock_geometry.Block`) from its (summed) statistics
    (:class:`gdnprune.scoring.subblocks.BlockScorer`): orders, raw scores, geometry."""
    if block.kind == "experts":  # routed experts: REAP or frequency (gdnprune.scoring.experts)
        return expert_payload(block, stats, method)
    n = max(int(stats["num_tokens"]), 1)
    activation = stats["abs_sum"] / n
    payload: dict[str, Any] = {
        "kind": block.kind,
        "layout": block.layout,
        "shape": block.shape.as_dict(),
        "method": method,
    }
    if block.kind == "attention":
        nkv, r = block.shape.num_key_value_heads, block.shape.heads_per_group
        if method == "projection":
            gram = stats["gram"]
            group_gram = gram.reshape(nkv, r, nkv, r).sum(dim=(1, 3))
            kv_groups = greedy_removal_order(group_gram)
            query_heads = greedy_lane_orders(gram, nkv)
            head_scores = gram.diagonal() / n
        else:
            head_scores = activation
            kv_groups = descending(head_scores.reshape(nkv, r).sum(-1))
            query_heads = descending(head_scores.reshape(nkv, r))
        payload.update(orders_to_payload({"kv_groups": kv_groups, "query_heads": query_heads}))
        payload["head_scores"] = head_scores.tolist()
    else:
        if method == "projection":
            channels = greedy_removal_order(stats["gram"])
            scores = stats["gram"].diagonal() / n
        else:
            scores = activation
            channels = descending(scores)
        payload.update(orders_to_payload({"channels": channels}))
        payload["channel_scores"] = scores.tolist()
    return payload
