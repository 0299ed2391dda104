"""Scoring MLP channels and attention heads (issue 21): the statistics against measurements of the model.

The contribution Gram is checked against ablation: the energy ``1^T G_RR 1`` it predicts for removing a
set ``R`` of channels or heads equals the measured squared change of the sub-block's output when their
``down_proj`` / ``o_proj`` columns are zeroed. The activation baseline is checked against mean
``|activation|`` computed here with a plain hook.
"""

from __future__ import annotations

import pytest
import torch
from helpers import DENSE, assert_same, random_dense_model, token_ids
from tiny_models import logits

from gdnprune.io.loading import slice_model
from gdnprune.model.subblock_geometry import orders_from_payload
from gdnprune.model.subblock_surgery import find_model_blocks
from gdnprune.scoring.subblocks import BlockScorer, block_payload


def _score(model, method, ids):
    scorers = {
        b.prefix: BlockScorer(b, model.get_submodule(b.prefix), method)
        for b in find_model_blocks(model, DENSE)
    }
    handles = [h for s in scorers.values() for h in s.attach()]
    try:
        with torch.no_grad():
            model(input_ids=ids)
    finally:
        for h in handles:
            h.remove()
    return scorers


def _output_of(model, prefix, ids):
    seen = []
    handle = model.get_submodule(prefix).register_forward_hook(
        lambda m, a, out: seen.append((out[0] if isinstance(out, tuple) else out).detach().double())
    )
    try:
        with torch.no_grad():
            model(input_ids=ids)
    finally:
        handle.remove()
    return seen[0]


