#!/usr/bin/env python
"""Recovery at scale: FSDP2 holds 56-65% of DDP's memory per process, sharded loading grows 0.5x per teacher byte, data preparation's memory does not grow with the corpus, and a pruned 27B fits 8 x 80 GB.

Four parts (``python -m benchmarks distill_scale PART``), every measured one on 2 CPU processes (gloo,
``torch.distributed.run``), the peak resident memory of each process from the kernel:

``engines``: a random Qwen3.5 text model, hidden 1024 (the teacher), and its GDN half-slice (the student: half
the key and value heads of every GDN layer), trained by :func:`gdnprune.distill.distill` for a few steps on
random tokens, in up to five runs: ``ddp`` (the student and the teacher whole in every process), ``fsdp`` (the
student sharded with FSDP2: parameters, gradients, AdamW state), ``fsdp+teacher`` (both sharded), and
``ddp+lm`` / ``fsdp+teacher+lm`` (``kd_weight=0, lm_weight=1``: the plain fine-tuning step a KD step is
compared with). Each run reports the training peak of each process (VmHWM, reset once the Trainer has
wrapped the model), the setup peak before it, the estimate of :func:`gdnprune.distill.estimate_memory`, the
throughput, the CPU time of a step (the slower process, all its threads), the pages mapped per step, and the
loss curve. Every process first sets the host allocator as ``gdnprune distill`` does on a CPU (``--malloc``).

``table``: the estimate per GPU for real model configurations on 8 x 80 GB, for DDP and FSDP2 variants
(float32 master parameters and AdamW state, bf16 mixed precision, a bf16 teacher, gradient checkpointing, one
window of 4096 tokens per GPU), built on the meta device from the numbers in ``CONFIGS`` (sources given).

``loading``: :func:`gdnprune.distill.distill_checkpoint` under FSDP2 with the teacher sharded, from folders
saved to a temporary directory: a small random student and random teachers of each size in
``--teacher-layers`` (stored in bf16, trained in float32); each loaded ``whole`` (every process builds both
models, then shards them) or ``sharded`` (each process reads only its own rows from the files). Reports the
peak while loading and while training, and how much the peak grows per byte added to the teacher (a whole
copy per process: about 1.0; the target for sharded loading: at most 0.6). ``--moe``: MoE models stored one
tensor per expert.

``corpus``: for each corpus size (generated JSONL shards under ``--root``) a fresh child process runs
:func:`gdnprune.corpus.open_windows` with the bundled demo tokenizer and reads every window once; its peak RSS
and the time of each step, first run and reused cache; ``--procs 2`` under ``torch.distributed.run`` sharing
the cache; a baseline child (the same imports, no data) and, with ``--old``, the one-file path of earlier
versions (the whole corpus in memory).

Usage::

    python -m benchmarks distill_scale engines                        # 5 runs, ~22 min on 2 busy cores
    python -m benchmarks distill_scale engines --modes ddp fsdp+teacher --gradient-checkpointing
    python -m benchmarks distill_scale engines --hidden 2048 --layers 12 --batch-size 2 --seq-len 128 \\
        --modes fsdp+teacher fsdp ddp                                 # 428M teacher: DDP ~9.5 GB per process
    python -m benchmarks distill_scale table                          # the 8 x 80 GB table, seconds
    python -m benchmarks distill_scale loading                        # ~3 minutes
    python -m benchmarks distill_scale loading --moe --teacher-layers 4 12 --steps 1
    python -m benchmarks distill_scale corpus --sizes 2 100 --procs 1 2 --root /tmp/bench
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

from _common import REPO, child_env, load_text, torchrun, write_json

GB = 1e9
HERE = Path(__file__).resolve().parent

# ---- engines: DDP against FSDP2 ------------------------------------------------------------------------------

ENGINE_WORKER = textwrap.dedent("""
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
    from _common import random_qwen35

    from gdnprune.io.loading import slice_model

    teacher = random_qwen35(seed, hidden=hidden, layers=layers, intermediate=hidden, tie=True)
    return teacher, slice_model(teacher, {"num_key_heads": 8, "num_value_heads": 8})


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


