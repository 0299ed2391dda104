#!/usr/bin/env python
"""The hidden size (issue 42): which order of the hidden channels, and does a plan that may cut the residual
width beat one that may not?

Two parts, each step cached in ``--work`` (a stopped run resumes where it was):

**Orders** (``--orders``): the hidden channels of every model scored on 64 training windows of 256 bytes, then
the model cut in memory to 3/4, 1/2 and 3/8 of its hidden size (nothing else cut) with the order of each
measure of :data:`gdnprune.scoring.payload.HIDDEN_MEASURES` (``activation`` is Minitron's mean magnitude of the
normalised activations summed over the norms), a loss-aware order (``taylor``: the squared gradient of the loss
with respect to a mask on the residual stream at the embedding and every layer output, summed over batches),
the identity order, the reversed default order and ``--random-orders`` random orders: the held-out loss
increase of each, and the share of random orders each beats.

**Plans** (default): at each budget (a fraction of ALL the model's parameters, embeddings included, as
``gdnprune plan --budget-params`` counts it), on ``--validation-windows`` held-out windows, one-shot and after
``--steps`` distillation steps (the recipe of ``benchmarks/_common.py``), with paired differences:

* **plan with hidden**: ``--blocks gdn,attention,mlp,hidden --dim-step 1/4`` (each hidden size of the default grid
  planned under the same budget, its whole cut model measured on 16 calibration windows, the least KL kept);
* **plan without hidden**: ``--blocks gdn,attention,mlp --dim-step 1/4``;
* **best uniform**: every maximal uniform cut of the widths (hidden size whole) within the budget, the best on
  the held-out windows (chosen on the windows it is scored on, which favours it);
* **hidden only**: the largest hidden size within the budget, every layer whole.

    nice -n 10 .venv/bin/python benchmarks/hidden.py --orders --threads 1
    nice -n 10 .venv/bin/python benchmarks/hidden.py --budgets 0.5,0.35 --validation-windows 128 --threads 1 \\
        --deep /work/models/deep_docstrings --json hidden.json
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

import numpy as np  # noqa: E402
import torch  # noqa: E402
from _common import RECIPE, SEQ, add_model_arguments, benchmark_models, load_average, paired, set_up  # noqa: E402
from after_recovery import StepLog  # noqa: E402
from plans import window_losses  # noqa: E402

from gdnprune import demo_data  # noqa: E402
from gdnprune.distill import DistillConfig, distill  # noqa: E402
from gdnprune.io.loading import slice_model  # noqa: E402
from gdnprune.model.hidden import hidden_shape  # noqa: E402
from gdnprune.model.subblock_surgery import find_model_hidden  # noqa: E402
from gdnprune.plan import PlanOptions  # noqa: E402
from gdnprune.plan.api import search  # noqa: E402
from gdnprune.plan.choose.solve import uniform_choices  # noqa: E402
from gdnprune.plan.hidden import search_hidden  # noqa: E402
from gdnprune.plan.measure.candidates import AXES, parse_dim_step  # noqa: E402
from gdnprune.plan.measure.hidden import absolute_budgets, hidden_cut_model  # noqa: E402
from gdnprune.plan.measure.problem import Grid, build_problem, given_budgets  # noqa: E402
from gdnprune.plan.rank import cut_model  # noqa: E402
from gdnprune.plan.report.results import Choice  # noqa: E402
from gdnprune.scoring import score_model  # noqa: E402
from gdnprune.scoring.api import measure_statistics  # noqa: E402
from gdnprune.scoring.payload import HIDDEN_MEASURES, hidden_scores  # noqa: E402

WIDTHS = ("gdn", "attention", "mlp")
PLANS = ("plan_with_hidden", "plan_without_hidden", "best_uniform", "hidden_only")


def parameters(model) -> int:
    """Every parameter once (a tied embedding and head count once)."""
    return sum(p.numel() for p in model.parameters())


class Bench:
    """One model: its windows, its scores (every kind, hidden channels included), and the cached steps."""

    def __init__(self, name: str, model, corpus: str, args):
        self.name, self.model, self.args = name, model, args
        self.work = args.work / name
        self.work.mkdir(parents=True, exist_ok=True)
        text = demo_data.train_text(corpus)
        self.train = demo_data.byte_windows(text, SEQ)
        self.calibration = demo_data.byte_windows(text, SEQ, 64)
        self.validation = demo_data.byte_windows(
            demo_data.validation_text(corpus), SEQ, args.validation_windows
        )
        self.total = parameters(model)
        self.hidden = hidden_shape(model.config).hidden_size
        self.base = window_losses(model, self.validation)
        self.scores = self.cached(
            "scores",
            lambda: score_model(
                model, list(self.calibration.split(8)), progress=False, blocks=[*WIDTHS, "hidden"]
            ),
        )

    def cached(self, key: str, make):
        path = self.work / f"{key}.pkl"
        if path.exists():
            return pickle.loads(path.read_bytes())
        value = make()
        part = path.with_name(f"{path.name}.{os.getpid()}.part")
        part.write_bytes(pickle.dumps(value))
        os.replace(part, path)
        return value

    def options(self, fraction: float, blocks) -> PlanOptions:
        return PlanOptions(budget_params=fraction, blocks=tuple(blocks), dim_step="1/4")

    def problem(self, model, options: PlanOptions):
        """The plan problem of ``options`` on ``model`` (no forward)."""
        return build_problem(
            model,
            given_budgets(options.keywords()),
            self.scores["layers"],
            context=None,
            blocks=[b for b in options.blocks if b != "hidden"],
            grid=Grid(parse_dim_step("1/4"), AXES),
            orders_applied=False,
            uniform=False,
        )

    def searched(self, fraction: float, with_hidden: bool) -> dict:
        """The plan search (cached): its picks, the hidden size it chose, its seconds. The search with hidden
        plans the full hidden size too, under the same budgets (as absolute amounts): the plan without hidden
        is that size's plan (``full_picks``), read from it where no search without hidden was cached."""
        blocks = (*WIDTHS, "hidden") if with_hidden else WIDTHS
        options = self.options(fraction, blocks)
        batches = list(self.calibration[:16].split(4))
        if not with_hidden and not (self.work / f"search_{fraction}_without.pkl").exists():
            found = self.searched(fraction, True)
            if "full_picks" in found:
                return {
                    "picks": found["full_picks"],
                    "hidden_size": self.hidden,
                    "hidden": None,
                    "seconds": None,
                }
        full: dict = {}

        def recording(small, *a, **k):
            done = search(small, *a, **k)
            if small is self.model:
                full["picks"] = list(done.choice.picks)
            return done

        def run():
            t0 = time.perf_counter()
            progress = not self.args.quiet
            if with_hidden:
                done = search_hidden(
                    self.model,
                    batches,
                    self.scores,
                    options,
                    recording,
                    tp=None,
                    multiple_of=None,
                    orders_applied=False,
                    progress=progress,
                )
            else:
                done = search(self.model, batches, self.scores, options, progress=progress)
            chosen = done.plan.get("hidden", {}).get("hidden_size", self.hidden)
            return {
                "picks": done.choice.picks,
                "hidden_size": chosen,
                "hidden": done.plan.get("hidden"),
                "seconds": time.perf_counter() - t0,
                **({"full_picks": full["picks"]} if "picks" in full else {}),
            }

        return self.cached(f"search_{fraction}_{'with' if with_hidden else 'without'}", run)

    def student(self, fraction: float, with_hidden: bool):
        """The cut model of a searched plan (the hidden-cut model's own problem when it cut the hidden size)."""
        found = self.searched(fraction, with_hidden)
        full = self.problem(self.model, self.options(fraction, WIDTHS))
        small = hidden_cut_model(self.model, self.scores, found["hidden_size"], orders_applied=False)
        problem = full
        if small is not self.model:
            problem = self.problem(
                small, PlanOptions(**{**self.options(fraction, WIDTHS).keywords(), **absolute_budgets(full)})
            )
        return cut_model(small, problem, Choice(picks=list(found["picks"])))

    def best_uniform(self, fraction: float) -> dict:
        """Every maximal uniform cut of the widths evaluated on the held-out windows; the best (cached)."""
        problem = self.problem(self.model, self.options(fraction, WIDTHS))

        def run():
            best = None
            choices = uniform_choices(problem.keys, problem.costs, problem.budgets, kinds=problem.kinds)
            for picks in choices:
                losses = window_losses(
                    cut_model(self.model, problem, Choice(picks=list(picks))), self.validation
                )
                if best is None or losses.mean() < best[1].mean():
                    best = (list(picks), losses)
            assert best is not None
            return {"picks": best[0], "evaluated": len(choices)}

        found = self.cached(f"uniform_{fraction}_{self.args.validation_windows}", run)
        return {**found, "model": lambda: cut_model(self.model, problem, Choice(picks=list(found["picks"])))}

    def hidden_only(self, fraction: float) -> tuple[int, object]:
        """The largest hidden size whose model (every layer whole) is within the budget."""
        residual = find_model_hidden(self.model)
        shapes = {n: tuple(p.shape) for n, p in self.model.named_parameters()}
        coupled = {n: s for n, s in shapes.items() if n in residual.rules}
        rest = sum(int(np.prod(s)) for n, s in shapes.items() if n not in residual.rules)
        limit = fraction * self.total
        size = max(
            k
            for k in range(1, self.hidden + 1)
            if rest + residual.parameters(coupled, residual.shape.replace(hidden_size=k)) <= limit
        )
        return size, lambda: slice_model(self.model, hidden_size=size, hidden_order=self.scores["hidden"])

    def recovered(self, fraction: float, name: str, key: str, build) -> dict:
        """One-shot and distilled per-window losses of a cut model (cached by ``key``)."""
        digest = hashlib.sha256(key.encode()).hexdigest()[:12]

        def run():
            student = build()
            kept = parameters(student)
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
                "fraction": kept / self.total,
                "distill_seconds": time.perf_counter() - t0,
            }

        out = self.cached(
            f"distilled_{fraction}_{digest}_{self.args.steps}_{self.args.validation_windows}", run
        )
        if not self.args.quiet:
            print(
                f"  {self.name} {fraction:.0%} {name}: kept {out['fraction']:.1%}  {out['before'].mean():.4f} -> {out['after'].mean():.4f}",
                flush=True,
            )
        return out


