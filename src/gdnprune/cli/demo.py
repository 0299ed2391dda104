"""``gdnprune demo``: the whole pipeline on the bundled model, with a table, results.json and a plot."""

from __future__ import annotations

import sys

from ._options import add_deprecated_alias, add_output_arguments, non_negative_int, positive_int
from ._runtime import model_runtime

NAME = "demo"
HELP = "score -> sort -> slice -> distill the bundled demo model and compare orderings"


# long: one argparse definition per flag, in the order --help shows them
def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        NAME,
        help=HELP,
        description="Run the whole pipeline on the bundled byte-level Qwen3.5 model: score, sort (checked to be "
        "function preserving), slice to nested targets, and report validation loss for the importance order, "
        "the identity order and random orders, then distill the middle slice from the unpruned model for a "
        "few steps (--recover-steps), and plan the whole model (GDN layers, attention heads, MLP channels) at "
        "half of all its parameters, printing the split over sub-blocks; it ends with an eval table of the "
        "teacher, the middle slice and the recovered slice on the built-in lm-eval tasks. Writes a table, "
        "results.json, PNG plots, checkpoints, the whole-model plan and eval.md.",
    )
    add_output_arguments(p, metavar="OUT_DIR", help="folder to create (default: demo_output)", required=False)
    p.set_defaults(output="demo_output")
    p.add_argument(
        "--method",
        default="projection",
        choices=("projection", "activation", "random"),
        help="projection (default): output-projection Gram + greedy removal; activation: "
        "Minitron-style magnitudes; random: seeded random orders",
    )
    p.add_argument(
        "--num-samples",
        type=positive_int,
        default=64,
        metavar="N",
        help="calibration windows for scoring (default 64)",
    )
    add_deprecated_alias(p, "--calibration-windows", "num_samples", "--num-samples", type=positive_int)
    p.add_argument(
        "--seq-len",
        type=positive_int,
        default=256,
        metavar="N",
        help="tokens (bytes) per window (default 256)",
    )
    p.add_argument(
        "--eval-samples",
        type=positive_int,
        default=32,
        metavar="N",
        help="held-out windows the losses are measured on (default 32)",
    )
    add_deprecated_alias(p, "--validation-windows", "eval_samples", "--eval-samples", type=positive_int)
    p.add_argument(
        "--num-random",
        type=non_negative_int,
        default=4,
        metavar="N",
        help="random orders to average (default 4)",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the random orders (default 0)")
    p.add_argument(
        "--recover-steps",
        type=non_negative_int,
        default=40,
        metavar="N",
        help="distillation steps that recover the middle slice (default 40; 0 skips it)",
    )
    p.add_argument(
        "--eval-limit",
        type=non_negative_int,
        default=16,
        metavar="N",
        help="documents per task of the closing eval table (teacher, middle slice, recovered on gdnprune's "
        "built-in lm-eval tasks: nats_per_byte, passkey, mqar at --seq-len; default 16; 0 skips it; needs "
        "pip install 'gdnprune[eval]')",
    )
    p.add_argument(
        "--no-plan", action="store_true", help="do not plan the whole model at half of its parameters"
    )
    p.add_argument(
        "--no-checkpoints", action="store_true", help="do not write the sorted and sliced checkpoints"
    )
    p.add_argument(
        "--threads",
        type=positive_int,
        default=1,
        metavar="N",
        help="CPU threads for torch (default 1: the model is tiny)",
    )
    p.set_defaults(func=run)


def run(args) -> int:
    # lazy: commands import the library when they run, so --help stays fast
    from ..demo import run_demo

    with model_runtime(args):
        run_demo(
            args.output,
            num_samples=args.num_samples,
            seq_len=args.seq_len,
            num_random=args.num_random,
            eval_samples=args.eval_samples,
            method=args.method,
            seed=args.seed,
            write_checkpoints=not args.no_checkpoints,
            recover_steps=args.recover_steps,
            budget_params=None if args.no_plan else 0.5,
            progress=not args.quiet and sys.stderr.isatty(),
            threads=args.threads,
            overwrite=args.overwrite,
            log=print,
            eval_limit=args.eval_limit,
        )
    return 0
