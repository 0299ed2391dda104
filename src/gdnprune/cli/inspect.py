"""``gdnprune inspect MODEL_DIR``: the GDN layers of a checkpoint folder, as a table or JSON."""

from __future__ import annotations

import json

from ._runtime import without_blas_threads

NAME = "inspect"
HELP = "list the GDN layers of a checkpoint folder"


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        NAME,
        help=HELP,
        description="A table of every GDN layer (prefix, layout, geometry, parameters) "
        "and the parameter totals. Reads the safetensors headers only.",
    )
    p.add_argument(
        "model_dir", metavar="MODEL_DIR", help="Hugging Face model folder (safetensors, sharded or not)"
    )
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(func=run)


def run(args) -> int:
    without_blas_threads()
    from ..checkpoint import inspect_checkpoint

    info = inspect_checkpoint(args.model_dir)
    print(json.dumps(info, indent=2) if args.json else format_inspect(info))
    return 0


def format_inspect(info: dict) -> str:
    """The table that ``gdnprune inspect`` prints for :func:`gdnprune.checkpoint.inspect_checkpoint`'s dict."""
    rows = [("prefix", "layout", "Hk", "Hv", "dk", "dv", "parameters")]
    for layer in info["layers"]:
        rows.append(
            (
                layer["prefix"],
                layer["layout"],
                str(layer["num_key_heads"]),
                str(layer["num_value_heads"]),
                str(layer["key_head_dim"]),
                str(layer["value_head_dim"]),
                f"{layer['parameters']:,}",
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = [
        f"{info['model_dir']}: {info['model_type']}, {info['format']}, {info['shards']} shard(s), "
        f"dtypes {info['dtypes']}",
    ]
    if info["manifest"]:
        lines.append(
            f"gdnprune output of '{info['manifest']['operation']}', sorted: {info['manifest']['sorted']}"
        )
    for r in rows:
        lines.append(
            "  ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
        )
    total = info["total_parameters"]
    lines.append(
        f"{len(info['layers'])} GDN layers: {info['gdn_parameters']:,} parameters "
        f"({100 * info['gdn_parameters'] / max(total, 1):.1f}% of all parameters); other: {info['other_parameters']:,}; "
        f"total: {total:,}"
    )
    quantized = {layer["prefix"]: layer["quantized"] for layer in info["layers"] if layer.get("quantized")}
    if quantized:
        first = next(iter(quantized.values()))
        same = all(q == first for q in quantized.values())
        lines.append(
            f"FP8 block-quantised GDN weights ({'every layer' if same else 'first layer'}): "
            + "; ".join(f"{k}: {v}" for k, v in first.items())
        )
    if info["passthrough"]:
        lines.append(f"left untouched (pass-through): {info['passthrough']}")
    return "\n".join(lines)