def run_budget(bench: Bench, fraction: float, plans=PLANS) -> dict:
    """The ``plans`` at one budget (each cached; a later run with every plan reads them back)."""
    with_hidden = bench.searched(fraction, True)
    without = bench.searched(fraction, False) if set(plans) - {"plan_with_hidden"} else None

    def uniform_build():
        assert without is not None
        uniform = bench.best_uniform(fraction)
        # the same cut as the plan without hidden (the plan may be uniform): the same cached run
        same = list(uniform["picks"]) == list(without["picks"])
        return f"{'without' if same else 'uniform'} {uniform['picks']}", uniform["model"]

    size, hidden_only = bench.hidden_only(fraction)
    # the plan kept the full hidden size and the picks of the plan without hidden: the same cut, the same run
    same = without is not None and with_hidden["hidden_size"] == bench.hidden
    same = same and list(with_hidden["picks"]) == list(without["picks"])  # type: ignore[index]
    builds = {
        "plan_with_hidden": lambda: (
            f"without {with_hidden['picks']}"
            if same
            else f"with {with_hidden['hidden_size']} {with_hidden['picks']}",
            lambda: bench.student(fraction, True),
        ),
        "plan_without_hidden": lambda: (
            f"without {without['picks']}",  # type: ignore[index]
            lambda: bench.student(fraction, False),
        ),
        "best_uniform": uniform_build,
        "hidden_only": lambda: (f"hidden only {size}", hidden_only),
    }
    results = {name: bench.recovered(fraction, name, *builds[name]()) for name in PLANS if name in plans}
    row = {
        "budget": fraction,
        "hidden_size": {
            "plan_with_hidden": with_hidden["hidden_size"],
            "hidden_only": size,
            "full": bench.hidden,
        },
        "hidden_candidates": with_hidden["hidden"],
        # without: None where it was the search with hidden's plan at the full size
        "search_seconds": {"with": with_hidden["seconds"], "without": without and without["seconds"]},
        "plans": {},
    }
    if "best_uniform" in results:
        row["uniform_evaluated"] = bench.best_uniform(fraction)["evaluated"]
    for name, r in results.items():
        entry = {
            "fraction": r["fraction"],
            "loss": float(r["before"].mean()),
            "loss_after": float(r["after"].mean()),
            "distill_seconds": r["distill_seconds"],
        }
        if name != "plan_with_hidden" and "plan_with_hidden" in results:
            entry["minus_with"] = paired(r["before"], results["plan_with_hidden"]["before"])
            entry["minus_with_after"] = paired(r["after"], results["plan_with_hidden"]["after"])
        row["plans"][name] = entry
    return row


