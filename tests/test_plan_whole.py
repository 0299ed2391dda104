"""Whole-model plans (issue 21): attention heads, MLP and shared-expert channels as plan candidates beside
the GDN layers. Their measured sensitivity against the full model with the removed output columns zeroed;
the MILP with the whole-model budgets against brute force; a plan that meets every budget on the loaded
sliced model, counted independently; the GDN-only path unchanged."""

from __future__ import annotations

import torch
import pytest

from gdnprune.block_surgery import find_model_blocks
from gdnprune.blocks import AttentionShape, MLPShape
from gdnprune.plan.halving import halving_sensitivity
from gdnprune.plan.sensitivity import measured_sensitivity
from gdnprune.plan.subblocks import BlockToPlan
from test_dense_axes import DENSE, _ids, _kept, _model, _orders, _zeroed


def _kl(teacher, student):
    t, s = teacher.log_softmax(-1), student.log_softmax(-1)
    return float((t.exp() * (t - s)).sum(-1).mean())


@pytest.mark.parametrize("model_type", ["qwen3_5", "qwen3_5_moe"])
def test_sub_block_sensitivity_is_the_kl_of_the_model_with_the_removed_columns_zeroed(model_type):
    model = _model(model_type, seed=2)
    orders = _orders(model, seed=5)
    blocks = find_model_blocks(model, DENSE)
    targets = {"mlp": MLPShape(40), "shared_expert": MLPShape(12)}
    to_plan = [BlockToPlan(b, model.get_submodule(b.prefix), orders[b.prefix],
                           [b.shape, AttentionShape(2, 1, b.shape.head_dim) if b.kind == "attention" else targets[b.kind]])
               for b in blocks]
    assert {b.kind for b in blocks} == ({"attention", "shared_expert"} if "moe" in model_type else {"attention", "mlp"})
    ids = _ids(seed=4, batch=2, seq=10)
    result = measured_sensitivity(model, [ids[:1], ids[1:]], to_plan, progress=False)
    with torch.no_grad():
        teacher = model(input_ids=ids).logits
        for layer in to_plan:
            fields = {"attention": {"num_attention_heads": 2, "num_key_value_heads": 1},
                      "mlp": {"intermediate_size": 40},
                      "shared_expert": {"shared_expert_intermediate_size": 12}}[layer.block.kind]
            ref = _zeroed(model, {layer.prefix: (layer.block.kind, _kept(layer.block, orders[layer.prefix], fields))})
            expected = _kl(teacher, ref(input_ids=ids).logits)
            assert result["kl"][layer.prefix][0] == 0.0
            assert expected > 1e-6
            assert result["kl"][layer.prefix][1] == pytest.approx(expected, rel=1e-3, abs=1e-7), layer.prefix
    # successive halving runs on the same candidates: with every window in its first rung it is the full measurement
    costs = {"params": [[float(layer.block.parameters(t)) for t in layer.candidates] for layer in to_plan]}
    budget = {"params": sum(c[0] for c in costs["params"])}
    halved = halving_sensitivity(model, [ids[:1], ids[1:]], to_plan, costs, budget, first=2, progress=False)
    for layer in to_plan:
        assert halved["kl"][layer.prefix] == pytest.approx(result["kl"][layer.prefix], rel=1e-5, abs=1e-9)
