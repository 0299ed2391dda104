"""Data preparation at the size of a recovery corpus: peak RSS per process and time, first run and reused cache.

For each corpus size (generated text in a folder of JSONL shards under ``--root``, never in the repo) a
fresh child process runs :func:`gdnprune.corpus.open_windows` with the bundled demo tokenizer, then reads
every window once, front to back; it reports its peak RSS (``resource.getrusage``) and the time of each
part. The first run tokenises into an empty cache, the second reuses it. ``--procs 2`` runs the same under
``torch.distributed.run`` with 2 processes sharing the cache (each reads its own half of the windows).
A baseline child (the same imports and the tokenizer, no data) gives the fixed part of the RSS, and, with
``--old``, the one-file path of earlier versions (``pack_windows(read_texts(file))``, the whole corpus in
memory) runs on the same text as one JSONL file for comparison.

    python benchmarks/corpus.py --sizes 2 100 --root /tmp/corpus-bench --procs 1 2 --old 2 100
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

DEMO = Path(__file__).resolve().parents[1] / "src" / "gdnprune" / "data" / "demo_model"
SEQ_LEN = 512
SHARD_BYTES = 32 << 20


def generate(folder: Path, megabytes: int, seed: int = 0) -> int:
    """JSONL shards of about ``SHARD_BYTES`` of generated documents (words drawn from a fixed list)."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    words = [
        "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 9)))
        for _ in range(5000)
    ]
    target, written, shard = megabytes << 20, 0, 0
    out = open(folder / f"shard-{shard:05d}.jsonl", "w", encoding="utf-8")
    while written < target:
        doc = " ".join(rng.choices(words, k=rng.randint(50, 800)))
        line = json.dumps({"text": doc}) + "\n"
        out.write(line)
        written += len(line)
        if out.tell() >= SHARD_BYTES and written < target:
            out.close()
            shard += 1
            out = open(folder / f"shard-{shard:05d}.jsonl", "w", encoding="utf-8")
    out.close()
    return written


def _peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def child(mode: str, data: str, cache: str) -> dict:
    """One measured run in this process; returns its numbers."""
    import torch.distributed as dist
    from transformers import AutoTokenizer

    start = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(DEMO)
    ranked = "RANK" in os.environ
    if ranked:
        dist.init_process_group("gloo")
    rank, world = (dist.get_rank(), dist.get_world_size()) if ranked else (0, 1)
    report: dict = {"mode": mode, "rank": rank, "setup_s": time.perf_counter() - start}
    if mode == "baseline":
        import gdnprune.corpus.dataset  # noqa: F401  (the fixed part: every module a corpus run imports)

        report["peak_rss_mib"] = _peak_mib()
        return report
    if mode == "old":
        from gdnprune.quality.calibration import pack_windows, read_texts

        t = time.perf_counter()
        windows = pack_windows(read_texts(data), tokenizer, seq_len=SEQ_LEN)
        report.update(
            prepare_s=time.perf_counter() - t, windows=int(windows.shape[0]), peak_rss_mib=_peak_mib()
        )
        return report
    from gdnprune.corpus.dataset import open_windows

    t = time.perf_counter()
    ds = open_windows(data, tokenizer, seq_len=SEQ_LEN, cache_dir=cache)
    report["prepare_s"] = time.perf_counter() - t
    report["reused"] = all(s.reused for s in ds.windows.streams)
    report["rss_after_prepare_mib"] = _peak_mib()
    mine = ds.shard(rank, world)
    t = time.perf_counter()
    total = 0
    for k in range(len(mine)):
        total += int(mine[k]["input_ids"][0])
    report.update(
        read_s=time.perf_counter() - t,
        windows=len(ds),
        my_windows=len(mine),
        tokens=sum(s.num_tokens for s in ds.windows.streams),
        peak_rss_mib=_peak_mib(),
    )
    if ranked:
        dist.destroy_process_group()
    return report


def run_child(mode: str, data: Path, cache: Path, procs: int) -> list[dict]:
    out = cache.parent / f".report-{os.getpid()}-{mode}.json"
    script = [str(Path(__file__).resolve()), "--child", mode, str(data), str(cache), str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if procs > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(procs)]
    else:
        cmd = [sys.executable]
    t = time.perf_counter()
    subprocess.run([*cmd, *script], env=env, check=True)
    wall = time.perf_counter() - t
    reports = [json.loads(line) for line in out.read_text().splitlines()]
    out.unlink()
    for r in reports:
        r["wall_s"] = wall
    return sorted(reports, key=lambda r: r["rank"])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", type=int, nargs="+", default=[2, 100], metavar="MB")
    p.add_argument("--procs", type=int, nargs="+", default=[1], metavar="N")
    p.add_argument(
        "--old", type=int, nargs="*", default=[], metavar="MB", help="sizes to run the old path on"
    )
    p.add_argument("--root", default="/tmp/gdnprune-corpus-bench")
    p.add_argument("--child", nargs=4, metavar=("MODE", "DATA", "CACHE", "OUT"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        mode, data, cache, out = args.child
        report = child(mode, data, cache)
        with open(out, "a") as f:  # ranks append one line each (short writes under O_APPEND)
            f.write(json.dumps(report) + "\n")
        return
    root = Path(args.root)
    root.mkdir(parents=True, exist_ok=True)
    rows = []
    base = run_child("baseline", root, root / "cache-none", 1)[0]
    print(f"baseline (imports + tokenizer, no data): peak RSS {base['peak_rss_mib']:.0f} MiB", flush=True)
    for size in args.sizes:
        data = root / f"{size}MB"
        if not data.exists():
            t = time.perf_counter()
            written = generate(data, size)
            print(
                f"generated {written / 2**20:.1f} MiB in {data} ({time.perf_counter() - t:.0f} s)", flush=True
            )
        for procs in args.procs:
            cache = root / f"cache-{size}MB-{procs}p"
            shutil.rmtree(cache, ignore_errors=True)
            for run in ("first", "reused"):
                for r in run_child("corpus", data, cache, procs):
                    rows.append(dict(size_mb=size, procs=procs, run=run, **r))
                    print(json.dumps(rows[-1]), flush=True)
            shutil.rmtree(cache, ignore_errors=True)
        if size in args.old:
            single = root / f"{size}MB.jsonl"
            with open(single, "wb") as out:
                for shard in sorted(data.glob("*.jsonl")):
                    out.write(shard.read_bytes())
            r = run_child("old", single, root / "cache-none", 1)[0]
            rows.append(dict(size_mb=size, procs=1, run="old", **r))
            print(json.dumps(rows[-1]), flush=True)
            single.unlink()
    print()
    print(
        f"| corpus | procs | run | prepare s | read all s | windows | peak RSS MiB (per process) | "
        f"over baseline ({base['peak_rss_mib']:.0f} MiB) |"
    )
    print("|---|---:|---|---:|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['size_mb']} MB | {r['procs']} (rank {r['rank']}) | {r['run']} | {r['prepare_s']:.1f} | "
            f"{r.get('read_s', float('nan')):.1f} | {r['windows']} | {r['peak_rss_mib']:.0f} | "
            f"{r['peak_rss_mib'] - base['peak_rss_mib']:+.0f} |"
        )


if __name__ == "__main__":
    main()
