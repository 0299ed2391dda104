"""``gdnprune distill STUDENT --teacher TEACHER --data TRAIN --output OUT``: recover a pruned model by logit KD."""

from __future__ import annotations

import logging
import os
import signal
import sys
import time

from ._options import (
    DRY_RUN_HELP,
    add_data_arguments,
    add_gpu_argument,
    add_quiet_argument,
    checked_data,
    positive_int,
)
from ._runtime import add_runtime_arguments, model_runtime
from .quantize import add_quantize_argument, quantize_beside
from .quantize import summary as quantize_summary

NAME = "distill"
HELP = "recover a pruned model by knowledge distillation from its unpruned teacher"

_DTYPES = ("float32", "bfloat16")  # as every command's --dtype
# words of the library's messages (its Python arguments) -> this command's flags
_FLAGS = (
    ("resume: ", "--resume: "),
    ("train_data: ", "--data: "),
    ("resume=True", "--resume"),
    ("overwrite=True", "--overwrite"),
    ("fsdp=True", "--fsdp"),
    ("fsdp=False", "no --fsdp"),
    ("cpu_offload", "--cpu-offload"),
    ("teacher_device_map", "--teacher-device-map"),
    ("teacher_sharding=", "--teacher-sharding "),
    ("teacher_sharding", "--teacher-sharding"),
    ("mixed_precision", "--mixed-precision"),
    ("micro_batch_size", "--micro-batch-size"),
    ("batch_size", "--batch-size"),
    ("keep_checkpoints", "--keep-checkpoints"),
    ("log_every", "log interval"),
    ("steps=", "--steps "),
    ("tokens=", "--tokens "),
)


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        NAME,
        help=HELP,
        description="Train the student (a pruned checkpoint, uniform or per-layer) to match the next-token "
        "distribution of the teacher (the unpruned model): forward KL at --temperature, optionally "
        "mixed with the LM loss. Runs on the transformers Trainer: one process, or data-parallel (DDP) "
        "under torchrun / accelerate launch; --fsdp (or `accelerate launch --config_file` with an FSDP2 "
        "config) shards the student's parameters, gradients and optimizer state, and the teacher, over "
        "the processes. Prints the expected memory per process first (--dry-run: only that). "
        "Checkpoints every --save-every steps; --resume continues an interrupted run; Ctrl-C saves and "
        "stops. Writes the trained model (with the student's mtp.* weights unchanged), gdnprune.json, "
        "distill_log.json and distill_loss.png into OUT. With --fsdp on a CPU (glibc) the command sets "
        "glibc's mmap threshold to 64 KiB for its process, so that the layers FSDP2 gathers and frees go "
        "back to the system (less memory, more CPU time per step); any MALLOC_* environment variable "
        "(e.g. MALLOC_MMAP_THRESHOLD_) or glibc.malloc tunable you set is kept instead.",
    )
    p.add_argument(
        "student", metavar="STUDENT", help="the model folder to train (e.g. gdnprune prune's output)"
    )
    p.add_argument("--teacher", required=True, metavar="TEACHER", help="the unpruned model folder")
    add_data_arguments(p, required=True, what="training text", eval_data=True)
    p.add_argument(
        "--data-cache",
        dest="data_cache",
        metavar="DIR",
        default=None,
        help="where the tokenised windows are kept and reused by later runs and --resume (default: "
        "$GDNPRUNE_DATA_CACHE, else gdnprune-windows in the datasets cache)",
    )
    p.add_argument("--output", "-o", required=True, metavar="OUT_DIR", help="folder to write")
    p.add_argument("--overwrite", action="store_true", help="replace OUT_DIR if it is an earlier output")
    add_quantize_argument(p)
    g = p.add_argument_group("length of the run (one of)")
    length = g.add_mutually_exclusive_group(required=True)
    length.add_argument("--steps", type=positive_int, help="optimizer steps")
    length.add_argument("--tokens", type=positive_int, help="training tokens (rounded up to whole steps)")
    _add_optimisation_arguments(p)
    k = p.add_argument_group("loss")
    k.add_argument("--temperature", type=float, default=1.0, help="KD temperature (default 1)")
    k.add_argument("--kd-weight", type=float, default=1.0, help="weight of the KL term (default 1: pure KD)")
    k.add_argument("--lm-weight", type=float, default=0.0, help="weight of the LM loss (default 0)")
    _add_engine_arguments(p)
    _add_evaluation_arguments(p)
    add_runtime_arguments(p)
    add_quiet_argument(p)
    p.set_defaults(func=run)


