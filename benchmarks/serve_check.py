#!/usr/bin/env python
"""Serve check (GPU): vLLM serves a servable gdnprune output, and predicted latency meets measured latency.

Issue 30's GPU check, as one prepared script. On a machine with a CUDA GPU it

1. takes a servable output (``--model``: one geometry per kind of block, whole layers removed, a plain
   config without ``per_layer_config``) and its teacher (``--teacher``), or, without them, builds both: a
   random Qwen3.5 text model (bfloat16; hidden 2048, 8 layers ``GGGA GGGA``, GDN 16 key / 32 value heads of
   128, MLP 6144, vocabulary 32000) and its uniform cut by ``slice_checkpoint`` (half the GDN value heads,
   the MLP at 4096, decoder layer 1 removed);
2. latency, at every ``--workload`` (default ``prefill:1:2048`` and ``decode:8:4096``), with
   :mod:`gdnprune.model.latency` and the kernels transformers picks (flash-linear-attention and causal-conv1d when
   installed): the teacher's and the cut model's measured whole-model latency (speed-up), and two
   predictions of the cut model's latency: ``fixed + sum of its decoder layers`` timed in its own harness,
   and ``teacher's fixed part + the cut layers timed in place of the teacher's`` (removed layers cost 0:
   what a latency budget sums; ``--removed`` names them for a given ``--model``); the ratio predicted /
   measured;
3. greedy generation: the same random prompts (``--prompts`` x ``--prompt-len`` token ids) through
   transformers (``gdnprune.load_pretrained``, ``generate(do_sample=False)``) and vLLM (``LLM(...,
   skip_tokenizer_init=True, enforce_eager=True)``, ``temperature=0``), ``--new-tokens`` each; prints the
   tokens that agree. (Random weights give nearly flat logits, where bfloat16 kernels may break ties
   differently; a trained checkpoint passed with ``--model`` is the real check.)

4. quantized outputs (issue 44): the cut model written by ``gdnprune quantize`` with each ``--quantize``
   scheme (default: fp8-block, fp8-dynamic, w4a16 with GPTQ on the prompts), each loaded by transformers
   (compressed-tensors) and by vLLM, their greedy tokens compared. With ``--smoke`` (CPU) only transformers.

It prints a dated markdown section for BENCHMARKS.md and writes every number to ``--out`` (JSON).
Without a CUDA GPU it prints what it needs and exits 0; without vllm it runs the latency part and says
what the generation check needs. Sized for an H200: a few minutes, most of it vLLM's start-up.

Usage::

    python benchmarks/serve_check.py --out serve_check.json
    python benchmarks/serve_check.py --teacher Qwen3.5-2B --model out-servable --workload decode:8:4096
"""

from __future__ import annotations

import argparse
import datetime
import gc
import importlib.util
import json
import sys
import tempfile
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

NEEDS = """serve_check needs:
  - a CUDA GPU (torch.cuda.is_available(): {cuda});
  - vllm with Qwen3.5 support (pip install vllm; found: {vllm}) for the generation check;
  - flash-linear-attention and causal-conv1d (pip install flash-linear-attention causal-conv1d; found: {fla},
    {conv}) so that transformers runs the fast GDN kernels (otherwise its PyTorch fallback is timed)."""


def found(name: str) -> bool:
    return importlib.util.find_spec(name) is not None


#: the decoder layers the built cut removes
BUILT_REMOVED = [1]


