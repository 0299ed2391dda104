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
    add_output_arguments,
    blocks_from_args,
    checked_data,
    non_negative_int,
    positive_int,
)
from ._ranking import add_rank_arguments, check_rank_flags, rank_cost_printer, ranking_summary
from ._recall import add_recall_arguments, recall_summary
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


# long: one argparse declaration per option
def add_search_arguments(p) -> None:
    """The budget and search options, shared with ``gdnprune prune``."""
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
    add_blocks_argument(
        p,
        help=f"what may shrink under a whole-model budget (default all: {BLOCKS}); experts: the number of routed experts kept "
        "per MoE layer; depth: whole decoder layers removed (a candidate of every layer that costs "
        "nothing, measured as the KL with that layer alone skipped)",
    )
    p.add_argument(
        "--sensitivity",
        choices=SENSITIVITIES,
        default="halving",
        help="halving (default): KL from the unpruned model with each layer cut alone, on calibration "
        "windows, by successive halving (every candidate on a few windows; the choice measured on all "
        "of them before it is trusted); where GDN layers may shrink the windows are recall windows: facts "
        "of the calibration text (spans, numbers) written twice into each window, the KL of the second "
        "copies counting for half, so that a cut that loses the model's memory shows; short: the same on "
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
    add_rank_arguments(p)
    for name, kind in (
        ("generations", non_negative_int),
        ("offspring", positive_int),
        ("seed", non_negative_int),
    ):
        add_deprecated_alias(p, f"--refine-{name}", f"evolve_{name}", f"--evolve-{name}", type=kind)
    add_constraint_arguments(p)


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
        keep_recall=args.keep_recall,
    )


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
    p.set_defaults(func=run)


def report_paths(output: str | Path) -> tuple[Path, Path]:
    """Where the report and the plot of a plan go: ``PLAN.sensitivity.json`` and ``PLAN.sensitivity.png``."""
    output = Path(output)
    stem = output.name[: -len(".json")] if output.name.endswith(".json") else output.name
    return output.with_name(f"{stem}.sensitivity.json"), output.with_name(f"{stem}.sensitivity.png")


