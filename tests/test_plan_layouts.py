"""The plan finds each GDN module's layout from its tensors (``layouts.detect_layout``); an unknown one is an error."""

from __future__ import annotations

import pytest
from tiny_models import build_model

from gdnprune.gated_delta_net import GDNShape
from gdnprune.model.layouts import find_gdn_modules
from gdnprune.plan import plan_model
from gdnprune.scoring import score_model

SHAPE = GDNShape(num_key_heads=2, num_value_heads=4, key_head_dim=8, value_head_dim=8)


@pytest.mark.parametrize("model_type", ["qwen3_5", "qwen3_next", "olmo_hybrid"])
def test_every_layout_plans_and_an_unknown_module_is_named(model_type):
    model = build_model(model_type, SHAPE)
    scores = score_model(model, [], method="random", progress=False)
    plan, report = plan_model(model, None, scores, sensitivity="proxy", budget_gdn_params=0.5, dim_step="1/2")
    assert plan["totals"]["gdn_params_fraction"] <= 0.5
    prefix, module = find_gdn_modules(model)[0]
    for name, child in list(module.named_children()):  # the same module, its projections renamed
        if "proj" in name or "norm" in name:
            delattr(module, name)
            setattr(module, f"renamed_{name}", child)
    with pytest.raises(ValueError, match=rf"{prefix}: a {type(module).__name__} of no known GDN layout"):
        plan_model(model, None, scores, sensitivity="proxy", budget_gdn_params=0.5, dim_step="1/2")
