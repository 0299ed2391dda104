#!/usr/bin/env python
"""One-shot quality on several models: measured lane choice and least-squares compensation (issue 12).

For every model, every axis at 50 % and 25 % kept (where representable) and one combined target, the
validation loss increase of

* ``default``: the ``projection`` scores; ``refined``: the same with measured lane orders
  (:func:`gdnprune.quality.lane_search.refine_lane_orders`); ``compensated``: the default cut with ``out_proj`` refitted
  by least squares (:mod:`gdnprune.quality.compensate`); ``refined+comp.``; ``sequential``: the default cut with
  ``out_proj`` refitted layer by layer on the cut model's own hidden states against the full model's
  residual stream (:func:`gdnprune.quality.compensate.sequential_refit`; ``--references`` adds columns for its
  other references); ``activation``;
* ``--random-orders`` random orders (mean, and the share each method beats);
* for lanes and key groups, the per-layer optimum (every choice of each layer alone, searched on training
  windows; as in ``benchmarks/quality.py``) and the gap each method closes.

Models: ``bundled`` (the demo model) and model folders trained with ``scripts/train_demo_model.py`` (the
corpus is read from their ``training.json``). Calibration, statistics and searches use training text;
losses use held-out text.

    .venv/bin/python benchmarks/one_shot.py --threads 1 --models bundled,benchmarks/_work/models/seed1,\\
        benchmarks/_work/models/lanes3_dim64,benchmarks/_work/models/deep_docstrings --json one_shot.json
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
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "src"))
sys.path.insert(0, str(HERE))

import torch  # noqa: E402
from quality import Evaluator, per_layer_key_groups, per_layer_lanes, targets  # noqa: E402

from gdnprune import demo_data  # noqa: E402
from gdnprune.gated_delta_net import GDNPermutation, GDNShape, slice_gated_delta_net_state_dict  # noqa: E402
from gdnprune.io.loading import load_pretrained, slice_model  # noqa: E402
from gdnprune.quality import compensate  # noqa: E402
from gdnprune.quality.lane_search import refine_lane_orders  # noqa: E402
from gdnprune.scoring import GDN_ONLY, score_model, scores_to_permutations  # noqa: E402

NAMES = ("default", "refined", "compensated", "refined+comp.", "sequential", "activation")


def _seq_name(reference: str) -> str:
    return "sequential" if reference == "stream" else f"seq. ({reference} ref.)"


def compensated_loss(ev: Evaluator, perms, target: GDNShape, stats) -> float:
    """Loss after permuting, slicing and refitting every layer's out_proj for ``target``."""
    sd = dict(ev.base_sd)
    for prefix in ev.layers:
        kept = perms[prefix].indices(ev.shape, target=target)["vidx"].numpy()
        weight = ev.base_sd[f"{prefix}.out_proj.weight"].double().numpy()
        columns = compensate.compensated_columns(weight, stats[prefix]["out_moment"], kept)
        slice_gated_delta_net_state_dict(
            sd, prefix=prefix, shape=ev.shape, target=target, permutation=perms[prefix]
        )
        sd[f"{prefix}.out_proj.weight"] = torch.from_numpy(columns).to(
            ev.base_sd[f"{prefix}.out_proj.weight"].dtype
        )
    return ev.loss_of_state_dict(sd, target)


def sequential_loss(
    ev: Evaluator, model, perms, target: GDNShape, batches, reference: str
) -> tuple[float, float]:
    """Loss after cutting in memory and refitting out_proj layer by layer (and the refit's seconds)."""
    model.load_state_dict(ev.base_sd)  # the evaluators' searches load edited weights into this very model
    small = slice_model(model, target, perms)
    t = time.perf_counter()
    compensate.sequential_refit(model, small, batches, reference=reference)
    seconds = time.perf_counter() - t
    return ev.loss_of_state_dict(small.state_dict(), target), seconds


