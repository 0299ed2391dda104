#!/usr/bin/env python
"""Replay successive halving's variants on a table of per-window KL: forwards and rounds counted exactly.

``benchmarks/plans.py --measure-only --cache FILE`` measures every candidate of every GDN layer on every
calibration window (one window per forward) and keeps each window's KL. This script runs the library's
procedure (:func:`gdnprune.plan.measure.halving.search`, the same code :func:`~gdnprune.plan.measure.halving.halving_sensitivity`
runs) with a ``measure`` that copies from that table instead of running forwards, for several variants,
budgets and window orders (order 0: the benchmark's; the others: seeded permutations of the windows), and
prints per variant: how often the plan equals the exact one (the MILP on every candidate's mean over every
window), the summed KL above the exact plan's, the window forwards, the rounds of the verification, and the
seconds of its choices ("MILP s": by merged fronts; variant ``milp``: by the MILP, as the third version).
The wall time of a real run is about forwards x (the full measurement's seconds per window forward) + those
seconds; ``benchmarks/plans.py`` measures it side by side.

    .venv/bin/python benchmarks/halving_replay.py --cache benchmarks/_work/measured31_bundled.json \\
        benchmarks/_work/measured31_tiny.json --orders 4
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "src"))
sys.path.insert(0, str(REPO / "benchmarks"))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from plans import BUDGETS, parse_budgets  # noqa: E402

from gdnprune import demo_data  # noqa: E402
from gdnprune.io.loading import load_pretrained  # noqa: E402
from gdnprune.model.geometry import GDNShape  # noqa: E402
from gdnprune.model.layouts import detect_layout, find_gdn_modules  # noqa: E402
from gdnprune.plan import STATE_BYTES, choose, layer_candidates  # noqa: E402
from gdnprune.plan.choose.solve import choose_among  # noqa: E402
from gdnprune.plan.measure.halving import exact_choice, rungs, search  # noqa: E402

#: name -> keyword arguments of :func:`~gdnprune.plan.measure.halving.search` (and ``first`` / ``grow`` of the rungs);
#: ``POOLED``: the ratio bound from every layer's candidates (the default until issue 31's third version)
POOLED = {"per_layer": False, "confidence": 1.5}
VARIANTS: dict[str, dict] = {
    "unverified": {"verified": False, "eta": 2},  # issue 22's halving
    "verified": {"eta": 2, "confidence": None, "per_layer": False},  # issue 31 as first merged
    "pooled": POOLED,  # issue 31's second version: pooled bound at 1.5 standard deviations, a quarter kept
    "default": {},  # the bound from the candidate's own layer at 2 standard deviations, a quarter kept
    "slack5": {"eta": 2, "confidence": None, "per_layer": False, "slack": 0.05},
    "conf2": {**POOLED, "confidence": 2.0},
    "eta2": {**POOLED, "eta": 2},
    "spread0": {**POOLED, "spread": 0},
    "spread2": {**POOLED, "spread": 2},
    "before1": {**POOLED, "before": 1},
    "jump": {**POOLED, "jump": True},
    "wide": {**POOLED, "plain": False},  # no front restriction, no cheapest-candidate feasibility
    "grow2": {**POOLED, "grow": 2},
    "grow2b1": {**POOLED, "grow": 2, "before": 1},
    "grow2b2": {**POOLED, "grow": 2, "before": 2},
    "grow2c2": {**POOLED, "grow": 2, "confidence": 2.0},
    "grow2b1c2": {**POOLED, "grow": 2, "before": 1, "confidence": 2.0},
    "layer15": {"confidence": 1.5},  # the default's per-layer bound at 1.5 / 1.75 standard deviations
    "layer175": {"confidence": 1.75},
    "layer2eta8": {"eta": 8},
    "layer2grow2": {"grow": 2},
    "layer2grow2c25": {"grow": 2, "confidence": 2.5},
    "milp": {
        "merged": False
    },  # the default, every choice by the MILP (the third version): same picks, slower
}


def candidate_costs(model: torch.nn.Module, dim_step: str) -> tuple[dict, list[list[bool]]]:
    """Every GDN layer's candidates' costs (as benchmarks/plans.py computes them) and which candidate is the
    layer's own geometry (KL 0, never measured)."""
    params, state, own = [], [], []
    for prefix, module in find_gdn_modules(model):
        shape = GDNShape.from_module(module)
        tensors = {n: tuple(p.shape) for n, p in module.named_parameters()}
        cands = layer_candidates(
            prefix, shape, tensors, detect_layout(tensors).name, module.conv_kernel_size, dim_step=dim_step
        )
        params.append([c.params for c in cands])
        state.append([c.state * STATE_BYTES for c in cands])
        own.append([c.target == shape for c in cands])
    return {"params": params, "state": state}, own