@pytest.mark.parametrize("model_type", ["qwen3_5", "qwen3_next", "olmo_hybrid"])
def test_the_gram_predicts_the_output_change_of_removing_any_set(model_type):
    model = random_dense_model(model_type)
    ids = token_ids(seed=6)
    scorers = _score(model, "projection", ids)
    g = torch.Generator().manual_seed(0)
    for prefix, scorer in scorers.items():
        units, width = scorer.units, scorer.width
        removed = torch.randperm(units, generator=g)[: max(1, units // 3)]
        predicted = scorer.stats["gram"][removed][:, removed].sum().item()
        full = _output_of(model, prefix, ids)
        name = "o_proj" if scorer.attention else "down_proj"
        weight = model.get_submodule(f"{prefix}.{name}").weight
        saved = weight.detach().clone()
        with torch.no_grad():
            for u in removed.tolist():
                weight[:, u * width : (u + 1) * width] = 0
        try:
            measured = (_output_of(model, prefix, ids) - full).pow(2).sum().item()
        finally:
            with torch.no_grad():
                weight.copy_(saved)
        assert measured > 0 and abs(predicted - measured) <= 1e-4 * measured, (prefix, predicted, measured)


def test_the_activation_baseline_is_the_mean_absolute_activation_and_orders_sort_exactly():
    model = random_dense_model("qwen3_5_moe")
    ids = token_ids(seed=7)
    scorers = _score(model, "activation", ids)
    prefix = next(p for p, s in scorers.items() if not s.attention)
    seen = []
    handle = model.get_submodule(prefix + ".down_proj").register_forward_pre_hook(
        lambda m, a: seen.append(a[0].detach().double().abs().reshape(-1, a[0].shape[-1]).mean(0))
    )
    with torch.no_grad():
        model(input_ids=ids)
    handle.remove()
    payload = block_payload(scorers[prefix].block, scorers[prefix].stats, "activation")
    torch.testing.assert_close(torch.tensor(payload["channel_scores"], dtype=torch.float64), seen[0])
    expected = torch.argsort(seen[0], descending=True, stable=True).tolist()
    assert payload["channel_order_most_important_first"] == expected

    payloads = {p: block_payload(s.block, s.stats, "activation") for p, s in scorers.items()}
    for p, s in scorers.items():
        orders_from_payload(payloads[p], s.block.shape)  # valid orders of the right shapes
    assert_same(logits(slice_model(model, None, block_orders=payloads), ids), logits(model, ids))


def test_projection_orders_keep_what_the_greedy_kept_and_group_heads_stay_in_their_group():
    model = random_dense_model("qwen3_5")
    ids = token_ids(seed=8)
    scorers = _score(model, "projection", ids)
    for scorer in scorers.values():
        payload = block_payload(scorer.block, scorer.stats, "projection")
        orders = orders_from_payload(payload, scorer.block.shape)
        gram = scorer.stats["gram"]
        if scorer.attention:
            assert orders["query_heads"].shape == (2, 2) and sorted(orders["kv_groups"].tolist()) == [0, 1]
            continue
        channels = orders["channels"]
        # the last channel of the order is the one whose removal alone costs least
        assert channels[-1] == int(torch.argmin(gram.diagonal()))
        # greedy conditional removal: each step removes the cheapest next channel given those removed before
        removed = list(reversed(channels.tolist()))
        for k in range(1, 6):
            before = removed[:k]
            costs = {
                c: gram[before + [c]][:, before + [c]].sum().item()
                for c in range(gram.shape[0])
                if c not in before
            }
            assert costs[removed[k]] <= min(costs.values()) + 1e-9 * abs(min(costs.values()))


def test_a_scores_file_holds_sub_block_payloads_beside_gdn_ones(tmp_path):
    from gdnprune.io.scores_file import ScoresError, check_scores, load_scores, save_scores

    model = random_dense_model("qwen3_5")
    scorers = _score(model, "projection", token_ids(seed=9))
    layers = {p: block_payload(s.block, s.stats, "projection") for p, s in scorers.items()}
    gdn = {
        "key_group_order_most_important_first": [1, 0],
        "value_lane_order_most_important_first": [[0, 1], [1, 0]],
        "key_dim_order_most_important_first": [list(range(8))] * 2,
        "value_dim_order_most_important_first": list(range(8)),
        "shape": {"num_key_heads": 2, "num_value_heads": 4, "key_head_dim": 8, "value_head_dim": 8},
    }
    scores = {
        "format": "gdnprune-scores",
        "version": 1,
        "layers": {"model.layers.0.linear_attn": gdn, **layers},
    }
    save_scores(scores, tmp_path / "scores.json")
    assert load_scores(tmp_path / "scores.json")["layers"].keys() == scores["layers"].keys()
    attention = next(p for p in layers if p.endswith("self_attn"))
    broken = {**layers[attention], "query_head_order_most_important_first": [[0, 0], [1, 0]]}
    with pytest.raises(ScoresError, match=r"sub-block 'model.layers.1.self_attn'.*not a permutation"):
        check_scores({**scores, "layers": {attention: broken}})
    lacking = {k: v for k, v in layers[attention].items() if k != "kv_group_order_most_important_first"}
    with pytest.raises(ScoresError, match=r"lacks the orders \['kv_group_order_most_important_first'\]"):
        check_scores({**scores, "layers": {attention: lacking}})


@pytest.mark.parametrize("method", ["projection", "activation", "random"])
def test_score_model_gives_sub_block_orders_beside_the_gdn_ones_in_one_pass(method):
    from gdnprune.io.scores_file import check_scores
    from gdnprune.scoring import score_model

    model = random_dense_model("qwen3_5_vl")
    batches = [token_ids(seed=10), token_ids(seed=11)]
    scores = check_scores(score_model(model, batches, method=method, progress=False, blocks=True))
    blocks = {b.prefix: b for b in find_model_blocks(model, DENSE)}
    gdn = [p for p in scores["layers"] if p.endswith("linear_attn")]
    assert set(scores["layers"]) == set(blocks) | set(gdn) and len(gdn) == 2
    if method != "random":  # the same sums as the scorers run alone on the same batches
        alone = _score(model, method, torch.cat(batches))
        for prefix, scorer in alone.items():
            expected, got = block_payload(scorer.block, scorer.stats, method), scores["layers"][prefix]
            assert {k: v for k, v in got.items() if not k.endswith("_scores")} == {
                k: v for k, v in expected.items() if not k.endswith("_scores")
            }
            for key in (k for k in expected if k.endswith("_scores")):
                torch.testing.assert_close(
                    torch.tensor(got[key]), torch.tensor(expected[key]), rtol=1e-12, atol=0
                )
    assert_same(
        logits(slice_model(model, None, block_orders={p: scores["layers"][p] for p in blocks}), batches[0]),
        logits(model, batches[0]),
    )


def test_score_model_orders_every_kind_the_model_has_by_default():
    """Without ``blocks`` (as ``gdnprune score`` and ``plan_model``), the attention heads and MLP channels get
    orders beside the GDN layers: the same scores as naming every kind; ``GDN_ONLY`` leaves them out."""
    from gdnprune.scoring import GDN_ONLY, score_model

    model = random_dense_model("qwen3_5")
    batches = [token_ids(seed=13)]
    # the reference: the model's own module names
    names = [n for n, _ in model.named_modules()]
    gdn = {n for n in names if n.endswith(".linear_attn")}
    kinds = {n: "attention" for n in names if n.endswith(".self_attn")}
    kinds.update({n: "mlp" for n in names if n.endswith(".mlp")})
    assert gdn and "attention" in kinds.values() and "mlp" in kinds.values()

    default = score_model(model, batches, method="activation", progress=False)
    assert set(default["layers"]) == gdn | set(kinds)
    assert {p: default["layers"][p]["kind"] for p in kinds} == kinds
    named = score_model(
        model, batches, method="activation", progress=False, blocks=["gdn", "attention", "mlp"]
    )
    assert default["layers"] == named["layers"]
    alone = score_model(model, batches, method="activation", progress=False, blocks=GDN_ONLY)
    assert set(alone["layers"]) == gdn


def test_score_model_warns_about_sub_blocks_it_cannot_score():
    from gdnprune.scoring import score_model

    model = random_dense_model("qwen4_exp")
    with pytest.warns(UserWarning, match="self_attn: its tensors fit no attention layout.*not scored"):
        scores = score_model(model, [token_ids(seed=12)], progress=False, blocks=True, method="activation")
    assert any(p.endswith("shared_expert") for p in scores["layers"])
    assert not any(p.endswith("self_attn") for p in scores["layers"])


def test_score_checkpoint_then_sort_orders_every_sub_block_of_a_vision_language_folder(tmp_path):
    """The scores name the checkpoint's own prefixes (``model.language_model.``), sort applies them."""
    from helpers import tokenizer_files

    from gdnprune import checkpoint as ck
    from gdnprune.io.loading import load_pretrained
    from gdnprune.io.scores_file import load_scores, save_scores
    from gdnprune.scoring import score_checkpoint

    model = random_dense_model("qwen3_5_vl")
    model.save_pretrained(tmp_path / "src")
    tokenizer_files(tmp_path / "src")
    (tmp_path / "data.txt").write_text("the model sorts heads and slices them " * 200)
    scores = score_checkpoint(
        tmp_path / "src",
        tmp_path / "data.txt",
        num_samples=4,
        seq_len=16,
        batch_size=2,
        device="cpu",
        progress=False,
        blocks=True,
    )
    save_scores(scores, tmp_path / "scores.json")
    layers = load_scores(tmp_path / "scores.json")["layers"]
    blocks = [p for p in layers if not p.endswith("linear_attn")]
    assert len(blocks) == 6 and all(p.startswith("model.language_model.layers.") for p in blocks)
    manifest = ck.sort_checkpoint(
        tmp_path / "src", tmp_path / "scores.json", tmp_path / "sorted", progress=False
    )
    assert set(manifest["blocks"]) == set(blocks)
    ids = token_ids(seed=13)
    assert_same(logits(load_pretrained(tmp_path / "sorted"), ids), logits(model, ids))


def test_masked_tokens_are_left_out_of_the_sub_block_statistics():
    """A batch with padding gives the statistics of its unpadded windows alone (the model is causal, so the
    kept tokens see the same context)."""
    from gdnprune.scoring.api import measure_statistics

    model = random_dense_model("qwen3_5")
    ids = token_ids(seed=14)
    mask = torch.ones_like(ids, dtype=torch.bool)
    mask[1, 8:] = False  # right padding of the second window
    padded = measure_statistics(
        model, [{"input_ids": ids, "attention_mask": mask}], progress=False, blocks=True, method="activation"
    )
    alone = measure_statistics(
        model, [ids[:1], ids[1:, :8]], progress=False, blocks=True, method="activation"
    )
    for prefix, (_, stats) in alone.blocks.items():
        assert int(padded.blocks[prefix][1]["num_tokens"]) == 12 + 8 == int(stats["num_tokens"])
        torch.testing.assert_close(
            padded.blocks[prefix][1]["abs_sum"], stats["abs_sum"], rtol=1e-5, atol=1e-6
        )


def test_prune_scores_sorts_and_cuts_mlps_and_attention_with_the_gdn_layers(tmp_path):
    from helpers import tokenizer_files

    from gdnprune.io.loading import load_pretrained
    from gdnprune.model.targets import TargetError
    from gdnprune.prune import prune_checkpoint
    from gdnprune.scoring import ScoringOptions

    model = random_dense_model("qwen3_5")
    model.save_pretrained(tmp_path / "src")
    tokenizer_files(tmp_path / "src")
    (tmp_path / "data.txt").write_text("the model sorts heads and slices them " * 200)
    target = {
        "num_key_heads": 1,
        "num_value_heads": 2,
        "intermediate_size": 48,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
    }
    options = dict(scoring=ScoringOptions(num_samples=4, seq_len=16, batch_size=2, device="cpu"))
    manifest = prune_checkpoint(
        tmp_path / "src", tmp_path / "data.txt", tmp_path / "out", target=target, progress=False, **options
    )
    blocks = manifest["blocks"]
    assert {b["kind"] for b in blocks.values()} == {"attention", "mlp"} and len(blocks) == 6
    assert all(b["permutation"] is not None for b in blocks.values())
    expected = slice_model(
        model,
        {"num_key_heads": 1, "num_value_heads": 2},
        {p: layer["permutation"] for p, layer in manifest["layers"].items()},
        blocks={
            k: v
            for k, v in target.items()
            if k in ("intermediate_size", "num_attention_heads", "num_key_value_heads")
        },
        block_orders={p: b["permutation"] for p, b in blocks.items()},
    )
    ids = token_ids(seed=15)
    assert_same(logits(load_pretrained(tmp_path / "out"), ids), logits(expected, ids))
    with pytest.raises(TargetError, match="num_attention_heads 3 / num_key_value_heads 1"):
        prune_checkpoint(
            tmp_path / "src",
            tmp_path / "data.txt",
            tmp_path / "bad",
            target={"num_attention_heads": 3, "num_key_value_heads": 1},
            progress=False,
            **options,
        )
    with pytest.raises(TargetError, match="sequential compensation"):
        prune_checkpoint(
            tmp_path / "src",
            tmp_path / "data.txt",
            tmp_path / "bad",
            target={"intermediate_size": 8},
            compensate="sequential",
            progress=False,
            **options,
        )
    assert not (tmp_path / "bad").exists()
