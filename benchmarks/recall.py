#!/usr/bin/env python
"""Recall under pruning: plans that keep it (``--experiment plans``, issue 43) and what each GDN axis costs
(``--experiment axes``, issue 29).

**plans** (the default). The claim: where GDN layers may shrink, the default plan is measured on recall
windows (every calibration window followed by a passkey / MQAR probe of its length, the answers a quarter of
the KL; the scores taken on them too) and keeps the recall that today's plan (``--sensitivity short``, the
calibration windows as they are) loses, at about the same nats/byte. For each model (``--models``: the recall model
``tests/data/trained/recall``, ``GGGG``, and the hybrid ``tests/data/trained/recall_hybrid``, ``GGGA``) and
budget (``--budget-state 0.5``, ``--budget-params 0.5``), ``gdnprune prune``'s own pipeline
(:func:`gdnprune.prune.prune_checkpoint`, its defaults: scores on 128 windows and the plan on 16 windows of
512 bytes of plain training text, no probe in it) makes:

* ``today``: ``--sensitivity short``;
* ``recall-aware``: the default (under ``--budget-state`` with its refit of ``out_proj`` on the recall
  windows; a plan cached before the refit was the default is cut again with it, the plan as it was);
* ``uniform``: the best uniform cut (``--uniform --sensitivity short``: one geometry per kind of block);
* ``keep-recall``: ``--keep-recall 0.9``.

Each is evaluated one-shot and after ``--steps`` distillation steps from the unpruned model (batch 4 x 256
bytes of text and training probes, lr 1e-3, seed 0): passkey and MQAR exact match at ``--lengths`` through
gdnprune's lm-eval tasks (standard errors lm-eval's), nats/byte on ``--windows`` validation windows of 256
bytes (mean and standard error over windows; paired differences against the recall-aware plan). Every step is
cached under ``--work``, so a stopped run resumes.

**windows**: which windows the recall-aware sensitivity is measured on: the recall model's ``--budget-state
0.5`` plan measured on each kind (``--kinds``: the calibration windows as they are; spans of the text written
twice; the windows weighted by the unpruned model's gain from long context; passkey / MQAR probes with the
text as the haystack; the probes with their own filler; the calibration windows with a probe beside each),
one-shot passkey, MQAR and nats/byte (``docs/scoring.md``, "Sensitivity that sees memory").

**axes**: the recall model with each GDN axis halved in every layer (key heads, lanes, key dim, value dim),
a uniform cut and a state plan, one-shot and distilled (the "Recall by GDN axis" table of BENCHMARKS.md).

Usage (one CPU thread)::

    python benchmarks/recall.py --json recall_plans.json
    python benchmarks/recall.py --experiment windows
    python benchmarks/recall.py --experiment axes --lengths 256,512,1024 --limit 32 --windows 16 \
        --steps 300 --distill-batch 4 --recover worst,middle,state
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import json
import logging
import math
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import transformers

os.environ.setdefault("OMP_NUM_THREADS", "1")
REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "src"))
sys.path.insert(0, str(REPO / "benchmarks"))

from _common import load_average, paired  # noqa: E402
from plans import window_losses  # noqa: E402

from gdnprune import demo_data  # noqa: E402
from gdnprune.distill import DistillConfig, distill  # noqa: E402
from gdnprune.evaluation.api import EvalOptions, evaluate_model, task_manager  # noqa: E402
from gdnprune.evaluation.report import markdown_table, recall_curves  # noqa: E402
from gdnprune.evaluation.tasks import write_task_folder  # noqa: E402
from gdnprune.gated_delta_net import GDNPermutation, GDNShape  # noqa: E402
from gdnprune.io.loading import load_pretrained, slice_model  # noqa: E402
from gdnprune.io.plan_file import state_elements  # noqa: E402
from gdnprune.io.scores_file import save_scores  # noqa: E402
from gdnprune.model.layouts import find_gdn_modules  # noqa: E402
from gdnprune.plan import PlanOptions, plan_model  # noqa: E402
from gdnprune.prune import prune_checkpoint  # noqa: E402
from gdnprune.quality import probes  # noqa: E402
from gdnprune.quality.recall_windows import (  # noqa: E402
    RECALL_SHARE,
    context_weights,
    probe_windows,
    span_windows,
)
from gdnprune.scoring import GDN_ONLY, score_checkpoint, score_model  # noqa: E402

TRAINED = REPO / "tests" / "data" / "trained"
MODEL = TRAINED / "recall"
MODELS = {"recall": TRAINED / "recall", "recall_hybrid": TRAINED / "recall_hybrid"}
TRAIN_PROBE_SEED = 1000  # scripts/train_demo_model.py's: the probes the model was trained on
#: the plans compared: their PlanOptions besides the budget
PLANS = {
    "today": dict(sensitivity="short"),
    "recall-aware": {},
    "uniform": dict(sensitivity="short", uniform=True),
    "keep-recall": dict(keep_recall=0.9),
}
BUDGETS = {"state": dict(budget_state=0.5), "params": dict(budget_params=0.5)}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--experiment", choices=["plans", "axes", "windows"], default="plans")
    p.add_argument(
        "--kinds",
        default="calibration,spans,context,probes-text,probes-filler,probes-alongside,"
        "probes-alongside+scores,probes-alongside:0.25+scores",
        help="windows: the kinds of windows compared (NAME or NAME:SHARE)",
    )
    p.add_argument("--models", default="recall,recall_hybrid", help="plans: models (default both)")
    p.add_argument("--budgets", default="state,params", help="plans: budgets (default state,params)")
    p.add_argument("--plans", default=",".join(PLANS), help=f"plans: plans (default {','.join(PLANS)})")
    p.add_argument("--work", type=Path, default=REPO / "benchmarks" / "_work" / "recall_plans")
    p.add_argument("--model", type=Path, default=MODEL, help="axes: the model")
    p.add_argument("--lengths", default="256,512", help="probe lengths (default 256,512)")
    p.add_argument("--limit", type=int, default=48, help="documents per task (default 48)")
    p.add_argument("--windows", type=int, default=32, help="validation windows of nats_per_byte (default 32)")
    p.add_argument(
        "--steps", type=int, default=300, help="distillation steps (default 300; 0: one-shot only)"
    )
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
        model,
        calibration,
        scores,
        budget_state=0.5,
        dim_step="1/4",
        blocks=["gdn"],
        sensitivity="short",  # the table's plan: measured on the calibration windows as they were
        progress=False,
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


def axes(args: argparse.Namespace) -> int:
    """The recall model with each GDN axis halved, a uniform cut and a state plan (issue 29)."""
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
        folder = write_task_folder(
            Path(tmp) / "tasks", context_lengths=lengths, data=text, kinds=("passkey", "mqar")
        )
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


# ---- plans (issue 43) -----------------------------------------------------------------------------------------


def _cached(path: Path, make) -> dict:
    """``make()``'s JSON value, computed once and kept at ``path`` (written whole, then renamed)."""
    if path.is_file():
        return json.loads(path.read_text())
    value = make()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(value, indent=1, default=float))
    tmp.replace(path)
    return value


