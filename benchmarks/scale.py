"""Cost growth at the counts of the published models, measured beside what ``gdnprune estimate`` predicts.

Claim (issue 41): every stage of the pipeline runs at the real counts of the Qwen hybrid family (48-60 layers,
up to 512 routed experts; gdnprune.model.family), its cost grows with its work (time and memory against
parameters, layers and experts, fitted on log-log axes), and ``gdnprune estimate`` predicts each stage within
30 % at the measured points.

What it runs, each stage a CLI call in a child process of its own (wall time, CPU seconds, peak RSS: VmHWM):

* ``prune``: ``prune --budget-params 0.5`` at every growth point (the issue's targets; first, the long part);
* ``growth``: Qwen3-Next-80B-A3B's counts scaled 1/8, 1/4, 1/2 and 1 (8 to 48 layers, 64 to 512 experts) at
  tiny widths (hidden 64, head dims 8, expert width 8), and the 4-layer, 8-expert model of the same widths;
  stages inspect, score, slice (half the GDN key heads), distill (1 process, 2 steps, on the slice), eval,
  bench, stage by stage; 4 calibration windows of 32 tokens,
  the plan on 1 of them with ``--dim-step 1/2`` (the default 1/8 grid makes 2,048 candidates per GDN layer
  here: ``gdnprune estimate`` says what that costs);
* ``widths``: random weights at the real widths of the smallest dense members (Qwen3.5-0.8B: hidden 1024;
  Qwen3.5-2B: hidden 2048) at 1/8 and 1/4 of their layers: inspect, score, slice, distill, bench (the plan's
  prediction is printed beside them);
* ``members``: every family member's real-count model end to end (inspect, score, prune --budget-params 0.5,
  distill under FSDP2 on 2 processes, eval, bench): pass or fail, and the times (``--members A,B``: only those,
  in that order);
* ``predictions``: the GPU predictions for Qwen3.5-9B, 27B and 397B-A17B on 1 and 8 H100s (markdown).

Every result is kept in ``benchmarks/_work/scale/results*.json`` (a rerun skips what is there: ``--redo`` runs it
again; ``--results`` names the file of a run beside another), with the load average when it ran; ``--plot`` draws ``docs/benchmarks/img/scale.png``; ``--fit``
prints the CPU's fixed costs (per call, per tensor, per byte, the starts: ``FITTED``) that fit the measurements
best, for the ``cpu`` entry of gdnprune/estimate/devices.py (its matrix rates are measured on products).

    nice -n 10 .venv/bin/python -m benchmarks scale prune widths growth members --plot
    .venv/bin/python -m benchmarks scale predictions
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from dataclasses import replace
from fractions import Fraction
from pathlib import Path

from _common import REPO, child_env, load_average

from gdnprune.demo_data import train_text, validation_text
from gdnprune.estimate.devices import DEVICES, Device
from gdnprune.estimate.inventory import ModelFacts, model_facts
from gdnprune.estimate.stages import RunOptions, stage_costs
from gdnprune.model.family import MEMBERS, member, real_config, tiny_config

WORK = REPO / "benchmarks" / "_work" / "scale"
IMG = REPO / "docs" / "benchmarks" / "img" / "scale.png"
#: the options every measured point runs with (small windows: the point is the growth, not the quality)
SAMPLES, PLAN_SAMPLES, SEQ, BATCH, STEP = 4, 1, 32, 2, "1/2"
OPTIONS = RunOptions(
    dim_step=Fraction(STEP),
    num_samples=SAMPLES,
    seq_len=SEQ,
    batch_size=BATCH,
    plan_samples=PLAN_SAMPLES,
    steps=2,
    distill_batch_size=2,
    distill_seq_len=SEQ,
    eval_tokens=128,
    workloads=(("prefill", 1, 32), ("decode", 1, 32)),
    repeats=2,
)
GROWTH = (
    ("next-4x8", 1 / 64),
    ("next-8th", 1 / 8),
    ("next-4th", 1 / 4),
    ("next-half", 1 / 2),
    ("next-full", 1.0),
)
GROWTH_STAGES = ("inspect", "score", "slice", "distill", "eval", "bench")  # prune: its own part, first
WIDTHS = (
    ("0.8B-8th", "Qwen3.5-0.8B", 1 / 8),
    ("0.8B-4th", "Qwen3.5-0.8B", 1 / 4),
    ("2B-8th", "Qwen3.5-2B", 1 / 8),
)

_CHILD = """
import json, resource, sys, time
argv = json.loads(sys.argv[1])
start = time.perf_counter()
from gdnprune.cli import main
code = main(argv)
usage = resource.getrusage(resource.RUSAGE_SELF)
# VmHWM, not ru_maxrss: a child's ru_maxrss keeps the peak of the parent it was forked from
hwm = [line for line in open("/proc/self/status") if line.startswith("VmHWM:")]
print("SCALE-RESULT " + json.dumps({"code": code, "seconds": time.perf_counter() - start,
      "cpu": usage.ru_utime + usage.ru_stime, "rss": int(hwm[0].split()[1]) * 1024 if hwm else usage.ru_maxrss * 1024}))
