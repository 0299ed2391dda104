"""``gdnprune estimate MODEL``: what each stage of a run will cost before it runs; and the block every long
command's ``--dry-run`` prints for its own options (:func:`dry_run`). Reads ``config.json`` and the safetensors
headers only (or a config alone): never torch."""

from __future__ import annotations

import argparse
import importlib
import os
from fractions import Fraction
from typing import Any

from ._options import add_gpu_argument, positive_int

NAME = "estimate"
HELP = "predict each stage's FLOPs, bytes, memory and wall time before running it (no torch)"

#: the stages each command's --dry-run shows
COMMAND_STAGES = {
    "score": ("score",),
    "plan": ("plan",),
    "prune": ("prune",),
    "distill": ("distill",),
    "eval": ("eval",),
    "bench": ("bench",),
}


def _copy(group: Any, command: str, dest: str, **changes: Any) -> None:
    """Add ``command``'s option ``dest`` to ``group`` as that command defines it (flags, type, choices, help: one
    definition per concept, as ``tests/test_cli_options.py`` checks), with ``changes`` (a default)."""
    from . import COMMANDS, Parser  # lazy: cli/__init__ imports this module

    sub = Parser(prog="gdnprune").add_subparsers()
    importlib.import_module(COMMANDS[command]).add_parser(sub)
    action = next(a for a in sub.choices[command]._actions if a.dest == dest)
    kwargs: dict[str, Any] = {"dest": dest, "default": action.default, "help": action.help}
    if action.nargs == 0:  # a switch
        kwargs["action"] = "store_true"
    else:
        kwargs.update(type=action.type, choices=action.choices, metavar=action.metavar)
        if type(action).__name__ == "_AppendAction":
            kwargs["action"] = "append"
    group.add_argument(*action.option_strings, **{**kwargs, **changes})


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        NAME,
        help=HELP,
        description="Per stage of the pipeline (score, plan, slice, prune, distill, eval, bench): the FLOPs, the "
        "bytes read and written, the host and device memory per process and the predicted wall time, from the "
        "model's config.json and safetensors headers (no torch, no weight read). MODEL is a model folder, a "
        "config.json (a model not downloaded), or a recorded family member such as Qwen3.5-397B-A17B "
        "(docs/models.md). The options are the commands' own; each long command's --dry-run prints the same "
        "block for its options. A prediction: docs/benchmarks/scale.md says how close it came on the measured "
        "points.",
    )
    p.add_argument("model", metavar="MODEL", help="model folder, config.json, or family member name")
    p.add_argument(
        "--stages",
        default="score,plan,slice,prune,distill,eval,bench",
        metavar="LIST",
        help="stages to estimate (default all: score,plan,slice,prune,distill,eval,bench; also inspect)",
    )
    _copy(p, "score", "device")
    add_gpu_argument(p)
    _copy(p, "distill", "processes", default=1)
    _copy(p, "score", "dtype")
    g = p.add_argument_group("score, plan and prune (their options)")
    for dest in (
        "num_samples",
        "seq_len",
        "batch_size",
        "plan_samples",
        "dim_step",
        "blocks",
        "budget_params",
    ):
        _copy(g, "prune", dest)
    d = p.add_argument_group("distill (its options; its --batch-size and --seq-len as --distill-*)")
    for dest in ("steps", "tokens", "fsdp", "mixed_precision", "gradient_checkpointing"):
        _copy(d, "distill", dest)
    d.add_argument(
        "--distill-batch-size", type=positive_int, default=16, metavar="N", help="distill's --batch-size (16)"
    )
    d.add_argument(
        "--distill-seq-len", type=positive_int, default=2048, metavar="N", help="distill's --seq-len (2048)"
    )
    e = p.add_argument_group("eval and bench")
    e.add_argument("--eval-tokens", type=positive_int, default=None, metavar="N", help="tokens lm-eval runs")
    _copy(e, "bench", "workload")
    p.set_defaults(func=run)


def _workloads(values: list[str] | None) -> tuple[tuple[str, int, int], ...]:
    if not values:
        return (("prefill", 1, 2048), ("decode", 8, 4096))
    out = []
    for text in values:
        parts = text.split(":")
        if (
            len(parts) != 3
            or parts[0] not in ("prefill", "decode")
            or not all(p.isdigit() for p in parts[1:])
        ):
            raise ValueError(f"--workload: expected PHASE:BATCH:CONTEXT (prefill or decode), found {text!r}")
        out.append((parts[0], int(parts[1]), int(parts[2])))
    return tuple(out)


def _step(text: str) -> Fraction:
    try:
        value = Fraction(text)
    except (ValueError, ZeroDivisionError):
        raise ValueError(
            f"--dim-step: expected a fraction such as 1/8 or a channel count, found {text!r}"
        ) from None
    if value <= 0:
        raise ValueError(f"--dim-step: expected a positive step, found {text!r}")
    return value


def _size(value: float) -> str:
    for unit, scale in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if value >= scale:
            return f"{value / scale:.1f} {unit}"
    return f"{value:.0f} B"


def _time(seconds: float) -> str:
    for unit, scale in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds >= scale:
            return f"{seconds / scale:.1f} {unit}"
    return f"{seconds:.1f} s"


