#!/usr/bin/env python
"""The loss-aware lane Gram on fewer tokens: lane quality for loss-token strides 1 to 128.

Why it matters: the default ``loss_token_stride`` is raised above 8 when the vocabulary products would
cost more than an eighth of the forward (``gdnprune.scoring.loss_head.default_loss_token_stride``:
64 for a 4-layer model with a 248K vocabulary). This runs the lane part of ``benchmarks/quality.py``
(same calibration, same validation windows, same ``Evaluator``): the validation loss increase after
cutting every GDN layer to 1 of 2 lanes per group with the lane orders of the default ``projection`` at
each stride, with the energy-Gram lanes and with 20 random orders for reference. The measured tokens are
``calibration tokens / stride`` (64 x 256 = 16384 calibration bytes: stride 16 measures 1024 tokens, as
many as stride 64 on a real 128 x 512-token calibration run).

Usage::

    python benchmarks/loss_stride.py --threads 1                                 # bundled model
    python benchmarks/loss_stride.py --threads 1 --model /tmp/demo_seed1         # train_demo_model.py --seed 1
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

from quality import Evaluator  # noqa: E402

from gdnprune import demo_data  # noqa: E402
from gdnprune.gated_delta_net import GDNPermutation  # noqa: E402
from gdnprune.scoring import GDN_ONLY, score_model, scores_to_permutations  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--model", type=Path, default=None, help="byte-level Qwen3.5 model folder (default: bundled)"
    )
    p.add_argument(
        "--strides", default="1,8,16,32,64,128", help="loss-token strides (default 1,8,16,32,64,128)"
    )
    p.add_argument("--random-orders", type=int, default=20, help="random orders (default 20, seed 0)")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    if args.model is None:
        model, _ = demo_data.load_demo_model()
    else:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    ev = Evaluator(model, text=demo_data.validation_text(), windows=48, seq_len=256)
    target = ev.shape.replace(num_value_heads=ev.shape.num_key_heads * (ev.shape.value_heads_per_group // 2))
    calib = demo_data.byte_windows(demo_data.train_text(), 256, 64)
    batches = [calib[i : i + 4] for i in range(0, calib.shape[0], 4)]
    rows = []
    for stride in (int(s) for s in args.strides.split(",")):
        scores = score_model(model, batches, progress=False, loss_token_stride=stride, blocks=GDN_ONLY)
        tokens = next(iter(scores["layers"].values()))["loss_tokens"]
        loss = ev.loss(scores_to_permutations(scores), target) - ev.base
        rows.append((f"loss-aware Gram, stride {stride}", tokens, loss))
    energy = score_model(model, batches, progress=False, lane_measure="energy_gram", blocks=GDN_ONLY)
    rows.append(("energy Gram", 0, ev.loss(scores_to_permutations(energy), target) - ev.base))
    gen = torch.Generator().manual_seed(0)
    randoms = [
        ev.loss({p: GDNPermutation.random(ev.shape, generator=gen) for p in ev.layers}, target) - ev.base
        for _ in range(args.random_orders)
    ]
    print(
        f"model {args.model or 'bundled'}: unpruned validation loss {ev.base:.4f} nats/byte; lanes cut to "
        f"{target.value_heads_per_group}/{ev.shape.value_heads_per_group} per group; "
        f"random orders {statistics.mean(randoms):.3f} ± {statistics.stdev(randoms):.3f} (best {min(randoms):.3f})"
    )
    print()
    print("| lane order | measured tokens | loss increase | random orders beaten |")
    print("|---|---:|---:|---:|")
    for name, tokens, loss in rows:
        beaten = sum(r > loss for r in randoms) / len(randoms)
        print(f"| {name} | {tokens} | {loss:.3f} | {beaten:.0%} |")
    print(f"\n{ev.evals} evaluations in {time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
