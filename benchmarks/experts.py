#!/usr/bin/env python
"""Removal error x frequency, the default expert order, beats REAP in every cut and matches or beats frequency at 50% of the experts.

Which expert order wins (issues 23, 31): the default (removal error x frequency), the removal error, the
measured greedy removal, REAP, frequency and random, uniform and per-layer counts,
before and after distillation, on a small Qwen3.5-MoE model trained on the demo corpus.

The model (default ``benchmarks/_work/models/moe16``: 4 decoder layers ``GGGA``, each with 16 routed
experts of 64 channels, 2 per token, and a shared expert) is trained by::

    python scripts/train_demo_model.py --threads 1 --family qwen3_5_moe --layer-types GGGA --num-experts 16 \\
        --experts-per-token 2 --expert-size 64 --steps 400 --batch-size 8 --log-every 20 \\
        --out benchmarks/_work/models/moe16

One scoring pass on training windows (``score_model(...)``, every kind of sub-block by default, the default method) gives, per MoE
layer, every expert measure of :mod:`gdnprune.scoring.experts`: the default order (the removal error x the
frequency), the removal error alone, the measured greedy removal and the greedy x frequency (:mod:`gdnprune.scoring.expert_greedy`,
``expert_sample_tokens=4096``), the
REAP order (mean over the
tokens routed to an expert of gate weight x the norm of its output) and the router's frequency (how often the
router picks the expert; the order of ``method="activation"``, ties to the lower expert). ``--random-orders``
seeded random orders are the chance baseline. Cuts, in memory (:func:`gdnprune.slice_model`):

* **uniform**: every MoE layer keeps the same number of experts, 50% (8 of 16) and 25% (4 of 16);
* **per-layer**: the same total of experts, spread over the layers by measured sensitivity: for every layer
  and every count from ``num_experts_per_tok`` to all, the KL divergence from the unpruned model of the model
  with that layer alone cut to that count (that order's first experts kept), on ``--sensitivity-windows``
  calibration windows; the per-layer counts are the exact MILP :func:`gdnprune.plan.choose.solve.choose` that
  minimises the summed KL with the total of kept experts at most the uniform cut's. Done for the REAP and
  frequency orders and the first ``--plan-random-orders`` random orders (each with its own sensitivity).

Every cut is evaluated on held-out validation windows (``window_losses``: nats/byte per window); the
differences between orders are paired over windows (mean and standard error). Then the distillation runs
(``--runs``) train the cut students from the unpruned model (:func:`gdnprune.distill.distill`, forward KL,
``--steps`` steps, batch ``--batch-size`` x 256 bytes, AdamW lr ``--lr``, cosine after 3% warmup, seed 0, every
training window of the corpus) one after another, each result cached as ``--results/NAME.json``. Also the
exactness check on the trained model: the 50% REAP cut against the unpruned model with the removed experts'
router logits set to -inf before top-k (a reference written here from the router's definition).

    .venv/bin/python benchmarks/experts.py --threads 1 --json experts.json   # 54 min on a busy 2-core machine
    .venv/bin/python benchmarks/experts.py --runs                           # one-shot part only
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
import torch.nn.functional as F  # noqa: E402
from _common import joint_kl, paired, window_losses  # noqa: E402

from gdnprune import demo_data  # noqa: E402
from gdnprune.distill import distill  # noqa: E402
from gdnprune.io.loading import load_pretrained, slice_model  # noqa: E402
from gdnprune.model.subblock_geometry import orders_from_payload  # noqa: E402
from gdnprune.model.subblock_surgery import find_model_blocks, random_orders  # noqa: E402
from gdnprune.plan.choose.solve import choose  # noqa: E402
from gdnprune.scoring import score_model  # noqa: E402
from gdnprune.scoring.experts import SAMPLE_TOKENS  # noqa: E402

SEQ_LEN, SEED, WARMUP = 256, 0, 0.03
FRACTIONS = (0.5, 0.25)
# distillation runs: name -> (fraction, "uniform" | "plan", order)
RUNS = {
    f"{int(f * 100)}-{cut}-{order}": (f, cut, order)
    for f in FRACTIONS
    for cut in ("uniform", "plan")
    for order in ("reap", "frequency", "random0")
}
DEFAULT_RUNS = [
    "50-uniform-reap",
    "50-uniform-frequency",
    "50-uniform-random0",
    "50-plan-reap",
    "25-uniform-reap",
    "25-uniform-frequency",
    "25-uniform-random0",
    "25-plan-reap",
]


def cut(model, orders: dict, counts: dict) -> torch.nn.Module:
    """``model`` with MoE layer ``p`` keeping the first ``counts[p]`` experts of ``orders[p]``."""
    return slice_model(
        model,
        None,
        blocks={p: {"num_experts": c} for p, c in counts.items()},
        block_orders={p: orders[p] for p in counts},
    )


class MaskedRouters:
    """The reference: every router of the unpruned model routes only among ``kept[prefix]`` — the removed
    experts' logits are -inf before the softmax and top-k (then the top-k weights renormalised, as Qwen's
    router does), written from the router's definition."""

    def __init__(self, model, kept: dict[str, list[int]]):
        self.model, self.kept, self.handles = model, kept, []

    def __enter__(self):
        for prefix, keep in self.kept.items():
            router = self.model.get_submodule(prefix + ".gate")
            self.handles.append(router.register_forward_hook(self._hook(sorted(keep))))
        return self.model

    def __exit__(self, *exc):
        for h in self.handles:
            h.remove()

    @staticmethod
    def _hook(keep):
        def hook(router, args, output):
            logits = F.linear(args[0].reshape(-1, router.weight.shape[1]), router.weight)
            mask = torch.full_like(logits, float("-inf"))
            mask[:, keep] = 0
            top, index = torch.topk(
                torch.softmax(logits + mask, dim=-1, dtype=torch.float), router.top_k, dim=-1
            )
            return logits, (top / top.sum(-1, keepdim=True)).to(logits.dtype), index

        return hook


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "model",
        type=Path,
        nargs="?",
        default=REPO / "benchmarks/_work/models/moe16",
        help="the trained MoE model folder (default: %(default)s)",
    )
    p.add_argument(
        "--calibration-windows", type=int, default=64, help="scoring windows of 256 training bytes (64)"
    )
    p.add_argument("--sensitivity-windows", type=int, default=16, help="of those, for the per-layer KL (16)")
    p.add_argument("--validation-windows", type=int, default=None, help="held-out windows (default: all)")
    p.add_argument("--random-orders", type=int, default=12, help="random orders of the one-shot cuts (12)")
    p.add_argument("--plan-random-orders", type=int, default=3, help="of those, with a per-layer plan (3)")
    p.add_argument(
        "--sum-order",
        action="store_true",
        help="also the router-weighted sum order (REAP x frequency: the mean over all tokens of gate weight "
        "x output norm), a diagnostic beside the library's two measures",
    )
    p.add_argument(
        "--runs",
        nargs="*",
        default=DEFAULT_RUNS,
        choices=list(RUNS),
        help="distillation runs, in this order (default: %(default)s); none: one-shot only",
    )
    p.add_argument("--steps", type=int, default=300, help="distillation steps (300)")
    p.add_argument("--batch-size", type=int, default=4, help="distillation windows of 256 bytes per step (4)")
    p.add_argument("--lr", type=float, default=1e-3, help="distillation learning rate (1e-3)")
    p.add_argument(
        "--results",
        type=Path,
        default=REPO / "benchmarks/_work/experts",
        help="per-run distillation results, reused when present (default: %(default)s)",
    )
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--json", type=Path, default=None, help="also write every number to this JSON file")
    args = p.parse_args(argv)
    if args.random_orders < 2:
        p.error("--random-orders: at least 2 (their standard deviation is reported)")
    torch.set_num_threads(args.threads)
    t_start = time.perf_counter()
    record = json.loads((args.model / "training.json").read_text())
    corpus = record["corpus"]["name"]
    model = load_pretrained(args.model, dtype=torch.float32).eval()
    blocks = find_model_blocks(model, ("experts",))
    prefixes = [b.prefix for b in blocks]
    n_experts, top_k = blocks[0].shape.num_experts, blocks[0].shape.num_experts_per_tok
    calibration = demo_data.byte_windows(demo_data.train_text(corpus), SEQ_LEN, args.calibration_windows)
    validation = demo_data.byte_windows(demo_data.validation_text(corpus), SEQ_LEN, args.validation_windows)
    print(
        f"load average {os.getloadavg()[0]:.1f}; torch threads {args.threads}; model {args.model}: "
        f"{len(blocks)} MoE layers x {n_experts} experts (top-{top_k}), corpus {corpus}; calibration "
        f"{calibration.shape[0]} x {SEQ_LEN} training bytes, validation {validation.shape[0]} x {SEQ_LEN}",
        flush=True,
    )

    # one scoring pass: every expert measure of every MoE layer (the default order: removal error x frequency)
    t0 = time.perf_counter()
    scores = score_model(
        model, list(calibration.split(8)), progress=False, expert_sample_tokens=SAMPLE_TOKENS
    )
    score_seconds = time.perf_counter() - t0
    payloads = {p: scores["layers"][p] for p in prefixes}
    default = payloads[prefixes[0]]["expert_measure"]

    def by(measure) -> dict:
        return {p: {"experts": torch.argsort(-measure(payloads[p]), stable=True).numpy()} for p in prefixes}

    orders = {
        name: by(lambda q, name=name: torch.tensor(q[f"expert_{name}"]))
        for name in ("removal_frequency", "removal", "greedy", "greedy_frequency", "reap", "frequency")
    }
    if any(
        not np.array_equal(
            orders[default][p]["experts"], orders_from_payload(payloads[p], b.shape)["experts"]
        )
        for p, b in zip(prefixes, blocks)
    ):
        raise SystemExit("the scores file's expert order is not its measure's")
    if args.sum_order:
        orders["sum"] = by(lambda q: torch.tensor(q["expert_reap"]) * torch.tensor(q["expert_frequency"]))
    g = torch.Generator().manual_seed(SEED)
    randoms = [{b.prefix: random_orders(b, generator=g) for b in blocks} for _ in range(args.random_orders)]
    orders.update({f"random{i}": r for i, r in enumerate(randoms)})
    t0 = time.perf_counter()
    base = window_losses(model, validation)
    eval_seconds = time.perf_counter() - t0
    print(
        f"unpruned validation loss {base.mean():.4f} nats/byte ({eval_seconds:.1f} s per evaluation); scoring "
        f"{score_seconds:.1f} s",
        flush=True,
    )
    agreement = {
        p: _overlap(orders["reap"][p]["experts"], orders["frequency"][p]["experts"]) for p in prefixes
    }

    # per-layer sensitivity: KL of one layer alone cut to every count, per order
    sens_windows = list(calibration[: args.sensitivity_windows].split(4))
    with torch.no_grad():
        teacher_logp = [model(input_ids=x).logits.float().log_softmax(-1) for x in sens_windows]
    counts = list(range(top_k, n_experts + 1))
    planned = ["removal_frequency", "removal", "greedy", "greedy_frequency", "reap", "frequency"]
    planned += ["sum"] * args.sum_order
    planned += [f"random{i}" for i in range(min(args.plan_random_orders, args.random_orders))]
    sensitivity, sens_seconds = {}, {}
    for name in planned:
        t0 = time.perf_counter()
        sensitivity[name] = [
            [
                0.0
                if c == n_experts
                else joint_kl(cut(model, orders[name], {p: c}), teacher_logp, sens_windows)
                for c in counts
            ]
            for p in prefixes
        ]
        sens_seconds[name] = time.perf_counter() - t0
    print(
        f"per-layer sensitivity: {len(prefixes)} layers x {len(counts) - 1} counts, "
        f"{sens_seconds['reap']:.0f} s per order",
        flush=True,
    )

    losses: dict[str, dict[str, np.ndarray]] = {}
    one_shot, plans = [], {}
    for fraction in FRACTIONS:
        keep = round(n_experts * fraction)
        key = f"{int(fraction * 100)}"
        uniform = {
            name: window_losses(cut(model, o, {p: keep for p in prefixes}), validation)
            for name, o in orders.items()
        }
        plan_losses = {}
        for name in planned:
            picks = choose(
                sensitivity[name], {"experts": [counts] * len(prefixes)}, {"experts": keep * len(prefixes)}
            )
            chosen = {p: counts[i] for p, i in zip(prefixes, picks)}
            plans[f"{key}-{name}"] = chosen
            plan_losses[name] = window_losses(cut(model, orders[name], chosen), validation)
        losses[f"{key}-uniform"], losses[f"{key}-plan"] = uniform, plan_losses
        one_shot.append(
            _one_shot_row(key, keep, base, uniform, plan_losses, plans, prefixes, args.random_orders)
        )
        print(_format_one_shot(one_shot[-1]), flush=True)

    # exactness on the trained model: the 50% REAP cut = the unpruned model with a masked router
    keep = n_experts // 2
    kept = {p: orders["reap"][p]["experts"][:keep].tolist() for p in prefixes}
    small = cut(model, orders["reap"], {p: keep for p in prefixes})
    with torch.no_grad():
        x = validation[:8]
        with MaskedRouters(model, kept):
            reference = model(input_ids=x).logits
        exact = float((small(input_ids=x).logits - reference).abs().max())
    print(
        f"50% REAP cut vs the unpruned model with the removed experts masked out of the router: max |logit "
        f"difference| {exact:.2e} on 8 x {SEQ_LEN} validation bytes",
        flush=True,
    )
    one_shot_seconds = time.perf_counter() - t_start

    distilled = []
    if args.runs:
        train = demo_data.byte_windows(demo_data.train_text(corpus), SEQ_LEN)
        for name in args.runs:
            distilled.append(
                _distill_run(name, model, orders, plans, prefixes, n_experts, train, validation, args)
            )
            r = distilled[-1]
            print(
                f"{name}: {r['before']:.4f} -> {r['after']:.4f} nats/byte, {r['cpu_s']:.0f} s CPU, "
                f"{r['wall_s']:.0f} s wall{' (cached)' if r.get('cached') else ''}",
                flush=True,
            )
        print(_format_distilled(distilled, float(base.mean())))
    total = time.perf_counter() - t_start
    print(
        f"\ncosts: scoring {score_seconds:.1f} s, per-layer sensitivity {sens_seconds['reap']:.0f} s per order, "
        f"one validation evaluation {eval_seconds:.1f} s, one-shot part {one_shot_seconds:.0f} s, all {total:.0f} s; "
        f"load average at the end {os.getloadavg()[0]:.1f}"
    )
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "model": str(args.model),
                    "corpus": corpus,
                    "num_experts": n_experts,
                    "num_experts_per_tok": top_k,
                    "moe_layers": prefixes,
                    "validation_windows": int(validation.shape[0]),
                    "calibration_windows": int(calibration.shape[0]),
                    "sensitivity_windows": args.sensitivity_windows,
                    "base_loss": float(base.mean()),
                    "reap_frequency_top_half_overlap": agreement,
                    "expert_scores": {
                        p: {
                            k: payloads[p][k]
                            for k in (
                                "expert_removal_frequency",
                                "expert_removal",
                                "expert_greedy",
                                "expert_greedy_error",
                                "expert_greedy_frequency",
                                "expert_reap",
                                "expert_frequency",
                            )
                        }
                        for p in prefixes
                    },
                    "orders": {
                        name: {p: np.asarray(o[p]["experts"]).tolist() for p in prefixes}
                        for name, o in orders.items()
                        if not name.startswith("random")
                    },
                    "sensitivity": sensitivity,
                    "sensitivity_counts": counts,
                    "plans": plans,
                    "one_shot": one_shot,
                    "masked_router_max_abs_logit_difference": exact,
                    "distilled": distilled,
                    "seconds": {
                        "score": score_seconds,
                        "sensitivity_per_order": sens_seconds,
                        "evaluation": eval_seconds,
                        "one_shot": one_shot_seconds,
                        "total": total,
                    },
                    "command": " ".join(sys.argv),
                },
                indent=1,
            )
        )
    return 0


