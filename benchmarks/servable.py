#!/usr/bin/env python
"""Servable plans and latency budgets (issue 30): what the latency model predicts, and what servability costs.

Part A, latency (a random Qwen3.5 where compute dominates: hidden 1024, 8 layers ``GGGA`` x 2, GDN 8 key
heads x 2 lanes of 128, attention 8/2 heads of 128, MLP 2048, vocab 1024, float32). Every candidate block
(GDN key-head counts, MLP widths in halves, attention head geometries, whole decoder layers) is timed
once per workload (prefill:1:128, decode:1:128) with ``gdnprune.model.latency`` (warm-up 1, median of 3) on this
machine; the model is random, so each candidate's sensitivity is the share of its group's parameters it
removes (the plans are only vehicles for the latency). For
three latency budgets the exact MILP chooses a plan (depth allowed); the table gives the additive prediction
(fixed part + the chosen blocks + the kept layers' rests) beside the measured latency of the whole cut model
(the chosen modules swapped in, removed layers taken out), and their ratio.

Part B, quality at equal parameters (the bundled demo model, byte-level: loss in nats/byte). Scores on 32
training windows of 256 bytes, sensitivities measured on ``--sensitivity-windows`` (16) of them
(``--sensitivity measured --dim-step 1/4`` by default), for each budget (fraction of all parameters) three plans: **heterogeneous** (the default search,
depth allowed), **servable** (``--servable``: one geometry per kind plus removed layers) and **best uniform**
(``--uniform``: one geometry per kind, every layer kept); each written by ``prune_checkpoint --plan`` (sorted,
sliced) and loaded back, its loss on 32 held-out windows (paired differences against the heterogeneous plan,
with standard errors).

    .venv/bin/python benchmarks/servable.py                 # both parts (about 5-10 min on 2 busy cores)
    .venv/bin/python benchmarks/servable.py --skip-latency  # part B only
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from fractions import Fraction
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "2")
REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "src"))
sys.path.insert(0, str(REPO / "benchmarks"))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from plans import window_losses  # noqa: E402
from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig  # noqa: E402

from gdnprune import demo_data  # noqa: E402
from gdnprune.io.loading import load_pretrained  # noqa: E402
from gdnprune.model.latency import parse_workload  # noqa: E402
from gdnprune.plan import plan_model  # noqa: E402
from gdnprune.plan.choose.solve import BudgetError  # noqa: E402
from gdnprune.plan.measure.latency_costs import add_latency_budget, cut_model_latency, measure_latency_costs  # noqa: E402
from gdnprune.plan.measure.problem import Grid, build_problem, check_feasible, given_budgets  # noqa: E402
from gdnprune.plan.report.results import Sensitivities  # noqa: E402
from gdnprune.plan.stages import choose_plan  # noqa: E402
from gdnprune.prune import prune_checkpoint  # noqa: E402
from gdnprune.scoring import score_model  # noqa: E402

LATENCY_BUDGETS = (0.8, 0.6, 0.4)
WORKLOADS = ("prefill:1:128", "decode:1:128")
QUALITY_BUDGETS = (0.75, 0.6)
SEQ = 256


def random_model() -> torch.nn.Module:
    """The compute-dominated random Qwen3.5 of part A."""
    config = Qwen3_5TextConfig(
        vocab_size=1024,
        hidden_size=1024,
        intermediate_size=2048,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=128,
        linear_num_key_heads=8,
        linear_num_value_heads=16,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        layer_types=["linear_attention"] * 3
        + ["full_attention"]
        + ["linear_attention"] * 3
        + ["full_attention"],
    )
    torch.manual_seed(0)
    return Qwen3_5ForCausalLM(config).eval()


def part_latency(args) -> list[dict]:
    """Predicted vs measured latency of the cut model at every latency budget and workload."""
    model = random_model()
    problem = build_problem(
        model,
        given_budgets({}),
        None,
        context=None,
        blocks=("gdn", "attention", "mlp", "depth"),
        grid=Grid(Fraction(1, 2), ("key_heads",)),
        orders_applied=True,
        uniform=False,
        latency=True,
    )
    # the model is random, so a measured KL would rank nothing: each candidate's "sensitivity" is the share of
    # its group's parameters it removes (the plans are only vehicles for the latency)
    full = [max(g) for g in problem.whole_costs["params"][: len(problem.groups)]]
    values = [[1.0 - c / f for c in g] for g, f in zip(problem.whole_costs["params"], full)]
    removal = {r.index: 1.0 for r in problem.rests}
    sens = Sensitivities(values=values, seconds=0.0, removal={i: (v, 0.0) for i, v in removal.items()})
    rows = []
    for text in args.workloads:
        workload = parse_workload(text)
        start = time.perf_counter()
        costs = measure_latency_costs(model, problem, workload, repeats=3, warmup=1, progress=False)
        timing = time.perf_counter() - start
        blocks = sum(len(g) for g in costs.groups) + len(costs.layers)
        for budget in args.latency_budgets:
            try:
                add_latency_budget(problem, costs, budget)
                check_feasible(problem, False)
            except BudgetError as exc:
                rows.append(dict(workload=text, budget=budget, error=str(exc)))
                continue
            choice = choose_plan(problem, sens, uniform=False)
            predicted = costs.predicted(choice.picks, choice.removed)
            measured = cut_model_latency(
                model, problem, choice.picks, choice.removed, workload, repeats=3, warmup=1
            )
            rows.append(
                dict(
                    workload=text,
                    budget=budget,
                    unpruned_ms=costs.whole * 1e3,
                    fixed_ms=costs.fixed * 1e3,
                    predicted_ms=predicted * 1e3,
                    measured_ms=measured * 1e3,
                    ratio=measured / predicted,
                    measured_speedup=costs.whole / measured,
                    removed=choice.removed,
                    timed_blocks=blocks,
                    timing_seconds=round(timing, 1),
                )
            )
            print(json.dumps(rows[-1]), flush=True)
    return rows


def _loss_of(plan: dict, src: Path, scores: Path, text: Path, validation: torch.Tensor) -> np.ndarray:
    """Held-out losses of ``plan`` applied through prune (sorted by ``scores``, sliced), loaded back."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "out"
        prune_checkpoint(src, text, out, plan=plan, scores=scores, progress=False)
        return window_losses(load_pretrained(out, dtype=torch.float32).eval(), validation)