def build_models(root: Path, smoke: bool = False) -> tuple[Path, Path, str]:
    """A random bfloat16 Qwen3.5 teacher and its servable cut (uniform widths, one layer removed)."""
    import torch
    import transformers

    from gdnprune.checkpoint import slice_checkpoint

    torch.manual_seed(0)
    layers, hidden = 8, 256 if smoke else 2048
    config = transformers.Qwen3_5TextConfig(
        vocab_size=32000,
        hidden_size=hidden,
        intermediate_size=6144,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 128,
        num_key_value_heads=max(1, hidden // 512),
        head_dim=128,
        layer_types=["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(layers)],
        linear_num_key_heads=hidden // 128,
        linear_num_value_heads=32,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        linear_conv_kernel_dim=4,
        max_position_embeddings=8192,
        architectures=["Qwen3_5ForCausalLM"],
    )
    model = transformers.Qwen3_5ForCausalLM(config).to(torch.bfloat16)
    teacher, cut = root / "teacher", root / "servable"
    model.save_pretrained(teacher)
    del model
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # an unsorted input: the check is about serving, not quality
        slice_checkpoint(
            teacher,
            cut,
            target={"num_value_heads": 16, "intermediate_size": 4096},
            remove_layers=BUILT_REMOVED,
            progress=False,
        )
    what = f"random Qwen3.5 (hidden {hidden}, {layers} layers) and its uniform cut (Hv 32->16, MLP 6144->4096, layer 1 removed)"
    return teacher, cut, what


def swapped_prediction(harness, big_layers, small_layers, removed: list[int]) -> float | None:
    """The teacher's fixed part + every kept teacher layer's latency with the cut layer timed in its place (a
    removed layer costs 0): what a latency budget sums. The cut layers' ``layer_idx`` are set to the teacher's
    numbers while they are timed (their cache layer must be of the teacher layer's kind)."""
    kept = [i for i in range(len(big_layers)) if i not in set(removed)]
    if len(kept) != len(small_layers):
        return None
    pairs = list(zip([big_layers[i] for i in kept], small_layers))
    saved = []
    for i, small in zip(kept, small_layers):
        for module in small.modules():
            if hasattr(module, "layer_idx"):
                saved.append((module, module.layer_idx))
                module.layer_idx = i
    try:
        return harness.fixed_latency().seconds + sum(t.seconds for t in harness.block_latencies(pairs))
    finally:
        for module, index in saved:
            module.layer_idx = index


def latencies(
    teacher: Path, cut: Path, workloads, repeats: int, warmup: int, device: str, removed: list[int]
) -> list[dict]:
    import torch

    from gdnprune.io.loading import load_pretrained
    from gdnprune.model.latency import LatencyHarness

    def load(path: Path):
        return load_pretrained(path, dtype=torch.bfloat16).to(device).eval()

    rows = []
    big, small = load(teacher), load(cut)
    big_layers, small_layers = list(big.model.layers), list(small.model.layers)
    for workload in workloads:
        tb = LatencyHarness(big, workload, repeats=repeats, warmup=warmup)
        tc = LatencyHarness(small, workload, repeats=repeats, warmup=warmup)
        teacher_whole = tb.model_latency().seconds
        cut_whole = tc.model_latency().seconds
        own = tc.fixed_latency().seconds + sum(
            t.seconds for t in tc.block_latencies([(layer, None) for layer in small_layers])
        )
        swapped = swapped_prediction(tb, big_layers, small_layers, removed)
        rows.append(
            {
                "workload": str(workload),
                "teacher_seconds": teacher_whole,
                "cut_seconds": cut_whole,
                "speedup": teacher_whole / cut_whole,
                "predicted_own_seconds": own,
                "predicted_own_ratio": own / cut_whole,
                "predicted_swapped_seconds": swapped,
                "predicted_swapped_ratio": None if swapped is None else swapped / cut_whole,
                "cut_peak_memory_bytes": tc.model_latency().peak_memory_bytes,
            }
        )
        print(
            f"  {workload}: teacher {1000 * teacher_whole:.2f} ms, cut {1000 * cut_whole:.2f} ms", flush=True
        )
    del big, small
    gc.collect()
    if device != "cpu":
        torch.cuda.empty_cache()
    return rows


def prompts(vocab: int, count: int, length: int, seed: int = 0) -> list[list[int]]:
    import torch

    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (count, length), generator=g).tolist()


def transformers_greedy(cut: Path, ids: list[list[int]], new_tokens: int, device: str) -> list[list[int]]:
    import torch

    from gdnprune.io.loading import load_pretrained

    model = load_pretrained(cut, dtype=torch.bfloat16).to(device).eval()
    out = []
    with torch.no_grad():
        for prompt in ids:
            x = torch.tensor([prompt], device=device)
            y = model.generate(x, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
            out.append(y[0, len(prompt) :].tolist())
    del model
    gc.collect()
    if device != "cpu":
        torch.cuda.empty_cache()
    return out


def vllm_greedy(cut: Path, ids: list[list[int]], new_tokens: int) -> list[list[int]]:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(
        model=str(cut),
        dtype="bfloat16",
        skip_tokenizer_init=True,
        enforce_eager=True,
        gpu_memory_utilization=0.5,
        max_model_len=max(len(p) for p in ids) + new_tokens + 16,
        seed=0,
    )
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, min_tokens=new_tokens, detokenize=False)
    outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in ids], params)
    return [list(o.outputs[0].token_ids) for o in outputs]


