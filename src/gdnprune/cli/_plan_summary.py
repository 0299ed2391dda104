"""What ``gdnprune plan`` and ``gdnprune prune`` print about a plan and write beside it: the per-layer table,
the cost, latency, servable and model summaries, the report and its plot."""

from __future__ import annotations

from pathlib import Path

from ._ranking import ranking_summary
from ._recall import recall_summary


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
    snap = report.get("snap_quant")
    if snap:
        m = snap["measured_kl"]
        lines.append(
            f"cost of --snap-quant {snap['snap_quant']}: measured KL of the whole cut model on {snap['windows']} "
            f"calibration windows {m['unsnapped']:.4g} -> {m['snapped']:.4g} ({m['cost']:+.4g})"
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
    hidden = plan.get("hidden")
    if hidden:
        tried = ", ".join(
            f"{c['hidden_size']} " + (f"KL {c['kl']:.4g}" if c.get("feasible") else "(no plan fits)")
            for c in hidden["candidates"]
        )
        lines.append(
            f"hidden size: {hidden['full_hidden_size']} -> {hidden['hidden_size']} (the whole cut model's KL "
            f"at each size tried: {tried}; the least kept)"
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
