#!/usr/bin/env python
"""Distillation at scale: memory per process and throughput of DDP against FSDP2, and what fits on 8 GPUs.

Part 1, measured (2 processes on the CPU, gloo, ``torch.distributed.run``): a random Qwen3.5 text model,
hidden 1024 (the teacher), and its GDN half-slice (the student: half the key and value heads of every
GDN layer), trained by :func:`gdnprune.distill.distill` for a few steps on random tokens, in four runs:

* ``ddp``: data-parallel, the student and the teacher whole in every process;
* ``fsdp``: the student sharded with FSDP2 (parameters, gradients, AdamW state), the teacher whole;
* ``fsdp+teacher``: the student and the teacher sharded;
* ``fsdp+teacher, LM only``: the same engine, ``kd_weight=0, lm_weight=1`` (no teacher forward, no KD
  loss): the plain fine-tuning step a KD step is compared with.

Each run reports the peak resident memory of each process (``ru_maxrss``), the memory before the models
were built (the interpreter, torch, transformers), the estimate of :func:`gdnprune.distill.estimate_memory`
for that engine, the training throughput (tokens/s over the steps after the first), the CPU time of a step
(all threads of the slower process: on a shared machine the load inflates wall time far more than CPU
time, so KD / LM step ratios are given in both) and the loss curve.

Every process first sets the host allocator as ``gdnprune distill`` does on a CPU: under FSDP2
:func:`gdnprune.distill.host_allocator.return_freed_memory` (glibc returns the blocks FSDP2 frees), DDP left
to glibc's default; ``--malloc mmap`` sets it in every mode, ``--malloc glibc`` in none (as the runs before
issue 28 measured), ``--malloc trim`` keeps glibc's default and calls ``malloc_trim(0)`` before every decoder
layer's forward and backward instead.

Part 2, computed: the estimate per GPU for real model configurations on 8 processes (8 x 80 GB), for DDP
and for FSDP2 with the teacher sharded: float32 master parameters and AdamW state, bf16 mixed precision,
a bf16 teacher, gradient checkpointing, one window of 4096 tokens per GPU. The configs are built on the
meta device (no weights) from the numbers in ``CONFIGS`` below (their sources are given there).

Usage::

    OMP_NUM_THREADS=1 python benchmarks/distill_scale.py                  # both parts (a few minutes)
    OMP_NUM_THREADS=1 python benchmarks/distill_scale.py --modes ddp fsdp+teacher --gradient-checkpointing
    python benchmarks/distill_scale.py --table-only                       # part 2 only (seconds)
    OMP_NUM_THREADS=1 python benchmarks/distill_scale.py --modes ddp fsdp+teacher --malloc glibc  # glibc's default
    OMP_NUM_THREADS=1 python benchmarks/distill_scale.py --hidden 2048 --layers 12 --batch-size 2 --seq-len 128 \\
        --modes fsdp+teacher fsdp ddp                            # 428M teacher: DDP ~9.5 GB per process
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
GB = 1e9

WORKER = textwrap.dedent("""
    import ctypes, json, os, resource, sys, time
    import torch
    from transformers import TrainerCallback
    torch.set_num_threads(int(sys.argv[3]))
    baseline = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    malloc, threshold = sys.argv[10].partition(":")[::2]  # cli, mmap, glibc or trim; and a threshold or ""
    # what `gdnprune distill --fsdp` does on a CPU before it loads any model (mmap: in every mode, DDP too)
    if malloc == "mmap" or (malloc == "cli" and sys.argv[1].startswith("fsdp")):
        from gdnprune.distill.host_allocator import MMAP_THRESHOLD, return_freed_memory
        return_freed_memory(int(threshold or MMAP_THRESHOLD))
    sys.path.insert(0, {bench!r})
    from distill_scale import build_pair, trim_hooks
    from gdnprune.distill import DistillConfig, distill, estimate_memory

    def high_water_mark():
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM"))

    class Clock(TrainerCallback):
        # the peak of the training phase: the high-water mark is reset once the Trainer has wrapped the model
        setup = start = cpu = None
        steps, cpu_steps, faults = [], [], []

        def on_train_begin(self, args, state, control, **kwargs):
            self.setup = high_water_mark()
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")

        def on_step_begin(self, args, state, control, **kwargs):
            self.start, self.cpu = time.perf_counter(), time.process_time()
            self.minflt = resource.getrusage(resource.RUSAGE_SELF).ru_minflt

        def on_step_end(self, args, state, control, **kwargs):
            self.steps.append(time.perf_counter() - self.start)
            self.cpu_steps.append(time.process_time() - self.cpu)  # all threads of the process (gloo's too)
            self.faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - self.minflt)  # pages mapped

    mode, out = sys.argv[1], sys.argv[2]
    steps, batch, seq_len, layers, checkpointing, hidden = map(int, sys.argv[4:10])
    teacher, student = build_pair(layers, hidden)
    if malloc == "trim":  # glibc's default, and malloc_trim(0) before every decoder layer's forward and backward
        trim_hooks([teacher, student], ctypes.CDLL(None).malloc_trim)
    fsdp = mode.startswith("fsdp")
    sharding = "shard" if "teacher" in mode else "replicate"
    lm_only = mode.endswith("lm")
    estimate = estimate_memory(student, teacher, processes=int(os.environ["WORLD_SIZE"]), fsdp=fsdp,
                               teacher_sharded=sharding == "shard", micro_batch_size=batch // 2, seq_len=seq_len,
                               kd=not lm_only, gradient_checkpointing=bool(checkpointing))
    data = torch.randint(0, teacher.config.vocab_size, (4 * batch, seq_len), generator=torch.Generator().manual_seed(0))
    clock = Clock()
    config = DistillConfig(steps=steps, batch_size=batch, lr=1e-4, log_every=1, progress=False, fsdp=fsdp,
                           teacher_sharding=sharding if fsdp else None, gradient_checkpointing=bool(checkpointing),
                           kd_weight=0.0 if lm_only else 1.0, lm_weight=1.0 if lm_only else 0.0)
    result = distill(student, teacher, data, config, callbacks=[clock])
    logs = [h for h in result["history"] if "loss" in h]
    report = {{"rank": int(os.environ["RANK"]), "peak": high_water_mark(), "setup_peak": clock.setup,
              "baseline": baseline, "losses": [h["loss"] for h in logs], "step_seconds": clock.steps,
              "step_cpu_seconds": clock.cpu_steps, "step_page_faults": clock.faults,
              "estimate": {{"total": estimate.total, **dict(estimate.rows())}},
              "student_parameters": sum(p.numel() for p in student.parameters()),
              "teacher_parameters": sum(p.numel() for p in teacher.parameters())}}
    with open(os.path.join(out, f"{{mode}}-{{report['rank']}}.json"), "w") as f:
        json.dump(report, f)