"""


def _cpu(r: dict) -> float:
    """The CPU seconds of a measured stage (user + system, its process alone): what the fits, the plot and the
    estimate's validation use, since the wall time of a shared 2-core machine under a load of 5-11 measures
    the other jobs as much as this one."""
    return r.get("cpu", r["seconds"])


RESULTS = "results.json"


def _results() -> dict:
    """Every measured point, from each ``results*.json`` under WORK (runs of several parts side by side each
    keep their own file: ``--results``)."""
    out: dict = {}
    for path in sorted(WORK.glob("results*.json")):
        out.update(json.loads(path.read_text()))
    return out


def _save(results: dict) -> None:
    WORK.mkdir(parents=True, exist_ok=True)
    tmp = WORK / (RESULTS + ".tmp")
    tmp.write_text(json.dumps(results, indent=1, sort_keys=True))
    os.replace(tmp, WORK / RESULTS)


def _stage(argv: list[str], launcher: list[str] | None = None) -> dict:
    """One CLI call in a child process (one torch thread): its exit code, wall time and peak RSS."""
    env = child_env(threads=1)
    command = [sys.executable, "-c", _CHILD, json.dumps(argv)]
    if launcher:
        command = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            *launcher,
            str(WORK / "child.py"),
            json.dumps(argv),
        ]
        (WORK / "child.py").write_text(_CHILD)
    start = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, env=env, cwd=WORK)
    lines = [line for line in done.stdout.splitlines() if line.startswith("SCALE-RESULT ")]
    if not lines:
        return {
            "code": done.returncode,
            "seconds": time.perf_counter() - start,
            "rss": 0,
            "error": done.stderr[-1500:],
        }
    out = json.loads(lines[0].removeprefix("SCALE-RESULT "))
    out["load"] = load_average()
    if out["code"]:
        out["error"] = done.stderr[-1500:]
    return out


def _folder(name: str, config: dict, dtype: str = "float32") -> Path:
    """The point's model folder, written once (resumable)."""
    import torch  # lazy: only the points that write a model need it

    from gdnprune.scale_models import write_model

    folder = WORK / "models" / name
    if not (folder / "model.safetensors.index.json").exists():
        write_model(config, folder, seed=0, dtype=getattr(torch, dtype))
    return folder


def _texts() -> tuple[Path, Path]:
    WORK.mkdir(parents=True, exist_ok=True)
    calib, val = WORK / "calib.txt", WORK / "val.txt"
    if not calib.exists():
        calib.write_text(train_text()[:20000], encoding="utf-8")
        val.write_text(validation_text()[:4000], encoding="utf-8")
    return calib, val


