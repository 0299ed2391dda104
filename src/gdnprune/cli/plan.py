"""``gdnprune plan MODEL --scores S --data CALIB --budget-params 0.5 --output PLAN.json``: per-layer widths."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from ._options import (
    BLOCKS,
    add_blocks_argument,
    add_calibration_arguments,
    add_constraint_arguments,
    add_deprecated_alias,
    add_distributed_arguments,
    add_dry_run_arguments,
    add_output_arguments,
    blocks_from_args,
    checked_data,
    non_negative_int,
    positive_int,
)
from ._plan_summary import format_plan, write_outputs
from ._ranking import add_rank_arguments, check_rank_flags, rank_cost_printer
from ._recall import add_recall_arguments
from ._runtime import add_runtime_arguments, model_runtime
from .bench import WORKLOAD_HELP, WORKLOAD_METAVAR

NAME = "plan"
#: --sensitivity's choices and --bld-steps' default (gdnprune.plan.api.SENSITIVITIES and
#: gdnprune.plan.measure.bld.DEFAULT_STEPS: written out here so that --help does not import the library; a test
#: checks they agree)
SENSITIVITIES = ("halving", "short", "measured", "bld", "proxy")
BLD_STEPS = 20
HELP = (
    "choose every layer's widths (GDN, attention heads, MLP channels, routed experts) and which layers to remove "
    "under parameter, memory or state budgets (measured sensitivity + exact MILP)"
)


def _budget(text: str) -> float:
    # lazy: commands import the library when they run, so --help stays fast
    import argparse

    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected a fraction such as 0.5 or an absolute amount, got {text!r}"
        ) from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected a positive budget, got {text!r}")
    return value


def add_search_arguments(p) -> None:
    """The budget and search options, shared with ``gdnprune prune``."""
    _add_budget_arguments(p)
    add_blocks_argument(
        p,
        help=f"what may shrink under a whole-model budget (default all: {BLOCKS}); experts: the number of routed experts kept "
        "per MoE layer; depth: whole decoder layers removed (a candidate of every layer that costs "
        "nothing, measured as the KL with that layer alone skipped); hidden: the hidden size (one for the "
        "whole model: each of --hidden-sizes planned as a model of its own, the whole cut models measured, "
        "the least KL kept)",
    )
    p.add_argument(
        "--hidden-sizes",
        dest="hidden_sizes",
        default=None,
        metavar="LIST",
        help="with hidden in --blocks (the hidden size, one choice for the whole model): the hidden sizes "
        "to plan and measure (e.g. 4096,3584,3072; default the full size, 7/8 and 3/4 of it, "
        "multiples of --multiple-of or 8)",
    )
    p.add_argument(
        "--sensitivity",
        choices=SENSITIVITIES,
        default="halving",
        help="halving (default): KL from the unpruned model with each layer cut alone, on calibration "
        "windows, by successive halving (every candidate on a few windows; the choice measured on all "
        "of them before it is trusted); where GDN layers may shrink the windows are recall windows: each "
        "calibration window followed by a passkey or MQAR probe of its length (without a tokenizer, spans "
        "of the text written twice), the answers a quarter of the KL, so that a cut that loses the "
        "model's memory shows; short: the same on "
        "the calibration windows as they are (before 0.x the default); measured: every candidate on every "
        "window (the exact reference, "
        "several times slower); bld: every candidate first trained --bld-steps steps to reproduce its "
        "unpruned block's output (blockwise local distillation), then measured: the plan sums recovered "
        "losses (slower still); proxy: output energy removed, from the scores (no forward pass)",
    )
    add_recall_arguments(p)
    p.add_argument(
        "--bld-steps",
        type=positive_int,
        default=BLD_STEPS,
        metavar="N",
        help=f"AdamW steps of every candidate with --sensitivity bld (default {BLD_STEPS})",
    )
    p.add_argument(
        "--dim-step",
        default="1/8",
        metavar="STEP",
        help="head-dim grid: a fraction of the dim (default 1/8) or a channel count such as 16",
    )
    p.add_argument(
        "--axes",
        default="key_heads,lanes,key_dim,value_dim",
        metavar="LIST",
        help="axes the search may cut (default all four: key_heads,lanes,key_dim,value_dim)",
    )
    p.add_argument(
        "--uniform",
        action="store_true",
        help="one geometry per kind of block: all GDN layers one, all MLPs one, all attention layers one (for engines that need uniform layers)",
    )
    add_servable_arguments(p)
    _add_evolve_arguments(p)
    add_rank_arguments(p)
    for name, kind in (
        ("generations", non_negative_int),
        ("offspring", positive_int),
        ("seed", non_negative_int),
    ):
        add_deprecated_alias(p, f"--refine-{name}", f"evolve_{name}", f"--evolve-{name}", type=kind)
    add_constraint_arguments(p)


def _add_budget_arguments(p) -> None:
    """The budgets: of the whole model, its GDN layers, memory and state."""
    p.add_argument(
        "--budget-params",
        type=_budget,
        metavar="X",
        help="parameters of the whole model to keep, embeddings included: a fraction (e.g. 0.5) or an "
        "absolute count; every sub-block of --blocks may shrink",
    )
    p.add_argument(
        "--budget-active-params",
        type=_budget,
        metavar="X",
        help="parameters used per token to keep (routed experts count num_experts_per_tok/num_experts of "
        "theirs; without MoE the same as --budget-params): a fraction or a count",
    )
    p.add_argument(
        "--budget-memory",
        type=_budget,
        metavar="X",
        help="inference memory per sequence to keep: GDN recurrent state (float32) plus the attention "
        "layers' KV cache at --context tokens (model dtype): a fraction or bytes",
    )
    p.add_argument(
        "--context",
        type=positive_int,
        metavar="N",
        help="tokens per sequence of --budget-memory's KV cache (required with it)",
    )
    p.add_argument(
        "--budget-gdn-params",
        type=_budget,
        metavar="X",
        help="GDN parameters to keep: a fraction or a count (given alone, only GDN layers are cut)",
    )
    p.add_argument(
        "--budget-state",
        type=_budget,
        metavar="X",
        help="recurrent state per sequence to keep (Hv*dk*dv + conv state, float32): a fraction or bytes",
    )


def _add_evolve_arguments(p) -> None:
    """The evolutionary search from the exact choice."""
    p.add_argument(
        "--evolve-generations",
        type=non_negative_int,
        default=0,
        metavar="N",
        help="then improve the plan by measuring whole plans: N generations of an evolutionary search "
        "(fitness: the KL of the whole cut model on the calibration windows; never worse than the "
        "plan it starts from; default 0: off)",
    )
    p.add_argument(
        "--evolve-offspring",
        type=positive_int,
        default=8,
        metavar="N",
        help="plans tried per generation of the evolutionary search (default 8)",
    )
    p.add_argument(
        "--evolve-seed",
        type=non_negative_int,
        default=0,
        metavar="N",
        help="the evolutionary search's random seed (default 0; the search is deterministic for a seed)",
    )


def add_servable_arguments(p) -> None:
    """``--servable`` (shared with ``gdnprune prune``)."""
    p.add_argument(
        "--servable",
        action="store_true",
        help="only plans that stock engines (vLLM, SGLang, llama.cpp, ...) load from a standard config: one "
        "geometry per kind of block plus whole decoder layers removed (with depth in --blocks; one "
        "full-attention layer kept); the exact best such plan. With --plan (prune): refuse a plan that "
        "needs per_layer_config",
    )
    p.add_argument(
        "--budget-latency",
        type=_budget,
        metavar="X",
        help="latency to keep, a fraction of the unpruned model's at --workload (e.g. 0.5): every candidate "
        "block is timed on this machine (warm-up, median of repeats) and the times are summed in the MILP",
    )
    p.add_argument(
        "--workload",
        action="append",
        metavar=WORKLOAD_METAVAR,
        help=WORKLOAD_HELP + " (one: the workload of --budget-latency)",
    )


def search_options(args) -> dict:
    """The keyword arguments of :func:`gdnprune.plan.plan_model` given on the command line."""
    return dict(
        budget_params=args.budget_params,
        budget_gdn_params=args.budget_gdn_params,
        budget_active_params=args.budget_active_params,
        budget_memory=args.budget_memory,
        budget_state=args.budget_state,
        context=args.context,
        blocks=blocks_from_args(args),
        sensitivity=args.sensitivity,
        bld_steps=args.bld_steps,
        dim_step=args.dim_step,
        axes=[a.strip() for a in args.axes.split(",") if a.strip()],
        tp=args.tp,
        multiple_of=args.multiple_of,
        snap_quant=args.snap_quant,
        uniform=args.uniform,
        servable=args.servable,
        budget_latency=args.budget_latency,
        workload=args.workload[0] if args.workload else None,
        evolve_generations=args.evolve_generations,
        evolve_offspring=args.evolve_offspring,
        evolve_seed=args.evolve_seed,
        rank_by_distill=args.rank_by_distill,
        rank_steps=args.rank_steps,
        rank_lr=args.rank_lr,
        hidden_sizes=_sizes(args.hidden_sizes),
        keep_recall=args.keep_recall,
    )


def _sizes(text: str | None) -> list[int] | None:
    """``"4096,3584"`` -> ``[4096, 3584]`` (ValueError: exit 2)."""
    if text is None:
        return None
    try:
        sizes = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise ValueError(f"--hidden-sizes: expected integers separated by commas, found {text!r}") from None
    if not sizes or min(sizes) < 1:
        raise ValueError(f"--hidden-sizes: expected positive integers, found {text!r}")
    return sizes


def check_latency_options(args) -> None:
    """--budget-latency and --workload go together; a malformed workload is refused (ValueError: exit 2)."""
    # lazy: commands import the library when they run, so --help stays fast
    from ..model.latency import parse_workload

    if args.budget_latency is None and args.workload is None:
        return
    if args.workload is None:
        raise ValueError("--budget-latency is a latency at a workload: give --workload PHASE:BATCH:CONTEXT")
    if args.budget_latency is None:
        raise ValueError("--workload is the workload of --budget-latency: give --budget-latency X too")
    if len(args.workload) > 1:
        raise ValueError(f"--workload: --budget-latency takes one workload, found {len(args.workload)}")
    if args.budget_latency > 1:
        raise ValueError(
            f"--budget-latency: expected a fraction of the unpruned model's latency in (0, 1], found "
            f"{args.budget_latency:g}"
        )
    try:
        parse_workload(args.workload[0])
    except ValueError as exc:
        raise ValueError(str(exc).replace("`workload`", "--workload", 1)) from None


def any_budget(args) -> bool:
    """Whether the command line gives a budget."""
    return any(
        getattr(args, f"budget_{name}") is not None
        for name in ("params", "active_params", "memory", "gdn_params", "state", "latency")
    )


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        NAME,
        help=HELP,
        description="Measure how much each GDN layer, and under a whole-model budget (--budget-params, "
        "--budget-active-params, --budget-memory) each attention, MLP and routed-experts sub-block, "
        "suffers from every candidate width and from the removal of its decoder layer (the KL divergence "
        "from the unpruned model when that sub-block alone is cut or that layer alone skipped, by "
        "successive halving or in full, or a proxy from the scores), then choose one candidate per layer "
        "that minimises the summed sensitivity "
        "within the budgets (an exact multiple-choice knapsack, scipy's MILP); with "
        "--evolve-generations, improve that plan by measuring whole plans (an evolutionary search). The budgets are checked "
        "before any forward. Writes PLAN.json for `slice --plan` / `prune --plan`, "
        "PLAN.sensitivity.json with every candidate and PLAN.sensitivity.png.",
    )
    p.add_argument("model_dir", metavar="MODEL_DIR", help="the (unsorted) model the scores describe")
    p.add_argument(
        "--scores", required=True, metavar="SCORES.json", help="gdnprune score's file for MODEL_DIR"
    )
    add_output_arguments(
        p, metavar="PLAN.json", help="plan file to write (and its report beside it)", folder=False
    )
    add_calibration_arguments(
        p,
        data_required=False,
        num_samples=16,
        method=False,
        purpose="the measured sensitivity (needs --data)",
    )
    add_search_arguments(p)
    p.add_argument(
        "--snap-servable",
        metavar="PLAN.json",
        help="the best servable plan near this heterogeneous plan (from gdnprune plan): under its budgets, on "
        "its grid; the report gives the cost of servability, predicted and measured on the calibration "
        "windows (needs --data; the budgets come from PLAN.json)",
    )
    add_distributed_arguments(p)
    add_runtime_arguments(p)
    p.add_argument("--json", action="store_true", help="print the plan as JSON instead of a table")
    add_dry_run_arguments(p)
    p.set_defaults(func=run)


def plan_threads(model_dir: str | Path, seq_len: int | None) -> int:
    """The default torch threads of a plan search: from the model's width and the tokens of one forward
    (one calibration window) and the free cores (:func:`._runtime.default_threads`)."""
    # lazy: commands import the library when they run, so --help stays fast
    from ._runtime import default_threads

    try:
        config = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return default_threads(0, 0)
    text = config.get("text_config") or config
    return default_threads(int(text.get("hidden_size") or 0), int(seq_len or 512))


def run(args) -> int:
    """Under torchrun / accelerate launch every rank measures its share of the windows; rank 0 writes."""
    if args.dry_run:  # before the library is imported: nothing loads, no torch
        from .estimate import dry_run  # lazy: headers and config only, never torch

        return dry_run(NAME, args, args.model_dir)
    # lazy: commands import the library when they run, so --help stays fast
    from ..runtime.distributed import RankFailedError, process_group, rank, world_size

    # lazy: commands import the library when they run, so --help stays fast
    from . import report_error

    who = ""
    try:
        with process_group(timeout=args.dist_timeout) as several:
            who = f"rank {rank()} of {world_size()}: " if several else ""
            return _plan(args)
    except RankFailedError as exc:
        report_error(NAME, exc, who)
        return 2 if exc.user_error else 1
    except (ValueError, OSError) as exc:
        if not who:
            raise
        return report_error(NAME, exc, who)


def _check_snap(args) -> None:
    """--snap-servable's plan file is read (exit 2 when it is no plan) and its budgets are not overridden."""
    # lazy: commands import the library when they run, so --help stays fast
    from ..io.plan_file import read_plan

    if any_budget(args):
        raise ValueError("--snap-servable takes the budgets of PLAN.json: give no --budget-* with it")
    if args.sensitivity == "proxy" or args.data is None:
        raise ValueError("--snap-servable measures both plans: give --data FILE (and no --sensitivity proxy)")
    read_plan(args.snap_servable)


