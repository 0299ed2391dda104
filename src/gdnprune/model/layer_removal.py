"""Layer removal (depth pruning), as data: which decoder layers go, the new number of every other one, the
tensor names that follow (a gather over names, as for per-expert tensors), and the config that describes
the shallower model. No torch, no numpy.

Layers are numbered as in the input. A removed layer's tensors are dropped, the tensors of the layers after
it are renamed (``layers.7.`` -> ``layers.6.``) and copied byte for byte; ``mtp.*`` (the multi-token
prediction head, which has its own ``mtp.layers.N``) and the vision tower are left as they are. The config
gets ``num_hidden_layers``, ``layer_types`` and ``per_layer_config`` renumbered; a Qwen3-Next
``decoder_sparse_step`` / ``mlp_only_layers`` pattern is rewritten as the explicit list of dense layers, so
every kept layer keeps its kind of MLP.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Iterable, Mapping
from typing import TypeVar

__all__ = [
    "DepthError",
    "check_removed",
    "layer_numbers",
    "removal_name_map",
    "remove_layers_from_config",
    "parse_layer_list",
    "num_layers_of",
    "compose_names",
]

_LAYER = re.compile(r"(^|\.)layers\.(\d+)\.")
_PASSTHROUGH = ("mtp.",)
_M = TypeVar("_M", bound=Mapping)


class DepthError(ValueError):
    """A set of layers to remove that does not fit the model (out of range, or all of them)."""


def _holder(config: _M) -> _M:
    """The part of ``config`` that holds the decoder's settings (``text_config`` of a multimodal one); a
    dict for a dict."""
    if "text_config" in config and "num_hidden_layers" not in config:
        return config["text_config"]
    return config


def parse_layer_list(text: str) -> list[int]:
    """``"3,7"`` -> ``[3, 7]`` (the command line's ``--remove-layers``). Raises :class:`DepthError`."""
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise DepthError(
            f"--remove-layers takes layer numbers separated by commas (e.g. 3,7), got {text!r}"
        ) from None
    if not values:
        raise DepthError(f"--remove-layers names no layer: {text!r}")
    return values


def attention_layers(config: Mapping) -> list[int]:
    """The full-attention decoder layers of a hybrid ``config`` dict (``layer_types``); [] without them."""
    types = _holder(config).get("layer_types")
    return [i for i, t in enumerate(types or []) if t == "full_attention"]


def check_removed(removed: Iterable[int], num_layers: int, attention: Iterable[int] = ()) -> list[int]:
    """The sorted, checked layer numbers to remove. Raises :class:`DepthError` for numbers out of range,
    repeated, all layers, or every full-attention layer of ``attention`` (transformers' hybrid cache counts
    the sequence length on a full-attention layer: a hybrid model without one cannot generate)."""
    removed = list(removed)
    bad = [i for i in removed if not isinstance(i, int) or isinstance(i, bool) or not 0 <= i < num_layers]
    if bad:
        raise DepthError(
            f"layers to remove must be decoder layer numbers 0..{num_layers - 1} (as in the input), got {bad}"
        )
    if len(set(removed)) != len(removed):
        raise DepthError(f"layers to remove are repeated: {removed}")
    if len(removed) >= num_layers:
        raise DepthError(f"cannot remove all {num_layers} decoder layers")
    attention = list(attention)
    if attention and set(attention) <= set(removed):
        raise DepthError(
            f"cannot remove every full-attention layer ({attention}): a hybrid model keeps at least one "
            f"(transformers' cache counts the sequence length on it)"
        )
    return sorted(removed)


def layer_numbers(num_layers: int, removed: Iterable[int]) -> dict[int, int]:
    """Old layer number -> new one, for the layers that stay."""
    gone = set(removed)
    kept = [i for i in range(num_layers) if i not in gone]
    return {old: new for new, old in enumerate(kept)}


def removal_name_map(names: Iterable[str], num_layers: int, removed: Iterable[int]) -> dict[str, str | None]:
    """Full tensor name -> its name in the output (None: dropped) for every name that changes: tensors of
    removed decoder layers are dropped, those of later layers renumbered; ``mtp.*`` keeps its names."""
    numbers = layer_numbers(num_layers, removed)
    out: dict[str, str | None] = {}
    for name in names:
        if name.startswith(_PASSTHROUGH):
            continue
        m = _LAYER.search(name)
        if m is None:
            continue
        old = int(m.group(2))
        new = numbers.get(old)
        if new is None:
            out[name] = None
        elif new != old:
            out[name] = f"{name[: m.start()]}{m.group(1)}layers.{new}.{name[m.end() :]}"
    return out


def remove_layers_from_config(config: Mapping, removed: Iterable[int]) -> dict:
    """A copy of the dict ``config`` without the decoder layers ``removed`` (numbers as in ``config``)."""
    out = copy.deepcopy(dict(config))
    holder = _holder(out)
    num_layers = int(holder["num_hidden_layers"])
    removed = check_removed(removed, num_layers, attention_layers(out))
    numbers = layer_numbers(num_layers, removed)
    holder["num_hidden_layers"] = len(numbers)
    if isinstance(holder.get("layer_types"), list):
        holder["layer_types"] = [t for i, t in enumerate(holder["layer_types"]) if i in numbers]
    per_layer = holder.get("per_layer_config")
    if isinstance(per_layer, Mapping):
        kept = {numbers[int(k)]: v for k, v in per_layer.items() if int(k) in numbers}
        if kept:
            width = len(str(max(kept)))
            holder["per_layer_config"] = {str(i).zfill(width): kept[i] for i in sorted(kept)}
        else:
            holder.pop("per_layer_config")
    if "decoder_sparse_step" in holder and holder.get("num_experts"):
        step = int(holder.get("decoder_sparse_step") or 1)
        dense = set(holder.get("mlp_only_layers") or [])
        dense |= {i for i in range(num_layers) if step <= 0 or (i + 1) % step != 0}
        holder["decoder_sparse_step"] = 1
        holder["mlp_only_layers"] = sorted(numbers[i] for i in dense if i in numbers)
    elif isinstance(holder.get("mlp_only_layers"), list):
        holder["mlp_only_layers"] = sorted(numbers[i] for i in holder["mlp_only_layers"] if i in numbers)
    return out


def num_layers_of(config: Mapping) -> int:
    """``num_hidden_layers`` of the (text) config."""
    return int(_holder(config)["num_hidden_layers"])


def compose_names(first: Mapping[str, str | None], then: Mapping[str, str | None]) -> dict[str, str | None]:
    """The name map of ``first`` followed by ``then`` (each: source name -> output name, None: dropped)."""
    out: dict[str, str | None] = {}
    for name, new in first.items():
        out[name] = None if new is None else then.get(new, new)
    for name, new in then.items():
        if name not in first:
            out[name] = new
    return {k: v for k, v in out.items() if v != k}