def quantized_checks(
    cut: Path, root: Path, ids: list[list[int]], new_tokens: int, device: str, schemes: list[str], vllm: bool
) -> list[dict]:
    """Each scheme of ``gdnprune quantize`` on the cut model (GPTQ calibrated on the prompts for w4a16):
    transformers' greedy tokens, and vLLM's from the same folder (compressed-tensors), compared."""
    import torch

    from gdnprune.quantize import quantize_checkpoint

    rows = []
    for scheme in schemes:
        out = root / f"cut-{scheme}"
        row: dict = {"scheme": scheme}
        try:
            manifest = quantize_checkpoint(
                cut, out, scheme=scheme, batches=[torch.tensor(ids)], progress=False, overwrite=True
            )
        except ValueError as exc:
            rows.append({**row, "error": f"quantize: {exc}"})
            continue
        row["quantized"], row["high_precision"] = len(manifest["quantized"]), len(manifest["high_precision"])
        row["bytes"] = manifest["weight_bytes"]
        reference = transformers_greedy(out, ids, new_tokens, device)
        row["transformers_tokens"] = reference
        if vllm:
            try:
                row["vllm"] = agreement(reference, vllm_greedy(out, ids, new_tokens))
            except Exception as exc:  # report what vLLM said, keep the other schemes
                row["error"] = f"vLLM failed: {type(exc).__name__}: {' '.join(str(exc).split())[:400]}"
        rows.append(row)
    return rows


def agreement(a: list[list[int]], b: list[list[int]]) -> dict:
    prefix = []
    for x, y in zip(a, b):
        n = 0
        while n < min(len(x), len(y)) and x[n] == y[n]:
            n += 1
        prefix.append(n)
    same = sum(int(u == v) for x, y in zip(a, b) for u, v in zip(x, y))
    total = sum(min(len(x), len(y)) for x, y in zip(a, b))
    return {
        "identical": all(x == y for x, y in zip(a, b)),
        "same_tokens": same,
        "tokens": total,
        "prefix": prefix,
    }


