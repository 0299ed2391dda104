#!/usr/bin/env python
"""Loading into FSDP2 shards against whole loading: the peak resident memory of each process as the teacher grows.

2 processes on the CPU (gloo, ``torch.distributed.run``) run :func:`gdnprune.distill.distill_checkpoint` under
FSDP2 with the teacher sharded, from folders saved to a temporary directory: a small random Qwen3.5 student
(fixed) and a random Qwen3.5 teacher of each size in ``--teacher-layers`` (hidden 1024, the layer count
sets the size: 110M and 378M parameters by default), stored in bf16 (``--stored-dtype``) and trained in
float32, a few steps on a short text. Each run loads
either ``whole`` (every process builds the whole student and teacher, then shards them: the old path,
``sharded_loading=False``) or ``sharded`` (each process reads only its own rows from the files).

Per process it reports the high-water mark of resident memory (VmHWM) while loading (up to the Trainer's
start) and while training (reset at the Trainer's start), and, between the smallest and the largest teacher,
how much the peak grows per byte added to the teacher: a whole copy per process gives about 1.0; the
target for sharded loading is at most 0.6.

On the CPU, glibc keeps the heap pages of the teacher's all-gathered units after FSDP2 frees them, so the
training peak grows by ~1.2x the added teacher bytes in both modes unless large allocations go to ``mmap``
(returned on free): run with ``MALLOC_MMAP_THRESHOLD_=65536`` to measure what is live (both modes' training
peak then grows by ~0.5x).

Usage::

    OMP_NUM_THREADS=1 python benchmarks/sharded_loading.py                        # ~3 minutes on 2 cores
    MALLOC_MMAP_THRESHOLD_=65536 OMP_NUM_THREADS=1 python benchmarks/sharded_loading.py   # freed memory returned
    OMP_NUM_THREADS=1 python benchmarks/sharded_loading.py --teacher-layers 4 12 --steps 1   # quicker
    OMP_NUM_THREADS=1 python benchmarks/sharded_loading.py --moe --teacher-layers 4 12 --hidden 512 --steps 1
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


def _config(layers: int, hidden: int, moe: bool = False):
    import transformers

    if moe:  # 8 experts of hidden / 2, 2 per token, a shared expert: stored one tensor per expert
        return transformers.Qwen3_5MoeTextConfig(
            **{k: v for k, v in _config(layers, hidden).to_dict().items() if k.startswith(_SHARED)},
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
    student = family(_config(4, 256, moe))  # of the teacher's family: transformers picks its tokenizer class
    student.save_pretrained(root / "student")
    _tokenizer(root / "student", moe)
    sizes = {}
    for layers in teacher_layers:
        folder = root / f"teacher{layers}"
        config = _config(layers, hidden, moe)
        teacher = family(config)
        teacher.to(getattr(torch, stored)).save_pretrained(folder, max_shard_size="200MB")
        _tokenizer(folder, moe)
        sizes[str(folder)] = sum(p.numel() for p in teacher.parameters())
        del teacher
    (root / "train.txt").write_text(" ".join(["the teacher is sharded and loaded by rows"] * 400))
    return sizes


def measure(args) -> dict:
    results: dict = {}
    with tempfile.TemporaryDirectory(dir=args.tmp) as tmp:
        root = Path(tmp)
        sizes = build_folders(root, args.teacher_layers, args.hidden, args.stored_dtype, args.moe)
        script = root / "worker.py"
        script.write_text(WORKER.format())
        env = {
            **os.environ,
            "OMP_NUM_THREADS": "1",
            "GDNPRUNE_DATA_CACHE": str(root / "cache"),
            "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]),
        }
        for teacher, parameters in sizes.items():
            for mode in args.modes:
                cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
                start = time.perf_counter()
                done = subprocess.run(
                    [*cmd, str(script), tmp, mode, teacher, str(args.steps)],
                    env=env,
                    capture_output=True,
                    text=True,
                )
                if done.returncode:
                    sys.exit(f"{mode} {teacher} failed:\n{done.stderr[-4000:]}")
                name = Path(teacher).name
                ranks = [json.loads((root / f"{mode}-{name}-{r}.json").read_text()) for r in (0, 1)]
                results[(mode, parameters)] = ranks
                print(
                    f"  {mode}, teacher {parameters / 1e6:.0f}M: {time.perf_counter() - start:.0f} s",
                    file=sys.stderr,
                )
    return results


def report(results: dict, args) -> None:
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


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--teacher-layers", type=int, nargs="+", default=[4, 28], help="teacher sizes (layers)"
    )
    parser.add_argument("--hidden", type=int, default=1024, help="the teacher's hidden size")
    parser.add_argument("--modes", nargs="+", default=["whole", "sharded"], choices=["whole", "sharded"])
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument(
        "--stored-dtype",
        default="bfloat16",
        choices=["bfloat16", "float32"],
        help="the teacher files' dtype (loaded in float32; float32 files are memory-mapped by a whole load)",
    )
    parser.add_argument(
        "--moe",
        action="store_true",
        help="an MoE teacher and student (Qwen3.5-MoE, 8 experts), stored one tensor per expert as save_pretrained "
        "writes them",
    )
    parser.add_argument("--tmp", default=None, help="where the model folders go (default: the system's temp)")
    parser.add_argument("--json", type=Path, help="also write the measurements here")
    args = parser.parse_args(argv)
    results = measure(args)
    report(results, args)
    if args.json:
        rows = [{"mode": m, "teacher_parameters": p, "ranks": r} for (m, p), r in results.items()]
        args.json.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
