"""Permute and slice real transformers models built from tiny configs, compare logits."""

import pytest
import torch
import transformers
from reference import hand_cut_state_dict
from tiny_models import (
    LAYOUT_OF,
    MODEL_CLASS,
    MODEL_TYPES,
    build_model,
    cached_decode_logits,
    clone_state_dict,
    config_for,
    gdn_layers,
    logits,
)

from gdnprune.gated_delta_net import (
    GDNPermutation,
    GDNShape,
    gated_delta_net_prefix_indices,
    permute_gated_delta_net_state_dict,
    slice_gated_delta_net_state_dict,
)

SEQ = 150  # longer than the chunked kernel's 64-token chunks
DECODE_STEPS = 4
TOL = 1e-4

GEOMETRIES = [GDNShape(2, 6, 8, 12), GDNShape(4, 8, 6, 5)]


def _ids(seed=0, batch=2, seq=SEQ):
    return torch.randint(2, 128, (batch, seq), generator=torch.Generator().manual_seed(seed))


def _fresh(model_type, config):
    return getattr(transformers, MODEL_CLASS[model_type])(config).eval()


def _permute_all(model, seed):
    g = torch.Generator().manual_seed(seed)
    sd = clone_state_dict(model)
    perms = {}
    for prefix, shape in gdn_layers(model):
        perms[prefix] = GDNPermutation.random(shape, generator=g)
        permute_gated_delta_net_state_dict(sd, prefix=prefix, shape=shape, permutation=perms[prefix])
    return sd, perms


@pytest.mark.parametrize("shape", GEOMETRIES, ids=str)
@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_random_permutation_preserves_logits(model_type, shape):
    model = build_model(model_type, shape, seed=1)
    ids = _ids()
    ref, ref_dec = logits(model, ids), cached_decode_logits(model, ids, DECODE_STEPS)
    sd, perms = _permute_all(model, seed=2)
    assert all(p != GDNPermutation.identity(shape) for p in perms.values())
    # the tensors really moved
    moved = [k for k, v in sd.items() if not torch.equal(v, model.state_dict()[k])]
    assert any("out_proj" in k or "o_proj" in k for k in moved)
    permuted = _fresh(model_type, model.config)
    permuted.load_state_dict(sd, strict=True)
    out, out_dec = logits(permuted, ids), cached_decode_logits(permuted, ids, DECODE_STEPS)
    assert (out - ref).abs().max().item() < TOL
    assert (out_dec - ref_dec).abs().max().item() < TOL
    assert ref.abs().max().item() > 0.1  # the comparison is not between near-zero logits


def _per_head_value_dim_shuffle(sd, prefix, shape, seed):
    """A WRONG permutation: a different value-dim order per value head (the norm weight is shared)."""
    g = torch.Generator().manual_seed(seed)
    Hv, dv = shape.num_value_heads, shape.value_head_dim
    vidx = (torch.arange(Hv)[:, None] * dv + torch.rand(Hv, dv, generator=g).argsort(-1)).reshape(-1)
    qk = 2 * shape.key_dim
    cidx = torch.cat([torch.arange(qk), qk + vidx])
    sd[f"{prefix}.in_proj_qkv.weight"] = sd[f"{prefix}.in_proj_qkv.weight"][cidx]
    sd[f"{prefix}.conv1d.weight"] = sd[f"{prefix}.conv1d.weight"][cidx]
    sd[f"{prefix}.in_proj_z.weight"] = sd[f"{prefix}.in_proj_z.weight"][vidx]
    sd[f"{prefix}.out_proj.weight"] = sd[f"{prefix}.out_proj.weight"][:, vidx]


def _modulo_grouping(sd, prefix, shape, seed):
    """A WRONG permutation: moves key heads as if value head h read key head h % Hk."""
    g = torch.Generator().manual_seed(seed)
    perm = GDNPermutation.random(shape, generator=g)
    idx = perm.indices(shape)
    Hk, dk = shape.num_key_heads, shape.key_head_dim
    qidx = idx["qidx"]
    hidx = idx["hidx"]
    # values move as the right permutation says, but q/k follow h % Hk instead of h // r
    wrong_groups = hidx[:: shape.value_heads_per_group] % Hk
    qidx = (wrong_groups[:, None] * dk + torch.arange(dk)).reshape(-1)
    vidx = idx["vidx"]
    cidx = torch.cat([qidx, shape.key_dim + qidx, 2 * shape.key_dim + vidx])
    for name, rows in (
        ("in_proj_qkv", cidx),
        ("conv1d", cidx),
        ("in_proj_z", vidx),
        ("in_proj_a", hidx),
        ("in_proj_b", hidx),
    ):
        sd[f"{prefix}.{name}.weight"] = sd[f"{prefix}.{name}.weight"][rows]
    for name in ("A_log", "dt_bias"):
        sd[f"{prefix}.{name}"] = sd[f"{prefix}.{name}"][hidx]
    sd[f"{prefix}.out_proj.weight"] = sd[f"{prefix}.out_proj.weight"][:, vidx]


@pytest.mark.parametrize("wrong", [_per_head_value_dim_shuffle, _modulo_grouping])
def test_negative_control_wrong_permutation_changes_logits(wrong):
    """The equivalence test can fail: plausible but wrong permutations change the output a lot."""
    shape = GDNShape(2, 6, 8, 12)
    model = build_model("qwen3_5", shape, seed=3)
    ids = _ids()
    ref = logits(model, ids)
    sd = clone_state_dict(model)
    for prefix, s in gdn_layers(model):
        wrong(sd, prefix, s, seed=4)
    broken = _fresh("qwen3_5", model.config)
    broken.load_state_dict(sd)
    assert (logits(broken, ids) - ref).abs().max().item() > 100 * TOL