def report(info: dict) -> str:
    lines = [
        f"## serve_check ({info['date']}, {info['gpu']})",
        "",
        f"Models: {info['models']}. Kernels: flash-linear-attention {info['fla']}, causal-conv1d {info['conv']}; "
        f"torch {info['torch']}, transformers {info['transformers']}, vllm {info['vllm']}.",
        "",
        "| workload | teacher ms | cut ms | speed-up | predicted (own layers) ms | / measured | "
        "predicted (swapped into teacher) ms | / measured |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in info["latency"]:
        swapped = r["predicted_swapped_seconds"]
        lines.append(
            f"| {r['workload']} | {1000 * r['teacher_seconds']:.2f} | {1000 * r['cut_seconds']:.2f} | "
            f"{r['speedup']:.2f}x | {1000 * r['predicted_own_seconds']:.2f} | {r['predicted_own_ratio']:.3f} | "
            + (
                "- | - |"
                if swapped is None
                else f"{1000 * swapped:.2f} | {r['predicted_swapped_ratio']:.3f} |"
            )
        )
    g = info.get("generation")
    lines.append("")
    if g is None:
        lines.append(f"Generation check not run: {info.get('generation_skipped')}")
    else:
        lines.append(
            f"Greedy generation, vLLM vs transformers ({g['prompts']} prompts x {g['new_tokens']} tokens): "
            f"{'identical' if g['identical'] else 'DIFFERENT'}; {g['same_tokens']}/{g['tokens']} tokens agree; "
            f"agreeing prefix per prompt: {g['prefix']}."
        )
    for q in info.get("quantized", []):
        if "error" in q:
            lines.append(f"- {q['scheme']}: {q['error']}")
        elif "vllm" in q:
            v = q["vllm"]
            lines.append(
                f"- {q['scheme']}: vLLM loads it ({q['quantized']} matrices quantized, {q['high_precision']} kept); "
                f"greedy vs transformers {'identical' if v['identical'] else 'DIFFERENT'}, "
                f"{v['same_tokens']}/{v['tokens']} tokens agree"
            )
        else:
            lines.append(
                f"- {q['scheme']}: transformers loads and generates ({q['quantized']} matrices quantized)"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, help="a servable gdnprune output (default: build one)")
    p.add_argument("--teacher", type=Path, help="the model it was cut from (with --model)")
    p.add_argument("--workload", action="append", help="default: prefill:1:2048 and decode:8:4096")
    p.add_argument(
        "--removed",
        default=None,
        help="with --model: the teacher's decoder layers the cut removed, e.g. 1,5 (default: none)",
    )
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--warmup-calls", type=int, default=3)
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--out", type=Path, help="write every number here (JSON)")
    p.add_argument(
        "--quantize",
        action="append",
        choices=("fp8-block", "fp8-dynamic", "w4a16"),
        help="quantize the cut model with this scheme (repeat; default: all three) and check that vLLM "
        "serves it and generates what transformers generates",
    )
    p.add_argument(
        "--smoke",
        action="store_true",
        help="check the script itself on a CPU: a small built model (hidden 256), small workloads, no vLLM",
    )
    args = p.parse_args(argv)
    if (args.model is None) != (args.teacher is None):
        p.error("give both --model and --teacher, or neither (then both are built)")

    import torch

    have = {
        "cuda": torch.cuda.is_available(),
        "vllm": found("vllm"),
        "fla": found("fla"),
        "conv": found("causal_conv1d"),
    }
    if args.smoke:
        have.update(cuda=False, vllm=False)
        args.workload = args.workload or ["prefill:1:64", "decode:2:64"]
        args.prompts, args.prompt_len, args.new_tokens, args.repeats, args.warmup_calls = 2, 16, 4, 2, 1
    elif not have["cuda"]:
        print(NEEDS.format(**have))
        print("no CUDA GPU here: nothing run")
        return 0
    if not (have["fla"] and have["conv"]) and not args.smoke:
        print(NEEDS.format(**have))
        print("note: timing with transformers' PyTorch fallback kernels", flush=True)

    import transformers

    from gdnprune.model.latency import parse_workload

    workloads = [parse_workload(w) for w in (args.workload or ["prefill:1:2048", "decode:8:4096"])]
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="serve_check-") as tmp:
        if args.model is None:
            teacher, cut, models = build_models(Path(tmp), smoke=args.smoke)
            removed = BUILT_REMOVED
        else:
            teacher, cut, models = args.teacher, args.model, f"{args.teacher} -> {args.model}"
            removed = [int(i) for i in args.removed.split(",")] if args.removed else []
        config = json.loads((cut / "config.json").read_text())
        text = config.get("text_config", config)
        if config.get("per_layer_config") or text.get("per_layer_config") or "auto_map" in config:
            print(
                f"{cut}: not servable by stock engines (per_layer_config or remote code); vLLM would refuse it"
            )
        info = {
            "date": datetime.date.today().isoformat(),
            "gpu": "CPU smoke run" if args.smoke else torch.cuda.get_device_name(0),
            "models": models,
            "fla": have["fla"],
            "conv": have["conv"],
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "vllm": importlib.util.find_spec("vllm") and __import__("vllm").__version__,
        }
        print("latency:", flush=True)
        device = "cpu" if args.smoke else "cuda"
        info["latency"] = latencies(teacher, cut, workloads, args.repeats, args.warmup_calls, device, removed)
        ids = prompts(int(text.get("vocab_size", 32000)), args.prompts, args.prompt_len)
        reference = transformers_greedy(cut, ids, args.new_tokens, device)
        if not have["vllm"]:
            info["generation"] = None
            info["generation_skipped"] = (
                "--smoke" if args.smoke else "vllm is not installed (pip install vllm)"
            )
        else:
            try:
                served = vllm_greedy(cut, ids, args.new_tokens)
                info["generation"] = {
                    "prompts": args.prompts,
                    "new_tokens": args.new_tokens,
                    **agreement(reference, served),
                }
            except Exception as exc:  # report what vLLM said, keep the latency numbers
                info["generation"] = None
                info["generation_skipped"] = (
                    f"vLLM failed: {type(exc).__name__}: {' '.join(str(exc).split())[:400]}"
                )
        schemes = args.quantize or ["fp8-block", "fp8-dynamic", "w4a16"]
        print("quantized:", flush=True)
        info["quantized"] = quantized_checks(
            cut, Path(tmp), ids, args.new_tokens, device, schemes, have["vllm"] and not args.smoke
        )
    info["seconds"] = time.perf_counter() - start
    print(report(info))
    if args.out is not None:
        args.out.write_text(json.dumps(info, indent=2) + "\n")
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
