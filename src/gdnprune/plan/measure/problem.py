"""The plan's problem, as data: its candidate groups, their costs and the budgets, built before any forward.

:func:`build_problem` turns a model, the budgets and the scores into a :class:`PlanProblem`: the GDN layers'
candidate tables, the sub-blocks (:mod:`.subblocks`), the removable decoder layers' rests (:mod:`.depth`),
per budget the cost of every candidate and the limit the chosen candidates must meet, and it checks that
some plan meets them. :func:`~gdnprune.plan.api.plan_model` measures and chooses over it; the totals and the
plan-file entries of a choice are read from it here.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ...io.scores_file import match_layers
from ...model.forwards import decoder_layers
from ...model.geometry import GDNShape, orders_from_payload
from ...model.layer_removal import attention_layers
from ...model.layouts import LAYOUTS, detect_layout, find_gdn_modules
from ...model.subblock_geometry import BLOCK_FIELDS, KINDS, block_kind_of
from ..choose.depth import LayerRest, choose_with_removal
from ..choose.servable import choose_servable
from ..choose.solve import BudgetError, choose, choose_uniform
from .candidates import layer_candidates
from .sensitivity import LayerToPlan
from .subblocks import (
    BLOCK_NAMES,
    PLAN_BLOCK_NAMES,
    SUB_BLOCK_NAMES,
    BlockToPlan,
    decoder_layer_rests,
    plannable_blocks,
    whole_model_costs,
)

__all__ = [
    "BUDGET_NAMES",
    "STATE_BYTES",
    "WHOLE",
    "Grid",
    "PlanProblem",
    "block_entry",
    "budget_limit",
    "build_problem",
    "check_feasible",
    "given_budgets",
]

#: bytes per recurrent-state element in budgets and reports (the delta-rule state is kept in float32)
STATE_BYTES = 4
#: every budget, in the order of the plan file
BUDGET_NAMES = ("params", "gdn_params", "active_params", "memory", "state")
#: the whole-model budgets (the others, ``gdn_params`` and ``state``, count the GDN layers alone)
WHOLE = ("params", "active_params", "memory")


def budget_limit(value: float | None, total: float, what: str) -> float | None:
    """A budget as an absolute amount: ``value`` <= 1 is a fraction of ``total``, larger values are absolute."""
    if value is None:
        return None
    if isinstance(value, bool) or not value > 0:
        raise ValueError(
            f"`budget_{what}` must be a positive fraction (<= 1) or an absolute amount, got {value!r}"
        )
    return float(value) * total if value <= 1 else float(value)


def given_budgets(options: Mapping[str, Any]) -> dict[str, float | None]:
    """``{budget name: value or None}`` from keyword options named ``budget_<name>``."""
    return {name: options.get(f"budget_{name}") for name in BUDGET_NAMES}


@dataclass(frozen=True)
class Grid:
    """The candidate grid: head-dim step, the GDN axes that may be cut and the serving constraints."""

    step: Any
    axes: Sequence[str]
    tp: int | None = None
    multiple_of: int | None = None
    snap_quant: int | None = None


@dataclass
class PlanProblem:
    """The candidate groups of a plan and what each candidate costs, with the budgets as group limits.

    Groups are the GDN layers (``layers``), then the sub-blocks (``blocks``), then the removable decoder
    layers' rests (``rests``, only where depth is planned); ``keys``, ``kinds`` and ``costs`` list the first
    two, then one entry per rest for ``costs``.
    """

    given: dict[str, float | None]
    context: int | None
    grid: Grid
    table: list[list]  # per GDN layer, its candidates (:class:`~gdnprune.plan.measure.candidates.Candidate`)
    layers: list[LayerToPlan]
    blocks: list[BlockToPlan]
    key_of: dict[str, str]  # module prefix -> the prefix the scores (and the plan file) use
    payload_of: dict[str, Any]  # GDN module prefix -> its scores entry
    gdn_totals: dict[str, float]
    whole: bool  # a whole-model budget is given
    depth: bool  # decoder layers may be removed
    budgets: dict[str, float] = field(default_factory=dict)  # per budget: what the groups may cost
    costs: dict[str, list[list[float]]] = field(default_factory=dict)
    limits: dict[str, float] = field(default_factory=dict)  # per budget: the limit on the whole
    totals: dict[str, float] | None = None  # whole-model totals per whole budget
    fixed: dict[str, float] | None = None  # what no candidate changes, per whole budget
    whole_costs: dict[str, list[list[float]]] | None = None
    rests: list[LayerRest] = field(default_factory=list)
    layer_of: list[int] | None = None  # the decoder layer of every group (with depth)
    keep_one_of: list[int] = field(default_factory=list)  # full-attention layers: one stays
    layer_costs: dict[str, list[float]] | None = None  # per budget, per decoder layer: all it costs

    @property
    def groups(self) -> list[Any]:
        """The width groups: GDN layers, then sub-blocks."""
        return [*self.layers, *self.blocks]

    @property
    def keys(self) -> list[list[Any]]:
        """Every width group's candidate geometries (GDN targets, sub-block targets)."""
        return [[c.target for c in cands] for cands in self.table] + [list(b.candidates) for b in self.blocks]

    @property
    def kinds(self) -> list[str]:
        """Every width group's kind of block (``gdn``, ``attention``, ``mlp``, ...)."""
        return ["gdn"] * len(self.layers) + [b.block.kind for b in self.blocks]

    def planned_kinds(self) -> list[str]:
        """The kinds of block the plan may change (the plan file's ``grid.blocks``)."""
        return sorted(
            {b.block.kind for b in self.blocks}
            | ({"gdn"} if self.layers else set())
            | ({"depth"} if self.rests else set())
        )

    def budget_record(self) -> dict[str, dict[str, float | None]]:
        """The plan file's ``budgets``: per budget in play, the value given and the absolute limit."""
        return {
            name: {"given": self.given[name], "limit": round(self.limits[name], 3)} for name in self.budgets
        }

    def entries(self, picks: Sequence[int | None]) -> dict[str, dict[str, int]]:
        """The plan file's ``layers``: every group's chosen target, keyed as the scores (or the model) name
        it; a pick None (its decoder layer removed) gives no entry."""
        n = len(self.layers)
        out = {
            self.key_of[layer.prefix]: self.table[i][pick].target.as_dict()
            for i, (layer, pick) in enumerate(zip(self.layers, picks))
            if pick is not None
        }
        for b, pick in zip(self.blocks, picks[n:]):
            if pick is not None:
                out[self.key_of.get(b.prefix, b.prefix)] = block_entry(b, b.candidates[pick])
        return out

    def gdn_kept(self, picks: Sequence[int | None]) -> dict[str, float]:
        """GDN parameters and recurrent-state bytes kept by ``picks``."""
        chosen = [self.table[i][p] for i, p in enumerate(picks[: len(self.layers)]) if p is not None]
        return {"params": sum(c.params for c in chosen), "state": sum(c.state for c in chosen) * STATE_BYTES}

    def decoder_keys(self) -> dict[int, str]:
        """Decoder layer index -> its prefix in the plan file: a planned group's key (the scores' and
        checkpoint's naming) cut after ``layers.N``, else the module path."""
        out = {r.index: r.prefix for r in self.rests}
        for g, group in enumerate(self.groups):
            key = self.key_of.get(group.prefix, group.prefix)
            found = re.search(r"(?:^|\.)layers\.\d+", key)
            if found and self.layer_of is not None:
                out[self.layer_of[g]] = key[: found.end()]
        return out

    def model_totals(self, picks: Sequence[int | None]) -> dict[str, Any]:
        """The whole-model totals of a plan: every budget's full and kept amounts, and the parameters split
        over the kinds of sub-block (``other``: what no candidate changes, embeddings and removable layers'
        rests included); a pick None (its decoder layer removed) keeps nothing."""
        if not self.whole:
            return {}
        assert self.totals is not None and self.fixed is not None and self.whole_costs is not None
        out: dict[str, Any] = {}
        wcosts, fixed = self.whole_costs, self.fixed
        for name, total in self.totals.items():
            kept = fixed[name] + sum(g[pick] for g, pick in zip(wcosts[name], picks) if pick is not None)
            word = "memory_bytes" if name == "memory" else f"model_{name}" if name == "params" else name
            out.update({word: total, f"{word}_kept": kept, f"{word}_fraction": kept / total})
        kinds = self.kinds + ["other"] * len(self.rests)
        full = (
            [sum(p.numel() for p in layer.module.parameters()) for layer in self.layers]
            + [b.block.parameters() for b in self.blocks]
            + [g[0] for g in wcosts["params"][len(kinds) - len(self.rests) :]]
        )
        split: dict[str, dict[str, float]] = {}
        for kind, size, g, pick in zip(kinds, full, wcosts["params"], picks):
            entry = split.setdefault(kind, {"params": 0.0, "params_kept": 0.0})
            entry["params"] += size
            entry["params_kept"] += 0.0 if pick is None else g[pick]
        other = split.setdefault("other", {"params": 0.0, "params_kept": 0.0})
        other["params"] += fixed["params"]
        other["params_kept"] += fixed["params"]
        out["split"] = split
        return out

    def totals_record(self, picks: Sequence[int | None]) -> dict[str, Any]:
        """The plan file's ``totals``: the GDN layers' (when planned) and the whole model's."""
        out: dict[str, Any] = {}
        if self.layers:
            kept, totals = self.gdn_kept(picks), self.gdn_totals
            out.update(
                gdn_params=totals["params"],
                gdn_params_kept=kept["params"],
                gdn_params_fraction=kept["params"] / totals["params"],
                state_bytes=totals["state"],
                state_bytes_kept=kept["state"],
                state_fraction=kept["state"] / totals["state"],
            )
        out.update(self.model_totals(picks))
        return out


