"""``gdnprune prune MODEL_DIR --data FILE --output OUT --num-key-heads N ...``: score, sort and slice."""

from __future__ import annotations

from ._options import add_calibration_arguments, add_output_arguments, add_target_arguments, scoring_options, \
    target_from_args
from ._runtime import add_runtime_arguments, model_runtime

NAME = "prune"
HELP = "score + sort + slice a checkpoint in one command"


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        NAME, help=HELP,
        description="Score the GDN layers of MODEL_DIR on calibration text, then sort every layer by importance "
                    "and cut it to the target in one streaming pass. Axes not given keep their size.",
    )
    p.add_argument("model_dir", metavar="MODEL_DIR", help="Hugging Face model folder (config, weights, tokenizer)")
    add_output_arguments(p)
    add_target_arguments(p)
    add_calibration_arguments(p)
    add_runtime_arguments(p)
    p.set_defaults(func=run)


def run(args) -> int:
    from ..prune import prune_checkpoint

    with model_runtime(args):
        manifest = prune_checkpoint(args.model_dir, args.data, args.output, target_from_args(args),
                                    overwrite=args.overwrite, progress=not args.quiet, **scoring_options(args))
    target = manifest.get("target") or {}
    print(f"gdnprune prune: scored with {args.method!r}, sorted and sliced to {target} -> {args.output}")
    return 0
