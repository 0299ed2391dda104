"""The command line of recall in the plan (``--keep-recall``, shared by ``plan`` and ``prune``): the flag and the
lines of the result (what the sensitivities were measured on, the recall kept)."""

from __future__ import annotations


def _share(text: str) -> float:
    # lazy: commands import the library when they run, so --help stays fast
    import argparse

    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"expected a share in (0, 1] such as 0.9, got {text!r}")
    return value


def add_recall_arguments(p) -> None:
    """``--keep-recall R``."""
    p.add_argument(
        "--keep-recall",
        type=_share,
        metavar="R",
        help="keep at least R (e.g. 0.9) of the unpruned model's recall: the greedy exact match of recall "
        "probes (passkey, MQAR) as long as the calibration windows, measured on the whole cut model; when the "
        "plan keeps less, the sensitivities are measured again with more weight on recall and the plan chosen "
        "again (at most twice); the report says each round",
    )


def recall_summary(report: dict) -> list[str]:
    """The lines of recall: what the sensitivities were measured on, and --keep-recall's rounds."""
    lines = []
    windows = report.get("windows") or {}
    what = {
        "probes": "each calibration window followed by a recall probe (passkey or MQAR) of its length",
        "spans": "spans of the calibration text written twice into each window",
    }
    if windows.get("kind") in what:
        lines.append(
            f"measured on recall windows: {what[windows['kind']]}; the answers {windows['recall_share']:.0%} of "
            f"the KL"
        )
    recall = report.get("recall")
    if recall:
        last = recall["rounds"][-1]
        lines.append(
            f"recall kept: {last['kept']:.1%} of the unpruned model's exact match ({last['exact_match']:.3f} ± "
            f"{last['exact_match_stderr']:.3f} against {last['unpruned_exact_match']:.3f}, {last['asked']} answers): {'met' if recall['met'] else 'MISSED'} --keep-recall {recall['keep']:g}"
        )
        if len(recall["rounds"]) > 1:
            steps = ", ".join(f"{r['kept']:.1%} at share {r['share']:.0%}" for r in recall["rounds"])
            lines.append(
                f"the plan kept too little recall: measured again with more weight on recall and chosen again "
                f"{len(recall['rounds']) - 1} time(s) ({steps})"
            )
    return lines