def _scores(folder: Path, data: Path, budget: str, plan: str, work: Path) -> Path:
    """The scores file ``gdnprune prune`` computes for the budget and plan (GDN layers only under a state
    budget; on recall windows where the plan is measured on them)."""
    recall = PlanOptions(**BUDGETS[budget], **PLANS[plan]).recall()
    path = work / f"scores_{budget}{'_recall' if recall else ''}.json"
    if not path.is_file():
        blocks = GDN_ONLY if budget == "state" else None
        scores = score_checkpoint(folder, data, blocks=blocks, recall=recall, progress=False)
        path.parent.mkdir(parents=True, exist_ok=True)
        save_scores(scores, path)
    return path


def _prune(folder: Path, data: Path, budget: str, plan: str, scores: Path, work: Path) -> tuple[Path, dict]:
    """``gdnprune prune FOLDER --data DATA --scores SCORES --budget-... 0.5 [plan's flags]``, kept."""
    out = work / "pruned"

    def run() -> dict:
        start = time.perf_counter()
        manifest = prune_checkpoint(
            folder,
            data,
            out,
            scores=scores,
            search=PlanOptions(**BUDGETS[budget], **PLANS[plan]),
            progress=False,
            overwrite=True,
        )
        return {
            "seconds": time.perf_counter() - start,
            "load": load_average(),
            "plan": manifest["plan"],
            "report": manifest.get("plan_report", {}),
            "refit": {"windows": manifest.get("compensation_windows")},
        }

    record = _cached(work / "prune.json", run)
    options = PlanOptions(**BUDGETS[budget], **PLANS[plan])
    if (
        options.recall() and not options.whole() and "refit" not in record
    ):  # cut before the default refit: the same plan cut again
        start = time.perf_counter()
        before = json.loads((out / "gdnprune.json").read_text())
        fields = ("head_dim",)  # a manifest's attention target also names what a plan does not cut
        targets = {
            p: {k: v for k, v in e["target"].items() if k not in fields}
            for group in ("layers", "blocks")
            for p, e in before.get(group, {}).items()
        }
        manifest = prune_checkpoint(
            folder,
            data,
            out,
            scores=scores,
            plan={"format": "gdnprune-plan", "version": 2, "layers": targets},
            compensate="sequential",  # the default's refit (on the recall windows of the recall scores)
            progress=False,
            overwrite=True,
        )
        record["refit"] = {
            "windows": manifest["compensation_windows"],
            "seconds": time.perf_counter() - start,
        }
        (work / "prune.json").write_text(json.dumps(record, indent=1, default=float))
    manifest = json.loads((out / "gdnprune.json").read_text())
    record["layers"] = {prefix: layer["target"] for prefix, layer in manifest["layers"].items()}
    return out, record