def _add_optimisation_arguments(p) -> None:
    o = p.add_argument_group("optimisation")
    o.add_argument(
        "--lr", type=float, default=1e-4, help="peak learning rate (default 1e-4; 1e-3 suits tiny models)"
    )
    o.add_argument("--lr-schedule", default="cosine", help="transformers schedule name (default cosine)")
    o.add_argument(
        "--warmup", type=float, default=0.0, help="warmup steps, or a fraction of the steps (default 0)"
    )
    o.add_argument("--weight-decay", type=float, default=0.0, help="AdamW weight decay (default 0)")
    o.add_argument(
        "--batch-size",
        type=positive_int,
        default=16,
        metavar="N",
        help="windows per step, over all processes (16)",
    )
    o.add_argument(
        "--micro-batch-size",
        type=positive_int,
        default=None,
        help="windows per forward pass and process (gradient accumulation for the rest)",
    )
    o.add_argument(
        "--seq-len",
        type=positive_int,
        default=None,
        metavar="N",
        help="tokens per window (default: the student's max_position_embeddings, at most 2048)",
    )
    o.add_argument(
        "--num-samples", type=positive_int, default=None, metavar="N", help="training windows (default: all)"
    )
    o.add_argument("--seed", type=int, default=0, help="seed of the data order (default 0)")


def _add_engine_arguments(p) -> None:
    n = p.add_argument_group("engine and memory")
    n.add_argument(
        "--fsdp",
        action="store_true",
        help="shard the student (parameters, gradients, optimizer state) with FSDP2 over the processes "
        "of torchrun; checkpoints become per-process shards",
    )
    n.add_argument(
        "--teacher-sharding",
        choices=("shard", "replicate"),
        default=None,
        help="shard the teacher too (FSDP2, forward only; the default with --fsdp) or keep a whole "
        "teacher in every process (the default otherwise; fine for small teachers)",
    )
    n.add_argument(
        "--teacher-device-map",
        metavar="MAP",
        default=None,
        help="spread a replicated teacher over the devices of its process (transformers device_map, "
        "e.g. auto)",
    )
    n.add_argument(
        "--dtype",
        choices=_DTYPES,
        default="float32",
        help="dtype of the student's parameters and optimizer state (default float32)",
    )
    n.add_argument(
        "--output-dtype",
        choices=(*_DTYPES, "float16"),
        default=None,
        help="dtype of the written model (default: the dtype the student folder stores)",
    )
    n.add_argument(
        "--teacher-dtype",
        choices=(*_DTYPES, "float16"),
        default=None,
        help="dtype of the teacher (default: --dtype)",
    )
    n.add_argument(
        "--mixed-precision",
        choices=("no", "bf16", "fp16"),
        default="no",
        help="run forward and backward passes in this precision; parameters, optimizer and gradient "
        "reductions stay in --dtype (default no)",
    )
    n.add_argument(
        "--gradient-checkpointing",
        action="store_true",
        help="recompute the decoder layers in the backward pass (less memory, about 30%% more time)",
    )
    n.add_argument(
        "--cpu-offload",
        action="store_true",
        help="with --fsdp: keep parameter shards and optimizer state in CPU memory",
    )
    n.add_argument("--dry-run", action="store_true", help=DRY_RUN_HELP)
    add_gpu_argument(n)
    n.add_argument(
        "--processes",
        type=positive_int,
        default=None,
        metavar="N",
        help="with --dry-run: the number of processes to estimate for (default: the launcher's, else 1)",
    )


