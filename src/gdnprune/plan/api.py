"""``plan_model`` / ``plan_checkpoint``: the best per-layer widths under a budget.

Candidates per layer (:mod:`.candidates`), their sensitivity (:mod:`.sensitivity`), the exact choice
(:mod:`.solve`); the result is a plan file (:mod:`gdnprune.plans`) and a report of every candidate.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from ..geometry import GDNShape, orders_from_payload
from ..plans import PLAN_FORMAT, PLAN_VERSION, kernel_warnings
from ..scores import match_layers, read_scores
from .candidates import AXES, layer_candidates, parse_dim_step
from .solve import BudgetError, choose, choose_among, choose_uniform
from .subblocks import BLOCK_NAMES

__all__ = [
    "SENSITIVITIES",
    "STATE_BYTES",
    "BudgetError",
    "budget_limit",
    "check_budgets",
    "plan_checkpoint",
    "plan_model",
    "uniform_plans",
]

#: how sensitivity is obtained, the default first
SENSITIVITIES = ("halving", "measured", "proxy")
#: bytes per recurrent-state element in budgets and reports (the delta-rule state is kept in float32)
STATE_BYTES = 4


def budget_limit(value: float | None, total: int, what: str) -> float | None:
    """A budget as an absolute amount: ``value`` <= 1 is a fraction of ``total``, larger values are absolute."""
    if value is None:
        return None
    if isinstance(value, bool) or not value > 0:
        raise ValueError(
            f"`budget_{what}` must be a positive fraction (<= 1) or an absolute amount, got {value!r}"
        )
    return float(value) * total if value <= 1 else float(value)


def plan_model(
    model: Any,
    batches: Iterable[Any] | None,
    scores: str | Path | Mapping,
    *,
    budget_params: float | None = None,
    budget_gdn_params: float | None = None,
    budget_active_params: float | None = None,
    budget_memory: float | None = None,
    budget_state: float | None = None,
    context: int | None = None,
    blocks: Sequence[str] = BLOCK_NAMES,
    sensitivity: str = "halving",
    dim_step: str | float | int = "1/8",
    axes: Sequence[str] = AXES,
    tp: int | None = None,
    multiple_of: int | None = None,
    uniform: bool = False,
    orders_applied: bool = False,
    refine_generations: int = 0,
    refine_offspring: int = 8,
    refine_seed: int = 0,
    progress: bool = True,
) -> tuple[dict, dict]:
    """Choose every GDN layer's target, and every sub-block's, under the budgets; returns ``(plan, report)``.

    With only GDN budgets (``budget_gdn_params``, ``budget_state``) only GDN layers are cut. With a
    whole-model budget (``budget_params``, ``budget_active_params``, ``budget_memory``) every sub-block of
    ``blocks`` is a candidate group too (:mod:`.subblocks`: attention heads, MLP and shared-expert channels,
    routed-expert counts), and with ``"depth"`` in ``blocks`` every decoder layer may also be removed (a
    candidate of cost 0 whose sensitivity is the KL with that layer alone skipped, :mod:`.depth`); one exact
    MILP chooses all of them. A removed layer is ``{"removed": true}`` in the plan file.

    Args:
        model: a loaded transformers model with GDN layers (the unsorted model the scores describe).
        batches: calibration batches for the measured sensitivity (unused by ``"proxy"``).
        scores: the scores file (or dict) of ``model``; its orders sort each layer before it is cut, and the
            proxy reads its raw scores.
        budget_params: every parameter of the model (embeddings included) kept: a fraction (<= 1) or a count.
        budget_gdn_params: GDN parameters kept: a fraction of the GDN layers' (<= 1) or a count.
        budget_active_params: parameters used per token (routed experts count ``num_experts_per_tok`` experts'
            weights and every kept router row; without MoE the same as ``budget_params``): a fraction or a count.
        budget_memory: inference memory per sequence, GDN recurrent state (float32) plus the attention
            layers' KV cache at ``context`` tokens (in the model's dtype): a fraction or bytes.
        budget_state: recurrent-state bytes per sequence (float32) kept: a fraction (<= 1) or bytes.
        context: tokens per sequence of ``budget_memory``'s KV cache.
        blocks: what may shrink under a whole-model budget (:data:`~gdnprune.plan.subblocks.BLOCK_NAMES`, all of
            them by default: ``gdn``, ``attention``, ``mlp``, ``shared_expert``, ``experts``, and ``depth`` —
            whole decoder layers removed).
        sensitivity: ``"halving"`` (KL of real cuts, by successive halving: the candidates that can be chosen
            on every window, the others on a few, :mod:`.halving`), ``"measured"`` (every candidate on every
            window: the exact reference; removals are measured on every window either way) or ``"proxy"``
            (output energy removed, from the scores; GDN layers only).
        dim_step: head-dim grid step: a fraction of the dim (``"1/8"``) or a channel count.
        axes: the axes the search may cut (:data:`~gdnprune.plan.candidates.AXES`).
        tp, multiple_of: serving constraints every candidate meets.
        uniform: one geometry per kind of block (all GDN layers one, all MLPs one, all attention layers one,
            ...): the best combination under the budgets (:func:`~gdnprune.plan.solve.choose_uniform`). Its
            choice is exact over the sensitivities it is given; successive halving's rungs serve the
            heterogeneous choice, so ``sensitivity="measured"`` is the exact reference of a uniform plan.
        orders_applied: the model is already sorted by these scores (e.g. a ``gdnprune sort`` output).
        refine_generations: generations of the joint refinement (:mod:`.evolve`, fitness the KL of the whole
            cut model on the calibration batches) that starts from the exact choice; its mutations also remove
            decoder layers and bring them back when ``depth`` is planned; 0: none.
        refine_offspring, refine_seed: plans tried per generation, and the refinement's random seed.
        progress: progress bars over the measured candidates and the refinement's generations.

    Returns:
        The plan (a :mod:`gdnprune.plans` dict with the budgets, the predicted summed sensitivity and the
        totals) and the report (every candidate of every layer: target, parameters, state, sensitivity,
        loss, and the chosen one).

    Raises:
        ValueError: bad options, a scores file that does not fit the model, or budgets no plan meets
            (:class:`~gdnprune.plan.solve.BudgetError`).
    """
    from .sensitivity import measured_sensitivity, proxy_sensitivity

    if sensitivity not in SENSITIVITIES:
        raise ValueError(f"unknown sensitivity {sensitivity!r}; expected one of {list(SENSITIVITIES)}")
    step = parse_dim_step(dim_step)
    data = read_scores(scores)
    given = dict(
        params=budget_params,
        gdn_params=budget_gdn_params,
        active_params=budget_active_params,
        memory=budget_memory,
        state=budget_state,
    )
    problem = _problem(
        model,
        given,
        data["layers"],
        context=context,
        blocks=blocks,
        step=step,
        axes=axes,
        tp=tp,
        multiple_of=multiple_of,
        orders_applied=orders_applied,
        uniform=uniform,
    )
    table, layers, sub, rests = problem["table"], problem["layers"], problem["blocks"], problem["rests"]
    budgets, costs, key_of, layer_of = (
        problem["budgets"],
        problem["costs"],
        problem["key_of"],
        problem["layer_of"],
    )
    groups = layers + sub
    if rests and sensitivity == "proxy":
        raise ValueError(
            "the proxy sensitivity cannot rank removing a decoder layer against cutting widths (block "
            "influence, 1 - cos between a layer's input and output, is no KL): measure (sensitivity "
            '"halving" or "measured") or leave "depth" out of `blocks`'
        )
    if sub and sensitivity == "proxy":
        raise ValueError(
            "the proxy sensitivity covers GDN layers only; measure the sub-blocks (sensitivity "
            '"halving" or "measured") or let only GDN layers shrink (`blocks` ["gdn"])'
        )
    payload_of = problem["payload_of"]

    start = time.perf_counter()
    survivors = removal = None
    if sensitivity in ("measured", "halving"):
        if batches is None:
            raise ValueError("measured sensitivity needs calibration batches")
        batches = list(batches)
        if rests:  # few candidates: each measured on every window
            from .depth import removal_sensitivity

            removal = removal_sensitivity(model, batches)
        if sensitivity == "measured" or not groups:
            measured = measured_sensitivity(model, batches, groups, progress=progress)
        else:
            from .halving import halving_sensitivity

            chooser = (
                None
                if not rests
                else lambda estimate, alive: _choose_with_removal(
                    problem, list(estimate), removal, list(alive)
                )[: len(groups)]
            )
            measured = halving_sensitivity(
                model,
                batches,
                groups,
                {k: v[: len(groups)] for k, v in costs.items()},
                budgets,
                choose=chooser,
                progress=progress,
            )
            survivors = [measured["survivors"][layer.prefix] for layer in groups]
        values = [measured["kl"][layer.prefix] for layer in groups]
        losses = [measured["loss"][layer.prefix] for layer in groups]
        extra = {
            "base_loss": measured["base_loss"],
            "tokens": measured["tokens"],
            "forwards": measured["forwards"],
            **({"rungs": measured["rungs"]} if survivors else {}),
        }
    else:
        # the scores' own orders and raw scores, both in the unsorted indexing: right whether or not the
        # model was sorted since
        values = [
            proxy_sensitivity(payload_of[layer.prefix], layer.shape, layer.candidates) for layer in layers
        ]
        losses, extra = None, {}
    seconds = time.perf_counter() - start

    if uniform:
        picks = choose_uniform(problem["keys"], values, costs, budgets, kinds=problem["kinds"])
    elif rests:
        picks = _choose_with_removal(problem, values, removal, survivors)
    else:
        picks = choose_among(values, costs, budgets, survivors)
    refinement = None
    if refine_generations:
        if uniform or sensitivity == "proxy" or batches is None:
            raise ValueError(
                "the joint refinement needs calibration batches and a heterogeneous plan (not --uniform)"
            )
        from .evolve import REMOVED
        from .joint import refine_plan

        refinement = refine_plan(
            model,
            batches,
            groups + rests,
            costs,
            budgets,
            [REMOVED if p is None else p for p in picks],
            generations=refine_generations,
            offspring=refine_offspring,
            seed=refine_seed,
            progress=progress,
            layer_of=layer_of,
            removable=[r.index for r in rests],
            keep_one_of=problem["keep_one_of"],
        )
        picks = [None if p == REMOVED else p for p in refinement["picks"]]
    n = len(layers)
    removed = sorted({layer_of[g] for g, p in enumerate(picks) if p is None}) if rests else []
    chosen = {
        layer.prefix: table[i][pick] for i, (layer, pick) in enumerate(zip(layers, picks)) if pick is not None
    }
    kept = {
        "params": sum(c.params for c in chosen.values()),
        "state": sum(c.state for c in chosen.values()) * STATE_BYTES,
    }
    totals = problem["gdn_totals"]
    entries = _entries(problem, picks)
    layer_keys = _decoder_keys(problem, groups) if rests else {}
    entries.update({layer_keys[i]: {"removed": True} for i in removed})
    removal_kl = {i: v[0] for i, v in (removal or {}).items()}
    plan = {
        "format": PLAN_FORMAT,
        "version": PLAN_VERSION,
        "layers": entries,
        "sensitivity": sensitivity,
        "uniform": bool(uniform),
        "budgets": {
            name: {"given": given[name], "limit": round(problem["limits"][name], 3)} for name in budgets
        },
        **(
            {
                "refined": {
                    k: refinement[k] for k in ("generations", "offspring", "seed", "seed_kl", "kl", "windows")
                }
            }
            if refinement
            else {}
        ),
        "predicted": {
            "summed_sensitivity": float(
                sum(v[pick] for v, pick in zip(values, picks) if pick is not None)
                + sum(removal_kl[i] for i in removed)
            ),
            **(
                {
                    "measured_losses_of_chosen": [
                        None if pick is None else losses[i][pick]
                        for i, pick in enumerate(picks[: len(groups)])
                    ]
                }
                if losses
                else {}
            ),
            **({"removed_layers": removed} if rests else {}),
        },
        "totals": {
            **(
                {
                    "gdn_params": totals["params"],
                    "gdn_params_kept": kept["params"],
                    "gdn_params_fraction": kept["params"] / totals["params"],
                    "state_bytes": totals["state"],
                    "state_bytes_kept": kept["state"],
                    "state_fraction": kept["state"] / totals["state"],
                }
                if layers
                else {}
            ),
            **_model_totals(problem, picks),
        },
        "grid": {
            "dim_step": str(step),
            "axes": list(axes),
            "tp": tp,
            "multiple_of": multiple_of,
            **(
                {
                    "blocks": sorted(
                        {b.block.kind for b in sub}
                        | ({"gdn"} if layers else set())
                        | ({"depth"} if rests else set())
                    ),
                    "context": context,
                }
                if problem["whole"]
                else {}
            ),
        },
        "scores": {"sha256": _scores_hash(scores), "method": data.get("method")},
        "kernel_warnings": kernel_warnings({key_of[p]: c.target for p, c in chosen.items()}),
    }
    whole_costs = problem["whole_costs"] or {}
    report = {
        "sensitivity": sensitivity,
        "seconds": round(seconds, 3),
        **extra,
        **({"refinement": {k: v for k, v in refinement.items() if k != "picks"}} if refinement else {}),
        "layers": {
            key_of[layer.prefix]: {
                "shape": layer.shape.as_dict(),
                "chosen": picks[i],
                **({"removed": True} if picks[i] is None else {}),
                "candidates": [
                    {
                        "target": c.target.as_dict(),
                        "params": c.params,
                        "state_bytes": c.state * STATE_BYTES,
                        "sensitivity": values[i][k],
                        **({"loss": losses[i][k]} if losses else {}),
                        **(
                            {"windows": measured["windows"][layer.prefix][k], "survivor": survivors[i][k]}
                            if survivors
                            else {}
                        ),
                    }
                    for k, c in enumerate(table[i])
                ],
            }
            for i, layer in enumerate(layers)
        },
        **(
            {
                "blocks": {
                    key_of.get(b.prefix, b.prefix): {
                        "kind": b.block.kind,
                        "shape": b.shape.as_dict(),
                        "chosen": picks[n + j],
                        **({"removed": True} if picks[n + j] is None else {}),
                        "candidates": [
                            {
                                "target": _block_entry(b, t),
                                **{name: table_[n + j][k] for name, table_ in whole_costs.items()},
                                "sensitivity": values[n + j][k],
                                **({"loss": losses[n + j][k]} if losses else {}),
                                **(
                                    {
                                        "windows": measured["windows"][b.prefix][k],
                                        "survivor": survivors[n + j][k],
                                    }
                                    if survivors
                                    else {}
                                ),
                            }
                            for k, t in enumerate(b.candidates)
                        ],
                    }
                    for j, b in enumerate(sub)
                }
            }
            if sub
            else {}
        ),
        **(
            {"removal": _removal_report(problem, layer_keys, removal, removed, model, batches)}
            if rests
            else {}
        ),
    }
    return plan, report


def _choose_with_removal(
    problem: Mapping[str, Any], values: list, removal: Mapping[int, tuple[float, float]], allowed: list | None
) -> list[int | None]:
    """The exact choice of widths and removed layers (:func:`.depth.choose_with_removal`) over the width groups'
    ``values`` (and ``allowed``) and the layers' rests (one candidate each, sensitivity 0)."""
    from .depth import choose_with_removal

    rests = [[0.0]] * len(problem["rests"])
    picks, _ = choose_with_removal(
        values + rests,
        problem["costs"],
        problem["budgets"],
        layer_of=problem["layer_of"],
        removal={i: v[0] for i, v in removal.items()},
        allowed=None if allowed is None else allowed + [[True]] * len(rests),
        keep_one_of=problem["keep_one_of"],
    )
    return picks


