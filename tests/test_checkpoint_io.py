"""The torch-free safetensors reader/writer behind checkpoint surgery."""

from __future__ import annotations

import errno
import json
import os
import struct

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from gdnprune.io import safetensors_io as io
from gdnprune.io.safetensors_io import (
    CheckpointError,
    copy_range,
    encode_header,
    frame_header,
    header_json,
    read_header,
)


def _tensors():
    g = torch.Generator().manual_seed(0)
    return {
        "a": torch.randn(3, 5, generator=g),
        "b": torch.randn(7, generator=g).to(torch.bfloat16),
        "c": torch.arange(6, dtype=torch.int64).reshape(2, 3),
        "empty": torch.zeros(0, 4, dtype=torch.float16),
    }


def test_read_header_of_a_safetensors_file(tmp_path):
    path = tmp_path / "x.safetensors"
    tensors = _tensors()
    save_file(tensors, path, metadata={"format": "pt", "note": "hi"})
    h = read_header(path)
    assert h.metadata == {"format": "pt", "note": "hi"} and (8 + h.header_size) % 8 == 0
    assert set(h.tensors) == set(tensors) and h.file_size == path.stat().st_size
    data = path.read_bytes()
    for name, t in tensors.items():
        info = h.tensors[name]
        assert info.shape == tuple(t.shape) and info.nbytes == t.numel() * t.element_size()
        assert data[info.start : info.end] == t.contiguous().view(torch.uint8).numpy().tobytes()
    assert h.tensors["b"].dtype == "BF16" and h.tensors["c"].numel == 6


def test_written_file_is_read_by_safetensors(tmp_path):
    tensors = _tensors()
    raw = {k: v.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() for k, v in tensors.items()}
    dtypes = {"a": "F32", "b": "BF16", "c": "I64", "empty": "F16"}
    entries, pos = [], 0
    for k in ("c", "a", "b", "empty"):
        entries.append((k, dtypes[k], list(tensors[k].shape), pos, pos + len(raw[k])))
        pos += len(raw[k])
    for size in (None, 4096 - 8):  # as safetensors pads it; padded so that the data starts at a block
        header = encode_header(entries, {"format": "pt"}, size=size)
        assert len(header) % 8 == 0 and struct.unpack("<Q", header[:8])[0] == len(header) - 8
        path = tmp_path / f"w{size}.safetensors"
        path.write_bytes(header + b"".join(raw[e[0]] for e in entries))
        with safe_open(path, "pt") as f:
            assert f.metadata() == {"format": "pt"}
            for k, t in tensors.items():
                assert torch.equal(f.get_tensor(k), t)
        assert read_header(path).tensors.keys() == set(tensors)
    with pytest.raises(ValueError, match="does not fit"):
        encode_header(entries, None, size=8)


def test_header_json_is_json_dumps_of_the_header_object():
    """The header is written entry by entry; the reference is json.dumps of the whole object, compact and UTF-8
    (names with quotes, backslashes, control and non-ASCII characters; scalars; metadata or none); a name
    given twice, or a tensor named __metadata__, is refused instead of silently merged."""
    entries = [
        ('quote"back\\slash\nnew\x01line', "F32", (2, 3), 0, 24),
        ("\u00e9t\u00e9.\u4e2d.weight", "BF16", (), 24, 26),
        ("model.layers.47.mlp.experts.511.down_proj.weight", "F8_E4M3", [0, 5], 26, 26),
    ]
    for metadata in (None, {"format": "pt", "note": 'a "b" \u00e9'}):
        header = {} if metadata is None else {"__metadata__": metadata}
        header.update(
            {n: {"dtype": d, "shape": list(s), "data_offsets": [b, e]} for n, d, s, b, e in entries}
        )
        expected = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
        assert header_json(entries, metadata) == expected
        assert frame_header(expected) == encode_header(entries, metadata)
    for bad in ([entries[0], entries[0]], [("__metadata__", "F32", (1,), 0, 4)]):
        with pytest.raises(ValueError, match="each tensor name once"):
            header_json(bad, None)


def _write_raw(path, header: dict, data: bytes, pad: bytes = b""):
    raw = json.dumps(header).encode() + pad
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)


