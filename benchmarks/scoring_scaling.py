#!/usr/bin/env python
"""Scoring on 1 and 2 processes: tokens/s, scaling efficiency, and whether the scores are equal.

For each model, a model folder and a calibration file are written to a temporary folder, then scored

* in-process timing: a worker started by ``torch.distributed.run`` with 1 and with 2 processes (the code
  path of ``torchrun``) loads the model, waits for the other ranks, and times
  :func:`gdnprune.scoring.score_model` on its share of the windows (forward passes, hooks, the sum over
  ranks, the orders) — the part that scales; each process runs ``--threads`` torch threads;
* end to end: ``gdnprune score`` alone and under ``torch.distributed.run --nproc_per_node 2`` (imports,
  tokenisation and model loading included), wall time of the whole command.

Reports tokens/s, scaling efficiency (2-process tokens/s / (2 x 1-process tokens/s)), the largest
relative difference of the raw scores between 1 and 2 processes and whether every order is identical,
and the load average before and after (the machine may be shared).

Models: ``bundled`` (the 0.9M-parameter demo model, byte-level, real text), ``large`` (a random Qwen3.5
text model, hidden 1024, 3 GDN + 1 attention layer, 16/16 heads of 128, vocabulary 32000, 139M params).

Usage::

    python benchmarks/scoring_scaling.py --threads 1                       # both models
    python benchmarks/scoring_scaling.py --models large --large-windows 16 --seq-len 512
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

WORKER = textwrap.dedent("""
    import json, sys, time
    import torch
    from gdnprune import distributed
    from gdnprune.quality.calibration import calibration_windows, iter_batches
    from gdnprune.scoring import GDN_ONLY, score_model

    model_dir, data, out, threads, windows_n, seq_len, batch = sys.argv[1:8]
    torch.set_num_threads(int(threads))
    with distributed.process_group(timeout=1800):
        import transformers
        tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
        model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        windows = calibration_windows(data, tokenizer, seq_len=int(seq_len), num_samples=int(windows_n))
        mine = distributed.shard_indices(windows.shape[0], distributed.rank(), distributed.world_size())
        batches = list(iter_batches(windows[mine.start:mine.stop], int(batch)))
        score_model(model, batches[:1], progress=False, window_offset=mine.start, blocks=GDN_ONLY)  # warm-up (not timed)
        distributed.exchange()  # start together
        start = time.perf_counter()
        scores = score_model(model, batches, progress=False, window_offset=mine.start, blocks=GDN_ONLY)
        seconds = time.perf_counter() - start
        seconds = max(distributed.exchange(seconds))  # the slowest rank sets the pace
        if distributed.is_main_process():
            with open(out, "w") as f:
                json.dump({"seconds": seconds, "tokens": int(windows.numel()), "scores": scores}, f)
