"""``gdnprune demo``: the whole pipeline on the bundled model, with a table, results.json and a plot."""

from __future__ import annotations

import sys

from ._runtime import model_runtime

NAME = "demo"
HELP = "score -> sort -> slice the bundled demo model and compare orderings"


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        NAME, help=HELP,
        description="Run the whole pipeline on the bundled byte-level Qwen3.5 model: score, sort (checked to be "
        "function preserving), slice to nested targets, and report validation loss for the importance order, "
        "the identity order and random orders. Writes a table, results.json, a PNG plot and checkpoints.",
    )
    p.add_argument("--output", default="demo_output", help="output folder (default: %(default)s)")
    p.add_argument("--method", default="projection", choices=["projection", "activation", "random"],
                   help="scoring method (default: %(default)s)")
    p.add_argument("--calibration-windows", type=int, default=64, help="calibration windows (default: %(default)s)")
    p.add_argument("--seq-len", type=int, default=256, help="window length in bytes (default: %(default)s)")
    p.add_argument("--num-random", type=int, default=4, help="random orders to average (default: %(default)s)")
    p.add_argument("--validation-windows", type=int, default=32, help="validation windows (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random orders (default: %(default)s)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (default: %(default)s; the model is tiny)")
    p.add_argument("--no-checkpoints", action="store_true", help="do not write the sorted and sliced checkpoints")
    p.add_argument("--recover-steps", type=int, default=40,
                   help="distillation steps that recover the middle slice (default: %(default)s; 0 skips it)")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.set_defaults(func=run)


def run(args) -> int:
    for name in ("calibration_windows", "seq_len", "num_random", "validation_windows", "threads", "recover_steps"):
        if getattr(args, name) < (0 if name in ("num_random", "recover_steps") else 1):
            raise ValueError(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    from ..demo import run_demo

    with model_runtime(args):
        run_demo(
            args.output,
            calibration_windows=args.calibration_windows,
            seq_len=args.seq_len,
            num_random=args.num_random,
            validation_windows=args.validation_windows,
            method=args.method,
            seed=args.seed,
            write_checkpoints=not args.no_checkpoints,
            recover_steps=args.recover_steps,
            progress=not args.quiet and sys.stderr.isatty(),
            threads=args.threads,
            log=print,
        )
    return 0