def _decoder_keys(problem: Mapping[str, Any], groups: Sequence[Any]) -> dict[int, str]:
    """Decoder layer index -> its prefix in the plan file: a planned group's key (the scores' and checkpoint's
    naming) cut after ``layers.N``, else the module path."""
    import re

    out = {r.index: r.prefix for r in problem["rests"]}
    for g, group in enumerate(groups):
        key = problem["key_of"].get(group.prefix, group.prefix)
        found = re.search(r"(?:^|\.)layers\.\d+", key)
        if found:
            out[problem["layer_of"][g]] = key[: found.end()]
    return out


def _removal_report(
    problem: Mapping[str, Any],
    keys: Mapping[int, str],
    removal: Mapping[int, tuple[float, float]],
    removed: Sequence[int],
    model: Any,
    batches: Any,
) -> dict[str, dict]:
    """Per decoder layer: the removal candidate (KL and loss with the layer alone skipped, block influence, what
    the whole layer costs on every budget) and whether it was chosen."""
    from ..scoring.experts import block_influence

    influence = block_influence(model, batches) if removal is not None else {}
    costs = problem["layer_costs"]
    return {
        keys[r.index]: {
            "layer": r.index,
            "removed": r.index in removed,
            **(
                {
                    "sensitivity": removal[r.index][0],
                    "loss": removal[r.index][1],
                    "block_influence": influence[r.index],
                }
                if removal is not None
                else {}
            ),
            **{name: costs[name][r.index] for name in costs},
        }
        for r in problem["rests"]
    }


