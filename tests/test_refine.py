"""The lane search (score --lane-search): the masks are exact head removals, the orders are valid
and do not depend on the batch split, and the model is left as it was."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import SOURCE_SHAPE, make_source
from tiny_models import build_model

from gdnprune.model.geometry import GDNShape, orders_from_payload
from gdnprune.model.layouts import find_gdn_modules
from gdnprune.quality.lane_search import search_lane_orders
from gdnprune.scoring import GDN_ONLY, score_model

SHAPE = GDNShape(num_key_heads=2, num_value_heads=6, key_head_dim=8, value_head_dim=4)


def _kl_without_head(model, x, prefix, head) -> float:
    """KL per token of the model with one value head's out_proj columns zeroed, by plain full forwards."""
    cut = copy.deepcopy(model)
    module = dict(find_gdn_modules(cut))[prefix]
    out = getattr(module, "out_proj", None) or module.o_proj
    dv = SHAPE.value_head_dim
    with torch.no_grad():
        out.weight[:, head * dv : (head + 1) * dv] = 0
        t = model(input_ids=x).logits.log_softmax(-1)
        s = cut(input_ids=x).logits.log_softmax(-1)
    return float((t.exp() * (t - s)).sum(-1).mean())


@pytest.mark.parametrize("model_type", ["qwen3_5", "qwen3_next", "olmo_hybrid"])
def test_searched_lane_orders_are_measured_exactly_and_batch_invariant(model_type):
    model = build_model(model_type, SHAPE, seed=21)
    x = torch.randint(0, 128, (2, 72), generator=torch.Generator().manual_seed(5))
    scores = score_model(model, [x], progress=False, blocks=GDN_ONLY)
    before = {p: m.state_dict() for p, m in find_gdn_modules(model)}
    refined, report = search_lane_orders(model, [x], scores, sweeps=1, progress=False)
    again, _ = search_lane_orders(model, [x[:1], x[1:]], scores, sweeps=1, progress=False)
    first = find_gdn_modules(model)[0][0]
    r = SHAPE.value_heads_per_group
    for prefix, payload in refined["layers"].items():
        orders = orders_from_payload(payload, SHAPE)  # valid permutations of the right shape
        assert orders["value_lanes"].shape == (2, r)
        assert (
            payload["value_lane_order_most_important_first"]
            == again["layers"][prefix]["value_lane_order_most_important_first"]
        )
        assert sum(payload["value_lane_scores"], []) == pytest.approx(
            sum(again["layers"][prefix]["value_lane_scores"], []), rel=1e-5
        )  # float32 forwards of other batch shapes
        for key in ("key_group_order_most_important_first", "key_dim_order_most_important_first"):
            assert payload[key] == scores["layers"][prefix][key]
    # the first lane removed in group 0 of the first layer (nothing else cut yet): its KL is that of the model
    # with that head alone removed, computed independently with full forwards
    payload = refined["layers"][first]
    lane = payload["value_lane_order_most_important_first"][0][-1]
    assert payload["value_lane_scores"][0][lane] == pytest.approx(
        _kl_without_head(model, x, first, lane), rel=1e-4
    )
    assert (
        report["evaluations"] == 2 * 2 * r * (r + 1) // 2
        and refined["measures"]["value_lane"] == "measured_kl"
    )
    for prefix, module in find_gdn_modules(model):  # no hook or weight left behind
        assert all(torch.equal(v, module.state_dict()[k]) for k, v in before[prefix].items())
        assert not (getattr(module, "out_proj", None) or module.o_proj)._forward_pre_hooks


def test_score_lane_search_and_compensation_then_prune_end_to_end(tmp_path, capsys):
    import json

    from gdnprune import load_pretrained
    from gdnprune.cli import main
    from gdnprune.io.scores_file import gdn_entries, load_scores
    from gdnprune.quality.compensate import load_statistics

    src = make_source(tmp_path / "model", "qwen3_5", seed=22)
    text = tmp_path / "calib.txt"
    text.write_text(" ".join(["the model sorts heads and slices them"] * 300))
    common = ["--data", str(text), "--num-samples", "4", "--seq-len", "72", "--quiet"]
    assert (
        main(
            [
                "score",
                str(src),
                "--output",
                str(tmp_path / "s.json"),
                "--lane-search",
                "--lane-search-samples",
                "2",
                "--compensation-stats",
                str(tmp_path / "s.compensation.safetensors"),
                *common,
            ]
        )
        == 0
    )
    assert "compensation statistics" in capsys.readouterr().out
    scores = load_scores(tmp_path / "s.json")
    assert scores["measures"]["value_lane"] == "measured_kl" and scores["lane_refinement"]["evaluations"] > 0
    subs = {k: v for k, v in scores["layers"].items() if k not in gdn_entries(scores["layers"])}
    assert {v["kind"] for v in subs.values()} == {"attention", "mlp"}  # every kind by default, kept as scored
    stats = load_statistics(tmp_path / "s.compensation.safetensors")
    assert set(stats) == set(gdn_entries(scores["layers"]))
    r = SOURCE_SHAPE.num_value_heads * SOURCE_SHAPE.value_head_dim
    assert all(v["out_moment"].shape == (r, r) and v["tokens"] == 4 * 72 for v in stats.values())
    # the deprecated spelling still works: --compensation writes beside the scores file
    assert main(["score", str(src), "--output", str(tmp_path / "s.json"), "--compensation", *common]) == 2
    assert "already exists" in capsys.readouterr().err  # neither file is replaced without --overwrite
    # prune with both in one run; the output loads and records what was done
    out = tmp_path / "pruned"
    assert (
        main(
            [
                "prune",
                str(src),
                "-o",
                str(out),
                "--num-key-heads",
                "1",
                "--num-value-heads",
                "2",
                "--lane-search",
                "--compensate",
                *common,
            ]
        )
        == 0
    )
    manifest = json.loads((out / "gdnprune.json").read_text())
    assert (
        manifest["compensation"]["nested"] is False
        and manifest["scores"]["measures"]["value_lane"] == "measured_kl"
    )
    assert load_pretrained(out)(input_ids=torch.randint(0, 11, (1, 20))).logits.isfinite().all()


def test_the_old_name_of_the_lane_search_still_works_and_says_so():
    from gdnprune.quality.lane_search import refine_lane_orders

    model = build_model("qwen3_5", SHAPE, seed=21)
    x = torch.randint(0, 128, (1, 72), generator=torch.Generator().manual_seed(5))
    scores = score_model(model, [x], progress=False, blocks=GDN_ONLY)
    with pytest.warns(FutureWarning, match="search_lane_orders"):
        old, _ = refine_lane_orders(model, [x], scores, sweeps=1, progress=False)
    new, _ = search_lane_orders(model, [x], scores, sweeps=1, progress=False)
    for prefix, payload in new["layers"].items():
        key = "value_lane_order_most_important_first"
        assert old["layers"][prefix][key] == payload[key]
