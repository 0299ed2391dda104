"""Byte-identical outputs: sort, slice and sort+slice of fixed checkpoints hash to recorded values.

The source folders are built from numpy's PCG64 stream and a hand-written safetensors header, so they are
the same bytes on every machine and with every torch or transformers version. The recorded hashes were
taken before the package was split into ``checkpoint/`` and ``scoring/`` (issue 8) and changed once, on
purpose, in issue 11: output shards keep the source's tensor order (GDN tensors in place instead of last)
and pad the header so that unchanged tensors keep their source offsets modulo 4 KiB (reflinks); every
tensor's bytes, the index, config and manifest stayed the same (compared tensor by tensor). Any change to
what the streaming engine writes (tensor order, header, index, config, manifest) shows up here. A change
that is meant to alter the output must update the hashes and say why in its commit.
"""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path

import numpy as np
import pytest

from gdnprune.checkpoint import slice_checkpoint, sort_checkpoint, transform_checkpoint
from gdnprune.geometry import GDNShape
from gdnprune.layouts import get_layout

SHAPE = GDNShape(num_key_heads=2, num_value_heads=6, key_head_dim=6, value_head_dim=4)
TARGET = {"num_key_heads": 1, "num_value_heads": 2, "key_head_dim": 5, "value_head_dim": 3}
HIDDEN, KERNEL = 16, 4
DTYPES = {"BF16": "<u2", "F16": "<f2", "F32": "<f4"}
# (layout, on-disk dtype, weight prefix of the text model, config builder)
CASES = {
    "qwen3_5_vl": ("qwen3_5", "BF16", "model.language_model."),
    "qwen3_next": ("qwen3_next", "F16", "model."),
    "olmo_hybrid": ("olmo_hybrid", "F32", "model."),
}
OLMO_SPLIT = {"conv1d.weight": ("q_conv1d.weight", "k_conv1d.weight", "v_conv1d.weight")}


def _config(name: str) -> dict:
    gdn = {
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 6,
        "linear_key_head_dim": 6,
        "linear_value_head_dim": 4,
        "linear_conv_kernel_dim": KERNEL,
    }
    text = {
        "hidden_size": HIDDEN,
        "num_hidden_layers": 3,
        "vocab_size": 32,
        "layer_types": ["linear_attention", "full_attention", "linear_attention"],
        **gdn,
    }
    if name == "qwen3_5_vl":
        return {
            "model_type": "qwen3_5",
            "architectures": ["Qwen3_5ForConditionalGeneration"],
            "text_config": {"model_type": "qwen3_5_text", **text},
            "vision_config": {"depth": 1},
        }
    return {"model_type": name, **text}


def _gdn_tensors(layout: str, prefix: str) -> dict[str, tuple[int, ...]]:
    shapes = {}
    for rule in get_layout(layout).rules:
        if not rule.required:
            continue
        n = rule.length(SHAPE)
        dims = {1: (n,), 2: (n, HIDDEN) if rule.axis == 0 else (HIDDEN, n), 3: (n, 1, KERNEL)}[rule.ndim]
        if layout == "olmo_hybrid" and rule.name in OLMO_SPLIT:  # transformers writes equal thirds
            for piece in OLMO_SPLIT[rule.name]:
                shapes[f"{prefix}.{piece}"] = (n // 3, 1, KERNEL)
        else:
            shapes[f"{prefix}.{rule.name}"] = dims
    return shapes


def _write_shard(path: Path, tensors: dict[str, np.ndarray], dtype: str) -> None:
    header, blobs, offset = {}, [], 0
    for name, array in tensors.items():
        data = array.tobytes()
        header[name] = {
            "dtype": dtype,
            "shape": list(array.shape),
            "data_offsets": [offset, offset + len(data)],
        }
        blobs.append(data)
        offset += len(data)
    header["__metadata__"] = {"format": "pt"}
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(struct.pack("<Q", len(text)) + text + b"".join(blobs))


def build_source(folder: Path, name: str) -> Path:
    """A three-shard folder: two GDN layers (the second straddles shards 2 and 3), attention, mlp, mtp."""
    layout, dtype, base = CASES[name]
    rng = np.random.Generator(np.random.PCG64(sum(map(ord, name))))
    shapes = {f"{base}embed_tokens.weight": (32, HIDDEN)}
    shapes.update(_gdn_tensors(layout, f"{base}layers.0.linear_attn"))
    shapes[f"{base}layers.1.self_attn.q_proj.weight"] = (HIDDEN, HIDDEN)
    shapes.update(_gdn_tensors(layout, f"{base}layers.2.linear_attn"))
    shapes.update(
        {
            f"{base}norm.weight": (HIDDEN,),
            "lm_head.weight": (32, HIDDEN),
            "mtp.fc.weight": (HIDDEN, 2 * HIDDEN),
        }
    )
    names = list(shapes)
    cut1, cut2 = names.index(f"{base}layers.1.self_attn.q_proj.weight"), len(names) - 6
    shards = [names[:cut1], names[cut1:cut2], names[cut2:]]
    folder.mkdir(parents=True)
    weight_map = {}
    for i, members in enumerate(shards, start=1):
        file = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        arrays = {}
        for n in members:
            if dtype == "BF16":
                arrays[n] = (
                    rng.integers(0x3C00, 0x4100, size=shapes[n], dtype=np.uint16)
                    ^ rng.integers(0, 2, size=shapes[n], dtype=np.uint16) << 15
                )
            else:
                arrays[n] = rng.standard_normal(shapes[n]).astype(DTYPES[dtype])
        _write_shard(folder / file, arrays, dtype)
        weight_map.update({n: file for n in members})
    total = sum((folder / f).stat().st_size for f in set(weight_map.values()))
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2)
    )
    (folder / "config.json").write_text(json.dumps(_config(name), indent=2))
    (folder / "tokenizer_config.json").write_text('{"model_max_length": 64}\n')
    return folder