def run_model(name: str, args) -> dict:
    t0 = time.perf_counter()
    if name == "bundled":
        model, corpus = demo_data.load_demo_model()[0], "pydoc"
    else:
        model = load_pretrained(name, dtype=torch.float32).eval()
        corpus = json.loads((Path(name) / "training.json").read_text())["corpus"].get("name", "pydoc")
    cache: dict = {}
    ev = Evaluator(
        model, text=demo_data.validation_text(corpus), windows=args.val_windows, seq_len=256, cache=cache
    )
    sev = Evaluator(
        model, text=demo_data.train_text(corpus), windows=args.search_windows, seq_len=256, cache=cache
    )
    calib = demo_data.byte_windows(demo_data.train_text(corpus), 256, args.calib_samples)
    batches = list(calib.split(4))
    t = time.perf_counter()
    scores = score_model(model, batches, progress=False, blocks=GDN_ONLY)
    cost = {"score": time.perf_counter() - t}
    t = time.perf_counter()
    refined, report = refine_lane_orders(model, batches[: args.refine_batches], scores, progress=False)
    cost["refine"] = time.perf_counter() - t
    t = time.perf_counter()
    stats = compensate.collect_statistics(model, batches)
    cost["statistics"] = time.perf_counter() - t
    orders = {
        "default": scores_to_permutations(scores),
        "refined": scores_to_permutations(refined),
        "activation": scores_to_permutations(
            score_model(model, batches, method="activation", progress=False, blocks=GDN_ONLY)
        ),
    }
    gen = torch.Generator().manual_seed(args.seed)
    randoms = [
        {p: GDNPermutation.random(ev.shape, generator=gen) for p in ev.layers}
        for _ in range(args.random_orders)
    ]
    s = ev.shape
    combined = GDNShape(
        max(1, s.num_key_heads * 3 // 4),
        max(1, s.num_key_heads * 3 // 4) * max(1, s.value_heads_per_group // 2),
        s.key_head_dim * 3 // 4,
        s.value_head_dim * 3 // 4,
    )
    rows = []
    for axis, label, target in targets(s, combined):
        row = {"axis": axis, "label": label, "target": target.as_dict(), "methods": {}}
        for n in ("default", "refined", "activation"):
            row["methods"][n] = ev.loss(orders[n], target) - ev.base
        row["methods"]["compensated"] = compensated_loss(ev, orders["default"], target, stats) - ev.base
        row["methods"]["refined+comp."] = compensated_loss(ev, orders["refined"], target, stats) - ev.base
        for reference in args.references.split(","):
            value, seconds = sequential_loss(ev, model, orders["default"], target, batches, reference)
            row["methods"][_seq_name(reference)] = value - ev.base
            cost.setdefault("sequential", []).append(seconds)
        row["random"] = [ev.loss(perms, target) - ev.base for perms in randoms]
        row["optimum"] = None
        if not args.no_optimum and axis in ("key_groups", "value_lanes"):
            search = per_layer_key_groups if axis == "key_groups" else per_layer_lanes
            keep = target.num_key_heads if axis == "key_groups" else target.value_heads_per_group
            row["optimum"] = ev.loss(search(sev, keep), target) - ev.base
        rows.append(row)
        print(f"  {name} {label}: done ({time.perf_counter() - t0:.0f} s)", flush=True)
    return {
        "model": name,
        "corpus": corpus,
        "shape": s.as_dict(),
        "layers": len(ev.layers),
        "base_loss": ev.base,
        "cost_seconds": cost,
        "refine_forwards": report["forwards"],
        "rows": rows,
    }


def _gap(row, value):
    mean = statistics.fmean(row["random"])
    if row["optimum"] is None or mean - row["optimum"] <= 1e-9:
        return None
    return (mean - value) / (mean - row["optimum"])


def print_model(result: dict) -> None:
    s = result["shape"]
    c = result["cost_seconds"]
    print(
        f"\n{result['model']}: {result['layers']} GDN layers, Hk {s['num_key_heads']} Hv {s['num_value_heads']} "
        f"dk {s['key_head_dim']} dv {s['value_head_dim']}, corpus {result['corpus']}, base loss "
        f"{result['base_loss']:.4f}; cost: score {c['score']:.1f} s, refine {c['refine']:.1f} s "
        f"({result['refine_forwards']} partial forwards), statistics {c['statistics']:.1f} s, sequential refit "
        f"{statistics.fmean(c['sequential']):.1f} s per target"
    )
    methods = result["rows"][0]["methods"]
    names = [*(n for n in NAMES if n in methods), *(n for n in methods if n not in NAMES)]
    header = ["target", *names, "random mean", "optimum", "beaten (def/ref)", "gap (def/ref)"]
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for row in result["rows"]:
        m = row["methods"]
        beaten = [sum(m[n] < x for x in row["random"]) / len(row["random"]) for n in ("default", "refined")]
        gaps = [_gap(row, m[n]) for n in ("default", "refined")]
        cells = [
            row["label"],
            *(f"{m[n]:.3f}" for n in names),
            f"{statistics.fmean(row['random']):.3f}",
            "–" if row["optimum"] is None else f"{row['optimum']:.3f}",
            " / ".join(f"{b:.0%}" for b in beaten),
            " / ".join("–" if g is None else f"{g:.0%}" for g in gaps),
        ]
        print("| " + " | ".join(cells) + " |")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="bundled", help="comma-separated: bundled and/or model folders")
    p.add_argument("--calib-samples", type=int, default=64)
    p.add_argument(
        "--refine-batches", type=int, default=4, help="calibration batches of 4 windows for refine (4)"
    )
    p.add_argument("--val-windows", type=int, default=32)
    p.add_argument("--search-windows", type=int, default=16)
    p.add_argument("--random-orders", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-optimum", action="store_true")
    p.add_argument(
        "--references",
        default="stream",
        help="comma-separated references of the sequential refit: stream (the 'sequential' column), "
        "full, cut (default stream)",
    )
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    print(f"load average {os.getloadavg()[0]:.1f}; threads {args.threads}")
    results = []
    for name in args.models.split(","):
        results.append(run_model(name.strip(), args))
        print_model(results[-1])
        if args.json:
            args.json.write_text(json.dumps(results, indent=1))
    half_lanes = [
        r for res in results for r in res["rows"] if r["axis"] == "value_lanes" and "(50%)" in r["label"]
    ]
    combined = [r for res in results for r in res["rows"] if r["axis"] == "combined"]
    print("\nTargets:")
    for n in ("default", "refined"):
        ok = all(
            sum(r["methods"][n] < x for x in r["random"]) / len(r["random"]) >= 0.9
            and (_gap(r, r["methods"][n]) or 0) >= 0.7
            for r in half_lanes
        )
        print(
            f"- lanes at 50% with {n} orders beat >= 90% of random orders and close >= 70% of the gap on every "
            f"model: {'MET' if ok else 'NOT MET'}"
        )
    cut = [
        1 - r["methods"]["compensated"] / r["methods"]["default"]
        for r in combined
        if r["methods"]["default"] > 0
    ]
    print(
        f"- compensation cuts the combined-target loss increase by {statistics.fmean(cut):.0%} on average "
        f"(target >= 25%): {'MET' if statistics.fmean(cut) >= 0.25 else 'NOT MET'} ({', '.join(f'{c:.0%}' for c in cut)})"
    )
    for reference in args.references.split(","):
        name = _seq_name(reference)
        cut = [
            1 - r["methods"][name] / r["methods"]["default"] for r in combined if r["methods"]["default"] > 0
        ]
        print(
            f"- {name} cuts the combined-target loss increase by {statistics.fmean(cut):.0%} on average "
            f"(target >= 25%): {'MET' if statistics.fmean(cut) >= 0.25 else 'NOT MET'} "
            f"({', '.join(f'{c:.0%}' for c in cut)})"
        )
    print(f"load average at the end {os.getloadavg()[0]:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
