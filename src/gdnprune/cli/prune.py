"""``gdnprune prune MODEL_DIR --data FILE --output OUT (--num-key-heads N ... | --plan P | --budget-params X)``."""

from __future__ import annotations

from ._options import (
    add_calibration_arguments,
    add_dry_run_arguments,
    add_lane_search_arguments,
    add_output_arguments,
    add_self_contained_argument,
    add_target_arguments,
    checked_data,
    positive_int,
    scoring_options,
    target_from_args,
)
from ._plan_summary import latency_summary, model_summary, servable_summary
from ._ranking import check_rank_flags, rank_cost_printer, ranking_summary
from ._recall import recall_summary
from ._runtime import add_runtime_arguments, model_runtime
from .plan import add_search_arguments, any_budget, check_latency_options, search_options
from .quantize import add_quantize_argument, quantize_beside
from .quantize import summary as quantize_summary

NAME = "prune"
HELP = "score + (plan) + sort + slice a checkpoint in one command"


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        NAME,
        help=HELP,
        description="Score MODEL_DIR on calibration text (its GDN layers, and the other blocks its target, plan or "
        "budget cuts), then sort every block by importance and cut it in one streaming pass: to one "
        "target (--num-key-heads ...; axes not given keep their size), to a plan (--plan), or to the plan"
        " searched under a budget (--budget-params: of the whole model, attention and MLP widths "
        "included; --budget-gdn-params / --budget-state: of the GDN layers alone; as `gdnprune plan` "
        "does).",
    )
    p.add_argument(
        "model_dir", metavar="MODEL_DIR", help="Hugging Face model folder (config, weights, tokenizer)"
    )
    add_output_arguments(p)
    add_self_contained_argument(p)
    add_target_arguments(p)
    p.add_argument("--plan", metavar="PLAN.json", help="per-layer targets (from gdnprune plan)")
    p.add_argument(
        "--scores",
        metavar="SCORES.json",
        help="sort by this scores file of MODEL_DIR instead of scoring again (a --plan must have been "
        "searched on it: its recorded sha256 is checked)",
    )
    add_search_arguments(p)
    p.add_argument(
        "--plan-samples",
        type=positive_int,
        default=16,
        metavar="N",
        help="calibration windows of the plan search's measured sensitivity (default 16; `gdnprune "
        "plan --num-samples`)",
    )
    add_calibration_arguments(p)
    add_quantize_argument(p)
    q = p.add_argument_group("one-shot quality")
    add_lane_search_arguments(q)
    q.add_argument(
        "--compensate",
        nargs="?",
        const="statistics",
        choices=("statistics", "sequential", "none"),
        default=None,
        help="refit each cut layer's out_proj by least squares on the calibration windows (the output "
        "is then not nested across targets): from the full model's statistics (plain "
        "--compensate), or 'sequential': layer by layer on the cut model's own hidden states, "
        "against the full model's residual stream (better one-shot quality; holds the full and the "
        "cut model in memory), on the recall windows where the scores were taken on them; 'none': no "
        "refit. Default: 'sequential' where --budget-state or --budget-gdn-params (no whole-model budget) "
        "is planned on recall windows (not --sensitivity short; without --device-map and --snap-quant), "
        "none elsewhere",
    )
    add_runtime_arguments(p)
    add_dry_run_arguments(p)
    p.set_defaults(func=run)