def _overlap(a, b) -> float:
    half = len(a) // 2
    return len(set(np.asarray(a[:half]).tolist()) & set(np.asarray(b[:half]).tolist())) / half


def _one_shot_row(key, keep, base, uniform, plan_losses, plans, prefixes, n_random) -> dict:
    rand = [f"random{i}" for i in range(n_random)]
    random_mean = np.mean([uniform[r] for r in rand], axis=0)  # per window, over the random orders
    row = {"cut": f"{key}%", "experts_kept": keep, "base": float(base.mean())}
    for name in [
        n
        for n in ("removal_frequency", "removal", "greedy", "greedy_frequency", "reap", "frequency", "sum")
        if n in uniform
    ]:
        row[f"uniform_{name}"] = float(uniform[name].mean())
        row[f"uniform_{name}_beats_random"] = sum(
            uniform[r].mean() > uniform[name].mean() for r in rand
        ) / len(rand)
    row["uniform_random"] = [float(uniform[r].mean()) for r in rand]
    row["uniform_reap_minus_frequency"] = paired(uniform["reap"], uniform["frequency"])
    row["uniform_reap_minus_random_mean"] = paired(uniform["reap"], random_mean)
    row["uniform_frequency_minus_random_mean"] = paired(uniform["frequency"], random_mean)
    plan_rand = [r for r in rand if r in plan_losses]
    for name in plan_losses:
        row[f"plan_{name}"] = float(plan_losses[name].mean())
        row[f"plan_{name}_counts"] = [plans[f"{key}-{name}"][p] for p in prefixes]
        row[f"plan_{name}_minus_uniform"] = paired(plan_losses[name], uniform[name])
    row["plan_reap_minus_frequency"] = paired(plan_losses["reap"], plan_losses["frequency"])
    for name in ("removal_frequency", "removal", "greedy", "greedy_frequency"):
        for other in ("reap", "frequency", "removal_frequency"):
            row[f"uniform_{name}_minus_{other}"] = paired(uniform[name], uniform[other])
            row[f"plan_{name}_minus_{other}"] = paired(plan_losses[name], plan_losses[other])
    if "sum" in uniform:
        row["uniform_sum_minus_frequency"] = paired(uniform["sum"], uniform["frequency"])
        row["plan_sum_minus_frequency"] = paired(plan_losses["sum"], plan_losses["frequency"])
    if plan_rand:
        row["plan_random"] = [float(plan_losses[r].mean()) for r in plan_rand]
        row["plan_reap_minus_random_mean"] = paired(
            plan_losses["reap"], np.mean([plan_losses[r] for r in plan_rand], axis=0)
        )
        row["plan_reap_beats_random"] = sum(
            plan_losses[r].mean() > plan_losses["reap"].mean() for r in plan_rand
        ) / len(plan_rand)
    return row