def _add_evaluation_arguments(p) -> None:
    e = p.add_argument_group("evaluation and checkpoints")
    e.add_argument(
        "--eval-samples", type=positive_int, default=None, metavar="N", help="held-out windows (default: all)"
    )
    e.add_argument("--eval-every", type=positive_int, default=None, help="steps between evaluations")
    e.add_argument(
        "--save-every", type=positive_int, default=None, help="steps between checkpoints (default: 1/10)"
    )
    e.add_argument(
        "--keep-checkpoints",
        type=positive_int,
        nargs="?",
        const=1,
        default=None,
        metavar="N",
        help="keep the checkpoints when the run finishes (the last N, default 1); without it a finished "
        "run removes them and its last step writes none (an interrupted one keeps its last, for --resume)",
    )
    e.add_argument("--log-every", type=positive_int, default=10, help="steps between log lines (default 10)")
    e.add_argument("--resume", action="store_true", help="continue from the last checkpoint in OUT_DIR")


def _flags(message: str) -> str:
    for word, flag in _FLAGS:
        message = message.replace(word, flag)
    return message


def _gb(n: int) -> str:
    return f"{n / 1e9:,.2f} GB" if abs(n) >= 1e8 else f"{n / 1e6:,.2f} MB"


def _device_memory() -> tuple[int, str] | None:
    """Bytes this process may use, and where: the GPU's, or the machine's RAM shared by the local processes."""
    # lazy: commands import the library when they run, so --help stays fast
    import torch

    if torch.cuda.is_available():
        return torch.cuda.get_device_properties(int(os.environ.get("LOCAL_RANK", "0"))).total_memory, "GPU"
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return None
    return total // int(os.environ.get("LOCAL_WORLD_SIZE", "1")), "CPU memory per process"


