"""``gdnprune score MODEL_DIR --data FILE --output SCORES.json``: importance of every GDN head and channel."""

from __future__ import annotations

from ._options import add_calibration_arguments, scoring_options
from ._runtime import add_runtime_arguments, model_runtime

NAME = "score"
HELP = "measure the importance of every GDN head and channel on calibration text"


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        NAME, help=HELP,
        description="Run calibration text through the model with hooks on every GatedDeltaNet layer and write a "
                    "scores file (importance orders per layer, most important first) for `gdnprune sort`.",
    )
    p.add_argument("model_dir", metavar="MODEL_DIR", help="Hugging Face model folder (config, weights, tokenizer)")
    p.add_argument("--output", required=True, metavar="SCORES.json", help="scores file to write")
    p.add_argument("--overwrite", action="store_true", help="replace SCORES.json if it exists")
    add_calibration_arguments(p)
    add_runtime_arguments(p)
    p.add_argument("--quiet", "-q", action="store_true", help="no progress bar, no notes")
    p.set_defaults(func=run)


def run(args) -> int:
    from ..scores import check_output_file, save_scores
    from ..scoring import score_checkpoint

    check_output_file(args.output, args.overwrite)
    with model_runtime(args):
        scores = score_checkpoint(args.model_dir, args.data, progress=not args.quiet, **scoring_options(args))
    path = save_scores(scores, args.output, overwrite=args.overwrite)
    print(f"gdnprune score: {len(scores['layers'])} GDN layers scored with {args.method!r} on "
          f"{scores['num_tokens']} tokens -> {path}")
    return 0