def _se(pair) -> str:
    mean, se = pair
    return f"{mean:+.4f} ± {se:.4f} ({mean / se:+.1f} se)" if se > 0 else f"{mean:+.4f}"


def _format_one_shot(row: dict) -> str:
    b, rnd = row["base"], row["uniform_random"]
    lines = [
        f"\n{row['cut']} of the experts ({row['experts_kept']} per layer), loss increase over the unpruned "
        f"{b:.4f} nats/byte:",
        f"  uniform   REAP {row['uniform_reap'] - b:+.4f} "
        f"(beats {row['uniform_reap_beats_random']:.0%} of random)  "
        f"frequency {row['uniform_frequency'] - b:+.4f} (beats {row['uniform_frequency_beats_random']:.0%})  "
        f"random {statistics.mean(rnd) - b:+.4f} ± {statistics.stdev(rnd):.4f} sd (n={len(rnd)}, "
        f"best {min(rnd) - b:+.4f})",
        f"            REAP - frequency {_se(row['uniform_reap_minus_frequency'])}; REAP - random mean "
        f"{_se(row['uniform_reap_minus_random_mean'])}; frequency - random mean "
        f"{_se(row['uniform_frequency_minus_random_mean'])}",
        f"  per-layer REAP {row['plan_reap'] - b:+.4f} {row['plan_reap_counts']}  frequency "
        f"{row['plan_frequency'] - b:+.4f} {row['plan_frequency_counts']}",
    ]
    if "plan_random" in row:
        pr = row["plan_random"]
        lines[-1] += (
            f"  random {statistics.mean(pr) - b:+.4f} ± {statistics.stdev(pr) if len(pr) > 1 else 0:.4f} "
            f"sd (n={len(pr)}; REAP beats {row['plan_reap_beats_random']:.0%})"
        )
    lines.append(
        f"            REAP plan - REAP uniform {_se(row['plan_reap_minus_uniform'])}; frequency plan - "
        f"frequency uniform {_se(row['plan_frequency_minus_uniform'])}; REAP plan - frequency plan "
        f"{_se(row['plan_reap_minus_frequency'])}"
    )
    for name, label in (
        ("removal_frequency", "removal x frequency (the default)"),
        ("removal", "removal"),
        ("greedy", "measured greedy removal"),
        ("greedy_frequency", "measured greedy x frequency"),
    ):
        lines.append(
            f"  {label}: uniform {row[f'uniform_{name}'] - b:+.4f} (beats "
            f"{row[f'uniform_{name}_beats_random']:.0%} of random), - REAP "
            f"{_se(row[f'uniform_{name}_minus_reap'])}, - frequency {_se(row[f'uniform_{name}_minus_frequency'])}; "
            f"per-layer {row[f'plan_{name}'] - b:+.4f} {row[f'plan_{name}_counts']}, - REAP plan "
            f"{_se(row[f'plan_{name}_minus_reap'])}, - frequency plan {_se(row[f'plan_{name}_minus_frequency'])}"
            + (
                ""
                if name == "removal_frequency"
                else f"; - the default: uniform {_se(row[f'uniform_{name}_minus_removal_frequency'])}, "
                f"per-layer {_se(row[f'plan_{name}_minus_removal_frequency'])}"
            )
        )
    if "uniform_sum" in row:
        lines.append(
            f"  sum order (REAP x frequency): uniform {row['uniform_sum'] - b:+.4f} (beats "
            f"{row['uniform_sum_beats_random']:.0%} of random), - frequency "
            f"{_se(row['uniform_sum_minus_frequency'])}; per-layer {row['plan_sum'] - b:+.4f} "
            f"{row['plan_sum_counts']}, - frequency plan {_se(row['plan_sum_minus_frequency'])}"
        )
    return "\n".join(lines)


