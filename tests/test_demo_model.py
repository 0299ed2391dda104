"""The bundled byte-level demo model, its tokenizer and the demo corpus (gdnprune.demo_data)."""

from __future__ import annotations

import math

import pytest
import torch

from gdnprune import demo_data

UNIFORM_BYTE_LOSS = math.log(256)  # ~5.545 nats/byte


@pytest.fixture(scope="module")
def bundled():
    from transformers import AutoTokenizer, Qwen3_5ForCausalLM

    path = demo_data.demo_model_path()
    model, info = Qwen3_5ForCausalLM.from_pretrained(path, output_loading_info=True)
    model.eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    return model, info, tokenizer


def test_bundled_files_are_package_data():
    path = demo_data.demo_model_path()
    assert path.parts[-3:] == ("gdnprune", "data", "demo_model")
    names = {p.name for p in path.iterdir()}
    assert {
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "training.json",
    } <= names
    size = sum(p.stat().st_size for p in path.iterdir() if p.is_file())
    assert size < 8_000_000, f"bundled demo model is {size} bytes, expected a few MB"


def test_bundled_model_loads_without_missing_or_unexpected_keys(bundled):
    model, info, _ = bundled
    assert not info["missing_keys"]
    assert not info["unexpected_keys"]
    assert not info["mismatched_keys"]
    assert all(p.dtype == torch.float32 for p in model.parameters())


def test_bundled_config_has_the_demo_gdn_geometry(bundled):
    model, _, tokenizer = bundled
    cfg = model.config
    assert cfg.model_type == "qwen3_5_text"
    assert cfg.hidden_size == 128
    assert cfg.layer_types == ["linear_attention", "linear_attention", "linear_attention", "full_attention"]
    assert (cfg.linear_num_key_heads, cfg.linear_num_value_heads) == (4, 8)
    assert (cfg.linear_key_head_dim, cfg.linear_value_head_dim) == (32, 32)
    assert cfg.linear_conv_kernel_dim == 4
    assert cfg.vocab_size == len(tokenizer) == 257
    gdn = model.model.layers[0].linear_attn
    assert (gdn.num_k_heads, gdn.num_v_heads, gdn.head_k_dim, gdn.head_v_dim) == (4, 8, 32, 32)
    assert 0.5e6 < sum(p.numel() for p in model.parameters()) < 2e6


def test_tokenizer_ids_are_utf8_bytes_and_round_trip(bundled):
    _, _, tokenizer = bundled
    assert tokenizer.eos_token == demo_data.EOS_TOKEN
    assert tokenizer.eos_token_id == 256
    text = (
        "  two leading spaces\n\n\ttab, CRLF\r\n é ñ 中文 🙂 \x00\x7f trailing  \n"
        + demo_data.validation_text()[:2000]
    )
    ids = tokenizer(text)["input_ids"]
    assert ids == list(text.encode("utf-8"))
    assert tokenizer.decode(ids) == text
    assert torch.equal(demo_data.text_to_ids(text, tokenizer), demo_data.text_to_ids(text))


def test_split_partitions_the_corpus():
    blocks = demo_data.corpus_blocks()
    assert "".join(blocks) == demo_data.corpus_text()
    assert all(len(b) == demo_data.BLOCK_CHARS for b in blocks[:-1])
    val = "".join(blocks[demo_data.VALIDATION_EVERY - 1 :: demo_data.VALIDATION_EVERY])
    assert demo_data.validation_text() == val
    assert len(demo_data.train_text()) + len(val) == len(demo_data.corpus_text())
    assert 0.08 < len(val) / len(demo_data.corpus_text()) < 0.12
    assert len(demo_data.corpus_sha256()) == 64


def test_byte_windows_are_fixed_non_overlapping_slices():
    text = demo_data.validation_text()
    ids = demo_data.text_to_ids(text)
    every = demo_data.byte_windows(text, 256)
    assert every.dtype == torch.long and every.shape == (ids.numel() // 256, 256)
    assert torch.equal(every.reshape(-1), ids[: every.numel()])
    some = demo_data.byte_windows(text, 256, 32)
    assert some.shape == (32, 256)
    assert torch.equal(some, demo_data.byte_windows(text, 256, 32))
    # every kept window is one of the non-overlapping windows, in text order, first and last included
    match = (some[:, None, :] == every[None, :, :]).all(-1).int().argmax(1)
    assert torch.equal(every[match], some)
    assert match[0] == 0 and match[-1] == every.shape[0] - 1 and bool((match.diff() > 0).all())
    with pytest.raises(ValueError):
        demo_data.byte_windows(text, 256, every.shape[0] + 1)


def test_validation_loss_matches_the_training_record(bundled):
    model, _, _ = bundled
    record = demo_data.demo_training_record()
    loss = demo_data.validation_loss(model)
    assert loss < UNIFORM_BYTE_LOSS - 3.0, f"validation loss {loss:.3f} is not far below ln 256"
    if record["corpus"]["sha256"] != demo_data.corpus_sha256():
        pytest.skip("this Python's pydoc topics differ from the training corpus; loss not comparable")
    assert abs(loss - record["validation_loss"]) < 0.02
    assert model.training is False
