#!/usr/bin/env python
"""The cost of the measured greedy expert removal (issue 31) against the scoring pass it rides on.

On a trained MoE (``benchmarks/experts.py``'s models), the same calibration windows (64 x 256 bytes, batches of
8) are scored with the expert hooks but no token sample (``expert_sample_tokens=0``, the default) and with
it (4096, what ``benchmarks/experts.py`` uses), each timed (best of ``--repeats``): the forward passes (``measure_statistics``) and
the orders (``scores_from_statistics``: the greedy runs there, one MoE layer after another). Also the
sample's size in the statistics (what a partial file holds on top).

    python benchmarks/expert_greedy_cost.py benchmarks/_work/models/moe16bal --threads 1
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "src"))

import torch  # noqa: E402

from gdnprune import demo_data  # noqa: E402
from gdnprune.io.loading import load_pretrained  # noqa: E402
from gdnprune.scoring.api import measure_statistics  # noqa: E402
from gdnprune.scoring.experts import SAMPLE_TOKENS  # noqa: E402
from gdnprune.scoring.payload import scores_from_statistics  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model", type=Path)
    p.add_argument("--windows", type=int, default=64, help="calibration windows of 256 bytes (64)")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    model = load_pretrained(args.model, dtype=torch.float32).eval()
    batches = list(demo_data.byte_windows(demo_data.train_text(), 256, args.windows).split(8))
    seconds: dict[str, float] = {}
    stats = {}
    for name, sample in (("without", 0), ("with", SAMPLE_TOKENS)):
        seconds[f"pass {name} the sample"] = _best(
            args.repeats,
            lambda name=name, sample=sample: stats.__setitem__(
                name, measure_statistics(model, batches, progress=False, expert_sample_tokens=sample)
            ),
        )
        seconds[f"orders {name} the sample"] = _best(
            args.repeats, lambda name=name: scores_from_statistics(stats[name])
        )
    moe = [s for b, s in stats["with"].blocks.values() if b.kind == "experts"]
    size = sum(v.numel() * v.element_size() for s in moe for k, v in s.items() if k.startswith("sample_"))
    print(
        f"load average {os.getloadavg()[0]:.1f}; {args.model}: {len(moe)} MoE layers, {len(batches)} batches, "
        f"sample {int(moe[0]['sample_used'].sum())} tokens per layer ({size / 2**20:.1f} MiB of statistics)"
    )
    for name, value in seconds.items():
        print(
            f"  {name} (scores_from_statistics)" if name.startswith("orders") else f"  {name}",
            f"{value:.2f} s",
        )
    plain = seconds["pass without the sample"]
    sample = seconds["pass with the sample"] - plain
    greedy = seconds["orders with the sample"] - seconds["orders without the sample"]
    print(
        f"  the sample adds {sample:+.2f} s ({sample / plain:+.0%}) to the pass, the greedy {greedy:+.2f} s ({greedy / plain:+.0%})"
    )
    return 0


def _best(repeats: int, work) -> float:
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        work()
        best = min(best, time.perf_counter() - t0)
    return best


if __name__ == "__main__":
    sys.exit(main())
