#!/usr/bin/env python
"""Recovery of pruned slices of the bundled demo model by distillation (``gdnprune.distill``).

The bundled byte-level Qwen3.5 model (the teacher) is scored with the default method on 64 training
windows, sorted, and sliced to about 50% (2 key heads, 4 value heads, head dims kept) and about 25%
(1 key head, 2 value heads) of its GDN parameters. Each run trains one student with
:func:`gdnprune.distill.distill` with the same recipe (AdamW, lr 1e-3, cosine schedule after 3% warmup,
batch 16 x 256 bytes, seed 0, one CPU thread) and evaluates it on all 176 held-out windows of 256 bytes
of the validation text (the library's ``eval_lm_loss``, equal to ``demo_data.validation_loss`` with
``num_windows=None``; checked at the end of every run). Runs:

* losses: ``kd`` (forward KL, T = 1), ``lm`` (next-byte cross entropy only, no teacher), ``mix``
  (0.5 KD + 0.5 LM), in two data regimes: ``full`` (all 1644 training windows, 411 KiB) and ``small``
  (256 evenly spaced training windows = 64 KiB, 16% of the training text);
* ``scratch``: the 50% architecture from a fresh initialisation, trained with KD the same way;
* ``random``: a slice of a randomly permuted model (seeded random orders on every axis), distilled;
* ``plan``: the sorted model cut by the plan search (``gdnprune.plan.plan_model``, measured sensitivity on
  16 calibration windows, head dims in quarters) to the same share of GDN parameters as the uniform slice,
  every layer at its own width (the plan is cached beside the results);
* ``50-kd-full-long``: the default loss for ``--long-steps`` steps with evaluations every 100 steps, the
  share of the pruning loss increase recovered after 100, 300 and 1000 steps of that schedule.

"recovered" = (sliced - after) / (sliced - teacher), on the held-out windows. Results go to a JSON file
per run (``--results``, default ``$TMPDIR/gdnprune_recovery``), so runs can be split over processes and
re-reported; BENCHMARKS.md ("Recovery") has the figures::

    python benchmarks/recovery.py                              # every run, about 80 min of one CPU core
    python benchmarks/recovery.py --runs 50-kd-full 50-lm-full # some runs
    python benchmarks/recovery.py --report                     # the table from the saved results
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

from gdnprune import demo_data  # noqa: E402
from gdnprune.distill import distill  # noqa: E402
from gdnprune.gated_delta_net import GDNPermutation, GDNShape, slice_gated_delta_net_state_dict  # noqa: E402
from gdnprune.io.loading import slice_model  # noqa: E402
from gdnprune.model.layouts import find_gdn_modules  # noqa: E402
from gdnprune.plan import plan_model  # noqa: E402
from gdnprune.scoring import GDN_ONLY, score_model  # noqa: E402

SLICES = {"50": GDNShape(2, 4, 32, 32), "25": GDNShape(1, 2, 32, 32)}
LOSSES = {"kd": (1.0, 0.0), "lm": (0.0, 1.0), "mix": (0.5, 0.5)}
# name -> (slice, student: sorted | random | scratch, data: full | small, loss, long run?)
RUNS = {
    "50-kd-full-long": ("50", "sorted", "full", "kd", True),
    "50-kd-full": ("50", "sorted", "full", "kd", False),
    "50-lm-full": ("50", "sorted", "full", "lm", False),
    "50-mix-full": ("50", "sorted", "full", "mix", False),
    "50-kd-small": ("50", "sorted", "small", "kd", False),
    "50-lm-small": ("50", "sorted", "small", "lm", False),
    "50-mix-small": ("50", "sorted", "small", "mix", False),
    "50-scratch-kd-full": ("50", "scratch", "full", "kd", False),
    "50-random-kd-full": ("50", "random", "full", "kd", False),
    "25-kd-full": ("25", "sorted", "full", "kd", False),
    "25-lm-small": ("25", "sorted", "small", "lm", False),
    "25-kd-small": ("25", "sorted", "small", "kd", False),
    "25-random-kd-full": ("25", "random", "full", "kd", False),
    "50-plan-kd-full": ("50", "plan", "full", "kd", False),
    "50-plan-kd-small": ("50", "plan", "small", "kd", False),
    "25-plan-kd-full": ("25", "plan", "full", "kd", False),
    "25-plan-kd-small": ("25", "plan", "small", "kd", False),
}
SEQ_LEN, BATCH, LR, WARMUP, SEED = 256, 16, 1e-3, 0.03, 0


def student_for(teacher, shape: GDNShape, target: GDNShape, kind: str, orders):
    """The student: the sorted (or randomly permuted) teacher sliced to ``target``, or a fresh model."""
    small_config = target.apply_to_config(teacher.config)
    if kind == "scratch":
        torch.manual_seed(SEED)
        return type(teacher)(small_config)
    if kind == "random":
        g = torch.Generator().manual_seed(SEED + 1)
        orders = {p: GDNPermutation.random(shape, generator=g) for p, _ in find_gdn_modules(teacher)}
    state = dict(teacher.state_dict())
    for prefix, _ in find_gdn_modules(teacher):
        slice_gated_delta_net_state_dict(
            state, prefix=prefix, shape=shape, target=target, permutation=orders[prefix]
        )
    student = type(teacher)(small_config)
    student.load_state_dict(state, strict=True)
    return student


def plan_student(teacher, shape: GDNShape, target: GDNShape, scores: dict, calibration, results: Path):
    """The sorted teacher cut by the plan search to at most as many GDN parameters as the uniform ``target``
    slice (the plan is cached in ``results``); returns the student and the plan."""
    path = results / f"plan-{target.num_key_heads}-{target.num_value_heads}.json"
    if path.exists():
        plan = json.loads(path.read_text())
    else:
        uniform = slice_model(teacher, target)
        budget = sum(p.numel() for _, m in find_gdn_modules(uniform) for p in m.parameters())
        plan, _ = plan_model(
            teacher,
            list(calibration[:16].split(4)),
            scores,
            budget_gdn_params=budget,
            dim_step="1/4",
            blocks=["gdn"],
            progress=False,
        )
        results.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(plan, indent=1))
    return slice_model(teacher, plan["layers"], scores["layers"]), plan


def run_one(name: str, steps: int, long_steps: int, results: Path) -> dict:
    slice_name, kind, data_name, loss, long = RUNS[name]
    teacher, _ = demo_data.load_demo_model()
    layers = find_gdn_modules(teacher)
    shape = GDNShape.from_module(layers[0][1])
    calibration = demo_data.byte_windows(demo_data.train_text(), SEQ_LEN, 64)
    scores = score_model(teacher, list(calibration.split(8)), progress=False, seed=SEED, blocks=GDN_ONLY)
    orders = {p: GDNPermutation.from_score_payload(scores["layers"][p], shape) for p, _ in layers}
    if kind == "plan":
        student, plan = plan_student(teacher, shape, SLICES[slice_name], scores, calibration, results)
        uniform = student_for(teacher, shape, SLICES[slice_name], "sorted", orders)
        uniform_start = demo_data.validation_loss(uniform, num_windows=None, seq_len=SEQ_LEN)
    else:
        student, plan, uniform_start = (
            student_for(teacher, shape, SLICES[slice_name], kind, orders),
            None,
            None,
        )
    train = demo_data.byte_windows(demo_data.train_text(), SEQ_LEN, 256 if data_name == "small" else None)
    held_out = demo_data.byte_windows(demo_data.validation_text(), SEQ_LEN)
    kd_weight, lm_weight = LOSSES[loss]
    n = long_steps if long else steps
    cpu, wall = time.process_time(), time.perf_counter()
    result = distill(
        student,
        teacher,
        train,
        steps=n,
        batch_size=BATCH,
        lr=LR,
        warmup=WARMUP,
        seed=SEED,
        kd_weight=kd_weight,
        lm_weight=lm_weight,
        eval_data=held_out,
        eval_every=100,
        log_every=50,
        progress=False,
    )
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    check = demo_data.validation_loss(student, num_windows=None, seq_len=SEQ_LEN)
    evals = {h["step"]: h for h in result["history"] if "eval_lm_loss" in h}
    record = {
        "name": name,
        "slice": slice_name,
        "target": SLICES[slice_name].as_dict(),
        "student": kind,
        "data": data_name,
        "train_windows": train.shape[0],
        "loss": loss,
        "steps": n,
        "teacher": evals[0]["eval_teacher_lm_loss"],
        "start": evals[0]["eval_lm_loss"],
        "eval_lm_loss": {s: h["eval_lm_loss"] for s, h in evals.items()},
        "eval_kd_loss": {s: h["eval_kd_loss"] for s, h in evals.items()},
        "train_loss": [(h["step"], h["loss"]) for h in result["history"] if "loss" in h],
        "final": evals[n]["eval_lm_loss"],
        "validation_loss_check": check,
        "cpu_s": cpu,
        "wall_s": wall,
        "torch_threads": torch.get_num_threads(),
        "command": " ".join(sys.argv),
        "plan": plan and plan["layers"],
        "uniform_start": uniform_start,
        "gdn_parameters": sum(p.numel() for prefix, m in find_gdn_modules(student) for p in m.parameters()),
    }
    if abs(check - record["final"]) > 1e-4:
        raise RuntimeError(f"{name}: eval_lm_loss {record['final']} != validation_loss {check}")
    results.mkdir(parents=True, exist_ok=True)
    (results / f"{name}.json").write_text(json.dumps(record, indent=1))
    return record


def recovered(r: dict, loss: float, sliced: float) -> float:
    return (sliced - loss) / (sliced - r["teacher"])


def report(results: Path) -> str:
    records = {p.stem: json.loads(p.read_text()) for p in sorted(results.glob("*.json"))}
    if not records:
        return f"no results in {results}"
    # the sorted slice's starting loss is the reference "sliced" loss, also for scratch runs
    sliced = {r["slice"]: r["start"] for r in records.values() if r["student"] == "sorted"}
    sliced.update(
        {
            r["slice"]: r["uniform_start"]
            for r in records.values()
            if r.get("uniform_start") and r["slice"] not in sliced
        }
    )
    lines = [
        "| run | slice | student | data | loss | steps | start | after 100 | after 300 | final | recovered | "
        "CPU s |",
        "|---|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name in [n for n in RUNS if n in records]:
        r = records[name]
        at = {int(k): v for k, v in r["eval_lm_loss"].items()}
        ref = sliced.get(r["slice"], r["start"])
        lines.append(
            f"| {name} | {r['slice']}% | {r['student']} | {r['data']} | {r['loss']} | {r['steps']} | "
            f"{r['start']:.3f} | "
            f"{at.get(100, float('nan')):.3f} | {at.get(300, float('nan')):.3f} | {r['final']:.3f} | "
            f"{recovered(r, r['final'], ref):.1%} | {r['cpu_s']:.0f} |"
        )
    teacher = next(iter(records.values()))["teacher"]
    out = [
        f"teacher {teacher:.4f} nats/byte; sliced (sorted): "
        + ", ".join(f"{k}% {v:.4f}" for k, v in sorted(sliced.items(), reverse=True)),
        "",
        *lines,
    ]
    long = [r for r in records.values() if RUNS.get(r["name"], (0, 0, 0, 0, False))[4]]
    for r in long:
        at = {int(k): v for k, v in r["eval_lm_loss"].items()}
        out += [
            "",
            f"{r['name']}: recovered after "
            + ", ".join(
                f"{s} steps {recovered(r, at[s], r['start']):.1%} ({at[s]:.4f})" for s in sorted(at) if s
            ),
        ]
    return "\n".join(out)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--runs", nargs="*", default=list(RUNS), choices=list(RUNS), help="runs (default: all)"
    )
    parser.add_argument(
        "--steps", type=int, default=300, help="steps of each comparison run (default: %(default)s)"
    )
    parser.add_argument(
        "--long-steps", type=int, default=1000, help="steps of the long run (default: %(default)s)"
    )
    parser.add_argument(
        "--results",
        type=Path,
        default=Path(tempfile.gettempdir()) / "gdnprune_recovery",
        help="folder of per-run JSON results (default: %(default)s)",
    )
    parser.add_argument("--report", action="store_true", help="only print the table of the saved results")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    if not args.report:
        for name in args.runs:
            start = time.perf_counter()
            r = run_one(name, args.steps, args.long_steps, args.results)
            print(
                f"{name}: {r['start']:.4f} -> {r['final']:.4f} nats/byte (teacher {r['teacher']:.4f}), "
                f"{r['cpu_s']:.0f} s CPU, {time.perf_counter() - start:.0f} s wall",
                flush=True,
            )
    print(report(args.results))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
