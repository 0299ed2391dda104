"""``gdnprune score MODEL_DIR --data FILE --output SCORES.json``: importance of every GDN head and channel.

Also under ``torchrun`` / ``accelerate launch`` (no extra flag: every rank scores its share of the
windows, rank 0 writes), one share at a time (``--shard i/n --partial OUT_i``) and the merge of the
shares (``--merge OUT_0 ... --output SCORES.json``).
"""

from __future__ import annotations

import argparse
import warnings
from pathlib import Path

from ._options import (
    SCORE_BLOCKS,
    add_blocks_argument,
    add_calibration_arguments,
    add_deprecated_alias,
    add_distributed_arguments,
    add_dry_run_arguments,
    add_lane_search_arguments,
    add_output_arguments,
    blocks_from_args,
    checked_data,
    deprecated,
    scoring_options,
    shard_spec,
)
from ._runtime import add_runtime_arguments, model_runtime

NAME = "score"
HELP = (
    "measure the importance of every head, channel and expert (GDN, attention, MLP, shared expert, routed "
    "experts) on calibration text"
)


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        NAME,
        help=HELP,
        description="Run calibration text through the model with hooks on every GatedDeltaNet layer and every "
        "attention, MLP, shared-expert and routed-experts block (--blocks) and write a scores file (the "
        "importance orders of every axis, most important first) for `gdnprune sort`. Under "
        "torchrun or accelerate launch every process scores its share of the windows and rank 0 "
        "writes the file. Without a launcher, --shard i/n --partial FILE scores one share and "
        "--merge FILE... --output SCORES.json adds the shares up.",
    )
    p.add_argument(
        "model_dir",
        metavar="MODEL_DIR",
        nargs="?",
        help="Hugging Face model folder (config, weights, tokenizer); not with --merge",
    )
    add_output_arguments(p, metavar="SCORES.json", help="scores file to write", required=False, folder=False)
    add_calibration_arguments(p, data_required=False)
    add_blocks_argument(
        p,
        help=f"the kinds of block to order, GDN layers always (default: {SCORE_BLOCKS}; the kinds the model "
        "lacks are skipped, depth has nothing to order); hidden: also the hidden channels (the residual "
        "stream's width; not by default: then `sort` rewrites every tensor; a plan cuts the hidden size "
        "only where the scores order them)",
        default=SCORE_BLOCKS,
    )
    add_deprecated_alias(
        p, "--sub-blocks", "blocks", "--blocks (default: every kind)", convert=lambda v: SCORE_BLOCKS, nargs=0
    )
    q = p.add_argument_group("one-shot quality")
    q.add_argument(
        "--recall",
        action="store_true",
        help="every calibration window followed by a recall probe (passkey or MQAR) of its length whose "
        "answers carry a quarter of the pair's weight: the orders then keep what recall needs (what prune does for "
        "a plan measured on recall windows; twice the forwards)",
    )
    add_lane_search_arguments(q)
    q.add_argument(
        "--compensation-stats",
        metavar="STATS.safetensors",
        default=None,
        help="also write the calibration statistics that `slice --compensation-stats` refits out_proj "
        "with (least squares; float64 [Hv*dv]^2 per layer)",
    )
    q.add_argument("--compensation", action="store_true", help=argparse.SUPPRESS)  # deprecated alias
    g = p.add_argument_group("many processes")
    g.add_argument(
        "--shard",
        type=shard_spec,
        default=None,
        metavar="i/n",
        help="score only share i of n of the calibration windows (0 <= i < n) and write its raw "
        "statistics with --partial",
    )
    g.add_argument(
        "--partial",
        metavar="FILE",
        default=None,
        help="write the raw statistics of the share (a safetensors file) instead of a scores file",
    )
    g.add_argument(
        "--merge",
        nargs="+",
        metavar="FILE",
        default=None,
        help="add up the partial files of every share and write the scores file given by --output "
        "(no MODEL_DIR, no --data)",
    )
    add_distributed_arguments(g)
    add_runtime_arguments(p)
    add_dry_run_arguments(p)
    p.set_defaults(func=run)


def compensation_path(output) -> str:
    """Where the deprecated ``score --compensation`` writes its statistics: beside the scores file."""
    text = str(output)
    return (text[: -len(".json")] if text.endswith(".json") else text) + ".compensation.safetensors"


def _mode(args) -> str:
    """``merge``, ``partial`` or ``scores``; the argument combinations that make no sense are errors."""
    if args.merge is not None:
        extra = [
            flag
            for flag, value in (
                ("MODEL_DIR", args.model_dir),
                ("--data", args.data),
                ("--shard", args.shard),
                ("--partial", args.partial),
            )
            if value is not None
        ]
        if extra:
            raise ValueError(f"--merge takes only partial files and --output; remove {', '.join(extra)}")
        if args.output is None:
            raise ValueError("--merge needs --output SCORES.json, the scores file to write")
        return "merge"
    if args.model_dir is None:
        raise ValueError("expected MODEL_DIR, the model folder to score (or --merge with partial files)")
    if args.data is None:
        raise ValueError("expected --data FILE, the calibration text")
    if args.shard is not None and args.partial is None:
        raise ValueError(
            "--shard scores one share of the windows: give --partial FILE for its statistics "
            "(and merge the shares with --merge)"
        )
    if args.partial is not None:
        if args.output is not None:
            raise ValueError(
                "give either --output (a scores file) or --partial (the statistics of one share), not both"
            )
        return "partial"
    if args.output is None:
        raise ValueError("expected --output SCORES.json (or --shard i/n --partial FILE)")
    return "scores"


