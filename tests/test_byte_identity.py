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
from pathlib import Path

import pytest
from helpers import BYTES_CASES as CASES
from helpers import BYTES_TARGET as TARGET
from helpers import build_source, scores_for

from gdnprune.checkpoint import slice_checkpoint, sort_checkpoint, transform_checkpoint

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
