"""The room for running models (:mod:`gdnprune.model.forwards`) on real tiny transformers models; the references are
transformers' own outputs (hidden states, loss) and the model structure read from the module names."""

from __future__ import annotations

import copy
import re

import pytest
import torch
import transformers
from tiny_models import build_model

from gdnprune.gated_delta_net import GDNShape
from gdnprune.model.forwards import (
    KL_WEIGHT,
    Forwards,
    block_index,
    block_of,
    decoder_blocks,
    decoder_layers,
    final_norm,
    hidden_argument,
    input_device,
    layer_index,
    layer_of,
    output_projection,
    parent_and_name,
    record_input,
    run_model,
    unpack_batch,
    with_hidden,
)
from gdnprune.model.layouts import find_gdn_modules
from gdnprune.quality import compensate

SHAPE = GDNShape(num_key_heads=2, num_value_heads=4, key_head_dim=8, value_head_dim=6)


def _batches():
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, 128, (2, 24), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 17:] = 0
    return [
        ids,
        {"input_ids": ids[:1, :20], "attention_mask": torch.ones(1, 20)},
        {"input_ids": ids, "attention_mask": mask},
    ]


def test_unpack_batch_takes_tensors_and_mappings_and_refuses_anything_else():
    ids, mask = unpack_batch(torch.arange(5, dtype=torch.int32))
    assert ids.dtype == torch.int64 and ids.tolist() == [[0, 1, 2, 3, 4]] and mask is None
    _, mask = unpack_batch({"input_ids": [[1, 2, 3]], "attention_mask": [[1, 1, 1]]})
    assert mask is None  # every token counts
    _, mask = unpack_batch({"input_ids": [[1, 2, 3]], "attention_mask": [[1, 1, 0]]})
    assert mask.tolist() == [[True, True, False]]
    with pytest.raises(ValueError, match=r"integer input_ids \[B, T\], got torch.float32"):
        unpack_batch(torch.zeros(2, 3))
    with pytest.raises(ValueError, match=r"\[2, 3, 4\]"):
        unpack_batch(torch.zeros(2, 3, 4, dtype=torch.long))


@pytest.mark.parametrize("model_type", ["qwen3_5", "olmo_hybrid", "qwen3_next"])
def test_blocks_output_projections_and_parents_are_found_in_real_models(model_type):
    model = build_model(model_type, SHAPE)
    layers = decoder_layers(model)
    gdn = find_gdn_modules(model)
    assert gdn
    for prefix, module in gdn:
        index = int(re.search(r"layers\.(\d+)\.", prefix).group(1))  # the structure, from the names
        assert layer_index(layers, module) == index
        assert layer_of(model, module) is model.get_submodule(prefix.rsplit(".", 1)[0])
        with pytest.warns(FutureWarning, match="block_index is deprecated.*use layer_index"):  # old names
            assert block_index(layers, module) == index
        with pytest.warns(FutureWarning, match="block_of is deprecated.*use layer_of"):
            assert block_of(model, module) is model.get_submodule(prefix.rsplit(".", 1)[0])
        parent, name = parent_and_name(layers[index], module)
        assert getattr(parent, name) is module
        expected = "o_proj" if model_type == "olmo_hybrid" else "out_proj"
        assert output_projection(module) is getattr(module, expected)
        assert output_projection(module).in_features == SHAPE.num_value_heads * SHAPE.value_head_dim
    mlp = next(m for n, m in model.named_modules() if n.endswith("layers.1.mlp"))
    if hasattr(mlp, "down_proj"):
        assert output_projection(mlp) is mlp.down_proj
    with pytest.raises(ValueError, match="Linear has no output projection"):
        output_projection(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="Linear module is not inside one of the decoder's layers"):
        block_of(model, torch.nn.Linear(2, 2))


@pytest.mark.parametrize("model_type", ["qwen3_5", "qwen3_5_vl"])
def test_the_final_norm_is_the_one_before_the_head(model_type):
    """The module whose output the LM head reads, named from the module tree (a VL model's is its language
    model's); a module without a decoder has none."""
    model = build_model(model_type, SHAPE)
    name = "model.language_model.norm" if model_type == "qwen3_5_vl" else "model.norm"
    assert final_norm(model) is model.get_submodule(name)
    assert final_norm(torch.nn.Linear(2, 2)) is None


def test_hidden_argument_positional_or_keyword():
    x, y = torch.zeros(1), torch.ones(1)
    assert hidden_argument((x, 3), {}) is x and hidden_argument((), {"hidden_states": x}) is x
    args, kwargs = with_hidden((x, 3), {"a": 1}, y)
    assert args[0] is y and args[1] == 3 and kwargs == {"a": 1}
    args, kwargs = with_hidden((), {"hidden_states": x, "a": 1}, y)
    assert args == () and kwargs["hidden_states"] is y and kwargs["a"] == 1