def _merge(args) -> int:
    from ..io.scores_file import save_scores  # lazy: fast --help
    from ..runtime.distributed import launch_info  # lazy: fast --help
    from ..runtime.fileio import check_output_file  # lazy: fast --help
    from ..scoring import merge_partials  # lazy: fast --help

    info = launch_info()
    if info is not None:
        raise ValueError(
            f"--merge runs in one process, found a launch of {info.world_size}; run it without "
            "torchrun or accelerate launch"
        )
    check_output_file(args.output, args.overwrite)
    scores = merge_partials(args.merge)
    path = save_scores(scores, args.output, overwrite=args.overwrite)
    subs = sum(1 for payload in scores["layers"].values() if "kind" in payload)
    print(
        f"gdnprune score: merged {scores['shards']} partials ({len(scores['layers']) - subs} GDN layers"
        + (f" and {subs} sub-blocks" if subs else "")
        + ", "
        f"{scores['num_tokens']} tokens, computed by {scores['world_size']} processes) -> {path}"
    )
    return 0


def _score(args, mode: str) -> int:
    from ..io.scores_file import save_scores  # lazy: fast --help
    from ..runtime.distributed import fail_together, is_main_process  # lazy: fast --help
    from ..runtime.fileio import check_output_file  # lazy: fast --help
    from ..scoring import measure_checkpoint, save_partial, score_checkpoint  # lazy: fast --help

    main = is_main_process()
    target = args.partial if mode == "partial" else args.output
    with fail_together():
        if main:
            check_output_file(target, args.overwrite)
            if mode == "scores" and args.compensation_stats:
                check_output_file(args.compensation_stats, args.overwrite)
        data = checked_data(args, tokenizer_dir=args.model_dir)
    # None: every kind (the hidden channels not), no note per kind
    blocks = None if args.blocks == SCORE_BLOCKS else blocks_from_args(args)
    path: Path | str | None = None  # what was written (in words, with a statistics file)
    options = dict(progress=not args.quiet, blocks=blocks, recall=args.recall, **scoring_options(args))
    runtime = args if main else argparse.Namespace(**{**vars(args), "quiet": True})
    with model_runtime(runtime), warnings.catch_warnings():
        if not main:  # the ranks see the same data and model: rank 0 speaks for them
            warnings.simplefilter("ignore")
        if mode == "partial":
            run = measure_checkpoint(args.model_dir, data, shard=args.shard or (0, 1), **options)
            with fail_together():
                path = save_partial(run, args.partial, overwrite=args.overwrite) if main else None
            index, count = run.shard["index"], run.shard["count"]
            start, stop = run.shard["windows"]
            what = (
                f"share {index} of {count} (windows {start}-{stop - 1} of {run.shard['total_windows']})"
                if stop > start
                else f"share {index} of {count} (no windows: only {run.shard['total_windows']})"
            )
            tokens = next(iter(run.statistics.layers.values())).stats.get("num_tokens")
            done = f"{what}, {int(tokens) if tokens is not None else 0} tokens"
        else:
            scores = score_checkpoint(
                args.model_dir,
                data,
                lane_search=args.lane_search,
                lane_search_samples=args.lane_search_samples,
                compensate=args.compensation_stats is not None,
                **options,
            )
            stats = scores.pop("compensation_statistics", None)
            with fail_together():
                path = save_scores(scores, args.output, overwrite=args.overwrite) if main else None
                if stats is not None and main:
                    from ..quality.compensate import model_identity, save_statistics  # lazy: fast --help

                    stats_path = args.compensation_stats
                    save_statistics(stats, stats_path, model=model_identity(args.model_dir))
                    path = f"{path} (compensation statistics: {stats_path})"
            subs = sum(1 for payload in scores["layers"].values() if "kind" in payload)
            done = (
                f"{len(scores['layers']) - subs} GDN layers"
                + (f" and {subs} sub-blocks" if subs else "")
                + (" and the hidden channels" if scores.get("hidden") else "")
                + f" scored with {args.method!r} on {scores['num_tokens']} tokens"
            )
            run = None
    if main:
        processes = run.world_size if run is not None else scores["world_size"]
        by = f" by {processes} processes" if processes > 1 else ""
        print(f"gdnprune score: {done}{by} -> {path}")
    return 0


def run(args) -> int:
    if args.dry_run:  # before the library is imported: nothing loads, no torch
        from .estimate import dry_run  # lazy: headers and config only, never torch

        return dry_run(NAME, args, args.model_dir)
    from ..runtime.distributed import RankFailedError, process_group, rank, world_size  # lazy: fast --help
    from . import report_error  # lazy: cli/__init__ imports this module

    if args.compensation:
        deprecated("--compensation", "--compensation-stats STATS.safetensors")
        if args.compensation_stats is None:  # beside the scores file, as before
            args.compensation_stats = compensation_path(args.output or "SCORES.json")
    mode = _mode(args)
    if mode != "scores" and (args.lane_search or args.compensation_stats):
        raise ValueError(
            "--lane-search and --compensation-stats go with a scores file: not with --shard/--partial or --merge"
        )
    if mode == "merge":
        return _merge(args)
    who = ""  # "rank R of N: " in front of the messages of a multi-process run
    try:
        with process_group(timeout=args.dist_timeout) as several:
            who = f"rank {rank()} of {world_size()}: " if several else ""
            return _score(args, mode)
    except RankFailedError as exc:  # another rank failed (its message), or the ranks lost touch
        report_error(NAME, exc, who)
        return 2 if exc.user_error else 1
    except (ValueError, OSError) as exc:
        if not who:
            raise
        return report_error(NAME, exc, who)