def block_entry(block: Any, target: Any) -> dict[str, int]:
    """A sub-block's plan-file entry: its target fields (:data:`gdnprune.model.subblock_geometry.BLOCK_FIELDS`)."""
    return {k: v for k, v in KINDS[block.block.kind].config_updates(target).items() if k in BLOCK_FIELDS}


def _check_options(
    given: Mapping[str, float | None], blocks: Sequence[str], context: int | None, latency: bool
) -> None:
    if all(v is None for v in given.values()) and not latency:
        raise ValueError(
            "give a budget: `budget_params`, `budget_gdn_params`, `budget_active_params`, "
            "`budget_memory`, `budget_state` and/or `budget_latency`"
        )
    unknown = sorted(set(blocks) - set(BLOCK_NAMES))
    if unknown or not blocks:
        raise ValueError(f"`blocks` must name some of {list(PLAN_BLOCK_NAMES)}, got {list(blocks)}")
    if given["memory"] is not None and context is None:
        raise ValueError(
            "`budget_memory` counts the KV cache at `context` tokens per sequence: give `context`"
        )
    if context is not None and (isinstance(context, bool) or not isinstance(context, int) or context < 1):
        raise ValueError(f"`context` must be a positive number of tokens, got {context!r}")


def build_problem(
    model: Any,
    given: Mapping[str, float | None],
    score_layers: Mapping | None,
    *,
    context: int | None,
    blocks: Sequence[str],
    grid: Grid,
    orders_applied: bool,
    uniform: bool,
    depth_allowed: bool | None = None,
    latency: bool = False,
    feasible: bool = True,
) -> PlanProblem:
    """The candidate groups (GDN layers, then sub-blocks), their costs and the budgets as group limits;
    checks that some plan meets the budgets (no forward, no weight read). ``depth_allowed``: whether a
    uniform plan may also remove decoder layers (a servable plan may; default: not with ``uniform``).
    ``latency``: a latency budget will be added (:mod:`.latency_costs`): a whole-model budget.
    ``feasible=False``: no check that a plan meets the budgets (the problem of the full hidden size, whose
    limits a smaller hidden size is planned under, :mod:`.hidden`). ``blocks`` may name ``hidden``: the hidden
    size is chosen outside the problem (:func:`gdnprune.plan.api.search`), so it is left out here."""
    blocks = [b for b in blocks if b != "hidden"]
    _check_options(given, blocks, context, latency)
    whole = any(given[name] is not None for name in WHOLE) or latency
    gdn = "gdn" in blocks or not whole
    if not gdn and (given["gdn_params"] is not None or given["state"] is not None):
        raise ValueError(
            "`budget_gdn_params` and `budget_state` limit the GDN layers, but `blocks` leaves them out"
        )
    default = tuple(
        b for b in BLOCK_NAMES if b != "hidden"
    )  # `blocks` as given, less hidden (stripped above)
    if uniform and not depth_allowed and whole and "depth" in blocks and tuple(blocks) != default:
        raise ValueError(
            'a uniform plan keeps every decoder layer: leave "depth" out of `blocks` (the default '
            "`blocks` with `uniform` plans widths only)"
        )
    problem = _gdn_groups(model, dict(given), score_layers, context, grid, gdn, orders_applied, whole)
    problem.depth = whole and "depth" in blocks and (not uniform or bool(depth_allowed))
    kinds = [k for k in blocks if k in SUB_BLOCK_NAMES] if whole else []
    problem.blocks = plannable_blocks(
        model,
        kinds,
        score_layers,
        step=grid.step,
        tp=grid.tp,
        multiple_of=grid.multiple_of,
        snap_quant=grid.snap_quant,
        orders_applied=orders_applied or score_layers is None,
    )
    problem.key_of.update({b.prefix: b.key for b in problem.blocks})
    if not problem.layers and not problem.blocks and not problem.depth:
        raise ValueError(f"nothing in {type(model).__name__} may shrink: `blocks` {list(blocks)}")
    _add_costs(problem, model, feasible)
    if uniform:
        _check_uniform(problem.groups, problem.keys, problem.kinds)
    # one full-attention layer stays (slice refuses to remove the last)
    problem.keep_one_of = attention_layers(model.config.to_dict()) if problem.depth else []
    if feasible:
        check_feasible(problem, uniform)  # before any forward
    return problem


