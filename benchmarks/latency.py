#!/usr/bin/env python
"""Block latencies add up to the whole model's within ~5%, latency budgets are met where compute dominates, and servability costs loss.

Three parts (``python -m benchmarks latency PART``), every latency a median of interleaved rounds:

``additivity``: on a random Qwen3.5 text model where compute dominates (default: hidden 1024, 8 layers
``GGGA GGGA``, GDN 8 key heads / 16 value heads of 128, attention 8 heads / 2 KV heads of 128, MLP 3072,
vocabulary 32000), at a prefill and a decode workload: the whole model
(:meth:`~gdnprune.model.latency.LatencyHarness.model_latency`), the fixed part (embeddings, rotary tables,
masks, final norm, ``lm_head``), the fixed part + the decoder layers timed alone, and + the sub-blocks timed
alone (what a plan sums); the ratios to the whole model (1.0 = additive), taken per round.

``predicted``: the latency model's prediction against the measured cut model. Every candidate block and whole
decoder layer is timed once per workload (``gdnprune.plan.measure.latency_costs``); for each latency budget the
exact MILP chooses a plan (depth allowed; the sensitivity is the share of parameters a candidate removes: the
plans only carry the latency), then the unpruned and the cut models are timed interleaved. Models:
``random`` (the compute-dominated random Qwen3.5 of hidden 1024, MLP 2048, vocabulary 1024), the trained tiny
models of ``tests/data/trained`` and the bundled demo model.

``quality``: what servability and a latency budget cost in loss, on the bundled demo model (loss in nats/byte
on held-out windows, paired differences with standard errors). Scores on 16 training windows, the
sensitivity measured once, every candidate timed once at ``--workload``; every plan chosen exactly from these
measurements and applied in memory (``latency_costs.cut_in_place``): at equal parameters and at equal latency
the heterogeneous plan (depth allowed), the servable plan (one geometry per kind plus removed layers) and the
best uniform cut; ``--budget-latency 0.5`` against the ``--budget-params`` plan whose measured latency is
nearest (fractions 0.2-0.95, each distinct plan timed beside it).

Usage::

    python -m benchmarks latency additivity --threads 1
    python -m benchmarks latency predicted --threads 1 --models random             # the compute-dominated model
    python -m benchmarks latency predicted --threads 1                             # and the trained models
    python -m benchmarks latency quality --threads 1
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
from _common import REPO, load_text, markdown_table, random_qwen35, window_losses, write_json

from gdnprune import demo_data
from gdnprune.io.loading import load_causal_lm
from gdnprune.model.latency import LatencyHarness, parse_workload
from gdnprune.plan.choose.solve import BudgetError
from gdnprune.plan.measure.candidates import parse_dim_step
from gdnprune.plan.measure.latency_costs import add_latency_budget, cut_in_place, measure_latency_costs
from gdnprune.plan.measure.problem import Grid, build_problem, given_budgets
from gdnprune.plan.report.results import Sensitivities
from gdnprune.plan.stages import choose_plan, measure
from gdnprune.scoring import score_model

SEQ = 256
AXES = ("key_heads", "lanes", "key_dim", "value_dim")
DEPTH = ("gdn", "attention", "mlp", "depth")
WIDTHS = ("gdn", "attention", "mlp")
TRAINED = ("qwen3_next", "olmo_hybrid", "qwen3_5_moe", "qwen3_5_vl")


def compute_bound(hidden: int = 1024, layers: int = 8, intermediate: int = 3072, vocab: int = 32000):
    """A random Qwen3.5 where compute dominates: every 4th layer full attention, attention ``hidden / 128``
    heads and ``hidden / 512`` KV heads of 128, GDN ``hidden / 128`` key and ``hidden / 64`` value heads of 128."""
    return random_qwen35(
        hidden=hidden, layers=layers, intermediate=intermediate, vocab=vocab, attention_heads=hidden // 128,
        kv_heads=max(1, hidden // 512), key_heads=hidden // 128, value_heads=hidden // 64,
    )  # fmt: skip


# ---- additivity --------------------------------------------------------------------------------------------


def _sub_modules(layer: torch.nn.Module) -> list[torch.nn.Module]:
    """The planned sub-blocks of a decoder layer: its token mixer and its MLP."""
    return [getattr(layer, "linear_attn", None) or layer.self_attn, layer.mlp]


def _additivity_of(model, workload, rounds: int, warmup: int) -> dict:
    """Interleaved rounds: in each, the whole model, the fixed part, every decoder layer and every sub-block
    timed once; the ratios per round, then their median (and range) over the rounds."""
    harness = LatencyHarness(model, workload, repeats=1, warmup=0)
    layers = list(model.model.layers)
    subs = [m for layer in layers for m in _sub_modules(layer)]
    harness.prepare(layers + subs)
    series: dict[str, list] = {"whole": [], "fixed": [], "layers": [], "blocks": []}
    for r in range(warmup + rounds):
        whole, fixed = harness.model_latency().seconds, harness.fixed_latency().seconds
        per_layer = [t.seconds for t in harness.block_latencies([(layer, None) for layer in layers])]
        per_sub = [t.seconds for t in harness.block_latencies([(m, None) for m in subs])]
        if r >= warmup:
            for key, value in zip(series, (whole, fixed, fixed + sum(per_layer), fixed + sum(per_sub))):
                series[key].append(value)
    ratios = {k: [a / w for a, w in zip(series[k], series["whole"])] for k in ("layers", "blocks")}
    return {
        "workload": str(workload),
        **{k: statistics.median(v) for k, v in series.items()},
        "ratio": {k: statistics.median(v) for k, v in ratios.items()},
        "range": {k: (min(v), max(v)) for k, v in ratios.items()},
    }


def additivity(args) -> int:
    model = compute_bound(args.hidden, args.layers, args.intermediate, args.vocab)
    model.to(device=args.device, dtype=getattr(torch, args.dtype))
    n = sum(p.numel() for p in model.parameters())
    print(
        f"random Qwen3.5: hidden {args.hidden}, {args.layers} layers, MLP {args.intermediate}, vocab {args.vocab}, "
        f"{n / 1e6:.1f}M parameters, {args.dtype} on {args.device}; {args.rounds} rounds after "
        f"{args.warmup_rounds} warm-up; load average {load_text()}"
    )
    header = ["workload", "whole ms", "fixed ms", "fixed + layers ms", "layers / whole (range)"]
    header += ["fixed + sub-blocks ms", "sub-blocks / whole (range)"]
    rows = []
    for text in (args.prefill, args.decode):
        r = _additivity_of(model, parse_workload(text), args.rounds, args.warmup_rounds)
        (lo_l, hi_l), (lo_b, hi_b) = r["range"]["layers"], r["range"]["blocks"]
        rows.append(
            [
                r["workload"], f"{1000 * r['whole']:.1f}", f"{1000 * r['fixed']:.2f}", f"{1000 * r['layers']:.1f}",
                f"{r['ratio']['layers']:.3f} ({lo_l:.3f}-{hi_l:.3f})", f"{1000 * r['blocks']:.1f}",
                f"{r['ratio']['blocks']:.3f} ({lo_b:.3f}-{hi_b:.3f})",
            ]
        )  # fmt: skip
    print(markdown_table(header, rows))
    write_json(args.json, {"header": header, "rows": rows})
    return 0


# ---- predicted against measured ----------------------------------------------------------------------------


def problem_of(model, scores, args, budgets: dict, *, uniform: bool, latency: bool):
    """The plan problem of ``budgets`` (``{"budget_params": 0.6}``...) on the benchmark's grid."""
    return build_problem(
        model,
        given_budgets(budgets),
        None if scores is None else scores["layers"],
        context=None,
        blocks=WIDTHS if uniform else DEPTH,
        grid=Grid(parse_dim_step(args.dim_step), AXES if args.part == "quality" else args.axes),
        orders_applied=scores is None,
        uniform=uniform,
        latency=latency,
    )


