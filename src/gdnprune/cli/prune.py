"""``gdnprune prune MODEL_DIR --data FILE --output OUT (--num-key-heads N ... | --plan P | --budget-params X)``."""

from __future__ import annotations

from ._options import add_calibration_arguments, add_output_arguments, add_refine_arguments, \
    add_target_arguments, positive_int, scoring_options, target_from_args
from ._runtime import add_runtime_arguments, model_runtime
from .plan import add_search_arguments, search_options

NAME = "prune"
HELP = "score + (plan) + sort + slice a checkpoint in one command"


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        NAME, help=HELP,
        description="Score the GDN layers of MODEL_DIR on calibration text, then sort every layer by importance "
                    "and cut it in one streaming pass: to one target (--num-key-heads ...; axes not given keep "
                    "their size), to a plan (--plan), or to the plan searched under a budget (--budget-params / "
                    "--budget-state, as `gdnprune plan` does).",
    )
    p.add_argument("model_dir", metavar="MODEL_DIR", help="Hugging Face model folder (config, weights, tokenizer)")
    add_output_arguments(p)
    add_target_arguments(p)
    p.add_argument("--plan", metavar="PLAN.json", help="per-layer targets (from gdnprune plan)")
    add_search_arguments(p)
    p.add_argument("--plan-samples", type=positive_int, default=16, metavar="N",
                   help="calibration windows of the plan search's measured sensitivity (default 16; `gdnprune "
                        "plan --num-samples`)")
    add_calibration_arguments(p)
    q = p.add_argument_group("one-shot quality")
    add_refine_arguments(q)
    q.add_argument("--compensate", nargs="?", const="statistics", choices=("statistics", "sequential"),
                   default=None,
                   help="refit each cut layer's out_proj by least squares on the calibration windows (the output "
                        "is then not nested across targets): from the full model's statistics (plain "
                        "--compensate), or 'sequential': layer by layer on the cut model's own hidden states, "
                        "against the full model's residual stream (better one-shot quality; loads the model "
                        "once more and holds the full and the cut model in memory)")
    add_runtime_arguments(p)
    p.set_defaults(func=run)


def run(args) -> int:
    from ..distributed import launch_info
    from ..prune import prune_checkpoint

    info = launch_info()
    if info is not None and info.world_size > 1:
        raise ValueError(f"prune runs in one process (found a launch of {info.world_size}); under torchrun, run "
                         f"`gdnprune score` (and `gdnprune plan`) there, then `sort` and `slice` in one process")
    budget = args.budget_params is not None or args.budget_state is not None
    target = target_from_args(args, required=not budget and args.plan is None)
    search = search_options(args) if budget else None
    if search is not None:
        for key in ("tp", "multiple_of"):
            search.pop(key)
    with model_runtime(args):
        manifest = prune_checkpoint(args.model_dir, args.data, args.output, target=target, plan=args.plan, search=search,
                                    plan_samples=args.plan_samples, tp=args.tp, multiple_of=args.multiple_of,
                                    compensate=args.compensate or False, overwrite=args.overwrite, progress=not args.quiet,
                                    refine=args.refine, refine_samples=args.refine_samples,
                                    **scoring_options(args))
    uniform = manifest.get("target")
    what = f"sliced to {uniform}" if uniform else "sliced layer by layer"
    if budget:
        plan = manifest.get("plan", {}).get("metadata", {})
        totals = plan.get("totals", {})
        what += (f" under the budget ({totals.get('gdn_params_fraction', 0):.1%} of GDN parameters, "
                 f"{totals.get('state_fraction', 0):.1%} of the recurrent state kept)")
    print(f"gdnprune prune: scored with {args.method!r}, sorted and {what} -> {args.output}")
    return 0