def _gdn_groups(
    model: Any,
    given: dict[str, float | None],
    score_layers: Mapping | None,
    context: int | None,
    grid: Grid,
    gdn: bool,
    orders_applied: bool,
    whole: bool,
) -> PlanProblem:
    """The problem with its GDN layers (their candidates, orders and scores entries) and nothing else yet."""
    modules = find_gdn_modules(model) if gdn else []
    if gdn and not modules:
        raise ValueError(f"{type(model).__name__} has no GDN layers to plan")
    gdn_entries = (
        None if score_layers is None else {k: v for k, v in score_layers.items() if block_kind_of(k) is None}
    )  # sub-blocks: .subblocks
    payload_of = (
        match_layers(gdn_entries, [p for p, _ in modules]) if gdn_entries is not None and modules else {}
    )
    missing = [p for p, _ in modules if not orders_applied and p not in payload_of]
    if missing:
        raise ValueError(f"the scores have no entry for the GDN layers {missing[:3]}; score this model first")
    key_of: dict[str, str] = {}
    for key in gdn_entries if modules and gdn_entries else ():
        key_of.update({p: key for p in match_layers({key: None}, [p for p, _ in modules])})
    key_of.update({p: p for p, _ in modules if p not in key_of})
    table = _candidate_table(modules, grid)
    layers = [
        LayerToPlan(
            prefix,
            module,
            None
            if orders_applied or prefix not in payload_of
            else orders_from_payload(payload_of[prefix], GDNShape.from_module(module)),
            [c.target for c in cands],
        )
        for (prefix, module), cands in zip(modules, table)
    ]
    gdn_totals = {
        "params": sum(c[0].params for c in table),
        "state": sum(c[0].state for c in table) * STATE_BYTES,
    }
    return PlanProblem(
        given=given,
        context=context,
        grid=grid,
        table=table,
        layers=layers,
        blocks=[],
        key_of=key_of,
        payload_of=payload_of,
        gdn_totals=gdn_totals,
        whole=whole,
        depth=False,
    )