""")


def bundled(folder: Path, windows: int, seq_len: int) -> None:
    import shutil

    from gdnprune import demo_data

    shutil.copytree(demo_data.demo_model_path(), folder / "model")
    (folder / "calib.txt").write_text(demo_data.train_text()[: windows * seq_len + 1000], encoding="utf-8")


def large(folder: Path, windows: int, seq_len: int) -> None:
    import torch
    import transformers

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from scoring_overhead import large_model

    from gdnprune import demo_data

    model, _ = large_model(vocab=32000)
    model.save_pretrained(folder / "model")
    demo_data.build_byte_tokenizer().save_pretrained(folder / "model")  # byte ids < 257 < 32000
    (folder / "calib.txt").write_text(demo_data.train_text()[: windows * seq_len + 1000], encoding="utf-8")
    del model, torch, transformers


def _launch(n: int, args: list[str], env: dict) -> tuple[float, subprocess.CompletedProcess]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(n), *args]
    start = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
    return time.perf_counter() - start, proc


def compare(a: dict, b: dict) -> tuple[bool, float]:
    """Whether every order is identical, and the largest relative difference of the raw scores."""
    import torch

    same, worst = True, 0.0
    for prefix, pa in a["layers"].items():
        pb = b["layers"][prefix]
        for key, value in pa.items():
            if "order" in key:
                same &= value == pb[key]
            elif key.endswith("_scores"):
                x, y = torch.tensor(value, dtype=torch.float64), torch.tensor(pb[key], dtype=torch.float64)
                worst = max(worst, float(((x - y).abs() / y.abs().clamp_min(1e-300)).max()))
    return same, worst


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", choices=("bundled", "large"), default=["bundled", "large"])
    p.add_argument("--threads", type=int, default=1, help="torch threads per process (default 1)")
    p.add_argument(
        "--bundled-windows", type=int, default=64, help="calibration windows, bundled (default 64)"
    )
    p.add_argument("--large-windows", type=int, default=16, help="calibration windows, large (default 16)")
    p.add_argument("--seq-len", type=int, default=256, help="tokens per window (default 256)")
    p.add_argument("--batch-size", type=int, default=2, help="windows per forward pass (default 2)")
    args = p.parse_args(argv)
    env = dict(
        os.environ,
        OMP_NUM_THREADS=str(args.threads),
        PYTHONPATH=os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]),
    )
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    print(
        f"{args.threads} torch thread(s) per process; {os.cpu_count()} CPUs; load average before: "
        f"{' '.join(open('/proc/loadavg').read().split()[:3])}"
    )
    print()
    print(
        "| model | tokens | 1 process tok/s | 2 processes tok/s | scaling efficiency | orders identical "
        "| max rel. score diff | `gdnprune score` wall, 1 → 2 processes |"
    )
    print("|---|---:|---:|---:|---:|---|---:|---:|")
    for name in args.models:
        with tempfile.TemporaryDirectory() as tmp:
            folder = Path(tmp)
            windows = args.bundled_windows if name == "bundled" else args.large_windows
            (bundled if name == "bundled" else large)(folder, windows, args.seq_len)
            (folder / "worker.py").write_text(WORKER, encoding="utf-8")
            runs = {}
            for n in (1, 2):
                out = folder / f"timing{n}.json"
                _launch(
                    n,
                    [
                        str(folder / "worker.py"),
                        str(folder / "model"),
                        str(folder / "calib.txt"),
                        str(out),
                        str(args.threads),
                        str(windows),
                        str(args.seq_len),
                        str(args.batch_size),
                    ],
                    env,
                )
                runs[n] = json.loads(out.read_text())
            cli = [
                "-m",
                "gdnprune",
                "score",
                str(folder / "model"),
                "--data",
                str(folder / "calib.txt"),
                "--num-samples",
                str(windows),
                "--seq-len",
                str(args.seq_len),
                "--batch-size",
                str(args.batch_size),
                "--threads",
                str(args.threads),
                "--quiet",
            ]
            walls = {}
            for n in (1, 2):
                walls[n], _ = _launch(n, cli + ["--output", str(folder / f"cli{n}.json")], env)
            same, worst = compare(runs[1]["scores"], runs[2]["scores"])
            cli_same, cli_worst = compare(
                json.loads((folder / "cli1.json").read_text()), json.loads((folder / "cli2.json").read_text())
            )
            tokens = runs[1]["tokens"]
            rate = {n: tokens / runs[n]["seconds"] for n in (1, 2)}
            print(
                f"| {name} | {tokens} | {rate[1]:.0f} | {rate[2]:.0f} | {rate[2] / (2 * rate[1]):.0%} | "
                f"{'yes' if same and cli_same else 'NO'} | {max(worst, cli_worst):.1e} | "
                f"{walls[1]:.1f} s → {walls[2]:.1f} s |",
                flush=True,
            )
    print()
    print(f"load average after: {' '.join(open('/proc/loadavg').read().split()[:3])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