@pytest.mark.parametrize(
    "header,data,message",
    [
        ({"x": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, b"\0" * 4, "truncated"),
        ({"x": {"dtype": "F32", "shape": [2], "data_offsets": [0, 4]}}, b"\0" * 4, "needs 8 bytes"),
        ({"x": {"dtype": "Q7", "shape": [2], "data_offsets": [0, 8]}}, b"\0" * 8, "unknown dtype"),
        ({"x": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 8]}}, b"\0" * 8, "non-negative"),
        (
            {
                "x": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},
                "y": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},
            },
            b"\0" * 8,
            "overlapping",
        ),
        ({"x": {"dtype": "F32", "shape": [1]}}, b"\0" * 4, "expected dtype, shape and data_offsets"),
        ({"x": [1, 2]}, b"", "expected dtype, shape and data_offsets"),
        ({"x": "F32"}, b"", "expected dtype, shape and data_offsets"),
        ({"x": {"dtype": ["F32"], "shape": [1], "data_offsets": [0, 4]}}, b"\0" * 4, "unknown dtype"),
        ({"x": {"dtype": "F32", "shape": 2, "data_offsets": [0, 8]}}, b"\0" * 8, "non-negative"),
        ({"x": {"dtype": "F32", "shape": [True], "data_offsets": [0, 4]}}, b"\0" * 4, "non-negative"),
        ({"x": {"dtype": "F32", "shape": [1], "data_offsets": [0]}}, b"\0" * 4, r"is not \[begin, end\]"),
        (
            {"x": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4.0]}},
            b"\0" * 4,
            r"is not \[begin, end\]",
        ),
        ([1, 2], b"", "expected an object"),
        ({"__metadata__": {"a": 1}}, b"", "__metadata__"),
    ],
)
def test_read_header_rejects_corrupt_files(tmp_path, header, data, message):
    path = tmp_path / "bad.safetensors"
    _write_raw(path, header, data)
    with pytest.raises(CheckpointError, match=message):
        read_header(path)


def test_read_header_rejects_short_and_unreadable_files(tmp_path):
    (tmp_path / "short").write_bytes(b"\1\2")
    with pytest.raises(CheckpointError, match="at least 8"):
        read_header(tmp_path / "short")
    (tmp_path / "huge").write_bytes(struct.pack("<Q", 10**12) + b"{}")
    with pytest.raises(CheckpointError, match="does not fit"):
        read_header(tmp_path / "huge")
    with pytest.raises(CheckpointError, match="cannot read"):
        read_header(tmp_path / "missing")


def test_trailing_spaces_in_header_are_fine(tmp_path):
    path = tmp_path / "pad.safetensors"
    _write_raw(
        path, {"x": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}, struct.pack("<f", 1.5), b" " * 13
    )
    assert read_header(path).tensors["x"].start == 8 + path.stat().st_size - 12
    with safe_open(path, "pt") as f:
        assert f.get_tensor("x").item() == 1.5


@pytest.mark.parametrize("broken", [(), ("copy_file_range",), ("copy_file_range", "sendfile")])
def test_copy_range_falls_back(tmp_path, monkeypatch, broken):
    def unsupported(*args, **kwargs):
        raise OSError(errno.EXDEV, "not here")

    for name in broken:
        monkeypatch.setattr(os, name, unsupported)
    src = tmp_path / "src"
    payload = os.urandom(300_000)
    src.write_bytes(payload)
    seen = []
    with open(src, "rb") as fin, open(tmp_path / "dst", "wb") as fout:
        fout.write(b"HEAD")
        fout.flush()
        monkeypatch.setattr(io, "_CHUNK", 100_000)
        copy_range(fin.fileno(), fout.fileno(), 1000, 250_000, on_chunk=seen.append)
    assert (tmp_path / "dst").read_bytes() == b"HEAD" + payload[1000:251_000]
    assert sum(seen) == 250_000 and len(seen) >= 3


def test_copy_range_reports_real_errors(tmp_path, monkeypatch):
    def failing(*args, **kwargs):
        raise OSError(errno.EIO, "disk on fire")

    monkeypatch.setattr(os, "copy_file_range", failing)
    (tmp_path / "src").write_bytes(b"x" * 10)
    with open(tmp_path / "src", "rb") as fin, open(tmp_path / "dst", "wb") as fout:
        with pytest.raises(OSError, match="disk on fire"):
            copy_range(fin.fileno(), fout.fileno(), 0, 10)
        with pytest.raises(OSError, match="end of file"):
            monkeypatch.undo()
            copy_range(fin.fileno(), fout.fileno(), 5, 10)
