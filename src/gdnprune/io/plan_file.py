"""The plan file: one target geometry per GDN layer, read, checked, resolved against a checkpoint, written.

A plan is a JSON object (``gdnprune plan`` writes one; ``slice --plan`` and ``prune --plan`` read it)::

    {"format": "gdnprune-plan", "version": 1,
     "default": {"num_key_heads": 8},                       # optional: layers not named below
     "layers": {"model.layers.0.linear_attn": {"num_key_heads": 4, "num_value_heads": 8,
                                               "key_head_dim": 128, "value_head_dim": 96}, ...},
     ...metadata (budgets, predicted KL, the scores file's hash)}

A layer may give only some of the four fields; the others keep the layer's size. A layer that is not
named gets ``default`` (or keeps its shape).

Version 2 (what gdnprune writes now; version 1 files are still read) also cuts the dense sub-blocks
(:mod:`gdnprune.model.subblock_geometry`): an entry keyed by a sub-block prefix gives that block's fields —
``"model.layers.3.self_attn": {"num_attention_heads": 8, "num_key_value_heads": 2}``,
``"model.layers.3.mlp": {"intermediate_size": 2048}``, ``"model.layers.3.mlp.shared_expert":
{"shared_expert_intermediate_size": 256}`` — and ``default`` may hold these fields too (each applies to
the sub-blocks that have it) and ``hidden_size``, the hidden size of the whole model (the residual stream's
width, :mod:`gdnprune.model.hidden`: one value for every layer). Prefixes match as in scores files, with or without the
``language_model.`` part of a vision-language checkpoint. Also here: the serving constraints a plan must
meet (:func:`constraint_violations`, :func:`kernel_warnings`) and the cost of a geometry
(:func:`state_elements`). This module does not import torch.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping
from typing import Any

from ..model.geometry import GDNShape, layer_index_of
from ..model.hidden import HIDDEN_FIELDS
from ..model.subblock_geometry import BLOCK_FIELDS, KINDS, block_kind_of, block_kinds_of, resolve_block_target
from ..model.targets import TARGET_FIELDS, TargetError, resolve_target
from ..runtime.fileio import write_json_atomic
from .scores_file import match_layers

__all__ = [
    "plan_hidden_size",
    "PLAN_FORMAT",
    "PLAN_VERSION",
    "PLAN_VERSIONS",
    "plan_block_kinds",
    "resolve_block_plan",
    "PlanError",
    "read_plan",
    "removed_layers",
    "resolve_plan",
    "save_plan",
    "servable_problems",
    "constraint_violations",
    "kernel_warnings",
    "state_elements",
]

#: ``format`` field of a plan file.
PLAN_FORMAT = "gdnprune-plan"
#: ``version`` field of a plan file that gdnprune writes.
PLAN_VERSION = 2
#: versions it reads (1: GDN layers only)
PLAN_VERSIONS = (1, 2)
#: flash-linear-attention's kernels fail on key head dims below this and pad head dims that are not multiples
#: of it (fla-org/flash-linear-attention#22)
KERNEL_MULTIPLE = 16


class PlanError(ValueError):
    """A plan file (or dict) that cannot be read or applied to the checkpoint."""


def _check_fields(entry: Any, where: str, allowed=TARGET_FIELDS) -> dict[str, int]:
    if not isinstance(entry, Mapping):
        raise PlanError(
            f"{where}: expected an object of some of {list(allowed)}, found {type(entry).__name__}"
        )
    unknown = sorted(map(str, set(entry) - set(allowed)))
    if unknown:
        raise PlanError(f"{where}: unknown fields {unknown}; expected some of {list(allowed)}")
    for name, value in entry.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise PlanError(f"{where}: {name} must be a positive integer, found {value!r}")
    return dict(entry)


def read_plan(plan: str | os.PathLike | Mapping) -> dict:
    """Read a plan file (or check a dict): format, version, ``layers`` and ``default`` entries.

    Raises:
        PlanError: the file cannot be read, is not JSON, or is not a plan as described in the module docs.
    """
    where = "plan"
    if not isinstance(plan, (Mapping, str, os.PathLike)):
        raise PlanError(f"a plan must be a file path or a mapping, found {type(plan).__name__}")
    if not isinstance(plan, Mapping):
        where = f"plan file {os.fspath(plan)}"
        try:
            with open(plan, encoding="utf-8") as f:
                plan = json.load(f)
        except OSError as exc:
            raise PlanError(f"{where}: cannot read ({exc.strerror or exc})") from None
        except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
            raise PlanError(f"{where}: not valid JSON ({exc})") from None
    if not isinstance(plan, Mapping):
        raise PlanError(f"{where}: expected a JSON object, found {type(plan).__name__}")
    if plan.get("format") != PLAN_FORMAT:
        raise PlanError(
            f"{where}: not a gdnprune plan (format {plan.get('format')!r}, expected {PLAN_FORMAT!r})"
        )
    version = plan.get("version")
    if isinstance(version, bool) or version not in PLAN_VERSIONS:
        raise PlanError(
            f"{where}: unsupported plan version {version!r}, expected one of {list(PLAN_VERSIONS)}"
        )
    layers = plan.get("layers", {})
    if not isinstance(layers, Mapping):
        raise PlanError(
            f"{where}: 'layers' must map GDN layer prefixes to targets, found {type(layers).__name__}"
        )
    if not layers and plan.get("default") is None:
        raise PlanError(f"{where}: names no layer and has no 'default': nothing to cut")
    out = dict(plan)
    out["layers"], removed = {}, set()
    for prefix, entry in layers.items():
        if not isinstance(prefix, str):
            raise PlanError(f"{where}: layer keys must be GDN layer prefixes, found {prefix!r}")
        if (
            isinstance(entry, Mapping) and "removed" in entry
        ):  # a decoder layer to drop (gdnprune.model.layer_removal)
            if version == 1 or set(entry) != {"removed"} or not isinstance(entry["removed"], bool):
                raise PlanError(
                    f'{where}: layers[{prefix!r}]: a removal is {{"removed": true}} alone, in a '
                    f"version-2 plan; found {dict(entry)!r} in version {version}"
                )
            try:
                index = layer_index_of(prefix)
            except ValueError as exc:
                raise PlanError(f"{where}: layers[{prefix!r}]: {exc}") from None
            if entry["removed"]:
                removed.add(index)
            continue
        kind = block_kind_of(prefix, entry if isinstance(entry, Mapping) else ())
        if kind is not None and version == 1:
            raise PlanError(
                f"{where}: layers[{prefix!r}] is a {kind.name} sub-block; plan version 1 cuts only GDN "
                f"layers (write version 2)"
            )
        allowed = TARGET_FIELDS if kind is None else tuple(k for k in kind.config_keys if k in BLOCK_FIELDS)
        out["layers"][prefix] = _check_fields(entry, f"{where}: layers[{prefix!r}]", allowed)
    if plan.get("default") is not None:
        allowed = TARGET_FIELDS if version == 1 else TARGET_FIELDS + BLOCK_FIELDS + HIDDEN_FIELDS
        out["default"] = _check_fields(plan["default"], f"{where}: default", allowed)
    if removed:
        out["removed_layers"] = sorted(removed)
    return out


def plan_hidden_size(plan: str | os.PathLike | Mapping) -> int | None:
    """The hidden size a plan cuts the model to (its ``default``'s ``hidden_size``), None when it keeps it."""
    return (read_plan(plan).get("default") or {}).get("hidden_size")


def removed_layers(plan: str | os.PathLike | Mapping) -> list[int]:
    """The decoder layers a plan removes (entries ``{"removed": true}``, numbered as in its input)."""
    return list(read_plan(plan).get("removed_layers", []))


def _gdn_part(plan: Mapping) -> tuple[dict, dict]:
    """The entries of GDN layers and the GDN fields of ``default``."""
    layers = {k: v for k, v in plan["layers"].items() if block_kind_of(k) is None}
    default = {k: v for k, v in (plan.get("default") or {}).items() if k in TARGET_FIELDS}
    return layers, default


def plan_block_kinds(plan: str | os.PathLike | Mapping) -> set[str]:
    """The sub-block kinds a plan cuts (named entries, or fields of ``default``)."""
    plan = read_plan(plan)
    kinds = {kind.name for p in plan["layers"] for kind in block_kinds_of(p)}
    default = set(plan.get("default") or {})
    return kinds | {k.name for k in KINDS.values() if default & set(k.config_keys)}


def resolve_block_plan(plan: str | os.PathLike | Mapping, blocks) -> dict[str, Any]:
    """The target geometry of every sub-block of ``blocks`` (:class:`gdnprune.model.subblock_geometry.Block` list) under
    ``plan``: its entry, else the fields of ``default`` its kind has, else its own geometry.

    Raises:
        PlanError: an entry names a sub-block the checkpoint does not have, or a target does not fit
            (all such blocks are listed).
    """
    plan = read_plan(plan)
    entries = {k: v for k, v in plan["layers"].items() if block_kind_of(k) is not None}
    by_prefix = {b.prefix: b for b in blocks}
    try:
        named = match_layers(entries, by_prefix, what="plan")
    except ValueError as exc:
        raise PlanError(str(exc)) from None
    default = plan.get("default") or {}
    targets, problems = {}, []
    for prefix, block in by_prefix.items():
        try:
            targets[prefix] = resolve_block_target(block, named.get(prefix, default))
        except ValueError as exc:
            problems.append(str(exc))
    if problems:
        raise PlanError(f"{len(problems)} sub-block(s) of the plan do not fit: " + "; ".join(problems))
    return targets


def resolve_plan(plan: str | os.PathLike | Mapping, shapes: Mapping[str, GDNShape]) -> dict[str, GDNShape]:
    """The target of every GDN layer of ``shapes`` (prefix -> its geometry) under ``plan``.

    Raises:
        PlanError: the plan is malformed, names a layer the checkpoint does not have (or one layer twice),
            or gives a layer a target that does not fit in it (all such layers are listed).
    """
    plan = read_plan(plan)
    layers, default = _gdn_part(plan)
    try:
        named = match_layers(layers, shapes, what="plan")
    except ValueError as exc:
        raise PlanError(str(exc)) from None
    targets, problems = {}, []
    for prefix, shape in shapes.items():
        fields = named.get(prefix, default)
        try:
            targets[prefix] = resolve_target(shape, fields) if fields else shape
        except TargetError as exc:
            problems.append(f"{prefix}: {exc}")
    if problems:
        raise PlanError(f"{len(problems)} layer(s) of the plan do not fit: " + "; ".join(problems))
    return targets


def servable_problems(
    gdn: Mapping[int, Any], blocks: Mapping[str, Mapping[int, Any]], removed: Iterable[int] = ()
) -> list[str]:
    """Why a cut is not servable from a standard config: per kind of block (``gdn``: decoder layer -> GDN
    target; ``blocks``: kind -> decoder layer -> target), the kept layers that differ in geometry. [] when
    every kind has one geometry over the kept layers (engines that read only the standard config load it)."""
    gone = set(removed)
    problems = []
    for kind, targets in (("gdn", gdn), *blocks.items()):
        kept = {i: t for i, t in sorted(targets.items()) if i not in gone}
        seen: dict[Any, int] = {}
        for i, t in kept.items():
            seen.setdefault(t, i)
        if len(seen) > 1:
            (a, i), (b, j) = list(seen.items())[:2]
            problems.append(f"{kind} layers differ ({a} at layer {i}, {b} at layer {j})")
    return problems


def save_plan(plan: Mapping[str, Any], path: str | os.PathLike) -> os.PathLike:
    """Write a plan (checked by :func:`read_plan`) as JSON, atomically."""
    read_plan(plan)
    return write_json_atomic(path, dict(plan), indent=1)


def constraint_violations(
    targets: Mapping[str, GDNShape], *, tp: int | None = None, multiple_of: int | None = None
) -> list[str]:
    """What breaks the serving constraints, one line per layer (empty when none does).

    ``tp``: tensor-parallel serving shards GDN heads over ``tp`` ranks, so every layer's key heads and value
    heads must be divisible by it. ``multiple_of``: head dims must be multiples of it.
    """
    lines = []
    for prefix, t in targets.items():
        problems = []
        if tp and (t.num_key_heads % tp or t.num_value_heads % tp):
            problems.append(
                f"{t.num_key_heads} key heads and {t.num_value_heads} value heads must be divisible "
                f"by `tp={tp}`"
            )
        if multiple_of:
            for name in ("key_head_dim", "value_head_dim"):
                if getattr(t, name) % multiple_of:
                    problems.append(f"{name} {getattr(t, name)} is not a multiple of {multiple_of}")
        if problems:
            lines.append(f"{prefix}: " + "; ".join(problems))
    return lines


def kernel_warnings(targets: Mapping[str, GDNShape]) -> list[str]:
    """Head dims that flash-linear-attention's kernels cannot run (key dims below 16) or pad (not multiples
    of 16): one line per layer. ``--multiple-of 16`` turns these into constraints."""
    lines = []
    for prefix, t in targets.items():
        notes = []
        if t.key_head_dim < KERNEL_MULTIPLE:
            notes.append(
                f"key_head_dim {t.key_head_dim} < {KERNEL_MULTIPLE}: flash-linear-attention's Triton "
                f"kernels fail on it"
            )
        for name in ("key_head_dim", "value_head_dim"):
            if getattr(t, name) % KERNEL_MULTIPLE:
                notes.append(
                    f"{name} {getattr(t, name)} is not a multiple of {KERNEL_MULTIPLE}: "
                    f"flash-linear-attention pads it (slower, no memory saved)"
                )
        if notes:
            lines.append(f"{prefix}: " + "; ".join(notes))
    return lines


def state_elements(shape: GDNShape, conv_kernel: int) -> int:
    """Recurrent state of one sequence in one GDN layer, in elements: the delta-rule state ``Hv*dk*dv``
    plus the conv state ``conv_dim * (K - 1)``. It replaces the KV cache and does not grow with context."""
    return shape.num_value_heads * shape.key_head_dim * shape.value_head_dim + shape.conv_dim * (
        conv_kernel - 1
    )