def interleaved(model, problem, choices, workload, rounds: int) -> list[float]:
    """The median latency (seconds) of every ``(picks, removed)`` (None: the unpruned model), timed in turn
    over ``rounds`` rounds."""
    times: list[list[float]] = [[] for _ in choices]
    for _ in range(rounds):
        for k, choice in enumerate(choices):
            if choice is None:
                times[k].append(LatencyHarness(model, workload, repeats=3, warmup=1).model_latency().seconds)
                continue
            with cut_in_place(model, problem, *choice):
                times[k].append(LatencyHarness(model, workload, repeats=3, warmup=1).model_latency().seconds)
    return [statistics.median(t) for t in times]


def _share_removed(problem) -> Sensitivities:
    """Each candidate's "sensitivity": the share of its group's parameters it removes (random or tiny models:
    the plans only carry the latency)."""
    full = [max(g) for g in problem.whole_costs["params"][: len(problem.groups)]]
    values = [[1.0 - c / f for c in g] for g, f in zip(problem.whole_costs["params"], full)]
    return Sensitivities(values=values, seconds=0.0, removal={r.index: (1.0, 0.0) for r in problem.rests})


def _predicted_models(names: list[str]):
    for name in names:
        if name == "random":
            yield name, compute_bound(intermediate=2048, vocab=1024)
        elif name == "demo":
            yield "qwen3_5 (demo)", load_causal_lm(demo_data.demo_model_path(), dtype="float32").eval()
        else:
            yield name, load_causal_lm(REPO / "tests" / "data" / "trained" / name, dtype="float32").eval()


