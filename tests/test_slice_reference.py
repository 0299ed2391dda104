"""Slicing checked against references that share no code with gdnprune (see ``reference.py``).

- Removing key groups or value heads equals zeroing the removed heads' ``out_proj`` columns in the full
  model (the gated RMSNorm normalises each head alone): compared on logits, for every family, after the
  torch API, for group removal, lane removal, and both after a non-identity permutation, sorted first
  (permute, then slice) and in one gather (``permutation=``).
- Any cut, ``dk`` and ``dv`` included, gives the tensors picked head by head by hand (``hand_cut``), and the
  hand-built model (``tiny_models.cut_model``) itself equals the zeroing reference for head cuts.

Checkpoints on disk are checked against the same references in ``test_checkpoint.py``.
"""

import copy

import pytest
import torch
import transformers
from reference import Geometry, hand_cut_state_dict, picks, zero_removed_heads
from tiny_models import (
    MODEL_CLASS,
    MODEL_TYPES,
    build_model,
    clone_state_dict,
    config_for,
    cut_model,
    gdn_layers,
)

from gdnprune.gated_delta_net import (
    GDNPermutation,
    GDNShape,
    permute_gated_delta_net_state_dict,
    slice_gated_delta_net_state_dict,
)

SHAPE = GDNShape(3, 9, 4, 4)  # Hk 3, r 3: h // r and h % Hk disagree for most heads
IDS = torch.randint(2, 128, (2, 80), generator=torch.Generator().manual_seed(0))  # > one 64-token chunk
TOL = 1e-4

# (name, target, permuted): group removal, lane removal, both (with a permutation)
HEAD_CUTS = [
    ("groups", GDNShape(2, 6, 4, 4), False),
    ("lanes", GDNShape(3, 3, 4, 4), False),
    ("groups+lanes, permuted", GDNShape(2, 4, 4, 4), True),
]


def _permutations(model, seed):
    g = torch.Generator().manual_seed(seed)
    perms = {prefix: GDNPermutation.random(shape, generator=g) for prefix, shape in gdn_layers(model)}
    assert all(p != GDNPermutation.identity(SHAPE) for p in perms.values())
    return perms


@torch.no_grad()
def _zeroing_reference(model, target, perms):
    """Logits of the full model with every removed head's out_proj columns zeroed; the kept heads by formula."""
    reference = copy.deepcopy(model)
    kept = {
        prefix: picks(shape, target, None if perms is None else perms[prefix]).value_heads(
            SHAPE.value_heads_per_group
        )
        for prefix, shape in gdn_layers(model)
    }
    assert all(len(set(h)) == target.num_value_heads for h in kept.values())
    zero_removed_heads(reference, kept)
    return reference(input_ids=IDS).logits


def _small(model_type, model, target, state):
    small = getattr(transformers, MODEL_CLASS[model_type])(config_for(model.config, target)).eval()
    small.load_state_dict(state, strict=True)
    assert [s for _, s in gdn_layers(small)] == [target] * len(gdn_layers(model))
    return small


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_removing_heads_equals_zeroing_their_out_proj_columns(model_type):
    model = build_model(model_type, SHAPE, seed=21)
    perms = _permutations(model, seed=22)
    with torch.no_grad():
        full = model(input_ids=IDS).logits
    for name, target, permuted in HEAD_CUTS:
        want = _zeroing_reference(model, target, perms if permuted else None)
        assert (want - full).abs().max() > 0.05, name  # the cut matters: zeroing is not a no-op
        ways = {}
        if permuted:  # sort first (permute), then slice the prefix; and both in one gather
            sorted_sd = clone_state_dict(model)
            for prefix, shape in gdn_layers(model):
                permute_gated_delta_net_state_dict(
                    sorted_sd, prefix=prefix, shape=shape, permutation=perms[prefix]
                )
                slice_gated_delta_net_state_dict(sorted_sd, prefix=prefix, shape=shape, target=target)
            ways["sort, then slice"] = sorted_sd
        one_gather = clone_state_dict(model)
        for prefix, shape in gdn_layers(model):
            slice_gated_delta_net_state_dict(
                one_gather,
                prefix=prefix,
                shape=shape,
                target=target,
                permutation=perms[prefix] if permuted else None,
            )
        ways["slice"] = one_gather
        for way, state in ways.items():
            with torch.no_grad():
                got = _small(model_type, model, target, state)(input_ids=IDS).logits
            assert (got - want).abs().max().item() < TOL, (name, way)


# dk / dv cuts too: the torch API gives exactly the tensors picked by hand
ANY_CUTS = [
    GDNShape(3, 9, 4, 4),
    GDNShape(2, 4, 3, 4),
    GDNShape(3, 3, 2, 3),
    GDNShape(1, 1, 1, 1),
    GDNShape(2, 6, 4, 2),
]


@pytest.mark.parametrize("model_type", ["qwen3_5", "qwen3_next", "olmo_hybrid"])
def test_the_torch_api_picks_the_tensors_a_hand_cut_picks(model_type):
    model = build_model(model_type, SHAPE, seed=23)
    perms = _permutations(model, seed=24)
    state = clone_state_dict(model)
    for target in ANY_CUTS:
        for permutations in (None, perms):
            got = dict(state)
            for prefix, shape in gdn_layers(model):
                slice_gated_delta_net_state_dict(
                    got,
                    prefix=prefix,
                    shape=shape,
                    target=target,
                    permutation=None if permutations is None else permutations[prefix],
                )
            want = hand_cut_state_dict(state, {p: (s, target) for p, s in gdn_layers(model)}, permutations)
            assert got.keys() == want.keys()
            for key in want:
                assert torch.equal(got[key], want[key]), (target, key)


@pytest.mark.parametrize("model_type", ["qwen3_5", "qwen3_next", "olmo_hybrid"])
def test_the_hand_built_reference_model_equals_zeroing_for_head_cuts(model_type):
    """``cut_model``, the reference of the plan and loading tests, is itself checked against zeroing."""
    model = build_model(model_type, SHAPE, seed=25)
    perms = _permutations(model, seed=26)
    first = gdn_layers(model)[0][0]
    for _, target, permuted in HEAD_CUTS:
        permutations = perms if permuted else None
        cut = cut_model(model, {first: target}, permutations)  # one layer cut, the other left whole
        reference = copy.deepcopy(model)
        shape = Geometry.of(SHAPE)
        zero_removed_heads(
            reference,
            {
                first: picks(
                    SHAPE, target, None if permutations is None else permutations[first]
                ).value_heads(shape.r)
            },
        )
        with torch.no_grad():
            assert (cut(input_ids=IDS).logits - reference(input_ids=IDS).logits).abs().max().item() < TOL
