"""Property tests over random geometries and permutations, on synthetic layers of every layout."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tiny_models import synthetic_layer

from gdnprune.gated_delta_net import (
    GDNPermutation,
    GDNShape,
    gated_delta_net_prefix_indices,
    permute_gated_delta_net_state_dict,
    slice_gated_delta_net_state_dict,
)
from gdnprune.model.layouts import LAYOUTS


@st.composite
def geometries(draw):
    hk = draw(st.integers(1, 4))
    r = draw(st.integers(1, 3))
    return GDNShape(hk, hk * r, draw(st.integers(1, 5)), draw(st.integers(1, 5)))


@st.composite
def geometry_and_target(draw):
    shape = draw(geometries())
    hk = draw(st.integers(1, shape.num_key_heads))
    r = draw(st.integers(1, shape.value_heads_per_group))
    target = GDNShape(
        hk, hk * r, draw(st.integers(1, shape.key_head_dim)), draw(st.integers(1, shape.value_head_dim))
    )
    return shape, target


SETTINGS = settings(max_examples=60, deadline=None)
layouts = st.sampled_from(sorted(LAYOUTS))
seeds = st.integers(0, 2**31 - 1)


def _perm(shape, seed):
    return GDNPermutation.random(shape, generator=torch.Generator().manual_seed(seed))


@SETTINGS
@given(shape=geometries(), seed=seeds, layout=layouts, biases=st.booleans())
def test_inverse_round_trips(shape, seed, layout, biases):
    sd = synthetic_layer(layout, shape, seed=seed % 1000, biases=biases)
    original = dict(sd)
    perm = _perm(shape, seed)
    permute_gated_delta_net_state_dict(sd, prefix="layer", shape=shape, permutation=perm)
    permute_gated_delta_net_state_dict(sd, prefix="layer", shape=shape, permutation=perm.inverse())
    assert sd.keys() == original.keys()
    for k in sd:
        assert torch.equal(sd[k], original[k]), k
    assert perm.inverse().inverse() == perm


@SETTINGS
@given(shape=geometries(), seed=seeds)
def test_indices_are_permutations_in_range(shape, seed):
    idx = _perm(shape, seed).indices(shape)
    sizes = {
        "qidx": shape.key_dim,
        "hidx": shape.num_value_heads,
        "vidx": shape.value_dim,
        "cidx": shape.conv_dim,
    }
    assert set(idx) == set(sizes)
    for key, n in sizes.items():
        assert idx[key].dtype == torch.long
        assert torch.equal(idx[key].sort().values, torch.arange(n)), key


@SETTINGS
@given(st=geometry_and_target(), seed=seeds)
def test_prefix_indices_are_duplicate_free_in_range_and_grouped(st, seed):
    shape, target = st
    for idx in (
        gated_delta_net_prefix_indices(shape, target),
        _perm(shape, seed).indices(shape, target=target),
    ):
        sizes = {
            "qidx": (target.key_dim, shape.key_dim),
            "hidx": (target.num_value_heads, shape.num_value_heads),
            "vidx": (target.value_dim, shape.value_dim),
            "cidx": (target.conv_dim, shape.conv_dim),
        }
        for key, (n, full) in sizes.items():
            assert idx[key].numel() == n
            assert idx[key].unique().numel() == n, key
            assert 0 <= int(idx[key].min()) and int(idx[key].max()) < full, key
        # every kept value head reads the key head kept at its group position
        kept_groups = idx["qidx"].view(target.num_key_heads, target.key_head_dim)[:, 0] // shape.key_head_dim
        heads_group = (
            idx["hidx"].view(target.num_key_heads, target.value_heads_per_group)
            // shape.value_heads_per_group
        )
        assert torch.equal(heads_group, kept_groups[:, None].expand_as(heads_group))


@SETTINGS
@given(st=geometry_and_target(), layout=layouts, seed=seeds)
def test_prefix_of_identity_equals_slice(st, layout, seed):
    shape, target = st
    a = synthetic_layer(layout, shape, seed=seed % 1000, biases=True)
    b = dict(a)
    slice_gated_delta_net_state_dict(a, prefix="layer", shape=shape, target=target)
    slice_gated_delta_net_state_dict(
        b, prefix="layer", shape=shape, target=target, permutation=GDNPermutation.identity(shape)
    )
    for k in a:
        assert torch.equal(a[k], b[k])
    # and the sliced layer has exactly the target's shapes
    expected = synthetic_layer(layout, target, seed=0, biases=True)
    assert {k: v.shape for k, v in a.items()} == {k: v.shape for k, v in expected.items()}


@SETTINGS
@given(st=geometry_and_target(), layout=layouts, seed=seeds)
def test_permute_then_slice_equals_one_gather(st, layout, seed):
    shape, target = st
    perm = _perm(shape, seed)
    a = synthetic_layer(layout, shape, seed=seed % 1000)
    b = dict(a)
    permute_gated_delta_net_state_dict(a, prefix="layer", shape=shape, permutation=perm)
    slice_gated_delta_net_state_dict(a, prefix="layer", shape=shape, target=target)
    slice_gated_delta_net_state_dict(b, prefix="layer", shape=shape, target=target, permutation=perm)
    for k in a:
        assert torch.equal(a[k], b[k]), k


@SETTINGS
@given(shape=geometries(), seed=seeds)
def test_fused_and_split_layouts_agree(shape, seed):
    """Qwen3-Next's grouped rows hold the same canonical rows as Qwen3.5's split tensors, before and after."""
    fused = synthetic_layer("qwen3_next", shape, seed=seed % 1000)
    split = _split_from_fused(fused, shape)
    perm = _perm(shape, seed)
    permute_gated_delta_net_state_dict(fused, prefix="layer", shape=shape, permutation=perm)
    permute_gated_delta_net_state_dict(split, prefix="layer", shape=shape, permutation=perm)
    again = _split_from_fused(fused, shape)
    for k in split:
        assert torch.equal(split[k], again[k]), k


def _split_from_fused(sd, shape):
    """Convert a Qwen3-Next layer to the Qwen3.5 split layout by reshaping (independent of the layout tables)."""
    Hk, r, dk, dv = shape.num_key_heads, shape.value_heads_per_group, shape.key_head_dim, shape.value_head_dim
    w = sd["layer.in_proj_qkvz.weight"]
    grouped = w.view(Hk, 2 * dk + 2 * r * dv, -1)
    q, k, v, z = grouped.split([dk, dk, r * dv, r * dv], dim=1)
    flat = lambda t: t.reshape(-1, w.shape[-1])  # noqa: E731
    ba = sd["layer.in_proj_ba.weight"].view(Hk, 2 * r, -1)
    b, a = ba.split([r, r], dim=1)
    out = {k2: v2 for k2, v2 in sd.items() if "in_proj" not in k2}
    out["layer.in_proj_qkv.weight"] = torch.cat([flat(q), flat(k), flat(v)])
    out["layer.in_proj_z.weight"] = flat(z)
    out["layer.in_proj_b.weight"] = flat(b)
    out["layer.in_proj_a.weight"] = flat(a)
    return out