def _add_costs(problem: PlanProblem, model: Any, feasible: bool = True) -> None:
    """Every budget's costs and limits; with depth, the decoder layers' rests as groups of their own."""
    p, given = problem, problem.given
    zeros = [[0.0] * len(b.candidates) for b in p.blocks]
    gdn_costs = {
        "gdn_params": [[float(c.params) for c in cands] for cands in p.table] + zeros,
        "state": [[float(c.state * STATE_BYTES) for c in cands] for cands in p.table] + zeros,
    }
    for name, total in (("gdn_params", p.gdn_totals["params"]), ("state", p.gdn_totals["state"])):
        if given[name] is not None:
            limit = budget_limit(given[name], total, name)
            assert limit is not None  # the budget is given
            p.limits[name] = p.budgets[name] = limit
            p.costs[name] = gdn_costs[name]
    gdn_pairs = [(layer.module, cands) for layer, cands in zip(p.layers, p.table)]
    if p.whole:
        p.totals, p.whole_costs, p.fixed = whole_model_costs(
            model, gdn_pairs, p.blocks, context=p.context, state_bytes=STATE_BYTES
        )
    if p.depth:  # every decoder layer may go: the part of it no candidate changes is a group of its own
        assert p.whole_costs is not None and p.fixed is not None  # depth is planned with a whole-model budget
        layer_of, prefixes, rest_costs, p.layer_costs = decoder_layer_rests(
            model, gdn_pairs, p.blocks, context=p.context, state_bytes=STATE_BYTES
        )
        p.rests = [LayerRest(pre, m, i) for i, (pre, m) in enumerate(zip(prefixes, decoder_layers(model)))]
        p.layer_of = layer_of + list(range(len(p.rests)))
        for name in p.whole_costs:
            p.whole_costs[name] = p.whole_costs[name] + [[v] for v in rest_costs[name]]
            p.fixed[name] -= sum(rest_costs[name])
        for name in p.costs:  # the GDN-only budgets: a layer's rest holds no GDN parameter or state
            p.costs[name] = p.costs[name] + [[0.0]] * len(p.rests)
    if not p.whole:
        return
    assert p.totals is not None and p.whole_costs is not None and p.fixed is not None  # set above
    for name in WHOLE:
        if given[name] is None:
            continue
        limit = budget_limit(given[name], p.totals[name], name)
        assert limit is not None  # the budget is given
        p.limits[name] = limit
        p.budgets[name], p.costs[name] = p.limits[name] - p.fixed[name], p.whole_costs[name]
        least = p.fixed[name] + (0.0 if p.depth else sum(min(g) for g in p.whole_costs[name]))
        if feasible and least > p.limits[name]:
            raise BudgetError(
                f"no plan meets the budgets: {name} needs at least {least:,.0f} (every sub-block at "
                f"its smallest candidate{', every decoder layer but one removed' if p.depth else ''}; "
                f"{p.fixed[name]:,.0f} in what no candidate changes), budget {p.limits[name]:,.0f}"
            )


