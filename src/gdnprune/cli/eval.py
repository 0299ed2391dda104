"""``gdnprune eval MODEL [MODEL ...] --tasks LIST -o OUT_DIR``: lm-eval tasks and recall probes, side by side."""

from __future__ import annotations

import argparse
import sys

from ._options import (
    add_device_arguments,
    add_distributed_arguments,
    add_dry_run_arguments,
    add_output_arguments,
    non_negative_int,
    positive_int,
)
from ._runtime import add_runtime_arguments, model_runtime

NAME = "eval"
HELP = "evaluate models side by side on lm-eval tasks, recall probes and nats per byte"


def context_lengths(text: str) -> list[int]:
    """``256,1024,4096`` -> [256, 1024, 4096]."""
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        values = []
    if not values or any(v < 1 for v in values):
        raise ValueError(f"expected positive integers separated by commas, got {text!r}")
    return values


def limit(text: str) -> float:
    """lm-eval's ``--limit``: a count of documents per task, or a share below 1."""
    value = float(text)
    if value <= 0:
        raise ValueError(f"expected a positive number, got {text!r}")
    return int(value) if value >= 1 else value


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        NAME,
        help=HELP,
        description="Evaluate every MODEL on the same tasks with lm-evaluation-harness (pip install "
        "'gdnprune[eval]') and print one table: parameters, active parameters and each task's metric with "
        "its standard error; a recall probe below the first MODEL's by more than the standard error of the "
        "difference is marked. Task names are lm-eval's (a hub task such as hellaswag, or a YAML task of "
        "--include-path) or gdnprune's built-in ones, which need no download: nats_per_byte (on --data), "
        "the recall probes passkey, mqar, multikey and vartrack (RULER's multi-key needle and variable "
        "tracking) at --context-lengths (one task per length, passkey_256, ...), and needle, the "
        "needle-in-a-haystack grid (the passkey at depths 0, 25, 50, 75, 100% of every length; drawn as "
        "OUT_DIR/needle.png, one panel per model). "
        "Models whose layers differ (per_layer_config) are loaded by gdnprune. Writes OUT_DIR/results.json, "
        "results.md, results.png and tasks/ (the built-in tasks of the run, for lm_eval --include_path). "
        "Under torchrun or accelerate launch each process scores its share of every task's documents, as "
        "lm_eval does under accelerate launch; rank 0 prints and writes.",
    )
    p.add_argument(
        "models", nargs="+", metavar="MODEL", help="model folders (e.g. teacher, pruned, recovered)"
    )
    p.add_argument(
        "--tasks",
        required=True,
        metavar="LIST",
        help="comma-separated task names, e.g. nats_per_byte,passkey,mqar or hellaswag",
    )
    add_output_arguments(p, metavar="OUT_DIR", help="folder to create for the results")
    p.add_argument(
        "--include-path",
        action="append",
        default=[],
        metavar="DIR",
        help="a folder of lm-eval YAML tasks (repeatable), as lm_eval's --include_path",
    )
    p.add_argument("--data", metavar="FILE", help="UTF-8 text file of the nats_per_byte task")
    p.add_argument(
        "--context-lengths",
        type=context_lengths,
        default=None,
        metavar="LIST",
        help="lengths of the recall probes in characters, none beyond a model's max_position_embeddings "
        "(default: what every model holds: 4K, 8K, ... 128K tokens up to the smallest "
        "max_position_embeddings, or a quarter, half and all of it when that is below 4K, in characters "
        "as the models' tokenizers count them)",
    )
    p.add_argument(
        "--limit", type=limit, default=None, metavar="N", help="at most N documents per task (or a share < 1)"
    )
    p.add_argument(
        "--num-fewshot",
        type=non_negative_int,
        default=None,
        metavar="N",
        help="few-shot examples (lm-eval's)",
    )
    p.add_argument(
        "--batch-size", type=positive_int, default=8, metavar="N", help="requests per forward (default 8)"
    )
    add_device_arguments(p)
    p.add_argument("--seed", type=int, default=0, help="seed of the recall probes and of lm-eval (default 0)")
    add_runtime_arguments(p)
    add_distributed_arguments(p)
    add_dry_run_arguments(p)
    p.set_defaults(func=run)


def run(args) -> int:
    """Under torchrun / accelerate launch every rank scores its share of the documents; rank 0 prints and
    writes."""
    if args.dry_run:  # before the library is imported: nothing loads, no torch
        from .estimate import dry_run  # lazy: headers and config only, never torch

        return max(dry_run(NAME, args, model) for model in args.models)
    # lazy: commands import the library when they run, so --help stays fast
    from ..runtime.distributed import RankFailedError, process_group, rank, world_size

    # lazy: commands import the library when they run, so --help stays fast
    from . import report_error

    who = ""  # "rank R of N: " in front of the messages of a multi-process run
    try:
        with process_group(timeout=args.dist_timeout) as several:
            who = f"rank {rank()} of {world_size()}: " if several else ""
            return _eval(args, main=rank() == 0)
    except RankFailedError as exc:  # another rank failed (its message), or the ranks lost touch
        report_error(NAME, exc, who)
        return 2 if exc.user_error else 1
    except (ValueError, OSError) as exc:
        if not who:
            raise
        return report_error(NAME, exc, who)


def _eval(args, main: bool) -> int:
    # lazy: commands import the library when they run, so --help stays fast
    from ..evaluation.api import EvalOptions, MissingExtraError, evaluate_models

    options = EvalOptions(
        tasks=[t.strip() for t in args.tasks.split(",") if t.strip()],
        include_path=args.include_path,
        data=args.data,
        context_lengths=args.context_lengths,
        limit=args.limit,
        num_fewshot=args.num_fewshot,
        batch_size=args.batch_size,
        device=args.device,
        dtype=args.dtype,
        seed=args.seed,
    )
    runtime = args if main else argparse.Namespace(**{**vars(args), "quiet": True})  # rank 0 speaks
    try:
        with model_runtime(runtime):
            report = evaluate_models(
                args.models, options, args.output, overwrite=args.overwrite, progress=not runtime.quiet
            )
    except MissingExtraError as exc:
        print(f"gdnprune eval: error: {exc}", file=sys.stderr)
        return 1
    if main:
        print(report.table, end="")
        if not args.quiet:
            extra = ", results.png" if report.plotted else " (no plot: matplotlib is not installed)"
            extra += ", needle.png" if report.needles else ""
            print(f"wrote {report.out_dir}: results.json, results.md{extra}, tasks/")
    return 0
