"""``gdnprune plan MODEL --scores S --data CALIB --budget-params 0.5 --output PLAN.json``: per-layer widths."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from ._options import add_calibration_arguments, add_constraint_arguments, add_distributed_arguments, \
    add_output_arguments
from ._runtime import add_runtime_arguments, model_runtime

NAME = "plan"
HELP = "choose every GDN layer's width under a parameter or state budget (measured sensitivity + exact MILP)"


def _budget(text: str) -> float:
    import argparse

    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a fraction such as 0.5 or an absolute amount, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected a positive budget, got {text!r}")
    return value


def add_search_arguments(p) -> None:
    """The budget and search options, shared with ``gdnprune prune``."""
    p.add_argument("--budget-params", type=_budget, metavar="X",
                   help="GDN parameters to keep: a fraction (e.g. 0.5) or an absolute count")
    p.add_argument("--budget-state", type=_budget, metavar="X",
                   help="recurrent state per sequence to keep (Hv*dk*dv + conv state, float32): a fraction or bytes")
    p.add_argument("--sensitivity", choices=("measured", "proxy"), default="measured",
                   help="measured (default): KL from the unpruned model with each layer cut alone, on calibration "
                        "windows; proxy: output energy removed, from the scores (no forward pass)")
    p.add_argument("--dim-step", default="1/8", metavar="STEP",
                   help="head-dim grid: a fraction of the dim (default 1/8) or a channel count such as 16")
    p.add_argument("--axes", default="key_heads,lanes,key_dim,value_dim", metavar="LIST",
                   help="axes the search may cut (default all four: key_heads,lanes,key_dim,value_dim)")
    p.add_argument("--uniform", action="store_true",
                   help="one geometry for all layers (for engines that need uniform layers)")
    add_constraint_arguments(p)


def search_options(args) -> dict:
    """The keyword arguments of :func:`gdnprune.plan.plan_model` given on the command line."""
    return dict(budget_params=args.budget_params, budget_state=args.budget_state, sensitivity=args.sensitivity,
                dim_step=args.dim_step, axes=[a.strip() for a in args.axes.split(",") if a.strip()], tp=args.tp,
                multiple_of=args.multiple_of, uniform=args.uniform)


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        NAME, help=HELP,
        description="Measure how much each GDN layer suffers from every candidate width (the KL divergence from "
                    "the unpruned model when that layer alone is cut, or a proxy from the scores), then choose one "
                    "candidate per layer that minimises the summed sensitivity within the budgets (an exact "
                    "multiple-choice knapsack, scipy's MILP). Writes PLAN.json for `slice --plan` / `prune --plan`, "
                    "PLAN.sensitivity.json with every candidate and PLAN.sensitivity.png.",
    )
    p.add_argument("model_dir", metavar="MODEL_DIR", help="the (unsorted) model the scores describe")
    p.add_argument("--scores", required=True, metavar="SCORES.json", help="gdnprune score's file for MODEL_DIR")
    add_output_arguments(p, metavar="PLAN.json", help="plan file to write (and its report beside it)", folder=False)
    add_calibration_arguments(p, data_required=False, num_samples=16, method=False,
                              purpose="the measured sensitivity (needs --data)")
    add_search_arguments(p)
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
    measured = report["sensitivity"] == "measured"
    rows = [("layer", "Hk", "Hv", "dk", "dv", "params kept", "state kept", "KL" if measured else "proxy",
             *(("loss",) if measured else ()))]
    for prefix, layer in report["layers"].items():
        full, chosen = layer["candidates"][0], layer["candidates"][layer["chosen"]]
        t = chosen["target"]
        rows.append((prefix, str(t["num_key_heads"]), str(t["num_value_heads"]), str(t["key_head_dim"]),
                     str(t["value_head_dim"]), f"{chosen['params']:,} ({chosen['params'] / full['params']:.0%})",
                     f"{chosen['state_bytes']:,} B ({chosen['state_bytes'] / full['state_bytes']:.0%})",
                     f"{chosen['sensitivity']:.4g}", *((f"{chosen['loss']:.4f}",) if measured else ())))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))) for r in rows]
    totals = plan["totals"]
    lines.append(f"GDN parameters kept: {totals['gdn_params_kept']:,} of {totals['gdn_params']:,} "
                 f"({totals['gdn_params_fraction']:.1%}); recurrent state kept: {totals['state_bytes_kept']:,} of "
                 f"{totals['state_bytes']:,} bytes per sequence ({totals['state_fraction']:.1%})")
    what = "summed KL (per token)" if measured else "summed proxy"
    lines.append(f"predicted {what}: {plan['predicted']['summed_sensitivity']:.4g}"
                 + (f"; base loss {report['base_loss']:.4f} on {report['tokens']:,} tokens, "
                    f"{report['forwards']:,} partial forwards in {report['seconds']:.1f} s" if measured else ""))
    return "\n".join(lines)


def write_outputs(plan: dict, report: dict, output: str | Path, overwrite: bool) -> list[str]:
    """PLAN.json, its report and its plot; returns the notes for the user."""
    from ..fileio import write_json_atomic
    from ..plan import plot_sensitivity
    from ..plans import save_plan
    from ..fileio import check_output_file

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


def run(args) -> int:
    """Under torchrun / accelerate launch every rank measures its share of the windows; rank 0 writes."""
    from ..distributed import RankFailedError, process_group, rank, world_size
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


def _plan(args) -> int:
    import argparse
    import warnings

    from ..distributed import fail_together, is_main_process
    from ..plan import plan_checkpoint
    from ..fileio import check_output_file

    main = is_main_process()
    with fail_together():
        if main:
            check_output_file(args.output, args.overwrite)
        if args.sensitivity == "measured" and args.data is None:
            raise ValueError("the measured sensitivity needs calibration text: give --data FILE (or --sensitivity "
                             "proxy)")
        if args.budget_params is None and args.budget_state is None:
            raise ValueError("give a budget: --budget-params and/or --budget-state")
    runtime = args if main else argparse.Namespace(**{**vars(args), "quiet": True})
    with model_runtime(runtime), warnings.catch_warnings():
        if not main:  # every rank computes the same plan: rank 0 speaks and writes
            warnings.simplefilter("ignore")
        with fail_together():
            plan, report = plan_checkpoint(args.model_dir, args.data, args.scores, num_samples=args.num_samples,
                                           seq_len=args.seq_len, batch_size=args.batch_size, device=args.device,
                                           dtype=args.dtype, device_map=args.device_map,
                                           progress=main and not args.quiet, **search_options(args))
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
