#!/usr/bin/env python
"""Scoring costs 0.9-1.1x a plain forward pass (activation) and 1.25-1.4x (projection), and scales over processes with identical orders.

Two parts (``python -m benchmarks scoring PART``):

``overhead``: for each model the same calibration batches are run (under ``torch.no_grad``,
``use_cache=False``) as

* ``plain``: the forward passes alone, called exactly as :func:`gdnprune.scoring.score_model` calls the model
  (``logits_to_keep=1``: no vocabulary projection except for the last token), the baseline of the targets;
* ``plain, full logits``: the forward passes with the logits of every token (what a user's own evaluation
  pass costs), for reference;
* ``activation``: ``score_model(..., method="activation")`` (hooks + final orders);
* ``projection``: ``score_model(..., method="projection")`` (the default: hooks, Grams, the loss-aware lane
  Gram's own final norm + ``lm_head`` forward and input gradient on one token in ``loss_token_stride``,
  greedy orders; the default stride is 8, raised when the vocabulary products would cost more than an eighth
  of the forward: 64 on the 248K-vocabulary model);
* ``projection, stride 8``: the same with ``loss_token_stride=8``;

interleaved round by round; each mode's time is the median over ``--repeats`` rounds after one warm-up round.
Targets: activation <= 1.15x, projection <= 1.5x. Models: the bundled demo model, a random Qwen3.5 text model
of hidden size 1024 (3 GDN + 1 full attention layer, 16 key and 16 value heads of 128; vocabulary 32000) and,
with ``--models large-vocab``, the same with Qwen3.5's real vocabulary of 248320.

``processes``: a model folder and a calibration file are written to a temporary folder, then scored by a
worker under ``torch.distributed.run`` with 1 and with 2 processes (``score_model`` on each rank's share of
the windows, timed after a warm-up, the slowest rank's time), and end to end by ``gdnprune score`` alone and
under ``torch.distributed.run --nproc_per_node 2``. Reports tokens/s, the scaling efficiency (2-process
tokens/s / (2 x 1-process tokens/s)), whether every order is identical and the largest relative difference
of the raw scores. Models: ``bundled`` and ``large`` (the random hidden-1024 model, vocabulary 32000).

Usage::

    python -m benchmarks scoring overhead --repeats 3 --threads 1 --models large-vocab large bundled
    python -m benchmarks scoring processes --threads 1
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import textwrap
from pathlib import Path

import torch
from _common import (
    child_env,
    interleaved_medians,
    load_text,
    markdown_table,
    random_qwen35,
    torchrun,
    write_json,
)

from gdnprune import demo_data
from gdnprune.scoring import GDN_ONLY, score_model

MODELS = ("bundled", "large", "large-vocab")


def large_model(vocab: int = 32000) -> torch.nn.Module:
    """The random Qwen3.5 of both parts: hidden 1024, 3 GDN + 1 attention layer, GDN 16/16 heads of 128."""
    return random_qwen35(hidden=1024, layers=4, vocab=vocab)


# ---- overhead ----------------------------------------------------------------------------------------------


def _plain(model, batches, full_logits: bool = False) -> None:
    extra = {} if full_logits else {"logits_to_keep": 1}
    with torch.no_grad():
        for batch in batches:
            model(input_ids=batch, use_cache=False, **extra)


def _overhead_batches(name: str, spec: str) -> list[torch.Tensor]:
    n, b, t = (int(x) for x in spec.split("x"))
    if name == "bundled":  # real text for the trained model
        windows = demo_data.byte_windows(demo_data.train_text(), t, n * b)
        return [windows[i * b : (i + 1) * b] for i in range(n)]
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, 256, (b, t), generator=g) for _ in range(n)]


def _modes(model, batches) -> dict:
    """The timed modes of one model on its batches."""
    score = dict(progress=False, blocks=GDN_ONLY)
    return {
        "plain": lambda: _plain(model, batches),
        "full": lambda: _plain(model, batches, full_logits=True),
        "activation": lambda: score_model(model, batches, method="activation", **score),
        "projection": lambda: score_model(model, batches, method="projection", **score),
        "stride8": lambda: score_model(model, batches, loss_token_stride=8, **score),
    }


def overhead(args) -> int:
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, CPU; load average before: {load_text()}\n"
    )
    header = [
        "model", "tokens", "plain tok/s", "plain, full logits tok/s", "activation tok/s", "projection tok/s",
        "activation ×", "projection × (loss stride)", "projection, stride 8 ×", "projection × full-logits plain",
    ]  # fmt: skip
    rows, ok = [], True
    for name in args.models:
        model = (
            demo_data.load_demo_model()[0]
            if name == "bundled"
            else large_model(248320 if name == "large-vocab" else 32000)
        )
        batches = _overhead_batches(name, args.bundled_batches if name == "bundled" else args.large_batches)
        stride = score_model(model, batches[:1], progress=False, blocks=GDN_ONLY)["measures"][
            "loss_token_stride"
        ]
        secs = interleaved_medians(_modes(model, batches), args.repeats)
        tokens = sum(b.numel() for b in batches)
        ratio_a, ratio_p = secs["activation"] / secs["plain"], secs["projection"] / secs["plain"]
        ok &= ratio_a <= 1.15 and ratio_p <= 1.5
        params = sum(x.numel() for x in model.parameters()) / 1e6
        label = f"{name} (hidden {model.config.hidden_size}, vocab {model.config.vocab_size}, {params:.1f}M params)"
        rows.append(
            [
                label, tokens, *(f"{tokens / secs[k]:.0f}" for k in ("plain", "full", "activation", "projection")),
                f"{ratio_a:.3f}", f"{ratio_p:.3f} ({stride})", f"{secs['stride8'] / secs['plain']:.3f}",
                f"{secs['projection'] / secs['full']:.3f}",
            ]
        )  # fmt: skip
        print(rows[-1], flush=True)
    print("\n" + markdown_table(header, rows))
    print("\ntargets (activation <= 1.15x, projection <= 1.5x):", "met" if ok else "NOT met")
    print(f"load average after: {load_text()}")
    write_json(args.json, {"header": header, "rows": rows})
    return 0


# ---- processes ---------------------------------------------------------------------------------------------

WORKER = textwrap.dedent("""
    import json, sys, time
    import torch
    from gdnprune.runtime import distributed
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
        score_model(model, batches[:1], progress=False, window_offset=mine.start, blocks=GDN_ONLY)  # warm-up
        distributed.exchange()  # start together
        start = time.perf_counter()
        scores = score_model(model, batches, progress=False, window_offset=mine.start, blocks=GDN_ONLY)
        seconds = time.perf_counter() - start
        seconds = max(distributed.exchange(seconds))  # the slowest rank sets the pace
        if distributed.is_main_process():
            with open(out, "w") as f:
                json.dump({"seconds": seconds, "tokens": int(windows.numel()), "scores": scores}, f)