@pytest.mark.parametrize("model_type", ["qwen3_5", "olmo_hybrid"])
def test_a_stopped_run_sees_the_input_of_a_block_as_transformers_reports_it(model_type):
    model = build_model(model_type, SHAPE)
    ids, mask = unpack_batch(_batches()[2])
    with torch.no_grad():
        reference = model(input_ids=ids, attention_mask=mask.long(), output_hidden_states=True).hidden_states
    with pytest.warns(FutureWarning, match="decoder_blocks is deprecated.*use decoder_layers"):  # old name
        assert list(decoder_blocks(model)) == list(decoder_layers(model))
    blocks = decoder_layers(model)
    later = []
    for k in range(len(blocks)):
        seen = {}
        hooks = [(blocks[k], record_input(seen, "x", stop=True))]
        hooks += [(b, lambda *a, **kw: later.append(1)) for b in list(blocks)[k + 1 :]]
        with torch.no_grad():
            run_model(model, ids, mask, hooks)
        torch.testing.assert_close(seen["x"], reference[k], rtol=0, atol=0)
    assert later == []  # the pass stopped at the block
    assert not any(b._forward_pre_hooks for b in blocks)  # and its hooks are gone


def test_forwards_from_an_unchanged_layer_give_zero_kl_and_the_models_own_loss():
    model = build_model("qwen3_5", SHAPE)
    ids = torch.randint(0, 128, (3, 20), generator=torch.Generator().manual_seed(1))
    forwards = Forwards(model, [ids[:2], ids[2:]])
    layers = [forwards.decoder_index(m) for _, m in find_gdn_modules(model)]
    forwards.teacher(layers)
    with torch.no_grad():
        losses = [model(input_ids=b, labels=b).loss for b in (ids[:2], ids[2:])]
    expected = (losses[0] * 2 * 19 + losses[1] * 19) / (3 * 19)  # transformers' mean over predicted tokens
    assert forwards.base_loss == pytest.approx(float(expected), rel=1e-5)
    for index in layers:
        with forwards.from_layer(index) as measure:
            kl, loss = measure()
        assert abs(kl) < 1e-6 and loss == pytest.approx(forwards.base_loss, rel=1e-5)
    assert forwards.forwards == 2 * len(layers) and forwards.tokens == 60


def test_a_kl_weight_per_position_gives_the_weighted_mean_of_the_per_position_kl():
    """Reference: the per-position KL of the cut model (out_proj of the second GDN layer halved) against the
    unpruned one, each computed by its own full forward, averaged with the weights by hand."""
    model = build_model("qwen3_5", SHAPE)
    ids = torch.randint(0, 128, (3, 20), generator=torch.Generator().manual_seed(2))
    weight = torch.rand(3, 20, generator=torch.Generator().manual_seed(3))
    weight[1, 5:9] = 0
    batches = [{"input_ids": ids[:2], KL_WEIGHT: weight[:2]}, {"input_ids": ids[2:], KL_WEIGHT: weight[2:]}]
    prefix, gdn = find_gdn_modules(model)[1]
    cut = copy.deepcopy(model)
    with torch.no_grad():
        cut.get_submodule(prefix).out_proj.weight.mul_(0.5)
        log_t = model(input_ids=ids).logits.double().log_softmax(-1)
        log_s = cut(input_ids=ids).logits.double().log_softmax(-1)
    per_position = (log_t.exp() * (log_t - log_s)).sum(-1)
    expected = float((per_position * weight).sum() / weight.sum())
    forwards = Forwards(model, batches)
    index = forwards.decoder_index(gdn)
    forwards.teacher([index])
    with forwards.from_layer(index) as measure:
        with torch.no_grad():
            gdn.out_proj.weight.mul_(0.5)
        try:
            kl, _ = measure()
        finally:
            with torch.no_grad():
                gdn.out_proj.weight.mul_(2.0)
    assert kl == pytest.approx(expected, rel=1e-4)
    unweighted = float(per_position.mean())
    assert abs(kl - unweighted) > 1e-3 * unweighted  # the weights made a difference
    with pytest.raises(ValueError, match="non-negative weights"):
        Forwards(model, [{"input_ids": ids, KL_WEIGHT: -weight}])


# ---- an embedding that a device map offloaded: its weights on ``meta`` ----------------------------------


@pytest.fixture(scope="module")
def offloaded(tmp_path_factory):
    root = tmp_path_factory.mktemp("offload")
    model = build_model("qwen3_5", SHAPE, seed=4)
    model.save_pretrained(root / "model")
    device_map = {
        "model.embed_tokens": "disk",
        "model.layers": "cpu",
        "model.norm": "cpu",
        "model.rotary_emb": "cpu",
        "lm_head": "cpu",
    }
    dispatched = transformers.AutoModelForCausalLM.from_pretrained(
        root / "model", device_map=device_map, offload_folder=str(root / "offload")
    )
    return model, dispatched


def test_the_ids_of_an_offloaded_embedding_go_to_its_execution_device(offloaded):
    plain, dispatched = offloaded
    assert dispatched.get_input_embeddings().weight.device.type == "meta"
    assert input_device(dispatched) == torch.device("cpu")
    assert input_device(plain) == torch.device("cpu")


def test_compensation_statistics_of_an_offloaded_model_equal_the_plain_models(offloaded):
    """``score --compensation`` under ``--device-map``: the ids went to ``meta`` before forwards.py."""
    plain, dispatched = offloaded
    batches = _batches()
    got = compensate.collect_statistics(dispatched, batches)
    want = compensate.collect_statistics(plain, batches)
    assert set(got) == set(want) and len(got) == 2
    for prefix, entry in want.items():
        assert got[prefix]["tokens"] == entry["tokens"] == 24 * 2 + 20 + 24 + 17
        torch.testing.assert_close(
            torch.from_numpy(got[prefix]["out_moment"]),
            torch.from_numpy(entry["out_moment"]),
            rtol=1e-6,
            atol=1e-9,
        )
