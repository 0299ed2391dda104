"""Config access in one place (gdnprune.model.model_config): dicts and config objects read alike, the decoder part
of a multimodal config, per-layer overrides, and the window a model supports. References: the values
written into the configs by hand."""

from __future__ import annotations

import pytest
import transformers

from gdnprune.model.model_config import (
    MTP_PREFIX,
    config_value,
    default_seq_len,
    global_config_value,
    per_layer_overrides,
    text_config,
)

TEXT = {"hidden_size": 64, "num_hidden_layers": 4, "max_position_embeddings": 256, "linear_num_key_heads": 2}
VL = {"model_type": "qwen3_5", "text_config": TEXT, "vision_config": {"depth": 1}}


def test_a_dict_and_an_object_read_alike():
    obj = transformers.Qwen3_5TextConfig(hidden_size=64, num_hidden_layers=4)
    assert config_value(TEXT, "hidden_size") == config_value(obj, "hidden_size") == 64
    assert config_value(TEXT, "missing", 7) == config_value(obj, "missing", 7) == 7


def test_the_text_config_is_the_decoder_part_unless_the_top_level_sets_the_key():
    assert text_config(VL) is TEXT
    assert text_config(TEXT) is TEXT
    both = {**TEXT, "text_config": {"hidden_size": 8}}  # the top level holds the decoder: it wins
    assert text_config(both) is both
    assert text_config(both, "vision_only_key") is both["text_config"]
    vl = transformers.Qwen3_5Config(text_config={"hidden_size": 64, "num_hidden_layers": 4})
    assert text_config(vl) is vl.text_config and text_config(vl.text_config) is vl.text_config


def test_per_layer_overrides_of_a_dict_and_of_an_object():
    raw = {**TEXT, "per_layer_config": {"01": {"intermediate_size": 32, "head_dim": 8}, "3": {"head_dim": 4}}}
    assert per_layer_overrides({"text_config": raw}, {"intermediate_size"}, key="linear_num_key_heads") == {
        1: {"intermediate_size": 32}
    }
    assert per_layer_overrides(raw, {"head_dim"}, key="hidden_size") == {
        1: {"head_dim": 8},
        3: {"head_dim": 4},
    }
    assert per_layer_overrides(TEXT, {"head_dim"}, key="hidden_size") == {}
    obj = transformers.Qwen3_5TextConfig(
        num_hidden_layers=4, linear_num_value_heads=8, per_layer_config={2: {"linear_num_value_heads": 4}}
    )
    assert per_layer_overrides(obj, {"linear_num_value_heads"}, key="linear_num_key_heads") == {
        2: {"linear_num_value_heads": 4}
    }
    assert global_config_value(obj, "linear_num_value_heads") == 8  # plain access raises


@pytest.mark.parametrize(
    "bad, message",
    [([1, 2], "must map layer indices"), ({"x": {}}, "not a layer index"), ({"1": 3}, "must be an object")],
)
def test_a_malformed_per_layer_config_is_a_value_error(bad, message):
    with pytest.raises(ValueError, match=message):
        per_layer_overrides({**TEXT, "per_layer_config": bad}, {"head_dim"}, key="hidden_size")


class _Tokenizer:
    def __init__(self, length):
        self.model_max_length = length


def test_the_default_window_is_the_least_limit_and_says_which():
    assert default_seq_len(VL, cap=512) == (256, "max_position_embeddings 256")
    assert default_seq_len(VL, _Tokenizer(128), cap=512) == (128, "tokenizer model_max_length 128")
    assert default_seq_len(VL, _Tokenizer(10**30), cap=64) == (64, "capped at 64")  # "no limit"
    assert default_seq_len({"max_position_embeddings": True}, cap=32) == (32, "capped at 32")
    obj = transformers.Qwen3_5TextConfig(max_position_embeddings=100)
    assert default_seq_len(obj, cap=2048) == (100, "max_position_embeddings 100")


def test_the_mtp_prefix_names_the_multi_token_prediction_tensors():
    assert "mtp.layers.0.self_attn.q_proj.weight".startswith(MTP_PREFIX)
    assert not "model.layers.0.mtp_gate.weight".startswith(MTP_PREFIX)