def print_row(bench: Bench, row: dict) -> None:
    print(f"\n{bench.name} {row['budget']:.0%} of the parameters; hidden sizes {row['hidden_size']}")
    for name, e in row["plans"].items():
        line = f"  {name:<20} kept {e['fraction']:6.1%}  {e['loss']:.4f} -> {e['loss_after']:.4f}"
        if "minus_with_after" in e:
            (d0, s0), (d, s) = e["minus_with"], e["minus_with_after"]
            line += f"  − with hidden: one-shot {d0:+.4f} ± {s0:.4f}, after {d:+.4f} ± {s:.4f} ({d / s if s else 0:+.1f} SE)"
        print(line, flush=True)


# ---- orders --------------------------------------------------------------------------------------------


def taylor_order(model, batches) -> torch.Tensor:
    """Loss-aware: the squared gradient of the next-token loss with respect to a mask (ones) on the residual
    stream at the embedding output and every decoder layer's output, summed over batches; descending."""
    hidden = hidden_shape(model.config).hidden_size
    mask = torch.ones(hidden, requires_grad=True)
    decoder = model.get_decoder()
    hooks = [decoder.embed_tokens.register_forward_hook(lambda m, a, out: out * mask)]
    for layer in decoder.layers:
        hooks.append(
            layer.register_forward_hook(
                lambda m, a, out: (out[0] * mask, *out[1:]) if isinstance(out, tuple) else out * mask
            )
        )
    score = torch.zeros(hidden, dtype=torch.float64)
    try:
        for ids in batches:
            loss = model(input_ids=ids, labels=ids).loss
            (grad,) = torch.autograd.grad(loss, mask)
            score += grad.double().pow(2)
    finally:
        for h in hooks:
            h.remove()
    return torch.sort(score, descending=True, stable=True).indices


