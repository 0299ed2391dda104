"""A short tour of the core API on a tiny random Qwen3.5 model: permute (exactly), then slice (nested)."""

import copy

import torch
import transformers

from gdnprune.gated_delta_net import (
    GDNPermutation,
    GDNShape,
    permute_gated_delta_net_state_dict,
    slice_gated_delta_net_state_dict,
)
from gdnprune.model.layouts import find_gdn_modules

torch.manual_seed(0)
config = transformers.Qwen3_5TextConfig(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    layer_types=["linear_attention", "full_attention"],
    linear_num_key_heads=4,
    linear_num_value_heads=8,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
)
model = transformers.Qwen3_5ForCausalLM(config).eval()
with torch.no_grad():  # fresh GDN weights are nearly symmetric; make them distinct
    for _, module in find_gdn_modules(model):
        for p in module.parameters():
            p.add_(0.1 * torch.randn_like(p))
ids = torch.randint(0, 256, (1, 100))
with torch.no_grad():
    reference = model(ids).logits

state_dict = {k: v.clone() for k, v in model.state_dict().items()}
for prefix, module in find_gdn_modules(model):
    shape = GDNShape.from_module(module)
    permutation = GDNPermutation.random(shape, generator=torch.Generator().manual_seed(1))
    permute_gated_delta_net_state_dict(state_dict, prefix=prefix, shape=shape, permutation=permutation)
    print(f"{prefix}: {shape}\n  key group order {permutation.key_groups.tolist()}")

model.load_state_dict(state_dict)
with torch.no_grad():
    diff = (model(ids).logits - reference).abs().max().item()
print(f"permuted model: max |logit difference| = {diff:.2e} (function preserved)")

target = GDNShape(num_key_heads=2, num_value_heads=2, key_head_dim=8, value_head_dim=8)
for prefix, module in find_gdn_modules(model):
    slice_gated_delta_net_state_dict(
        state_dict, prefix=prefix, shape=GDNShape.from_module(module), target=target
    )
small_config = copy.deepcopy(config)
for key, value in target.config_updates().items():
    setattr(small_config, key, value)
small = transformers.Qwen3_5ForCausalLM(small_config).eval()
small.load_state_dict(state_dict, strict=True)
count = lambda m: sum(p.numel() for _, mod in find_gdn_modules(m) for p in mod.parameters())  # noqa: E731
print(f"sliced to {target}: GDN parameters {count(model)} -> {count(small)}, loads with strict=True")