def predicted(args) -> int:
    print(f"load average at start: {load_text()}", flush=True)
    header = [
        "model",
        "workload",
        "budget",
        "unpruned ms",
        "predicted ms",
        "measured ms",
        "measured / predicted",
    ]
    header += ["measured / unpruned", "layers removed"]
    rows, records = [], []
    for name, model in _predicted_models(args.models):
        problem = problem_of(model, None, args, {}, uniform=False, latency=True)
        sens = _share_removed(problem)
        for text in args.workloads:
            workload = parse_workload(text)
            costs = measure_latency_costs(model, problem, workload, repeats=3, warmup=1, progress=False)
            choices = []
            for budget in args.latency_budgets:
                try:
                    add_latency_budget(problem, costs, budget)
                    choices.append((budget, choose_plan(problem, sens, uniform=False)))
                except BudgetError as exc:
                    records.append(dict(model=name, workload=text, budget=budget, error=str(exc)))
                    print(json.dumps(records[-1]), flush=True)
            measured = interleaved(
                model, problem, [None] + [(c.picks, c.removed) for _, c in choices], workload, args.rounds
            )
            for (budget, choice), seconds in zip(choices, measured[1:]):
                guess = costs.predicted(choice.picks, choice.removed)
                removed = ", ".join(map(str, choice.removed)) or "-"
                rows.append(
                    [
                        name, text, budget, f"{measured[0] * 1e3:.1f}", f"{guess * 1e3:.1f}", f"{seconds * 1e3:.1f}",
                        f"{seconds / guess:.2f}", f"{seconds / measured[0]:.2f}", removed,
                    ]
                )  # fmt: skip
                records.append(dict(zip(header, rows[-1])))
                print(json.dumps(records[-1]), flush=True)
        del model
    print("\n" + markdown_table(header, rows, "llrrrrrrl"))
    print(f"\nload average at end: {load_text()}")
    write_json(args.json, records)
    return 0


# ---- quality -----------------------------------------------------------------------------------------------


def _plan(model, scores, args, sens, costs, budgets: dict, mode: str):
    """The exact choice of ``mode`` (heterogeneous, servable, uniform) under ``budgets``; its problem too."""
    latency = budgets.pop("budget_latency", None)
    problem = problem_of(model, scores, args, budgets, uniform=mode == "uniform", latency=latency is not None)
    if latency is not None:
        if mode == "uniform":  # the width groups' latencies only (every layer kept)
            costs = type(costs)(
                costs.workload, costs.whole, costs.fixed + sum(costs.rests), costs.groups, [], []
            )
        add_latency_budget(problem, costs, latency)
    use = sens if mode != "uniform" else Sensitivities(values=sens.values, seconds=0.0)
    return problem, choose_plan(problem, use, uniform=mode == "uniform", servable=mode == "servable")


def _nearest_params_plan(model, scores, args, sens, costs, base, target, workload):
    """The ``--budget-params`` plan whose measured latency is nearest the latency plan ``target``'s: every
    distinct params plan on a grid of fractions timed beside it (2 interleaved rounds)."""
    scanned: dict[tuple, tuple] = {}
    for p in np.arange(0.2, 1.0, 0.05):
        try:
            problem, choice = _plan(
                model, scores, args, sens, costs, {"budget_params": float(p)}, "heterogeneous"
            )
        except BudgetError:
            continue
        scanned.setdefault(
            (tuple(choice.picks), tuple(choice.removed)), (round(float(p), 2), problem, choice)
        )
    options = list(scanned.values())
    choices = [(target.picks, target.removed)] + [(c.picks, c.removed) for _, _, c in options]
    times = interleaved(model, base, choices, workload, 2)
    print(
        json.dumps(
            {"scan": [(o[0], t * 1e3) for o, t in zip(options, times[1:])], "target_ms": times[0] * 1e3}
        )
    )
    return options[int(np.argmin([abs(t - times[0]) for t in times[1:]]))]


