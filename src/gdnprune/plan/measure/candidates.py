"""Candidate geometries of one GDN layer and what each costs: kept parameters and recurrent state.

A candidate is a nested prefix of the (sorted) layer: the first ``Hk'`` key groups, the first ``r'`` lanes of
each, the first ``dk'`` and ``dv'`` channels. The grid takes every key-head count, every lane count and head
dims in steps of ``dim_step`` (a fraction of the full dim such as ``1/8``, or a channel count), varies
only the ``axes`` asked for, and keeps only candidates that meet the serving constraints. No torch.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from fractions import Fraction

from ...io.plan_file import constraint_violations, state_elements
from ...model.geometry import GDNShape
from ...model.layouts import get_layout
from ...model.tiles import tile_problems

__all__ = ["AXES", "Candidate", "parse_dim_step", "dim_values", "layer_candidates", "parameters_of"]

#: the four axes a plan may cut
AXES = ("key_heads", "lanes", "key_dim", "value_dim")


@dataclass(frozen=True)
class Candidate:
    """One geometry of one layer, with its kept GDN parameters and recurrent state (elements per sequence)."""

    target: GDNShape
    params: int
    state: int


def parse_dim_step(text: str | float | Fraction) -> Fraction | int:
    """``"1/8"`` or ``0.125`` -> a fraction of the full dim; ``"16"`` or ``16`` -> a channel count."""
    try:
        value = Fraction(str(text)) if not isinstance(text, (int, Fraction)) else text
    except (ValueError, ZeroDivisionError):
        raise ValueError(
            f"dim step must be a fraction such as 1/8 or a channel count such as 16, got {text!r}"
        ) from None
    if isinstance(value, bool) or value <= 0:
        raise ValueError(f"dim step must be positive, got {text!r}")
    if value < 1:
        return Fraction(value)
    if value != int(value):
        raise ValueError(f"a dim step of 1 or more is a channel count and must be an integer, got {text!r}")
    return int(value)


def dim_values(full: int, step: Fraction | int, multiple_of: int | None = None) -> list[int]:
    """The head dims a grid tries for a dim of size ``full``: multiples of the step, and ``full`` itself."""
    if isinstance(step, Fraction):
        values = {max(1, math.ceil(full * step * k)) for k in range(1, math.ceil(1 / step) + 1)}
    else:
        values = set(range(step, full + 1, step))
    values = {v for v in values if v <= full} | {full}
    if multiple_of:
        values = {v for v in values if v % multiple_of == 0} | ({full} if full % multiple_of == 0 else set())
    return sorted(values)


def parameters_of(
    tensor_shapes: Mapping[str, tuple[int, ...]], layout: str, shape: GDNShape, target: GDNShape
) -> int:
    """GDN parameters of a layer with ``tensor_shapes`` (suffix -> shape, as in its module or state dict)
    once cut to ``target``: each coupled axis scales with its canonical length."""
    rules = get_layout(layout)
    total = 0
    for suffix, dims in tensor_shapes.items():
        rule = rules.rule(suffix)
        numel = math.prod(dims)
        if rule is not None:
            numel = numel // rule.length(shape) * rule.length(target)
        total += numel
    return total


def layer_candidates(
    prefix: str,
    shape: GDNShape,
    tensor_shapes: Mapping[str, tuple[int, ...]],
    layout: str,
    conv_kernel: int,
    *,
    dim_step: str | Fraction | int = Fraction(1, 8),
    axes: Iterable[str] = AXES,
    tp: int | None = None,
    multiple_of: int | None = None,
    snap_quant: int | None = None,
) -> list[Candidate]:
    """Every candidate of one layer, largest first (the full geometry, when it meets the constraints;
    ``snap_quant``: every width a candidate cuts fits tiles of that size, :mod:`gdnprune.model.tiles`).

    Raises:
        ValueError: an unknown axis, or a layer that no candidate fits (the constraints exclude even the
            full layer).
    """
    dim_step = parse_dim_step(dim_step)
    axes = set(axes)
    unknown = axes - set(AXES)
    if unknown:
        raise ValueError(f"unknown axes {sorted(unknown)}; expected some of {list(AXES)}")
    r = shape.value_heads_per_group
    heads = range(1, shape.num_key_heads + 1) if "key_heads" in axes else [shape.num_key_heads]
    lanes = range(1, r + 1) if "lanes" in axes else [r]
    key_dims = (
        dim_values(shape.key_head_dim, dim_step, multiple_of) if "key_dim" in axes else [shape.key_head_dim]
    )
    value_dims = (
        dim_values(shape.value_head_dim, dim_step, multiple_of)
        if "value_dim" in axes
        else [shape.value_head_dim]
    )
    out = []
    for hk in reversed(heads):
        for rr in reversed(lanes):
            for dk in reversed(key_dims):
                for dv in reversed(value_dims):
                    target = GDNShape(hk, hk * rr, dk, dv)
                    if constraint_violations({prefix: target}, tp=tp, multiple_of=multiple_of):
                        continue
                    if snap_quant and tile_problems(shape, target, snap_quant):
                        continue
                    out.append(
                        Candidate(
                            target,
                            parameters_of(tensor_shapes, layout, shape, target),
                            state_elements(target, conv_kernel),
                        )
                    )
    if not out:
        raise ValueError(
            f"{prefix}: no candidate geometry of {shape} meets the constraints (tp={tp}, "
            f"multiple_of={multiple_of}, snap_quant={snap_quant})"
        )
    return out
