"""Benchmark of streaming checkpoint surgery against `cp -r` and a naive load/gather/save baseline.

Builds a synthetic checkpoint with the real GDN geometry of Qwen3-Next-80B (hidden 2048, 16 key heads,
32 value heads, head dims 128, bf16, fused ``in_proj_qkvz`` / ``in_proj_ba`` layout): one layer per
shard, each shard ~470 MB of which ~67 MB are GDN tensors, the rest MoE-expert filler. Then runs, each
in its own child process and side by side in every round:

* ``cp -r`` of the folder (the physical limit);
* ``gdnprune sort`` (random importance orders) and ``gdnprune slice`` (half the key and value heads), as
  the command line runs them (``python -m gdnprune ...``);
* the same two through the Python API (``python -c "from gdnprune.checkpoint import ..."``), which
  imports only what the engine needs;
* a naive baseline: ``safetensors.torch.load_file`` each shard, gather the GDN tensors, ``save_file``.

Wall time and peak RSS come from ``os.wait4`` of each child; ``sync`` runs (untimed, reported) between
commands so that one command's write-back does not land in the next one's time. Prints the median over
rounds and the ratios to ``cp -r`` and to the targets (wall <= 1.3x cp, RSS <= largest tensor + 1 GB).

    python benchmarks/transform.py                  # 6 layers, ~470 MB shards (~2.8 GB)
    python benchmarks/transform.py --layers 12      # twice the layers
    python benchmarks/transform.py --shard-scale 4  # shards 4x larger (~1.9 GB)
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HIDDEN = 2048
# Qwen3-Next-80B GDN geometry: Hk, Hv, dk, dv
GEOMETRY = dict(num_key_heads=16, num_value_heads=32, key_head_dim=128, value_head_dim=128)
MOE_INTER = 512
SHARD_MB = 470
PYTHON = sys.executable

NAIVE = r"""
import json, os, shutil, sys
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from gdnprune.checkpoint import open_checkpoint, find_gdn_layers
from gdnprune.gated_delta_net import GDNPermutation, gather_gated_delta_net_tensor, gated_delta_net_prefix_indices
src, out, mode, arg = sys.argv[1:5]
ckpt = open_checkpoint(src)
layers, _ = find_gdn_layers(ckpt)
owner = {l.name(s): (l, s) for l in layers for s in l.tensors}
plans = {}
for l in layers:
    if mode == "sort":
        perm = GDNPermutation.from_score_payload(json.load(open(arg))["layers"][l.prefix], l.shape)
        plans[l.prefix] = (l.shape, perm.indices(l.shape))
    else:
        t = l.shape.replace(**json.loads(arg))
        plans[l.prefix] = (t, gated_delta_net_prefix_indices(l.shape, t))
os.makedirs(out)
for shard in ckpt.shards:
    with safe_open(shard.path, "pt") as f:
        metadata = f.metadata()
    sd = load_file(shard.path)
    for k in list(sd):
        if k in owner:
            l, s = owner[k]
            t, idx = plans[l.prefix]
            sd[k] = gather_gated_delta_net_tensor(s, sd[k], layout=l.layout, shape=l.shape, target=t, indices=idx)
    save_file(sd, os.path.join(out, os.path.basename(shard.path)), metadata=metadata)
    del sd
for name in os.listdir(src):
    if not name.endswith(".safetensors"):
        shutil.copy2(os.path.join(src, name), os.path.join(out, name))
"""

API = r"""
import json, sys
from gdnprune.checkpoint import sort_checkpoint, slice_checkpoint
src, out, mode, arg = sys.argv[1:5]
if mode == "sort":
    sort_checkpoint(src, arg, out, progress=False)
else:
    import warnings; warnings.simplefilter("ignore")
    slice_checkpoint(src, out, json.loads(arg), progress=False)
