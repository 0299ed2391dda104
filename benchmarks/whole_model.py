#!/usr/bin/env python
"""Whole-model plans (issue 21) and depth in the plan (issue 23): what the searched plan buys over simpler
cuts of the same size, before and after distillation.

For each model (the bundled demo model; ``--deep``: the deeper benchmark model) it scores every sub-block
(``score_model(...)``, every kind by default: GDN layers, attention heads, MLP channels) on 64 training windows of 256
bytes, measures the sensitivity of every candidate of every group once (the KL from the unpruned model with
that group alone cut, on 16 of those windows; GDN grid ``--dim-step 1/4``, MLP widths in quarters, every
attention head geometry) and, with ``--depth``, the sensitivity of removing each decoder layer. Then for
every budget, a fraction of the **decoder's** parameters (embeddings and final norm excluded; the fraction
is of everything inside the decoder layers), it compares on held-out windows:

* **searched**: the exact MILP over every group (what ``gdnprune plan --budget-params`` chooses from the
  measured sensitivity, ``--sensitivity measured --blocks gdn,attention,mlp``);
* **GDN-only**: the same MILP with only the GDN layers allowed to shrink (``--blocks gdn``), where one meets
  the budget;
* **best uniform**: the best cut with ONE geometry per kind (all GDN layers alike, all MLPs alike, all
  attention layers alike), found by evaluating the held-out loss of every maximal uniform combination
  within the budget (maximal: no kind can take a larger nested geometry and still fit; the held-out
  windows choose it, which favours it);
* with ``--depth`` (budgets 75 % and 50 %): **depth allowed** (the MILP with a removal candidate for every
  decoder layer, :func:`gdnprune.plan.choose.depth.choose_with_removal`) and **best depth-only** (every set of
  removed layers that fits, at full width otherwise, evaluated on the held-out windows; the best kept);
* each of them again after ``--steps`` steps of distillation from the unpruned model with one recipe for
  all (``gdnprune.distill.distill``: KD, batch 4 x 256 bytes, lr 1e-3, 3 % warmup, cosine, seed 0).

Paired differences (comparison − searched; positive: the searched plan is better) with standard errors
over the held-out windows. ``--cache FILE`` keeps the measured sensitivities (the slowest part) and reuses
them; the GDN part is stored under the same key as ``benchmarks/plans.py`` uses, so either script reuses
the other's measurement of the same model.

    .venv/bin/python benchmarks/whole_model.py --threads 1 --cache benchmarks/_work/measured.json --json whole.json
    .venv/bin/python benchmarks/whole_model.py --skip-bundled --deep benchmarks/_work/models/deep_docstrings --depth
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import tempfile
import time
from fractions import Fraction
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "src"))
sys.path.insert(0, str(REPO / "benchmarks"))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from _common import (  # noqa: E402
    RECIPE,
    SEQ,
    add_model_arguments,
    benchmark_models,
    load_average,
    paired,
    set_up,
)
from plans import spearman, window_losses  # noqa: E402

from gdnprune import demo_data  # noqa: E402
from gdnprune.distill import DistillConfig, distill  # noqa: E402
from gdnprune.io.loading import load_pretrained, slice_model  # noqa: E402
from gdnprune.model.geometry import GDNShape, orders_from_payload  # noqa: E402
from gdnprune.model.layouts import detect_layout, find_gdn_modules  # noqa: E402
from gdnprune.model.subblock_shapes import AttentionShape  # noqa: E402
from gdnprune.plan import BudgetError, choose, layer_candidates  # noqa: E402
from gdnprune.plan.choose.depth import choose_with_removal, removal_sensitivity  # noqa: E402
from gdnprune.plan.measure.sensitivity import LayerToPlan, measured_sensitivity  # noqa: E402
from gdnprune.plan.measure.subblocks import plannable_blocks, whole_model_costs  # noqa: E402
from gdnprune.scoring import score_model  # noqa: E402
from gdnprune.scoring.experts import block_influence  # noqa: E402

DEPTH_BUDGETS = (0.75, 0.5)


def contains(big, small) -> bool:
    """``small`` is a nested prefix of ``big`` (every axis at most as large)."""
    if isinstance(big, GDNShape):
        return (
            big.num_key_heads >= small.num_key_heads
            and big.value_heads_per_group >= small.value_heads_per_group
            and big.key_head_dim >= small.key_head_dim
            and big.value_head_dim >= small.value_head_dim
        )
    if isinstance(big, AttentionShape):
        return (
            big.num_key_value_heads >= small.num_key_value_heads
            and big.heads_per_group >= small.heads_per_group
        )
    return big.intermediate_size >= small.intermediate_size


class Problem:
    """One model's candidate groups (GDN layers, then sub-blocks), their costs, measured sensitivities."""

    def __init__(self, name: str, model, corpus: str, args):
        self.name, self.model, self.corpus = name, model, corpus
        t0 = time.perf_counter()
        calibration = demo_data.byte_windows(demo_data.train_text(corpus), SEQ, 64)
        self.scores = score_model(model, list(calibration.split(8)), progress=False)
        self.score_seconds = time.perf_counter() - t0
        self.sens = list(calibration[:16].split(4))
        self.validation = demo_data.byte_windows(
            demo_data.validation_text(corpus), SEQ, args.validation_windows
        )
        self.train = demo_data.byte_windows(demo_data.train_text(corpus), SEQ)
        self.base = window_losses(model, self.validation)
        step = Fraction(args.dim_step)
        self.gdn = []
        gdn_table = []
        for prefix, module in find_gdn_modules(model):
            shape = GDNShape.from_module(module)
            tensors = {n: tuple(p.shape) for n, p in module.named_parameters()}
            cands = layer_candidates(
                prefix, shape, tensors, detect_layout(tensors).name, module.conv_kernel_size, dim_step=step
            )
            self.gdn.append(
                LayerToPlan(
                    prefix,
                    module,
                    orders_from_payload(self.scores["layers"][prefix], shape),
                    [c.target for c in cands],
                )
            )
            gdn_table.append(cands)
        self.sub = plannable_blocks(
            model,
            ("attention", "mlp", "shared_expert"),
            self.scores["layers"],
            step=Fraction(1, 4),
            tp=None,
            multiple_of=None,
            orders_applied=False,
        )
        self.groups = self.gdn + self.sub
        self.kind = ["gdn"] * len(self.gdn) + [b.block.kind for b in self.sub]
        self.layer_of = [int(g.prefix.split(".layers.")[1].split(".")[0]) for g in self.groups]
        totals, wcosts, fixed = whole_model_costs(
            model,
            [(layer.module, c) for layer, c in zip(self.gdn, gdn_table)],
            self.sub,
            context=None,
            state_bytes=4,
        )
        self.costs, self.fixed, self.total = wcosts["params"], fixed["params"], totals["params"]
        self.decoder = sum(p.numel() for p in model.model.layers.parameters())
        self.outside = self.total - self.decoder  # embeddings (tied head once), final norm
        self.measure(args)

    def measure(self, args) -> None:
        key = f"{self.name}|{args.dim_step}|64|16"
        stored = json.loads(args.cache.read_text()) if args.cache and args.cache.exists() else {}
        t0 = time.perf_counter()
        if key in stored:
            gdn = stored[key]
        else:
            gdn = measured_sensitivity(self.model, self.sens, self.gdn, progress=not args.quiet)
            gdn["benchmark_seconds"] = time.perf_counter() - t0
            gdn["load_average"] = os.getloadavg()[0]
        sub_key = f"{key}|sub-blocks"
        if sub_key not in stored:
            t1 = time.perf_counter()
            stored[sub_key] = measured_sensitivity(self.model, self.sens, self.sub, progress=not args.quiet)
            stored[sub_key]["benchmark_seconds"] = time.perf_counter() - t1
        depth_key = f"{key}|removal"
        if args.depth and depth_key not in stored:
            t1 = time.perf_counter()
            removal = removal_sensitivity(self.model, self.sens)
            t2 = time.perf_counter()
            influence = block_influence(self.model, self.sens)
            stored[depth_key] = {
                "kl": {str(i): v[0] for i, v in removal.items()},
                "loss": {str(i): v[1] for i, v in removal.items()},
                "influence": {str(i): v for i, v in influence.items()},
                "influence_seconds": time.perf_counter() - t2,
                "benchmark_seconds": t2 - t1,
            }
        if args.depth and "influence" not in stored[depth_key]:  # a cache written before the proxy was added
            t2 = time.perf_counter()
            stored[depth_key]["influence"] = {
                str(i): v for i, v in block_influence(self.model, self.sens).items()
            }
            stored[depth_key]["influence_seconds"] = time.perf_counter() - t2
        stored[key] = gdn
        if args.cache:
            args.cache.parent.mkdir(parents=True, exist_ok=True)
            args.cache.write_text(json.dumps(stored))
        sub = stored[sub_key]
        self.kl = [gdn["kl"][g.prefix] for g in self.gdn] + [sub["kl"][b.prefix] for b in self.sub]
        self.removal = {int(i): v for i, v in stored[depth_key]["kl"].items()} if args.depth else {}
        self.influence = {int(i): v for i, v in stored[depth_key]["influence"].items()} if args.depth else {}
        self.seconds = {
            "score": self.score_seconds,
            "gdn": gdn["benchmark_seconds"],
            "sub_blocks": sub["benchmark_seconds"],
            **({"removal": stored[depth_key]["benchmark_seconds"]} if args.depth else {}),
        }
        self.forwards = {"gdn": gdn["forwards"], "sub_blocks": sub["forwards"]}

    # ---- plans -------------------------------------------------------------------------------------------------

    def limit(self, fraction: float) -> float:
        """The budget in group costs: what the decoder may keep, minus what no candidate changes in it."""
        return fraction * self.decoder - (self.fixed - self.outside)

    def searched(self, fraction: float) -> list[int]:
        return choose(self.kl, {"params": self.costs}, {"params": self.limit(fraction)})

    def gdn_only(self, fraction: float) -> list[int] | None:
        n = len(self.gdn)
        rest = sum(c[0] for c in self.costs[n:])
        try:
            picks = choose(self.kl[:n], {"params": self.costs[:n]}, {"params": self.limit(fraction) - rest})
        except BudgetError:
            return None
        return picks + [0] * len(self.sub)

    def uniform_choices(self, fraction: float) -> list[list[int]]:
        """Every maximal uniform combination (one candidate index per kind) within the budget."""
        kinds = sorted(set(self.kind), key=self.kind.index)
        members = {k: [g for g, kk in enumerate(self.kind) if kk == k] for k in kinds}
        cands = {k: self.groups[members[k][0]].candidates for k in kinds}
        for k in kinds:
            assert all(self.groups[g].candidates == cands[k] for g in members[k]), (
                f"{k}: blocks differ in shape"
            )
        budget = self.limit(fraction)
        feasible = []
        for combo in itertools.product(*[range(len(cands[k])) for k in kinds]):
            cost = sum(self.costs[g][combo[i]] for i, k in enumerate(kinds) for g in members[k])
            if cost <= budget:
                feasible.append(combo)
        maximal = [
            a
            for a in feasible
            if not any(
                b != a and all(contains(cands[k][b[i]], cands[k][a[i]]) for i, k in enumerate(kinds))
                for b in feasible
            )
        ]
        return [[combo[kinds.index(k)] for k in self.kind] for combo in maximal]

    def refined(self, fraction: float, picks: list[int], generations: int) -> tuple[list[int], dict]:
        """The joint refinement (issue 22) of ``picks``: whole cut models' KL on the calibration windows."""
        from gdnprune.plan.measure.joint import evolve_plan

        result = evolve_plan(
            self.model,
            self.sens,
            self.groups,
            {"params": self.costs},
            {"params": self.limit(fraction)},
            picks,
            generations=generations,
            offspring=8,
            seed=0,
            progress=False,
        )
        return result["picks"], {k: result[k] for k in ("seed_kl", "kl", "seconds", "evaluations")}

    def with_depth(self, fraction: float) -> tuple[list[int | None], list[int]]:
        return choose_with_removal(
            self.kl,
            {"params": self.costs},
            {"params": self.limit(fraction)},
            layer_of=self.layer_of,
            removal=self.removal,
        )

    def depth_only(self, fraction: float) -> list[list[int]]:
        """Every minimal set of removed layers that fits, the rest at full width (one full-attention layer kept)."""
        layers = sorted(self.removal)
        budget = self.limit(fraction)
        types = self.model.config.get_text_config(decoder=True).layer_types
        attention = {i for i, t in enumerate(types) if t == "full_attention"}
        fits = []
        for k in range(len(layers) + 1):
            for removed in itertools.combinations(layers, k):
                if attention and attention <= set(removed):
                    continue  # transformers' hybrid cache needs a full-attention layer (gdnprune keeps one)
                cost = sum(c[0] for c, layer in zip(self.costs, self.layer_of) if layer not in removed)
                if cost <= budget and not any(set(f) <= set(removed) for f in fits):
                    fits.append(removed)
        return [list(r) for r in fits]

    # ---- models ------------------------------------------------------------------------------------------------

    def plan_layers(self, picks, removed=()) -> dict:
        out = {}
        for g, pick, layer in zip(self.groups, picks, self.layer_of):
            if layer in removed:
                continue
            target = g.candidates[pick]
            if isinstance(g, LayerToPlan):
                out[g.prefix] = target.as_dict()
            else:
                out[g.prefix] = {k: v for k, v in target.as_dict().items() if k != "head_dim"}
        return out

    def build(self, picks, removed=()) -> torch.nn.Module:
        gdn = {g.prefix: g.candidates[p] for g, p in zip(self.gdn, picks)}
        blocks = {}
        for b, p in zip(self.sub, picks[len(self.gdn) :]):
            t = b.candidates[p]
            blocks[b.prefix] = (
                {"num_attention_heads": t.num_attention_heads, "num_key_value_heads": t.num_key_value_heads}
                if b.block.kind == "attention"
                else {
                    "shared_expert_intermediate_size"
                    if b.block.kind == "shared_expert"
                    else "intermediate_size": t.intermediate_size
                }
            )
        gdn_payloads = {g.prefix: self.scores["layers"][g.prefix] for g in self.gdn}
        block_payloads = {b.prefix: self.scores["layers"][b.prefix] for b in self.sub}
        small = slice_model(self.model, gdn, gdn_payloads, blocks=blocks, block_orders=block_payloads)
        if removed:
            small = remove_layers(small, removed)
        return small

    def decoder_params(self, model) -> int:
        return sum(p.numel() for p in model.model.layers.parameters())


