"""The transformers internals that gdnprune relies on, asserted directly, so that a transformers release
that changes them fails here by name (and not as a wrong shape deep inside a load). pyproject.toml bounds
transformers above the last version CI tests (``<5.24`` while 5.23 is pinned); raise the bound only with
this file green on the new version.

What relies on what:
- :mod:`gdnprune.io.loading` wraps the ``__init__`` of the ``*GatedDeltaNet`` and ``*DecoderLayer`` classes of
  each family's modeling module (called as ``(config, layer_idx)``) and of its ``*ForCausalLM`` /
  ``*ForConditionalGeneration`` heads (called as ``(config)``); it reads ``config.is_heterogeneous`` and
  ``config.per_layer_config[i]``, sets ``allow_global_per_layer_attribute_access`` in the config's
  ``__dict__``, and resolves an Auto class through ``_model_mapping[type(config)]``.
- :mod:`gdnprune.model.model_config` reads a heterogeneous config's global value with
  ``_getattr_without_heterogeneous_validation`` and its overrides from ``__dict__["_heterogeneity_spec"]
  .per_layer_overrides``.
"""

from __future__ import annotations

import importlib
import inspect
import re
from pathlib import Path

import pytest
import transformers
from packaging.version import Version

from gdnprune.model.model_config import global_config_value, per_layer_overrides

FAMILIES = {
    "qwen3_5": ("Qwen3_5TextConfig", "Qwen3_5"),
    "qwen3_5_moe": ("Qwen3_5MoeTextConfig", "Qwen3_5Moe"),
    "qwen3_next": ("Qwen3NextConfig", "Qwen3Next"),
    "olmo_hybrid": ("OlmoHybridConfig", "OlmoHybrid"),
}


def _pyproject_bound() -> Version:
    """The upper bound of transformers in pyproject.toml's dependencies."""
    text = (Path(__file__).resolve().parents[1] / "pyproject.toml").read_text(encoding="utf-8")
    (spec,) = re.findall(r'^\s*"transformers([^"]*)"', text, flags=re.M)
    (bound,) = [part.strip()[1:] for part in spec.split(",") if part.strip().startswith("<")]
    return Version(bound)


def test_the_installed_transformers_is_below_the_bound_that_pyproject_declares():
    assert Version(transformers.__version__) < _pyproject_bound()


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_the_classes_loading_wraps_exist_with_the_arguments_it_passes(family):
    modeling = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    classes = {name: obj for name, obj in vars(modeling).items() if isinstance(obj, type)}
    gdn = [c for n, c in classes.items() if n.endswith("GatedDeltaNet")]
    layers = [c for n, c in classes.items() if n.endswith("DecoderLayer")]
    heads = [c for n, c in classes.items() if n.endswith(("ForCausalLM", "ForConditionalGeneration"))]
    assert gdn and layers and heads
    for cls in gdn + layers:
        if "__init__" in cls.__dict__:  # wrapped as __init__(self, config, layer_idx, ...)
            assert list(inspect.signature(cls.__init__).parameters)[:3] == ["self", "config", "layer_idx"]
    for cls in heads:
        if "__init__" in cls.__dict__:  # wrapped as __init__(self, config, ...)
            assert list(inspect.signature(cls.__init__).parameters)[:2] == ["self", "config"]


def test_a_heterogeneous_config_has_the_attributes_gdnprune_reads():
    config = transformers.Qwen3_5TextConfig(
        num_hidden_layers=4,
        linear_num_value_heads=8,
        per_layer_config={1: {"linear_num_value_heads": 4}},
    )
    assert config.is_heterogeneous
    with pytest.raises(transformers.integrations.heterogeneity.AmbiguousGlobalPerLayerAttributeError):
        _ = config.linear_num_value_heads
    assert config._getattr_without_heterogeneous_validation("linear_num_value_heads", None) == 8
    assert global_config_value(config, "linear_num_value_heads") == 8
    assert config.__dict__["_heterogeneity_spec"].per_layer_overrides == {1: {"linear_num_value_heads": 4}}
    assert per_layer_overrides(config, {"linear_num_value_heads"}, key="linear_num_key_heads") == {
        1: {"linear_num_value_heads": 4}
    }
    assert config.per_layer_config[1].linear_num_value_heads == 4
    assert config.per_layer_config[0].linear_num_value_heads == 8
    config.__dict__["allow_global_per_layer_attribute_access"] = True  # what loading's head wrapper sets
    assert config.linear_num_value_heads == 8


def test_an_auto_class_maps_a_config_type_to_its_model_class():
    mapping = transformers.AutoModelForCausalLM._model_mapping
    assert mapping[transformers.Qwen3_5TextConfig] is transformers.Qwen3_5ForCausalLM
    assert mapping[transformers.Qwen3NextConfig] is transformers.Qwen3NextForCausalLM