def _plan(args) -> int:
    # lazy: commands import the library when they run, so --help stays fast
    import argparse

    # lazy: commands import the library when they run, so --help stays fast
    import warnings

    # lazy: commands import the library when they run, so --help stays fast
    from ..plan import plan_checkpoint

    # lazy: commands import the library when they run, so --help stays fast
    from ..runtime.distributed import fail_together, is_main_process

    # lazy: commands import the library when they run, so --help stays fast
    from ..runtime.fileio import check_output_file

    main = is_main_process()
    with fail_together():
        if main:
            check_output_file(args.output, args.overwrite)
        if args.sensitivity != "proxy" and args.data is None:
            raise ValueError(
                "the measured sensitivity needs calibration text: give --data FILE (or --sensitivity proxy)"
            )
        data = checked_data(args, tokenizer_dir=args.model_dir)
        check_latency_options(args)
        check_rank_flags(args)
        if args.snap_servable is not None:
            _check_snap(args)
        elif not any_budget(args):
            raise ValueError(
                "give a budget: --budget-params, --budget-active-params, --budget-memory, "
                "--budget-gdn-params, --budget-state and/or --budget-latency"
            )
    if args.threads is None:
        args.threads = plan_threads(args.model_dir, args.seq_len)
    runtime = args if main else argparse.Namespace(**{**vars(args), "quiet": True})
    with model_runtime(runtime), warnings.catch_warnings():
        if not main:  # every rank computes the same plan: rank 0 speaks and writes
            warnings.simplefilter("ignore")
        with fail_together():
            plan, report = plan_checkpoint(
                args.model_dir,
                data,
                args.scores,
                num_samples=args.num_samples,
                seq_len=args.seq_len,
                batch_size=args.batch_size,
                device=args.device,
                dtype=args.dtype,
                device_map=args.device_map,
                progress=main and not args.quiet,
                snap=args.snap_servable,
                on_rank_cost=rank_cost_printer(NAME, not main or args.quiet),
                **search_options(args),
            )
        with fail_together():
            notes = write_outputs(plan, report, args.output, args.overwrite) if main else []
    if not main:
        return 0
    print(json.dumps(plan, indent=1) if args.json else format_plan(plan, report))
    for line in plan.get("kernel_warnings", []):
        print(f"gdnprune plan: warning: {line}", file=sys.stderr)
    if not args.json:
        print(f"wrote {args.output}; " + "; ".join(notes))
    return 0
