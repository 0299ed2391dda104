"""Per-layer GatedDeltaNet hybrids for plain transformers, written into a model folder by
``gdnprune slice/prune --self-contained``. It needs only transformers (and torch); not gdnprune.

The folder's ``config.json`` gives some decoder layers their own GDN, attention or MLP sizes in
``per_layer_config`` (transformers' heterogeneous configs). transformers reads that config, but its Qwen3.5,
Qwen3.5-MoE, Qwen3-Next and OLMo-hybrid modeling builds every layer from the global config and stops with
``AmbiguousGlobalPerLayerAttributeError``. ``auto_map`` in ``config.json`` points
``AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)`` to this file, whose classes are
transformers' own classes of the same name, except that while one is constructed, every decoder layer and
every GatedDeltaNet module of its family is built from its own layer's config
(``config.per_layer_config[layer_idx]``). Weight loading, dtypes, device maps, the cache, generation and
``save_pretrained`` are transformers'. With a config that is not heterogeneous the classes are exactly
transformers' classes.

A class is made on first use: ``modeling_gdnprune.Qwen3_5ForCausalLM`` is
``transformers.Qwen3_5ForCausalLM`` built per layer (any class of these families works).
"""

import functools
import sys
import threading

import transformers

_LOCK = threading.RLock()
#: the config attribute that lets a heterogeneous config's global keys be read (transformers' heterogeneity)
_GLOBAL_ACCESS = "allow_global_per_layer_attribute_access"
_UNSET = object()


def _per_layer_classes(module):
    """The classes of ``module`` (a transformers modeling module) built once per layer."""
    return [obj for name, obj in vars(module).items() if isinstance(obj, type) and obj.__module__ == module.__name__
            and name.endswith(("GatedDeltaNet", "DecoderLayer")) and "__init__" in obj.__dict__]


def _own_layer_config(original):
    @functools.wraps(original)
    def __init__(self, config, layer_idx=None, *args, **kwargs):
        if layer_idx is None:
            return original(self, config, *args, **kwargs)
        if getattr(config, "is_heterogeneous", False):
            config = config.per_layer_config[layer_idx]
        return original(self, config, layer_idx, *args, **kwargs)

    return __init__


def _heterogeneous(base):
    """A subclass of the transformers model class ``base`` (same name) that builds each layer from its config."""
    layers = _per_layer_classes(sys.modules[base.__module__])
    if not any(c.__name__.endswith("GatedDeltaNet") for c in layers):
        raise AttributeError(f"{base.__name__} of transformers {transformers.__version__} is not a model class of a "
                             f"GatedDeltaNet hybrid (Qwen3.5, Qwen3.5-MoE, Qwen3-Next, OLMo-hybrid)")

    def __init__(self, config, *args, **kwargs):
        # MoE model classes read num_experts globally (the router aux loss): they get the global key, which
        # holds the most common count; the aux loss of per-layer expert counts is not defined (leave
        # output_router_logits off). Every layer is built from its own config.
        text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
        holders = [config] if text is config else [config, text]
        with _LOCK:  # the layer classes are shared: built per layer only while this model is constructed
            originals = {cls: cls.__dict__["__init__"] for cls in layers}
            before = [c.__dict__.get(_GLOBAL_ACCESS, _UNSET) for c in holders]
            for cls, original in originals.items():
                cls.__init__ = _own_layer_config(original)
            for c in holders:
                c.__dict__[_GLOBAL_ACCESS] = True
            try:
                base.__init__(self, config, *args, **kwargs)
            finally:
                for cls, original in originals.items():
                    cls.__init__ = original
                for c, value in zip(holders, before):
                    if value is _UNSET:
                        c.__dict__.pop(_GLOBAL_ACCESS, None)
                    else:
                        c.__dict__[_GLOBAL_ACCESS] = value

    return type(base.__name__, (base,), {"__init__": __init__, "__module__": __name__, "__qualname__": base.__name__,
                                         "__doc__": f"{base.__name__}, built layer by layer (per_layer_config)."})


def __getattr__(name):
    """``modeling_gdnprune.X``: transformers' model class ``X`` built layer by layer (made on first use)."""
    base = getattr(transformers, name, None) if not name.startswith("_") else None
    if not isinstance(base, type) or not issubclass(base, transformers.PreTrainedModel):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    with _LOCK:
        made = globals().get(name)
        if made is None:
            made = globals()[name] = _heterogeneous(base)
        return made
