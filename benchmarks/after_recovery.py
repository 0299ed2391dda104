#!/usr/bin/env python
"""Plans after recovery (issue 31): does the searched plan, or the plan ranked by a short distillation, beat
the best uniform cut once all of them are distilled the same way?

For each model (the bundled demo model; ``--deep FOLDER``: the deeper benchmark model of
``benchmarks/whole_model.py``) and budget (a fraction of the **decoder's** parameters, as in
``whole_model.py``), it scores every block (64 training windows of 256 bytes), searches the plan as
``gdnprune plan --budget-params --blocks gdn,attention,mlp --dim-step 1/4`` does (the default sensitivity,
successive halving, on 16 of those windows), and compares on ``--validation-windows`` held-out windows:

* **one-shot MILP**: the exact choice over the measured sensitivities (``plan`` without ranking);
* **ranked**: ``--rank-by-distill K --rank-steps S``: the MILP's K best distinct plans and the best uniform
  cut under the same budget (:func:`gdnprune.plan.rank.candidate_plans`), each distilled S steps on 24
  training windows and measured on 8 others (:func:`gdnprune.plan.rank.rank_by_distill`), the least held-out
  KL kept;
* **best uniform**: every maximal uniform cut (one geometry per kind of block) within the budget, evaluated
  on the held-out windows, the best kept (chosen on the windows it is scored on, which favours it);
* ``--also-sensitivity NAME``: a column for another sensitivity of the plan search (the hook for
  ``--sensitivity bld``, issue 31's blockwise local distillation, where it exists);
* each after ``--steps`` distillation steps from the unpruned model with one recipe for all
  (:func:`gdnprune.distill.distill`: forward KL, batch 4 x 256 bytes, AdamW lr 1e-3, cosine after 3 % warmup,
  seed 0; the ranking's short runs use the same recipe).

Paired differences over the held-out windows (mean ± standard error). Each step's result is cached in
``--work`` (scores, each budget's search, each distilled model's per-window losses), so a run that is stopped
resumes where it was.

    .venv/bin/python benchmarks/after_recovery.py --budgets 0.5 --json after.json
    .venv/bin/python benchmarks/after_recovery.py --skip-bundled --deep benchmarks/_work/models/deep_docstrings
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import pickle
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "src"))
sys.path.insert(0, str(REPO / "benchmarks"))

from _common import RECIPE, SEQ, add_model_arguments, benchmark_models, load_average, paired, set_up  # noqa: E402
from plans import window_losses  # noqa: E402
from transformers import TrainerCallback  # noqa: E402

from gdnprune import demo_data  # noqa: E402
from gdnprune.distill import DistillConfig, distill  # noqa: E402
from gdnprune.plan import PlanOptions  # noqa: E402
from gdnprune.plan.api import search  # noqa: E402
from gdnprune.plan.choose.solve import uniform_choices  # noqa: E402
from gdnprune.plan.measure.candidates import AXES, parse_dim_step  # noqa: E402
from gdnprune.plan.measure.problem import Grid, build_problem, given_budgets  # noqa: E402
from gdnprune.plan.rank import candidate_plans, cut_model, rank_by_distill, rank_recipe  # noqa: E402
from gdnprune.plan.report.results import Choice  # noqa: E402
from gdnprune.scoring import score_model  # noqa: E402

BLOCKS = ("gdn", "attention", "mlp")


class StepLog(TrainerCallback):
    """A line every ``every`` steps of a long distillation (the log shows how far a run got)."""

    def __init__(self, label: str, every: int):
        self.label, self.every, self.start = label, every, time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step % self.every == 0:
            seconds = time.perf_counter() - self.start
            print(
                f"    {self.label}: step {state.global_step}/{state.max_steps} ({seconds:.0f} s)", flush=True
            )
        return control


class Bench:
    """One model: its windows, scores (cached), and per budget the cached searches and distilled losses."""

    def __init__(self, name: str, model, corpus: str, args):
        self.name, self.model, self.args = name, model, args
        self.work = args.work / name
        self.work.mkdir(parents=True, exist_ok=True)
        train = demo_data.byte_windows(demo_data.train_text(corpus), SEQ)
        self.calibration = demo_data.byte_windows(demo_data.train_text(corpus), SEQ, 64)
        self.train = train
        self.validation = demo_data.byte_windows(
            demo_data.validation_text(corpus), SEQ, args.validation_windows
        )
        self.decoder = sum(p.numel() for p in model.model.layers.parameters())
        self.total = sum(p.numel() for p in model.parameters())
        self.base = window_losses(model, self.validation)

        def scored():
            t0 = time.perf_counter()
            scores = score_model(model, list(self.calibration.split(8)), progress=False, blocks=list(BLOCKS))
            return scores, time.perf_counter() - t0

        self.scores, self.score_seconds = self.cached("scores", scored)

    def budget_params(self, fraction: float) -> float:
        """The whole-model parameter budget that keeps ``fraction`` of the decoder (the rest kept whole)."""
        return fraction * self.decoder + (self.total - self.decoder)

    def cached(self, key: str, make):
        path = self.work / f"{key}.pkl"
        if path.exists():
            return pickle.loads(path.read_bytes())
        value = make()
        part = path.with_name(
            f"{path.name}.{os.getpid()}.part"
        )  # processes of other budgets share the folder
        part.write_bytes(pickle.dumps(value))
        os.replace(part, path)
        return value

    def searched(self, fraction: float, sensitivity: str):
        """The plan search (problem, sensitivities, exact choice) at ``fraction``; its measurement is cached."""
        options = PlanOptions(
            budget_params=self.budget_params(fraction), blocks=BLOCKS, sensitivity=sensitivity, dim_step="1/4"
        )
        batches = list(self.calibration[:16].split(4))

        def run():
            t0 = time.perf_counter()
            done = search(self.model, batches, self.scores, options, progress=not self.args.quiet)
            return {"sens": done.sens, "picks": done.choice.picks, "seconds": time.perf_counter() - t0}

        stored = self.cached(f"search_{fraction}_{sensitivity}", run)
        # the problem again (no forward): the cached measurement is of exactly these groups and candidates
        problem = self.problem(options)
        return problem, stored["sens"], Choice(picks=stored["picks"]), stored["seconds"]

    def problem(self, options: PlanOptions):
        """The plan problem of ``options`` on the whole-model grid (no forward)."""
        return build_problem(
            self.model,
            given_budgets(options.keywords()),
            self.scores["layers"],
            context=None,
            blocks=BLOCKS,
            grid=Grid(parse_dim_step("1/4"), AXES),
            orders_applied=False,
            uniform=False,
        )

    def ranked(self, fraction: float, problem, sens, choice):
        """The ranking (cached): K best MILP plans + the best uniform cut, S steps each."""
        args = self.args

        def told(cost) -> None:
            if cost.estimate_seconds is not None:
                print(
                    f"  {self.name} {fraction:.0%} ranking: {cost.candidates} plans x {cost.steps} steps, "
                    f"estimated {cost.estimate_seconds:.0f} s after the first step",
                    flush=True,
                )

        def run():
            windows = self.calibration[16:48]
            train, heldout = windows[:24], windows[24:]
            candidates = candidate_plans(problem, sens, choice, args.rank_by_distill)
            recipe = rank_recipe(args.rank_steps, RECIPE["lr"], 4, int(heldout.shape[0]))
            ranking = rank_by_distill(
                self.model, problem, candidates, train, heldout, recipe, on_cost=None if args.quiet else told
            )
            return {"ranking": ranking.as_dict(), "winner_picks": ranking.best.choice.picks}

        return self.cached(f"ranked_{fraction}_{args.rank_by_distill}x{args.rank_steps}", run)

    def best_uniform(self, fraction: float, problem):
        """Every maximal uniform cut evaluated on the held-out windows; the best (cached)."""

        def run():
            t0 = time.perf_counter()
            best = None
            choices = uniform_choices(problem.keys, problem.costs, problem.budgets, kinds=problem.kinds)
            for picks in choices:
                losses = window_losses(
                    cut_model(self.model, problem, Choice(picks=list(picks))), self.validation
                )
                if best is None or losses.mean() < best[1].mean():
                    best = (list(picks), losses)
            assert best is not None
            return {"picks": best[0], "evaluated": len(choices), "seconds": time.perf_counter() - t0}

        return self.cached(f"uniform_{fraction}_{self.args.validation_windows}", run)

    def recovered(self, fraction: float, name: str, problem, picks):
        """One-shot and distilled per-window losses of a plan (cached by plan)."""
        digest = hashlib.sha256(json.dumps(picks).encode()).hexdigest()[:12]
        key = f"distilled_{fraction}_{digest}_{self.args.steps}_{self.args.validation_windows}"

        def run():
            student = cut_model(self.model, problem, Choice(picks=list(picks)))
            kept = sum(p.numel() for p in student.model.layers.parameters())
            before = window_losses(student, self.validation)
            t0 = time.perf_counter()
            student.train()
            for p in student.parameters():
                p.requires_grad_(True)
            config = DistillConfig(steps=self.args.steps, log_every=self.args.steps, progress=False, **RECIPE)
            log = (
                []
                if self.args.quiet
                else [StepLog(f"{self.name} {fraction:.0%} {name}", max(1, self.args.steps // 6))]
            )
            distill(student, self.model, self.train, config, callbacks=log)
            after = window_losses(student.eval(), self.validation)
            return {
                "before": before,
                "after": after,
                "decoder_fraction": kept / self.decoder,
                "distill_seconds": time.perf_counter() - t0,
            }

        out = self.cached(key, run)
        if not self.args.quiet:
            print(
                f"  {self.name} {fraction:.0%} {name}: {out['before'].mean():.4f} -> {out['after'].mean():.4f}",
                flush=True,
            )
        return out


def run_budget(bench: Bench, fraction: float, args) -> dict:
    problem, sens, choice, search_seconds = bench.searched(fraction, "halving")
    uniform = bench.best_uniform(fraction, problem)
    # the comparison the targets rest on comes first (a run stopped during the ranking still has it)
    early = {
        "one_shot": bench.recovered(fraction, "one_shot", problem, choice.picks),
        "best_uniform": bench.recovered(fraction, "best_uniform", problem, uniform["picks"]),
    }
    if not args.quiet:
        d, s = paired(early["best_uniform"]["after"], early["one_shot"]["after"])
        print(
            f"  {bench.name} {fraction:.0%} best uniform − one-shot MILP, after: {d:+.4f} ± {s:.4f}",
            flush=True,
        )
    plans = {"one_shot": choice.picks, "best_uniform": uniform["picks"]}
    costs = {
        "one_shot": {"search_seconds": search_seconds},
        "best_uniform": {"evaluated": uniform["evaluated"], "seconds": uniform["seconds"]},
    }
    ranking = None
    if args.rank_by_distill:  # 0: no ranking (the other plans only)
        ranked = bench.ranked(fraction, problem, sens, choice)
        ranking = ranked["ranking"]
        plans["ranked"] = ranked["winner_picks"]
        costs["ranked"] = {
            "search_seconds": search_seconds,
            "ranking_seconds": ranking["seconds"],
            "ranking_steps": ranking["cost"]["total_steps"],
        }
    for name in args.also_sensitivity:
        p, s, c, seconds = bench.searched(fraction, name)
        plans[name] = c.picks
        costs[name] = {"search_seconds": seconds}
    results = {name: bench.recovered(fraction, name, problem, picks) for name, picks in plans.items()}
    row = {"budget": fraction, "ranking": ranking, "plans": {}}
    for name, r in results.items():
        entry = {
            "decoder_fraction": r["decoder_fraction"],
            "loss": float(r["before"].mean()),
            "loss_after": float(r["after"].mean()),
            "distill_seconds": r["distill_seconds"],
            "same_plan_as": [o for o in plans if o != name and plans[o] == plans[name]],
            "cost": costs[name],
        }
        for ref in ("one_shot", "ranked"):
            if ref != name and ref in results:
                entry[f"minus_{ref}"] = paired(r["before"], results[ref]["before"])
                entry[f"minus_{ref}_after"] = paired(r["after"], results[ref]["after"])
        row["plans"][name] = entry
    return row


def print_row(bench: Bench, row: dict) -> None:
    r = row["ranking"]
    ranking = f"winner {r['winner']} ({r['seconds']:.0f} s)" if r else "none (--rank-by-distill 0)"
    print(f"\n{bench.name} {row['budget']:.0%} of the decoder; ranking: {ranking}")
    for p in r["plans"] if r else []:
        print(
            f"   {p['name']:<8} summed KL {p['summed_sensitivity']:.4f}  held-out KL one-shot {p['one_shot_kl']:.4f}"
            f"  after {r['steps']} steps {p['recovered_kl']:.4f}"
        )
    for name, e in row["plans"].items():
        line = f"  {name:<13} kept {e['decoder_fraction']:6.1%}  {e['loss']:.4f} -> {e['loss_after']:.4f}"
        for ref in ("one_shot", "ranked"):
            if f"minus_{ref}_after" in e:
                d, s = e[f"minus_{ref}_after"]
                line += f"  after − {ref}: {d:+.4f} ± {s:.4f} ({d / s if s else 0:+.1f} SE)"
        print(line + (f"  (same plan as {e['same_plan_as']})" if e["same_plan_as"] else ""))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_arguments(p)
    p.add_argument(
        "--rank-by-distill",
        type=int,
        default=4,
        help="MILP plans ranked (default 4, + uniform; 0: no ranking)",
    )
    p.add_argument("--rank-steps", type=int, default=50, help="distillation steps per ranked plan (50)")
    p.add_argument("--steps", type=int, default=300, help="distillation steps of the final comparison (300)")
    p.add_argument(
        "--also-sensitivity",
        type=lambda t: [v for v in t.split(",") if v],
        default=[],
        help="other plan sensitivities to compare (e.g. bld where it exists)",
    )
    p.add_argument("--work", type=Path, default=REPO / "benchmarks" / "_work" / "after_recovery")
    args = p.parse_args()
    set_up(args)
    print(
        f"load average {load_average():.1f}; torch threads {args.threads}; ranking {args.rank_by_distill} "
        f"MILP plans + uniform x {args.rank_steps} steps; final distillation {args.steps} steps, {RECIPE}"
    )
    results = []
    for spec in benchmark_models(args):
        name = spec.name
        bench = Bench(name, spec.load(), spec.corpus, args)
        rows = []
        for fraction in args.budgets:
            rows.append(run_budget(bench, fraction, args))
            print_row(bench, rows[-1])
            results_model = {
                "model": name,
                "params": bench.total,
                "decoder_params": bench.decoder,
                "base_loss": float(bench.base.mean()),
                "score_seconds": bench.score_seconds,
                "recipe": RECIPE,
                "steps": args.steps,
                "rows": rows,
            }
            if args.json:
                args.json.write_text(json.dumps(results + [results_model], indent=1))
        results.append(results_model)
    print(f"\nload average at the end {load_average():.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
