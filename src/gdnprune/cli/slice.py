"""``gdnprune slice MODEL_DIR --output OUT --num-key-heads N ...``: cut every GDN layer to a nested prefix."""

from __future__ import annotations

from ._options import add_deprecated_alias, add_output_arguments, positive_float, add_plan_arguments, add_target_arguments, summary, target_from_args
from ._runtime import without_blas_threads

NAME = "slice"
HELP = "cut every GDN layer to a nested prefix"


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(NAME, help=HELP,
                              description="Keep the first key heads, value heads, key dims and value dims of "
                                          "every GDN layer and rewrite the geometry in config.json. An axis "
                                          "not given keeps its size; --plan gives every layer its own target "
                                          "(written with transformers' per_layer_config when the layers "
                                          "differ; load those with gdnprune.load_pretrained). Sort first so "
                                          "that the prefix is the most important part.")
    p.add_argument("model_dir", metavar="MODEL_DIR", help="Hugging Face model folder (safetensors, sharded or not)")
    add_output_arguments(p)
    add_target_arguments(p)
    add_plan_arguments(p)
    p.add_argument("--compensation-stats", metavar="STATS.safetensors", default=None,
                   help="refit out_proj by least squares to reconstruct the full layer output, from these "
                        "calibration statistics (`gdnprune score --compensation-stats`); outputs are then not nested")
    add_deprecated_alias(p, "--compensate", "compensation_stats", "--compensation-stats STATS.safetensors",
                         metavar="STATS.safetensors")
    p.add_argument("--ridge", type=positive_float, default=None, metavar="X",
                   help="ridge strength of the least-squares refit, relative to the mean diagonal (default 1e-3)")
    p.add_argument("--dequantize", action="store_true",
                   help="FP8 checkpoints: write the weights whose scale blocks the %s would split in BF16 (added "
                        "to modules_to_not_convert) instead of refusing" % ("order" if NAME == "sort" else "cut"))
    p.set_defaults(func=run)


def run(args) -> int:
    if not args.compensation_stats:  # the refit multiplies matrices (torch, which may use OpenBLAS)
        without_blas_threads()
    from ..checkpoint import slice_checkpoint

    target = target_from_args(args)
    manifest = slice_checkpoint(args.model_dir, args.output, target=target, plan=args.plan, tp=args.tp,
                                multiple_of=args.multiple_of, compensation=args.compensation_stats, ridge=args.ridge,
                                dequantize=args.dequantize,
                                overwrite=args.overwrite, progress=not args.quiet)
    print(summary(manifest, args.output))
    return 0