def _candidate_table(
    modules: Sequence[tuple[str, Any]],
    step: Any,
    axes: Sequence[str],
    tp: int | None,
    multiple_of: int | None,
) -> list[list]:
    """Every candidate of every GDN module (:func:`~gdnprune.plan.candidates.layer_candidates`)."""
    from ..layouts import LAYOUTS, detect_layout

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
                dim_step=step,
                axes=axes,
                tp=tp,
                multiple_of=multiple_of,
            )
        )
    return table


#: the whole-model budgets (the others, ``gdn_params`` and ``state``, count the GDN layers alone)
WHOLE = ("params", "active_params", "memory")


def _problem(
    model: Any,
    given: Mapping[str, float | None],
    score_layers: Mapping | None,
    *,
    context: int | None,
    blocks: Sequence[str],
    step: Any,
    axes: Sequence[str],
    tp: int | None,
    multiple_of: int | None,
    orders_applied: bool,
    uniform: bool,
) -> dict[str, Any]:
    """The candidate groups (GDN layers, then sub-blocks), their costs and the budgets as group limits;
    checks that some plan meets the budgets (no forward, no weight read)."""
    from ..layouts import find_gdn_modules
    from .sensitivity import LayerToPlan
    from .subblocks import BLOCK_NAMES, SUB_BLOCK_NAMES, plannable_blocks, whole_model_costs

    if all(v is None for v in given.values()):
        raise ValueError(
            "give a budget: `budget_params`, `budget_gdn_params`, `budget_active_params`, "
            "`budget_memory` and/or `budget_state`"
        )
    unknown = sorted(set(blocks) - set(BLOCK_NAMES))
    if unknown or not blocks:
        raise ValueError(f"`blocks` must name some of {list(BLOCK_NAMES)}, got {list(blocks)}")
    if given["memory"] is not None and context is None:
        raise ValueError(
            "`budget_memory` counts the KV cache at `context` tokens per sequence: give `context`"
        )
    if context is not None and (isinstance(context, bool) or not isinstance(context, int) or context < 1):
        raise ValueError(f"`context` must be a positive number of tokens, got {context!r}")
    whole = any(given[name] is not None for name in WHOLE)
    gdn = "gdn" in blocks or not whole
    if not gdn and (given["gdn_params"] is not None or given["state"] is not None):
        raise ValueError(
            "`budget_gdn_params` and `budget_state` limit the GDN layers, but `blocks` leaves them out"
        )
    modules = find_gdn_modules(model) if gdn else []
    if gdn and not modules:
        raise ValueError(f"{type(model).__name__} has no GDN layers to plan")
    from ..blocks import block_kind_of

    gdn_entries = (
        None if score_layers is None else {k: v for k, v in score_layers.items() if block_kind_of(k) is None}
    )  # sub-blocks: .subblocks
    payload_of = (
        match_layers(gdn_entries, [p for p, _ in modules]) if gdn_entries is not None and modules else {}
    )
    missing = [p for p, _ in modules if not orders_applied and p not in payload_of]
    if missing:
        raise ValueError(f"the scores have no entry for the GDN layers {missing[:3]}; score this model first")
    key_of = {}  # module prefix -> the prefix the scores use (checkpoint names: the plan file uses them)
    for key in gdn_entries if modules and gdn_entries else ():
        key_of.update({p: key for p in match_layers({key: None}, [p for p, _ in modules])})
    key_of.update({p: p for p, _ in modules if p not in key_of})
    table = _candidate_table(modules, step, axes, tp, multiple_of)
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
    kinds = [k for k in blocks if k in SUB_BLOCK_NAMES] if whole else []
    if uniform and whole and "depth" in blocks and tuple(blocks) != tuple(BLOCK_NAMES):
        raise ValueError(
            'a uniform plan keeps every decoder layer: leave "depth" out of `blocks` (the default '
            "`blocks` with `uniform` plans widths only)"
        )
    depth = whole and "depth" in blocks and not uniform  # a uniform plan keeps every layer
    sub = plannable_blocks(
        model,
        kinds,
        score_layers,
        step=step,
        tp=tp,
        multiple_of=multiple_of,
        orders_applied=orders_applied or score_layers is None,
    )
    key_of.update({b.prefix: b.key for b in sub})
    if not layers and not sub and not depth:
        raise ValueError(f"nothing in {type(model).__name__} may shrink: `blocks` {list(blocks)}")
    zeros = [[0.0] * len(b.candidates) for b in sub]
    gdn_totals = {
        "params": sum(c[0].params for c in table),
        "state": sum(c[0].state for c in table) * STATE_BYTES,
    }
    gdn_costs = {
        "gdn_params": [[float(c.params) for c in cands] for cands in table] + zeros,
        "state": [[float(c.state * STATE_BYTES) for c in cands] for cands in table] + zeros,
    }
    limits, budgets, costs = {}, {}, {}
    for name, total in (("gdn_params", gdn_totals["params"]), ("state", gdn_totals["state"])):
        if given[name] is not None:
            limits[name] = budgets[name] = budget_limit(given[name], total, name)
            costs[name] = gdn_costs[name]
    totals = fixed = wcosts = None
    rests, layer_of, wholes = [], None, None
    gdn_pairs = [(m, c) for (_, m), c in zip(modules, table)]
    if whole:
        totals, wcosts, fixed = whole_model_costs(
            model, gdn_pairs, sub, context=context, state_bytes=STATE_BYTES
        )
    if depth:  # every decoder layer may go: the part of it no candidate changes is a group of its own
        from ..forwards import decoder_blocks
        from .depth import LayerRest
        from .subblocks import decoder_layer_rests

        layer_of, prefixes, rest_costs, wholes = decoder_layer_rests(
            model, gdn_pairs, sub, context=context, state_bytes=STATE_BYTES
        )
        rests = [LayerRest(p, m, i) for i, (p, m) in enumerate(zip(prefixes, decoder_blocks(model)))]
        layer_of = layer_of + list(range(len(rests)))
        for name in wcosts:
            wcosts[name] = wcosts[name] + [[v] for v in rest_costs[name]]
            fixed[name] -= sum(rest_costs[name])
        for name in costs:  # the GDN-only budgets: a layer's rest holds no GDN parameter or state
            costs[name] = costs[name] + [[0.0]] * len(rests)
    if whole:
        for name in WHOLE:
            if given[name] is None:
                continue
            limits[name] = budget_limit(given[name], totals[name], name)
            budgets[name], costs[name] = limits[name] - fixed[name], wcosts[name]
            least = fixed[name] + (0.0 if depth else sum(min(g) for g in wcosts[name]))
            if least > limits[name]:
                raise BudgetError(
                    f"no plan meets the budgets: {name} needs at least {least:,.0f} (every sub-block at "
                    f"its smallest candidate{', every decoder layer but one removed' if depth else ''}; "
                    f"{fixed[name]:,.0f} in what no candidate changes), budget {limits[name]:,.0f}"
                )
    keys = [[c.target for c in cands] for cands in table] + [list(b.candidates) for b in sub]
    kinds = ["gdn"] * len(layers) + [b.block.kind for b in sub]
    if uniform:
        _check_uniform(layers + sub, keys, kinds)
    from ..depth import attention_layers

    keep_one_of = (
        attention_layers(model.config.to_dict()) if depth else []
    )  # one stays (slice refuses the rest)
    _check_feasible(
        keys + [[None]] * len(rests), kinds, costs, budgets, uniform, layer_of if depth else None, keep_one_of
    )  # before any forward
    return {
        "table": table,
        "layers": layers,
        "blocks": sub,
        "budgets": budgets,
        "costs": costs,
        "limits": limits,
        "keys": keys,
        "kinds": kinds,
        "key_of": key_of,
        "payload_of": payload_of,
        "gdn_totals": gdn_totals,
        "whole": whole,
        "totals": totals,
        "fixed": fixed,
        "whole_costs": wcosts,
        "depth": depth,
        "rests": rests,
        "layer_of": layer_of,
        "keep_one_of": keep_one_of,
        "layer_costs": wholes,
    }


