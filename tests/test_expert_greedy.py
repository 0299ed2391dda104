"""The measured greedy removal of routed experts (issue 31) against brute force on real MoE blocks.

The reference runs the model's own experts module (transformers) on the MoE inputs of the sampled tokens,
with a router whose removed experts' logits are -inf before its softmax and top-k (the weights then
renormalised when the router renormalises): what the cut model computes, written from the router's
definition. Each greedy step must remove the expert whose removal, given the earlier ones, changes the
routed output least over the sampled tokens.
"""

from __future__ import annotations

import pytest
import torch
from helpers import DENSE_SHAPE, moe_block_inputs, token_ids
from tiny_models import build_model, make_config

from gdnprune.scoring.api import measure_statistics, score_model
from gdnprune.scoring.experts import SAMPLE_PER_WINDOW, SAMPLE_TOKENS
from gdnprune.scoring.payload import scores_from_statistics

NUM_EXPERTS = 6


@pytest.fixture(scope="module", params=["qwen3_5_moe", "qwen3_next-unnormalized"])
def model(request):
    model_type = request.param.split("-")[0]
    config = make_config(model_type, DENSE_SHAPE)
    config.num_experts = NUM_EXPERTS
    model = build_model(model_type, DENSE_SHAPE, seed=4, config=config)
    g = torch.Generator().manual_seed(11)
    with torch.no_grad():  # experts and routers of distinct, sizeable outputs
        for name, p in model.named_parameters():
            if ".mlp." in name and p.dim() > 1:
                p.copy_(torch.randn(p.shape, generator=g) * p.shape[-1] ** -0.5)
    if request.param.endswith("-unnormalized"):
        for module in model.modules():
            if hasattr(module, "norm_topk_prob"):
                module.norm_topk_prob = False
    return model


def _moe_inputs(model, batches, positions):
    """Per MoE prefix: the block's input at ``positions`` of every window, [tokens, H]."""
    return {
        p: torch.cat([x[:, positions] for x in xs]).reshape(-1, xs[0].shape[-1])
        for p, xs in moe_block_inputs(model, batches).items()
    }


def _routed_output(moe, x, removed):
    """The experts module's output on ``x`` with the router choosing among the experts not ``removed``."""
    logits = torch.nn.functional.linear(x, moe.gate.weight)
    logits[:, sorted(removed)] = float("-inf")
    top, index = torch.topk(torch.softmax(logits, dim=-1, dtype=torch.float), moe.gate.top_k, dim=-1)
    if getattr(moe.gate, "norm_topk_prob", True):
        top = top / top.sum(-1, keepdim=True)
    with torch.no_grad():
        return moe.experts(x, index, top.to(x.dtype)).double()


def _check_greedy(model, batches, positions):
    scores = score_model(
        model, batches, blocks=["gdn", "experts"], progress=False, expert_sample_tokens=SAMPLE_TOKENS
    )
    for prefix, x in _moe_inputs(model, batches, positions).items():
        payload = scores["layers"][prefix]
        assert payload["expert_greedy_tokens"] == x.shape[0]
        moe = model.get_submodule(prefix)
        full = _routed_output(moe, x, [])
        frequency = payload["expert_frequency"]  # of every token, the step scale of greedy_frequency
        for name in ("greedy", "greedy_frequency"):
            keep = torch.argsort(-torch.tensor(payload[f"expert_{name}"]), stable=True).tolist()
            removal = keep[::-1]
            for step, chosen in enumerate(removal[:-1]):  # the last removal leaves no expert
                before = removal[:step]
                now = float((_routed_output(moe, x, before) - full).pow(2).sum())
                change = {
                    j: float((_routed_output(moe, x, before + [j]) - full).pow(2).sum())
                    for j in range(NUM_EXPERTS)
                    if j not in before
                }
                rank = {j: c if name == "greedy" else (c - now) * frequency[j] for j, c in change.items()}
                best = min(rank.values())
                assert rank[chosen] <= best + 1e-5 * max(abs(best), 1e-3), (prefix, name, step, rank)
                measured = payload[f"expert_{name}_error"][chosen] * x.shape[0]
                assert measured == pytest.approx(change[chosen], rel=1e-4, abs=1e-7)


def test_each_greedy_step_removes_the_expert_whose_removal_changes_the_routed_output_least(model):
    batches = [token_ids(seed=i, batch=2, seq=10) for i in range(2)]  # every token sampled
    _check_greedy(model, batches, torch.arange(10))


def test_the_sample_takes_evenly_spaced_tokens_of_long_windows(model):
    length = SAMPLE_PER_WINDOW + 16
    batches = [token_ids(seed=5, batch=1, seq=length)]
    _check_greedy(model, batches, torch.arange(SAMPLE_PER_WINDOW) * length // SAMPLE_PER_WINDOW)


def test_shares_of_the_windows_add_up_to_the_greedy_of_one_pass(model):
    batches = [token_ids(seed=i, batch=2, seq=10) for i in range(2)]
    options = dict(blocks=["gdn", "experts"], progress=False, expert_sample_tokens=SAMPLE_TOKENS)
    one = scores_from_statistics(measure_statistics(model, batches, **options))
    first = measure_statistics(model, batches[:1], **options)
    second = measure_statistics(model, batches[1:], window_offset=2, **options)
    for a, b in zip(first.tensors(), second.tensors()):
        a += b
    both = scores_from_statistics(first)
    moe = [p for p, payload in one["layers"].items() if payload.get("kind") == "experts"]
    assert moe
    for prefix in moe:
        payload = one["layers"][prefix]
        assert both["layers"][prefix]["expert_greedy"] == payload["expert_greedy"]
        assert both["layers"][prefix]["expert_greedy_tokens"] == 40
        torch.testing.assert_close(
            torch.tensor(both["layers"][prefix]["expert_greedy_error"]),
            torch.tensor(payload["expert_greedy_error"]),
        )


def test_without_a_sample_there_is_no_greedy_order_and_the_default_order_is_unchanged(model):
    batches = [token_ids(seed=1, batch=2, seq=10)]
    plain = score_model(model, batches, blocks=["gdn", "experts"], progress=False)
    sampled = score_model(
        model, batches, blocks=["gdn", "experts"], progress=False, expert_sample_tokens=SAMPLE_TOKENS
    )
    for prefix, payload in plain["layers"].items():
        if payload.get("kind") == "experts":
            assert "expert_greedy" not in payload and "expert_greedy" in sampled["layers"][prefix]
            assert payload["expert_measure"] == sampled["layers"][prefix]["expert_measure"]
            assert (
                payload["expert_order_most_important_first"]
                == sampled["layers"][prefix]["expert_order_most_important_first"]
            )
    with pytest.raises(ValueError, match="expert_sample_tokens"):
        score_model(model, batches, progress=False, expert_sample_tokens=-1)
