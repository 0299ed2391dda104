"""Every error path of the core API: ValueError with a message that names what was expected and found."""

import types

import pytest
import torch
import transformers
from tiny_models import synthetic_layer

from gdnprune.gated_delta_net import (
    GDNPermutation,
    GDNShape,
    gated_delta_net_prefix_indices,
    gather_gated_delta_net_tensor,
    permute_gated_delta_net_state_dict,
    slice_gated_delta_net_state_dict,
)

SHAPE = GDNShape(2, 4, 3, 5)
PREFIX = "model.layers.0.linear_attn"


def _layer(layout="qwen3_5", **kw):
    return synthetic_layer(layout, SHAPE, prefix=PREFIX, **kw)


def _perm(seed=0):
    return GDNPermutation.random(SHAPE, generator=torch.Generator().manual_seed(seed))


def _snapshot(sd):
    return {k: v.clone() for k, v in sd.items()}


def _unchanged(sd, snap):
    return sd.keys() == snap.keys() and all(torch.equal(sd[k], snap[k]) for k in sd)


# ---- GDNShape -------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "args", [(0, 4, 3, 5), (2, -4, 3, 5), (2, 4, 0, 5), (2, 4, 3, 0), (2.0, 4, 3, 5), (True, 4, 3, 5)]
)
def test_shape_rejects_non_positive_or_non_integer(args):
    with pytest.raises(ValueError, match="positive integer"):
        GDNShape(*args)


def test_shape_rejects_value_heads_not_multiple_of_key_heads():
    with pytest.raises(ValueError, match=r"num_value_heads \(6\) must be a multiple of num_key_heads \(4\)"):
        GDNShape(4, 6, 8, 8)


def test_shape_constructors():
    text = transformers.Qwen3_5TextConfig(
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=3, linear_value_head_dim=5
    )
    assert GDNShape.from_config(text) == SHAPE
    vl = transformers.Qwen3_5Config(text_config=text.to_dict())
    assert GDNShape.from_config(vl) == SHAPE
    assert GDNShape.from_config({"text_config": text.to_dict()}) == SHAPE
    assert (
        GDNShape.from_mamba_config(types.SimpleNamespace(num_groups=2, num_heads=4, state_dim=3, head_dim=5))
        == SHAPE
    )
    assert (
        GDNShape.from_module(types.SimpleNamespace(num_k_heads=2, num_v_heads=4, head_k_dim=3, head_v_dim=5))
        == SHAPE
    )
    assert SHAPE.value_heads_per_group == 2


def test_shape_constructors_errors():
    with pytest.raises(ValueError, match="missing .*linear_num_key_heads"):
        GDNShape.from_config({"hidden_size": 8})
    with pytest.raises(ValueError, match="not a GDN module"):
        GDNShape.from_module(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="num_groups"):
        GDNShape.from_mamba_config(types.SimpleNamespace(num_heads=4, state_dim=3, head_dim=5))


# ---- payloads and permutations --------------------------------------------------------------------------


def test_payload_missing_keys_mean_identity():
    assert GDNPermutation.from_score_payload({}, SHAPE) == GDNPermutation.identity(SHAPE)
    p = GDNPermutation.from_score_payload({"key_group_order_most_important_first": [1, 0], "other": 3}, SHAPE)
    assert p.key_groups.tolist() == [1, 0] and p.value_dim.tolist() == [0, 1, 2, 3, 4]


def test_payload_round_trips_through_json_lists_and_tensors():
    perm = _perm()
    payload = perm.to_score_payload()
    assert GDNPermutation.from_score_payload(payload, SHAPE) == perm
    tensors = {k: torch.tensor(v) for k, v in payload.items()}
    assert GDNPermutation.from_score_payload(tensors, SHAPE) == perm