def run_orders(bench: Bench, args) -> dict:
    model = bench.model
    batches = list(bench.calibration.split(8))

    def stats():
        return measure_statistics(model, batches, progress=False, blocks=["gdn", "hidden"]).hidden.stats

    sums = bench.cached("hidden_statistics", stats)
    orders = {
        m: torch.sort(hidden_scores(sums, m), descending=True, stable=True).indices for m in HIDDEN_MEASURES
    }
    orders["taylor"] = bench.cached("taylor_order", lambda: taylor_order(model, batches))
    orders["identity"] = torch.arange(bench.hidden)
    orders["reversed activation"] = orders["activation"].flip(0)
    g = torch.Generator().manual_seed(0)
    randoms = [torch.randperm(bench.hidden, generator=g) for _ in range(args.random_orders)]
    base = float(bench.base.mean())

    def loss(order, size):
        return (
            float(
                window_losses(
                    slice_model(model, hidden_size=size, hidden_order={"channels": order}), bench.validation
                ).mean()
            )
            - base
        )

    rows = []
    for frac in (0.75, 0.5, 0.375):
        size = int(round(bench.hidden * frac))

        def measure(size=size):
            row = {"hidden_size": size, **{name: loss(o, size) for name, o in orders.items()}}
            row["random"] = [loss(o, size) for o in randoms]
            return row

        row = bench.cached(f"orders_{size}_{args.random_orders}_{args.validation_windows}", measure)
        row["activation, rescaled norms"] = bench.cached(
            f"rescaled_{size}_{args.validation_windows}",
            lambda size=size: (
                float(
                    window_losses(
                        slice_model(
                            model, hidden_size=size, hidden_order=bench.scores["hidden"], rescale_norms=True
                        ),
                        bench.validation,
                    ).mean()
                )
                - base
            ),
        )
        rows.append(row)
        rnd = row["random"]
        print(
            f"\n{bench.name}: hidden {size} of {bench.hidden}; random {np.mean(rnd):+.4f} ± {np.std(rnd):.4f} (n={len(rnd)})"
        )
        for name in [*orders, "activation, rescaled norms"]:
            beats = sum(v > row[name] for v in rnd) / len(rnd)
            print(f"  {name:<20} {row[name]:+.4f}  beats {beats:.0%} of random", flush=True)
    return {"base_loss": base, "rows": rows}


