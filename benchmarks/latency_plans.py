#!/usr/bin/env python
"""Latency plans on trained models (issue 30): what servability and a latency budget cost in loss, and the
latency model's prediction against the measured cut model.

Part A, quality (the bundled demo model: byte-level Qwen3.5, hidden 128, layers ``GGGA``; loss in nats/byte on
``--validation-windows`` held-out windows of 256 bytes, paired differences with standard errors). Scores on
16 training windows, the sensitivity measured once (``measured``: every candidate on ``--sensitivity-windows``
windows; every decoder layer's removal), the latency of every candidate block timed once at ``--workload``
(``gdnprune.plan.measure.latency_costs``). Every plan is then chosen exactly from these same measurements and applied
in memory (``latency_costs.cut_in_place``: the modules a sliced checkpoint loads):

* at equal parameters (``--budget-params``) and at equal latency (``--budget-latency``): the heterogeneous
  plan (depth allowed), the servable plan (one geometry per kind plus removed layers) and the best uniform cut
  (one geometry per kind, every layer kept);
* ``--budget-latency 0.5`` against the ``--budget-params`` plan whose measured latency is nearest the
  latency plan's (params fractions 0.2-0.95 in steps of 0.05, each distinct plan timed beside it), both
  heterogeneous.

Each plan's latency is measured as a whole cut model, all plans interleaved over ``--rounds`` rounds (medians).

Part B, predicted against measured latency on the trained models (``tests/data/trained/*`` and the demo
model): at every workload every candidate block is timed once, then for 3 latency budgets the exact MILP
chooses a plan (depth allowed; the sensitivity is the share of parameters a candidate removes, the plans are
only vehicles for the latency), and the unpruned and the 3 cut models are timed interleaved over
``--rounds`` rounds (medians).

    .venv/bin/python benchmarks/latency_plans.py --threads 1    # both parts (5 min on 2 cores at load 15)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "src"))
sys.path.insert(0, str(REPO / "benchmarks"))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from plans import window_losses  # noqa: E402

from gdnprune import demo_data  # noqa: E402
from gdnprune.io.loading import load_causal_lm  # noqa: E402
from gdnprune.model.latency import LatencyHarness, parse_workload  # noqa: E402
from gdnprune.plan.choose.solve import BudgetError  # noqa: E402
from gdnprune.plan.measure.candidates import parse_dim_step  # noqa: E402
from gdnprune.plan.measure.latency_costs import (  # noqa: E402
    add_latency_budget,
    cut_in_place,
    measure_latency_costs,
)
from gdnprune.plan.measure.problem import Grid, build_problem, given_budgets  # noqa: E402
from gdnprune.plan.report.results import Sensitivities  # noqa: E402
from gdnprune.plan.stages import choose_plan, measure  # noqa: E402
from gdnprune.scoring import score_model  # noqa: E402

SEQ = 256
AXES = ("key_heads", "lanes", "key_dim", "value_dim")
DEPTH = ("gdn", "attention", "mlp", "depth")
WIDTHS = ("gdn", "attention", "mlp")
TRAINED = ("qwen3_next", "olmo_hybrid", "qwen3_5_moe", "qwen3_5_vl")


def problem_of(model, scores, args, budgets: dict, *, uniform: bool, latency: bool):
    """The plan problem of ``budgets`` (``{"budget_params": 0.6}``...) on the benchmark's grid."""
    return build_problem(
        model,
        given_budgets(budgets),
        None if scores is None else scores["layers"],
        context=None,
        blocks=WIDTHS if uniform else DEPTH,
        grid=Grid(parse_dim_step(args.dim_step), AXES),
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
                harness = LatencyHarness(model, workload, repeats=3, warmup=1)
                times[k].append(harness.model_latency().seconds)
                continue
            with cut_in_place(model, problem, *choice):
                harness = LatencyHarness(model, workload, repeats=3, warmup=1)
                times[k].append(harness.model_latency().seconds)
    return [statistics.median(t) for t in times]


def _losses(model, problem, choice, validation) -> np.ndarray:
    with cut_in_place(model, problem, choice.picks, choice.removed):
        return window_losses(model, validation)


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


# long: one benchmark part, its steps in order
def part_quality(args) -> list[dict]:
    model, _ = demo_data.load_demo_model()
    model = model.float().eval()
    calibration = demo_data.byte_windows(demo_data.train_text("pydoc"), SEQ, 16)
    validation = demo_data.byte_windows(demo_data.validation_text("pydoc"), SEQ, args.validation_windows)
    start = time.perf_counter()
    scores = score_model(model, list(calibration.split(8)), progress=False, blocks=None)
    batches = list(calibration[: args.sensitivity_windows].split(4))
    workload = parse_workload(args.workload)
    base = problem_of(model, scores, args, {}, uniform=False, latency=True)
    sens = measure(model, batches, base, "measured", progress=False, servable=True)
    costs = measure_latency_costs(model, base, workload, repeats=5, warmup=2, progress=False)
    print(f"measured in {time.perf_counter() - start:.0f} s", flush=True)
    unpruned = window_losses(model, validation)
    cases = []
    for mode in ("heterogeneous", "servable", "uniform"):
        cases.append(("equal params", mode, {"budget_params": args.budget_params}))
    for mode in ("heterogeneous", "servable", "uniform"):
        cases.append(("equal latency", mode, {"budget_latency": args.budget_latency}))
    cases.append(("latency 0.5", "heterogeneous", {"budget_latency": 0.5}))
    chosen = []
    for what, mode, budgets in cases:
        try:
            problem, choice = _plan(model, scores, args, sens, costs, dict(budgets), mode)
        except BudgetError as exc:
            print(json.dumps({"case": what, "mode": mode, "error": str(exc)}), flush=True)
            continue
        chosen.append((what, mode, budgets, problem, choice))
    # the --budget-params plan whose measured latency is nearest the latency-0.5 plan's: every distinct params
    # plan on a grid of fractions timed beside it (2 interleaved rounds), the nearest kept
    target = next(c for c in chosen if c[0] == "latency 0.5")
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
    times = interleaved(
        model,
        base,
        [(target[4].picks, target[4].removed)] + [(c.picks, c.removed) for _, _, c in options],
        workload,
        2,
    )
    k = int(np.argmin([abs(t - times[0]) for t in times[1:]]))
    p, problem, choice = options[k]
    print(
        json.dumps(
            {"scan": [(o[0], t * 1e3) for o, t in zip(options, times[1:])], "target_ms": times[0] * 1e3}
        )
    )
    chosen.append(("params at equal latency", "heterogeneous", {"budget_params": p}, problem, choice))
    measured = interleaved(
        model,
        base,
        [None] + [(c[4].picks, c[4].removed) for c in chosen],
        workload,
        args.rounds,
    )
    losses = {}
    rows = []
    for what, mode, _, problem, choice in chosen:
        losses[(what, mode)] = _losses(model, problem, choice, validation)
    for (what, mode, budgets, problem, choice), seconds in zip(chosen, measured[1:]):
        mine = losses[(what, mode)]
        ref = losses.get((what, "heterogeneous"), losses[("latency 0.5", "heterogeneous")])
        if what == "params at equal latency":
            ref = losses[("latency 0.5", "heterogeneous")]
        totals = problem.model_totals(choice.picks)
        rows.append(
            dict(
                case=what,
                plan=mode,
                budgets=budgets,
                params_fraction=totals["model_params_fraction"],
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
    return rows


def part_latency(args) -> list[dict]:
    """Predicted against measured latency on every trained model, at 3 budgets and every workload."""
    folders = [(name, REPO / "tests" / "data" / "trained" / name) for name in TRAINED]
    folders.append(("qwen3_5 (demo)", demo_data.demo_model_path()))
    rows = []
    for name, folder in folders:
        model = load_causal_lm(folder, dtype="float32", device="cpu").eval()
        problem = problem_of(model, None, args, {}, uniform=False, latency=True)
        full = [max(g) for g in problem.whole_costs["params"][: len(problem.groups)]]
        values = [[1.0 - c / f for c in g] for g, f in zip(problem.whole_costs["params"], full)]
        removal = {r.index: (1.0, 0.0) for r in problem.rests}
        sens = Sensitivities(values=values, seconds=0.0, removal=removal)
        for text in args.workloads:
            workload = parse_workload(text)
            costs = measure_latency_costs(model, problem, workload, repeats=3, warmup=1, progress=False)
            choices = []
            for budget in args.latency_budgets:
                try:
                    add_latency_budget(problem, costs, budget)
                    choices.append((budget, choose_plan(problem, sens, uniform=False)))
                except BudgetError as exc:
                    rows.append(dict(model=name, workload=text, budget=budget, error=str(exc)))
            measured = interleaved(
                model, problem, [None] + [(c.picks, c.removed) for _, c in choices], workload, args.rounds
            )
            for (budget, choice), seconds in zip(choices, measured[1:]):
                predicted = costs.predicted(choice.picks, choice.removed)
                rows.append(
                    dict(
                        model=name,
                        workload=text,
                        budget=budget,
                        unpruned_ms=measured[0] * 1e3,
                        unpruned_ms_costs=costs.whole * 1e3,
                        predicted_ms=predicted * 1e3,
                        measured_ms=seconds * 1e3,
                        ratio=seconds / predicted,
                        measured_fraction=seconds / measured[0],
                        removed=choice.removed,
                    )
                )
                print(json.dumps(rows[-1]), flush=True)
        del model
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--skip-quality", action="store_true")
    parser.add_argument("--skip-latency", action="store_true")
    parser.add_argument("--workload", default="prefill:1:256", help="part A's workload")
    parser.add_argument("--workloads", nargs="+", default=["prefill:1:128", "decode:1:128"])
    parser.add_argument("--latency-budgets", nargs="+", type=float, default=[0.8, 0.6, 0.4])
    parser.add_argument("--budget-params", type=float, default=0.6)
    parser.add_argument("--budget-latency", type=float, default=0.6)
    parser.add_argument("--validation-windows", type=int, default=16)
    parser.add_argument("--sensitivity-windows", type=int, default=8)
    parser.add_argument("--dim-step", default="1/2")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"load average at start: {os.getloadavg()}", flush=True)
    result: dict = {}
    if not args.skip_quality:
        result["quality"] = part_quality(args)
    if not args.skip_latency:
        result["latency"] = part_latency(args)
    print(f"load average at end: {os.getloadavg()}", flush=True)
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
