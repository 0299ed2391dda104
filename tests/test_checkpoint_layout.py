"""The output layout of the streaming engine and its copy paths.

Every output shard keeps the source's tensor order; the header is padded (spaces) so that the unchanged
tensors keep their source offsets modulo the block size (a file system with reflinks can then share them).
A sort keeps the source layout exactly. GDN rows are copied in the kernel when their runs are long and
read and written with vectored writes when they are short; both paths must give the same bytes. On a
loop-mounted XFS image with reflinks (root only), a sort must share every unchanged block.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct
import subprocess
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from safetensors import safe_open

from gdnprune.checkpoint import engine, slice_checkpoint, sort_checkpoint, transform_checkpoint
from gdnprune.checkpoint.engine import InputChangedError
from gdnprune.io import safetensors_io
from gdnprune.io.safetensors_io import BLOCK, copy_range, read_header

HIDDEN = 512  # BF16 rows of 1 KiB
GDN = {
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "linear_conv_kernel_dim": 4,
}
TARGET = {"num_key_heads": 1, "num_value_heads": 2}


def _gdn(prefix: str) -> dict[str, tuple[int, ...]]:
    """A Qwen3-Next layer (fused in_proj_qkvz / in_proj_ba), in the order safetensors writes names."""
    hk, hv, dk, dv = 2, 4, 16, 16
    conv = 2 * hk * dk + hv * dv
    return {
        f"{prefix}.A_log": (hv,),
        f"{prefix}.conv1d.weight": (conv, 1, 4),
        f"{prefix}.dt_bias": (hv,),
        f"{prefix}.in_proj_ba.weight": (2 * hv, HIDDEN),
        f"{prefix}.in_proj_qkvz.weight": (hk * (2 * dk + 2 * (hv // hk) * dv), HIDDEN),
        f"{prefix}.norm.weight": (dv,),
        f"{prefix}.out_proj.weight": (HIDDEN, hv * dv),
    }


def build_wide(folder: Path, pad: int = 0) -> Path:
    """Two shards laid out as Hugging Face writes them: [norm][GDN layer][MLP experts (40 KiB each)][norm];
    the second also holds a full-attention layer. ``pad`` extra header bytes move every source offset."""
    rng = np.random.Generator(np.random.PCG64(5))
    shards = []
    for layer, attention in ((0, None), (2, 1)):
        shapes = {}
        if attention is not None:
            shapes[f"model.layers.{attention}.self_attn.q_proj.weight"] = (HIDDEN, 36)
        shapes[f"model.layers.{layer}.input_layernorm.weight"] = (HIDDEN,)
        shapes.update(_gdn(f"model.layers.{layer}.linear_attn"))
        for e in range(3):
            shapes[f"model.layers.{layer}.mlp.experts.{e}.down_proj.weight"] = (HIDDEN, 40)
        shapes[f"model.layers.{layer}.post_attention_layernorm.weight"] = (HIDDEN,)
        shards.append(shapes)
    folder.mkdir(parents=True)
    weight_map = {}
    for i, shapes in enumerate(shards, start=1):
        name = f"model-{i:05d}-of-00002.safetensors"
        header, blobs, offset = {"__metadata__": {"format": "pt"}}, [], 0
        for tensor, shape in shapes.items():
            data = rng.integers(0x3C00, 0x4100, size=shape, dtype=np.uint16).tobytes()
            header[tensor] = {
                "dtype": "BF16",
                "shape": list(shape),
                "data_offsets": [offset, offset + len(data)],
            }
            blobs.append(data)
            offset += len(data)
            weight_map[tensor] = name
        text = json.dumps(header, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8 + pad)
        (folder / name).write_bytes(struct.pack("<Q", len(text)) + text + b"".join(blobs))
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map})
    )
    config = {
        "model_type": "qwen3_next",
        "hidden_size": HIDDEN,
        "num_hidden_layers": 3,
        "vocab_size": 32,
        "layer_types": ["linear_attention", "full_attention", "linear_attention"],
        **GDN,
    }
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def random_scores(seed: int = 3) -> dict:
    rng = np.random.Generator(np.random.PCG64(seed))
    return {
        "layers": {
            f"model.layers.{i}.linear_attn": {
                "key_group_order_most_important_first": rng.permutation(2).tolist(),
                "value_lane_order_most_important_first": [rng.permutation(2).tolist() for _ in range(2)],
                "key_dim_order_most_important_first": [rng.permutation(16).tolist() for _ in range(2)],
                "value_dim_order_most_important_first": rng.permutation(16).tolist(),
            }
            for i in (0, 2)
        }
    }


def tensors(path: Path) -> dict[str, bytes]:
    with safe_open(path, "np") as f:  # safetensors' own reader checks the header and the offsets
        names = list(f.keys())
    header = read_header(path)
    data = path.read_bytes()
    assert set(names) == set(header.tensors)
    return {t.name: data[t.start : t.end] for t in header.tensors.values()}


def digest(folder: Path) -> str:
    h = hashlib.sha256()
    for p in sorted(folder.glob("*.safetensors")):
        h.update(p.read_bytes())
    return h.hexdigest()


@pytest.mark.parametrize("pad", [0, 8, 1000])
def test_a_sort_keeps_the_source_layout(tmp_path, pad):
    src = build_wide(tmp_path / "src", pad)
    sort_checkpoint(src, random_scores(), tmp_path / "out", progress=False)
    for path in sorted(src.glob("*.safetensors")):
        a, b = read_header(path), read_header(tmp_path / "out" / path.name)
        assert b.data_start % BLOCK == a.data_start % BLOCK and b.data_start % 8 == 0
        assert [(t.name, t.start - a.data_start, t.end - a.data_start) for t in a.tensors.values()] == [
            (t.name, t.start - b.data_start, t.end - b.data_start) for t in b.tensors.values()
        ]
        before, after = tensors(path), tensors(tmp_path / "out" / path.name)
        changed = {n for n in before if before[n] != after[n]}
        assert changed and all(".linear_attn." in n for n in changed)


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_a_slice_keeps_the_largest_unchanged_run_at_its_block_offset(tmp_path):
    src = build_wide(tmp_path / "src", pad=24)
    slice_checkpoint(src, tmp_path / "out", TARGET, progress=False)
    for path in sorted(src.glob("*.safetensors")):
        a, b = read_header(path), read_header(tmp_path / "out" / path.name)
        raw = (tmp_path / "out" / path.name).read_bytes()[8 : b.data_start]
        assert b.data_start % 8 == 0 and raw.rstrip(b" ").endswith(b"}") and b" " * 64 in raw  # padded
        experts = [n for n in a.tensors if ".mlp." in n]
        assert all((b.tensors[n].start - a.tensors[n].start) % BLOCK == 0 for n in experts)
        assert list(a.tensors) == list(b.tensors)  # the source's order
        before, after = tensors(path), tensors(tmp_path / "out" / path.name)
        assert all(before[n] == after[n] for n in before if ".linear_attn." not in n)


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("operation", ["slice", "sort+slice"])
def test_kernel_copies_and_vectored_writes_give_the_same_rows(tmp_path, monkeypatch, operation):
    """A slice keeps whole heads (runs of 96 rows of 1 KiB, copied in the kernel); force both row paths."""
    src = build_wide(tmp_path / "src")
    kwargs = dict(
        target=TARGET,
        operation="prune",
        progress=False,
        permutations=random_scores()["layers"] if operation == "sort+slice" else None,
    )
    calls = []
    real = engine._copy
    monkeypatch.setattr(engine, "_copy", lambda *args: calls.append(args) or real(*args))
    results = {}
    for threshold in (0, 1 << 40):
        monkeypatch.setattr(engine, "_KERNEL_RUN", threshold)
        out = tmp_path / f"out{threshold}"
        transform_checkpoint(src, out, **kwargs)
        results[threshold] = digest(out)
    assert results[0] == results[1 << 40]
    assert any(
        len(c) == 4 for c in calls
    )  # GDN rows copied in the kernel (the unchanged bytes pass on_chunk)


def test_two_threads_share_the_unchanged_bytes_of_large_shards(tmp_path, monkeypatch):
    """Once its GDN jobs are done the worker copies unchanged pieces from the back of the shards; each piece
    is copied once, by one thread, and the output does not depend on who copied what."""
    src = build_wide(tmp_path / "src")
    sort_checkpoint(
        src, random_scores(), tmp_path / "alone", progress=False
    )  # small shards: the main thread alone
    monkeypatch.setattr(engine, "_SHARE_MIN", 0)
    monkeypatch.setattr(engine, "_PIECE", BLOCK)
    pieces, main_copied = [], threading.Event()
    real = engine._copy

    def slow_main_thread(src_fd, dst_fd, path, piece, on_chunk=None):
        pieces.append((threading.current_thread().name, path, piece))
        if on_chunk is None:  # the worker's: not before the main thread has begun
            main_copied.wait(timeout=30)
        else:  # the main thread's, slowed down
            main_copied.set()
            time.sleep(0.005)
        return real(src_fd, dst_fd, path, piece, on_chunk)

    monkeypatch.setattr(engine, "_copy", slow_main_thread)
    sort_checkpoint(src, random_scores(), tmp_path / "shared", progress=False)
    assert digest(tmp_path / "shared") == digest(tmp_path / "alone")
    threads = {name for name, _, _ in pieces}
    assert threads == {"MainThread", "gdnprune-gdn"}
    copied = sorted((path, piece) for _, path, piece in pieces)
    assert len(copied) == len(set(copied))  # no piece twice
    for path in sorted(src.glob("*.safetensors")):
        unchanged = sum(t.nbytes for t in read_header(path).tensors.values() if ".linear_attn." not in t.name)
        assert sum(piece[2] for p, piece in copied if p == str(path)) == unchanged


@pytest.mark.parametrize(
    "threshold,cut_at",
    [(0, "conv1d"), (1 << 40, "conv1d"), (1 << 40, "experts")],
    ids=["kernel row copies", "reads", "shared unchanged copies"],
)
def test_a_shard_truncated_under_the_gdn_work_gives_a_clear_error(tmp_path, monkeypatch, threshold, cut_at):
    from gdnprune.checkpoint import find_gdn_layers, open_checkpoint
    from gdnprune.model.targets import resolve_target

    monkeypatch.setattr(engine, "_KERNEL_RUN", threshold)
    monkeypatch.setattr(engine, "_SHARE_MIN", 0)  # the worker copies unchanged pieces after its jobs
    monkeypatch.setattr(engine, "_PIECE", BLOCK)
    ckpt = open_checkpoint(build_wide(tmp_path / "src"))
    layers, _ = find_gdn_layers(ckpt)
    plans = {
        layer.prefix: engine.plan_layer(layer, resolve_target(layer.shape, TARGET), None) for layer in layers
    }
    (tmp_path / "out").mkdir()
    shards = engine.plan_shards(
        ckpt, {layer.name(s) for layer in layers for s in layer.tensors}, tmp_path / "out"
    )
    work = engine.GDNWork(ckpt, shards, plans)
    cut = {
        "conv1d": "model.layers.2.linear_attn.conv1d.weight",
        "experts": "model.layers.2.mlp.experts.1.down_proj.weight",
    }
    with open(ckpt.shards[-1].path, "r+b") as f:  # after the headers were read (the GDN tensors come before)
        f.truncate(ckpt.tensor(cut[cut_at]).end)
    with pytest.raises(InputChangedError, match="input changed while reading"):
        work.run()


@pytest.mark.parametrize(
    "index",
    [
        np.random.default_rng(0).permutation(64),  # single columns
        np.concatenate([np.arange(h * 16, h * 16 + 16) for h in (3, 0, 2)]),  # whole heads of 16
        np.concatenate([np.arange(h * 16, h * 16 + 8) for h in (1, 2)]),  # half heads: blocks of 8
        np.arange(10, 30),  # one run, unaligned start
    ],
)
def test_block_gathers_equal_numpy_take(index):
    array = np.random.default_rng(1).integers(0, 2**16, size=(5, 64), dtype=np.uint16)
    out = np.empty((5, index.size), dtype=np.uint16)
    assert np.array_equal(engine._take_blocks(array, index, 1, out), np.take(array, index, axis=1))


def test_copies_start_at_block_boundaries_after_the_first(tmp_path, monkeypatch):
    payload = os.urandom(5 * BLOCK + 123)
    (tmp_path / "src").write_bytes(payload)
    calls = []
    real = os.copy_file_range
    monkeypatch.setattr(os, "copy_file_range", lambda *a: calls.append(a[2:]) or real(*a))
    monkeypatch.setattr(safetensors_io, "_CHUNK", 2 * BLOCK)
    with open(tmp_path / "src", "rb") as fin, open(tmp_path / "dst", "wb") as fout:
        copy_range(fin.fileno(), fout.fileno(), 100, len(payload) - 100, dst_offset=BLOCK + 100)
        fout.seek(0, os.SEEK_END)
        copy_range(fin.fileno(), fout.fileno(), 0, 10)  # at the current position, which then moves on
        assert fout.tell() == len(payload) + BLOCK + 10
    assert (tmp_path / "dst").read_bytes()[BLOCK + 100 :] == payload[100:] + payload[:10]
    offsets = [(src, dst) for _, src, dst in calls[:-1]]
    assert [c[0] for c in calls[:-1]] == [BLOCK - 100, 2 * BLOCK, 2 * BLOCK, 123]
    assert all(src % BLOCK == 0 and dst == src + BLOCK for src, dst in offsets[1:])


# ---- reflinks: a loop-mounted XFS image (root only) ---------------------------------------------------------


@pytest.fixture
def xfs(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("the reflink test loop-mounts an XFS image: needs root")
    if not shutil.which("mkfs.xfs") or not shutil.which("filefrag"):
        pytest.skip(
            "the reflink test needs mkfs.xfs (xfsprogs) and filefrag (e2fsprogs); "
            f"missing: {[t for t in ('mkfs.xfs', 'filefrag') if not shutil.which(t)]}"
        )
    image, mount = tmp_path / "xfs.img", tmp_path / "mnt"
    with open(image, "wb") as f:
        f.truncate(320 << 20)  # sparse; mkfs.xfs needs at least 300 MB
    mount.mkdir()
    for step in (
        ["mkfs.xfs", "-q", "-m", "reflink=1", str(image)],
        ["mount", "-o", "loop", str(image), str(mount)],
    ):
        done = subprocess.run(step, capture_output=True, text=True)
        if done.returncode:
            pytest.skip(
                f"the reflink test cannot run {step[0]} here (exit {done.returncode}: "
                f"{' '.join(done.stderr.split())[:120]})"
            )
    try:
        yield mount
    finally:
        subprocess.run(["umount", str(mount)], check=True)


def shared_bytes(path: Path) -> int:
    """Bytes of ``path`` in extents that the file system marks as shared (FIEMAP, via filefrag)."""
    out = subprocess.run(
        ["filefrag", "-v", "-b1", str(path)], capture_output=True, text=True, check=True
    ).stdout
    total = 0
    for line in out.splitlines():
        fields = [f.strip() for f in line.split(":")]
        if len(fields) >= 5 and fields[0].isdigit() and "shared" in line:
            total += int(fields[3].split()[0] if fields[3] else 0)
    return total


def test_on_xfs_a_sort_shares_every_unchanged_block(xfs):
    src = build_wide(xfs / "src", pad=40)
    sort_checkpoint(src, random_scores(), xfs / "out", progress=False)
    os.sync()
    for path in sorted(src.glob("*.safetensors")):
        header = read_header(path)
        unchanged = sum(t.nbytes for t in header.tensors.values() if ".linear_attn." not in t.name)
        shared = shared_bytes(xfs / "out" / path.name)
        assert unchanged - 2 * 2 * BLOCK <= shared <= unchanged  # all but the partial blocks at a run's ends