def _argv(stage: str, model: Path, out: Path, calib: Path, val: Path) -> tuple[list[str], list[str] | None]:
    common = ["--data", str(calib), "--seq-len", str(SEQ), "--batch-size", str(BATCH), "--threads", "1", "-q"]
    if stage == "inspect":
        return ["inspect", str(model), "--json"], None
    if stage == "score":
        return [
            "score",
            str(model),
            "--num-samples",
            str(SAMPLES),
            "-o",
            str(out / "scores.json"),
            "--overwrite",
            *common,
        ], None
    if stage == "plan":
        return [
            "plan", str(model), "--scores", str(out / "scores.json"), "--budget-params", "0.5", "--num-samples",
            str(PLAN_SAMPLES), "--dim-step", STEP, "-o", str(out / "plan.json"), *common,
        ], None  # fmt: skip
    if stage == "sort":  # every importance order of the score's file, applied (members)
        return ["sort", str(model), "--scores", str(out / "scores.json"), "-o", str(out / "sorted"), "-q",
                "--overwrite"], None  # fmt: skip
    if stage in ("slice", "slice-sorted"):  # slice-sorted: the sorted folder (members), not the model
        config = _config(model)  # half the GDN key heads and value heads: every member has them
        keys, values = config["linear_num_key_heads"] // 2, config["linear_num_value_heads"] // 2
        source, target = (out / "sorted", "sorted-sliced") if stage == "slice-sorted" else (model, "sliced")
        argv = ["slice", str(source), "--num-key-heads", str(keys), "--num-value-heads", str(values)]
        return [*argv, "-o", str(out / target), "-q", "--overwrite"], None
    if stage in ("prune", "prune-proxy"):  # prune-proxy: the plan from the proxy sensitivity (no KL search)
        return [
            "prune", str(model), "--budget-params", "0.5", "--num-samples", str(SAMPLES), "--plan-samples",
            str(PLAN_SAMPLES), "--dim-step", STEP, "-o", str(out / "pruned"), "--overwrite", *common,
        ] + (["--sensitivity", "proxy", "--blocks", "gdn,attention,mlp,shared_expert,experts"]  # no depth: no KL
             if stage == "prune-proxy" else []), None  # fmt: skip
    if stage in ("distill", "distill-fsdp"):
        student = out / (
            "sliced" if (out / "sliced").exists() else "pruned"
        )  # growth: the slice; members: prune
        argv = ["distill", str(student), "--teacher", str(model), "--data", str(calib), "--steps", "2"]
        argv += ["--batch-size", "2", "--seq-len", str(SEQ), "--threads", "1", "-q", "--overwrite"]
        argv += ["-o", str(out / stage)]
        return (
            (argv + ["--fsdp"], ["--standalone", "--nproc_per_node", "2"])
            if stage == "distill-fsdp"
            else (argv, None)
        )
    if stage == "eval":
        return [
            "eval", str(model), "--tasks", "nats_per_byte", "--data", str(val), "--limit", "1", "--context-lengths",
            "128", "--batch-size", "1", "--threads", "1", "-q", "--overwrite", "-o", str(out / "eval"),
        ], None  # fmt: skip
    if stage == "bench":
        return [
            "bench", str(model), "--workload", "prefill:1:32", "--workload", "decode:1:32", "--repeats", "2",
            "--warmup-calls", "0", "--device", "cpu", "--threads", "1", "-q", "--overwrite", "-o", str(out / "bench"),
        ], None  # fmt: skip
    raise ValueError(stage)


def _config(model: Path) -> dict:
    return json.loads((model / "config.json").read_text())


