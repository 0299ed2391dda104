#!/usr/bin/env python
"""Which order wins for MLP channels and attention heads (issue 21): validation loss after a cut.

On the bundled demo model (or ``--model``: a byte-level model folder such as the deeper model of
``scripts/train_demo_model.py``), the sub-blocks are scored on training text with
``score_model(...)`` (every kind by default) by both methods, then cut in memory (:func:`gdnprune.slice_model`):

* every MLP to 1/2, 1/4 and 1/8 of its channels;
* every full-attention layer to one key-value group (all its query heads), to one query head per group,
  and to one head in all;

each with the ``projection`` order (the default), the ``activation`` baseline (Minitron), the identity
order, the reversed projection order, and ``--random-orders`` random orders (mean, standard deviation,
and the share of them each method beats). For attention, where few choices exist, also the best and the
worst of every possible kept set (exhaustive, on the validation text itself: an upper bound no order
can beat). Reported: validation loss (nats/byte) minus the unpruned model's.

    .venv/bin/python benchmarks/dense_orders.py --threads 1   # about 13 minutes on a shared 2-core machine
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

from gdnprune import demo_data  # noqa: E402
from gdnprune.io.loading import slice_model  # noqa: E402
from gdnprune.model.subblock_geometry import orders_to_payload  # noqa: E402
from gdnprune.model.subblock_surgery import find_model_blocks, random_orders  # noqa: E402
from gdnprune.scoring import score_model  # noqa: E402


def _loss(model, args, blocks, orders) -> float:
    cut = slice_model(model, None, blocks=blocks, block_orders=orders)
    return demo_data.validation_loss(cut, seq_len=args.seq_len, num_windows=args.val_windows)


def _reversed(payload: dict) -> dict:
    out = dict(payload)
    for key, value in payload.items():
        if key.endswith("_order_most_important_first"):
            out[key] = [row[::-1] for row in value] if value and isinstance(value[0], list) else value[::-1]
    return out


def _attention_choices(block) -> list[dict]:
    """Orders that put every possible set of key-value groups and query heads first (for exhaustive cuts)."""
    nkv, r = block.shape.num_key_value_heads, block.shape.heads_per_group
    out = []
    for groups in itertools.permutations(range(nkv)):
        for rows in itertools.product(list(itertools.permutations(range(r))), repeat=nkv):
            out.append(orders_to_payload({"kv_groups": list(groups), "query_heads": [list(x) for x in rows]}))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--model", type=Path, default=None, help="byte-level model folder (default: the bundled model)"
    )
    p.add_argument(
        "--calib-samples", type=int, default=64, help="calibration windows of training text (default 64)"
    )
    p.add_argument("--calib-seq-len", type=int, default=128)
    p.add_argument("--val-windows", type=int, default=48, help="validation windows (default 48)")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--random-orders", type=int, default=20)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--json", type=Path, default=None, help="also write all numbers to this JSON file")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    if args.model is None:
        model, _ = demo_data.load_demo_model()
    else:
        from gdnprune.io.loading import load_pretrained

        model = load_pretrained(args.model, dtype=torch.float32).eval()
    base = demo_data.validation_loss(model, seq_len=args.seq_len, num_windows=args.val_windows)
    calib = demo_data.byte_windows(demo_data.train_text(), args.calib_seq_len, args.calib_samples)
    batches = [calib[i : i + 4] for i in range(0, calib.shape[0], 4)]
    blocks = find_model_blocks(model)
    orders = {}
    for method in ("projection", "activation"):
        scores = score_model(model, batches, method=method, progress=False)
        orders[method] = {b.prefix: scores["layers"][b.prefix] for b in blocks}
    orders["identity"] = None
    orders["reversed projection"] = {k: _reversed(v) for k, v in orders["projection"].items()}
    g = torch.Generator().manual_seed(0)
    randoms = [
        {b.prefix: orders_to_payload(random_orders(b, generator=g)) for b in blocks}
        for _ in range(args.random_orders)
    ]
    mlp = next((b for b in blocks if b.kind in ("mlp", "shared_expert")), None)
    attention = [b for b in blocks if b.kind == "attention"]
    cuts = []
    if mlp is not None:
        key = "intermediate_size" if mlp.kind == "mlp" else "shared_expert_intermediate_size"
        for frac in (2, 4, 8):
            cuts.append(
                (f"MLPs at 1/{frac} of the channels", {key: mlp.shape.intermediate_size // frac}, "mlp")
            )
    if attention:
        a = attention[0].shape
        cuts += [
            (
                "attention: 1 key-value group",
                {"num_key_value_heads": 1, "num_attention_heads": a.heads_per_group},
                "attention",
            ),
            (
                "attention: 1 query head per group",
                {"num_key_value_heads": a.num_key_value_heads, "num_attention_heads": a.num_key_value_heads},
                "attention",
            ),
            ("attention: 1 head", {"num_key_value_heads": 1, "num_attention_heads": 1}, "attention"),
        ]
    print(
        f"model {args.model or 'bundled'}: {len(blocks)} sub-blocks ({', '.join(sorted({b.kind for b in blocks}))}); "
        f"validation loss {base:.4f} nats/byte ({args.val_windows} windows x {args.seq_len}); calibration "
        f"{args.calib_samples} x {args.calib_seq_len} training bytes",
        flush=True,
    )
    results = []
    for label, target, kind in cuts:
        kind_blocks = [b for b in blocks if (b.kind == "attention") == (kind == "attention")]
        fields = {b.prefix: target for b in kind_blocks}
        row = {"cut": label, "target": target}
        for method, method_orders in orders.items():
            chosen = None if method_orders is None else {p: method_orders[p] for p in fields}
            row[method] = _loss(model, args, fields, chosen) - base
        row["random"] = [_loss(model, args, fields, {p: r[p] for p in fields}) - base for r in randoms]
        if kind == "attention" and len(kind_blocks) == 1:
            block = kind_blocks[0]
            every = [_loss(model, args, fields, {block.prefix: c}) - base for c in _attention_choices(block)]
            row["best possible"], row["worst possible"] = min(every), max(every)
        results.append(row)
        print(_format(row), flush=True)
    print(f"({time.perf_counter() - t0:.0f} s)")
    if args.json:
        args.json.write_text(json.dumps({"base_loss": base, "results": results}, indent=1))
    return 0


def _format(row: dict) -> str:
    rnd = row["random"]
    mean, std = statistics.mean(rnd), statistics.pstdev(rnd)
    beats = {m: sum(v > row[m] for v in rnd) / len(rnd) for m in ("projection", "activation")}
    parts = [
        f"{row['cut']:<36}",
        f"projection {row['projection']:+.4f} (beats {beats['projection']:.0%} of random)",
        f"activation {row['activation']:+.4f} (beats {beats['activation']:.0%})",
        f"identity {row['identity']:+.4f}",
        f"reversed {row['reversed projection']:+.4f}",
        f"random {mean:+.4f} +- {std:.4f}",
    ]
    if "best possible" in row:
        parts.append(f"best/worst possible {row['best possible']:+.4f}/{row['worst possible']:+.4f}")
    return "  ".join(parts)


if __name__ == "__main__":
    sys.exit(main())