def _measure(model, tokenizer, options, manager, validation: torch.Tensor, name: str) -> dict:
    """A model's probe results (lm-eval's, with standard errors) and nats/byte per validation window."""
    model.eval()
    row = evaluate_model(model, tokenizer, options, manager, name=name)
    state = state_of(model)
    return {
        "results": row.results,
        "parameters": row.parameters,
        "state": state,
        "losses": window_losses(model, validation).tolist(),
    }


def _distilled(student, teacher, steps: int, batch: int, data: torch.Tensor):
    config = DistillConfig(output_dir=None, steps=steps, batch_size=batch, lr=1e-3, seed=0, progress=False)
    distill(student.train(), teacher, data, config)
    return student.eval()


def _one_plan(ctx: argparse.Namespace, source: Path, teacher, budget: str, plan: str, where: Path) -> dict:
    """One plan of one model at one budget: pruned, measured one-shot, distilled and measured again."""
    pruned, record = _prune(source, ctx.data, budget, plan, ctx.scores, where)
    cut = load_pretrained(pruned, dtype=torch.float32).eval()

    def one_shot() -> dict:
        return _measure(cut, ctx.tokenizer, ctx.options, ctx.manager, ctx.validation, plan)

    def recovered() -> dict:
        begin = time.perf_counter()
        model = _distilled(cut, teacher, ctx.steps, ctx.distill_batch, ctx.distill_data)
        seconds = time.perf_counter() - begin
        measured = _measure(model, ctx.tokenizer, ctx.options, ctx.manager, ctx.validation, plan)
        return {**measured, "distill_seconds": seconds, "load": load_average()}

    # the same pruned weights (keep-recall met at once is the recall-aware plan) are measured once
    key = hashlib.sha256((pruned / "model.safetensors").read_bytes()).hexdigest()[:16]
    same = where.parent / "by_plan" / key
    first = _cached(same / "one_shot.json", one_shot)
    after = _cached(same / f"distilled_{ctx.steps}.json", recovered) if ctx.steps else None
    return {"one-shot": first, "distilled": after, "prune": record}