def plot(paths: list[Path], out: Path) -> None:
    """The plans' search, per model and budget: the whole cut model's KL (calibration windows) at each hidden
    size tried, the size chosen marked."""
    from gdnprune.runtime.figures import new_figure

    records = [m for p in paths for m in json.loads(p.read_text())]
    fig = new_figure(figsize=(6.4, 3.6), dpi=110)
    if fig is None:
        print("no matplotlib: no plot")
        return
    ax = fig.subplots()
    for m in records:
        for row in m.get("rows", []):
            tried = [c for c in row["hidden_candidates"]["candidates"] if c.get("feasible")]
            x = [c["hidden_size"] / m["hidden_size"] for c in tried]
            line = ax.plot(x, [c["kl"] for c in tried], marker="o", label=f"{m['model']} {row['budget']:.0%}")
            chosen = row["hidden_size"]["plan_with_hidden"]
            best = next(c for c in tried if c["hidden_size"] == chosen)
            ax.plot([chosen / m["hidden_size"]], [best["kl"]], marker="*", ms=14, color=line[0].get_color())
    ax.set_xlabel("hidden size kept (fraction of the full size)")
    ax.set_ylabel("KL of the whole cut model (nats/token)")
    ax.set_title("Plan at each hidden size: the least KL is kept (star)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_arguments(p)
    p.add_argument("--orders", action="store_true", help="the order comparison instead of the plans")
    p.add_argument("--random-orders", type=int, default=20)
    p.add_argument("--steps", type=int, default=300, help="distillation steps (300)")
    p.add_argument(
        "--plans",
        type=lambda v: [x for x in v.split(",") if x],
        default=list(PLANS),
        help=f"which of {','.join(PLANS)} to run (default all; a later run reads the cached ones back)",
    )
    p.add_argument("--work", type=Path, default=REPO / "benchmarks" / "_work" / "hidden")
    p.add_argument("--plot", nargs=2, metavar=("PNG", "JSON,..."), help="draw the plans' searches and exit")
    p.set_defaults(budgets=[0.5, 0.35])
    args = p.parse_args(argv)
    if args.plot:
        plot([Path(v) for v in args.plot[1].split(",")], Path(args.plot[0]))
        return 0
    set_up(args)
    print(
        f"load average {load_average():.1f}; torch threads {args.threads}; distillation {args.steps} steps, {RECIPE}"
    )
    results = []
    for spec in benchmark_models(args):
        bench = Bench(spec.name, spec.load(), spec.corpus, args)
        record = {
            "model": spec.name,
            "params": bench.total,
            "hidden_size": bench.hidden,
            "base_loss": float(bench.base.mean()),
        }
        if args.orders:
            record["orders"] = run_orders(bench, args)
        else:
            record["rows"] = []
            for fraction in args.budgets:
                record["rows"].append(run_budget(bench, fraction, args.plans))
                print_row(bench, record["rows"][-1])
                if args.json:
                    args.json.write_text(json.dumps(results + [record], indent=1, default=float))
        results.append(record)
        if args.json:
            args.json.write_text(json.dumps(results, indent=1, default=float))
    print(f"\nload average at the end {load_average():.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
