#!/usr/bin/env python
"""Latency additivity: the sum of block latencies + the fixed part against the whole model's latency.

The plan's latency budget (issue 30) sums per-block latencies measured by :mod:`gdnprune.model.latency` in one
MILP, so the sum must track the whole model's measured latency. On a random Qwen3.5 text model where compute
dominates (default: hidden 1024, 8 layers ``GGGA GGGA``, GDN 8 key heads / 16 value heads of 128, attention
8 heads / 2 KV heads of 128, MLP 3072, vocabulary 32000) this prints, at a prefill and a decode workload:

* ``whole``: :meth:`LatencyHarness.model_latency`;
* ``fixed``: :meth:`LatencyHarness.fixed_latency` (embeddings, rotary tables, masks, final norm, lm_head);
* ``layers``: fixed + the sum of the decoder layers' :meth:`~LatencyHarness.block_latency`;
* ``blocks``: fixed + the sum of the sub-modules' latencies (GDN / attention, MLP): what a plan over
  sub-blocks sums; it leaves out each layer's two RMSNorms and residual adds;

and the ratios ``layers / whole`` and ``blocks / whole`` (1.0 = additive). Everything is timed in
interleaved rounds (each timing once per round), so the slow phases of a shared machine hit all of it alike;
a ratio is taken per round, and the median over the rounds is printed with its range.

Usage::

    python benchmarks/latency_additivity.py                                  # ~3-5 min on 2 CPU cores
    python benchmarks/latency_additivity.py --prefill prefill:1:512 --decode decode:8:1024 --device cuda
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

from gdnprune.model.latency import LatencyHarness, parse_workload  # noqa: E402


def random_qwen35(hidden: int, layers: int, intermediate: int, vocab: int, seed: int = 0):
    """A random Qwen3.5 text model: every 4th layer full attention, GDN head dims 128 (Qwen3.5's)."""
    torch.manual_seed(seed)
    config = transformers.Qwen3_5TextConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 128,
        num_key_value_heads=max(1, hidden // 512),
        head_dim=128,
        layer_types=["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(layers)],
        linear_num_key_heads=hidden // 128,
        linear_num_value_heads=hidden // 64,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        linear_conv_kernel_dim=4,
    )
    return transformers.Qwen3_5ForCausalLM(config).eval()


def sub_modules(layer: torch.nn.Module) -> list[torch.nn.Module]:
    """The planned sub-blocks of a decoder layer: its token mixer and its MLP."""
    mixer = getattr(layer, "linear_attn", None) or layer.self_attn
    return [mixer, layer.mlp]


def measure(model, workload, rounds: int, warmup: int) -> dict:
    """Interleaved rounds: in each, the whole model, the fixed part, every decoder layer and every sub-block
    are timed once (a harness with one repeat each), so a shared machine's slow phases hit all of them alike;
    the ratios are taken per round, then their median (and range) over the rounds."""
    harness = LatencyHarness(model, workload, repeats=1, warmup=0)
    layers = list(model.model.layers)
    subs = [m for layer in layers for m in sub_modules(layer)]
    harness.prepare(layers + subs)
    series: dict[str, list] = {"whole": [], "fixed": [], "layers": [], "blocks": [], "per_layer": []}
    for r in range(warmup + rounds):
        whole = harness.model_latency().seconds
        fixed = harness.fixed_latency().seconds
        per_layer = [t.seconds for t in harness.block_latencies([(layer, None) for layer in layers])]
        per_sub = [t.seconds for t in harness.block_latencies([(m, None) for m in subs])]
        if r < warmup:
            continue
        series["whole"].append(whole)
        series["fixed"].append(fixed)
        series["layers"].append(fixed + sum(per_layer))
        series["blocks"].append(fixed + sum(per_sub))
        series["per_layer"].append(per_layer)
    ratios = {k: [a / w for a, w in zip(series[k], series["whole"])] for k in ("layers", "blocks")}
    return {
        "workload": str(workload),
        **{k: statistics.median(series[k]) for k in ("whole", "fixed", "layers", "blocks")},
        "ratio": {k: statistics.median(v) for k, v in ratios.items()},
        "range": {k: (min(v), max(v)) for k, v in ratios.items()},
        "layer_ms": [1000 * statistics.median(col) for col in zip(*series["per_layer"])],
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--intermediate", type=int, default=3072)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--prefill", default="prefill:1:256")
    p.add_argument("--decode", default="decode:4:256")
    p.add_argument("--rounds", type=int, default=5, help="interleaved timed rounds (default 5)")
    p.add_argument("--warmup-rounds", type=int, default=1, help="untimed rounds before them (default 1)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument("--threads", type=int, default=None)
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    start = time.perf_counter()
    model = random_qwen35(args.hidden, args.layers, args.intermediate, args.vocab)
    model.to(device=args.device, dtype=getattr(torch, args.dtype))
    n = sum(p.numel() for p in model.parameters())
    print(
        f"random Qwen3.5: hidden {args.hidden}, {args.layers} layers, MLP {args.intermediate}, vocab {args.vocab}, "
        f"{n / 1e6:.1f}M parameters, {args.dtype} on {args.device}, {torch.get_num_threads()} threads, "
        f"{args.rounds} rounds after {args.warmup_rounds} warm-up round(s)"
    )
    print(
        "| workload | whole ms | fixed ms | fixed + layers ms | layers / whole (range) | fixed + sub-blocks ms | "
        "sub-blocks / whole (range) |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    for text in (args.prefill, args.decode):
        r = measure(model, parse_workload(text), args.rounds, args.warmup_rounds)
        lo_l, hi_l = r["range"]["layers"]
        lo_b, hi_b = r["range"]["blocks"]
        print(
            f"| {r['workload']} | {1000 * r['whole']:.1f} | {1000 * r['fixed']:.2f} | {1000 * r['layers']:.1f} | "
            f"{r['ratio']['layers']:.3f} ({lo_l:.3f}-{hi_l:.3f}) | {1000 * r['blocks']:.1f} | "
            f"{r['ratio']['blocks']:.3f} ({lo_b:.3f}-{hi_b:.3f}) |",
            flush=True,
        )
        print(f"|   per layer ms: {', '.join(f'{t:.1f}' for t in r['layer_ms'])} | | | | | | |", flush=True)
    print(f"total {time.perf_counter() - start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