def _cell(value: float, stderr: float | None) -> str:
    return f"{value:.2f}" if stderr is None else f"{value:.2f} ± {stderr:.2f}"


def _recall(result: dict, kind: str, length: int) -> tuple[float, float]:
    metrics = result["results"][f"{kind}_{length}"]
    return float(metrics["acc,none"]), float(metrics.get("acc_stderr,none") or 0.0)


def _row(label: str, result: dict, unpruned: dict, lengths: list[int]) -> str:
    cells = [label, f"{result['parameters']:,}", f"{result['state'] / unpruned['state']:.0%}"]
    for kind in ("passkey", "mqar"):
        cells += [_cell(*_recall(result, kind, n)) for n in lengths]
    losses = np.asarray(result["losses"])
    cells.append(_cell(float(losses.mean()), float(losses.std(ddof=1) / math.sqrt(len(losses)))))
    d, se = paired(losses, np.asarray(unpruned["losses"]))
    cells.append(f"{d:+.3f} ± {se:.3f}")
    return "| " + " | ".join(cells) + " |"


def _verdicts(results: dict, lengths: list[int]) -> list[str]:
    """The issue's targets, each met or missed with its numbers."""
    out = []
    n = lengths[0]
    recall = results.get("recall", {})
    base = recall.get("unpruned")
    state = recall.get("state", {}).get("recall-aware", {}).get("one-shot")
    if base and state:
        pk, mq = _recall(state, "passkey", n)[0], _recall(state, "mqar", n)[0]
        pk0, mq0 = _recall(base, "passkey", n)[0], _recall(base, "mqar", n)[0]
        d, se = paired(np.asarray(state["losses"]), np.asarray(base["losses"]))
        out.append(
            f"recall model, default prune --budget-state 0.5, one-shot at {n}: passkey {pk:.2f} = {pk / pk0:.2f}x "
            f"(target >= 0.75x: {'met' if pk >= 0.75 * pk0 else 'MISSED'}), MQAR {mq:.2f} = {mq / mq0:.2f}x "
            f"(target >= 0.5x: {'met' if mq >= 0.5 * mq0 else 'MISSED'}), nats/byte {d:+.3f} ± {se:.3f} "
            f"(target <= +0.10: {'met' if d <= 0.10 else 'MISSED'})"
        )
    hybrid = results.get("recall_hybrid", {})
    for budget, plans_ in hybrid.items():
        if budget == "unpruned" or not {"today", "recall-aware", "uniform"} <= set(plans_):
            continue
        ours, today, uniform = (plans_[k]["one-shot"] for k in ("recall-aware", "today", "uniform"))
        for kind in ("passkey", "mqar"):
            a, sa = _recall(ours, kind, n)
            b, sb = _recall(today, kind, n)
            z = (a - b) / max(math.hypot(sa, sb), 1e-12)
            out.append(
                f"hybrid, {budget} 0.5, {kind} at {n}: recall-aware {a:.2f} vs today {b:.2f}: {z:+.1f} SE "
                f"(target >= 2: {'met' if z >= 2 else 'MISSED'})"
            )
        d, se = paired(np.asarray(ours["losses"]), np.asarray(uniform["losses"]))
        out.append(
            f"hybrid, {budget} 0.5: nats/byte recall-aware - best uniform {d:+.4f} ± {se:.4f} "
            f"(target <= +1 SE: {'met' if d <= se else 'MISSED'})"
        )
    return out