def _predict(model: Path, stage: str, device: Device = DEVICES["cpu"], facts: dict | None = None) -> dict:
    """The estimate of ``stage`` at the point of ``model`` (``distill``: of the student the point trained,
    ``distill-fsdp``: on 2 processes under FSDP2); ``facts``: a cache of the models' facts."""
    facts = {} if facts is None else facts

    def of(path: Path) -> ModelFacts:
        if path not in facts:
            facts[path] = model_facts(path)
        return facts[path]

    teacher, options, student = of(model), OPTIONS, None
    if stage.startswith("distill"):
        out = WORK / "runs" / model.name
        trained = out / ("sliced" if (out / "sliced").exists() else "pruned")
        student = of(trained) if (trained / "config.json").exists() else None
        if stage == "distill-fsdp":
            options = replace(OPTIONS, processes=2, fsdp=True)
    manifest = WORK / "runs" / model.name / "pruned" / "gdnprune.json"
    if (
        stage == "prune"
        and manifest.exists()
        and "hidden" not in json.loads(manifest.read_text())["plan"]["metadata"]
    ):
        # measured before prune searched the hidden size by default (its plan records no hidden search)
        options = replace(options, blocks=tuple(b for b in options.blocks if b != "hidden"))
    name = {"distill-fsdp": "distill", "slice-sorted": "slice"}.get(stage, stage)
    (cost,) = stage_costs(teacher, options, device, [name], student=student)
    return {"seconds": cost.seconds, "rss": cost.host_memory, "parameters": teacher.parameters,
            "layers": len(teacher.layers), "experts": teacher.experts, "tensors": len(teacher.tensors)}  # fmt: skip


def run_point(results: dict, key: str, model: Path, stages: list[str], redo: bool) -> None:
    calib, val = _texts()
    out = WORK / "runs" / key
    out.mkdir(parents=True, exist_ok=True)
    for stage in stages:
        name = f"{key}/{stage}"
        if name in results and not redo and results[name].get("code") == 0:
            continue
        argv, launcher = _argv(stage, model, out, calib, val)
        print(f"{name} ...", flush=True)
        measured = _stage(argv, launcher)
        # no estimate stage for these: the proxy plan, sort (`estimate` does not offer it, `sort` has no dry run)
        measured["predicted"] = None if stage in ("prune-proxy", "sort") else _predict(model, stage)
        results[name] = measured
        _save(results)
        pred = measured["predicted"]
        shown = f"predicted {pred['seconds']:.1f} s" if pred else ""
        print(f"  {name}: code {measured['code']}, {measured['seconds']:.1f} s, {measured['rss'] / 2**20:.0f} MiB; {shown}"
              f" (load {measured.get('load', 0):.1f})", flush=True)  # fmt: skip


def growth(results: dict, redo: bool, stages: tuple[str, ...] = GROWTH_STAGES) -> None:
    """Every stage at every growth point, stage by stage (so a run cut short still has each stage's smaller
    points)."""
    models = {key: _folder(key, tiny_config("Qwen3-Next-80B-A3B", scale=scale)) for key, scale in GROWTH}
    for stage in stages:
        for key, model in models.items():
            run_point(results, key, model, [stage], redo)


def prune(results: dict, redo: bool) -> None:
    """The issue's targets first: ``prune --budget-params 0.5`` at every growth point."""
    growth(results, redo, ("prune",))


def widths(results: dict, redo: bool) -> None:
    for key, name, scale in WIDTHS:
        real = tiny_config(name, scale=scale)
        config = {**real_config(member(name)), "num_hidden_layers": real["num_hidden_layers"], "layer_types": real["layer_types"],
                  "vocab_size": 257}  # fmt: skip
        model = _folder(key, config)
        run_point(results, key, model, ["inspect", "score", "slice", "distill", "bench"], redo)


def members(results: dict, redo: bool, names: tuple[str, ...] = ()) -> None:
    """Every family member's real-count model end to end (``names``: only those, in that order)."""
    chosen = [member(n) for n in names] if names else list(MEMBERS)
    for m in chosen:
        key = "member-" + m.name
        model = _folder(key, tiny_config(m))
        stages = ["inspect", "score", "sort", "slice-sorted", "prune", "distill-fsdp", "eval", "bench"]
        run_point(results, key, model, stages, redo)