TARGETS = [
    GDNShape(4, 8, 6, 5),  # full size: slicing is the identity
    GDNShape(4, 4, 6, 5),  # one lane per group
    GDNShape(2, 4, 6, 5),  # half the key groups
    GDNShape(2, 4, 3, 5),
    GDNShape(2, 2, 3, 2),
    GDNShape(1, 1, 1, 1),
]


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_slice_loads_strictly_into_target_model_and_runs(model_type):
    shape = GDNShape(4, 8, 6, 5)
    model = build_model(model_type, shape, seed=5)
    ids = _ids(seq=80)
    ref = logits(model, ids)
    for target in TARGETS:
        sd = clone_state_dict(model)
        for prefix, s in gdn_layers(model):
            slice_gated_delta_net_state_dict(sd, prefix=prefix, shape=s, target=target)
        small = _fresh(model_type, config_for(model.config, target))
        small.load_state_dict(sd, strict=True)
        assert [s for _, s in gdn_layers(small)] == [target] * 2
        out = logits(small, ids)
        # the tensors are those picked head by head by hand (reference.py: no gdnprune index code)
        by_hand = hand_cut_state_dict(
            model.state_dict(), {prefix: (s, target) for prefix, s in gdn_layers(model)}
        )
        assert sd.keys() == by_hand.keys() and all(torch.equal(sd[k], by_hand[k]) for k in sd)
        diff = (out - ref).abs().max().item()
        if target == shape:
            assert diff < TOL
        else:
            assert diff > TOL  # a real cut changes the model


@pytest.mark.parametrize("model_type", ["qwen3_5", "qwen3_next", "olmo_hybrid"])
def test_permute_then_slice_is_the_prefix_of_the_permutation(model_type):
    """Nested property: sort, then slice == one gather of the original at the permutation's prefix."""
    shape = GDNShape(4, 8, 6, 5)
    model = build_model(model_type, shape, seed=6)
    sorted_sd, perms = _permute_all(model, seed=7)
    for target in TARGETS[1:]:
        a = dict(sorted_sd)
        b = clone_state_dict(model)
        for prefix, s in gdn_layers(model):
            slice_gated_delta_net_state_dict(a, prefix=prefix, shape=s, target=target)
            slice_gated_delta_net_state_dict(
                b, prefix=prefix, shape=s, target=target, permutation=perms[prefix]
            )
            # and the indices of the one-gather path are the permutation's indices at the prefix
            full = perms[prefix].indices(s)
            pre = gated_delta_net_prefix_indices(s, target)
            composed = perms[prefix].indices(s, target=target)
            for key in ("qidx", "hidx", "vidx", "cidx"):
                assert torch.equal(composed[key], full[key][pre[key]])
        assert a.keys() == b.keys()
        for k in a:
            assert torch.equal(a[k], b[k]), k


def test_nested_targets_are_nested():
    """Slicing to a large target and then to a smaller one equals slicing straight to the smaller one."""
    shape = GDNShape(4, 8, 6, 5)
    model = build_model("qwen3_next", shape, seed=8)
    big, small = GDNShape(3, 6, 4, 4), GDNShape(2, 2, 3, 2)
    a, b = clone_state_dict(model), clone_state_dict(model)
    for prefix, s in gdn_layers(model):
        slice_gated_delta_net_state_dict(a, prefix=prefix, shape=s, target=big)
        slice_gated_delta_net_state_dict(a, prefix=prefix, shape=big, target=small)
        slice_gated_delta_net_state_dict(b, prefix=prefix, shape=s, target=small)
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_sorted_and_sliced_model_equals_sliced_sorted_model_logits():
    """The model cut after sorting runs and equals the cut of the sorted model, logits included."""
    shape = GDNShape(2, 6, 8, 12)
    target = GDNShape(1, 2, 4, 6)
    model = build_model("qwen3_5_vl", shape, seed=9)
    sorted_sd, perms = _permute_all(model, seed=10)
    one_gather = clone_state_dict(model)
    for prefix, s in gdn_layers(model):
        slice_gated_delta_net_state_dict(sorted_sd, prefix=prefix, shape=s, target=target)
        slice_gated_delta_net_state_dict(
            one_gather, prefix=prefix, shape=s, target=target, permutation=perms[prefix]
        )
    ids = _ids(seq=70)
    outs = []
    for sd in (sorted_sd, one_gather):
        m = _fresh("qwen3_5_vl", config_for(model.config, target))
        m.load_state_dict(sd, strict=True)
        outs.append(logits(m, ids))
    assert torch.equal(outs[0], outs[1])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_dtypes_are_preserved_and_permutation_is_exact(dtype):
    shape = GDNShape(2, 6, 8, 12)
    model = build_model("qwen3_next", shape, seed=11).to(dtype)
    sd = clone_state_dict(model)
    prefix, s = gdn_layers(model)[0]
    perm = GDNPermutation.random(s, generator=torch.Generator().manual_seed(12))
    permute_gated_delta_net_state_dict(sd, prefix=prefix, shape=s, permutation=perm)
    permute_gated_delta_net_state_dict(sd, prefix=prefix, shape=s, permutation=perm.inverse())
    for k, v in sd.items():
        assert v.dtype == dtype
        assert torch.equal(v, model.state_dict()[k])


def test_layout_is_detected_per_model_type():
    from gdnprune.model.layouts import detect_layout

    shape = GDNShape(2, 4, 4, 4)
    for model_type in MODEL_TYPES:
        model = build_model(model_type, shape, randomize=False)
        prefix, _ = gdn_layers(model)[0]
        names = [k[len(prefix) + 1 :] for k in model.state_dict() if k.startswith(prefix + ".")]
        assert detect_layout(names).name == LAYOUT_OF[model_type]
