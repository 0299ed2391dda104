"""``gdnprune bench MODEL [MODEL ...] --workload prefill:1:2048 [-o OUT_DIR]``: prefill and decode throughput."""

from __future__ import annotations

import os
from pathlib import Path

from ..runtime.fileio import write_json_atomic
from ._options import (
    add_device_arguments,
    add_dry_run_arguments,
    add_output_arguments,
    non_negative_int,
    positive_int,
)
from ._runtime import add_runtime_arguments, model_runtime

NAME = "bench"
HELP = (
    "prefill and decode throughput of models side by side (teacher, pruned): tokens/s, ms per token, memory"
)

#: the files of an output folder (results.json marks an earlier output that --overwrite may replace)
RESULTS, TABLE, PLOT = "results.json", "results.md", "bench.png"


#: ``--workload``'s metavar and help, for every command that names a workload
WORKLOAD_METAVAR = "PHASE:BATCH:CONTEXT"
WORKLOAD_HELP = (
    "the serving workload timed: prefill:B:C is one forward of B sequences of C tokens; decode:B:C is one "
    "generation step of B sequences whose cache holds C tokens (e.g. prefill:1:2048, decode:8:4096)"
)


def add_timing_arguments(p) -> None:
    """``--repeats`` and ``--warmup-calls`` of the latency harness (``gdnprune.model.latency``)."""
    p.add_argument(
        "--repeats",
        type=positive_int,
        default=5,
        metavar="N",
        help="timed calls per latency; the median is used (default 5)",
    )
    p.add_argument(
        "--warmup-calls",
        dest="warmup_calls",
        type=non_negative_int,
        default=2,
        metavar="N",
        help="untimed calls before the timed ones (default 2)",
    )


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        NAME,
        help=HELP,
        description="Time every MODEL at every --workload on this machine with the latency harness that the "
        "plan's latency budget uses (the model's own kernels; warm-up, then the median of --repeats), and "
        "print a table: latency per call, tokens/s, ms per token, peak memory, speed-up over the first MODEL. "
        "With -o, also write results.json, a markdown table and a plot.",
    )
    p.add_argument(
        "models",
        metavar="MODEL",
        nargs="+",
        help="model folders (the unpruned teacher first: speed-ups are relative to the first); folders with "
        "per_layer_config load through gdnprune's loader",
    )
    p.add_argument(
        "--workload",
        action="append",
        required=True,
        metavar=WORKLOAD_METAVAR,
        help=WORKLOAD_HELP + " (repeatable)",
    )
    add_output_arguments(
        p, required=False, help=f"folder to create with {RESULTS}, {TABLE} and {PLOT} (default: print only)"
    )
    add_device_arguments(p)
    add_timing_arguments(p)
    p.add_argument("--seed", type=int, default=0, help="seed of the random token ids (default 0)")
    add_runtime_arguments(p)
    add_dry_run_arguments(p)
    p.set_defaults(func=run)


def _mib(value: int | None) -> str:
    return "-" if value is None else f"{value / 2**20:.1f}"


def table(results, names: dict[str, str]) -> str:
    """The results as a markdown table, one row per model and workload."""
    lines = [
        "| model | workload | latency ms | tokens/s | ms/token | peak MiB | +MiB | speed-up |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        t = r.timing
        lines.append(
            f"| {names[r.model]} | {t.workload} | {1000 * t.seconds:.2f} | {t.tokens_per_second:.1f} | "
            f"{t.ms_per_token:.4f} | {_mib(t.peak_memory_bytes)} | {_mib(t.memory_growth_bytes)} | "
            f"{r.speedup:.2f}x |"
        )
    return "\n".join(lines)


def _names(models: list[str]) -> dict[str, str]:
    """Short labels: the folder names, or the paths as given where two folder names are the same."""
    short = {m: os.path.basename(os.path.normpath(m)) or m for m in models}
    if len(set(short.values())) < len(short):
        return {m: m for m in models}
    return short


def _write(out: Path, results, names: dict[str, str], header: dict, overwrite: bool) -> bool:
    """results.json, results.md and the plot, in a temporary folder renamed into place; False when the plot
    could not be drawn (matplotlib missing)."""
    # lazy: commands import the library when they run, so --help stays fast
    from ..checkpoint.output import Staging

    # lazy: commands import the library when they run, so --help stays fast
    from ..evaluation.bench import bench_figure

    try:
        # lazy: commands import the library when they run, so --help stays fast
        import matplotlib  # noqa: F401  (lazy: the optional plot extra)

        plotted = True
    except ImportError:
        plotted = False
    staging = Staging(out, overwrite, markers=frozenset({RESULTS}))
    with staging as tmp:
        write_json_atomic(tmp / RESULTS, {**header, "results": [r.to_dict() for r in results]}, indent=2)
        (tmp / TABLE).write_text(table(results, names) + "\n", encoding="utf-8")
        if plotted:
            fig = bench_figure(results, [names[m] for m in dict.fromkeys(r.model for r in results)])
            fig.savefig(tmp / PLOT, dpi=120)
        staging.commit()
    return plotted


def run(args) -> int:
    if args.dry_run:  # before the library is imported: nothing loads, no torch
        from .estimate import dry_run  # lazy: headers and config only, never torch

        return max(dry_run(NAME, args, model) for model in args.models)
    # lazy: commands import the library when they run, so --help stays fast
    import importlib.util

    # lazy: commands import the library when they run, so --help stays fast
    import platform

    # lazy: commands import the library when they run, so --help stays fast
    from ..checkpoint.output import check_output_folder

    # lazy: commands import the library when they run, so --help stays fast
    from ..evaluation.bench import bench_models
    from ..model.latency import parse_workload  # lazy: as above

    workloads = list(dict.fromkeys(parse_workload(w) for w in args.workload))  # malformed: exit 2 here
    if args.output is not None:
        check_output_folder(Path(args.output), args.overwrite, frozenset({RESULTS}))

    # lazy: commands import the library when they run, so --help stays fast
    import torch

    # lazy: commands import the library when they run, so --help stays fast
    import transformers

    # lazy: commands import the library when they run, so --help stays fast
    from tqdm.auto import tqdm

    names = _names(list(args.models))
    with model_runtime(args):
        with tqdm(
            total=len(args.models) * len(workloads), desc="bench", unit="timing", disable=args.quiet
        ) as bar:
            results = bench_models(
                args.models,
                workloads,
                device=args.device,
                dtype=args.dtype,
                repeats=args.repeats,
                warmup=args.warmup_calls,
                seed=args.seed,
                progress=bar.update,
            )
    print(table(results, names))
    if args.output is not None:
        header = {
            "version": 1,
            "models": list(args.models),
            "workloads": [str(w) for w in workloads],
            "device": results[0].timing.device,
            "dtype": args.dtype,
            "repeats": args.repeats,
            "warmup_calls": args.warmup_calls,
            "threads": torch.get_num_threads(),
            "flash_linear_attention": importlib.util.find_spec("fla") is not None,
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "machine": platform.processor() or platform.machine(),
        }
        if torch.cuda.is_available() and results[0].timing.device.startswith("cuda"):
            header["gpu"] = torch.cuda.get_device_name(torch.device(results[0].timing.device))
        plotted = _write(Path(args.output), results, names, header, args.overwrite)
        note = "" if plotted else f" (no {PLOT}: `pip install gdnprune[plot]` for the plot)"
        print(f"wrote {args.output}: {RESULTS}, {TABLE}" + (f", {PLOT}" if plotted else "") + note)
    return 0