@pytest.mark.parametrize(
    "key,value,match",
    [
        ("key_group_order_most_important_first", [0, 1, 2], r"expected shape \[2\], found \[3\]"),
        ("key_group_order_most_important_first", [1, 1], "not a permutation of 0..1"),
        ("value_lane_order_most_important_first", [0, 1], r"expected shape \[2, 2\], found \[2\]"),
        ("value_lane_order_most_important_first", [[0, 1], [0, 0]], r"not a permutation of 0..1 \(row 1\)"),
        (
            "key_dim_order_most_important_first",
            [[0, 1, 3], [0, 1, 2]],
            r"not a permutation of 0..2 \(row 0\)",
        ),
        ("key_dim_order_most_important_first", [[0, 1, 2]], r"expected shape \[2, 3\]"),
        ("value_dim_order_most_important_first", [0.5, 1, 2, 3, 4], "non-integral"),
        ("value_dim_order_most_important_first", [True] * 5, "expected integers"),
        ("value_dim_order_most_important_first", "abc", "not a tensor of integers"),
        ("value_dim_order_most_important_first", [4, 3, 2, 1, -1], "not a permutation"),
    ],
)
def test_payload_errors_name_the_key(key, value, match):
    with pytest.raises(ValueError, match=match) as info:
        GDNPermutation.from_score_payload({key: value}, SHAPE)
    assert key in str(info.value)


def test_payload_must_be_a_mapping():
    with pytest.raises(ValueError, match="mapping"):
        GDNPermutation.from_score_payload([1, 2], SHAPE)


def test_permutation_constructor_validates():
    with pytest.raises(ValueError, match="key_groups: not a permutation"):
        GDNPermutation(
            torch.tensor([0, 0]),
            torch.zeros(2, 1, dtype=torch.long),
            torch.zeros(2, 1, dtype=torch.long),
            torch.tensor([0]),
        )
    with pytest.raises(ValueError, match=r"value_lanes: expected shape \[2, n\]"):
        GDNPermutation(
            torch.tensor([0, 1]), torch.tensor([0]), torch.zeros(2, 1, dtype=torch.long), torch.tensor([0])
        )


def test_permutation_for_another_geometry_is_rejected():
    other = GDNPermutation.identity(GDNShape(2, 4, 3, 4))
    sd = _layer()
    snap = _snapshot(sd)
    with pytest.raises(ValueError, match=r"permutation is for \(Hk, r, dk, dv\) = \(2, 2, 3, 4\)"):
        permute_gated_delta_net_state_dict(sd, prefix=PREFIX, shape=SHAPE, permutation=other)
    assert _unchanged(sd, snap)


def test_permutation_argument_type():
    with pytest.raises(ValueError, match="must be a GDNPermutation"):
        permute_gated_delta_net_state_dict(_layer(), prefix=PREFIX, shape=SHAPE, permutation={"a": 1})


# ---- targets ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "target,match",
    [
        (GDNShape(4, 4, 3, 5), "num_key_heads 4 > 2"),
        (GDNShape(1, 4, 3, 5), "value_heads_per_group 4 > 2"),
        (GDNShape(2, 4, 4, 5), "key_head_dim 4 > 3"),
        (GDNShape(2, 4, 3, 6), "value_head_dim 6 > 5"),
        ({"num_key_heads": 1, "colour": 2}, "unknown target fields"),
        ({"num_value_heads": 3}, "must be a multiple"),
        ("half", "must be a GDNShape or a mapping"),
    ],
)
def test_illegal_targets(target, match):
    with pytest.raises(ValueError, match=match):
        gated_delta_net_prefix_indices(SHAPE, target)
    sd = _layer()
    snap = _snapshot(sd)
    with pytest.raises(ValueError, match=match):
        slice_gated_delta_net_state_dict(sd, prefix=PREFIX, shape=SHAPE, target=target)
    assert _unchanged(sd, snap)


def test_target_as_mapping_keeps_missing_axes():
    a = gated_delta_net_prefix_indices(SHAPE, {"key_head_dim": 2})
    b = gated_delta_net_prefix_indices(SHAPE, GDNShape(2, 4, 2, 5))
    assert all(torch.equal(a[k], b[k]) for k in a)


