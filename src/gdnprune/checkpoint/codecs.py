"""Tensor bytes as numbers and back, without torch: the float dtypes of safetensors as float64 numpy arrays.

The streaming engine reads FP8 scale tiles and writes dequantised BF16 with them; the out_proj refit
(:mod:`gdnprune.checkpoint.refit`) reads a weight's bytes and writes the refitted columns back in its dtype.
"""

from __future__ import annotations

import numpy as np

__all__ = ["to_float", "from_float"]

_NUMPY = {"F64": "<f8", "F32": "<f4", "F16": "<f2"}


def to_float(data: bytes | bytearray | memoryview, dtype: str, shape: tuple[int, ...]) -> np.ndarray:
    """A tensor's raw little-endian bytes as float64 (F64, F32, F16 or BF16)."""
    raw = np.frombuffer(data, dtype={**_NUMPY, "BF16": "<u2"}[dtype])
    if dtype == "BF16":
        raw = (raw.astype(np.uint32) << 16).view(np.float32)
    return raw.astype(np.float64).reshape(shape)


def from_float(values: np.ndarray, dtype: str) -> bytes:
    """float64 values as the raw bytes of ``dtype`` (BF16 rounded to nearest even, as torch rounds)."""
    if dtype == "BF16":
        f32 = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32)
        rounded = (f32 + 0x7FFF + ((f32 >> 16) & 1)) >> 16
        nan = np.isnan(values.astype(np.float32))
        rounded = np.where(nan, 0x7FC0, rounded).astype("<u2")
        return rounded.tobytes()
    return np.ascontiguousarray(values, dtype=_NUMPY[dtype]).tobytes()
