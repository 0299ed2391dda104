#!/usr/bin/env python
"""Pruned, recovered, then quantized: what each serving format costs at 50 % of the parameters.

Claim (issue 44): on the trained benchmark models pruned to half their parameters and recovered, FP8 costs
at most 0.01 nats/byte over bf16, w4a16 with GPTQ at most 0.05, and an FP8 output is at most 0.55x the bf16
bytes.

For each model it runs the pipeline with the CLI: ``prune --budget-params 0.5`` on the training text,
``distill`` (the shared recipe, ``--steps``, written in bfloat16: the "bf16" row), then ``quantize`` with
``fp8-block``, ``fp8-dynamic`` and ``w4a16`` (GPTQ, and round-to-nearest beside it). Tiles and groups are
128 wide as engines expect; these models are narrower than 128 (hidden 64-128), so where nothing fits at 128
the script says so and also measures the largest size in 64, 32, 16 at which every projection fits
(labelled with its size). Then ``eval`` (nats/byte on the held-out text, passkey and MQAR recall probes at
``--context-lengths``), bytes of the weights on disk, and ``bench``'s decode tokens/s (transformers on CPU:
compressed-tensors dequantizes the weights at load and quantizes FP8 activations in the forward, so the
speed is the bf16 model's, less the activation rounding).

Every step's output stays under ``benchmarks/_work/quantize/`` (git-ignored), so a stopped run resumes.

Usage::

    nice -n 10 .venv/bin/python benchmarks/quantize.py --threads 1
    nice -n 10 .venv/bin/python benchmarks/quantize.py --model /work/models/deep_docstrings --threads 1

``--snap-quant 128`` also prunes each model with ``prune --snap-quant 128`` and reports what the tiles cost
before recovery: the KL of both whole cut models on the calibration windows (as ``prune`` measures it) and the
held-out nats/byte of both pruned models, paired.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))

import numpy as np  # noqa: E402

from gdnprune import demo_data  # noqa: E402
from gdnprune.cli import main as gdnprune  # noqa: E402

WORK = ROOT / "benchmarks" / "_work" / "quantize"
SIZES = (128, 64, 32, 16)
SEQ = [256]  # bytes per window (--seq-len)


def _run(argv: list[str], out: Path) -> Path:
    """``gdnprune ARGV -o OUT`` unless OUT is already there (resume); exits on failure."""
    if not out.exists():
        t0 = time.time()
        code = gdnprune([*argv, "-o", str(out), "-q", "--threads", os.environ["OMP_NUM_THREADS"]])
        print(f"  {argv[0]} -> {out.name}: exit {code} ({time.time() - t0:.0f} s)", flush=True)
        if code != 0:
            return Path()
    return out


def _corpus(model: Path) -> str:
    try:
        return json.loads((model / "training.json").read_text())["corpus"].get("name", "pydoc")
    except (OSError, KeyError, ValueError, AttributeError):
        return "pydoc"


def _weight_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.glob("*.safetensors"))


def _quantized(
    recovered: Path, work: Path, scheme: str, calibration: str, train: Path
) -> list[tuple[str, Path]]:
    """The scheme at 128 (or why not), and at the largest size that fits every projection when 128 does not."""
    outputs = []
    flag = {"fp8-block": "--block-size", "w4a16": "--group-size"}.get(scheme)
    sizes = SIZES if flag else (None,)
    for size in sizes:
        rtn = "-rtn" if calibration == "rtn" and scheme == "w4a16" else ""
        name = f"{scheme}{'' if size is None else f'-{size}'}{rtn}"
        argv = ["quantize", str(recovered), "--scheme", scheme]
        argv += [flag, str(size)] if flag else []
        argv += ["--calibration", calibration] if scheme == "w4a16" else []
        argv += (
            ["--data", str(train), "--num-samples", "32", "--seq-len", str(SEQ[0])]
            if calibration == "gptq"
            else []
        )
        out = work / name
        if not out.exists() and (work / f"{name}.refused").exists():
            continue
        if not _run(argv, out).name:
            (work / f"{name}.refused").touch()
            print(f"  {name}: refused (no projection fits, or partly unfit routed experts)")
            continue
        manifest = json.loads((out / "gdnprune.json").read_text())
        outputs.append((name, out))
        if not manifest["high_precision"] or size is None:
            break  # every projection fits at this size
    return outputs


def _table(rows: list[dict], base: dict) -> list[str]:
    lines = [
        "| output | nats/byte | vs bf16 (paired) | passkey | mqar | weight bytes | vs bf16 | high precision | decode tok/s |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['name']} | {r['nats']:.4f} ± {r['nats_se']:.4f} | {r['cost']:+.4f} ± {r['cost_se']:.4f} | "
            f"{r['passkey']:.2f} | {r['mqar']:.2f} | {r['bytes']:,} | {r['bytes'] / base['bytes']:.2f}x | "
            f"{r['kept']} | {r['tok_s']:.0f} |"
        )
    return lines


def _window_losses(path: Path, text: str, windows: int, cache: Path) -> list[float]:
    """Mean next-byte loss (nats/byte) of each held-out window, loaded as gdnprune loads it (cached)."""
    if cache.exists():
        return json.loads(cache.read_text())
    import torch  # noqa: PLC0415

    from gdnprune.io.loading import load_causal_lm  # noqa: PLC0415

    model = load_causal_lm(path, dtype="float32", device="cpu")
    ids = demo_data.byte_windows(text, SEQ[0], windows)
    losses = []
    with torch.no_grad():
        for batch in ids.split(8):
            logits = model(input_ids=batch).logits[:, :-1].float()
            ce = torch.nn.functional.cross_entropy(logits.transpose(1, 2), batch[:, 1:], reduction="none")
            losses += ce.mean(1).tolist()
    cache.write_text(json.dumps(losses))
    return losses


def _recall(results: dict, kind: str) -> float:
    values = [v["acc,none"] for k, v in results.items() if k.startswith(f"{kind}_") and "acc,none" in v]
    return sum(values) / max(len(values), 1)


def run_model(model: Path, args: argparse.Namespace) -> list[str]:
    name = "bundled" if model == demo_data.demo_model_path() else model.name
    work = WORK / name
    work.mkdir(parents=True, exist_ok=True)
    corpus = _corpus(model) if name != "bundled" else "pydoc"
    train, valid = work / "train.txt", work / "valid.txt"
    if not train.exists():
        train.write_text(demo_data.train_text(corpus), encoding="utf-8")
        valid.write_text(
            demo_data.validation_text(corpus)[: SEQ[0] * args.validation_windows], encoding="utf-8"
        )
    print(f"{name}: corpus {corpus}", flush=True)
    pruned = _run(
        ["prune", str(model), "--data", str(train), "--budget-params", "0.5", "--seq-len", str(SEQ[0])],
        work / "pruned",
    )
    recovered = Path()
    if pruned.name:  # else the failure was said above
        distill = ["distill", str(pruned), "--teacher", str(model), "--data", str(train)]
        distill += ["--steps", str(args.steps), "--seq-len", str(SEQ[0]), "--batch-size", "4", "--lr", "1e-3"]
        recovered = _run([*distill, "--output-dtype", "bfloat16"], work / "recovered")
    if not recovered.name:  # a step failed (said above): nothing to quantize
        return [f"{name}: prune or distill failed; nothing measured", ""]
    outputs = [("bf16", recovered)]
    for scheme, calibration in (
        ("fp8-block", "rtn"),
        ("fp8-dynamic", "rtn"),
        ("w4a16", "gptq"),
        ("w4a16", "rtn"),
    ):
        outputs += _quantized(recovered, work, scheme, calibration, train)
    evals = work / "eval"
    tasks = "passkey,mqar"
    lengths = ",".join(map(str, args.context_lengths))
    _run(
        ["eval", *[str(p) for _, p in outputs], "--tasks", tasks]
        + ["--context-lengths", lengths, "--limit", str(args.probe_limit), "--device", "cpu"],
        evals,
    )
    bench = work / "bench"
    _run(
        ["bench", *[str(p) for _, p in outputs], "--workload", f"decode:1:{SEQ[0]}", "--device", "cpu"], bench
    )
    results = json.loads((evals / "results.json").read_text())["models"]
    speeds = {
        r["model"]: r["tokens_per_second"]
        for r in json.loads((bench / "results.json").read_text())["results"]
    }
    rows = []
    text = valid.read_text(encoding="utf-8")
    (work / "losses").mkdir(exist_ok=True)
    losses = {
        label: np.array(
            _window_losses(path, text, args.validation_windows, work / "losses" / f"{label}.json")
        )
        for label, path in outputs
    }
    for (label, path), result in zip(outputs, results, strict=True):
        res = result["results"]
        manifest = json.loads((path / "gdnprune.json").read_text()) if label != "bf16" else {}
        diff = losses[label] - losses["bf16"]
        rows.append(
            {
                "name": label,
                "nats": float(losses[label].mean()),
                "nats_se": float(losses[label].std(ddof=1) / np.sqrt(len(diff))),
                "cost": float(diff.mean()),
                "cost_se": float(diff.std(ddof=1) / np.sqrt(len(diff))) if label != "bf16" else 0.0,
                "passkey": _recall(res, "passkey"),
                "mqar": _recall(res, "mqar"),
                "bytes": _weight_bytes(path),
                "kept": len(manifest.get("high_precision", {})),
                "tok_s": speeds[str(path)],
            }
        )
    (work / "rows.json").write_text(json.dumps(rows, indent=1))
    base = rows[0]
    lines = [
        f"**{name}** (50 % of the parameters, {args.steps} distillation steps; load {os.getloadavg()[0]:.1f})"
    ]
    lines += _table(rows, base)
    targets = []
    for r in rows[1:]:
        limit = 0.05 if r["name"].startswith("w4a16") and "rtn" not in r["name"] else 0.01
        if r["name"].startswith("w4a16") and "rtn" in r["name"]:
            continue
        cost = r["cost"]
        targets.append(
            f"{r['name']}: {cost:+.4f} nats/byte ({'met' if cost <= limit else 'missed'}, <= {limit})"
        )
        if r["name"].startswith("fp8"):
            ratio = r["bytes"] / base["bytes"]
            targets.append(
                f"{r['name']} bytes {ratio:.2f}x ({'met' if ratio <= 0.55 else 'missed'}, <= 0.55x)"
            )
    return [*lines, "", "; ".join(targets), "", *_snap_cost(model, pruned, work, train, valid, args)]


def _snap_cost(
    model: Path, pruned: Path, work: Path, train: Path, valid: Path, args: argparse.Namespace
) -> list[str]:
    """``--snap-quant N``: the same prune with ``--snap-quant N``; what the tiles cost, as prune measures it
    (the KL of both whole cut models on its calibration windows) and on the held-out windows (nats/byte of
    both pruned models, paired)."""
    if not args.snap_quant:
        return []
    n = args.snap_quant
    argv = ["prune", str(model), "--data", str(train), "--budget-params", "0.5", "--seq-len", str(SEQ[0])]
    snapped = _run([*argv, "--snap-quant", str(n)], work / f"pruned-snap{n}")
    if not snapped.name:
        return [f"--snap-quant {n}: prune refused (see above)"]
    report = json.loads((snapped / "gdnprune.json").read_text())["plan_report"]["snap_quant"]
    text = valid.read_text(encoding="utf-8")
    losses = [
        np.array(_window_losses(p, text, args.validation_windows, work / "losses" / f"{p.name}.json"))
        for p in (pruned, snapped)
    ]
    diff = losses[1] - losses[0]
    m = report["measured_kl"]
    params = [
        json.loads((p / "gdnprune.json").read_text())["plan"]["metadata"]["totals"] for p in (pruned, snapped)
    ]
    kept = [t.get("model_params_fraction", float("nan")) for t in params]
    return [
        f"--snap-quant {n} (pruned, before recovery): KL on {report['windows']} calibration windows "
        f"{m['unsnapped']:.4f} -> {m['snapped']:.4f} ({m['cost']:+.4f}); held-out nats/byte "
        f"{losses[0].mean():.4f} -> {losses[1].mean():.4f} ({diff.mean():+.4f} ± "
        f"{diff.std(ddof=1) / np.sqrt(len(diff)):.4f}); parameters kept {kept[0]:.1%} -> {kept[1]:.1%}",
        "",
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--model", type=Path, action="append", default=None, help="a trained model folder (repeat)"
    )
    parser.add_argument("--skip-bundled", action="store_true")
    parser.add_argument("--steps", type=int, default=200, help="distillation steps (200)")
    parser.add_argument(
        "--validation-windows", type=int, default=64, help="held-out windows of --seq-len bytes (64)"
    )
    parser.add_argument("--context-lengths", type=int, nargs="+", default=[128, 256])
    parser.add_argument(
        "--seq-len", type=int, default=256, help="bytes per window (256; the trained test models: 128)"
    )
    parser.add_argument("--probe-limit", type=int, default=20, help="documents per recall probe (20)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument(
        "--snap-quant",
        type=int,
        default=None,
        metavar="N",
        help="also prune with --snap-quant N and report what the tiles cost (KL and nats/byte, before recovery)",
    )
    args = parser.parse_args(argv)
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    import torch  # noqa: PLC0415 (after OMP_NUM_THREADS)

    torch.set_num_threads(args.threads)
    SEQ[0] = args.seq_len
    models = ([] if args.skip_bundled else [demo_data.demo_model_path()]) + list(args.model or [])
    report = []
    for model in models:
        report += run_model(model, args)
    print("\n".join(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