""")


def _write_inputs(name: str, folder: Path, windows: int, seq_len: int) -> None:
    if name == "bundled":
        shutil.copytree(demo_data.demo_model_path(), folder / "model")
    else:
        large_model().save_pretrained(folder / "model")
        demo_data.build_byte_tokenizer().save_pretrained(folder / "model")  # byte ids < 257 < 32000
    (folder / "calib.txt").write_text(demo_data.train_text()[: windows * seq_len + 1000], encoding="utf-8")


def compare(a: dict, b: dict) -> tuple[bool, float]:
    """Whether every order is identical, and the largest relative difference of the raw scores."""
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


def processes(args) -> int:
    env = child_env(args.threads)
    print(f"{args.threads} torch thread(s) per process; load average before: {load_text()}\n")
    header = [
        "model", "tokens", "1 process tok/s", "2 processes tok/s", "scaling efficiency", "orders identical",
        "max rel. score diff", "`gdnprune score` wall, 1 → 2 processes",
    ]  # fmt: skip
    rows = []
    for name in args.models:
        with tempfile.TemporaryDirectory() as tmp:
            folder = Path(tmp)
            windows = args.bundled_windows if name == "bundled" else args.large_windows
            _write_inputs(name, folder, windows, args.seq_len)
            (folder / "worker.py").write_text(WORKER, encoding="utf-8")
            sizes = [str(args.threads), str(windows), str(args.seq_len), str(args.batch_size)]
            runs, walls = {}, {}
            for n in (1, 2):
                out = folder / f"timing{n}.json"
                torchrun([str(folder / "worker.py"), str(folder / "model"), str(folder / "calib.txt"), str(out), *sizes], n, env)  # fmt: skip
                runs[n] = json.loads(out.read_text())
                cli = ["-m", "gdnprune", "score", str(folder / "model"), "--data", str(folder / "calib.txt")]
                cli += ["--num-samples", str(windows), "--seq-len", str(args.seq_len), "--batch-size"]
                cli += [str(args.batch_size), "--threads", str(args.threads), "--quiet"]
                walls[n], _ = torchrun([*cli, "--output", str(folder / f"cli{n}.json")], n, env)
            same, worst = compare(runs[1]["scores"], runs[2]["scores"])
            cli_same, cli_worst = compare(
                *(json.loads((folder / f"cli{n}.json").read_text()) for n in (1, 2))
            )
            tokens = runs[1]["tokens"]
            rate = {n: tokens / runs[n]["seconds"] for n in (1, 2)}
            rows.append(
                [
                    name, tokens, f"{rate[1]:.0f}", f"{rate[2]:.0f}", f"{rate[2] / (2 * rate[1]):.0%}",
                    "yes" if same and cli_same else "NO", f"{max(worst, cli_worst):.1e}",
                    f"{walls[1]:.1f} s → {walls[2]:.1f} s",
                ]
            )  # fmt: skip
            print(rows[-1], flush=True)
    print("\n" + markdown_table(header, rows, "lrrrrlrr"))
    print(f"\nload average after: {load_text()}")
    write_json(args.json, {"header": header, "rows": rows})
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parts = parser.add_subparsers(dest="part", required=True)
    p = parts.add_parser("overhead", help="scoring against plain forward passes")
    p.add_argument("--models", nargs="+", choices=MODELS, default=["bundled", "large"])
    p.add_argument("--repeats", type=int, default=3, help="timed rounds per mode (default 3)")
    p.add_argument("--bundled-batches", default="4x4x256", help="NUMxBATCHxSEQ, bundled model (4x4x256)")
    p.add_argument("--large-batches", default="2x2x512", help="NUMxBATCHxSEQ, large models (2x2x512)")
    p.set_defaults(run=overhead)
    q = parts.add_parser("processes", help="scoring on 1 and 2 processes")
    q.add_argument("--models", nargs="+", choices=MODELS[:2], default=["bundled", "large"])
    q.add_argument("--bundled-windows", type=int, default=64, help="calibration windows, bundled (64)")
    q.add_argument("--large-windows", type=int, default=16, help="calibration windows, large (16)")
    q.add_argument("--seq-len", type=int, default=256, help="tokens per window (default 256)")
    q.add_argument("--batch-size", type=int, default=2, help="windows per forward pass (default 2)")
    q.set_defaults(run=processes)
    for sub in (p, q):
        sub.add_argument("--threads", type=int, default=1, help="torch threads (per process; default 1)")
        sub.add_argument("--json", type=Path, default=None, help="also write the table here")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