"""


def gdn_tensors(prefix: str, g):
    """One Qwen3-Next GDN layer (fused layout), bf16."""
    import torch

    Hk, Hv, dk, dv = (GEOMETRY[k] for k in ("num_key_heads", "num_value_heads", "key_head_dim", "value_head_dim"))
    shapes = {
        "in_proj_qkvz.weight": (Hk * (2 * dk + 2 * (Hv // Hk) * dv), HIDDEN),
        "in_proj_ba.weight": (2 * Hv, HIDDEN),
        "conv1d.weight": (2 * Hk * dk + Hv * dv, 1, 4),
        "A_log": (Hv,),
        "dt_bias": (Hv,),
        "norm.weight": (dv,),
        "out_proj.weight": (HIDDEN, Hv * dv),
    }
    return {f"{prefix}.{k}": torch.randn(s, generator=g).to(torch.bfloat16) for k, s in shapes.items()}


def filler(prefix: str, nbytes: int):
    """MoE-expert filler tensors (random bits) totalling about ``nbytes``."""
    import torch

    per_expert = 3 * MOE_INTER * HIDDEN * 2
    out = {f"{prefix}.input_layernorm.weight": torch.ones(HIDDEN, dtype=torch.bfloat16),
           f"{prefix}.post_attention_layernorm.weight": torch.ones(HIDDEN, dtype=torch.bfloat16)}
    for e in range(max(1, round(nbytes / per_expert))):
        for name, shape in (("gate_proj", (MOE_INTER, HIDDEN)), ("up_proj", (MOE_INTER, HIDDEN)),
                            ("down_proj", (HIDDEN, MOE_INTER))):
            t = torch.empty(shape[0] * shape[1] * 2, dtype=torch.uint8).random_()
            out[f"{prefix}.mlp.experts.{e}.{name}.weight"] = t.view(torch.bfloat16).view(shape)
    return out


def build(folder: str, layers: int, shard_scale: float, seed: int = 0) -> dict:
    """Write the synthetic checkpoint and a scores file; returns facts about it (run in a child process)."""
    import torch
    from safetensors.torch import save_file

    from gdnprune.gated_delta_net import GDNPermutation, GDNShape

    shape = GDNShape(**GEOMETRY)
    os.makedirs(folder)
    g = torch.Generator().manual_seed(seed)
    weight_map, total, largest = {}, 0, 0
    for i in range(layers):
        name = f"model-{i + 1:05d}-of-{layers:05d}.safetensors"
        gdn = gdn_tensors(f"model.layers.{i}.linear_attn", g)
        gdn_bytes = sum(t.nbytes for t in gdn.values())
        tensors = {**gdn, **filler(f"model.layers.{i}", int(SHARD_MB * 1e6 * shard_scale) - gdn_bytes)}
        save_file(tensors, os.path.join(folder, name), metadata={"format": "pt"})
        weight_map.update({k: name for k in tensors})
        total += sum(t.nbytes for t in tensors.values())
        largest = max(largest, max(t.nbytes for t in tensors.values()))
        del tensors
    with open(os.path.join(folder, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    config = {
        "architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next", "hidden_size": HIDDEN,
        "num_hidden_layers": layers, "layer_types": ["linear_attention"] * layers, "vocab_size": 151936,
        "linear_conv_kernel_dim": 4, "num_experts": 512, "moe_intermediate_size": MOE_INTER,
        **shape.config_updates(),
    }
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    scores = {"layers": {f"model.layers.{i}.linear_attn": GDNPermutation.random(shape, generator=g).to_score_payload()
                         for i in range(layers)}, "note": "random orders (benchmark)"}
    scores_path = folder + ".scores.json"
    with open(scores_path, "w") as f:
        json.dump(scores, f)
    shard = os.path.getsize(os.path.join(folder, f"model-00001-of-{layers:05d}.safetensors"))
    return {"total_bytes": total, "largest_tensor": largest, "shard_bytes": shard, "scores": scores_path,
            "gdn_bytes_per_shard": gdn_bytes}


def run_child(cmd: list[str]) -> tuple[float, int, float, float]:
    """Run ``cmd``; returns (wall s, peak RSS bytes, seconds of the `sync` that follows, CPU s (user + sys))."""
    subprocess.run(["sync"], check=True)
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - start
    proc.returncode = os.waitstatus_to_exitcode(status)
    err = proc.stderr.read().decode(errors="replace")
    proc.stderr.close()
    if proc.returncode != 0:
        raise SystemExit(f"command failed ({proc.returncode}): {' '.join(cmd)}\n{err}")
    start = time.perf_counter()
    subprocess.run(["sync"], check=True)
    return wall, usage.ru_maxrss * 1024, time.perf_counter() - start, usage.ru_utime + usage.ru_stime


def pick_workdir(need: int, requested: str | None) -> str:
    candidates = [requested] if requested else ["/tmp", "/work", os.getcwd()]
    for c in candidates:
        if c and os.path.isdir(c) and shutil.disk_usage(c).free > need * 1.2:
            return tempfile.mkdtemp(prefix="gdnprune-bench-", dir=c)
    raise SystemExit(f"no folder among {candidates} has {need * 1.2 / 1e9:.1f} GB free")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=6, help="GDN layers = shards (default 6; 12 doubles)")
    p.add_argument("--shard-scale", type=float, default=1.0, help="shard size multiplier (4: ~1.9 GB shards)")
    p.add_argument("--rounds", type=int, default=3, help="rounds of all commands (median reported)")
    p.add_argument("--workdir", help="folder for the checkpoint and outputs (default: /tmp or /work, by free space)")
    p.add_argument("--skip-naive", action="store_true", help="leave out the naive baseline")
    p.add_argument("--keep", action="store_true", help="keep the work folder")
    p.add_argument("--build-only", metavar="DIR", help=argparse.SUPPRESS)  # internal: build in a child process
    args = p.parse_args(argv)
    if args.build_only:
        print(json.dumps(build(args.build_only, args.layers, args.shard_scale)))
        return 0

    est = int(args.layers * SHARD_MB * 1e6 * args.shard_scale)
    print(subprocess.run(["df", "-h", "/tmp", "/work"], capture_output=True, text=True).stdout.strip())
    work = pick_workdir(2 * est, args.workdir)
    src, out = os.path.join(work, "model"), os.path.join(work, "out")
    try:
        t0 = time.perf_counter()
        # built in a child process: this process stays small, so that forked children start small
        built = subprocess.run([PYTHON, os.path.abspath(__file__), "--build-only", src, "--layers", str(args.layers),
                                "--shard-scale", str(args.shard_scale)], check=True, capture_output=True, text=True)
        facts = json.loads(built.stdout.strip().splitlines()[-1])
        print(f"built {src}: {args.layers} layers, {facts['total_bytes'] / 1e9:.2f} GB, shard "
              f"{facts['shard_bytes'] / 1e6:.0f} MB ({facts['gdn_bytes_per_shard'] / 1e6:.0f} MB GDN), largest "
              f"tensor {facts['largest_tensor'] / 1e6:.0f} MB, in {time.perf_counter() - t0:.0f} s")
        target = json.dumps({"num_key_heads": 8, "num_value_heads": 16})
        commands = {
            "cp -r": ["cp", "-r", src, out],
            "gdnprune sort": [PYTHON, "-m", "gdnprune", "sort", src, "--scores", facts["scores"], "--output", out,
                              "--quiet"],
            "gdnprune slice": [PYTHON, "-m", "gdnprune", "slice", src, "--output", out, "--num-key-heads", "8",
                               "--num-value-heads", "16", "--quiet"],
            "sort (python API)": [PYTHON, "-c", API, src, out, "sort", facts["scores"]],
            "slice (python API)": [PYTHON, "-c", API, src, out, "slice", target],
        }
        if not args.skip_naive:
            commands["naive sort"] = [PYTHON, "-c", NAIVE, src, out, "sort", facts["scores"]]
        subprocess.run(["cat", *[os.path.join(src, f) for f in os.listdir(src)]], stdout=subprocess.DEVNULL)
        results: dict[str, list] = {k: [] for k in commands}
        for r in range(args.rounds):
            for name, cmd in commands.items():
                shutil.rmtree(out, ignore_errors=True)
                results[name].append(run_child(cmd))
                wall, rss, sync, cpu = results[name][-1]
                print(f"round {r + 1} {name:20s} {wall:7.2f} s  {rss / 2**20:7.0f} MiB  (+sync {sync:.2f} s, "
                      f"cpu {cpu:.2f} s)", flush=True)
            shutil.rmtree(out, ignore_errors=True)

        med = {k: (statistics.median(r[0] for r in v), max(r[1] for r in v), statistics.median(r[0] + r[2] for r in v),
                   statistics.median(r[3] for r in v)) for k, v in results.items()}
        cp_wall, _, cp_sync, cp_cpu = med["cp -r"]
        rss_target = facts["largest_tensor"] + 2**30
        print()
        print(f"checkpoint: {args.layers} layers, {facts['total_bytes'] / 1e9:.2f} GB, shards "
              f"{facts['shard_bytes'] / 1e6:.0f} MB, largest tensor {facts['largest_tensor'] / 1e6:.0f} MB; "
              f"median of {args.rounds} rounds")
        print(f"{'command':20s} {'wall s':>7s} {'x cp':>6s} {'+sync s':>8s} {'x cp':>6s} {'cpu s':>6s} "
              f"{'peak RSS MiB':>13s} {'/ target':>9s} {'/ shard':>8s}")
        for name, (wall, rss, with_sync, cpu) in med.items():
            print(f"{name:20s} {wall:7.2f} {wall / cp_wall:6.2f} {with_sync:8.2f} {with_sync / cp_sync:6.2f} "
                  f"{cpu:6.2f} {rss / 2**20:13.0f} {rss / rss_target:9.2f} {rss / facts['shard_bytes']:8.2f}")
        print(f"targets: wall <= 1.3 x cp -r; peak RSS <= largest tensor + 1 GiB = {rss_target / 2**20:.0f} MiB")
    finally:
        if args.keep:
            print(f"kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