def predictions() -> str:
    """The GPU predictions table (markdown) for Qwen3.5-9B, 27B and 397B-A17B on 1 and 8 H100s."""
    rows = [
        "| model | GPUs | stage | FLOPs | device memory / process | predicted time |",
        "|---|---:|---|---:|---:|---:|",
    ]
    for name in ("Qwen3.5-9B", "Qwen3.5-27B", "Qwen3.5-397B-A17B"):
        facts = model_facts(name)
        for gpus in (1, 8):
            options = RunOptions(dtype="bfloat16", processes=gpus, fsdp=gpus > 1, mixed_precision="bf16")
            for cost in stage_costs(
                facts, options, DEVICES["h100"], ["score", "plan", "prune", "distill", "eval"]
            ):
                fits = "" if cost.device_memory <= DEVICES["h100"].memory else " (does not fit)"
                rows.append(f"| {name} | {gpus} | {cost.stage} | {cost.flops:.1e} | {cost.device_memory / 1e9:.0f} GB{fits} | "
                            f"{_hours(cost.seconds)} |")  # fmt: skip
    return "\n".join(rows)


def _hours(seconds: float) -> str:
    return f"{seconds / 3600:.1f} h" if seconds >= 3600 else f"{seconds / 60:.1f} min"


def _fresh(results: dict) -> dict:
    """The results with every prediction made again by the estimate as it is now (the CPU's calibrated rates
    included), for the points whose model folder is here."""
    out = {}
    for name, r in results.items():
        point, stage = name.rsplit("/", 1)
        model = WORK / "models" / point
        if r.get("code") == 0 and stage not in ("prune-proxy", "sort") and model.exists():
            r = {**r, "predicted": _predict(model, stage)}
        out[name] = r
    return out