def engines_measure(args) -> dict:
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "worker.py"
        script.write_text(ENGINE_WORKER.format(bench=str(HERE)))
        env = child_env(args.threads)
        for mode in args.modes:
            cmd = [
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
            wall, _ = torchrun(cmd, 2, env)
            ranks = [json.loads((Path(tmp) / f"{mode}-{r}.json").read_text()) for r in (0, 1)]
            results[mode] = {"ranks": ranks, "wall": wall}
            print(f"  {mode}: {wall:.0f} s", file=sys.stderr)
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


# ---- table: real configurations on 8 x 80 GB ---------------------------------------------------------------

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


# ---- loading: into FSDP2 shards against whole loading --------------------------------------------------------

LOADING_WORKER = textwrap.dedent("""
    import json, os, sys
    import torch
    from transformers import TrainerCallback
    torch.set_num_threads(1)

    def high_water_mark():
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM"))

    baseline = high_water_mark()
    from gdnprune.distill import DistillConfig, distill_checkpoint

    class Peaks(TrainerCallback):
        loading = None

        def on_train_begin(self, args, state, control, **kwargs):
            self.loading = high_water_mark()
            with open("/proc/self/clear_refs", "w") as f:  # resets VmHWM: the training phase's own peak
                f.write("5")

    root, mode, teacher, steps = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    peaks = Peaks()
    config = DistillConfig(steps=steps, batch_size=2, lr=1e-4, log_every=1, progress=False, fsdp=True,
                           teacher_sharding="shard")
    out = os.path.join(root, f"out-{{mode}}-{{os.path.basename(teacher)}}")
    distill_checkpoint(os.path.join(root, "student"), teacher, os.path.join(root, "train.txt"), out,
                       config=config, seq_len=32, sharded_loading=mode == "sharded", callbacks=[peaks])
    rank = int(os.environ["RANK"])
    report = {{"baseline": baseline, "loading": peaks.loading, "training": high_water_mark()}}
    with open(os.path.join(root, f"{{mode}}-{{os.path.basename(teacher)}}-{{rank}}.json"), "w") as f:
        json.dump(report, f)
""")


def loading_config(layers: int, hidden: int, moe: bool = False):
    import transformers

    if moe:  # 8 experts of hidden / 2, 2 per token, a shared expert: stored one tensor per expert
        return transformers.Qwen3_5MoeTextConfig(
            **{k: v for k, v in loading_config(layers, hidden).to_dict().items() if k.startswith(_SHARED)},
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=hidden // 2,
            shared_expert_intermediate_size=hidden // 2,
            tie_word_embeddings=False,
        )
    return transformers.Qwen3_5TextConfig(
        vocab_size=32000,
        hidden_size=hidden,
        intermediate_size=hidden * 2,
        num_hidden_layers=layers,
        layer_types=(["linear_attention"] * 3 + ["full_attention"]) * (layers // 4),
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=hidden // 8,
        linear_num_key_heads=8,
        linear_num_value_heads=8,
        linear_key_head_dim=hidden // 8,
        linear_value_head_dim=hidden // 8,
        linear_conv_kernel_dim=4,
        tie_word_embeddings=False,
    )


# the config keys an MoE teacher takes from the dense one
_SHARED = ("vocab_size", "hidden_size", "num_hidden_layers", "layer_types", "num_attention_heads",
           "num_key_value_heads", "head_dim", "linear_")  # fmt: skip


def _tokenizer(folder: Path, moe: bool = False) -> None:
    """A word-level tokenizer of the benchmark's text (teacher and student share it); for MoE models, whose
    model type makes transformers load its Qwen tokenizer class, gdnprune's byte tokenizer."""
    import transformers

    if moe:
        from gdnprune.demo_data import build_byte_tokenizer

        build_byte_tokenizer().save_pretrained(folder)
        return
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = ["[UNK]", "the", "teacher", "is", "sharded", "and", "loaded", "by", "rows"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]").save_pretrained(folder)


def build_folders(
    root: Path, teacher_layers: list[int], hidden: int, stored: str, moe: bool = False
) -> dict[str, int]:
    """The student folder, one teacher folder per size (both MoE with ``moe``), the text;
    ``{teacher folder: parameters}``."""
    import torch
    import transformers

    torch.manual_seed(0)
    family = transformers.Qwen3_5MoeForCausalLM if moe else transformers.Qwen3_5ForCausalLM
    student = family(
        loading_config(4, 256, moe)
    )  # of the teacher's family: transformers picks its tokenizer class
    student.save_pretrained(root / "student")
    _tokenizer(root / "student", moe)
    sizes = {}
    for layers in teacher_layers:
        folder = root / f"teacher{layers}"
        config = loading_config(layers, hidden, moe)
        teacher = family(config)
        teacher.to(getattr(torch, stored)).save_pretrained(folder, max_shard_size="200MB")
        _tokenizer(folder, moe)
        sizes[str(folder)] = sum(p.numel() for p in teacher.parameters())
        del teacher
    (root / "train.txt").write_text(" ".join(["the teacher is sharded and loaded by rows"] * 400))
    return sizes


def loading_measure(args) -> dict:
    results: dict = {}
    with tempfile.TemporaryDirectory(dir=args.tmp) as tmp:
        root = Path(tmp)
        sizes = build_folders(root, args.teacher_layers, args.hidden, args.stored_dtype, args.moe)
        script = root / "worker.py"
        script.write_text(LOADING_WORKER.format())
        env = child_env(1, GDNPRUNE_DATA_CACHE=str(root / "cache"))
        for teacher, parameters in sizes.items():
            for mode in args.modes:
                wall, _ = torchrun([str(script), tmp, mode, teacher, str(args.steps)], 2, env)
                name = Path(teacher).name
                ranks = [json.loads((root / f"{mode}-{name}-{r}.json").read_text()) for r in (0, 1)]
                results[(mode, parameters)] = ranks
                print(
                    f"  {mode}, teacher {parameters / 1e6:.0f}M: {wall:.0f} s",
                    file=sys.stderr,
                )
    return results


def loading_report(results: dict, args) -> None:
    print(
        f"2 processes (gloo, CPU), FSDP2, student and {'MoE ' if args.moe else ''}teacher float32 "
        f"(teacher files {args.stored_dtype}), "
        f"{args.steps} steps of 2 x 32 tokens. "
        f"Peak = VmHWM of each process: while loading (to the Trainer's start), while training (reset there).\n"
    )
    print("| loading | teacher parameters | teacher bytes | rank | peak loading (GB) | peak training (GB) |")
    print("|---|---:|---:|---:|---:|---:|")
    for (mode, parameters), ranks in results.items():
        for rank, r in enumerate(ranks):
            print(
                f"| {mode} | {parameters / 1e6:.0f}M | {parameters * 4 / GB:.2f} GB | {rank} | "
                f"{r['loading'] / GB:.2f} | {r['training'] / GB:.2f} |"
            )
    sizes = sorted({p for _, p in results})
    print("\nGrowth of the peak per added teacher byte (smallest to largest teacher, worst process):\n")
    print("| loading | while loading | while training | whole process |")
    print("|---|---:|---:|---:|")
    added = (sizes[-1] - sizes[0]) * 4
    for mode in args.modes:
        small, big = results[(mode, sizes[0])], results[(mode, sizes[-1])]
        row = []
        for key in ("loading", "training", "peak"):
            grow = [
                (max(b["loading"], b["training"]) - max(s["loading"], s["training"]))
                if key == "peak"
                else b[key] - s[key]
                for s, b in zip(small, big)
            ]
            row.append(f"{max(grow) / added:.2f}x")
        print(f"| {mode} | {' | '.join(row)} |")


# ---- corpus: data preparation -------------------------------------------------------------------------------

DEMO = REPO / "src" / "gdnprune" / "data" / "demo_model"
SEQ_LEN = 512
SHARD_BYTES = 32 << 20


def generate(folder: Path, megabytes: int, seed: int = 0) -> int:
    """JSONL shards of about ``SHARD_BYTES`` of generated documents (words drawn from a fixed list)."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    words = [
        "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 9)))
        for _ in range(5000)
    ]
    target, written, shard = megabytes << 20, 0, 0
    out = open(folder / f"shard-{shard:05d}.jsonl", "w", encoding="utf-8")
    while written < target:
        doc = " ".join(rng.choices(words, k=rng.randint(50, 800)))
        line = json.dumps({"text": doc}) + "\n"
        out.write(line)
        written += len(line)
        if out.tell() >= SHARD_BYTES and written < target:
            out.close()
            shard += 1
            out = open(folder / f"shard-{shard:05d}.jsonl", "w", encoding="utf-8")
    out.close()
    return written


def _peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def child(mode: str, data: str, cache: str) -> dict:
    """One measured run in this process; returns its numbers."""
    import torch.distributed as dist
    from transformers import AutoTokenizer

    start = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(DEMO)
    ranked = "RANK" in os.environ
    if ranked:
        dist.init_process_group("gloo")
    rank, world = (dist.get_rank(), dist.get_world_size()) if ranked else (0, 1)
    report: dict = {"mode": mode, "rank": rank, "setup_s": time.perf_counter() - start}
    if mode == "baseline":
        import gdnprune.corpus.dataset  # noqa: F401  (the fixed part: every module a corpus run imports)

        report["peak_rss_mib"] = _peak_mib()
        return report
    if mode == "old":
        from gdnprune.quality.calibration import pack_windows, read_texts

        t = time.perf_counter()
        windows = pack_windows(read_texts(data), tokenizer, seq_len=SEQ_LEN)
        report.update(
            prepare_s=time.perf_counter() - t, windows=int(windows.shape[0]), peak_rss_mib=_peak_mib()
        )
        return report
    from gdnprune.corpus.dataset import open_windows

    t = time.perf_counter()
    ds = open_windows(data, tokenizer, seq_len=SEQ_LEN, cache_dir=cache)
    report["prepare_s"] = time.perf_counter() - t
    report["reused"] = all(s.reused for s in ds.windows.streams)
    report["rss_after_prepare_mib"] = _peak_mib()
    mine = ds.shard(rank, world)
    t = time.perf_counter()
    total = 0
    for k in range(len(mine)):
        total += int(mine[k]["input_ids"][0])
    report.update(
        read_s=time.perf_counter() - t,
        windows=len(ds),
        my_windows=len(mine),
        tokens=sum(s.num_tokens for s in ds.windows.streams),
        peak_rss_mib=_peak_mib(),
    )
    if ranked:
        dist.destroy_process_group()
    return report


def run_child(mode: str, data: Path, cache: Path, procs: int) -> list[dict]:
    out = cache.parent / f".report-{os.getpid()}-{mode}.json"
    script = [str(HERE / "distill_scale.py"), "corpus", "--child", mode, str(data), str(cache), str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if procs > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(procs)]
    else:
        cmd = [sys.executable]
    t = time.perf_counter()
    subprocess.run([*cmd, *script], env=env, check=True)
    wall = time.perf_counter() - t
    reports = [json.loads(line) for line in out.read_text().splitlines()]
    out.unlink()
    for r in reports:
        r["wall_s"] = wall
    return sorted(reports, key=lambda r: r["rank"])


def engines(args) -> int:
    load = load_text()
    results = engines_measure(args)
    print(f"Load average before / after: {load} / {load_text()} (shared machine)\n")
    report_measured(results, args)
    write_json(args.json, results)
    return 0


def table(args) -> int:
    report_table(args)
    return 0


def loading(args) -> int:
    results = loading_measure(args)
    loading_report(results, args)
    write_json(args.json, [{"mode": m, "teacher_parameters": p, "ranks": r} for (m, p), r in results.items()])
    return 0


def corpus(args) -> int:
    if args.child:
        mode, data, cache, out = args.child
        report = child(mode, data, cache)
        with open(out, "a") as f:  # ranks append one line each (short writes under O_APPEND)
            f.write(json.dumps(report) + "\n")
        return 0
    root = Path(args.root)
    root.mkdir(parents=True, exist_ok=True)
    rows = []
    base = run_child("baseline", root, root / "cache-none", 1)[0]
    print(f"baseline (imports + tokenizer, no data): peak RSS {base['peak_rss_mib']:.0f} MiB", flush=True)
    for size in args.sizes:
        data = root / f"{size}MB"
        if not data.exists():
            t = time.perf_counter()
            written = generate(data, size)
            print(
                f"generated {written / 2**20:.1f} MiB in {data} ({time.perf_counter() - t:.0f} s)", flush=True
            )
        for procs in args.procs:
            cache = root / f"cache-{size}MB-{procs}p"
            shutil.rmtree(cache, ignore_errors=True)
            for run in ("first", "reused"):
                for r in run_child("corpus", data, cache, procs):
                    rows.append(dict(size_mb=size, procs=procs, run=run, **r))
                    print(json.dumps(rows[-1]), flush=True)
            shutil.rmtree(cache, ignore_errors=True)
        if size in args.old:
            single = root / f"{size}MB.jsonl"
            with open(single, "wb") as out:
                for shard in sorted(data.glob("*.jsonl")):
                    out.write(shard.read_bytes())
            r = run_child("old", single, root / "cache-none", 1)[0]
            rows.append(dict(size_mb=size, procs=1, run="old", **r))
            print(json.dumps(rows[-1]), flush=True)
            single.unlink()
    print(
        f"\n| corpus | procs | run | prepare s | read all s | windows | peak RSS MiB (per process) | "
        f"over baseline ({base['peak_rss_mib']:.0f} MiB) |"
    )
    print("|---|---:|---|---:|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['size_mb']} MB | {r['procs']} (rank {r['rank']}) | {r['run']} | {r['prepare_s']:.1f} | "
            f"{r.get('read_s', float('nan')):.1f} | {r['windows']} | {r['peak_rss_mib']:.0f} | "
            f"{r['peak_rss_mib'] - base['peak_rss_mib']:+.0f} |"
        )
    write_json(args.json, rows)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parts = parser.add_subparsers(dest="part", required=True)
    e = parts.add_parser("engines", help="DDP against FSDP2: memory per process, speed, loss curves")
    e.add_argument("--steps", type=int, default=4)
    e.add_argument("--batch-size", type=int, default=4, help="global batch (2 processes)")
    e.add_argument("--seq-len", type=int, default=256)
    e.add_argument("--layers", type=int, default=8, help="decoder layers (a multiple of 4)")
    e.add_argument("--hidden", type=int, default=1024, help="hidden size and MLP width of the teacher")
    e.add_argument("--threads", type=int, default=1, help="torch threads per process")
    e.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    e.add_argument("--gradient-checkpointing", action="store_true", help="recompute the decoder layers")
    e.add_argument(
        "--malloc",
        choices=("cli", "mmap", "glibc", "trim"),
        default="cli",
        help="host allocator: cli = what `gdnprune distill` sets on a CPU (the default: under FSDP2 glibc's "
        "mmap threshold fixed at 64 KiB unless a MALLOC_* variable is set, DDP left to glibc's default); "
        "mmap = that threshold in every mode; glibc = glibc's default (or the environment's MALLOC_*); "
        "trim = glibc's default and malloc_trim(0) before every decoder layer's forward and backward",
    )
    e.add_argument(
        "--mmap-threshold",
        type=int,
        default=None,
        metavar="BYTES",
        help="with --malloc cli or mmap: the threshold given to return_freed_memory (default: its own)",
    )
    e.set_defaults(run=engines)
    parts.add_parser("table", help="the estimate per GPU for real configurations on 8 x 80 GB").set_defaults(
        run=table
    )
    lo = parts.add_parser("loading", help="loading into FSDP2 shards against whole loading")
    lo.add_argument("--teacher-layers", type=int, nargs="+", default=[4, 28], help="teacher sizes (layers)")
    lo.add_argument("--hidden", type=int, default=1024, help="the teacher's hidden size")
    lo.add_argument("--modes", nargs="+", default=["whole", "sharded"], choices=["whole", "sharded"])
    lo.add_argument("--steps", type=int, default=2)
    lo.add_argument(
        "--stored-dtype",
        default="bfloat16",
        choices=["bfloat16", "float32"],
        help="the teacher files' dtype (loaded in float32; float32 files are memory-mapped by a whole load)",
    )
    lo.add_argument("--moe", action="store_true", help="MoE teacher and student (8 experts, one tensor each)")
    lo.add_argument("--tmp", default=None, help="where the model folders go (default: the system's temp)")
    lo.set_defaults(run=loading)
    c = parts.add_parser("corpus", help="data preparation: peak RSS and time as the corpus grows")
    c.add_argument("--sizes", type=int, nargs="+", default=[2, 100], metavar="MB")
    c.add_argument("--procs", type=int, nargs="+", default=[1], metavar="N")
    c.add_argument(
        "--old", type=int, nargs="*", default=[], metavar="MB", help="sizes to run the old path on"
    )
    c.add_argument("--root", default="/tmp/gdnprune-corpus-bench")
    c.add_argument("--child", nargs=4, metavar=("MODE", "DATA", "CACHE", "OUT"), help=argparse.SUPPRESS)
    c.set_defaults(run=corpus)
    for sub in (e, lo, c):
        sub.add_argument("--json", type=Path, default=None, help="also write the measurements here")
    args = parser.parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