def remove_layers(model, removed) -> torch.nn.Module:
    """The model with decoder layers ``removed`` dropped, through the checkpoint path a user runs
    (``save_pretrained`` → ``gdnprune slice --remove-layers`` → ``load_pretrained``)."""
    from gdnprune.checkpoint import slice_checkpoint

    with tempfile.TemporaryDirectory() as tmp:
        src, out = Path(tmp) / "in", Path(tmp) / "out"
        model.save_pretrained(src)
        slice_checkpoint(src, out, remove_layers=list(removed))
        return load_pretrained(out, dtype=torch.float32).eval()


def distil(problem: Problem, student, steps: int) -> np.ndarray:
    student.train()
    for p in student.parameters():
        p.requires_grad_(True)
    config = DistillConfig(steps=steps, log_every=max(steps, 1), progress=False, **RECIPE)
    distill(student, problem.model, problem.train, config)
    student.eval()
    return window_losses(student, problem.validation)


def run_model(problem: Problem, args) -> dict:
    rows = []
    for fraction in args.budgets:
        row = {"budget": fraction, "limit_decoder_params": fraction * problem.decoder}
        plans: dict[str, tuple] = {"searched": (problem.searched(fraction), ())}
        if args.refine_generations:
            picks, row["refinement"] = problem.refined(
                fraction, plans["searched"][0], args.refine_generations
            )
            plans["refined"] = (picks, ())
        gdn = problem.gdn_only(fraction) if "gdn_only" in args.plans else None
        if gdn is not None:
            plans["gdn_only"] = (gdn, ())
        t0 = time.perf_counter()
        best, n_uniform = None, 0
        for picks in problem.uniform_choices(fraction) if "best_uniform" in args.plans else ():
            losses = window_losses(problem.build(picks), problem.validation)
            n_uniform += 1
            if best is None or losses.mean() < best[1].mean():
                best = (picks, losses)
        row["uniform_evaluated"], row["uniform_seconds"] = n_uniform, time.perf_counter() - t0
        if best is not None:
            plans["best_uniform"] = (best[0], ())
        if args.depth and fraction in DEPTH_BUDGETS and "depth_allowed" in args.plans:
            choice, removed = problem.with_depth(fraction)
            plans["depth_allowed"] = ([0 if c is None else c for c in choice], tuple(removed))
            best_depth, n_depth = None, 0
            for removed in problem.depth_only(fraction):
                losses = window_losses(problem.build([0] * len(problem.groups), removed), problem.validation)
                n_depth += 1
                if best_depth is None or losses.mean() < best_depth[1].mean():
                    best_depth = (removed, losses)
            row["depth_only_evaluated"] = n_depth
            if best_depth is not None:
                plans["depth_only"] = ([0] * len(problem.groups), tuple(best_depth[0]))
        results = {}
        for name, (picks, removed) in plans.items():
            small = problem.build(picks, removed)
            kept = problem.decoder_params(small)
            assert kept <= fraction * problem.decoder + 1e-6, (name, kept, fraction * problem.decoder)
            before = window_losses(small, problem.validation)
            t0 = time.perf_counter()
            after = distil(problem, small, args.steps) if args.steps else None
            results[name] = {
                "before": before,
                "after": after,
                "distill_seconds": time.perf_counter() - t0,
                "decoder_fraction": kept / problem.decoder,
                "removed": list(removed),
                "predicted_kl": float(
                    sum(problem.kl[g][p] for g, p in enumerate(picks) if problem.layer_of[g] not in removed)
                    + sum(problem.removal.get(layer, 0.0) for layer in removed)
                ),
                "plan": problem.plan_layers(picks, removed),
            }
            if not args.quiet:
                print(
                    f"  {problem.name} {fraction:.0%} {name}: {before.mean():.4f}"
                    + (f" -> {after.mean():.4f}" if after is not None else ""),
                    flush=True,
                )
        ref = results["searched"]
        for name, r in results.items():
            entry = {
                "loss": float(r["before"].mean()),
                "decoder_fraction": r["decoder_fraction"],
                "removed": r["removed"],
                "predicted_kl": r["predicted_kl"],
                "plan": r["plan"],
                "minus_searched": paired(r["before"], ref["before"]),
            }
            if r["after"] is not None:
                entry.update(
                    {
                        "loss_after": float(r["after"].mean()),
                        "minus_searched_after": paired(r["after"], ref["after"]),
                        "distill_seconds": r["distill_seconds"],
                    }
                )
            row[name] = entry
        rows.append(row)
    split = {}
    for kind in dict.fromkeys(problem.kind):
        split[kind] = (
            sum(problem.costs[g][0] for g, k in enumerate(problem.kind) if k == kind) / problem.total
        )
    split["outside the decoder"] = problem.outside / problem.total
    return {
        "model": problem.name,
        "corpus": problem.corpus,
        "params": problem.total,
        "decoder_params": problem.decoder,
        "base_loss": float(problem.base.mean()),
        "seconds": problem.seconds,
        "forwards": problem.forwards,
        "removal_kl": problem.removal,
        "block_influence": problem.influence,
        "influence_spearman": (
            spearman(
                [problem.influence[i] for i in sorted(problem.removal)],
                [problem.removal[i] for i in sorted(problem.removal)],
            )
            if len(problem.removal) > 2
            else None
        ),
        "shares": split,
        "steps": args.steps,
        "recipe": RECIPE,
        "rows": rows,
    }


