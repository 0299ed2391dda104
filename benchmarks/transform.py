"""Streaming sort and slice of a checkpoint take about as long as `cp -r` of it, in 60-110 MiB, 6x faster than a naive load/gather/save.

The benchmark of streaming checkpoint surgery against `cp -r` and a naive load/gather/save baseline.

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

Rounds alternate the commands: one of each per round, in a new order every round (a Williams design:
over as many rounds as there are commands, each command directly follows each other one once). Wall time, CPU time,
peak RSS and the bytes each command made the kernel write (``ru_oublock``: after reflinks, only what was
not shared) come from ``os.wait4`` of each child. Untimed, between commands: ``sync`` (reported, so that
one command's write-back does not land in the next one's time; ``+sync`` = command plus that write-back)
and, after it, the bytes of the output that the file system does not share with the source (FIEMAP
extents, read with ``filefrag``). On this VM the same command varies by up to 4x between rounds: memory
that stays free for a few seconds goes back to the host (free page reporting), and whoever allocates it
next pays for the host to fault it in again (a command that needs more page cache than the one before it
freed, a sort after a slice, ran up to 3x slower); the order design spreads that evenly over the
commands. Compare medians, and ratios of one run.

The tables give medians over the rounds and, as ``best``, each command's fastest round (the one least
disturbed), with ratios to ``cp -r``'s.

Around every command the benchmark measures how much CPU the machine's other processes used (their user
and system time, from ``/proc``): a round is *calm* when they used less than ``--calm`` cores (default
0.25) during its commands. The calm rounds are reported first (medians and ratios to ``cp -r`` of the
same rounds), then the busy ones, then all, each with its load. On a busy machine ``cp`` (one thread)
loses more than gdnprune's two threads, which flatters the ratio: compare calm rounds. ``--wait-calm S``
waits up to S seconds for a calm machine before each round.

``--fs xfs`` runs everything on a sparse loop-mounted XFS image formatted with ``reflink=1`` (root and
``mkfs.xfs``, Debian package xfsprogs), against ``cp -r --reflink=auto``: there the unchanged bytes are
shared, not copied.

``--fp8`` stores ``in_proj_qkvz`` and ``out_proj`` as Qwen's FP8 releases do (``float8_e4m3fn``, one float32
``weight_scale_inv`` per 128 x 128 block, ``quantization_config``): sort and the whole-head slice then
gather FP8 bytes and scale rows together.

    python benchmarks/transform.py                  # 6 layers, ~470 MB shards (~2.8 GB), 5 rounds
    python benchmarks/transform.py --fs xfs         # the same on XFS with reflinks
    python benchmarks/transform.py --layers 12      # twice the layers
    python benchmarks/transform.py --shard-scale 4  # shards 4x larger (~1.9 GB)
    python benchmarks/transform.py --fp8            # FP8 GDN projections
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
    slice_checkpoint(src, out, target=json.loads(arg), progress=False)
"""


FP8_BLOCK = 128
FP8_PROJECTIONS = ("in_proj_qkvz.weight", "out_proj.weight")  # FP8 in Qwen's releases; the rest stays BF16


