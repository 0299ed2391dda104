"""``gdnprune quantize MODEL_DIR -o OUT --scheme S``: the model in a format engines serve at low precision."""

from __future__ import annotations

import sys

from ._options import add_data_arguments, add_output_arguments, checked_data, positive_int
from ._runtime import add_runtime_arguments, model_runtime

NAME = "quantize"
HELP = "write a model quantized for serving (compressed-tensors: fp8-block, fp8-dynamic, w4a16)"

#: the choices of --scheme, in the order of SCHEMES (kept here so `--help` imports no torch)
SCHEME_NAMES = ("fp8-block", "fp8-dynamic", "w4a16")


def add_quantize_argument(p) -> None:
    """``--quantize SCHEME`` of ``prune`` and ``distill``: the quantized model written beside the output."""
    p.add_argument(
        "--quantize",
        choices=SCHEME_NAMES,
        default=None,
        metavar="SCHEME",
        help=f"also write the output quantized with SCHEME ({', '.join(SCHEME_NAMES)}) to OUT_DIR-SCHEME "
        "(`gdnprune quantize` with its defaults: tiles and groups of 128, GPTQ on the calibration text)",
    )


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        NAME,
        help=HELP,
        description="Write MODEL_DIR (any gdnprune output: uniform, per-layer, MoE, vision-language) with the "
        "projections of its decoder layers quantized, in the compressed-tensors format that vLLM, SGLang "
        "and transformers load. Embeddings, the LM head, norms, routers, the shared-expert gate, the GDN "
        "gates, decay and convolution, and the vision tower keep their precision (the config's `ignore` "
        "lists them). A matrix a cut left at a width the tiles or groups do not divide keeps its "
        "precision too, with a warning naming it. fp8-block: FP8 weights in square tiles, one scale "
        "each (Qwen's FP8 tiles), activations in groups quantized at run time; fp8-dynamic: FP8 weights "
        "per output channel, activations per token; w4a16: 4-bit weights in groups along the input, "
        "chosen by GPTQ on --data (or rounded to nearest with --calibration rtn).",
    )
    p.add_argument("model_dir", metavar="MODEL_DIR", help="Hugging Face model folder (bf16 or fp32)")
    add_output_arguments(p)
    p.add_argument("--scheme", required=True, choices=SCHEME_NAMES, help="the quantization scheme")
    p.add_argument(
        "--block-size",
        dest="block_size",
        type=positive_int,
        default=None,
        metavar="N",
        help="fp8-block: the edge of the square weight tile and of the activation group (default 128, as "
        "engines expect; a multiple of 16)",
    )
    p.add_argument(
        "--group-size",
        dest="group_size",
        type=positive_int,
        default=None,
        metavar="N",
        help="w4a16: input channels per weight scale (default 128; a multiple of 16)",
    )
    p.add_argument(
        "--calibration",
        choices=("gptq", "rtn"),
        default=None,
        help="w4a16: gptq (default; needs --data) or rtn (round to nearest); the fp8 schemes round to nearest",
    )
    add_data_arguments(p, required=False, what="calibration text of GPTQ")
    p.add_argument(
        "--num-samples",
        type=positive_int,
        default=128,
        metavar="N",
        help="calibration windows of GPTQ (default 128); the first ones of the corpus",
    )
    p.add_argument(
        "--seq-len", type=positive_int, default=512, metavar="N", help="tokens per window (default 512)"
    )
    p.add_argument(
        "--batch-size", type=positive_int, default=4, metavar="N", help="windows per forward pass (default 4)"
    )
    add_runtime_arguments(p)
    p.set_defaults(func=run)


def size_of(args) -> int | None:
    """The one size flag that applies to ``args.scheme`` (a user error for the other)."""
    wrong = {"fp8-block": "group_size", "w4a16": "block_size"}.get(args.scheme)
    for dest in ("block_size", "group_size"):
        if getattr(args, dest, None) is not None and (dest == wrong or args.scheme == "fp8-dynamic"):
            flag = "--" + dest.replace("_", "-")
            raise ValueError(f"{flag} does not apply to --scheme {args.scheme}")
    return args.block_size if args.scheme == "fp8-block" else args.group_size


def _library():
    """``gdnprune.quantize.quantize_checkpoint``; an error line naming the extra without compressed-tensors."""
    try:
        from ..quantize import quantize_checkpoint  # lazy: as every command's library import
    except ModuleNotFoundError as exc:
        if exc.name != "compressed_tensors":
            raise
        raise MissingQuantizeExtra(
            "quantize needs compressed-tensors: pip install 'gdnprune[quantize]'"
        ) from None
    return quantize_checkpoint


class MissingQuantizeExtra(ImportError):
    """compressed-tensors is not installed (exit 1: the environment's)."""


def quantize_beside(model_dir, scheme: str, *, data, overwrite: bool, progress: bool) -> tuple[str, dict]:
    """``prune``/``distill --quantize``: ``model_dir`` quantized with ``scheme``'s defaults to
    ``MODEL_DIR-SCHEME``; returns (that folder, its manifest)."""
    quantize_checkpoint = _library()

    out = f"{str(model_dir).rstrip('/')}-{scheme}"
    manifest = quantize_checkpoint(
        model_dir, out, scheme=scheme, data=data, overwrite=overwrite, progress=progress
    )
    return out, manifest


def summary(out: str, manifest: dict) -> str:
    sizes = manifest["weight_bytes"]
    size = f" {manifest['size']}" if manifest.get("size") else ""
    kept = len(manifest["high_precision"])
    return (
        f"gdnprune quantize: {manifest['scheme']}{size} ({manifest['calibration']}) -> {out}: "
        f"{len(manifest['quantized'])} matrices quantized"
        + (f", {kept} kept in high precision" if kept else "")
        + f"; weights {sizes['after'] / 2**20:.2f} MiB ({sizes['after'] / max(sizes['before'], 1):.2f}x)"
    )


def run(args) -> int:
    size = size_of(args)
    try:
        quantize_checkpoint = _library()
    except MissingQuantizeExtra as exc:
        print(f"gdnprune quantize: error: {exc}", file=sys.stderr)
        return 1
    with model_runtime(args):
        data = checked_data(args, tokenizer_dir=args.model_dir)
        manifest = quantize_checkpoint(
            args.model_dir,
            args.output,
            scheme=args.scheme,
            size=size,
            calibration=args.calibration,
            data=data,
            num_samples=args.num_samples,
            seq_len=args.seq_len,
            batch_size=args.batch_size,
            overwrite=args.overwrite,
            progress=not args.quiet,
        )
    print(summary(args.output, manifest))
    return 0