NAMES = [
    ("searched", "searched"),
    ("refined", "refined"),
    ("gdn_only", "GDN-only"),
    ("best_uniform", "best uniform"),
    ("depth_allowed", "depth allowed"),
    ("depth_only", "best depth-only"),
]


def print_model(result: dict) -> None:
    shares = ", ".join(f"{k} {v:.1%}" for k, v in result["shares"].items())
    print(
        f"\n{result['model']}: {result['params']:,.0f} parameters ({shares}); decoder {result['decoder_params']:,}; "
        f"unpruned validation loss {result['base_loss']:.4f}; sensitivity seconds "
        + ", ".join(f"{k} {v:.0f}" for k, v in result["seconds"].items())
    )
    if result["removal_kl"]:
        print(
            "removal KL (measured) / block influence per layer: "
            + ", ".join(
                f"{i}: {result['removal_kl'][i]:.3f}/{result['block_influence'][i]:.3f}"
                for i in sorted(result["removal_kl"])
            )
            + f"; Spearman rho {result['influence_spearman']:.2f}"
        )
    header = f"{'budget':<7} {'plan':<16} {'kept':>6} {'loss':>7} {'- searched':>17} {'after':>7} {'- searched':>17}  removed"
    print(header)
    print("-" * len(header))
    for row in result["rows"]:
        for key, label in NAMES:
            if key not in row:
                continue
            e = row[key]
            d = e["minus_searched"]
            line = f"{row['budget']:<7.0%} {label:<16} {e['decoder_fraction']:6.1%} {e['loss']:7.4f} {d[0]:+9.4f}±{d[1]:.4f}"
            if "loss_after" in e:
                a = e["minus_searched_after"]
                line += f" {e['loss_after']:7.4f} {a[0]:+9.4f}±{a[1]:.4f}"
            print(line + f"  {e['removed'] or ''}")
        print(
            f"{'':7} ({row['uniform_evaluated']} maximal uniform cuts evaluated"
            + (f", {row['depth_only_evaluated']} depth-only cuts" if "depth_only_evaluated" in row else "")
            + ")"
        )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_arguments(p)
    p.add_argument(
        "--depth", action="store_true", help="also depth-allowed and depth-only plans (75 %% and 50 %%)"
    )
    p.add_argument("--dim-step", default="1/4", help="GDN head-dim grid (default 1/4)")
    p.add_argument(
        "--plans",
        type=lambda t: t.split(","),
        default=["gdn_only", "best_uniform", "depth_allowed"],
        help="comparisons besides the searched plan (default gdn_only,best_uniform,depth_allowed; "
        "depth_allowed also brings the best depth-only cut, with --depth)",
    )
    p.add_argument(
        "--refine-generations",
        type=int,
        default=0,
        help="also the searched plan after this many generations of the joint refinement (0: not)",
    )
    p.add_argument("--steps", type=int, default=300, help="distillation steps per plan (300; 0: none)")
    p.add_argument("--cache", type=Path, default=None, help="keep / reuse the measured sensitivities here")
    args = p.parse_args(argv)
    set_up(args)
    print(
        f"load average {load_average():.1f}; torch threads {args.threads}; distillation {args.steps} steps, "
        f"{RECIPE}"
    )
    results = []
    for spec in benchmark_models(args):
        problem = Problem(spec.name, spec.load(), spec.corpus, args)
        results.append(run_model(problem, args))
        print_model(results[-1])
        if args.json:
            args.json.write_text(json.dumps(results, indent=1))
    print(f"\nload average at the end {load_average():.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
