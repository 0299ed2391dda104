"""Slice targets: the geometry each GDN layer is cut to, checked against the layer it is cut from.

A target is a :class:`~gdnprune.model.geometry.GDNShape`, or a mapping of some of its four fields (a field not
given keeps the layer's size). A target fits a layer when it keeps at most the layer's key heads, value
heads per key head, key dim and value dim. This module does not import torch.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Mapping

__all__ = ["TARGET_FIELDS", "TargetError", "resolve_target", "keyword_target"]

#: the four fields of a target geometry
TARGET_FIELDS = ("num_key_heads", "num_value_heads", "key_head_dim", "value_head_dim")


class TargetError(ValueError):
    """A slice target that the layers cannot be cut to."""


def keyword_target(paths: int):
    """Decorator for a function whose ``target`` is keyword-only after ``paths`` path arguments: the old
    call form with the target given positionally after the paths still works, with a ``FutureWarning``."""

    def wrap(func):
        @functools.wraps(func)
        def call(*args, **kwargs):
            if len(args) > paths:
                if len(args) > paths + 1 or "target" in kwargs:
                    raise TypeError(
                        f"{func.__name__}() takes {paths} positional arguments (the paths); give "
                        f"everything else by keyword"
                    )
                warnings.warn(
                    f"{func.__name__}: give the target by keyword (target=...); a positional target is "
                    f"deprecated",
                    FutureWarning,
                    stacklevel=2,
                )
                kwargs["target"], args = args[paths], args[:paths]
            return func(*args, **kwargs)

        return call

    return wrap


def resolve_target(shape, target):
    """The target GDNShape (``shape`` when None), validated against ``shape``."""
    from .geometry import GDNShape  # lazy: numpy-free at import (the CLI imports this before numpy)

    if target is None:
        return shape
    if isinstance(target, GDNShape):
        t = target
    elif isinstance(target, Mapping):
        unknown = sorted(set(target) - set(TARGET_FIELDS))
        if unknown:
            raise TargetError(f"unknown target fields {unknown}; expected some of {list(TARGET_FIELDS)}")
        try:
            t = shape.replace(**{k: v for k, v in target.items() if v is not None})
        except ValueError as exc:
            raise TargetError(f"illegal target for layers of {shape}: {exc}") from None
    else:
        raise TargetError(
            f"target must be a GDNShape or a mapping of its fields, got {type(target).__name__}"
        )
    problems = []
    if t.num_key_heads > shape.num_key_heads:
        problems.append(f"num_key_heads {t.num_key_heads} > {shape.num_key_heads}")
    if t.value_heads_per_group > shape.value_heads_per_group:
        problems.append(
            f"num_value_heads {t.num_value_heads} / num_key_heads {t.num_key_heads} = {t.value_heads_per_group} "
            f"value heads per key head > {shape.value_heads_per_group} (give num_value_heads <= "
            f"{t.num_key_heads * shape.value_heads_per_group}, a multiple of {t.num_key_heads})"
        )
    if t.key_head_dim > shape.key_head_dim:
        problems.append(f"key_head_dim {t.key_head_dim} > {shape.key_head_dim}")
    if t.value_head_dim > shape.value_head_dim:
        problems.append(f"value_head_dim {t.value_head_dim} > {shape.value_head_dim}")
    if problems:
        raise TargetError(f"illegal target {t.as_dict()} for layers of {shape}: {'; '.join(problems)}")
    return t