def part_quality(args) -> list[dict]:
    """Heterogeneous, servable and best uniform plans at equal parameters on the demo model."""
    model, _ = demo_data.load_demo_model()
    calibration = demo_data.byte_windows(demo_data.train_text("pydoc"), SEQ, 32)
    validation = demo_data.byte_windows(demo_data.validation_text("pydoc"), SEQ, args.validation_windows)
    data = score_model(model, list(calibration.split(8)), progress=False)
    batches = list(calibration[: args.sensitivity_windows].split(4))
    base = window_losses(model, validation)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        src, text, scores = Path(tmp) / "model", Path(tmp) / "calib.txt", Path(tmp) / "scores.json"
        model.save_pretrained(src)
        for name in ("tokenizer.json", "tokenizer_config.json"):
            if (demo_data.demo_model_path() / name).exists():
                (src / name).write_bytes((demo_data.demo_model_path() / name).read_bytes())
        text.write_text(demo_data.train_text("pydoc")[:20000])
        scores.write_text(json.dumps(data))
        for budget in args.quality_budgets:
            common = dict(
                budget_params=budget, sensitivity="measured", dim_step=args.dim_step, progress=False
            )
            kinds = {
                "heterogeneous": dict(),
                "servable": dict(servable=True),
                "uniform": dict(uniform=True, blocks=("gdn", "attention", "mlp")),
            }
            losses = {}
            for kind, extra in kinds.items():
                start = time.perf_counter()
                plan, _ = plan_model(model, batches, str(scores), **common, **extra)
                seconds = time.perf_counter() - start
                losses[kind] = _loss_of(plan, src, scores, text, validation)
                totals = plan["totals"]
                rows.append(
                    dict(
                        budget=budget,
                        plan=kind,
                        params_fraction=totals["model_params_fraction"],
                        removed=plan["predicted"].get("removed_layers", []),
                        loss=float(losses[kind].mean()),
                        se=float(losses[kind].std(ddof=1) / np.sqrt(len(losses[kind]))),
                        minus_heterogeneous=float((losses[kind] - losses["heterogeneous"]).mean()),
                        paired_se=float(
                            (losses[kind] - losses["heterogeneous"]).std(ddof=1) / np.sqrt(len(losses[kind]))
                        ),
                        base_loss=float(base.mean()),
                        plan_seconds=round(seconds, 1),
                    )
                )
                print(json.dumps(rows[-1]), flush=True)
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--skip-latency", action="store_true")
    parser.add_argument("--skip-quality", action="store_true")
    parser.add_argument("--workloads", nargs="+", default=list(WORKLOADS))
    parser.add_argument("--latency-budgets", nargs="+", type=float, default=list(LATENCY_BUDGETS))
    parser.add_argument("--quality-budgets", nargs="+", type=float, default=list(QUALITY_BUDGETS))
    parser.add_argument("--validation-windows", type=int, default=32)
    parser.add_argument("--sensitivity-windows", type=int, default=16)
    parser.add_argument("--dim-step", default="1/4")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    result: dict = {}
    if not args.skip_latency:
        result["latency"] = part_latency(args)
        print(
            "\nworkload        budget  unpruned ms  predicted ms  measured ms  measured/predicted  speed-up"
        )
        for r in result["latency"]:
            if "error" in r:
                print(f"{r['workload']:<15} {r['budget']:<6}  {r['error']}")
                continue
            print(
                f"{r['workload']:<15} {r['budget']:<6}  {r['unpruned_ms']:11.1f}  {r['predicted_ms']:12.1f}  "
                f"{r['measured_ms']:11.1f}  {r['ratio']:18.3f}  {r['measured_speedup']:7.2f}x"
            )
    if not args.skip_quality:
        result["quality"] = part_quality(args)
        print("\nbudget  plan           params kept  removed  loss (nats/byte)    vs heterogeneous")
        for r in result["quality"]:
            print(
                f"{r['budget']:<6}  {r['plan']:<13}  {r['params_fraction']:11.1%}  {str(r['removed']):<7}  "
                f"{r['loss']:.4f} ± {r['se']:.4f}   {r['minus_heterogeneous']:+.4f} ± {r['paired_se']:.4f}"
            )
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