def run(args) -> int:
    if args.dry_run:  # before the library is imported: nothing loads, no torch
        from .estimate import dry_run  # lazy: headers and config only, never torch

        return dry_run(NAME, args, args.model_dir)
    # lazy: commands import the library when they run, so --help stays fast
    # lazy: commands import the library when they run, so --help stays fast
    from ..plan import PlanOptions

    # lazy: commands import the library when they run, so --help stays fast
    from ..prune import prune_checkpoint
    from ..runtime.distributed import launch_info  # lazy: as the import above

    # lazy: commands import the library when they run, so --help stays fast
    from ..scoring import ScoringOptions

    info = launch_info()
    if info is not None and info.world_size > 1:
        raise ValueError(
            f"prune runs in one process (found a launch of {info.world_size}); under torchrun, run "
            f"`gdnprune score` (and `gdnprune plan`) there, then `sort` and `slice` in one process"
        )
    check_latency_options(args)
    check_rank_flags(args)
    budget = any_budget(args)
    target = target_from_args(args, required=not budget and args.plan is None)
    search = None
    if budget:
        options = search_options(args)
        for key in ("tp", "multiple_of"):
            options.pop(key)
        search = PlanOptions(**options)
    if args.threads is None:
        # lazy: commands import the library when they run, so --help stays fast
        from .plan import plan_threads

        args.threads = plan_threads(args.model_dir, args.seq_len)
    with model_runtime(args):  # a PlanScoresWarning shows as one warning line, like every warning
        data = checked_data(args, tokenizer_dir=args.model_dir)
        manifest = prune_checkpoint(
            args.model_dir,
            data,
            args.output,
            target=target,
            plan=args.plan,
            scores=args.scores,
            search=search,
            plan_samples=args.plan_samples,
            tp=args.tp,
            multiple_of=args.multiple_of,
            snap_quant=args.snap_quant,
            compensate=args.compensate,
            overwrite=args.overwrite,
            progress=not args.quiet,
            self_contained=args.self_contained,
            servable=args.servable,
            scoring=ScoringOptions(
                lane_search=args.lane_search,
                lane_search_samples=args.lane_search_samples,
                **scoring_options(args),
            ),
            on_rank_cost=rank_cost_printer(NAME, args.quiet),
        )
    uniform = manifest.get("target")
    what = f"sliced to {uniform}" if uniform else "sliced layer by layer"
    if budget:
        plan = manifest.get("plan", {}).get("metadata", {})
        totals = plan.get("totals", {})
        if "model_params" in totals:
            what += (
                f" under the budget ({totals['model_params_fraction']:.1%} of the model's parameters kept: "
                f"{totals['model_params_kept']:,.0f} of {totals['model_params']:,.0f})"
            )
        else:
            what += (
                f" under the budget ({totals.get('gdn_params_fraction', 0):.1%} of GDN parameters, "
                f"{totals.get('state_fraction', 0):.1%} of the recurrent state kept)"
            )
    how = f"sorted by {args.scores}" if args.scores else f"scored with {args.method!r}, sorted"
    also = f" (self-contained: {manifest['self_contained']})" if manifest.get("self_contained") else ""
    if manifest.get("removed_layers"):
        what += f", decoder layers {manifest['removed_layers']} removed"
    hidden = manifest.get("hidden")
    if hidden and hidden["target"] != hidden["shape"]:
        what += f", hidden size {hidden['shape']['hidden_size']} -> {hidden['target']['hidden_size']}"
    if manifest.get("snap_quant"):
        what += f", cut widths in multiples of {manifest['snap_quant']} (--snap-quant)"
    print(f"gdnprune prune: {how} and {what} -> {args.output}{also}")
    if manifest.get("compensation_windows") and not args.compensate:
        print(f"  out_proj refitted on the {manifest['compensation_windows']} (--compensate none: not)")
    if budget:
        for line in model_summary(manifest.get("plan", {}).get("metadata", {}))[-2:]:
            print(f"  {line}")
        report = manifest.get("plan_report", {})
        lines = servable_summary(report) + recall_summary(report) + latency_summary(report)
        for line in lines + ranking_summary(report):
            print(f"  {line}")
    if args.quantize:
        with model_runtime(args):
            out, quantized = quantize_beside(
                args.output, args.quantize, data=data, overwrite=args.overwrite, progress=not args.quiet
            )
        print(quantize_summary(out, quantized))
    return 0
