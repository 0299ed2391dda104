"""Reading a transformers model config, as a dict (``config.json``) or a config object, without torch.

The one place that knows how a config is accessed: a key of a dict or an attribute of an object
(:func:`config_value`), the global value of a heterogeneous transformers config whose per-layer attributes
raise when read globally (:func:`global_config_value`), the part that holds the decoder of a multimodal
model (:func:`text_config`), the per-layer overrides of transformers' ``per_layer_config``
(:func:`per_layer_overrides`) and the longest window a model supports (:func:`default_seq_len`). The
multi-token-prediction head's tensors (:data:`MTP_PREFIX`) are named here too: every command passes them
through.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any

__all__ = [
    "MTP_PREFIX",
    "config_value",
    "global_config_value",
    "text_config",
    "per_layer_overrides",
    "default_seq_len",
]

#: tensor names of the multi-token-prediction head (``mtp.*``): never a decoder layer's, copied unchanged
MTP_PREFIX = "mtp."


def config_value(config: Any, key: str, default: Any = None) -> Any:
    """``config[key]`` for dicts, ``config.key`` for config objects; ``default`` when it is missing."""
    if isinstance(config, Mapping):
        return config.get(key, default)
    return getattr(config, key, default)


def global_config_value(config: Any, key: str, default: Any = None) -> Any:
    """Like :func:`config_value`, but a heterogeneous transformers config gives its global value instead of
    raising (transformers' ``AmbiguousGlobalPerLayerAttributeError``)."""
    raw = getattr(config, "_getattr_without_heterogeneous_validation", None)
    if raw is not None and not isinstance(config, Mapping):
        return raw(key, default)
    return config_value(config, key, default)


def text_config(config: Any, key: str = "num_hidden_layers") -> Any:
    """The part of ``config`` that holds the decoder: its ``text_config`` (a multimodal model's) when it has
    one and does not set ``key`` itself, else the config."""
    sub = config_value(config, "text_config")
    if sub is not None and global_config_value(config, key) is None:
        return sub
    return config


def per_layer_overrides(config: Any, keys: Collection[str], *, key: str) -> dict[int, dict[str, Any]]:
    """``{layer_index: {k: value}}`` for the config ``keys`` that a heterogeneous config sets per layer.

    Reads transformers' ``per_layer_config`` (zero-padded string keys in JSON) from a dict config, or the
    heterogeneity spec of a config object, in :func:`text_config` (``key`` as there); empty for a uniform
    config.

    Raises:
        ValueError: a ``per_layer_config`` that is not ``{layer index: {attribute: value}}``.
    """
    holder = text_config(config, key)
    if isinstance(holder, Mapping):
        raw = holder.get("per_layer_config")
    else:
        spec = getattr(holder, "__dict__", {}).get("_heterogeneity_spec")
        raw = None if spec is None else spec.per_layer_overrides
    if raw is None:
        return {}
    if not isinstance(raw, Mapping):
        raise ValueError(f"per_layer_config must map layer indices to objects, found {type(raw).__name__}")
    out = {}
    for index_key, overrides in raw.items():
        try:
            index = int(index_key)
        except (TypeError, ValueError):
            raise ValueError(f"per_layer_config key {index_key!r} is not a layer index") from None
        if not isinstance(overrides, Mapping):
            raise ValueError(
                f"per_layer_config[{index_key!r}] must be an object, found {type(overrides).__name__}"
            )
        chosen = {k: v for k, v in overrides.items() if k in keys}
        if chosen:
            out[index] = chosen
    return out


def default_seq_len(config: Any, tokenizer: Any = None, *, cap: int) -> tuple[int, str]:
    """The longest window a model supports, at most ``cap``: the least of ``cap``, the (text) config's
    ``max_position_embeddings`` and the tokenizer's ``model_max_length`` when they are set; and why, in words
    (``"capped at 512"``, ``"max_position_embeddings 256"``, ``"tokenizer model_max_length 128"``)."""
    limits = [(cap, f"capped at {cap}")]
    positions = global_config_value(text_config(config), "max_position_embeddings")
    if isinstance(positions, int) and not isinstance(positions, bool) and positions > 1:
        limits.append((positions, f"max_position_embeddings {positions}"))
    length = getattr(tokenizer, "model_max_length", None)
    if isinstance(length, int) and 1 < length < 1_000_000:  # transformers says "no limit" with a huge number
        limits.append((length, f"tokenizer model_max_length {length}"))
    value = min(v for v, _ in limits)
    return value, next(why for v, why in limits if v == value)