def replay(truth: list[np.ndarray], own: list[list[bool]], costs: dict, budgets: dict, options: dict) -> dict:
    """One run of the procedure on ``truth`` ([candidates, windows] per layer)."""
    total = truth[0].shape[1]
    kl = [np.zeros_like(t) for t in truth]
    seen = [np.zeros(len(t), dtype=int) for t in truth]
    full = [np.array(o) for o in own]
    count = {"forwards": 0, "solves": 0, "seconds": 0.0}

    def measure(todo: list[list[tuple[int, int]]], desc: str) -> None:
        for li, items in enumerate(todo):
            for c, upto in items:
                kl[li][c, seen[li][c] : upto] = truth[li][c, seen[li][c] : upto]
                count["forwards"] += upto - int(seen[li][c])
                seen[li][c] = upto

    options = dict(options)
    solve = exact_choice(costs, budgets, merged=options.pop("merged", True))

    def pick(estimate: list, alive: list) -> list:
        start = time.perf_counter()
        out = solve(estimate, alive)
        count["seconds"] += time.perf_counter() - start
        count["solves"] += 1
        return out

    schedule = rungs(total, options.pop("first", None), options.pop("grow", 4))
    rounds = search(measure, kl, seen, full, np.ones(total), costs, budgets, schedule, pick, **options)
    survivors = [(s >= total) | f for s, f in zip(seen, full)]
    means = [np.where(f, 0.0, k.sum(1) / np.maximum(s, 1)) for k, s, f in zip(kl, seen, full)]  # unseen: 0
    picks = choose_among(means, costs, budgets, survivors)
    return {"picks": picks, "rounds": rounds, **count}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cache", type=Path, nargs="+", required=True, help="benchmarks/plans.py --cache files")
    p.add_argument("--orders", type=int, default=1, help="window orders (the benchmark's, then permutations)")
    p.add_argument("--variants", nargs="*", default=list(VARIANTS), help=f"of {', '.join(VARIANTS)}")
    p.add_argument("--budgets", type=parse_budgets, default=BUDGETS, help="e.g. params:0.5,state:0.5")
    p.add_argument("--models", nargs="*", default=[], help="only these models of the caches (default all)")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    torch.set_num_threads(1)
    out = []
    for path in args.cache:
        for key, entry in json.loads(path.read_text()).items():
            name, dim_step = key.split("|")[:2]
            if args.models and name not in args.models:
                continue
            if name == "bundled":
                model, _ = demo_data.load_demo_model()
            else:
                model = load_pretrained(REPO / "tests" / "data" / "trained" / name, dtype=torch.float32)
            costs, own = candidate_costs(model, dim_step)
            prefixes = list(entry["kl_windows"])
            base = [np.array(entry["kl_windows"][prefix]) for prefix in prefixes]
            per_forward = entry["benchmark_seconds"] / max(1, entry["forwards"])
            totals = {k: sum(v[0] for v in costs[k]) for k in costs}
            print(
                f"\n{name}: {[len(b) for b in base]} candidates, {base[0].shape[1]} windows, "
                f"{per_forward * 1000:.0f} ms per window forward in the full measurement"
            )
            print(
                f"{'budget':<12} {'variant':<12} {'exact':>5} {'dKL mean':>9} {'dKL max':>8} {'fwd':>6} "
                f"{'fwd max':>7} {'rounds':>6} {'solves':>6} {'MILP s':>6} {'est s':>6}"
            )
            for kind, fraction in args.budgets:
                budgets = {kind: fraction * totals[kind]}
                exact = choose([b.mean(1) for b in base], costs, budgets)
                exact_kl = sum(b.mean(1)[c] for b, c in zip(base, exact))
                for variant in args.variants:
                    runs = []
                    for order in range(args.orders):
                        perm = (
                            np.arange(base[0].shape[1])
                            if order == 0
                            else np.random.default_rng(order).permutation(base[0].shape[1])
                        )
                        r = replay([b[:, perm] for b in base], own, costs, budgets, VARIANTS[variant])
                        r["dkl"] = float(sum(b.mean(1)[c] for b, c in zip(base, r["picks"])) - exact_kl)
                        r["exact"] = r["picks"] == exact
                        runs.append(r)
                    fwd = [r["forwards"] for r in runs]
                    row = {
                        "model": name,
                        "budget": f"{kind} {fraction:.0%}",
                        "variant": variant,
                        "exact": sum(r["exact"] for r in runs),
                        "orders": len(runs),
                        "dkl_mean": float(np.mean([r["dkl"] for r in runs])),
                        "dkl_max": float(max(r["dkl"] for r in runs)),
                        "forwards": float(np.mean(fwd)),
                        "forwards_max": max(fwd),
                        "forwards_order0": fwd[0],
                        "rounds": float(np.mean([r["rounds"] for r in runs])),
                        "solves": float(np.mean([r["solves"] for r in runs])),
                        "milp_seconds": float(np.mean([r["seconds"] for r in runs])),
                    }
                    row["estimated_seconds"] = row["forwards"] * per_forward + row["milp_seconds"]
                    out.append(row)
                    print(
                        f"{row['budget']:<12} {variant:<12} {row['exact']:>2}/{row['orders']:<2} "
                        f"{row['dkl_mean']:9.5f} {row['dkl_max']:8.5f} {row['forwards']:6.0f} "
                        f"{row['forwards_max']:7d} {row['rounds']:6.1f} {row['solves']:6.1f} "
                        f"{row['milp_seconds']:6.1f} {row['estimated_seconds']:6.0f}",
                        flush=True,
                    )
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