def _distill_run(name, model, orders, plans, prefixes, n_experts, train, validation, args) -> dict:
    path = args.results / f"{name}.json"
    settings = {
        "steps": args.steps,
        "batch_size": args.batch_size,
        "lr": args.lr,
        "seq_len": SEQ_LEN,
        "warmup": WARMUP,
        "seed": SEED,
        "validation_windows": int(validation.shape[0]),
    }
    if path.exists():
        stored = json.loads(path.read_text())
        if stored.get("settings") == settings and stored.get("model") == str(args.model):
            return {**stored, "cached": True}
    fraction, kind, order = RUNS[name]
    keep = round(n_experts * fraction)
    counts = plans[f"{int(fraction * 100)}-{order}"] if kind == "plan" else {p: keep for p in prefixes}
    student = cut(model, orders[order], counts)
    before = window_losses(student, validation)
    cpu, wall = time.process_time(), time.perf_counter()
    result = distill(
        student,
        model,
        train,
        steps=args.steps,
        batch_size=args.batch_size,
        lr=args.lr,
        warmup=WARMUP,
        seed=SEED,
        kd_weight=1.0,
        lm_weight=0.0,
        log_every=50,
        progress=False,
    )
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    student.eval()
    after = window_losses(student, validation)
    out = {
        "name": name,
        "model": str(args.model),
        "settings": settings,
        "fraction": fraction,
        "cut": kind,
        "order": order,
        "counts": [counts[p] for p in prefixes],
        "before": float(before.mean()),
        "after": float(after.mean()),
        "before_windows": before.tolist(),
        "after_windows": after.tolist(),
        "train_loss": [(h["step"], h["loss"]) for h in result["history"] if "loss" in h],
        "cpu_s": cpu,
        "wall_s": wall,
        "load_average": os.getloadavg()[0],
    }
    args.results.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out))
    return out


def _format_distilled(runs: list[dict], base: float) -> str:
    by = {r["name"]: r for r in runs}
    lines = [
        f"\nafter {runs[0]['settings']['steps']} distillation steps (loss increase over the unpruned "
        f"{base:.4f}; recovered = share of the cut's increase removed):",
        f"{'run':<24} {'counts':<16} {'before':>8} {'after':>8} {'recovered':>9} {'CPU s':>6}",
    ]
    for r in runs:
        lines.append(
            f"{r['name']:<24} {str(r['counts']):<16} {r['before'] - base:+8.4f} {r['after'] - base:+8.4f} "
            f"{(r['before'] - r['after']) / (r['before'] - base):9.1%} {r['cpu_s']:6.0f}"
        )
    for f in ("50", "25"):
        reap = by.get(f"{f}-uniform-reap")
        for other in (f"{f}-uniform-frequency", f"{f}-uniform-random0", f"{f}-plan-reap"):
            if reap and other in by:
                a, b = np.array(reap["after_windows"]), np.array(by[other]["after_windows"])
                lines.append(f"  after: {f}-uniform-reap - {other}: {_se(paired(a, b))}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
