#!/usr/bin/env python
"""Latency additivity: the sum of block latencies + the fixed part against the whole model's latency.

The plan's latency budget (issue 30) sums per-block latencies measured by :mod:`gdnprune.latency` in one
MILP, so the sum must track the whole model's measured latency. On a random Qwen3.5 text model where compute
dominates (default: hidden 1024, 8 layers ``GGGA GGGA``, GDN 8 key heads / 16 value heads of 128, attention
8 heads / 2 KV heads of 128, MLP 3072, vocabulary 32000) this prints, at a prefill and a decode workload:

* ``whole``: :meth:`LatencyHarness.model_latency`, measured before and after the blocks (a shared machine
  drifts; the mean of the two medians is the reference);
* ``fixed``: :meth:`LatencyHarness.fixed_latency` (embeddings, rotary tables, masks, final norm, lm_head);
* ``layers``: fixed + the sum of the decoder layers' :meth:`~LatencyHarness.block_latency`;
* ``blocks``: fixed + the sum of the sub-modules' latencies (GDN / attention, MLP): what a plan over
  sub-blocks sums; it leaves out each layer's two RMSNorms and residual adds;

and the ratios ``layers / whole`` and ``blocks / whole`` (1.0 = additive), from the medians and from the
fastest repeat of each timing (a busy machine only adds time, so the fastest repeats drift less).

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

from gdnprune.latency import LatencyHarness, parse_workload  # noqa: E402


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


def measure(model, workload, repeats: int, warmup: int) -> dict:
    """Medians (and, less sensitive to a busy machine, the fastest repeats) of the whole model, the fixed part,
    the decoder layers and their sub-blocks."""
    harness = LatencyHarness(model, workload, repeats=repeats, warmup=warmup)
    layers = list(model.model.layers)
    subs = [m for layer in layers for m in sub_modules(layer)]
    harness.prepare(layers + subs)
    before = harness.model_latency()
    fixed = harness.fixed_latency()
    layer_times = harness.block_latencies([(layer, None) for layer in layers])
    sub_times = harness.block_latencies([(m, None) for m in subs])
    after = harness.model_latency()
    result = {"workload": str(workload), "layer_ms": [1000 * t.seconds for t in layer_times]}
    for name, pick in (("median", lambda t: t.seconds), ("fastest", lambda t: min(t.repeats))):
        whole = statistics.mean([pick(before), pick(after)])
        result[name] = {
            "whole_before": pick(before),
            "whole_after": pick(after),
            "whole": whole,
            "fixed": pick(fixed),
            "layers": pick(fixed) + sum(pick(t) for t in layer_times),
            "blocks": pick(fixed) + sum(pick(t) for t in sub_times),
        }
    return result


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--intermediate", type=int, default=3072)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--prefill", default="prefill:1:256")
    p.add_argument("--decode", default="decode:4:256")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--warmup-calls", type=int, default=1)
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
        f"repeats {args.repeats}, warm-up {args.warmup_calls}"
    )
    print(
        "| workload | statistic | whole ms (before / after) | fixed ms | fixed + layers ms | layers / whole | "
        "fixed + sub-blocks ms | sub-blocks / whole |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for text in (args.prefill, args.decode):
        r = measure(model, parse_workload(text), args.repeats, args.warmup_calls)
        for name in ("median", "fastest"):
            ms = {k: 1000 * v for k, v in r[name].items()}
            print(
                f"| {r['workload']} | {name} | {ms['whole']:.1f} ({ms['whole_before']:.1f} / "
                f"{ms['whole_after']:.1f}) | {ms['fixed']:.2f} | {ms['layers']:.1f} | "
                f"{ms['layers'] / ms['whole']:.3f} | {ms['blocks']:.1f} | {ms['blocks'] / ms['whole']:.3f} |",
                flush=True,
            )
        print(
            f"|   median per layer ms: {', '.join(f'{t:.1f}' for t in r['layer_ms'])} | | | | | | | |",
            flush=True,
        )
    print(f"total {time.perf_counter() - start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
