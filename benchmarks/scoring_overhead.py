#!/usr/bin/env python
"""Scoring overhead: calibration tokens/s with scoring hooks vs the same plain forward passes.

For each model, the same calibration batches are run (under ``torch.no_grad``, ``use_cache=False``) as

* ``plain``: the forward passes alone, called exactly as :func:`gdnprune.scoring.score_model` calls the
  model (``logits_to_keep=1``: no vocabulary projection except for the last token), the baseline of
  the targets;
* ``plain, full logits``: the forward passes with the logits of every token (what a user's own
  evaluation pass costs), for reference;
* ``activation``: ``score_model(..., method="activation")`` (hooks + final orders),
* ``projection``: ``score_model(..., method="projection")`` (the default: hooks, Grams, the loss-aware lane
  Gram's own final norm + ``lm_head`` forward and input gradient on one token in ``loss_token_stride``,
  greedy orders; the default stride is 8, raised when the vocabulary products would cost more than an
  eighth of the forward: 64 on the 248K-vocabulary model),
* ``projection, stride 8``: the same with ``loss_token_stride=8`` (the default before the rule; the same
  run as ``projection`` where the rule keeps 8),

interleaved round by round (so slow phases of a shared machine hit every mode alike); each mode's time
is the median over ``--repeats`` rounds after one warm-up round. Prints tokens/s and the ratios to
``plain``. Targets: activation <= 1.15x, projection <= 1.5x. The projection side pays for every logit it
computes, so the ratio to ``plain`` is the whole overhead.

Models: the bundled demo model (``gdnprune.demo_data.demo_model_path()``), a random Qwen3.5 text model
with hidden size 1024 (3 GDN layers + 1 full attention layer, 16 key heads, 16 value heads, head dims 128,
like the smallest Qwen3.5 geometry; vocabulary 32000) and, with ``--models large-vocab``, the same with
Qwen3.5's real vocabulary of 248320 (the loss-aware Gram's ``lm_head`` products weigh most there; with only
4 layers this overstates their share for a real model of 24+ layers).

Usage::

    python benchmarks/scoring_overhead.py                    # both models
    python benchmarks/scoring_overhead.py --models large --repeats 5
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

from gdnprune.scoring import GDN_ONLY, score_model  # noqa: E402


def bundled_model():
    """The bundled demo model (fp32, eval)."""
    from gdnprune.demo_data import load_demo_model

    model, _ = load_demo_model()
    return model, model.config.vocab_size


def large_model(hidden: int = 1024, seed: int = 0, vocab: int = 32000):
    """A random Qwen3.5 text model, hidden ``hidden``, 3 GDN + 1 attention layer, GDN 16/16 heads of 128."""
    import transformers

    torch.manual_seed(seed)
    config = transformers.Qwen3_5TextConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=3 * hidden,
        num_hidden_layers=4,
        layer_types=["linear_attention"] * 3 + ["full_attention"],
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=128,
        linear_num_key_heads=16,
        linear_num_value_heads=16,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        linear_conv_kernel_dim=4,
    )
    return transformers.Qwen3_5ForCausalLM(config).eval(), config.vocab_size


def run_plain(model, batches, full_logits: bool = False) -> None:
    extra = {} if full_logits else {"logits_to_keep": 1}
    with torch.no_grad():
        for batch in batches:
            model(input_ids=batch, use_cache=False, **extra)


def measure(model, batches, repeats: int) -> dict[str, float]:
    """Median seconds per mode over ``repeats`` interleaved rounds (after one warm-up round)."""
    modes = {
        "plain": lambda: run_plain(model, batches),
        "full": lambda: run_plain(model, batches, full_logits=True),
        "activation": lambda: score_model(
            model, batches, method="activation", progress=False, blocks=GDN_ONLY
        ),
        "projection": lambda: score_model(
            model, batches, method="projection", progress=False, blocks=GDN_ONLY
        ),
        "stride8": lambda: score_model(
            model, batches, method="projection", progress=False, loss_token_stride=8, blocks=GDN_ONLY
        ),
    }
    times: dict[str, list[float]] = {name: [] for name in modes}
    for round_ in range(repeats + 1):
        for name, fn in modes.items():
            start = time.perf_counter()
            fn()
            if round_:
                times[name].append(time.perf_counter() - start)
    return {name: statistics.median(ts) for name, ts in times.items()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--models", nargs="+", choices=("bundled", "large", "large-vocab"), default=["bundled", "large"]
    )
    p.add_argument("--repeats", type=int, default=3, help="timed rounds per mode (default 3)")
    p.add_argument(
        "--threads", type=int, default=None, help="torch.set_num_threads (default: torch's choice)"
    )
    p.add_argument(
        "--bundled-batches", default="4x4x256", help="NUMxBATCHxSEQ for the bundled model (default 4x4x256)"
    )
    p.add_argument(
        "--large-batches", default="2x2x512", help="NUMxBATCHxSEQ for the large model (default 2x2x512)"
    )
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, CPU")
    print()
    print(f"load average before: {' '.join(open('/proc/loadavg').read().split()[:3])}")
    print()
    print(
        "| model | tokens | plain tok/s | plain, full logits tok/s | activation tok/s | projection tok/s "
        "| activation × | projection × (loss stride) | projection, stride 8 × | projection × full-logits plain |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    ok = True
    for name in args.models:
        if name == "bundled":
            model, vocab = bundled_model()
        else:
            model, vocab = large_model(vocab=248320 if name == "large-vocab" else 32000)
        n, b, t = (
            int(x) for x in (args.bundled_batches if name == "bundled" else args.large_batches).split("x")
        )
        g = torch.Generator().manual_seed(0)
        batches = [torch.randint(0, min(vocab, 256), (b, t), generator=g) for _ in range(n)]
        if name == "bundled":  # real text for the trained model
            from gdnprune.demo_data import byte_windows, train_text

            windows = byte_windows(train_text(), t, n * b)
            batches = [windows[i * b : (i + 1) * b] for i in range(n)]
        stride = score_model(model, batches[:1], progress=False, blocks=GDN_ONLY)["measures"][
            "loss_token_stride"
        ]
        secs = measure(model, batches, args.repeats)
        tokens = n * b * t
        ratio_a, ratio_p = secs["activation"] / secs["plain"], secs["projection"] / secs["plain"]
        ok &= ratio_a <= 1.15 and ratio_p <= 1.5
        hidden = model.config.hidden_size
        label = (
            f"{name} (hidden {hidden}, vocab {model.config.vocab_size}, "
            f"{sum(x.numel() for x in model.parameters()) / 1e6:.1f}M params)"
        )
        print(
            f"| {label} | {tokens} | {tokens / secs['plain']:.0f} | {tokens / secs['full']:.0f} | "
            f"{tokens / secs['activation']:.0f} | {tokens / secs['projection']:.0f} | {ratio_a:.3f} | "
            f"{ratio_p:.3f} ({stride}) | {secs['stride8'] / secs['plain']:.3f} | "
            f"{secs['projection'] / secs['full']:.3f} |",
            flush=True,
        )
    print()
    print("targets (activation <= 1.15x, projection <= 1.5x):", "met" if ok else "NOT met")
    print(f"load average after: {' '.join(open('/proc/loadavg').read().split()[:3])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