def fp8_blocks(weight):
    """Block-scaled FP8 as Qwen's FP8 releases store it: ``float8_e4m3fn`` weight, float32 ``weight_scale_inv``
    (amax / 448 of each 128 x 128 block)."""
    import torch

    rows, cols = weight.shape
    blocks = weight.float().reshape(rows // FP8_BLOCK, FP8_BLOCK, cols // FP8_BLOCK, FP8_BLOCK)
    scale = blocks.abs().amax(dim=(1, 3)).clamp_min(1e-12) / 448.0
    return (blocks / scale[:, None, :, None]).reshape(rows, cols).to(torch.float8_e4m3fn), scale


def gdn_tensors(prefix: str, g, fp8: bool = False):
    """One Qwen3-Next GDN layer (fused layout), bf16; with ``fp8`` its two large projections block-scaled FP8."""
    import torch

    Hk, Hv, dk, dv = (
        GEOMETRY[k] for k in ("num_key_heads", "num_value_heads", "key_head_dim", "value_head_dim")
    )
    shapes = {
        "in_proj_qkvz.weight": (Hk * (2 * dk + 2 * (Hv // Hk) * dv), HIDDEN),
        "in_proj_ba.weight": (2 * Hv, HIDDEN),
        "conv1d.weight": (2 * Hk * dk + Hv * dv, 1, 4),
        "A_log": (Hv,),
        "dt_bias": (Hv,),
        "norm.weight": (dv,),
        "out_proj.weight": (HIDDEN, Hv * dv),
    }
    out = {f"{prefix}.{k}": torch.randn(s, generator=g).to(torch.bfloat16) for k, s in shapes.items()}
    for name in FP8_PROJECTIONS if fp8 else ():
        out[f"{prefix}.{name}"], out[f"{prefix}.{name}_scale_inv"] = fp8_blocks(out[f"{prefix}.{name}"])
    return out


def filler(prefix: str, nbytes: int):
    """MoE-expert filler tensors (random bits) totalling about ``nbytes``."""
    import torch

    per_expert = 3 * MOE_INTER * HIDDEN * 2
    out = {
        f"{prefix}.input_layernorm.weight": torch.ones(HIDDEN, dtype=torch.bfloat16),
        f"{prefix}.post_attention_layernorm.weight": torch.ones(HIDDEN, dtype=torch.bfloat16),
    }
    for e in range(max(1, round(nbytes / per_expert))):
        for name, shape in (
            ("gate_proj", (MOE_INTER, HIDDEN)),
            ("up_proj", (MOE_INTER, HIDDEN)),
            ("down_proj", (HIDDEN, MOE_INTER)),
        ):
            t = torch.empty(shape[0] * shape[1] * 2, dtype=torch.uint8).random_()
            out[f"{prefix}.mlp.experts.{e}.{name}.weight"] = t.view(torch.bfloat16).view(shape)
    return out


def build(folder: str, layers: int, shard_scale: float, fp8: bool = False, seed: int = 0) -> dict:
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
        gdn = gdn_tensors(f"model.layers.{i}.linear_attn", g, fp8)
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
        "architectures": ["Qwen3NextForCausalLM"],
        "model_type": "qwen3_next",
        "hidden_size": HIDDEN,
        "num_hidden_layers": layers,
        "layer_types": ["linear_attention"] * layers,
        "vocab_size": 151936,
        "linear_conv_kernel_dim": 4,
        "num_experts": 512,
        "moe_intermediate_size": MOE_INTER,
        **shape.config_updates(),
    }
    if fp8:
        config["quantization_config"] = {
            "quant_method": "fp8",
            "fmt": "e4m3",
            "activation_scheme": "dynamic",
            "weight_block_size": [FP8_BLOCK, FP8_BLOCK],
            "modules_to_not_convert": ["lm_head", "mlp.gate", "in_proj_ba"],
        }
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    scores = {
        "layers": {
            f"model.layers.{i}.linear_attn": GDNPermutation.random(shape, generator=g).to_score_payload()
            for i in range(layers)
        },
        "note": "random orders (benchmark)",
    }
    scores_path = folder + ".scores.json"
    with open(scores_path, "w") as f:
        json.dump(scores, f)
    shard = os.path.getsize(os.path.join(folder, f"model-00001-of-{layers:05d}.safetensors"))
    return {
        "total_bytes": total,
        "largest_tensor": largest,
        "shard_bytes": shard,
        "scores": scores_path,
        "gdn_bytes_per_shard": gdn_bytes,
    }


def others_cpu() -> float:
    """CPU seconds used so far by every user process but this one (and its reaped children): user and system
    time of each, plus that of its reaped children, so that a process that ends between two readings still
    counts through its parent. Kernel threads (write-back, loop devices) are left out: their work is ours."""
    total, me = 0, os.getpid()
    for pid in os.listdir("/proc"):
        if not pid.isdigit() or int(pid) == me:
            continue
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:  # gone meanwhile
            continue
        if int(fields[6]) & 0x00200000:  # PF_KTHREAD
            continue
        total += sum(int(x) for x in fields[11:15])  # utime, stime, cutime, cstime
    return total / os.sysconf("SC_CLK_TCK")


def unshared_bytes(folder: str) -> int | None:
    """Bytes of the files under ``folder`` in extents that the file system does not mark as shared (FIEMAP,
    read with ``filefrag``; None without it): what a copy really wrote to disk."""
    if not shutil.which("filefrag"):
        return None
    paths = [os.path.join(d, f) for d, _, files in os.walk(folder) for f in files]
    out = subprocess.run(["filefrag", "-v", "-b1", *paths], capture_output=True, text=True, check=True).stdout
    total = 0
    for line in out.splitlines():
        fields = [f.strip() for f in line.split(":")]
        if len(fields) >= 5 and fields[0].isdigit() and "shared" not in fields[-1]:
            total += int(fields[3])
    return total


def run_child(cmd: list[str], out: str) -> dict:
    """Run ``cmd`` (which writes ``out``) between two ``sync`` calls. Returns wall s, peak RSS, the `sync`
    that follows, the child's CPU s, the bytes it dirtied (``ru_oublock``: what it made the kernel write,
    after reflinks), the bytes of its output not shared with the source (FIEMAP), the 1-minute load average
    before it, and the CPU that everything else on the machine used meanwhile (in cores: the load the run
    competed with)."""
    subprocess.run(["sync"], check=True)
    load, others = os.getloadavg()[0], others_cpu()
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - start
    others = others_cpu() - others
    proc.returncode = os.waitstatus_to_exitcode(status)
    err = proc.stderr.read().decode(errors="replace")
    proc.stderr.close()
    if proc.returncode != 0:
        raise SystemExit(f"command failed ({proc.returncode}): {' '.join(cmd)}\n{err}")
    cpu = usage.ru_utime + usage.ru_stime
    start = time.perf_counter()
    subprocess.run(["sync"], check=True)
    return {
        "wall": wall,
        "rss": usage.ru_maxrss * 1024,
        "sync": time.perf_counter() - start,
        "cpu": cpu,
        "written": usage.ru_oublock * 512,
        "unshared": unshared_bytes(out),
        "load": load,
        "others_cpu": max(0.0, others),
        "others": max(0.0, others) / wall,
    }


def wait_until_calm(limit: float, seconds: float) -> None:
    """Wait (at most ``seconds``) until the other processes use less than ``limit`` cores over 2 s."""
    deadline = time.time() + seconds
    while time.time() < deadline:
        others = others_cpu()
        time.sleep(2)
        if (others_cpu() - others) / 2 < limit:
            return


class XFSImage:
    """A sparse file formatted as XFS with reflinks (``mkfs.xfs -m reflink=1``) and loop-mounted (root)."""

    def __init__(self, where: str, size: int):
        self.image, self.mount = os.path.join(where, "xfs.img"), os.path.join(where, "xfs")
        with open(self.image, "wb") as f:
            f.truncate(size)
        os.makedirs(self.mount)
        for cmd in (
            ["mkfs.xfs", "-q", "-m", "reflink=1", self.image],
            ["mount", "-o", "loop", self.image, self.mount],
        ):
            try:
                done = subprocess.run(cmd, capture_output=True, text=True)
            except FileNotFoundError:
                raise SystemExit(f"--fs xfs needs {cmd[0]} (Debian: apt-get install xfsprogs)") from None
            if done.returncode:
                raise SystemExit(
                    f"--fs xfs: {' '.join(cmd)} failed (root and loop devices needed): {done.stderr}"
                )

    def close(self) -> None:
        subprocess.run(["umount", self.mount], check=False)


def pick_workdir(need: int, requested: str | None) -> str:
    candidates = [requested] if requested else ["/tmp", "/work", os.getcwd()]
    for c in candidates:
        if c and os.path.isdir(c) and shutil.disk_usage(c).free > need * 1.2:
            return tempfile.mkdtemp(prefix="gdnprune-bench-", dir=c)
    raise SystemExit(f"no folder among {candidates} has {need * 1.2 / 1e9:.1f} GB free")


def williams_order(names: list, r: int) -> list:
    """Round ``r`` of a Williams design: over ``len(names)`` rounds (an even number), every command directly
    follows every other one exactly once, so no command always comes after the same one."""
    n = len(names)
    first = [0] + [i // 2 + 1 if i % 2 == 0 else n - (i + 1) // 2 for i in range(n - 1)]
    return [names[(x + r) % n] for x in first]


def others_cores(round_: dict) -> float:
    """Cores the other processes used during a round's commands (over all of them: a 10 ms command alone
    sees whole clock ticks)."""
    return sum(r["others_cpu"] for r in round_.values()) / sum(r["wall"] for r in round_.values())


def table(title: str, rounds: list[dict], names: list[str]) -> None:
    """Medians over ``rounds`` (each: command -> run_child result), ratios to ``names[0]`` (`cp -r`) of the
    same rounds."""
    med = {
        k: {m: statistics.median(r[k][m] for r in rounds) for m in ("wall", "sync", "cpu", "written")}
        for k in names
    }
    for k in names:
        med[k]["best"] = min(r[k]["wall"] for r in rounds)
        med[k]["with_sync"] = statistics.median(r[k]["wall"] + r[k]["sync"] for r in rounds)
        med[k]["rss"] = max(r[k]["rss"] for r in rounds)
        med[k]["unshared"] = statistics.median(r[k]["unshared"] or 0 for r in rounds)
    cp = med[names[0]]
    loads = [r[k]["load"] for r in rounds for k in names]
    others = [others_cores(r) for r in rounds]
    print(
        f"\n{title}: median of {len(rounds)} rounds; 1-min load average {min(loads):.2f}-{max(loads):.2f}, "
        f"other processes used {min(others):.2f}-{max(others):.2f} cores (per round)"
    )
    print(
        f"{'command':22s} {'wall s':>7s} {'x cp':>6s} {'best s':>7s} {'x cp':>6s} {'+sync':>6s} {'x cp':>6s} "
        f"{'cpu s':>6s} {'RSS MiB':>8s} {'written MB':>11s} {'unshared MB':>12s}"
    )
    for k in names:
        m = med[k]
        print(
            f"{k:22s} {m['wall']:7.2f} {m['wall'] / cp['wall']:6.2f} {m['best']:7.2f} {m['best'] / cp['best']:6.2f} "
            f"{m['with_sync']:6.2f} "
            f"{m['with_sync'] / cp['with_sync']:6.2f} {m['cpu']:6.2f} {m['rss'] / 2**20:8.0f} "
            f"{m['written'] / 1e6:11.0f} {m['unshared'] / 1e6:12.0f}"
        )
    per_round = "; ".join(
        " ".join(f"{r[k]['wall'] / r[names[0]]['wall']:.2f}" for k in names[1:]) for r in rounds
    )
    print(f"per round, x {names[0]} ({', '.join(names[1:])}): {per_round}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=6, help="GDN layers = shards (default 6; 12 doubles)")
    p.add_argument("--shard-scale", type=float, default=1.0, help="shard size multiplier (4: ~1.9 GB shards)")
    p.add_argument(
        "--rounds", type=int, default=5, help="rounds of all commands, alternating (medians reported)"
    )
    p.add_argument(
        "--fs",
        choices=("default", "xfs"),
        default="default",
        help="xfs: run on a loop-mounted XFS image with reflinks (root, xfsprogs), against "
        "`cp -r --reflink=auto`",
    )
    p.add_argument(
        "--calm",
        type=float,
        default=0.25,
        metavar="CORES",
        help="a round is calm when other processes used less than this many cores during its commands "
        "(default 0.25)",
    )
    p.add_argument(
        "--wait-calm",
        type=float,
        default=0,
        metavar="S",
        help="before each round, wait up to S seconds for the machine to be calm",
    )
    p.add_argument(
        "--workdir", help="folder for the checkpoint and outputs (default: /tmp or /work, by free space)"
    )
    p.add_argument(
        "--fp8",
        action="store_true",
        help="FP8 checkpoint: in_proj_qkvz and out_proj block-scaled float8_e4m3fn with weight_scale_inv, as "
        "in Qwen's FP8 releases (the naive baseline, which knows no scales, is left out)",
    )
    p.add_argument("--skip-naive", action="store_true", help="leave out the naive baseline")
    p.add_argument("--skip-api", action="store_true", help="leave out the Python API commands")
    p.add_argument("--keep", action="store_true", help="keep the work folder")
    p.add_argument(
        "--build-only", metavar="DIR", help=argparse.SUPPRESS
    )  # internal: build in a child process
    args = p.parse_args(argv)
    if args.build_only:
        print(json.dumps(build(args.build_only, args.layers, args.shard_scale, args.fp8)))
        return 0

    est = int(args.layers * SHARD_MB * 1e6 * args.shard_scale)
    print(subprocess.run(["df", "-h", "/tmp", "/work"], capture_output=True, text=True).stdout.strip())
    work = pick_workdir(2 * est, args.workdir)
    xfs = None
    try:
        if args.fs == "xfs":
            xfs = XFSImage(work, max(int(2.5 * est), 400 << 20))
            print(
                f"XFS image {xfs.image} ({max(int(2.5 * est), 400 << 20) / 1e9:.1f} GB, sparse) mounted on {xfs.mount}"
            )
        base = xfs.mount if xfs else work
        src, out = os.path.join(base, "model"), os.path.join(base, "out")
        t0 = time.perf_counter()
        # built in a child process: this process stays small, so that forked children start small
        built = subprocess.run(
            [
                PYTHON,
                os.path.abspath(__file__),
                "--build-only",
                src,
                "--layers",
                str(args.layers),
                "--shard-scale",
                str(args.shard_scale),
                *(["--fp8"] if args.fp8 else []),
            ],
            check=True,
            capture_output=True,
            text=True,
        )
        facts = json.loads(built.stdout.strip().splitlines()[-1])
        print(
            f"built {src}: {'FP8, ' if args.fp8 else ''}{args.layers} layers, {facts['total_bytes'] / 1e9:.2f} GB, shard "
            f"{facts['shard_bytes'] / 1e6:.0f} MB ({facts['gdn_bytes_per_shard'] / 1e6:.0f} MB GDN), largest "
            f"tensor {facts['largest_tensor'] / 1e6:.0f} MB, in {time.perf_counter() - t0:.0f} s"
        )
        target = json.dumps({"num_key_heads": 8, "num_value_heads": 16})
        cp = ["cp", "-r", "--reflink=auto", src, out] if xfs else ["cp", "-r", src, out]
        commands = {
            " ".join(cp[:-2]): cp,
            "gdnprune sort": [
                PYTHON,
                "-m",
                "gdnprune",
                "sort",
                src,
                "--scores",
                facts["scores"],
                "--output",
                out,
                "--quiet",
            ],
            "gdnprune slice": [
                PYTHON,
                "-m",
                "gdnprune",
                "slice",
                src,
                "--output",
                out,
                "--num-key-heads",
                "8",
                "--num-value-heads",
                "16",
                "--quiet",
            ],
        }
        if not args.skip_api:
            commands["sort (python API)"] = [PYTHON, "-c", API, src, out, "sort", facts["scores"]]
            commands["slice (python API)"] = [PYTHON, "-c", API, src, out, "slice", target]
        if not (args.skip_naive or args.fp8):
            commands["naive sort"] = [PYTHON, "-c", NAIVE, src, out, "sort", facts["scores"]]
        rounds = []
        for r in range(args.rounds):
            if args.wait_calm:
                wait_until_calm(args.calm, args.wait_calm)
            # page-cached: read the source (this machine pages out what has not been used for a minute)
            subprocess.run(
                ["cat", *[os.path.join(src, f) for f in os.listdir(src)]], stdout=subprocess.DEVNULL
            )
            rounds.append({})
            for name in williams_order(list(commands), r):
                shutil.rmtree(out, ignore_errors=True)
                res = rounds[-1][name] = run_child(commands[name], out)
                print(
                    f"round {r + 1} {name:22s} {res['wall']:7.2f} s  {res['rss'] / 2**20:5.0f} MiB  cpu "
                    f"{res['cpu']:5.2f} s  +sync {res['sync']:.2f} s  written {res['written'] / 1e6:6.0f} MB  unshared "
                    f"{(res['unshared'] or 0) / 1e6:6.0f} MB  load {res['load']:.2f}  others {res['others']:.2f} cores",
                    flush=True,
                )
        shutil.rmtree(out, ignore_errors=True)

        print(
            f"\ncheckpoint: {args.layers} layers, {facts['total_bytes'] / 1e9:.2f} GB, shards "
            f"{facts['shard_bytes'] / 1e6:.0f} MB, largest tensor {facts['largest_tensor'] / 1e6:.0f} MB"
            f"{', GDN projections FP8 (128 x 128 blocks)' if args.fp8 else ''}; "
            f"file system: {'XFS (reflink=1, loop)' if xfs else 'that of ' + work}; {os.cpu_count()} CPUs"
        )
        calm = [r for r in rounds if others_cores(r) < args.calm]
        busy = [r for r in rounds if r not in calm]
        if calm:
            table(f"calm rounds (other processes < {args.calm} cores)", calm, list(commands))
        else:
            print(f"\nno calm round (other processes used less than {args.calm} cores during none)")
        if busy:
            table("busy rounds", busy, list(commands))
        table("all rounds", rounds, list(commands))
        print("targets: wall <= 1.2 x cp on a calm machine, <= 0.8 x on a busy one; peak RSS <= 256 MiB")
    finally:
        if xfs:
            shutil.rmtree(os.path.join(xfs.mount, "out"), ignore_errors=True)
            xfs.close()
        if args.keep:
            print(f"kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
