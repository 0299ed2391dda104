"""The latency harness (:mod:`gdnprune.model.latency`) on real tiny transformers models.

Nothing here compares timings with thresholds: the checks are structural (which module the harness calls,
how often, with which shapes, over a cache of how many tokens), and the references are the model's own
geometry (module attributes, the config) and hooks registered by the test itself.
"""

from __future__ import annotations

import copy

import pytest
import transformers
from tiny_models import build_model

from gdnprune.gated_delta_net import GDNShape
from gdnprune.model.latency import (
    LatencyHarness,
    Timing,
    Workload,
    WorkloadError,
    block_latencies,
    model_latency,
    parse_workload,
)

SHAPE = GDNShape(num_key_heads=2, num_value_heads=4, key_head_dim=16, value_head_dim=16)
PREFILL = Workload("prefill", 2, 70)  # longer than the 64-token chunk of the GDN kernel
DECODE = Workload("decode", 2, 70)


@pytest.fixture(scope="module")
def model():
    return build_model("qwen3_5", SHAPE)


def _layers(model):
    return list(model.model.layers)


def _counter(module, seen: list):
    """A pre-hook on ``module`` that keeps (hidden-state shape, kwargs) of every call."""

    def hook(mod, args, kwargs):
        hidden = args[0] if args else kwargs["hidden_states"]
        seen.append((tuple(hidden.shape), dict(kwargs)))

    return module.register_forward_pre_hook(hook, with_kwargs=True)


# -- workloads ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, expected",
    [
        ("prefill:1:2048", Workload("prefill", 1, 2048)),
        ("decode:8:4096", Workload("decode", 8, 4096)),
        (" Decode:3:5 ", Workload("decode", 3, 5)),
    ],
)
def test_parse_workload(text, expected):
    workload = parse_workload(text)
    assert workload == expected
    assert str(workload) == text.strip().lower()


def test_workload_tokens():
    assert Workload("prefill", 3, 100).tokens == 300
    assert Workload("decode", 3, 100).tokens == 3


@pytest.mark.parametrize(
    "text, says",
    [
        ("prefill:1", "PHASE:BATCH:CONTEXT"),
        ("decode:1:2:3", "PHASE:BATCH:CONTEXT"),
        ("", "PHASE:BATCH:CONTEXT"),
        ("train:1:2", "prefill, decode"),
        ("prefill:0:8", "batch: expected an integer >= 1, got 0"),
        ("decode:2:-4", "context: expected an integer >= 1, got -4"),
        ("prefill:two:8", "batch must be an integer"),
        ("prefill:2:8k", "context must be an integer"),
    ],
)
def test_parse_workload_errors(text, says):
    with pytest.raises(WorkloadError) as info:
        parse_workload(text)
    assert isinstance(info.value, ValueError)
    assert says in str(info.value)
    assert "\n" not in str(info.value)


def test_workload_fields_checked():
    with pytest.raises(WorkloadError, match="batch"):
        Workload("prefill", True, 4)
    with pytest.raises(WorkloadError, match="context"):
        Workload("decode", 1, 2.0)


# -- timings ------------------------------------------------------------------------------------------------


def test_timing_units():
    t = Timing(workload=Workload("prefill", 2, 50), seconds=0.5, repeats=(0.4, 0.5, 0.9), device="cpu")
    assert t.tokens_per_second == pytest.approx(200.0)
    assert t.ms_per_token == pytest.approx(5.0)
    d = t.to_dict()
    assert d["workload"] == "prefill:2:50" and d["repeats"] == [0.4, 0.5, 0.9]
    assert d["tokens_per_second"] == pytest.approx(200.0)


@pytest.mark.parametrize("workload", [PREFILL, DECODE], ids=str)
def test_block_latencies_positive_and_median(model, workload):
    layers = _layers(model)
    candidates = [(layers[0].linear_attn, None), (layers[1].self_attn, None), (layers[0].mlp, None)]
    candidates += [(layer, None) for layer in layers]
    harness = LatencyHarness(model, workload, repeats=3, warmup=1)
    timings = harness.block_latencies(candidates)
    assert len(timings) == len(candidates)
    for t in timings:
        assert t.seconds > 0 and len(t.repeats) == 3
        assert t.seconds == sorted(t.repeats)[1]  # the median of three
        assert t.workload == workload and t.device == "cpu"
        assert t.peak_memory_bytes is None or t.peak_memory_bytes >= t.memory_growth_bytes >= 0
    assert harness.calls == len(candidates) * 4


def test_prefill_block_calls_and_shapes(model):
    gdn = _layers(model)[2].linear_attn
    harness = LatencyHarness(model, PREFILL, repeats=4, warmup=2)
    harness.prepare([gdn])
    seen: list = []
    handle = _counter(gdn, seen)
    try:
        t = harness.block_latency(gdn)
    finally:
        handle.remove()
    assert len(seen) == 2 + 4  # warm-up + repeats, nothing else
    assert {shape for shape, _ in seen} == {(2, 70, model.config.hidden_size)}
    assert all(kwargs.get("cache_params") is None for _, kwargs in seen)
    assert len(t.repeats) == 4