def _entries(problem: Mapping[str, Any], picks: Sequence[int]) -> dict[str, dict[str, int]]:
    """The plan file's ``layers``: every group's chosen target, keyed as the scores (or the model) name it."""
    n, key_of = len(problem["layers"]), problem["key_of"]
    entries = {
        key_of[layer.prefix]: problem["table"][i][pick].target.as_dict()
        for i, (layer, pick) in enumerate(zip(problem["layers"], picks))
        if pick is not None
    }
    for b, pick in zip(problem["blocks"], picks[n:]):
        if pick is not None:  # None: its decoder layer is removed
            entries[key_of.get(b.prefix, b.prefix)] = _block_entry(b, b.candidates[pick])
    return entries


def uniform_plans(model: Any, *, maximal: bool = True, **options: Any) -> list[dict]:
    """Every uniform plan of ``model`` that meets the budgets, without a forward (weights not needed: a
    ``meta`` model will do): one geometry per kind of block (:func:`~gdnprune.plan.solve.uniform_choices`;
    with ``maximal``, only those where no single kind can take a larger geometry within the budgets).

    ``options``: the budgets and grid options of :func:`plan_model` (``budget_params``, ``blocks``,
    ``dim_step``, ``context``, ...); the others are ignored. Each plan is a plan-file dict (``layers`` keyed
    by the model's module prefixes; ``slice_model`` or ``gdnprune slice --plan`` take it) with its
    ``totals`` (kept amounts per budget, the split over sub-blocks) and no sensitivity.
    """
    from .solve import uniform_choices

    names = ("params", "gdn_params", "active_params", "memory", "state")
    given = {name: options.get(f"budget_{name}") for name in names}
    problem = _problem(
        model,
        given,
        None,
        context=options.get("context"),
        blocks=options.get("blocks", BLOCK_NAMES),
        step=parse_dim_step(options.get("dim_step", "1/8")),
        axes=options.get("axes", AXES),
        tp=options.get("tp"),
        multiple_of=options.get("multiple_of"),
        orders_applied=True,
        uniform=True,
    )
    plans = []
    for picks in uniform_choices(
        problem["keys"], problem["costs"], problem["budgets"], kinds=problem["kinds"], maximal=maximal
    ):
        gdn = [problem["table"][i][pick] for i, pick in enumerate(picks[: len(problem["layers"])])]
        totals = _model_totals(problem, picks)
        if gdn:
            totals.update(
                gdn_params=problem["gdn_totals"]["params"],
                gdn_params_kept=sum(c.params for c in gdn),
                state_bytes=problem["gdn_totals"]["state"],
                state_bytes_kept=sum(c.state for c in gdn) * STATE_BYTES,
            )
        plans.append(
            {
                "format": PLAN_FORMAT,
                "version": PLAN_VERSION,
                "layers": _entries(problem, picks),
                "uniform": True,
                "budgets": {
                    name: {"given": given[name], "limit": round(problem["limits"][name], 3)}
                    for name in problem["budgets"]
                },
                "totals": totals,
            }
        )
    return plans