def _estimate(args, world: int, teacher_sharding: str, *, table: bool) -> None:
    """Print the expected memory per process (``table``), and a warning when it exceeds the device's."""
    # lazy: commands import the library when they run, so --help stays fast
    from ..distill import default_seq_len, estimate_checkpoint_memory

    # lazy: commands import the library when they run, so --help stays fast
    from ..distill.memory import meta_model

    seq_len = args.seq_len or default_seq_len(meta_model(args.student).config)
    micro = args.micro_batch_size or max(1, args.batch_size // world)
    est = estimate_checkpoint_memory(
        args.student,
        args.teacher,
        processes=world,
        fsdp=args.fsdp,
        teacher_sharded=teacher_sharding == "shard",
        dtype=args.dtype,
        teacher_dtype=args.teacher_dtype,
        mixed_precision=args.mixed_precision,
        micro_batch_size=micro,
        seq_len=seq_len,
        gradient_checkpointing=args.gradient_checkpointing,
        cpu_offload=args.cpu_offload,
        kd=args.kd_weight > 0,
    )
    if int(os.environ.get("RANK", "0")) != 0:
        return
    if table:
        _print_estimate(est, world, micro, seq_len)
    device = _device_memory()
    if device is not None and est.total > device[0]:
        print(
            f"gdnprune distill: warning: the estimate ({_gb(est.total)}) exceeds the {device[1]} "
            f"({_gb(device[0])}); consider --fsdp, --gradient-checkpointing, a smaller --micro-batch-size or "
            f"--cpu-offload",
            file=sys.stderr,
        )


def _print_estimate(est, world: int, micro: int, seq_len: int) -> None:
    student = (
        "student sharded (FSDP2)"
        if est.student_sharded
        else "student replicated (DDP)"
        if world > 1
        else "student whole"
    )
    teacher = "teacher sharded" if est.teacher_sharded else "teacher whole"
    print(
        f"gdnprune distill: expected peak memory per process ({world} process{'es' * (world > 1)}: {student}, "
        f"{teacher}; micro-batch {micro} x {seq_len} tokens):"
    )
    for label, size in est.rows():
        print(f"  {label:<40} {_gb(size):>12}")
    print(f"  {'total':<40} {_gb(est.total):>12}")
    import torch  # lazy: `gdnprune --help` imports no torch

    if torch.cuda.is_available():
        training = f"{_gb(est.host_training)} offloaded while training" if est.host_training else "little"
        where = f"{training} while training (the rest above is GPU memory)"
    else:
        where = f"{_gb(est.total)} while training (the table above: a CPU run holds it all in host memory)"
    how = (
        "its shards, read from the files"
        if est.sharded_loading
        else "the whole student and teacher, read before they are moved or sharded"
    )
    print(f"  host memory per process: {_gb(est.host_loading)} while loading ({how}), {where}")


def run(args) -> int:
    # lazy: commands import the library when they run, so --help stays fast
    from ..distill import OutputFolderError, check_batch, check_options, check_output_folder

    world = args.processes if args.dry_run and args.processes else int(os.environ.get("WORLD_SIZE", "1"))
    # `accelerate launch` with an FSDP config says so in the environment
    args.fsdp = args.fsdp or os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true"
    try:
        data = eval_data = None
        if not args.dry_run:
            check_output_folder(args.output, args.resume, args.overwrite)
        sharding = check_options(
            world_size=world,
            fsdp=args.fsdp,
            teacher_sharding=args.teacher_sharding,
            teacher_device_map=args.teacher_device_map,
            mixed_precision=args.mixed_precision,
            cpu_offload=args.cpu_offload,
        )
        check_batch(args.batch_size, args.micro_batch_size, world)
        if not args.dry_run:  # every input is checked before any model loads
            data, eval_data = checked_data(args), checked_data(args, eval_data=True)
    except OutputFolderError as exc:
        return _output_error(exc)
    except ValueError as exc:
        print(f"gdnprune distill: error: {_flags(str(exc))}", file=sys.stderr)
        return 2
    if args.dry_run:  # the stages' cost (headers and configs only), then the memory table below
        from .estimate import dry_run  # lazy: fast --help

        dry_run(NAME, args, args.teacher, student=args.student)
    _estimate(args, world, sharding, table=not args.quiet or args.dry_run)
    if args.dry_run:
        return 0
    return _train(args, data, eval_data)


def _config(args):
    """The :class:`DistillConfig` of the command's flags."""
    # lazy: commands import the library when they run, so --help stays fast
    from ..distill import DistillConfig

    return DistillConfig(
        output_dir=args.output,
        steps=args.steps,
        tokens=args.tokens,
        lr=args.lr,
        lr_schedule=args.lr_schedule,
        warmup=args.warmup,
        weight_decay=args.weight_decay,
        batch_size=args.batch_size,
        micro_batch_size=args.micro_batch_size,
        seed=args.seed,
        temperature=args.temperature,
        kd_weight=args.kd_weight,
        lm_weight=args.lm_weight,
        eval_every=args.eval_every,
        save_every=args.save_every,
        keep_checkpoints=args.keep_checkpoints or 1,
        remove_checkpoints=args.keep_checkpoints is None,
        log_every=args.log_every,
        resume=args.resume,
        overwrite=args.overwrite,
        fsdp=args.fsdp,
        teacher_sharding=args.teacher_sharding,
        mixed_precision=args.mixed_precision,
        gradient_checkpointing=args.gradient_checkpointing,
        cpu_offload=args.cpu_offload,
        output_dtype=args.output_dtype,
        progress=False,
    )


def _train(args, data, eval_data) -> int:
    # lazy: commands import the library when they run, so --help stays fast
    import torch

    # lazy: commands import the library when they run, so --help stays fast
    from ..distill import OutputFolderError, distill_checkpoint

    # lazy: commands import the library when they run, so --help stays fast
    from ..distill.host_allocator import return_freed_memory

    if args.fsdp and not torch.cuda.is_available():  # a CPU FSDP2 run: its freed gathers go back (--help)
        return_freed_memory()
    dtype = getattr(torch, args.dtype)  # --dtype has a default; --teacher-dtype defaults to it
    teacher_dtype = None if args.teacher_dtype is None else getattr(torch, args.teacher_dtype)
    # checkpoints a second apart make transformers doubt file times; it then orders them by step, as it should
    quiet_mtime = _DropMessage("mtime may not be reliable")
    logging.getLogger("transformers.trainer_utils").addFilter(quiet_mtime)
    try:
        with model_runtime(args):  # one bar: ours (no loading or shard-writing bars of transformers)
            result = distill_checkpoint(
                args.student,
                args.teacher,
                data,
                args.output,
                config=_config(args),
                seq_len=args.seq_len,
                num_samples=args.num_samples,
                eval_data=eval_data,
                eval_samples=args.eval_samples,
                data_cache=args.data_cache,
                dtype=dtype,
                teacher_dtype=teacher_dtype,
                teacher_device_map=args.teacher_device_map,
                callbacks=[] if args.quiet else [_console_callback()],
                data_progress=not args.quiet,
            )
    except OutputFolderError as exc:
        return _output_error(exc)
    except ValueError as exc:
        print(f"gdnprune distill: error: {_flags(' '.join(str(exc).split()))}", file=sys.stderr)
        return 2
    finally:
        logging.getLogger("transformers.trainer_utils").removeFilter(quiet_mtime)
    if int(os.environ.get("RANK", "0")) != 0:
        return (
            0
            if not result.get("interrupted")
            else 128 + int(getattr(signal, result.get("signal") or "SIGINT"))
        )
    code = _report(args, result)
    if code == 0 and args.quantize:
        with model_runtime(args):
            out, manifest = quantize_beside(
                args.output, args.quantize, data=data, overwrite=args.overwrite, progress=not args.quiet
            )
        print(quantize_summary(out, manifest))
    return code


class _DropMessage(logging.Filter):
    def __init__(self, text: str):
        super().__init__()
        self.text = text

    def filter(self, record: logging.LogRecord) -> bool:
        return self.text not in record.getMessage()


def _output_error(exc) -> int:
    if exc.reason == "exists":
        message = (
            f"output folder {exc.path} exists and is not empty: give a new folder, or --resume to continue "
            f"its run, or --overwrite to replace it"
        )
    elif exc.reason == "not_ours":
        message = (
            f"refusing to replace {exc.path}: --overwrite replaces an earlier output (a model folder or a "
            f"distill log), and this is neither; remove the folder yourself"
        )
    else:
        message = f"--resume: {str(exc).removeprefix('resume: ')}"
    print(f"gdnprune distill: error: {message}", file=sys.stderr)
    return 2


def _report(args, result) -> int:
    if result.get("interrupted"):
        name = result.get("signal") or "SIGINT"
        print(
            f"gdnprune distill: interrupted by {name} at step {result['steps']}; saved {result.get('checkpoint')}; "
            f"continue with the same command and --resume",
            file=sys.stderr,
        )
        return 128 + int(getattr(signal, name, signal.SIGINT))
    losses = result.get("losses") or {}
    last, mean, window = losses.get("last"), losses.get("window_mean"), losses.get("window")
    loss = ""
    if isinstance(last, float):
        loss = f", train loss {last:.4f} at the last step"
        if isinstance(mean, float) and window and window[0] < window[1]:
            loss += f" (mean {mean:.4f} over steps {window[0]}-{window[1]})"
    print(
        f"gdnprune distill: {result['steps']} steps, {result['tokens']:,} tokens{loss} in "
        f"{result['seconds']:.0f} s -> {args.output}"
    )
    evals = result.get("eval") or {}
    if isinstance(evals.get("lm_loss"), float):
        print(
            f"gdnprune distill: eval LM loss (nats/token): student {evals['lm_loss']:.4f}, teacher "
            f"{evals['teacher_lm_loss']:.4f}; KD (KL to the teacher) {evals['kd_loss']:.4f}"
        )
    removed = result.get("checkpoints_removed") or []
    if removed:
        print(
            f"gdnprune distill: removed the checkpoints of the finished run ({', '.join(os.path.basename(p) for p in removed)}); "
            f"--keep-checkpoints keeps them"
        )
    elif result.get("checkpoint"):
        print(
            f"gdnprune distill: kept the checkpoints (--keep-checkpoints), the last is {result['checkpoint']}"
        )
    return 0


def _console_callback():
    """One progress bar (steps) and one readable line per log, written above the bar, on the first process."""
    # lazy: commands import the library when they run, so --help stays fast
    from tqdm.auto import tqdm

    # lazy: commands import the library when they run, so --help stays fast
    from transformers import TrainerCallback

    class Console(TrainerCallback):
        bar = None

        def on_train_begin(self, args, state, control, train_dataloader=None, **kwargs):
            dataset = getattr(train_dataloader, "dataset", None)
            seq_len = len(dataset[0]["input_ids"]) if dataset is not None and len(dataset) else 0
            per_step = args.per_device_train_batch_size * args.gradient_accumulation_steps * args.world_size
            self.tokens_per_step, self.start = per_step * seq_len, (time.perf_counter(), state.global_step)
            if state.is_world_process_zero:
                self.bar = tqdm(
                    total=state.max_steps,
                    initial=state.global_step,
                    desc="distill",
                    unit="step",
                    dynamic_ncols=True,
                )

        def on_step_end(self, args, state, control, **kwargs):
            if self.bar is not None:
                seconds = max(time.perf_counter() - self.start[0], 1e-9)
                rate = (state.global_step - self.start[1]) * self.tokens_per_step / seconds
                self.bar.set_postfix_str(f"{rate:,.0f} tokens/s", refresh=False)
                self.bar.update(state.global_step - self.bar.n)

        def on_log(self, args, state, control, logs=None, **kwargs):
            if state.is_world_process_zero and logs:
                line = format_log(state.global_step, state.max_steps, logs)
                if line:
                    (self.bar.write if self.bar is not None else print)(line, file=sys.stderr)

        def on_train_end(self, args, state, control, **kwargs):
            if self.bar is not None:
                self.bar.close()
                self.bar = None

    return Console()


def format_log(step: int, total: int, logs: dict) -> str | None:
    """A Trainer log as one line: ``step 10/100  loss 0.1671  lr 9.5e-05  grad norm 1.23  1,234 tokens/s``."""
    head = f"step {step}/{total}"
    if "eval_loss" in logs:
        parts = [f"eval loss {logs['eval_loss']:.4f}"]
        if "eval_kd_loss" in logs:
            parts.append(
                f"KD {logs['eval_kd_loss']:.4f}, LM {logs['eval_lm_loss']:.4f} (teacher "
                f"{logs['eval_teacher_lm_loss']:.4f})"
            )
        return "  ".join([head, *parts])
    if "loss" in logs:
        parts = [f"loss {logs['loss']:.4f}"]
        if "learning_rate" in logs:
            parts.append(f"lr {logs['learning_rate']:.2e}")
        if isinstance(logs.get("grad_norm"), (int, float)):
            parts.append(f"grad norm {logs['grad_norm']:.3g}")
        if "tokens_per_second" in logs:
            parts.append(f"{logs['tokens_per_second']:,.0f} tokens/s")
        return "  ".join([head, *parts])
    return None