def _candidate_table(modules: Sequence[tuple[str, Any]], grid: Grid) -> list[list]:
    """Every candidate of every GDN module (:func:`~gdnprune.plan.measure.candidates.layer_candidates`)."""
    table = []
    for prefix, module in modules:
        tensors = {name: tuple(p.shape) for name, p in module.named_parameters()}
        layout = detect_layout(tensors)
        if layout is None:
            raise ValueError(
                f"{prefix}: a {type(module).__name__} of no known GDN layout (tensors {sorted(tensors)}; "
                f"expected one of {sorted(LAYOUTS)})"
            )
        table.append(
            layer_candidates(
                prefix,
                GDNShape.from_module(module),
                tensors,
                layout.name,
                int(module.conv_kernel_size),
                dim_step=grid.step,
                axes=grid.axes,
                tp=grid.tp,
                multiple_of=grid.multiple_of,
                snap_quant=grid.snap_quant,
            )
        )
    return table


def check_feasible(problem: PlanProblem, uniform: bool) -> None:
    """Raise :class:`BudgetError` when no plan of the problem's space meets the budgets."""
    keys = problem.keys + [[None]] * len(problem.rests)
    zeros = [[0.0] * len(group) for group in keys]
    kinds = problem.kinds + [f"rest {r.index}" for r in problem.rests]
    if uniform and problem.depth:
        choose_servable(
            keys,
            zeros,
            problem.costs,
            problem.budgets,
            kinds=kinds,
            layer_of=problem.layer_of or [],
            removal={i: 0.0 for i in set(problem.layer_of or [])},
            keep_one_of=problem.keep_one_of,
        )
    elif uniform:
        choose_uniform(keys, zeros, problem.costs, problem.budgets, kinds=kinds)
    elif problem.depth:
        assert problem.layer_of is not None
        choose_with_removal(
            zeros,
            problem.costs,
            problem.budgets,
            layer_of=problem.layer_of,
            removal={i: 0.0 for i in set(problem.layer_of)},
            keep_one_of=problem.keep_one_of,
        )
    else:
        choose(zeros, problem.costs, problem.budgets)


def _check_uniform(groups: Sequence[Any], keys: Sequence[Sequence[Any]], kinds: Sequence[str]) -> None:
    """Every kind's blocks must share a candidate geometry for a uniform plan (blocks of one shape do)."""
    for kind in dict.fromkeys(kinds):
        members = [g for g, k in enumerate(kinds) if k == kind]
        if not set(keys[members[0]]).intersection(*(keys[g] for g in members[1:])):
            shapes: dict[str, str] = {}
            for g in members:
                shapes.setdefault(str(groups[g].shape), groups[g].prefix)
            raise ValueError(
                f"a uniform plan gives all {kind} blocks one geometry, but they have different shapes "
                f"and share no candidate: "
                + "; ".join(f"{s} (e.g. {p})" for s, p in shapes.items())
                + f"; leave {kind} out of `blocks` or plan without `uniform`"
            )