# long: one benchmark part, its steps in order
def quality(args) -> int:
    model = demo_data.load_demo_model()[0].float().eval()
    calibration = demo_data.byte_windows(demo_data.train_text("pydoc"), SEQ, 16)
    validation = demo_data.byte_windows(demo_data.validation_text("pydoc"), SEQ, args.validation_windows)
    start = time.perf_counter()
    scores = score_model(model, list(calibration.split(8)), progress=False, blocks=None)
    workload = parse_workload(args.workload)
    base = problem_of(model, scores, args, {}, uniform=False, latency=True)
    batches = list(calibration[: args.sensitivity_windows].split(4))
    sens = measure(model, batches, base, "measured", progress=False, servable=True)
    costs = measure_latency_costs(model, base, workload, repeats=5, warmup=2, progress=False)
    print(f"measured in {time.perf_counter() - start:.0f} s; load average {load_text()}", flush=True)
    cases = [
        ("equal params", m, {"budget_params": args.budget_params})
        for m in ("heterogeneous", "servable", "uniform")
    ]
    cases += [
        ("equal latency", m, {"budget_latency": args.budget_latency})
        for m in ("heterogeneous", "servable", "uniform")
    ]
    cases.append(("latency 0.5", "heterogeneous", {"budget_latency": 0.5}))
    chosen = []
    for what, mode, budgets in cases:
        try:
            chosen.append(
                (what, mode, budgets, *_plan(model, scores, args, sens, costs, dict(budgets), mode))
            )
        except BudgetError as exc:
            print(json.dumps({"case": what, "mode": mode, "error": str(exc)}), flush=True)
    target = next(c for c in chosen if c[0] == "latency 0.5")
    p, problem, choice = _nearest_params_plan(model, scores, args, sens, costs, base, target[4], workload)
    chosen.append(("params at equal latency", "heterogeneous", {"budget_params": p}, problem, choice))
    measured = interleaved(
        model, base, [None] + [(c[4].picks, c[4].removed) for c in chosen], workload, args.rounds
    )
    losses = {}
    for what, mode, _, problem, choice in chosen:
        with cut_in_place(model, problem, choice.picks, choice.removed):
            losses[(what, mode)] = window_losses(model, validation)
    unpruned = window_losses(model, validation)
    rows = []
    for (what, mode, budgets, problem, choice), seconds in zip(chosen, measured[1:]):
        mine = losses[(what, mode)]
        ref = losses.get((what, "heterogeneous"), losses[("latency 0.5", "heterogeneous")])
        if what == "params at equal latency":
            ref = losses[("latency 0.5", "heterogeneous")]
        rows.append(
            dict(
                case=what,
                plan=mode,
                budgets=budgets,
                params_fraction=problem.model_totals(choice.picks)["model_params_fraction"],
                removed=choice.removed,
                predicted_fraction=costs.predicted(choice.picks, choice.removed) / costs.whole,
                measured_fraction=seconds / measured[0],
                measured_speedup=measured[0] / seconds,
                loss=float(mine.mean()),
                se=float(mine.std(ddof=1) / np.sqrt(len(mine))),
                minus_reference=float((mine - ref).mean()),
                paired_se=float((mine - ref).std(ddof=1) / np.sqrt(len(mine))),
                unpruned_loss=float(unpruned.mean()),
                unpruned_ms=measured[0] * 1e3,
            )
        )
        print(json.dumps(rows[-1]), flush=True)
    print(f"load average at end: {load_text()}")
    write_json(args.json, rows)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parts = parser.add_subparsers(dest="part", required=True)
    a = parts.add_parser("additivity", help="block latencies against the whole model's")
    a.add_argument("--hidden", type=int, default=1024)
    a.add_argument("--layers", type=int, default=8)
    a.add_argument("--intermediate", type=int, default=3072)
    a.add_argument("--vocab", type=int, default=32000)
    a.add_argument("--prefill", default="prefill:1:256")
    a.add_argument("--decode", default="decode:4:256")
    a.add_argument("--rounds", type=int, default=5, help="interleaved timed rounds (default 5)")
    a.add_argument("--warmup-rounds", type=int, default=1, help="untimed rounds before them (default 1)")
    a.add_argument("--device", default="cpu")
    a.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    a.set_defaults(run=additivity)
    p = parts.add_parser("predicted", help="the latency model's prediction against the measured cut model")
    p.add_argument(
        "--models", nargs="+", default=["random", *TRAINED, "demo"], help="random, demo or a trained family"
    )
    p.add_argument("--workloads", nargs="+", default=["prefill:1:128", "decode:1:128"])
    p.add_argument("--latency-budgets", nargs="+", type=float, default=[0.8, 0.6, 0.4])
    p.add_argument("--axes", type=lambda t: tuple(t.split(",")), default=AXES, help="GDN axes of the grid")
    p.add_argument("--dim-step", default="1/2")
    p.add_argument("--rounds", type=int, default=5)
    p.set_defaults(run=predicted)
    q = parts.add_parser("quality", help="what servability and a latency budget cost in loss")
    q.add_argument("--workload", default="prefill:1:256")
    q.add_argument("--budget-params", type=float, default=0.6)
    q.add_argument("--budget-latency", type=float, default=0.6)
    q.add_argument("--validation-windows", type=int, default=16)
    q.add_argument("--sensitivity-windows", type=int, default=8)
    q.add_argument("--dim-step", default="1/2")
    q.add_argument("--rounds", type=int, default=5)
    q.set_defaults(run=quality)
    for sub in (a, p, q):
        sub.add_argument("--threads", type=int, default=1)
        sub.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