def test_decode_attention_sees_a_cache_of_context_tokens(model):
    layer = _layers(model)[1]
    attention = layer.self_attn
    harness = LatencyHarness(model, DECODE, repeats=3, warmup=2)
    harness.prepare([attention])
    seen: list = []
    lengths: list = []

    def before(mod, args, kwargs):
        lengths.append(kwargs["past_key_values"].layers[1].get_seq_length())

    handles = [_counter(attention, seen), attention.register_forward_pre_hook(before, with_kwargs=True)]
    try:
        harness.block_latency(attention)
    finally:
        for handle in handles:
            handle.remove()
    # one prefill of CONTEXT tokens fills the block's own cache, then warm-up + repeats decode steps
    assert [shape for shape, _ in seen] == [(2, 70, 64)] + [(2, 1, 64)] * 5
    assert lengths == [0] + [70] * 5
    cache = seen[-1][1]["past_key_values"]
    keys = cache.layers[1].keys
    kv_heads, head_dim = model.config.num_key_value_heads, model.config.head_dim
    assert tuple(keys.shape) == (2, kv_heads, 70, head_dim)  # trimmed back after the last step


def test_decode_gdn_state_of_the_replacement(model):
    """A cut GDN module timed in place of the original gets a recurrent state of its own (smaller) shape."""
    original = _layers(model)[0].linear_attn
    small = GDNShape(num_key_heads=1, num_value_heads=2, key_head_dim=16, value_head_dim=8)
    config = small.apply_to_config(copy.deepcopy(model.config))
    cut = transformers.models.qwen3_5.modeling_qwen3_5.Qwen3_5GatedDeltaNet(config, layer_idx=0).eval()
    harness = LatencyHarness(model, DECODE, repeats=2, warmup=1)
    harness.prepare([original])
    seen_cut: list = []
    seen_original: list = []
    handles = [_counter(cut, seen_cut), _counter(original, seen_original)]
    try:
        harness.block_latency(original, cut)
    finally:
        for handle in handles:
            handle.remove()
    assert seen_original == []  # the replacement is timed, not the original
    assert len(seen_cut) == 1 + 1 + 2
    cache = seen_cut[-1][1]["cache_params"]
    state = cache.layers[0].recurrent_states[0]
    assert tuple(state.shape) == (2, small.num_value_heads, small.key_head_dim, small.value_head_dim)
    conv = cache.layers[0].conv_states[0]
    assert conv.shape[:2] == (2, 2 * small.num_key_heads * small.key_head_dim + small.num_value_heads * 8)


def test_model_decode_keeps_context_tokens(model):
    attention = _layers(model)[3].self_attn
    lengths: list = []

    def before(mod, args, kwargs):
        lengths.append(kwargs["past_key_values"].layers[3].get_seq_length())

    handle = attention.register_forward_pre_hook(before, with_kwargs=True)
    try:
        harness = LatencyHarness(model, DECODE, repeats=3, warmup=1)
        t = harness.model_latency()
    finally:
        handle.remove()
    # the prefill that builds the cache (empty before it), the recorded step, then warm-up and repeats: every
    # step over exactly CONTEXT cached tokens
    assert lengths == [0] + [70] * 5
    assert t.tokens_per_second == pytest.approx(2 / t.seconds)


def test_fixed_latency_skips_the_decoder_layers(model):
    layers = _layers(model)
    seen: list = []
    handles = [_counter(layer, seen) for layer in layers]
    try:
        for workload in (PREFILL, DECODE):
            harness = LatencyHarness(model, workload, repeats=2, warmup=1)
            harness.prepare([layers[0]])  # decode: the model's cache of CONTEXT tokens is built here
            seen.clear()
            t = harness.fixed_latency()
            assert seen == [] and t.seconds > 0
    finally:
        for handle in handles:
            handle.remove()
    assert list(model.model.layers) == layers  # put back


def test_model_latency_runs_every_layer_once_per_call(model):
    seen: list = []
    handles = [_counter(layer, seen) for layer in _layers(model)]
    try:
        t = model_latency(model, PREFILL, repeats=2, warmup=1)
    finally:
        for handle in handles:
            handle.remove()
    assert len(seen) == 3 * len(_layers(model))
    assert {shape for shape, _ in seen} == {(2, 70, 64)}
    assert t.tokens_per_second == pytest.approx(140 / t.seconds)


def test_a_module_outside_the_layers_is_refused(model):
    with pytest.raises(ValueError, match="not inside one of the decoder's layers"):
        block_latencies(model, PREFILL, [(model.lm_head, None)], repeats=1, warmup=0)
    with pytest.raises(ValueError, match="repeats"):
        LatencyHarness(model, PREFILL, repeats=0)


@pytest.mark.parametrize("model_type", ["qwen3_next", "olmo_hybrid", "qwen3_5_moe"])
def test_other_families_decode(model_type):
    other = build_model(model_type, SHAPE)
    layers = list(other.model.layers)
    mixers = [getattr(layer, "linear_attn", None) or layer.self_attn for layer in layers[:2]]
    candidates = [(m, None) for m in mixers] + [(layers[0].mlp, None), (layers[1], None)]
    harness = LatencyHarness(other, Workload("decode", 1, 9), repeats=2, warmup=1)
    timings = harness.block_latencies(candidates)
    assert all(t.seconds > 0 for t in timings)
    assert harness.model_latency().seconds > 0
