"""Which transformers class builds a model folder's model, and building it with per-layer GDN geometries: the
part of loading that reads no weight (``per_layer_gdn_modules``, ``resolve_class``, ``heterogeneous``, and
``empty_pretrained``: the model on the ``meta`` device). :mod:`.sharded_loading` fills such a model from the
files; :mod:`.loading` loads through ``from_pretrained``."""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import sys
import threading
from collections.abc import Iterator
from typing import Any

import torch
import transformers

from ..model.geometry import GDN_CONFIG_KEYS
from ..model.model_config import per_layer_overrides, text_config
from ..model.subblock_geometry import KINDS

__all__ = ["per_layer_gdn_modules", "resolve_class", "heterogeneous", "empty_pretrained"]

#: transformers' logger of heterogeneous configs (its warnings go to the terminal, past gdnprune's CLI)
_HETEROGENEITY_LOG = logging.getLogger("transformers.integrations.heterogeneity.configuration_utils")
_LOCK = threading.RLock()


def _gdn_classes(model_class: type) -> list[type]:
    """The GatedDeltaNet module classes of the modeling file that defines ``model_class``."""
    return _classes(model_class, "GatedDeltaNet")


def _classes(model_class: type, suffix: str) -> list[type]:
    module = sys.modules[model_class.__module__]
    return [obj for name, obj in vars(module).items() if isinstance(obj, type) and name.endswith(suffix)]


@contextlib.contextmanager
def per_layer_gdn_modules(model_class: type) -> Iterator[None]:
    """While inside, the GDN modules and the decoder layers (so their attention and MLP too) of
    ``model_class``'s family are built from their layer's own config when the model config is
    heterogeneous (``config.per_layer_config[layer_idx]``)."""
    classes = _gdn_classes(model_class)
    layers = _classes(model_class, "DecoderLayer")
    if not classes:
        raise ValueError(
            f"{model_class.__name__}: no GatedDeltaNet module class in {model_class.__module__}; "
            f"per-layer GDN geometries are supported for the Qwen3.5, Qwen3-Next and OLMo-hybrid "
            f"families"
        )
    heads = [
        c
        for c in _classes(model_class, "ForCausalLM") + _classes(model_class, "ForConditionalGeneration")
        if "__init__" in c.__dict__
    ]
    with _LOCK:
        originals = {cls: cls.__dict__["__init__"] for cls in classes + layers if "__init__" in cls.__dict__}
        globals_ = {cls: cls.__dict__["__init__"] for cls in heads}
        for cls, original in globals_.items():

            @functools.wraps(original)
            def head_init(self, config, *args, _original=original, **kwargs):
                # MoE heads read num_experts globally (router aux loss): the most common count, as config.json's
                # global key holds it; the aux loss of per-layer expert counts is not defined (leave
                # output_router_logits off)
                text = text_config(config)
                before = {
                    id(c): c.__dict__.get("allow_global_per_layer_attribute_access") for c in (config, text)
                }
                for c in (config, text):
                    c.__dict__["allow_global_per_layer_attribute_access"] = True
                level = _HETEROGENEITY_LOG.level  # its warning that the global value is read: read on purpose
                _HETEROGENEITY_LOG.setLevel(logging.ERROR)
                try:
                    _original(self, config, *args, **kwargs)
                finally:
                    _HETEROGENEITY_LOG.setLevel(level)
                    for c in (config, text):
                        if before[id(c)] is None:
                            c.__dict__.pop("allow_global_per_layer_attribute_access", None)
                        else:
                            c.__dict__["allow_global_per_layer_attribute_access"] = before[id(c)]

            setattr(cls, "__init__", head_init)  # noqa: B010  (mypy: assigning __init__ is unsound)
        originals.update(globals_)
        for cls, original in originals.items():
            if cls in globals_:
                continue

            @functools.wraps(original)
            def init(self, config, layer_idx=None, *args, _original=original, **kwargs):
                if layer_idx is not None and getattr(config, "is_heterogeneous", False):
                    config = config.per_layer_config[layer_idx]
                _original(self, config, layer_idx, *args, **kwargs)

            setattr(cls, "__init__", init)  # noqa: B010
        try:
            yield
        finally:
            for cls, original in originals.items():
                setattr(cls, "__init__", original)  # noqa: B010


def resolve_class(config: Any, model_class: Any) -> tuple[Any, type]:
    """The class to call ``from_pretrained`` on, and the concrete model class it builds (the same class
    unless ``model_class`` is an Auto class)."""
    if model_class is None:
        names = getattr(config, "architectures", None) or []
        found = [getattr(transformers, name, None) for name in names]
        model_class = next((c for c in found if c is not None), transformers.AutoModelForCausalLM)
    mapping = getattr(model_class, "_model_mapping", None)
    if mapping is not None:  # an Auto class: the concrete class it picks for this config
        try:
            return model_class, mapping[type(config)]
        except KeyError:
            raise ValueError(f"{model_class.__name__} cannot load a {type(config).__name__}") from None
    return model_class, model_class


def heterogeneous(config: Any) -> bool:
    """Whether ``config`` sets a GDN, attention or MLP geometry per layer."""
    keys = set(GDN_CONFIG_KEYS).union(*(kind.config_keys for kind in KINDS.values()))
    return bool(per_layer_overrides(config, keys, key="linear_num_key_heads"))


def empty_pretrained(path: str | os.PathLike, *, model_class: Any = None, dtype: Any = None) -> Any:
    """The model :func:`load_pretrained` would load (same class choice), built on the ``meta`` device from
    the folder's config alone, in ``dtype`` (default: float32), weights tied as the config says. Built as
    ``from_pretrained`` builds it: parameters created in ``dtype``, buffers that transformers computes in
    float32 (the rotary frequencies) kept in float32, ``config.dtype`` set to ``dtype``."""

    config = transformers.AutoConfig.from_pretrained(path)
    _, concrete = resolve_class(config, model_class)
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    per_layer = heterogeneous(text) or heterogeneous(config)
    with per_layer_gdn_modules(concrete) if per_layer else contextlib.nullcontext(), torch.device("meta"):
        model = concrete._from_config(config, dtype=dtype or torch.float32)  # type: ignore[attr-defined]
    return model.eval()
