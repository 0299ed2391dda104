#!/usr/bin/env python
"""The searched per-layer GDN plan beats the best uniform cut at every budget; successive halving finds the exact plan.

Plan search benchmark: searched per-layer plans against the best uniform target, under the same budgets.

For each model (the bundled demo model; a deeper model that ``scripts/train_demo_model.py`` trains, see
``--deep``) it scores the GDN layers on training text, measures every candidate's sensitivity once (the
KL divergence from the unpruned model with that layer alone cut, on calibration windows) and computes
the proxy, then for every budget (75 %, 50 %, 25 % of GDN parameters; 50 % of recurrent state):

* the searched plan (exact MILP on the measured sensitivity) and the plan from the proxy;
* the best uniform target on the same grid within the same budget, found by evaluating the validation
  loss of *every* feasible uniform target (not by any prediction), and the uniform target that
  ``--uniform`` would pick from the measured sensitivity;
* validation loss on held-out windows for each (the same scores, windows and sort for all), the paired
  difference searched - best uniform with its standard error over windows;
* the predicted loss change (summed per-layer KL) against the measured joint KL of the whole plan.

It also reports how well the proxy ranks candidates (Spearman's rho against the measured KL) and what
each sensitivity cost. And, per budget (issue 22):

* **cheap**: the plan from the default sensitivity, successive halving (:mod:`gdnprune.plan.measure.halving`, run
  for that budget), its cost (partial forwards of one window, seconds, and seconds / the scoring pass: the
  median of ``--scoring-passes`` passes timed before the plans and of those timed before and after every
  halving run, in the same process; "xlocal": its seconds over the mean of the passes just before and just
  after it, the load of that moment weighing on both);
* **refined**: that plan after ``--refine-generations`` generations of the joint refinement
  (:mod:`gdnprune.plan.choose.evolve`), its cost;
* the paired difference of each against the searched (measured MILP) plan on the held-out windows, and the
  joint KL of each (calibration windows) beside the searched plan's and the best uniform cut's.

Prints the tables; ``--json`` writes every number; ``--cache FILE`` keeps the measured sensitivity (the
slowest part, every candidate on every window, one window per forward, with every window's KL) and reuses
it when the model, grid and windows are the same; ``--measure-only`` only fills the cache (the replay of
successive halving's variants on it, ``benchmarks/halving_replay.py``, is in git at commit 7019855).

    .venv/bin/python benchmarks/plans.py --threads 1 --json plans.json
    .venv/bin/python benchmarks/plans.py --deep benchmarks/_work/models/deep_docstrings   # + the deeper model

The deeper model (6 GDN + 2 attention layers, 2 key heads x 4 lanes, the standard library's docstrings):

    .venv/bin/python scripts/train_demo_model.py --threads 1 --layer-types GGGAGGGA --key-heads 2 \\
        --value-heads 8 --corpus docstrings --out benchmarks/_work/models/deep_docstrings
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "src"))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from _common import joint_kl, spearman, window_losses  # noqa: E402,F401  (whole_model, after_recovery import them from here)

from gdnprune import demo_data  # noqa: E402
from gdnprune.io.loading import load_pretrained, slice_model  # noqa: E402
from gdnprune.model.geometry import GDNShape, orders_from_payload  # noqa: E402
from gdnprune.model.layouts import detect_layout, find_gdn_modules  # noqa: E402
from gdnprune.plan import STATE_BYTES, BudgetError, choose, choose_uniform, layer_candidates  # noqa: E402
from gdnprune.plan.choose.solve import choose_among  # noqa: E402
from gdnprune.plan.measure.halving import halving_sensitivity  # noqa: E402
from gdnprune.plan.measure.joint import evolve_plan  # noqa: E402
from gdnprune.plan.measure.sensitivity import LayerToPlan, proxy_sensitivity  # noqa: E402
from gdnprune.scoring import GDN_ONLY, score_model, scores_to_permutations  # noqa: E402

BUDGETS = [("params", 0.75), ("params", 0.5), ("params", 0.25), ("state", 0.5)]
#: issue 31's successive halving variants, side by side: name -> options of ``halving_sensitivity``
HALVING_VARIANTS: dict[str, dict] = {
    "unverified": {"verified": False, "eta": 2},
    "verified": {"eta": 2, "confidence": None, "per_layer": False},
    "pooled": {"per_layer": False, "confidence": 1.5},  # the second version: every layer's ratios pooled
    "milp": {"merged": False},  # the default with every choice by the MILP (the third version): same picks
    "default": {},
}


def parse_budgets(text: str) -> list[tuple[str, float]]:
    out = []
    for item in text.split(","):
        kind, _, value = item.partition(":")
        if kind not in ("params", "state") or not value:
            raise argparse.ArgumentTypeError(f"a budget is params:F or state:F, got {item!r}")
        out.append((kind, float(value)))
    return out


def scoring_pass(model, calibration: torch.Tensor) -> tuple[dict, float]:
    """One scoring pass (the GDN layers scored on the calibration windows, 8 per batch) and its seconds."""
    t0 = time.perf_counter()
    scores = score_model(model, list(calibration.split(8)), progress=False, blocks=GDN_ONLY)
    return scores, time.perf_counter() - t0


def run_model(name: str, model, corpus: str, args) -> dict:
    t0 = time.perf_counter()
    calibration = demo_data.byte_windows(demo_data.train_text(corpus), 256, args.calibration_windows)
    scores = score_model(model, list(calibration.split(8)), progress=False, blocks=GDN_ONLY)
    permutations = scores_to_permutations(scores)
    score_seconds = time.perf_counter() - t0
    sens_windows = list(calibration[: args.sensitivity_windows].split(4))
    validation = demo_data.byte_windows(demo_data.validation_text(corpus), 256, args.validation_windows)
    base = window_losses(model, validation)

    modules = find_gdn_modules(model)
    layers, table = [], []
    for prefix, module in modules:
        shape = GDNShape.from_module(module)
        tensors = {n: tuple(p.shape) for n, p in module.named_parameters()}
        cands = layer_candidates(
            prefix,
            shape,
            tensors,
            detect_layout(tensors).name,
            module.conv_kernel_size,
            dim_step=args.dim_step,
        )
        layers.append(
            LayerToPlan(
                prefix,
                module,
                orders_from_payload(scores["layers"][prefix], shape),
                [c.target for c in cands],
            )
        )
        table.append(cands)
    costs = {
        "params": [[c.params for c in cands] for cands in table],
        "state": [[c.state * STATE_BYTES for c in cands] for cands in table],
    }
    key = f"{name}|{args.dim_step}|{args.calibration_windows}|{args.sensitivity_windows}"
    stored = json.loads(args.cache.read_text()) if args.cache and args.cache.exists() else {}
    if key in stored:
        measured, measured_seconds = stored[key], stored[key]["benchmark_seconds"]
        print(f"{name}: the measured sensitivity from {args.cache} (measured in {measured_seconds:.0f} s)")
    else:
        t0 = time.perf_counter()
        # the full measurement, one window per forward (as halving measures), keeping every window's KL
        # (benchmarks/halving_replay.py of commit 7019855 replays halving's variants on it)
        measured = halving_sensitivity(
            model,
            sens_windows,
            layers,
            costs,
            {},
            first=args.sensitivity_windows,
            progress=not args.quiet,
        )
        measured_seconds = time.perf_counter() - t0
        if args.cache:
            stored[key] = {
                **measured,
                "benchmark_seconds": measured_seconds,
                "load_average": os.getloadavg()[0],
            }
            args.cache.parent.mkdir(parents=True, exist_ok=True)
            args.cache.write_text(json.dumps(stored))
    if args.measure_only:
        return {"model": name, "measure_only": True}
    # the denominator of every "x scoring": the median of several scoring passes of this run (these, and those
    # just before and after every halving run, side by side with them; the first pass above, which warms up,
    # is not one of them), not one pass (issue 31: 1.8 s in one run, 11.3 s in another)
    scoring_passes = [scoring_pass(model, calibration)[1] for _ in range(args.scoring_passes)]
    t0 = time.perf_counter()
    proxy = [
        proxy_sensitivity(scores["layers"][layer.prefix], layer.shape, layer.candidates) for layer in layers
    ]
    proxy_seconds = time.perf_counter() - t0
    kl = [measured["kl"][layer.prefix] for layer in layers]
    rho = [spearman(p[1:], k[1:]) for p, k in zip(proxy, kl)]
    pooled = spearman(np.concatenate([p[1:] for p in proxy]), np.concatenate([k[1:] for k in kl]))
    with torch.no_grad():
        teacher = [model(input_ids=x).logits.float().log_softmax(-1) for x in sens_windows]

    totals = {k: sum(v[0] for v in costs[k]) for k in costs}
    keys = [[c.target for c in cands] for cands in table]
    cache: dict = {}

    def evaluate(picks) -> dict:
        targets = {layer.prefix: table[i][p].target for i, (layer, p) in enumerate(zip(layers, picks))}
        key = tuple(sorted((k, v) for k, v in targets.items()))
        if key not in cache:
            small = slice_model(model, targets, permutations)
            cache[key] = {
                "losses": window_losses(small, validation),
                "joint_kl": joint_kl(small, teacher, sens_windows),
                "targets": {k: v.as_dict() for k, v in targets.items()},
                "params": sum(costs["params"][i][p] for i, p in enumerate(picks)) / totals["params"],
                "state": sum(costs["state"][i][p] for i, p in enumerate(picks)) / totals["state"],
            }
        return cache[key]

    rows = []
    for kind, fraction in args.budgets:
        budgets = {kind: fraction * totals[kind]}
        row = {"budget": f"{kind} {fraction:.0%}"}
        try:
            picks = choose(kl, costs, budgets)
        except BudgetError as exc:
            row["error"] = str(exc)
            rows.append(row)
            continue
        searched = evaluate(picks)
        predicted = float(sum(k[p] for k, p in zip(kl, picks)))
        proxy_plan = evaluate(choose(proxy, costs, budgets))
        measured_uniform = evaluate(choose_uniform(keys, kl, costs, budgets))
        # every uniform geometry within the budget, evaluated on validation
        best_uniform, n_uniform = None, 0
        for target in [] if args.skip_uniform else keys[0]:
            picks_u = [layer_keys.index(target) for layer_keys in keys]
            if sum(costs[kind][i][p] for i, p in enumerate(picks_u)) > budgets[kind]:
                continue
            n_uniform += 1
            result = evaluate(picks_u)
            if best_uniform is None or result["losses"].mean() < best_uniform["losses"].mean():
                best_uniform = result
        if best_uniform is None:  # --skip-uniform: the uniform cut --uniform picks stands in
            best_uniform = measured_uniform
        diff = best_uniform["losses"] - searched["losses"]

        # issue 22: the cheap sensitivity's plan, and that plan refined
        def paired(a, b):  # a - b over the held-out windows: mean and standard error
            d = a["losses"] - b["losses"]
            return float(d.mean()), float(d.std(ddof=1) / math.sqrt(len(d)))

        # issue 31: successive halving unverified (as in issue 22), verified as first merged (lowest ratio,
        # half kept per rung), its second version (pooled prediction bound) and the default (the bound
        # from the candidate's own layer), a quarter kept per rung, same budget (--halving-variants)
        variants = {}
        # every variant's run between two scoring passes (the one after it is the next one's before): its
        # seconds over their mean, the local ratio, beside the ratio to the median of all passes
        before = scoring_pass(model, calibration)[1] if args.scoring_passes > 0 else None
        scoring_passes.extend([] if before is None else [before])
        for variant in args.halving_variants:
            options = HALVING_VARIANTS[variant]
            t0 = time.perf_counter()
            halved = halving_sensitivity(
                model, sens_windows, layers, costs, budgets, progress=False, **options
            )
            seconds = time.perf_counter() - t0
            after = scoring_pass(model, calibration)[1] if before is not None else None
            scoring_passes.extend([] if after is None else [after])
            chosen = choose_among(
                [halved["kl"][layer.prefix] for layer in layers],
                costs,
                budgets,
                [halved["survivors"][layer.prefix] for layer in layers],
            )
            plan = evaluate(chosen)
            variants[variant] = {
                "picks": chosen,
                "loss": float(plan["losses"].mean()),
                "minus_searched": paired(plan, searched),
                "same_plan": chosen == picks,
                "measured_kl": float(sum(k[p] for k, p in zip(kl, chosen))),
                "joint_kl": plan["joint_kl"],
                "forwards": halved["forwards"],
                "seconds": seconds,
                "verify_rounds": halved["verify_rounds"],
                "targets": plan["targets"],
                "scoring_around": [before, after],
                "x_scoring_local": None if before is None else seconds / (0.5 * (before + after)),
            }
            before = after
        halved_default = variants["default"]
        cheap_picks, cheap = halved_default["picks"], evaluate(halved_default["picks"])
        row["halving"] = variants
        if args.refine_generations > 0:
            refined_result = evolve_plan(
                model,
                sens_windows,
                layers,
                costs,
                budgets,
                cheap_picks,
                generations=args.refine_generations,
                offspring=args.refine_offspring,
                seed=0,
                progress=False,
            )
        else:  # no refinement: the cheap plan stands
            refined_result = {
                "picks": cheap_picks,
                "kl": cheap["joint_kl"],
                "seed_kl": cheap["joint_kl"],
                "seconds": 0.0,
                "evaluations": 0,
                "history": [],
            }
        refined = evaluate(refined_result["picks"])

        row.update(
            {
                "cheap_loss": float(cheap["losses"].mean()),
                "cheap_minus_searched": paired(cheap, searched),
                "cheap_same_plan": cheap_picks == picks,
                "cheap_joint_kl": cheap["joint_kl"],
                "cheap_forwards": halved_default["forwards"],
                "cheap_seconds": halved_default["seconds"],
                "cheap_targets": cheap["targets"],
                "refined_loss": float(refined["losses"].mean()),
                "refined_minus_searched": paired(refined, searched),
                "refined_minus_cheap": paired(refined, cheap),
                "refined_joint_kl": refined["joint_kl"],
                "refined_fitness": refined_result["kl"],
                "refined_seed_fitness": refined_result["seed_kl"],
                "refined_seconds": refined_result["seconds"],
                "refined_window_forwards": refined_result["evaluations"],
                "refined_history": [h["kl"] for h in refined_result["history"]],
                "refined_accepted": sum(h["accepted"] for h in refined_result["history"]),
                "refined_targets": refined["targets"],
                "best_uniform_joint_kl": best_uniform["joint_kl"],
            }
        )
        row.update(
            {
                "searched_loss": float(searched["losses"].mean()),
                "searched_kept": {"params": searched["params"], "state": searched["state"]},
                "searched_targets": searched["targets"],
                "best_uniform_loss": float(best_uniform["losses"].mean()),
                "best_uniform_target": next(iter(best_uniform["targets"].values())),
                "uniform_evaluated": n_uniform,
                "uniform_by_sensitivity_loss": float(measured_uniform["losses"].mean()),
                "proxy_plan_loss": float(proxy_plan["losses"].mean()),
                "paired_gain": float(diff.mean()),
                "paired_se": float(diff.std(ddof=1) / math.sqrt(len(diff))),
                "predicted_kl": predicted,
                "measured_joint_kl": searched["joint_kl"],
            }
        )
        rows.append(row)
    return {
        "model": name,
        "corpus": corpus,
        "layers": len(layers),
        "shape": layers[0].shape.as_dict(),
        "candidates_per_layer": [len(c) for c in table],
        "base_loss": float(base.mean()),
        "seconds": {
            "score": float(np.median(scoring_passes)) if scoring_passes else score_seconds,
            "first_score": score_seconds,
            "scoring_passes": scoring_passes,
            "measured_sensitivity": measured_seconds,
            "proxy": proxy_seconds,
        },
        "forwards": measured["forwards"],
        "window_forwards": sum(len(layer.candidates) - 1 for layer in layers) * args.sensitivity_windows,
        "tokens": measured["tokens"],
        "proxy_spearman": {"per_layer": rho, "pooled": pooled},
        "rows": rows,
    }


def print_model(result: dict) -> None:
    s = result["shape"]
    print(
        f"\n{result['model']}: {result['layers']} GDN layers, Hk {s['num_key_heads']} Hv {s['num_value_heads']} "
        f"dk {s['key_head_dim']} dv {s['value_head_dim']}, corpus {result['corpus']}, "
        f"{result['candidates_per_layer'][0]} candidates/layer; unpruned validation loss {result['base_loss']:.4f}"
    )
    sec = result["seconds"]
    print(
        f"cost: scoring {sec['score']:.1f} s; measured sensitivity {sec['measured_sensitivity']:.1f} s "
        f"({result['forwards']} partial forwards on {result['tokens']} tokens); proxy {sec['proxy']:.3f} s; "
        f"proxy vs measured Spearman rho: pooled {result['proxy_spearman']['pooled']:.2f}, per layer "
        + ", ".join(f"{r:.2f}" for r in result["proxy_spearman"]["per_layer"])
    )
    header = (
        f"{'budget':<12} {'searched':>9} {'best unif':>9} {'gain':>8} {'± se':>7} {'unif(pred)':>10} "
        f"{'proxy plan':>10} {'pred KL':>8} {'joint KL':>8}  best uniform target"
    )
    print(header)
    print("-" * len(header))
    for row in result["rows"]:
        if "error" in row:
            print(f"{row['budget']:<12} {row['error']}")
            continue
        t = row["best_uniform_target"]
        print(
            f"{row['budget']:<12} {row['searched_loss']:9.4f} {row['best_uniform_loss']:9.4f} "
            f"{row['paired_gain']:8.4f} {row['paired_se']:7.4f} {row['uniform_by_sensitivity_loss']:10.4f} "
            f"{row['proxy_plan_loss']:10.4f} {row['predicted_kl']:8.4f} {row['measured_joint_kl']:8.4f}  "
            f"{t['num_key_heads']}/{t['num_value_heads']}/{t['key_head_dim']}/{t['value_head_dim']} "
            f"(of {row['uniform_evaluated']})"
        )
    score = sec["score"]
    print(
        f"\ncheap = successive halving (the default), refined = cheap + the joint refinement; "
        f"searched (measured) sensitivity: {sec['measured_sensitivity']:.0f} s = "
        f"{sec['measured_sensitivity'] / score:.0f}x scoring"
    )
    header = (
        f"{'budget':<12} {'cheap':>7} {'-searched':>15} {'fwd':>5} {'s':>5} {'xscore':>6} {'refined':>7} "
        f"{'-searched':>15} {'s':>5} {'wfwd':>5} {'jKL srch':>8} {'unif':>6} {'cheap':>6} {'refined':>7}"
    )
    print(header)
    print("-" * len(header))
    for row in result["rows"]:
        if "error" in row:
            continue
        c, r = row["cheap_minus_searched"], row["refined_minus_searched"]
        print(
            f"{row['budget']:<12} {row['cheap_loss']:7.4f} {c[0]:+8.4f}±{c[1]:.4f} {row['cheap_forwards']:5d} "
            f"{row['cheap_seconds']:5.0f} {row['cheap_seconds'] / score:6.1f} {row['refined_loss']:7.4f} "
            f"{r[0]:+8.4f}±{r[1]:.4f} {row['refined_seconds']:5.0f} {row['refined_window_forwards']:5d} "
            f"{row['measured_joint_kl']:8.4f} {row['best_uniform_joint_kl']:6.3f} {row['cheap_joint_kl']:6.3f} "
            f"{row['refined_joint_kl']:7.4f}"
        )


def print_halving(result: dict) -> None:
    """Issue 31's table: successive halving's variants (:data:`HALVING_VARIANTS`: unverified, verified as
    first merged, its pooled second version, the default; those of ``--halving-variants``) against the
    exact plan on the full measurement."""
    score, full = result["seconds"]["score"], result["window_forwards"]
    measured = result["seconds"]["measured_sensitivity"]
    passes = result["seconds"]["scoring_passes"]
    print(
        f"\nsuccessive halving against the exact plan (measured: {full} window forwards, {measured:.0f} s = "
        f"{measured / score:.1f}x scoring {score:.2f} s, the median of {len(passes)} scoring passes: "
        + ", ".join(f"{t:.2f}" for t in passes)
        + f"; the first pass {result['seconds']['first_score']:.2f} s)"
    )
    header = (
        f"{'budget':<12} {'exact':>7} | {'variant':<10} {'loss':>7} {'- exact ± se':>17} {'same':>5} "
        f"{'sumKL-ex':>8} {'fwd':>5} {'of full':>7} {'s':>5} {'xscore':>6} {'xlocal':>6} {'rounds':>6}"
    )
    print(header)
    print("-" * len(header))
    for row in result["rows"]:
        if "error" in row:
            continue
        for name, v in row["halving"].items():
            d = v["minus_searched"]
            exact_kl = row["predicted_kl"]
            print(
                f"{row['budget']:<12} {row['searched_loss']:7.4f} | {name:<10} {v['loss']:7.4f} "
                f"{d[0]:+8.4f}±{d[1]:.4f} {str(v['same_plan']):>5} {v['measured_kl'] - exact_kl:8.4f} "
                f"{v['forwards']:5d} {v['forwards'] / full:7.3f} {v['seconds']:5.0f} {v['seconds'] / score:6.1f} "
                f"{v['x_scoring_local'] or float('nan'):6.1f} {v['verify_rounds']:6d}"
            )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--deep", type=Path, default=None, help="folder of the deeper model (trained as above)")
    p.add_argument("--skip-bundled", action="store_true", help="only the --deep model")
    p.add_argument("--dim-step", default="1/4", help="head-dim grid (default 1/4)")
    p.add_argument("--calibration-windows", type=int, default=64, help="scoring windows of 256 bytes (64)")
    p.add_argument("--sensitivity-windows", type=int, default=16, help="of those, for the sensitivity (16)")
    p.add_argument("--validation-windows", type=int, default=32, help="held-out windows (32)")
    p.add_argument("--refine-generations", type=int, default=30, help="generations of the refinement (30)")
    p.add_argument("--refine-offspring", type=int, default=8, help="offspring per generation (8)")
    p.add_argument("--cache", type=Path, default=None, help="keep / reuse the measured sensitivity here")
    p.add_argument(
        "--models",
        type=Path,
        nargs="*",
        default=[],
        help="more model folders with a training.json (e.g. tests/data/trained/qwen3_next), run like --deep",
    )
    p.add_argument(
        "--skip-uniform",
        action="store_true",
        help="do not evaluate every uniform cut (the one --uniform picks stands in for the best)",
    )
    p.add_argument(
        "--budgets",
        type=parse_budgets,
        default=BUDGETS,
        help="the budgets to run, e.g. params:0.25,state:0.5 (default: "
        + ",".join(f"{k}:{v}" for k, v in BUDGETS)
        + "; to spread them over processes)",
    )
    p.add_argument(
        "--measure-only",
        action="store_true",
        help="only the full measurement (into --cache), no plans",
    )
    p.add_argument(
        "--halving-variants",
        nargs="+",
        choices=list(HALVING_VARIANTS),
        default=list(HALVING_VARIANTS),
        help="successive halving's variants to run side by side (default all; 'default' is always run)",
    )
    p.add_argument(
        "--scoring-passes",
        type=int,
        default=3,
        help="scoring passes timed before the plans, besides the first (which gives the scores); more are "
        "timed before and after every halving run; the median of them all is the denominator of every "
        "'x scoring' (default 3; 0: the first pass alone and no pass around the runs, as before issue 31)",
    )
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--quiet", action="store_true")
    args = p.parse_args(argv)
    if "default" not in args.halving_variants:
        args.halving_variants.append("default")  # the cheap plan of the other tables
    torch.set_num_threads(args.threads)
    print(f"load average {os.getloadavg()[0]:.1f}; torch threads {args.threads}; dim step {args.dim_step}")
    results = []
    if not args.skip_bundled:
        model, _ = demo_data.load_demo_model()
        results.append(run_model("bundled", model, "pydoc", args))
        if not args.measure_only:
            print_model(results[-1])
            print_halving(results[-1])
    for folder in ([] if args.deep is None else [args.deep]) + args.models:
        record = json.loads((folder / "training.json").read_text())
        model = load_pretrained(folder, dtype=torch.float32).eval()
        results.append(run_model(folder.name, model, record["corpus"].get("name", "pydoc"), args))
        if not args.measure_only:
            print_model(results[-1])
            print_halving(results[-1])
    print(f"\nload average at the end {os.getloadavg()[0]:.1f}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