""")

MALLOC = {
    "cli": "as `gdnprune distill` sets it on a CPU (FSDP2: return_freed_memory; DDP: glibc's default)",
    "mmap": "return_freed_memory in every mode (DDP too)",
    "glibc": "glibc's default"
    + (" with the environment's MALLOC_*" if any(k.startswith("MALLOC_") for k in os.environ) else ""),
    "trim": "glibc's default, malloc_trim(0) before every decoder layer's forward and backward",
}
MODES = ("ddp", "fsdp", "fsdp+teacher", "ddp+lm", "fsdp+teacher+lm")
LABELS = {
    "ddp": "DDP",
    "fsdp": "FSDP2 (student)",
    "fsdp+teacher": "FSDP2 (student + teacher)",
    "ddp+lm": "DDP, LM only",
    "fsdp+teacher+lm": "FSDP2 (student + teacher), LM only",
}


def build_pair(layers: int = 8, hidden: int = 1024, seed: int = 0):
    """A random Qwen3.5 text model (hidden and MLP ``hidden``, 3 GDN + 1 attention per 4 layers, GDN 16/16
    heads of 128, vocabulary 32000, tied embeddings) and its GDN half-slice (8 key and 8 value heads)."""
    import torch
    import transformers

    from gdnprune.io.loading import slice_model

    torch.manual_seed(seed)
    config = transformers.Qwen3_5TextConfig(
        vocab_size=32000,
        hidden_size=hidden,
        intermediate_size=hidden,
        num_hidden_layers=layers,
        layer_types=(["linear_attention"] * 3 + ["full_attention"]) * (layers // 4),
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=128,
        linear_num_key_heads=16,
        linear_num_value_heads=16,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        linear_conv_kernel_dim=4,
        tie_word_embeddings=True,
    )
    teacher = transformers.Qwen3_5ForCausalLM(config).eval()
    student = slice_model(teacher, {"num_key_heads": 8, "num_value_heads": 8})
    return teacher, student


def trim_hooks(models, malloc_trim) -> None:
    """``malloc_trim(0)`` before the forward and the backward of every decoder layer of ``models`` (FSDP2's own
    pre-forward hook, added later with ``prepend``, gathers the layer first): what the previous layer freed
    goes back to the system (``--malloc trim``)."""
    from gdnprune.distill.fsdp import layer_classes

    def trim(*_):
        malloc_trim(0)

    for model in models:
        classes = tuple(layer_classes(model))
        for layer in (m for m in model.modules() if isinstance(m, classes)):
            layer.register_forward_pre_hook(trim)
            layer.register_full_backward_pre_hook(trim)


def measure(args) -> dict:
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "worker.py"
        script.write_text(WORKER.format(bench=str(Path(__file__).resolve().parent)))
        env = {
            **os.environ,
            "OMP_NUM_THREADS": str(args.threads),
            "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]),
        }
        for mode in args.modes:
            cmd = [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--standalone",
                "--nproc_per_node",
                "2",
                str(script),
                mode,
                tmp,
                str(args.threads),
                str(args.steps),
                str(args.batch_size),
                str(args.seq_len),
                str(args.layers),
                str(int(args.gradient_checkpointing)),
                str(args.hidden),
                f"{args.malloc}:{args.mmap_threshold or ''}",
            ]
            start = time.perf_counter()
            done = subprocess.run(cmd, env=env, capture_output=True, text=True)
            if done.returncode:
                sys.exit(f"{mode} failed:\n{done.stderr[-4000:]}")
            ranks = [json.loads((Path(tmp) / f"{mode}-{r}.json").read_text()) for r in (0, 1)]
            results[mode] = {"ranks": ranks, "wall": time.perf_counter() - start}
            print(f"  {mode}: {time.perf_counter() - start:.0f} s", file=sys.stderr)
    return {mode: results[mode] for mode in MODES if mode in results}  # reported in this order


def _mean(xs):
    return sum(xs) / len(xs) if xs else float("nan")


def _median(xs):
    xs = sorted(xs)
    return xs[len(xs) // 2] if xs else float("nan")


def report_measured(results: dict, args) -> None:
    first = next(iter(results.values()))["ranks"][0]
    sizes = first["teacher_parameters"] / 1e6, first["student_parameters"] / 1e6
    threshold = f" (threshold {args.mmap_threshold:,} bytes)" if args.mmap_threshold else ""
    print(
        f"Teacher {sizes[0]:.1f}M parameters (hidden {args.hidden}, {args.layers} layers), student "
        f"{sizes[1]:.1f}M; {args.steps} steps of {args.batch_size} x "
        f"{args.seq_len} tokens (micro-batch {args.batch_size // 2} per process), float32, "
        f"{'gradient checkpointing, ' if args.gradient_checkpointing else ''}{args.threads} "
        f"thread(s) per process, host allocator: {MALLOC[args.malloc]}{threshold}. Peak = the high-water "
        f"mark of resident memory while training (reset when the Trainer has wrapped the model); setup = the "
        f"high-water mark before (building random models, slicing, "
        f"sharding).\n"
    )
    print(
        "| engine | training peak per process (rank 0 / 1) | estimate | setup peak | s/step (median) | "
        "CPU s/step (median) | tokens/s (2 processes) |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    step, cpu = {}, {}
    for mode, res in results.items():
        r0, r1 = res["ranks"]
        step[mode] = _median([max(a, b) for a, b in zip(r0["step_seconds"][1:], r1["step_seconds"][1:])])
        cpu[mode] = _median(
            [max(a, b) for a, b in zip(r0["step_cpu_seconds"][1:], r1["step_cpu_seconds"][1:])]
        )
        tps = args.batch_size * args.seq_len / step[mode]
        print(
            f"| {LABELS[mode]} | {r0['peak'] / GB:.2f} / {r1['peak'] / GB:.2f} GB | "
            f"{r0['estimate']['total'] / GB + r0['baseline'] / GB:.2f} GB | "
            f"{max(r0['setup_peak'], r1['setup_peak']) / GB:.2f} GB | {step[mode]:.1f} | {cpu[mode]:.1f} | "
            f"{tps:,.0f} |"
        )
    print(
        f"\n(estimate = estimate_memory + the {first['baseline'] / GB:.2f} GB the interpreter, torch and "
        f"transformers take before any model)"
    )
    for mode, res in results.items():
        faults = [r.get("step_page_faults", [])[1:] for r in res["ranks"]]
        if all(faults):  # pages the process mapped in a step: what returning freed memory costs in CPU time
            median = _median([max(a, b) for a, b in zip(*faults)])
            print(
                f"- {LABELS[mode]}: {median:,} page faults per step (median; {median * 4096 / GB:.1f} GB of pages)"
            )
    peak = {m: max(r["peak"] for r in res["ranks"]) for m, res in results.items()}
    if "ddp" in results:
        print()
        for mode in ("fsdp", "fsdp+teacher"):
            if mode in results:
                print(
                    f"- {LABELS[mode]} training peak / DDP: {peak[mode] / peak['ddp']:.1%} (target <= 65%); "
                    f"above the {first['baseline'] / GB:.2f} GB floor: "
                    f"{(peak[mode] - first['baseline']) / (peak['ddp'] - first['baseline']):.1%}"
                )
        base = results["ddp"]["ranks"][0]["losses"]
        for mode in results:
            losses = results[mode]["ranks"][0]["losses"]
            diff = max(abs(a - b) / abs(b) for a, b in zip(losses, base))
            print(
                f"- {LABELS[mode]} loss curve {[f'{x:.4f}' for x in losses]}"
                + (
                    ""
                    if mode == "ddp" or mode.endswith("lm")
                    else f", max relative difference to DDP {diff:.1e}"
                )
            )
    for kd, lm in (("ddp", "ddp+lm"), ("fsdp+teacher", "fsdp+teacher+lm")):
        if kd in step and lm in step:
            print(
                f"- KD step / LM step, {LABELS[kd]}: {cpu[kd] / cpu[lm]:.2f}x in CPU time (target <= 1.5x), "
                f"{step[kd] / step[lm]:.2f}x in wall time (the machine's load moves this one)"
            )
    print("\nEstimate components (rank 0, GB):")
    for mode, res in results.items():
        est = res["ranks"][0]["estimate"]
        print(f"- {LABELS[mode]}: " + ", ".join(f"{k} {v / GB:.3f}" for k, v in est.items() if k != "total"))


# Real configurations. Sources:
# - Qwen3.5-27B: the Qwen3.5-27B model card (huggingface.co/Qwen/Qwen3.5-27B): 64 layers (16 x (3 Gated
#   DeltaNet + 1 gated attention)), hidden 5120, FFN 17408, gated attention 24 Q / 4 KV heads of 256, Gated
#   DeltaNet 16 QK / 48 V heads of 128, vocabulary 248320, 1 MTP layer (not trained: not counted). The
#   text model built here has 26.9B parameters; with the vision tower and the MTP layer that is the 27.78B of
#   the release (55.56 GB of bf16 in its model.safetensors.index.json).
# - Qwen3.5-122B-A10B: its model card (huggingface.co/Qwen/Qwen3.5-122B-A10B): 48 layers (12 x (3 + 1)),
#   hidden 3072, 256 experts (8 routed + 1 shared) of 1024, gated attention 32 Q / 2 KV heads of 256, Gated
#   DeltaNet 16 QK / 64 V heads of 128, vocabulary 248320. Built here: 122.2B parameters.
# - Qwen3-Next-80B-A3B: transformers' Qwen3NextConfig defaults, documented as that model's configuration
#   (transformers 5.23, models/qwen3_next/configuration_qwen3_next.py): 48 layers, hidden 2048, 512 experts
#   (10 routed + 1 shared) of 512, attention 16 Q / 2 KV heads of 256, Gated DeltaNet 16 QK / 32 V heads of
#   128, vocabulary 151936. Built here: 79.7B parameters.
CONFIGS = {
    "Qwen3.5-27B": (
        "Qwen3_5TextConfig",
        dict(
            vocab_size=248320,
            hidden_size=5120,
            intermediate_size=17408,
            num_hidden_layers=64,
            num_attention_heads=24,
            num_key_value_heads=4,
            head_dim=256,
            linear_num_key_heads=16,
            linear_num_value_heads=48,
            linear_key_head_dim=128,
            linear_value_head_dim=128,
            tie_word_embeddings=False,
        ),
    ),
    "Qwen3-Next-80B-A3B": (
        "Qwen3NextConfig",
        dict(
            vocab_size=151936,
            hidden_size=2048,
            intermediate_size=5120,
            num_hidden_layers=48,
            num_attention_heads=16,
            num_key_value_heads=2,
            head_dim=256,
            linear_num_key_heads=16,
            linear_num_value_heads=32,
            linear_key_head_dim=128,
            linear_value_head_dim=128,
            num_experts=512,
            num_experts_per_tok=10,
            moe_intermediate_size=512,
            shared_expert_intermediate_size=512,
            tie_word_embeddings=False,
        ),
    ),
    "Qwen3.5-122B-A10B": (
        "Qwen3_5MoeTextConfig",
        dict(
            vocab_size=248320,
            hidden_size=3072,
            num_hidden_layers=48,
            num_attention_heads=32,
            num_key_value_heads=2,
            head_dim=256,
            linear_num_key_heads=16,
            linear_num_value_heads=64,
            linear_key_head_dim=128,
            linear_value_head_dim=128,
            num_experts=256,
            num_experts_per_tok=8,
            moe_intermediate_size=1024,
            shared_expert_intermediate_size=1024,
            tie_word_embeddings=False,
        ),
    ),
}
CLASSES = {
    "Qwen3_5TextConfig": "Qwen3_5ForCausalLM",
    "Qwen3NextConfig": "Qwen3NextForCausalLM",
    "Qwen3_5MoeTextConfig": "Qwen3_5MoeForCausalLM",
}


def meta_models(name: str, student_heads: str):
    """Teacher and student of ``name`` on the meta device; the student is the teacher (``"full"``) or its GDN
    half-slice (``"half"``: half the key and value heads of every GDN layer)."""
    import torch
    import transformers

    config_class, values = CONFIGS[name]
    config = getattr(transformers, config_class)(**values)
    cls = getattr(transformers, CLASSES[config_class])
    with torch.device("meta"):
        teacher = cls(config)
        if student_heads == "full":
            return teacher, teacher
        half = dict(
            values,
            linear_num_key_heads=values["linear_num_key_heads"] // 2,
            linear_num_value_heads=values["linear_num_value_heads"] // 2,
        )
        return teacher, cls(getattr(transformers, config_class)(**half))


def report_table(args) -> None:
    import torch

    from gdnprune.distill import estimate_memory

    gpus, budget = 8, 80 * GB
    engines = {  # label -> options of estimate_memory
        "DDP": dict(fsdp=False, teacher_sharded=False),
        "FSDP2": dict(fsdp=True, teacher_sharded=True),
        "FSDP2, teacher whole": dict(fsdp=True, teacher_sharded=False),
        "FSDP2, bf16 params + AdamW": dict(
            fsdp=True, teacher_sharded=True, dtype=torch.bfloat16, mixed_precision="no"
        ),
        "FSDP2 + CPU offload (GPU part)": dict(fsdp=True, teacher_sharded=True, cpu_offload=True),
    }
    print(
        f"Estimated memory per GPU on {gpus} GPUs of 80 GB (estimate_memory on meta-device models): float32 "
        f"parameters and AdamW state with bf16 mixed precision unless said, bf16 teacher, gradient "
        f"checkpointing, micro-batch 1 x 4096 tokens. FSDP2 shards the teacher too unless said.\n"
    )
    hosts = ("DDP", "FSDP2", "FSDP2 + CPU offload (GPU part)")  # the host-memory column's engines
    print(
        "| teacher | student | params (teacher / student) | "
        + " | ".join(engines)
        + " | host memory per process (DDP / FSDP2 / FSDP2 + CPU offload) |"
    )
    print("|---|---|---:|" + "---:|" * (len(engines) + 1))
    for name in CONFIGS:
        for student_heads in ("half", "full"):
            teacher, student = meta_models(name, student_heads)
            cells, host = [], {}
            for label, options in engines.items():
                options = {
                    "processes": gpus,
                    "dtype": torch.float32,
                    "teacher_dtype": torch.bfloat16,
                    "mixed_precision": "bf16",
                    "micro_batch_size": 1,
                    "seq_len": 4096,
                    "gradient_checkpointing": True,
                    **options,
                }
                estimate = estimate_memory(student, teacher, **options)
                total = estimate.total
                cells.append(f"{total / GB:,.0f} GB {'fits' if total <= budget else 'no'}")
                # the --dry-run's host line: what a process reads while loading, or holds offloaded after
                host[label] = max(estimate.host_loading, estimate.host_training)
            cells.append(" / ".join(f"{host[label] / GB:,.0f}" for label in hosts) + " GB")
            sizes = [sum(p.numel() for p in m.parameters()) / 1e9 for m in (teacher, student)]
            label = "GDN half-slice" if student_heads == "half" else "same size"
            print(f"| {name} | {label} | {sizes[0]:.1f}B / {sizes[1]:.1f}B | " + " | ".join(cells) + " |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--batch-size", type=int, default=4, help="global batch (2 processes)")
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--layers", type=int, default=8, help="decoder layers (a multiple of 4)")
    p.add_argument("--hidden", type=int, default=1024, help="hidden size and MLP width of the teacher")
    p.add_argument("--threads", type=int, default=1, help="torch threads per process")
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    p.add_argument("--gradient-checkpointing", action="store_true", help="recompute the decoder layers")
    p.add_argument(
        "--malloc",
        choices=("cli", "mmap", "glibc", "trim"),
        default="cli",
        help="host allocator: cli = what `gdnprune distill` sets on a CPU (the default: under FSDP2 glibc's "
        "mmap threshold fixed at 64 KiB unless a MALLOC_* variable is set, DDP left to glibc's default); "
        "mmap = that threshold in every mode; glibc = glibc's default (or the environment's MALLOC_*); "
        "trim = glibc's default and malloc_trim(0) before every decoder layer's forward and backward",
    )
    p.add_argument(
        "--mmap-threshold",
        type=int,
        default=None,
        metavar="BYTES",
        help="with --malloc cli or mmap: the threshold given to return_freed_memory (default: its own)",
    )
    p.add_argument("--table-only", action="store_true")
    args = p.parse_args()
    sys.path.insert(0, str(ROOT / "src"))
    load = os.getloadavg()
    if not args.table_only:
        results = measure(args)
        print(f"Load average before / after: {load[0]:.1f} / {os.getloadavg()[0]:.1f} (shared machine)\n")
        report_measured(results, args)
        print()
    report_table(args)


if __name__ == "__main__":
    main()