def scores_for(folder: Path, name: str) -> dict:
    _, _, base = CASES[name]
    rng = np.random.Generator(np.random.PCG64(7))
    layers = {}
    for i in (0, 2):
        layers[f"{base}layers.{i}.linear_attn"] = {
            "key_group_order_most_important_first": rng.permutation(2).tolist(),
            "value_lane_order_most_important_first": [rng.permutation(3).tolist() for _ in range(2)],
            "key_dim_order_most_important_first": [rng.permutation(6).tolist() for _ in range(2)],
            "value_dim_order_most_important_first": rng.permutation(4).tolist(),
        }
    return {"format": "gdnprune-scores", "version": 1, "method": "fixed", "layers": layers}


_VOLATILE = ("created", "elapsed_seconds", "path")


def _stable(value):
    if isinstance(value, dict):
        return {k: _stable(v) for k, v in value.items() if k not in _VOLATILE}
    if isinstance(value, list):
        return [_stable(v) for v in value]
    return value


def tree_digest(folder: Path) -> str:
    """One sha256 over every file of the folder (the manifest without times and absolute paths)."""
    h = hashlib.sha256()
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        data = path.read_bytes()
        if path.name == "gdnprune.json":
            data = json.dumps(_stable(json.loads(data)), sort_keys=True).encode()
        h.update(f"{path.relative_to(folder)}\0{len(data)}\0".encode() + data)
    return h.hexdigest()


RECORDED = {
    ("qwen3_5_vl", "sort"): "b580d2136420b60d244ec6c8865ad4b23b2496982e854fb72a377eeef696e4f4",
    ("qwen3_5_vl", "slice"): "fc5984fa36e5b7f13d62c4f08f91f371b2e8bc27a9e5091b0cd778306b91d081",
    ("qwen3_5_vl", "sort+slice"): "340c16932c1e39a8a0c0383042dda611b1d007211ab6bb88b0c474846f7d5a93",
    ("qwen3_next", "sort"): "50c6fef204107e8e53b2e554edb3e116e9ac39cc821df969725dae1f3a4d0379",
    ("qwen3_next", "slice"): "53fd9af90543bcc94bf30ccfaebbd9fef9581979c33e50b28b3297e9fff8b1d0",
    ("qwen3_next", "sort+slice"): "7c5cf62666c1144118921fe1436a6596f152db0ed4e8f5b8deef9a3c8663758e",
    ("olmo_hybrid", "sort"): "7a6ae1945c45d5c32b4be23d21f7e2684258b2055e136809c2836b0bc3137523",
    ("olmo_hybrid", "slice"): "79d831d03cf5aa180b04012c77c445bfe4dca74cdb7f43ecfcc86b422f2b8a31",
    ("olmo_hybrid", "sort+slice"): "f4768cd304a3aeb0657e2f0730479bac93d3381264cb29622bb6daf99654b230",
}


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("operation", ["sort", "slice", "sort+slice"])
def test_outputs_are_byte_identical_to_the_recorded_ones(name, operation, tmp_path):
    src = build_source(tmp_path / "src", name)
    out = tmp_path / "out"
    scores = scores_for(src, name)
    if operation == "sort":
        sort_checkpoint(src, scores, out, progress=False)
    elif operation == "slice":
        slice_checkpoint(src, out, TARGET, progress=False)
    else:
        transform_checkpoint(
            src, out, permutations=scores["layers"], target=TARGET, operation="prune", progress=False
        )
    assert tree_digest(out) == RECORDED[(name, operation)]