# long: one loop over models, budgets and plans, each step cached
def plans(args: argparse.Namespace) -> int:
    """The plans of issue 43 side by side, one-shot and distilled."""
    start = time.perf_counter()
    lengths = [int(x) for x in args.lengths.split(",")]
    names = [m for m in args.models.split(",") if m]
    budgets = [b for b in args.budgets.split(",") if b]
    wanted = [p for p in args.plans.split(",") if p]
    tokenizer = demo_data.build_byte_tokenizer()
    args.work.mkdir(parents=True, exist_ok=True)
    data = args.work / "train.txt"
    if not data.is_file():
        data.write_text(demo_data.train_text(), encoding="utf-8")
    validation = demo_data.byte_windows(demo_data.validation_text(), 256, args.windows)
    distill_data = recall_mix(256, 2000)
    results: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        folder = write_task_folder(Path(tmp) / "tasks", context_lengths=lengths, kinds=("passkey", "mqar"))
        options = EvalOptions(
            tasks=list(folder.tasks), limit=args.limit, context_lengths=lengths, batch_size=8
        )
        ctx = argparse.Namespace(
            data=data,
            tokenizer=tokenizer,
            options=options,
            manager=task_manager(options, folder.path),
            validation=validation,
            steps=args.steps,
            distill_batch=args.distill_batch,
            distill_data=distill_data,
        )
        for name in names:
            source, work = MODELS[name], args.work / name
            teacher = load_pretrained(source, dtype=torch.float32).eval()
            unpruned = work / "unpruned.json"
            if not unpruned.is_file():
                _cached(
                    unpruned,
                    lambda m=teacher: _measure(m, tokenizer, options, ctx.manager, validation, "unpruned"),
                )
            results[name] = {"unpruned": json.loads(unpruned.read_text())}
            for budget in budgets:
                for plan in wanted:
                    ctx.scores = _scores(source, data, budget, plan, work)
                    entry = _one_plan(ctx, source, teacher, budget, plan, work / budget / plan)
                    results[name].setdefault(budget, {})[plan] = entry
                    print(f"{name} {budget} {plan}: done ({time.perf_counter() - start:.0f} s)", flush=True)
    print(f"\nload average {load_average():.1f}; {time.perf_counter() - start:.0f} s")
    for name in names:
        unpruned = results[name]["unpruned"]
        head = ["plan", "parameters", "state kept"]
        head += [f"{k} {n}" for k in ("passkey", "MQAR") for n in lengths] + ["nats/byte", "Δ nats/byte"]
        print(f"\n{name}\n\n| " + " | ".join(head) + " |\n|" + "---|" * len(head))
        print(_row("unpruned", unpruned, unpruned, lengths))
        for budget in budgets:
            for plan in wanted:
                entry = results[name][budget][plan]
                print(_row(f"{budget} 0.5 {plan}", entry["one-shot"], unpruned, lengths))
                if entry["distilled"] is not None:
                    print(_row(f"{budget} 0.5 {plan} + {args.steps}", entry["distilled"], unpruned, lengths))
        for budget in budgets:
            for plan in wanted:
                print(f"{name} {budget} {plan}: {json.dumps(results[name][budget][plan]['prune']['layers'])}")
    print()
    for line in _verdicts(results, lengths):
        print(line)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1, default=float))
    return 0


# ---- windows (issue 43: which windows the recall-aware sensitivity is measured on) ----------------------------


def _window_kinds(teacher, batches: list, kind: str) -> list:
    """The plan's calibration batches made into one candidate kind of recall windows (``NAME`` or
    ``NAME:SHARE``; a trailing ``+scores`` is the scores')."""
    name, _, share_text = kind.removesuffix("+scores").partition(":")
    share = float(share_text or RECALL_SHARE)
    tokenizer = demo_data.build_byte_tokenizer()
    if name == "calibration":
        return batches
    if name == "spans":
        return span_windows(batches, share=share)
    if name == "context":
        return context_weights(teacher, batches, share=share)
    if name == "probes-text":
        return probe_windows(batches, tokenizer, share=share)
    if name == "probes-filler":
        return probe_windows(batches, tokenizer, share=share, haystack=False)
    if name == "probes-alongside":
        return probe_windows(batches, tokenizer, share=share, haystack=False, alongside=True)
    raise SystemExit(f"--kinds: unknown kind {kind!r}")