def _block_entry(block: Any, target: Any) -> dict[str, int]:
    """A sub-block's plan-file entry: its target fields (:data:`gdnprune.blocks.BLOCK_FIELDS`)."""
    from ..blocks import BLOCK_FIELDS, KINDS

    return {k: v for k, v in KINDS[block.block.kind].config_updates(target).items() if k in BLOCK_FIELDS}


def _model_totals(problem: Mapping[str, Any], picks: Sequence[int | None]) -> dict[str, Any]:
    """The whole-model totals of a plan: every budget's full and kept amounts, and the parameters split over
    the kinds of sub-block (``other``: what no candidate changes, embeddings and removable layers' rests
    included); a pick None (its decoder layer removed) keeps nothing."""
    if not problem["whole"]:
        return {}
    out: dict[str, Any] = {}
    wcosts, fixed = problem["whole_costs"], problem["fixed"]
    for name, total in problem["totals"].items():
        kept = fixed[name] + sum(g[pick] for g, pick in zip(wcosts[name], picks) if pick is not None)
        word = "memory_bytes" if name == "memory" else f"model_{name}" if name == "params" else name
        out.update({word: total, f"{word}_kept": kept, f"{word}_fraction": kept / total})
    rests = problem["rests"]
    kinds = (
        ["gdn"] * len(problem["layers"]) + [b.block.kind for b in problem["blocks"]] + ["other"] * len(rests)
    )
    full = (
        [sum(p.numel() for p in layer.module.parameters()) for layer in problem["layers"]]
        + [b.block.parameters() for b in problem["blocks"]]
        + [g[0] for g in wcosts["params"][len(kinds) - len(rests) :]]
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


def _check_feasible(
    keys,
    kinds,
    costs,
    budgets,
    uniform: bool,
    layer_of: Sequence[int] | None = None,
    keep_one_of: Sequence[int] = (),
) -> None:
    zeros = [[0.0] * len(group) for group in keys]
    if uniform:
        choose_uniform(keys, zeros, costs, budgets, kinds=kinds)
    elif layer_of is not None:
        from .depth import choose_with_removal

        choose_with_removal(
            zeros,
            costs,
            budgets,
            layer_of=layer_of,
            removal={i: 0.0 for i in set(layer_of)},
            keep_one_of=keep_one_of,
        )
    else:
        choose(zeros, costs, budgets)


def _check_uniform(groups: Sequence[Any], keys: Sequence[Sequence[Any]], kinds: Sequence[str]) -> None:
    """Every kind's blocks must share a candidate geometry for a uniform plan (blocks of one shape do)."""
    for kind in dict.fromkeys(kinds):
        members = [g for g, k in enumerate(kinds) if k == kind]
        if not set(keys[members[0]]).intersection(*(keys[g] for g in members[1:])):
            shapes = {}
            for g in members:
                shapes.setdefault(str(groups[g].shape), groups[g].prefix)
            raise ValueError(
                f"a uniform plan gives all {kind} blocks one geometry, but they have different shapes "
                f"and share no candidate: "
                + "; ".join(f"{s} (e.g. {p})" for s, p in shapes.items())
                + f"; leave {kind} out of `blocks` or plan without `uniform`"
            )


def check_budgets(
    model: Any,
    *,
    budget_params: float | None = None,
    budget_gdn_params: float | None = None,
    budget_active_params: float | None = None,
    budget_memory: float | None = None,
    budget_state: float | None = None,
    context: int | None = None,
    blocks: Sequence[str] = BLOCK_NAMES,
    dim_step: str | float | int = "1/8",
    axes: Sequence[str] = AXES,
    tp: int | None = None,
    multiple_of: int | None = None,
    uniform: bool = False,
    **_: Any,
) -> None:
    """Raise :class:`~gdnprune.plan.solve.BudgetError` when no plan of ``model`` (weights not needed: a
    ``meta`` model will do) meets the budgets; the other options of :func:`plan_model` are ignored."""
    given = dict(
        params=budget_params,
        gdn_params=budget_gdn_params,
        active_params=budget_active_params,
        memory=budget_memory,
        state=budget_state,
    )
    _problem(
        model,
        given,
        None,
        context=context,
        blocks=blocks,
        step=parse_dim_step(dim_step),
        axes=axes,
        tp=tp,
        multiple_of=multiple_of,
        orders_applied=True,
        uniform=uniform,
    )


def _scores_hash(scores: Any) -> str | None:
    from ..fileio import file_sha256

    return None if isinstance(scores, Mapping) else file_sha256(scores)


def plan_checkpoint(
    model_dir: str | Path,
    data: str | Path | None,
    scores: str | Path | Mapping,
    *,
    num_samples: int = 16,
    seq_len: int | None = None,
    batch_size: int = 4,
    device: str | None = None,
    dtype: str = "float32",
    device_map: str | None = None,
    model: Any = None,
    **options: Any,
) -> tuple[dict, dict]:
    """:func:`plan_model` on a model folder and a calibration file (read as ``gdnprune score`` reads it).

    When the folder is a ``gdnprune sort`` output of these very scores (its manifest records their hash),
    the orders are not applied a second time. ``model``: the folder's model already loaded
    (:func:`gdnprune.loading.load_causal_lm`; then ``device``, ``dtype`` and ``device_map`` are not used).
    The proxy sensitivity needs no weights: without ``model`` it builds the model on the ``meta`` device
    from the config (:func:`gdnprune.loading.empty_causal_lm`) and reads no tensor.
    """
    from ..checkpoint import read_manifest
    from ..loading import empty_causal_lm, load_causal_lm
    from ..scoring.api import default_seq_len

    model_dir = Path(model_dir)
    manifest = read_manifest(model_dir) or {}
    applied = (
        not isinstance(scores, Mapping)
        and manifest.get("sorted")
        and (manifest.get("scores") or {}).get("sha256") == _scores_hash(scores)
    )
    batches = None
    if options.get("sensitivity", "halving") != "proxy":
        import json

        from transformers import AutoTokenizer

        from ..calibration import calibration_windows, iter_batches

        if data is None:
            raise ValueError("measured sensitivity needs calibration data (`data`)")
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        if seq_len is None:
            seq_len = default_seq_len(json.loads((model_dir / "config.json").read_text()), tokenizer)[0]
        windows = calibration_windows(data, tokenizer, seq_len=seq_len, num_samples=num_samples)
        batches = list(iter_batches(windows, batch_size))
    if model is None:
        model = (
            load_causal_lm(model_dir, dtype=dtype, device=device, device_map=device_map)
            if batches is not None
            else empty_causal_lm(model_dir)
        )
    plan, report = plan_model(model, batches, scores, orders_applied=bool(applied), **options)
    plan["model"] = str(model_dir)
    if batches is not None:
        plan["calibration"] = {
            "data": str(data),
            "num_samples": sum(int(b.shape[0]) for b in batches),
            "seq_len": int(seq_len),
            "batch_size": batch_size,
        }
    return plan, report
