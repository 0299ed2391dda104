#!/usr/bin/env python
"""Recall and nats/byte of the recall model when each GDN axis is cut, under a state budget, and after
distillation.

The model: ``tests/data/trained/recall``, a byte-level Qwen3.5 with four GatedDeltaNet layers and no
attention layer (so every bit of recall lives in the GDN state), trained on the demo text plus the recall
probes (``scripts/train_demo_model.py --recall-mix 0.75 --induction-init``; see
``tests/data/trained/README.md``). The cuts keep the importance order (one ``score_model`` pass on training
text, or with ``--calibration mix`` on text and training probes) and halve one axis in every layer:

* key heads (``Hk``), value heads (lanes per group), key dim (``dk``), value dim (``dv``);
* ``uniform``: every axis cut (key heads and both dims to 3/4; lanes cannot be cut by a quarter);
* ``state``: ``plan_model(budget_state=0.5)``, the plan's own choice per layer at half the recurrent state.

Each variant is evaluated side by side, in one run, on gdnprune's built-in lm-eval tasks (passkey and MQAR
at ``--lengths``, ``--limit`` documents each; nats per byte on the demo validation text), and the variants of
``--recover`` are distilled from the unpruned model for ``--steps`` steps on the training mix (text windows
and recall probes, the probes' training seed, never an evaluation probe) and evaluated again.

Usage (the numbers in BENCHMARKS.md; one CPU thread)::

    python benchmarks/recall.py --lengths 256,512 --limit 32 --windows 16 --steps 300 --distill-batch 4
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "src"))

from gdnprune import demo_data  # noqa: E402
from gdnprune.distill import DistillConfig, distill  # noqa: E402
from gdnprune.evaluation import probes  # noqa: E402
from gdnprune.evaluation.api import EvalOptions, evaluate_model, task_manager  # noqa: E402
from gdnprune.evaluation.report import markdown_table, recall_curves  # noqa: E402
from gdnprune.evaluation.tasks import write_task_folder  # noqa: E402
from gdnprune.gated_delta_net import GDNPermutation, GDNShape  # noqa: E402
from gdnprune.io.loading import load_pretrained, slice_model  # noqa: E402
from gdnprune.io.plan_file import state_elements  # noqa: E402
from gdnprune.model.layouts import find_gdn_modules  # noqa: E402
from gdnprune.plan import plan_model  # noqa: E402
from gdnprune.scoring import GDN_ONLY, score_model  # noqa: E402

MODEL = REPO / "tests" / "data" / "trained" / "recall"
TRAIN_PROBE_SEED = 1000  # scripts/train_demo_model.py's: the probes the model was trained on


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, default=MODEL)
    p.add_argument("--lengths", default="256,512", help="probe lengths (default 256,512)")
    p.add_argument("--limit", type=int, default=48, help="documents per task (default 48)")
    p.add_argument("--windows", type=int, default=32, help="validation windows of nats_per_byte (default 32)")
    p.add_argument("--steps", type=int, default=300, help="distillation steps (default 300)")
    p.add_argument(
        "--recover",
        default="state,worst,middle",
        help="variants to distil, comma-separated: names, or worst / middle (the axis cut with the lowest / "
        "the median recall at the shortest length, passkey and MQAR averaged; default state,worst,middle)",
    )
    p.add_argument("--distill-batch", type=int, default=8, help="windows per distillation step (default 8)")
    p.add_argument(
        "--calibration",
        choices=["text", "mix"],
        default="text",
        help="data of the importance scores and the state plan: 32 windows of training text (default), or "
        "mix: 16 text windows and 16 training probes",
    )
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--json", type=Path, default=None, help="also write the results here")
    return p.parse_args(argv)


def variants(model, shape: GDNShape, scores: dict, calibration: list[torch.Tensor]) -> dict[str, dict]:
    """Name -> {prefix: target} for every GDN layer (the axis cuts) or the state plan's targets."""
    prefixes = [p for p, _ in find_gdn_modules(model)]
    r = shape.value_heads_per_group
    cuts = {
        "key_heads": GDNShape(
            shape.num_key_heads // 2, shape.num_value_heads // 2, shape.key_head_dim, shape.value_head_dim
        ),
        "value_heads": GDNShape(
            shape.num_key_heads,
            shape.num_key_heads * max(1, r // 2),
            shape.key_head_dim,
            shape.value_head_dim,
        ),
        "key_dim": GDNShape(
            shape.num_key_heads, shape.num_value_heads, shape.key_head_dim // 2, shape.value_head_dim
        ),
        "value_dim": GDNShape(
            shape.num_key_heads, shape.num_value_heads, shape.key_head_dim, shape.value_head_dim // 2
        ),
        "uniform": GDNShape(
            shape.num_key_heads * 3 // 4,
            shape.num_key_heads * 3 // 4 * r,
            shape.key_head_dim * 3 // 4,
            shape.value_head_dim * 3 // 4,
        ),
    }
    out = {name: {p: t for p in prefixes} for name, t in cuts.items()}
    plan, _ = plan_model(
        model, calibration, scores, budget_state=0.5, dim_step="1/4", blocks=["gdn"], progress=False
    )
    out["state"] = dict(plan["layers"])
    return out


def resolve_recover(names: list[str], cut_rows: list, variant_names: list[str]) -> list[str]:
    """``worst`` / ``middle`` -> the axis cut (not the state plan) with the lowest / the median recall at the
    shortest probe length (passkey and MQAR averaged); other names unchanged, each kept once, in order."""
    recall = {}
    for name, row in zip(variant_names, cut_rows, strict=True):
        curves = recall_curves(row)
        recall[name] = sum(points[0][1] for points in curves.values()) / max(1, len(curves))
    axes = sorted((n for n in variant_names if n != "state"), key=lambda n: (recall[n], n))
    picked = {"worst": axes[0], "middle": axes[len(axes) // 2]}
    out: list[str] = []
    for name in names:
        chosen = picked.get(name, name)
        if chosen not in variant_names:
            raise SystemExit(f"--recover: expected variant names or worst/middle, got {name!r}")
        if chosen not in out:
            out.append(chosen)
    return out


def recall_mix(seq_len: int, count: int) -> torch.Tensor:
    """The distillation data: text windows and training probes (passkey, MQAR), interleaved."""
    text = demo_data.byte_windows(demo_data.train_text(), seq_len)
    rows = []
    for i in range(count):
        rows.append(text[i % text.shape[0]])
        kind = "passkey" if i % 2 == 0 else "mqar"
        rows.append(demo_data.text_to_ids(probes.probe(kind, TRAIN_PROBE_SEED, seq_len, 10**6 + i).text))
    return torch.stack(rows)


def state_of(model) -> int:
    return sum(
        state_elements(GDNShape.from_module(m), int(m.conv_kernel_size)) for _, m in find_gdn_modules(model)
    )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    logging.getLogger("lm_eval").setLevel(logging.ERROR)
    start = time.perf_counter()
    lengths = [int(x) for x in args.lengths.split(",")]
    teacher = load_pretrained(args.model, dtype=torch.float32).eval()
    tokenizer = demo_data.build_byte_tokenizer()
    shape = GDNShape.from_module(find_gdn_modules(teacher)[0][1])
    if args.calibration == "text":
        calibration = list(demo_data.byte_windows(demo_data.train_text(), 256, 32).split(8))
    else:  # 16 text windows and 16 training probes, interleaved (never an evaluation probe)
        calibration = list(recall_mix(256, 16).split(8))
    scores = score_model(teacher, calibration, progress=False, seed=0, blocks=GDN_ONLY)
    permutations = {
        p: GDNPermutation.from_score_payload(scores["layers"][p], shape) for p, _ in find_gdn_modules(teacher)
    }
    plans = variants(teacher, shape, scores, calibration)
    recover = [v for v in args.recover.split(",") if v]
    with tempfile.TemporaryDirectory() as tmp:
        text = Path(tmp) / "validation.txt"
        text.write_text(demo_data.validation_text()[: 256 * args.windows], encoding="utf-8")
        folder = write_task_folder(Path(tmp) / "tasks", context_lengths=lengths, data=text)
        options = EvalOptions(
            tasks=list(folder.tasks), limit=args.limit, context_lengths=lengths, batch_size=8
        )
        manager = task_manager(options, folder.path)
        rows, states = (
            [evaluate_model(teacher, tokenizer, options, manager, name="unpruned")],
            {"unpruned": state_of(teacher)},
        )
        cut_models = {}
        for name, targets in plans.items():
            cut = slice_model(teacher, targets, permutations).eval()
            cut_models[name] = cut
            rows.append(evaluate_model(cut, tokenizer, options, manager, name=name))
            states[name] = state_of(cut)
            print(f"{name}: evaluated ({time.perf_counter() - start:.0f} s)", flush=True)
        print(markdown_table(rows), flush=True)
        recover = resolve_recover(recover, rows[1:], list(plans))
        print(f"distilling: {recover}", flush=True)
        data = recall_mix(256, 2000)
        seconds = {}
        for name in recover:
            student = copy.deepcopy(cut_models[name]).train()
            t0 = time.perf_counter()
            config = DistillConfig(
                output_dir=None,
                steps=args.steps,
                batch_size=args.distill_batch,
                lr=1e-3,
                seed=0,
                progress=False,
            )
            distill(student, teacher, data, config)
            seconds[name] = time.perf_counter() - t0
            rows.append(
                evaluate_model(
                    student.eval(), tokenizer, options, manager, name=f"{name} + {args.steps} steps"
                )
            )
            print(f"{name}: distilled in {seconds[name]:.0f} s", flush=True)
            print(markdown_table(rows), flush=True)  # the rows so far, should a later step be cut short
    full_state = states["unpruned"]
    print(
        f"\nrecall model {args.model} ({shape}); {args.limit} documents per task; calibration {args.calibration}"
    )
    print(markdown_table(rows))
    print(
        "state kept (GDN recurrent + conv state per sequence, share of the unpruned model's): "
        + ", ".join(f"{name} {value / full_state:.0%}" for name, value in states.items())
    )
    print("state plan: " + json.dumps(plans["state"]))
    print(f"\ndistillation seconds: {seconds}; total {time.perf_counter() - start:.0f} s")
    if args.json:
        args.json.write_text(
            json.dumps({"rows": [r.to_json() for r in rows], "states": states, "seconds": seconds}, indent=1)
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
