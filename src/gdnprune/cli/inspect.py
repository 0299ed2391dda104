"""``gdnprune inspect MODEL_DIR``: every block of a checkpoint folder that a plan can cut, as tables or JSON."""

from __future__ import annotations

import json
from collections.abc import Sequence

from ._runtime import without_blas_threads

NAME = "inspect"
HELP = "list what can be cut in a checkpoint folder: GDN layers, attention, MLPs, experts, layers"


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        NAME,
        help=HELP,
        description="A table per kind of block a plan can cut (GDN layers, attention, MLP, shared expert, "
        "routed experts, whole decoder layers) with its geometry and parameters, and the parameters per kind. "
        "Reads config.json and the safetensors headers only.",
    )
    p.add_argument(
        "model_dir", metavar="MODEL_DIR", help="Hugging Face model folder (safetensors, sharded or not)"
    )
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(func=run)


def run(args) -> int:
    without_blas_threads()
    from ..checkpoint import inspect_checkpoint  # lazy: fast --help

    info = inspect_checkpoint(args.model_dir)
    print(json.dumps(info, indent=2) if args.json else format_inspect(info))
    return 0


#: column headers of the geometry fields (the config keys)
_HEADERS = {
    "num_key_heads": "Hk",
    "num_value_heads": "Hv",
    "key_head_dim": "dk",
    "value_head_dim": "dv",
    "num_attention_heads": "heads",
    "num_key_value_heads": "kv heads",
    "head_dim": "head dim",
    "intermediate_size": "channels",
    "num_experts": "experts",
    "num_experts_per_tok": "per token",
}
#: each kind's title: what it is and what a plan cuts in it
_TITLES = {
    "gdn": "GDN layers (Hk key heads, Hv value heads, dk key dim, dv value dim)",
    "attention": "attention (query heads, key-value heads; the head dim stays)",
    "mlp": "MLP (intermediate channels)",
    "shared_expert": "shared experts (intermediate channels)",
    "experts": "routed experts (experts per layer; per token stays)",
}


def _table(rows: Sequence[tuple[str, ...]], left: int) -> list[str]:
    """Aligned rows, two spaces in front: the first ``left`` columns left-aligned, numbers right-aligned."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return [
        "  " + "  ".join(c.ljust(w) if i < left else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
        for r in rows
    ]


def _kind_table(kind: str, blocks: list[dict]) -> list[str]:
    fields = [k for k in blocks[0] if k in _HEADERS]
    rows = [("prefix", "layout", *(_HEADERS[f] for f in fields), "parameters")]
    rows += [(b["prefix"], b["layout"], *(str(b[f]) for f in fields), f"{b['parameters']:,}") for b in blocks]
    return [_TITLES.get(kind, kind), *_table(rows, 2)]


def _layers_table(layers: list[dict]) -> list[str]:
    rows = [("layer", "type", "parameters", "removable")]
    rows += [
        (str(d["index"]), str(d["type"] or "-"), f"{d['parameters']:,}", "yes" if d["removable"] else "no")
        for d in layers
    ]
    title = "decoder layers (a plan may remove a whole layer; it keeps one full-attention layer)"
    return [title, *[line.rstrip() for line in _table(rows, 2)]]


def format_inspect(info: dict) -> str:
    """The tables that ``gdnprune inspect`` prints for :func:`gdnprune.checkpoint.inspect_checkpoint`'s dict:
    one per kind of block a plan can cut, the decoder layers, and the parameters per kind."""
    lines = [
        f"{info['model_dir']}: {info['model_type']}, {info['format']}, {info['shards']} shard(s), "
        f"dtypes {info['dtypes']}",
    ]
    if info["manifest"]:
        lines.append(
            f"gdnprune output of '{info['manifest']['operation']}', sorted: {info['manifest']['sorted']}"
        )
    gdn = [{**layer, "layout": layer["layout"]} for layer in info["layers"]]
    lines += _kind_table("gdn", gdn)
    blocks = [b for b in info.get("sub_blocks", []) if "unsupported" not in b]
    for kind in dict.fromkeys(b["kind"] for b in blocks):
        lines += _kind_table(kind, [b for b in blocks if b["kind"] == kind])
    for b in info.get("sub_blocks", []):
        if "unsupported" in b:
            lines.append(f"{b['kind']}: cannot be cut in this checkpoint ({b['unsupported']})")
    if info.get("decoder_layers"):
        lines += _layers_table(info["decoder_layers"])
    total = info["total_parameters"]
    hidden = info.get("hidden") or {}
    if "unsupported" in hidden:
        lines.append(f"hidden size: cannot be cut in this checkpoint ({hidden['unsupported']})")
    elif hidden:
        lines.append(
            f"hidden size {hidden['hidden_size']}: {hidden['parameters']:,} parameters on the residual stream "
            f"({100 * hidden['parameters'] / max(total, 1):.1f}% of all, each shrinking with it)"
        )
    by_kind = info.get("parameters_by_kind") or {
        "gdn": info["gdn_parameters"],
        "other": info["other_parameters"],
    }
    shares = ", ".join(
        f"{kind} {n:,} ({100 * n / max(total, 1):.1f}%)" for kind, n in by_kind.items() if kind != "other"
    )
    other = by_kind.get("other", 0)
    lines.append(
        f"parameters by kind (% of all parameters): {shares}; not cut (embeddings, norms, ...): {other:,} "
        f"({100 * other / max(total, 1):.1f}%); total: {total:,}"
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
