"""The command line of ranking by distillation (``--rank-by-distill``, shared by ``plan`` and ``prune``): its
flags, their checks, the cost said before the work, and the lines of the result."""

from __future__ import annotations

import sys

from ._options import non_negative_int, positive_float, positive_int


def add_rank_arguments(p) -> None:
    """``--rank-by-distill K``, ``--rank-steps S``, ``--rank-lr LR``."""
    p.add_argument(
        "--rank-by-distill",
        type=non_negative_int,
        default=0,
        metavar="K",
        help="rank after a short recovery: the K best distinct plans of the search (and the best uniform cut) "
        "are each distilled --rank-steps steps from the model on 3/4 of the calibration windows, and the "
        "least KL on the other 1/4 wins; costs K+1 short distillations (the estimate is printed before "
        "they run; under torchrun they are spread over the processes). Default 0: off",
    )
    p.add_argument(
        "--rank-steps",
        type=positive_int,
        default=100,  # gdnprune.plan.rank.RANK_STEPS (the library is imported when the command runs)
        metavar="S",
        help="distillation steps per plan of --rank-by-distill (default 100)",
    )
    p.add_argument(
        "--rank-lr",
        type=positive_float,
        default=1e-4,  # gdnprune.plan.rank.RANK_LR
        metavar="LR",
        help="learning rate of --rank-by-distill's distillations (AdamW, cosine; default 1e-4)",
    )


def check_rank_flags(args) -> None:
    """--rank-by-distill ranks heterogeneous plans on calibration windows (ValueError: exit 2)."""
    if not args.rank_by_distill:
        return
    for flag, given in (("--uniform", args.uniform), ("--servable", args.servable)):
        if given:
            raise ValueError(
                f"--rank-by-distill: expected a heterogeneous plan search, found {flag} (the best uniform cut "
                "is one of the ranked plans anyway)"
            )
    if args.sensitivity == "proxy":
        raise ValueError(
            "--rank-by-distill: expected a measured --sensitivity (halving or measured), found proxy"
        )
    if getattr(args, "snap_servable", None) is not None:
        raise ValueError("--rank-by-distill: expected a plan search, found --snap-servable")


def ranking_summary(report: dict) -> list[str]:
    """The lines of --rank-by-distill (every plan's held-out KL one-shot and recovered, the winner) and of the
    depth check (a plan that removes a layer against the best widths-only plan)."""
    lines = []
    check = report.get("depth_check")
    if check:
        widths = check["widths_only_kl"]
        lines.append(
            f"depth check: removing layers {check['removed_layers']} measures KL {check['depth_kl']:.4g} on the "
            "calibration windows, the best widths-only plan "
            + ("(none meets the budgets)" if widths is None else f"{widths:.4g}")
            + f": kept {'the widths-only plan' if check['kept'] == 'widths' else 'the plan with depth'}"
        )
    ranking = report.get("ranking")
    if ranking:
        lines.append(
            f"ranked by distillation: {len(ranking['plans'])} plans x {ranking['steps']} steps on "
            f"{ranking['train_windows']} windows, held-out KL on {ranking['heldout_windows']} "
            f"({ranking['seconds']:.1f} s); winner: {ranking['winner']}"
        )
        for p in ranking["plans"]:
            lines.append(
                f"  {p['name']:<10} summed KL {p['summed_sensitivity']:.4g}  one-shot {p['one_shot_kl']:.4g}"
                f"  recovered {p['recovered_kl']:.4g}"
                + (f"  removed {p['removed_layers']}" if p["removed_layers"] else "")
            )
    return lines


def rank_cost_printer(command: str, quiet: bool):
    """The ``on_rank_cost`` of a command: the ranking's cost said on stderr before it runs (None: --quiet)."""
    if quiet:
        return None

    def say(cost) -> None:
        if cost.seconds_per_step is None:
            print(
                f"gdnprune {command}: ranking {cost.candidates} plans by {cost.steps} distillation steps each "
                f"({cost.total_steps} steps over {cost.processes} process{'es' if cost.processes > 1 else ''})",
                file=sys.stderr,
                flush=True,
            )
        else:
            print(
                f"gdnprune {command}: the first step took {cost.seconds_per_step:.2f} s: about "
                f"{cost.estimate_seconds:.0f} s for the ranking",
                file=sys.stderr,
                flush=True,
            )

    return say
