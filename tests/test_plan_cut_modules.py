"""The plan's cut sub-block modules (``BlockToPlan.build``: what the measured and successive-halving
sensitivities run) on the trained tiny OLMo-hybrid and Qwen3-Next models: the model with the built module in
place gives the logits of an independent reference. Qwen3-Next attention and every MLP / shared expert: the
full model with the removed heads' ``o_proj`` columns or the removed channels' ``down_proj`` columns zeroed.
OLMo-hybrid attention, whose ``q_norm``/``k_norm`` average over the whole projection (zeroing is not a cut
there): a smaller attention built by hand, rows and columns copied head by head."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from helpers import assert_same, kept_by_orders, token_ids, zeroed_model

from gdnprune import load_pretrained
from gdnprune.model.subblock_shapes import AttentionShape, MLPShape
from gdnprune.model.subblock_surgery import find_model_blocks, random_orders
from gdnprune.plan.measure.subblocks import BlockToPlan

TRAINED = Path(__file__).parent / "data" / "trained"
TARGETS = {
    "attention": {"num_attention_heads": 2, "num_key_value_heads": 1},
    "mlp": {"intermediate_size": 40},
    "shared_expert": {"shared_expert_intermediate_size": 24},
}


def _target(block):
    fields = TARGETS[block.kind]
    if block.kind == "attention":
        return AttentionShape(
            fields["num_attention_heads"], fields["num_key_value_heads"], block.shape.head_dim
        )
    return MLPShape(next(iter(fields.values())))


def _with_module(model, prefix, module):
    """A copy of ``model`` with the sub-module at ``prefix`` replaced by ``module``."""
    out = copy.deepcopy(model)
    parent, _, name = prefix.rpartition(".")
    setattr(out.get_submodule(parent), name, module)
    return out


def _logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits


def _built(model, block, orders):
    plan = BlockToPlan(block, model.get_submodule(block.prefix), orders, [block.shape, _target(block)])
    return plan.build(plan.sorted_state(), _target(block), torch.device("cpu"))


def _olmo_attention_by_hand(model, prefix, orders):
    """The attention of ``prefix`` cut to 1 key-value group and 2 query heads, built by hand from the config
    and the full tensors: q/k/v rows and o_proj columns of the kept heads, and their q_norm/k_norm weights."""
    full = model.get_submodule(prefix)
    config = copy.deepcopy(model.config)
    config.num_attention_heads, config.num_key_value_heads, config.head_dim = 2, 1, 16
    small = type(full)(config, layer_idx=full.layer_idx).eval()
    hd, r = 16, 2
    g = int(orders["kv_groups"][0])  # the key-value group kept, and its first two query heads
    heads = [g * r + int(orders["query_heads"][g][j]) for j in range(2)]
    old, new = full.state_dict(), small.state_dict()
    with torch.no_grad():
        for pos, h in enumerate(heads):
            rows, cols = slice(pos * hd, (pos + 1) * hd), slice(h * hd, (h + 1) * hd)
            new["q_proj.weight"][rows] = old["q_proj.weight"][cols]
            new["q_norm.weight"][rows] = old["q_norm.weight"][cols]
            new["o_proj.weight"][:, rows] = old["o_proj.weight"][:, cols]
        for name in ("k_proj.weight", "v_proj.weight", "k_norm.weight"):
            new[name][:] = old[name][g * hd : (g + 1) * hd]
        assert set(new) == set(old)
        small.load_state_dict(new)
    return small


@pytest.mark.parametrize("family", ["olmo_hybrid", "qwen3_next"])
def test_built_cut_modules_give_the_logits_of_the_reference_on_a_trained_model(family):
    model = load_pretrained(TRAINED / family, dtype=torch.float32).eval()
    blocks = [b for b in find_model_blocks(model, ("attention", "mlp", "shared_expert"))]
    kinds = {b.kind for b in blocks}
    assert kinds == ({"attention", "mlp"} if family == "olmo_hybrid" else {"attention", "shared_expert"})
    g = torch.Generator().manual_seed(3)
    ids = token_ids(seed=6, batch=2, seq=24)
    full = _logits(model, ids)
    for block in blocks:
        orders = random_orders(block, generator=g)
        cut = _logits(_with_module(model, block.prefix, _built(model, block, orders)), ids)
        if family == "olmo_hybrid" and block.kind == "attention":
            reference = _logits(
                _with_module(model, block.prefix, _olmo_attention_by_hand(model, block.prefix, orders)), ids
            )
        else:
            keep = kept_by_orders(block, orders, TARGETS[block.kind])
            reference = _logits(zeroed_model(model, {block.prefix: (block.kind, keep)}), ids)
        assert_same(cut, reference)
        assert (cut - full).abs().max() > 1e-2 * full.abs().max(), block.prefix  # a real cut
        # negative control: the reversed orders keep what these orders drop, and their cut is not the reference
        other = {
            name: order[..., ::-1].copy() if name != "query_heads" else order.copy()
            for name, order in orders.items()
        }
        wrong = _logits(_with_module(model, block.prefix, _built(model, block, other)), ids)
        assert (wrong - reference).abs().max() > 1e-3 * reference.abs().max(), block.prefix