def table(results: dict) -> str:
    """Every measured point beside its prediction: CPU seconds and peak RSS, each with predicted / measured."""
    rows = [
        "| point | stage | wall s | CPU s | predicted s | ratio | peak RSS MiB | predicted MiB | ratio | load |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name in sorted(results):
        r = results[name]
        point, stage = name.rsplit("/", 1)
        p = r.get("predicted") or {}
        if r["code"] or not p:
            continue
        memory = f"{p['rss'] / r['rss']:.2f}" if r["rss"] else ""
        rows.append(
            f"| {point} | {stage} | {r['seconds']:.1f} | {_cpu(r):.1f} | {p['seconds']:.1f} | {p['seconds'] / _cpu(r):.2f} | "
            f"{r['rss'] / 2**20:.0f} | {p['rss'] / 2**20:.0f} | {memory} | {r.get('load', 0):.1f} |"
        )  # fmt: skip
    return "\n".join(rows)


def targets(results: dict) -> str:
    """The issue's targets for ``prune --budget-params 0.5`` of the 48-layer, 512-expert model in one process:
    at most 40x the wall time of the same widths with 4 layers and 8 experts, peak RSS at most 4x the
    checkpoint's bytes + 1.5 GiB, the output at most half the parameters and loaded by load_pretrained."""
    big, small = results.get("next-full/prune"), results.get("next-4x8/prune")
    if not big or not small or big["code"] or small["code"]:
        return "prune targets: not measured yet"
    model = WORK / "models" / "next-full"
    size = sum(f.stat().st_size for f in model.glob("*.safetensors"))
    limit = 4 * size + 1.5 * 2**30
    lines = [
        f"prune wall time: {big['seconds']:.0f} s vs {small['seconds']:.0f} s = {big['seconds'] / small['seconds']:.1f}x "
        f"(target <= 40x: {'met' if big['seconds'] <= 40 * small['seconds'] else 'missed'}; load "
        f"{big.get('load', 0):.1f} vs {small.get('load', 0):.1f}); CPU time {_cpu(big):.0f} s vs {_cpu(small):.0f} s = "
        f"{_cpu(big) / _cpu(small):.1f}x",
        f"prune peak RSS: {big['rss'] / 2**30:.2f} GiB vs 4 x {size / 2**30:.2f} GiB + 1.5 GiB = {limit / 2**30:.2f} GiB "
        f"(target: {'met' if big['rss'] <= limit else 'missed'})",
    ]
    pruned = WORK / "runs" / "next-full" / "pruned"
    if pruned.exists():
        facts_of = model_facts
        kept = facts_of(pruned).decoder_parameters + 0.0
        full = facts_of(model).decoder_parameters
        total_kept = sum(t.numel for t in facts_of(pruned).tensors if not t.name.startswith("mtp."))
        total = sum(t.numel for t in facts_of(model).tensors if not t.name.startswith("mtp."))
        lines.append(f"prune output: {total_kept:,} of {total:,} parameters ({total_kept / total:.1%}; decoder "
                     f"{kept / full:.1%}); target <= 50%: {'met' if total_kept <= 0.5 * total else 'missed'}")  # fmt: skip
        import torch

        from gdnprune import load_pretrained

        loaded = load_pretrained(pruned)
        with torch.no_grad():
            logits = loaded(input_ids=torch.arange(16)[None] % loaded.config.vocab_size).logits
        lines.append(f"load_pretrained: {type(loaded).__name__}, {loaded.config.num_hidden_layers} layers, "
                     f"{sum(p.numel() for p in loaded.parameters()):,} parameters, finite logits: "
                     f"{bool(torch.isfinite(logits).all())}")  # fmt: skip
    return "\n".join(lines)


def slopes(results: dict) -> str:
    """The growth table: each stage's CPU time and peak RSS at every growth point, and the log-log slope against
    the parameters (scales 1/8 to 1) of what each adds to the 4-layer, 8-expert model's (the fixed costs,
    imports and startup, left out). Layers and experts both double from one point to the next and the
    parameters grow 4x (the experts hold nearly all), so a slope of 1 is linear in layers x experts and 0.5
    is linear in the layers alone."""
    import numpy as np  # lazy: after the runs

    points = [key for key, _ in GROWTH]
    rows = [
        "| stage (CPU s / peak RSS MiB) | " + " | ".join(points) + " | time ~ params^ | RSS ~ params^ |",
        "|---|" + "---:|" * (len(points) + 2),
    ]  # fmt: skip
    for stage in ("inspect", "score", "slice", "prune", "distill", "eval", "bench"):
        pts = [results.get(f"{key}/{stage}") for key in points]
        ok = [p for p in pts if p and p["code"] == 0 and p.get("predicted")]
        if len(ok) < 3 or not pts[0] or pts[0]["code"]:
            continue
        base = pts[0]
        grown = [p for p in pts[1:] if p and p["code"] == 0 and p.get("predicted")]
        x = np.log([p["predicted"]["parameters"] - base["predicted"]["parameters"] for p in grown])
        dt = np.log([max(_cpu(p) - _cpu(base), 1e-2) for p in grown])
        dm = np.log([max(p["rss"] - base["rss"], 2**20) for p in grown])
        cells = [f"{_cpu(p):.1f} / {p['rss'] / 2**20:.0f}" if p and p["code"] == 0 else "" for p in pts]
        rows.append(f"| {stage} | " + " | ".join(cells) + f" | {float(np.polyfit(x, dt, 1)[0]):.2f} | "
                    f"{float(np.polyfit(x, dm, 1)[0]):.2f} |")  # fmt: skip
    return "\n".join(rows)


def widths_table(results: dict) -> str:
    """The real-width points: each stage's CPU seconds / peak RSS MiB, and the plan's prediction."""
    stages = ("inspect", "score", "slice", "distill", "bench")
    rows = [
        "| point | parameters | " + " | ".join(stages) + " | plan (predicted) |",
        "|---|" + "---:|" * (len(stages) + 2),
    ]
    for key, _, _ in WIDTHS:
        pts = [results.get(f"{key}/{stage}") for stage in stages]
        if not any(pts):
            continue
        model = WORK / "models" / key
        plan = _predict(model, "plan")
        cells = [f"{_cpu(p):.1f} s / {p['rss'] / 2**20:.0f}" if p and p["code"] == 0 else "" for p in pts]
        rows.append(
            f"| {key} | {plan['parameters'] / 1e6:.0f}M | "
            + " | ".join(cells)
            + f" | {_hours(plan['seconds'])} |"
        )
    return "\n".join(rows)


def plot(results: dict) -> None:
    from gdnprune.runtime.figures import new_figure

    fig = new_figure(figsize=(10, 4))
    if fig is None:
        print("matplotlib is missing: no plot")
        return
    axes = fig.subplots(1, 2)
    for stage, marker in zip(("score", "plan", "slice", "prune", "distill", "eval", "bench"), "os^vDP*"):
        pts = [(results[f"{k}/{stage}"]) for k, _ in GROWTH if f"{k}/{stage}" in results]
        pts = [p for p in pts if p["code"] == 0 and p.get("predicted")]
        if not pts:
            continue
        params = [p["predicted"]["parameters"] for p in pts]
        line = axes[0].loglog(params, [_cpu(p) for p in pts], marker=marker, label=stage)[0]
        axes[0].loglog(params, [p["predicted"]["seconds"] for p in pts], ls=":", color=line.get_color())
        axes[1].loglog(params, [p["rss"] / 2**20 for p in pts], marker=marker, label=stage)
    axes[0].set(xlabel="parameters (4 to 48 layers, 8 to 512 experts)", ylabel="CPU time, s (dotted: predicted)",
                title="time per stage")  # fmt: skip
    axes[1].set(xlabel="parameters", ylabel="peak RSS, MiB", title="memory per stage")
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    IMG.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(IMG, dpi=80)
    print(f"wrote {IMG}")


#: the CPU's fixed costs ``--fit`` fits (its matrix rates are measured on products, not fitted)
FITTED = ("op_seconds", "bandwidth_efficiency", "tensor_seconds", "stream_tensor_seconds", "convert_tensor_seconds",
          "disk", "write", "startup", "light_startup", "harness_startup", "launch")  # fmt: skip


def fit(results: dict) -> None:
    """The CPU's fixed costs that fit the measured points best (least squares on the log of predicted over
    measured CPU seconds), to copy into the ``cpu`` entry of gdnprune/estimate/devices.py."""
    import numpy as np
    from scipy.optimize import minimize

    points = [(k, r) for k, r in results.items() if r.get("code") == 0 and r.get("predicted")]
    points = [(k, r) for k, r in points if (WORK / "models" / k.rsplit("/", 1)[0]).exists()]
    base, cache = DEVICES["cpu"], {}

    def error(logs) -> float:
        dev = replace(base, **{n: float(np.exp(v)) for n, v in zip(FITTED, logs)})
        errs = [math.log(_predict(WORK / "models" / k.rsplit("/", 1)[0], k.rsplit("/", 1)[1], dev, cache)["seconds"]
                         / _cpu(r)) ** 2 for k, r in points]  # fmt: skip
        return float(np.mean(errs))

    start = np.log([getattr(base, n) for n in FITTED])
    print("mean squared log error now", error(start))
    best = minimize(error, start, method="Nelder-Mead", options={"maxiter": 1500, "xatol": 1e-3})
    print({n: f"{float(np.exp(v)):.3g}" for n, v in zip(FITTED, best.x)}, "mean squared log error", best.fun)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "parts", nargs="*", default=["growth"], help="prune, growth, widths, members, predictions"
    )
    parser.add_argument("--redo", action="store_true", help="run again what results.json holds")
    parser.add_argument("--plot", action="store_true", help=f"draw {IMG.relative_to(REPO)}")
    parser.add_argument("--fit", action="store_true", help="print the CPU rates that fit the measurements")
    parser.add_argument(
        "--results", default=RESULTS, help="the file under benchmarks/_work/scale/ this run writes"
    )
    parser.add_argument(
        "--members", default="", help="members: only these, comma-separated, in this order (default: all)"
    )
    args = parser.parse_args(argv)
    globals()["RESULTS"] = args.results
    results = _results()
    for part in args.parts:
        if part == "predictions":
            print(predictions())
        elif part == "members":
            members(results, args.redo, tuple(n for n in args.members.split(",") if n))
        else:
            {"prune": prune, "growth": growth, "widths": widths}[part](results, args.redo)
    if results:
        results = _fresh(results)
        print(table(results))
        print(slopes(results))
        print(widths_table(results))
        print(targets(results))
    if args.fit:
        fit(results)
    if args.plot:
        plot(results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