def format_estimate(facts: Any, device: Any, processes: int, costs: list) -> str:
    """The block ``estimate`` and every ``--dry-run`` print: what the model is, then one row per stage."""
    where = {"folder": "folder", "config": "config only", "member": "recorded family member, config only"}
    lines = [
        f"gdnprune estimate: {facts.name} ({where[facts.source]}): {facts.parameters:,} parameters, "
        f"{_size(facts.bytes)} in {facts.dtype}, {len(facts.tensors):,} tensors, {len(facts.layers)} layers, "
        f"{facts.experts:,} routed experts",
        f"on {device.name}{f' x {processes} processes' if processes > 1 else ''} (a prediction: "
        f"{'rates measured on the benchmark machine' if device.kind == 'cpu' else 'peak rates x efficiency'})",
    ]
    rows = [("stage", "FLOPs", "read", "written", "host/process", "device/process", "time")]
    for c in costs:
        rows.append(
            (
                c.stage,
                f"{c.flops:.2e}",
                _size(c.bytes_read),
                _size(c.bytes_written),
                _size(c.host_memory),
                _size(c.device_memory) if device.kind == "cuda" else "-",
                _time(c.seconds),
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        lines.append(
            "  " + "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
        )
    for c in costs:
        for note in c.notes:
            lines.append(f"  {c.stage}: {note}")
    return "\n".join(lines)


def _estimate(model: Any, options: Any, device_name: str, stages: list[str], student: Any = None) -> str:
    from ..estimate.devices import device  # lazy: imported when the command runs (a fast --help); no torch
    from ..estimate.inventory import model_facts  # lazy: as above
    from ..estimate.stages import stage_costs  # lazy: as above

    facts = model_facts(model)
    chosen = device(device_name)
    costs = stage_costs(
        facts, options, chosen, stages, student=None if student is None else model_facts(student)
    )
    return format_estimate(facts, chosen, options.processes, costs)


def run(args) -> int:
    # lazy: as above
    from ..estimate.stages import STAGES, RunOptions

    stages = [s for s in args.stages.split(",") if s]
    unknown = sorted(set(stages) - set(STAGES))
    if unknown:
        raise ValueError(f"--stages: unknown {unknown}; expected some of {', '.join(STAGES)}")
    options = RunOptions(
        num_samples=args.num_samples,
        seq_len=args.seq_len or 512,  # score's default window: the model's, capped at 512
        batch_size=args.batch_size,
        plan_samples=args.plan_samples,
        dim_step=_step(args.dim_step),
        blocks=tuple(b for b in args.blocks.split(",") if b),
        budget=min(1.0, args.budget_params or 0.5),
        dtype=args.dtype,
        distill_tokens=args.tokens or 0,
        steps=args.steps or 1000,
        distill_batch_size=args.distill_batch_size,
        distill_seq_len=args.distill_seq_len,
        processes=args.processes,
        fsdp=args.fsdp,
        mixed_precision=args.mixed_precision,
        gradient_checkpointing=args.gradient_checkpointing,
        eval_tokens=args.eval_tokens or 0,
        workloads=_workloads(args.workload),
    )
    cuda = str(args.device or "").startswith("cuda") or args.gpu is not None
    print(_estimate(args.model, options, (args.gpu or "h100") if cuda else "cpu", stages))
    return 0


def dry_run(command: str, args: argparse.Namespace, model: Any, *, student: Any = None) -> int:
    """``COMMAND --dry-run``: the estimate block for the command's own options, printed; exit code 0. Nothing is
    loaded (no torch): ``model`` is read from its config and headers."""
    # lazy: as above
    from ..estimate.stages import RunOptions

    world = int(os.environ.get("WORLD_SIZE", "1"))
    processes = getattr(args, "processes", None) or world
    values: dict[str, Any] = {"processes": processes}
    for dest, field in (
        ("num_samples", "num_samples"),
        ("batch_size", "batch_size"),
        ("plan_samples", "plan_samples"),
    ):
        if isinstance(getattr(args, dest, None), int):
            values[field] = getattr(args, dest)
    if command == "plan" and isinstance(getattr(args, "num_samples", None), int):
        values["plan_samples"] = args.num_samples  # the plan's --num-samples is its windows
    if getattr(args, "seq_len", None):
        values["seq_len" if command != "distill" else "distill_seq_len"] = args.seq_len
    if getattr(args, "dim_step", None):
        values["dim_step"] = _step(str(args.dim_step))
    if getattr(args, "blocks", None):
        values["blocks"] = tuple(b for b in str(args.blocks).split(",") if b)
    if getattr(args, "budget_params", None):
        values["budget"] = min(1.0, float(args.budget_params))
    if getattr(args, "dtype", None) in ("float32", "bfloat16"):
        values["dtype"] = args.dtype
    if command == "distill":
        values.update(
            steps=args.steps or 1000,
            distill_tokens=args.tokens or 0,
            distill_batch_size=args.batch_size,
            fsdp=bool(args.fsdp),
            mixed_precision=args.mixed_precision,
            gradient_checkpointing=bool(args.gradient_checkpointing),
        )
        values.pop("batch_size", None)
    if command == "eval":
        documents = (args.limit or 1000) * max(1, len(str(args.tasks or "x").split(",")))
        values["eval_tokens"] = int(documents * max(args.context_lengths or [512]))
    if command == "bench":
        values["workloads"] = _workloads(args.workload)
        values["repeats"] = args.repeats
    device = getattr(args, "gpu", None) or "cpu"
    if str(getattr(args, "device", None) or "").startswith("cuda") and not getattr(args, "gpu", None):
        device = "h100"
    print(_estimate(model, RunOptions(**values), device, list(COMMAND_STAGES[command]), student=student))
    return 0