@torch.no_grad()
def _exact(model, kind: str, count: int, length: int = 256) -> tuple[float, float]:
    """Greedy exact match (mean, standard error) of the first ``count`` evaluation probes (seed 0)."""
    hits = []
    for i in range(count):
        made = probes.probe(kind, 0, length, i)
        ids = demo_data.text_to_ids(made.text)[None]
        greedy = model(input_ids=ids, use_cache=False).logits[0].argmax(-1)
        for q in made.queries:
            a, n = len(q.context), len(q.answer)
            hits.append(bool((greedy[a - 1 : a - 1 + n] == ids[0, a : a + n]).all()))
    return float(np.mean(hits)), float(np.std(hits, ddof=1) / math.sqrt(len(hits)))


def windows(args: argparse.Namespace) -> int:
    """The recall model's ``--budget-state 0.5`` plan measured on each kind of windows (``--kinds``): scores
    on 32 text windows of 256 bytes, the plan on 16 of 512, passkey (32 probes) and MQAR (4 probes, 32
    queries) at 256 characters, nats/byte on 16 validation windows."""
    teacher = load_pretrained(args.model, dtype=torch.float32).eval()
    teacher.config.use_cache = False
    calibration = list(demo_data.byte_windows(demo_data.train_text(), 256, 32).split(8))
    scores = score_model(teacher, calibration, progress=False, seed=0, blocks=GDN_ONLY)
    permutations = {
        p: GDNPermutation.from_score_payload(scores["layers"][p], GDNShape.from_module(m))
        for p, m in find_gdn_modules(teacher)
    }
    batches = list(demo_data.byte_windows(demo_data.train_text(), 512, 16).split(4))

    def measured(model) -> str:
        pk, mq = _exact(model, "passkey", 32), _exact(model, "mqar", 4)
        nats = demo_data.validation_loss(model, seq_len=256, num_windows=16)
        return f"passkey {pk[0]:.2f} ± {pk[1]:.2f} | MQAR {mq[0]:.2f} ± {mq[1]:.2f} | nats/byte {nats:.3f}"

    print(f"unpruned | {measured(teacher)}", flush=True)
    for kind in args.kinds.split(","):
        begin = time.perf_counter()
        # "+scores": the orders too from the scoring windows made recall windows of the same kind
        ordered, orders = scores, permutations
        if kind.endswith("+scores"):
            ordered = score_model(
                teacher, _window_kinds(teacher, calibration, kind), progress=False, seed=0, blocks=GDN_ONLY
            )
            orders = {
                p: GDNPermutation.from_score_payload(ordered["layers"][p], GDNShape.from_module(m))
                for p, m in find_gdn_modules(teacher)
            }
        plan, _ = plan_model(
            teacher,
            _window_kinds(teacher, batches, kind),
            ordered,
            budget_state=0.5,
            blocks=["gdn"],
            sensitivity="short",  # the windows as given
            progress=False,
        )
        cut = slice_model(teacher, plan["layers"], orders).eval()
        cut.config.use_cache = False
        first = plan["layers"]["model.layers.0.linear_attn"]
        print(
            f"{kind} | {measured(cut)} | layer 0 {json.dumps(first)} | {time.perf_counter() - begin:.0f} s, "
            f"load {load_average():.1f}",
            flush=True,
        )
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    logging.getLogger("lm_eval").setLevel(logging.ERROR)
    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()
    return {"axes": axes, "plans": plans, "windows": windows}[args.experiment](args)


if __name__ == "__main__":
    raise SystemExit(main())
