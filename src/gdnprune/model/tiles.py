"""The widths that quantization tiles and groups need, as data: which widths of a cut fit tiles of ``n``
(``--snap-quant``), and a target snapped up to the nearest geometry that fits. No torch, no numpy.

A quantized matrix fits a scheme of tile (or group) size ``n`` when its widths are multiples of ``n``
(:mod:`gdnprune.quantize.schemes`). A cut changes these widths: a GDN layer's key width (``Hk * dk``: the
q and k rows of ``in_proj_qkv``) and value width (``Hv * dv``: the v rows, ``in_proj_z``, the columns of
``out_proj``), an MLP's ``intermediate_size`` (the rows of ``gate_proj``/``up_proj``, the columns of
``down_proj``), an attention layer's query and key-value widths (heads times ``head_dim``). A width the cut
leaves at its full size is the model's own and is not asked to fit (the scheme keeps that matrix in high
precision when it does not). Routed-expert counts change no matrix width.
"""

from __future__ import annotations

from typing import Any

from .geometry import GDNShape
from .subblock_shapes import AttentionShape, MLPShape

__all__ = ["fits", "tile_problems", "snap_to_tiles"]


def fits(width: int, full: int, n: int) -> bool:
    """A width of a cut fits tiles of ``n``: a multiple of ``n``, or the full width it was cut from."""
    return width == full or width % n == 0


def _widths(shape: Any) -> dict[str, int]:
    """The matrix widths a geometry sets, by name."""
    if isinstance(shape, GDNShape):
        return {
            "key width (num_key_heads x key_head_dim)": shape.num_key_heads * shape.key_head_dim,
            "value width (num_value_heads x value_head_dim)": shape.num_value_heads * shape.value_head_dim,
        }
    if isinstance(shape, MLPShape):
        return {"intermediate_size": shape.intermediate_size}
    if isinstance(shape, AttentionShape):
        return {
            "query width (num_attention_heads x head_dim)": shape.num_attention_heads * shape.head_dim,
            "key-value width (num_key_value_heads x head_dim)": shape.num_key_value_heads * shape.head_dim,
        }
    return {}  # routed experts: the count changes no matrix width


def tile_problems(shape: Any, target: Any, n: int) -> list[str]:
    """The widths of ``target`` (cut from ``shape``) that do not fit tiles of ``n`` (empty when all do)."""
    full = _widths(shape)
    return [
        f"{name} {width} is not a multiple of {n}"
        for name, width in _widths(target).items()
        if not fits(width, full[name], n)
    ]


def snap_to_tiles(shape: Any, target: Any, n: int) -> Any:
    """``target`` with every width snapped up to fit tiles of ``n``: the nearest geometry at or above it
    (each count and dim at least the target's, at most the shape's) whose widths all fit. The full
    geometry always fits, so there is always one. A geometry that already fits is returned as it is."""
    if not tile_problems(shape, target, n):
        return target
    if isinstance(shape, GDNShape):
        return _snap_gdn(shape, target, n)
    if isinstance(shape, MLPShape):
        size = next(
            s
            for s in range(target.intermediate_size, shape.intermediate_size + 1)
            if fits(s, shape.intermediate_size, n)
        )
        return MLPShape(size)
    assert isinstance(shape, AttentionShape)
    hd, full_q, full_kv = shape.head_dim, shape.num_attention_heads, shape.num_key_value_heads
    for nkv in range(target.num_key_value_heads, full_kv + 1):
        for r in range(target.heads_per_group, shape.heads_per_group + 1):
            if fits(nkv * hd, full_kv * hd, n) and fits(nkv * r * hd, full_q * hd, n):
                return AttentionShape(nkv * r, nkv, hd)
    return shape  # unreachable: the full geometry fits


def _snap_gdn(shape: GDNShape, target: GDNShape, n: int) -> GDNShape:
    """The key heads and dim first (the smallest count, then dim, that fits), then the value lanes and dim."""
    full_key = shape.num_key_heads * shape.key_head_dim
    full_value = shape.num_value_heads * shape.value_head_dim
    r_full, r = shape.value_heads_per_group, target.value_heads_per_group
    for hk in range(target.num_key_heads, shape.num_key_heads + 1):
        dks = [d for d in range(target.key_head_dim, shape.key_head_dim + 1) if fits(hk * d, full_key, n)]
        values = [
            (rr, d)
            for rr in range(r, r_full + 1)
            for d in range(target.value_head_dim, shape.value_head_dim + 1)
            if fits(hk * rr * d, full_value, n)
        ]
        if dks and values:
            rr, dv = values[0]
            return GDNShape(hk, hk * rr, dks[0], dv)
    return shape  # unreachable: the full geometry fits
