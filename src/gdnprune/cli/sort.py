"""``gdnprune sort MODEL_DIR --scores SCORES.json --output OUT``: the sorted teacher (same function), every
order of the scores file applied (GDN layers, attention heads, MLP and shared-expert channels, experts)."""

from __future__ import annotations

from ._options import add_output_arguments, add_self_contained_argument, summary
from ._runtime import without_blas_threads

NAME = "sort"
HELP = "permute every block by importance: GDN, attention, MLP, experts (same function)"


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        NAME,
        help=HELP,
        description="Apply every importance order of a scores file (GDN layers, attention heads, MLP and "
        "shared-expert channels, routed experts): the output computes the same function (the sorted "
        "teacher), and a later `gdnprune slice` of any axis keeps its most important part.",
    )
    p.add_argument(
        "model_dir", metavar="MODEL_DIR", help="Hugging Face model folder (safetensors, sharded or not)"
    )
    p.add_argument(
        "--scores",
        required=True,
        metavar="SCORES.json",
        help='JSON object with "layers": {prefix: {*_order_most_important_first: ...}}',
    )
    add_output_arguments(p)
    add_self_contained_argument(p)
    p.add_argument(
        "--dequantize",
        action="store_true",
        help="FP8 checkpoints: write the weights whose scale tiles the %s would split in BF16 (added "
        "to modules_to_not_convert) instead of refusing" % ("order" if NAME == "sort" else "cut"),
    )
    p.set_defaults(func=run)


def run(args) -> int:
    without_blas_threads()
    from ..checkpoint import sort_checkpoint  # lazy: fast --help

    manifest = sort_checkpoint(
        args.model_dir,
        args.scores,
        args.output,
        overwrite=args.overwrite,
        dequantize=args.dequantize,
        self_contained=args.self_contained,
        progress=not args.quiet,
    )
    print(summary(manifest, args.output))
    return 0