def format_plan(plan: dict, report: dict) -> str:
    """The per-layer table ``gdnprune plan`` prints."""
    measured = report["sensitivity"] in ("measured", "halving", "short", "bld")
    rows = [
        (
            "layer",
            "Hk",
            "Hv",
            "dk",
            "dv",
            "params kept",
            "state kept",
            "KL" if measured else "proxy",
            *(("loss",) if measured else ()),
        )
    ]
    for prefix, layer in report["layers"].items():
        if layer["chosen"] is None:
            rows.append((prefix, "removed", *[""] * (len(rows[0]) - 2)))
            continue
        full, chosen = layer["candidates"][0], layer["candidates"][layer["chosen"]]
        t = chosen["target"]
        rows.append(
            (
                prefix,
                str(t["num_key_heads"]),
                str(t["num_value_heads"]),
                str(t["key_head_dim"]),
                str(t["value_head_dim"]),
                f"{chosen['params']:,} ({chosen['params'] / full['params']:.0%})",
                f"{chosen['state_bytes']:,} B ({chosen['state_bytes'] / full['state_bytes']:.0%})",
                f"{chosen['sensitivity']:.4g}",
                *((f"{chosen['loss']:.4f}",) if measured else ()),
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = [
        "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
        for r in rows
    ]
    totals = plan["totals"]
    if "gdn_params" in totals:
        lines.append(
            f"GDN parameters kept: {totals['gdn_params_kept']:,} of {totals['gdn_params']:,} "
            f"({totals['gdn_params_fraction']:.1%}); recurrent state kept: {totals['state_bytes_kept']:,} of "
            f"{totals['state_bytes']:,} bytes per sequence ({totals['state_fraction']:.1%})"
        )
    lines += model_summary(plan, report)
    what = "summed KL (per token)" if measured else "summed proxy"
    lines.append(
        f"predicted {what}: {plan['predicted']['summed_sensitivity']:.4g}"
        + (
            f"; base loss {report['base_loss']:.4f} on {report['tokens']:,} tokens, "
            f"{report['forwards']:,} partial forwards in {report['seconds']:.1f} s"
            if measured
            else ""
        )
    )
    lines += cost_summary(report)
    lines += servable_summary(report) + recall_summary(report) + latency_summary(report)
    lines += ranking_summary(report)
    evolved = report.get("evolution")
    if evolved:
        accepted = sum(h["accepted"] for h in evolved["history"])
        lines.append(
            f"evolutionary search: KL of the whole cut model {evolved['seed_kl']:.4g} -> {evolved['kl']:.4g} "
            f"({evolved['generations']} generations, {accepted} improvements, {evolved['evaluations']:,} "
            f"window forwards in {evolved['seconds']:.1f} s)"
        )
    return "\n".join(lines)


def cost_summary(report: dict) -> list[str]:
    """The cost line of a measured sensitivity: its time as a multiple of one forward over the calibration
    windows (the teacher pass; a scoring pass over as many windows costs about as much), and BLD's recovery."""
    teacher = report.get("teacher_seconds")
    if not teacher:
        return []
    line = (
        f"cost: {report['seconds']:.1f} s = {report['seconds'] / teacher:.1f}x one forward over the "
        f"calibration windows ({teacher:.2f} s)"
    )
    bld = report.get("bld")
    if bld:
        before = [e for errors in bld["error_one_shot"].values() for e in errors]
        after = [e for errors in bld["error"].values() for e in errors]
        line += (
            f"; BLD {bld['steps']} steps per candidate (lr {bld['lr']:g}): mean block output error "
            f"{sum(before) / max(len(before), 1):.4g} one-shot -> {sum(after) / max(len(after), 1):.4g}"
        )
    return [line]


def latency_summary(report: dict) -> list[str]:
    """The latency line of a plan with --budget-latency: predicted beside measured, and the speed-up."""
    t = report.get("latency")
    if not t:
        return []
    lines = [
        f"latency at {t['workload']}: unpruned {t['unpruned_seconds'] * 1e3:.3g} ms; predicted "
        f"{t['predicted_seconds'] * 1e3:.3g} ms ({t['predicted_fraction']:.1%}), measured "
        f"{t['measured_seconds'] * 1e3:.3g} ms ({t['measured_fraction']:.1%}): speed-up "
        f"{t['measured_speedup']:.2f}x measured, {t['predicted_speedup']:.2f}x predicted"
    ]
    fitting = t.get("fitting") or []
    if len(fitting) > 1:
        steps = ", ".join(f"{r['measured_seconds'] / t['unpruned_seconds']:.1%}" for r in fitting)
        lines.append(
            f"the first choice measured over the budget: chosen again against a lower planned latency "
            f"{len(fitting) - 1} time(s) (measured {steps})"
        )
    return lines


def servable_summary(report: dict) -> list[str]:
    """The lines of a servable plan: what loads it, and the cost of servability of a snapped plan."""
    lines = [f"servable: {report['servable']}"] if report.get("servable") else []
    cost = report.get("servability")
    if cost:
        p, m = cost["predicted"], cost["measured_kl"]
        lines.append(
            f"cost of servability: predicted summed KL {p['heterogeneous']:.4g} -> {p['servable']:.4g} "
            f"({p['cost']:+.4g}); measured KL of the whole cut model on {cost['windows']} calibration windows "
            f"{m['heterogeneous']:.4g} -> {m['servable']:.4g} ({m['cost']:+.4g})"
        )
    return lines


def model_summary(plan: dict, report: dict | None = None) -> list[str]:
    """The whole-model lines of a plan: every budget's share kept and the parameters split over sub-blocks."""
    totals = plan.get("totals", {})
    if "model_params" not in totals:
        return []
    lines = []
    for prefix, block in ((report or {}).get("blocks") or {}).items():
        if block["chosen"] is None:
            lines.append(f"{prefix}: removed with its decoder layer")
            continue
        t = block["candidates"][block["chosen"]]
        lines.append(
            f"{prefix}: "
            + ", ".join(f"{k}={v}" for k, v in t["target"].items())
            + f"  params {t['params']:,.0f} ({t['params'] / block['candidates'][0]['params']:.0%})"
            + f"  KL {t['sensitivity']:.4g}"
        )
    removal = (report or {}).get("removal") or {}
    if removal:
        gone = [
            f"{prefix} (KL {entry['sensitivity']:.4g})"
            for prefix, entry in removal.items()
            if entry["removed"]
        ]
        lines.append(
            f"removed decoder layers: {', '.join(gone) if gone else 'none'} (removal candidates: "
            f"{len(removal)})"
        )
    lines.append(
        f"model parameters kept: {totals['model_params_kept']:,.0f} of {totals['model_params']:,.0f} "
        f"({totals['model_params_fraction']:.1%}); active per token: {totals['active_params_fraction']:.1%}"
        + (
            f"; memory per sequence: {totals['memory_bytes_kept']:,.0f} of {totals['memory_bytes']:,.0f} "
            f"bytes ({totals['memory_bytes_fraction']:.1%})"
            if "memory_bytes" in totals
            else ""
        )
    )
    lines.append(
        "split: "
        + ", ".join(
            f"{kind} {v['params_kept']:,.0f} of {v['params']:,.0f}"
            f" ({v['params_kept'] / max(v['params'], 1):.0%})"
            for kind, v in totals["split"].items()
        )
    )
    return lines


def write_outputs(plan: dict, report: dict, output: str | Path, overwrite: bool) -> list[str]:
    """PLAN.json, its report and its plot; returns the notes for the user."""
    # lazy: commands import the library when they run, so --help stays fast
    # lazy: commands import the library when they run, so --help stays fast
    from ..io.plan_file import save_plan

    # lazy: commands import the library when they run, so --help stays fast
    from ..plan import plot_sensitivity
    from ..runtime.fileio import check_output_file, write_json_atomic  # lazy: as the import above

    report_json, report_png = report_paths(output)
    for path in (output, report_json):
        check_output_file(path, overwrite)
    save_plan(plan, output)
    write_json_atomic(report_json, report)
    notes = [f"report: {report_json}"]
    if plot_sensitivity(report, report_png):
        notes.append(f"plot: {report_png}")
    else:
        notes.append("no plot: matplotlib is not installed (pip install 'gdnprune[plot]')")
    return notes


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
