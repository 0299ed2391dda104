#!/usr/bin/env python
"""The BLD plan of ``benchmarks/after_recovery.py`` at several budgets from one BLD measurement (issue 31).

``after_recovery.py --also-sensitivity bld`` searches the plan with ``--sensitivity bld`` at each budget; the
BLD sensitivity of a candidate does not depend on the budget (every candidate of the same grid is trained and
measured alike), so this script measures it once, at the first budget, through ``after_recovery``'s own
:class:`Bench` (same model, scores, windows and options), then makes the exact choice at every other budget
from the same sensitivities and stores each as the search ``after_recovery.py`` would have cached
(``search_{budget}_bld.pkl`` in its ``--work`` folder; ``seconds``: the one measurement's). Then

    python benchmarks/bld_after_recovery.py --budgets 0.5,0.35,0.75
    python benchmarks/after_recovery.py --budgets 0.5 --also-sensitivity bld --json after_50.json

distils the BLD plan and compares it with the others; ``--report`` then prints, from the cached results
alone (no forward), every plan's losses and the BLD plan's paired differences with each of the others
(``after_recovery.py`` prints them against the one-shot MILP and ranked plans only).

    python benchmarks/bld_after_recovery.py --budgets 0.5,0.35,0.75 --report

It takes ``after_recovery.py``'s model options (``--deep FOLDER --skip-bundled``, ``--validation-windows``,
``--threads``), so the same cache folder serves both.
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

from _common import add_model_arguments, benchmark_models, load_average, set_up  # noqa: E402
from after_recovery import BLOCKS, Bench, paired  # noqa: E402

from gdnprune.plan import PlanOptions  # noqa: E402
from gdnprune.plan.stages import choose_plan  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_arguments(p)
    p.add_argument("--work", type=Path, default=REPO / "benchmarks" / "_work" / "after_recovery")
    p.add_argument("--steps", type=int, default=300, help="distillation steps of the runs to report (300)")
    p.add_argument("--report", action="store_true", help="print the cached comparison; measure nothing")
    args = p.parse_args()
    models = benchmark_models(args)
    if args.report:
        return report(args, [m.name for m in models])
    set_up(args)
    print(f"load average {load_average():.1f}", flush=True)
    for spec in models:
        measure(Bench(spec.name, spec.load(), spec.corpus, args), args.budgets)
    return 0


def measure(bench: Bench, budgets: list[float]) -> None:
    """The BLD sensitivities once, at the first budget; the exact choice from them at every other."""
    first, *rest = budgets
    t0 = time.perf_counter()
    problem, sens, choice, seconds = bench.searched(first, "bld")
    print(
        f"BLD at {first:.0%}: {seconds:.0f} s = {seconds / bench.score_seconds:.1f}x the scoring pass",
        flush=True,
    )
    groups = [(g.prefix, list(g.candidates)) for g in problem.groups]
    for fraction in rest:
        path = bench.work / f"search_{fraction}_bld.pkl"
        options = PlanOptions(budget_params=bench.budget_params(fraction), blocks=BLOCKS, dim_step="1/4")
        other = bench.problem(options)
        if [(g.prefix, list(g.candidates)) for g in other.groups] != groups:
            raise SystemExit(f"the candidates at {fraction} differ from those at {first}: measure it alone")
        picks = choose_plan(other, sens, uniform=False).picks
        path.write_bytes(
            pickle.dumps({"sens": sens, "picks": picks, "seconds": seconds, "measured_at": first})
        )
        print(f"BLD plan at {fraction:.0%} from the same sensitivities: {picks}", flush=True)
    print(f"{time.perf_counter() - t0:.0f} s; load average at the end {load_average():.1f}")


def report(args: argparse.Namespace, names: list[str]) -> int:
    """The cached plans and distilled losses of each budget: losses, and the BLD plan minus each other plan."""
    for name in names:
        print(name)
        report_model(args, args.work / name)
    return 0


def report_model(args: argparse.Namespace, work: Path) -> None:
    """:func:`report` for one model's cache folder."""

    def load(key: str):
        path = work / f"{key}.pkl"
        return pickle.loads(path.read_bytes()) if path.exists() else None

    for fraction in args.budgets:
        plans = {
            "one_shot": (load(f"search_{fraction}_halving") or {}).get("picks"),
            "ranked": (load(f"ranked_{fraction}_4x50") or {}).get("winner_picks"),
            "best_uniform": (load(f"uniform_{fraction}_{args.validation_windows}") or {}).get("picks"),
            "bld": (load(f"search_{fraction}_bld") or {}).get("picks"),
        }
        runs = {}
        for name, picks in plans.items():
            if picks is not None:
                digest = hashlib.sha256(json.dumps(picks).encode()).hexdigest()[:12]
                runs[name] = load(f"distilled_{fraction}_{digest}_{args.steps}_{args.validation_windows}")
        print(f"{fraction:.0%} of the decoder")
        for name, run in runs.items():
            if run is None:
                print(f"  {name:<13} not distilled yet")
                continue
            line = f"  {name:<13} kept {run['decoder_fraction']:6.1%}  {run['before'].mean():.4f} -> "
            line += f"{run['after'].mean():.4f}  ({run['distill_seconds']:.0f} s)"
            if name != "bld" and runs.get("bld") is not None:
                for when in ("before", "after"):
                    d, se = paired(runs["bld"][when], run[when])
                    line += f"  bld − this {when}: {d:+.4f} ± {se:.4f} ({d / se if se else 0:+.1f} SE)"
            print(line)


if __name__ == "__main__":
    sys.exit(main())