# ---- state dicts -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", ["qwen3_5", "qwen3_next", "olmo_hybrid"])
def test_missing_tensor_is_an_error_and_nothing_changes(layout):
    sd = _layer(layout)
    victim = sorted(sd)[len(sd) // 2]
    del sd[victim]
    snap = _snapshot(sd)
    with pytest.raises(ValueError, match="missing tensor") as info:
        permute_gated_delta_net_state_dict(sd, prefix=PREFIX, shape=SHAPE, permutation=_perm())
    assert victim in str(info.value) and "expected shape" in str(info.value)
    assert _unchanged(sd, snap)


@pytest.mark.parametrize("layout", ["qwen3_5", "qwen3_next"])
def test_wrong_shape_names_prefix_tensor_expected_and_actual(layout):
    sd = _layer(layout)
    key = f"{PREFIX}.out_proj.weight"
    sd[key] = torch.zeros(5, 19)
    snap = _snapshot(sd)
    with pytest.raises(ValueError) as info:
        permute_gated_delta_net_state_dict(sd, prefix=PREFIX, shape=SHAPE, permutation=_perm())
    msg = str(info.value)
    assert PREFIX in msg and key in msg and "(5, 19)" in msg and "(*, 20)" in msg
    assert _unchanged(sd, snap)


def test_wrong_ndim_is_an_error():
    sd = _layer()
    sd[f"{PREFIX}.conv1d.weight"] = torch.zeros(32, 3)
    with pytest.raises(ValueError, match=r"expected \(32, \*, \*\)"):
        slice_gated_delta_net_state_dict(sd, prefix=PREFIX, shape=SHAPE, target=SHAPE)


def test_state_dict_for_other_geometry_is_rejected_before_any_change():
    sd = _layer()
    snap = _snapshot(sd)
    with pytest.raises(ValueError, match="expected"):
        permute_gated_delta_net_state_dict(
            sd,
            prefix=PREFIX,
            shape=GDNShape(2, 4, 3, 4),
            permutation=GDNPermutation.identity(GDNShape(2, 4, 3, 4)),
        )
    assert _unchanged(sd, snap)


def test_prefix_without_gdn_tensors():
    sd = _layer()
    sd["model.layers.1.self_attn.q_proj.weight"] = torch.zeros(4, 4)
    with pytest.raises(ValueError, match="model.layers.1.self_attn: no GDN tensors found"):
        permute_gated_delta_net_state_dict(
            sd, prefix="model.layers.1.self_attn", shape=SHAPE, permutation=_perm()
        )
    with pytest.raises(ValueError, match="model.layers.7.linear_attn: no tensors under this prefix"):
        permute_gated_delta_net_state_dict(
            sd, prefix="model.layers.7.linear_attn", shape=SHAPE, permutation=_perm()
        )


def test_unknown_tensor_under_prefix_refuses_partial_permutation():
    sd = _layer()
    sd[f"{PREFIX}.in_proj_qkv.weight_scale_inv"] = torch.ones(1, 1)
    snap = _snapshot(sd)
    with pytest.raises(ValueError, match="weight_scale_inv.*not part of the qwen3_5 GDN layout"):
        permute_gated_delta_net_state_dict(sd, prefix=PREFIX, shape=SHAPE, permutation=_perm())
    assert _unchanged(sd, snap)


def test_forced_layout_that_does_not_match():
    sd = _layer("qwen3_5")
    with pytest.raises(ValueError, match="not part of the qwen3_next GDN layout"):
        permute_gated_delta_net_state_dict(
            sd, prefix=PREFIX, shape=SHAPE, permutation=_perm(), layout="qwen3_next"
        )
    with pytest.raises(ValueError, match="unknown GDN layout 'mamba'"):
        permute_gated_delta_net_state_dict(
            sd, prefix=PREFIX, shape=SHAPE, permutation=_perm(), layout="mamba"
        )


def test_partial_state_dict_needs_explicit_non_strict_layout():
    full = _layer()
    part = {k: v for k, v in full.items() if "out_proj" in k or "A_log" in k}
    with pytest.raises(ValueError, match="strict=False needs an explicit layout"):
        permute_gated_delta_net_state_dict(
            dict(part), prefix=PREFIX, shape=SHAPE, permutation=_perm(), strict=False
        )
    with pytest.raises(ValueError, match="missing tensor"):
        permute_gated_delta_net_state_dict(
            dict(part), prefix=PREFIX, shape=SHAPE, permutation=_perm(), layout="qwen3_5"
        )
    # explicit partial mode permutes exactly what is there, the same way as the whole layer
    permute_gated_delta_net_state_dict(
        part, prefix=PREFIX, shape=SHAPE, permutation=_perm(), layout="qwen3_5", strict=False
    )
    permute_gated_delta_net_state_dict(full, prefix=PREFIX, shape=SHAPE, permutation=_perm())
    for k in part:
        assert torch.equal(part[k], full[k])


def test_gather_single_tensor_errors_and_agrees():
    sd = _layer()
    idx = gated_delta_net_prefix_indices(SHAPE, GDNShape(1, 1, 2, 3))
    w = sd[f"{PREFIX}.in_proj_z.weight"]
    out = gather_gated_delta_net_tensor(
        "in_proj_z.weight", w, layout="qwen3_5", shape=SHAPE, target=GDNShape(1, 1, 2, 3), indices=idx
    )
    assert torch.equal(out, w[idx["vidx"]])
    with pytest.raises(ValueError, match="'in_proj_qkvz.weight' is not part of the qwen3_5 GDN layout"):
        gather_gated_delta_net_tensor(
            "in_proj_qkvz.weight", w, layout="qwen3_5", shape=SHAPE, target=SHAPE, indices=idx
        )
    with pytest.raises(ValueError, match=r"expected 4 entries .* found 3"):
        gather_gated_delta_net_tensor(
            "in_proj_z.weight", w, layout="qwen3_5", shape=SHAPE, target=GDNShape(1, 1, 2, 4), indices=idx
        )
    with pytest.raises(ValueError, match="indices lack 'hidx'"):
        gather_gated_delta_net_tensor(
            "in_proj_z.weight",
            w,
            layout="qwen3_5",
            shape=SHAPE,
            target=GDNShape(1, 1, 2, 3),
            indices={"qidx": idx["qidx"]},
        )


def test_indices_follow_the_tensor_device_and_dtype():
    sd = _layer(dtype=torch.bfloat16)
    idx = permute_gated_delta_net_state_dict(sd, prefix=PREFIX, shape=SHAPE, permutation=_perm())
    assert set(idx) == {"qidx", "hidx", "vidx", "cidx"}
    assert all(v.device == sd[f"{PREFIX}.A_log"].device for v in idx.values())
    assert all(v.dtype == torch.bfloat16 for v in sd.values())
    meta = {k: v.to("meta") for k, v in _layer().items()}
    idx = slice_gated_delta_net_state_dict(meta, prefix=PREFIX, shape=SHAPE, target=GDNShape(1, 1, 1, 1))
    assert all(v.device.type == "meta" for v in meta.values())
    assert meta[f"{PREFIX}.in_proj_qkv.weight"].shape == (3, 5)


def test_apply_to_config_sets_geometry_where_from_config_reads_it():
    target = GDNShape(1, 3, 2, 2)
    text = transformers.Qwen3_5TextConfig(
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=3, linear_value_head_dim=5
    )
    vl = transformers.Qwen3_5Config(text_config=text.to_dict())
    for config in (text, vl, text.to_dict(), {"text_config": text.to_dict()}):
        new = target.apply_to_config(config)
        assert GDNShape.from_config(new) == target
        assert GDNShape.from_config(config) == SHAPE  # the input is untouched
    assert "linear_num_key_heads" not in target.apply_to_config({"text_config": text.to_dict()})
