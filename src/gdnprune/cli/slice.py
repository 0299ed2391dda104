"""``gdnprune slice MODEL_DIR --output OUT --num-key-heads N ...``: cut every GDN layer to a nested prefix."""

from __future__ import annotations

from ._options import (
    add_deprecated_alias,
    add_output_arguments,
    add_plan_arguments,
    add_self_contained_argument,
    add_target_arguments,
    positive_float,
    positive_int,
    summary,
    target_from_args,
)
from ._runtime import without_blas_threads

NAME = "slice"
HELP = "cut every GDN layer to a nested prefix"


# Over 80 lines: argparse definitions in a row, one per option.
def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        NAME,
        help=HELP,
        description="Keep the first key heads, value heads, key dims and value dims of "
        "every GDN layer and rewrite the geometry in config.json. An axis "
        "not given keeps its size; --plan gives every layer its own target "
        "(written with transformers' per_layer_config when the layers "
        "differ; load those with gdnprune.load_pretrained, or with "
        "--self-contained with transformers alone). Sort first so "
        "that the prefix is the most important part.",
    )
    p.add_argument(
        "model_dir", metavar="MODEL_DIR", help="Hugging Face model folder (safetensors, sharded or not)"
    )
    add_output_arguments(p)
    add_self_contained_argument(p)
    add_target_arguments(p)
    blocks = p.add_argument_group(
        "attention and MLP",
        "cut every full-attention layer or MLP (the same nested "
        "prefix for each); per-layer sizes go in --plan",
    )
    blocks.add_argument(
        "--intermediate-size",
        dest="intermediate_size",
        type=positive_int,
        metavar="N",
        help="MLP channels of every dense MLP",
    )
    blocks.add_argument(
        "--shared-expert-intermediate-size",
        dest="shared_expert_intermediate_size",
        type=positive_int,
        metavar="N",
        help="channels of every MoE shared expert",
    )
    blocks.add_argument(
        "--num-attention-heads",
        dest="num_attention_heads",
        type=positive_int,
        metavar="N",
        help="query heads of every full-attention layer, a multiple of the key-value heads",
    )
    blocks.add_argument(
        "--num-key-value-heads",
        dest="num_key_value_heads",
        type=positive_int,
        metavar="N",
        help="key-value heads (GQA groups) of every full-attention layer",
    )
    blocks.add_argument(
        "--num-experts",
        dest="num_experts",
        type=positive_int,
        metavar="N",
        help="routed experts kept in every MoE layer (the first N: sort first; the router keeps "
        "their rows; num_experts_per_tok is unchanged and must be <= N)",
    )
    p.add_argument(
        "--hidden-size",
        dest="hidden_size",
        type=positive_int,
        metavar="N",
        help="hidden size (the residual stream's width) of the whole model: every tensor that reads or "
        "writes the residual stream (embeddings, LM head, norms, every projection, mtp.*, a VL merger's "
        "output) keeps its first N hidden channels (sort first: the scores' hidden order)",
    )
    p.add_argument(
        "--rescale-norms",
        dest="rescale_norms",
        metavar="SCORES.json",
        default=None,
        help="with --hidden-size: the rescaled-norms correction, from these scores (the ones MODEL_DIR was "
        "sorted by): every RMS norm on the residual stream is scaled by the expected ratio of the RMS over "
        "the kept channels to the RMS over all of them; outputs are then not nested",
    )
    p.add_argument(
        "--remove-layers",
        dest="remove_layers",
        metavar="I,J",
        default=None,
        help="remove these decoder layers (numbered as in the input, e.g. 3,7): their tensors are "
        "dropped, later layers renumbered, config.json rewritten; mtp.* is kept",
    )
    add_plan_arguments(p)
    p.add_argument(
        "--compensation-stats",
        metavar="STATS.safetensors",
        default=None,
        help="refit out_proj by least squares to reconstruct the full layer output, from these "
        "calibration statistics (`gdnprune score --compensation-stats`); outputs are then not nested",
    )
    add_deprecated_alias(
        p,
        "--compensate",
        "compensation_stats",
        "--compensation-stats STATS.safetensors",
        metavar="STATS.safetensors",
    )
    p.add_argument(
        "--ridge",
        type=positive_float,
        default=None,
        metavar="X",
        help="ridge strength of the least-squares refit, relative to the mean diagonal (default 1e-3)",
    )
    p.add_argument(
        "--dequantize",
        action="store_true",
        help="FP8 checkpoints: write the weights whose scale tiles the %s would split in BF16 (added "
        "to modules_to_not_convert) instead of refusing" % ("order" if NAME == "sort" else "cut"),
    )
    p.set_defaults(func=run)


def run(args) -> int:
    if not args.compensation_stats:  # the refit multiplies matrices (torch, which may use OpenBLAS)
        without_blas_threads()
    from ..checkpoint import slice_checkpoint  # lazy: fast --help
    from ..model.layer_removal import parse_layer_list  # lazy: fast --help
    from ..model.subblock_geometry import BLOCK_FIELDS  # lazy: fast --help
    from ..model.targets import TargetError  # lazy: fast --help

    sub_blocks = {f: getattr(args, f) for f in BLOCK_FIELDS if getattr(args, f) is not None}
    if args.hidden_size is not None:
        sub_blocks["hidden_size"] = args.hidden_size
    if sub_blocks and args.plan is not None:
        raise TargetError("give a target (--intermediate-size, --hidden-size, ...) or --plan, not both")
    remove = parse_layer_list(args.remove_layers) if args.remove_layers is not None else None
    target = target_from_args(args, required=not sub_blocks and not remove and args.plan is None)
    if sub_blocks:
        target = {**(target or {}), **sub_blocks}
    manifest = slice_checkpoint(
        args.model_dir,
        args.output,
        target=target,
        plan=args.plan,
        tp=args.tp,
        multiple_of=args.multiple_of,
        snap_quant=args.snap_quant,
        compensation_stats=args.compensation_stats,
        ridge=args.ridge,
        dequantize=args.dequantize,
        self_contained=args.self_contained,
        remove_layers=remove,
        rescale_norms=args.rescale_norms,
        overwrite=args.overwrite,
        progress=not args.quiet,
    )
    line = summary(manifest, args.output)
    if manifest.get("removed_layers"):
        line += f"; removed decoder layers {manifest['removed_layers']}"
    if manifest.get("hidden") and manifest["hidden"]["target"] != manifest["hidden"]["shape"]:
        line += f"; hidden size {manifest['hidden']['shape']['hidden_size']} -> {manifest['hidden']['target']['hidden_size']}"
    if manifest.get("blocks"):
        kinds: dict[str, int] = {}
        for entry in manifest["blocks"].values():
            kinds[entry["kind"]] = kinds.get(entry["kind"], 0) + 1
        blocks = ", ".join(f"{n} {kind} block{'s' * (n > 1)}" for kind, n in sorted(kinds.items()))
        if all(layer["target"] == layer["shape"] for layer in manifest["layers"].values()):
            line = f"wrote {args.output}: cut {blocks}; GDN layers unchanged ({manifest['elapsed_seconds']:.1f} s)"
        else:
            line += f"; also cut {blocks}"
    if manifest.get("snap_quant"):
        line += f"; cut widths snapped to multiples of {manifest['snap_quant']} (--snap-quant)"
    print(line)
    return 0
