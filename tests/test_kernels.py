"""model.kernels: the CPU gated delta rule against transformers' own rules (the chunked reference and the
token-by-token recurrence), values and gradients, and ``cpu_gdn_kernels`` on a real model."""

from __future__ import annotations

import importlib

import pytest
import torch
from tiny_models import build_model

from gdnprune.gated_delta_net import GDNShape
from gdnprune.model.kernels import GDN_MODELING_MODULES, chunk_gated_delta_rule, cpu_gdn_kernels

NEXT = importlib.import_module("transformers.models.qwen3_next.modeling_qwen3_next")
REFERENCE = NEXT.torch_chunk_gated_delta_rule
RECURRENT = NEXT.torch_recurrent_gated_delta_rule


def _inputs(batch, length, key_heads=2, value_heads=4, key_dim=8, value_dim=6, *, seed=0, state=False):
    gen = torch.Generator().manual_seed(seed)
    x = {
        "query": torch.randn(batch, length, key_heads, key_dim, generator=gen),
        "key": torch.randn(batch, length, key_heads, key_dim, generator=gen),
        "value": torch.randn(batch, length, value_heads, value_dim, generator=gen),
        "g": -2 * torch.rand(batch, length, value_heads, generator=gen),
        "beta": torch.rand(batch, length, value_heads, generator=gen),
    }
    if state:
        x["initial_state"] = torch.randn(batch, value_heads, key_dim, value_dim, generator=gen)
    return x


@pytest.mark.parametrize("length", [1, 5, 16, 37, 64, 130])
@pytest.mark.parametrize("state", [False, True])
@pytest.mark.parametrize("dims", [(8, 6), (32, 48)])  # chunks of 16 (a small head state), of 64
def test_equals_transformers_rules(length, state, dims):
    x = _inputs(2, length, key_dim=dims[0], value_dim=dims[1], state=state)
    ours, our_state = chunk_gated_delta_rule(**x, output_final_state=True, use_qk_l2norm_in_kernel=True)
    theirs, their_state = REFERENCE(**x, output_final_state=True, use_qk_l2norm_in_kernel=True)
    step, step_state = RECURRENT(**x, output_final_state=True, use_qk_l2norm_in_kernel=True)
    assert ours.shape == theirs.shape == (2, length, 4, dims[1])
    for reference, reference_state in ((theirs, their_state), (step, step_state)):
        torch.testing.assert_close(ours, reference, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(our_state, reference_state, rtol=1e-4, atol=1e-5)
    alone, none = chunk_gated_delta_rule(**x, use_qk_l2norm_in_kernel=True)
    assert none is None
    torch.testing.assert_close(alone, theirs, rtol=1e-4, atol=1e-5)


def test_no_normalisation_and_dtype():
    x = {k: v.to(torch.bfloat16) for k, v in _inputs(1, 40, key_heads=4, value_heads=4, seed=3).items()}
    ours, _ = chunk_gated_delta_rule(**x)
    theirs, _ = REFERENCE(**x)
    assert ours.dtype == torch.bfloat16
    torch.testing.assert_close(ours.float(), theirs.float(), rtol=2e-2, atol=2e-2)


def test_gradients_equal_the_reference():
    x = _inputs(2, 45, state=True, seed=1)
    grads = []
    for rule in (chunk_gated_delta_rule, REFERENCE):
        leaves = {k: v.clone().requires_grad_(True) for k, v in x.items()}
        out, last = rule(**leaves, chunk_size=16, output_final_state=True, use_qk_l2norm_in_kernel=True)
        (out.square().sum() + last.sum()).backward()
        grads.append({k: v.grad for k, v in leaves.items()})
    for name in x:
        torch.testing.assert_close(grads[0][name], grads[1][name], rtol=1e-3, atol=1e-4)


def test_packed_sequences_are_refused():
    with pytest.raises(ValueError, match="cu_seqlens"):
        chunk_gated_delta_rule(**_inputs(1, 4), cu_seqlens=torch.tensor([0, 2, 4]))


def test_in_place_on_a_real_model_and_restored():
    model = build_model("qwen3_next", GDNShape(2, 2, 8, 8), seed=4).eval()
    ids = torch.randint(0, model.config.vocab_size, (2, 21), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        before = model(input_ids=ids).logits
        with cpu_gdn_kernels(), cpu_gdn_kernels():  # re-entrant
            assert NEXT.torch_chunk_gated_delta_rule is chunk_gated_delta_rule
            inside = model(input_ids=ids).logits
        assert NEXT.torch_chunk_gated_delta_rule is REFERENCE
    torch.testing.assert_close(inside, before, rtol=1e-4, atol=1e-5)
    assert all(name.startswith("transformers.models.") for name in GDN_MODELING_MODULES)


@pytest.mark.parametrize("length", [8, 33, 130])
def test_a_window_does_not_depend_on_its_batch(length):
    """Sharded statistics add up to the whole only if a window's result is the same in any batch."""
    x = _inputs(5, length, key_heads=1, value_heads=4, key_dim=8, value_dim=4, seed=2)
    with torch.no_grad():
        whole, _ = chunk_gated_delta_rule(**x, chunk_size=16)
        parts = [
            chunk_gated_delta_rule(**{k: v[i:j] for k, v in x.items()}, chunk_size=16)[0]
            for i, j in ((0, 1), (1, 3), (3, 5))
        ]
    assert torch.equal(whole, torch.cat(parts))


def test_float32_under_autocast():
    x = {k: v.to(torch.bfloat16) for k, v in _inputs(1, 20, seed=5).items()}
    reference, _ = chunk_gated_delta_rule(**x)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        ours, _ = chunk_gated_delta_rule(**x)
    assert torch.equal(ours, reference)


def test_the_estimate_models_this_kernel():
    from gdnprune.estimate import work
    from gdnprune.model import kernels

    assert work.SMALL_STATE == kernels.SMALL_STATE and work.SMALL_CHUNK == 16
