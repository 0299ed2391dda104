"""Removal as a plan candidate (issue 23): the MILP with a cost-0 removal per decoder layer against brute
force; the measured removal sensitivity against a full forward with the layer skipped; expert-count
candidates in the same problem."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from helpers import random_dense_model, scored_source, skipped_model, token_ids

from gdnprune.plan.choose.depth import choose_with_removal, removal_sensitivity
from gdnprune.plan.choose.solve import BudgetError
from gdnprune.scoring.experts import block_influence


def _brute(sensitivity, costs, budgets, layer_of, removal, keep_one_of=()):
    best = (np.inf, None)
    layers = sorted(removal)
    for removed in itertools.product([False, True], repeat=len(layers)):
        gone = {layer for layer, r in zip(layers, removed) if r}
        if gone == set(layer_of) or (keep_one_of and set(keep_one_of) <= gone):
            continue
        options = [[None] if layer_of[g] in gone else range(len(s)) for g, s in enumerate(sensitivity)]
        for pick in itertools.product(*options):
            if any(
                sum(costs[name][g][c] for g, c in enumerate(pick) if c is not None) > budget + 1e-9
                for name, budget in budgets.items()
            ):
                continue
            value = sum(sensitivity[g][c] for g, c in enumerate(pick) if c is not None) + sum(
                removal[layer] for layer in gone
            )
            if value < best[0] - 1e-12:
                best = (value, (list(pick), sorted(gone)))
    return best


@pytest.mark.parametrize("seed", range(6))
def test_widths_and_removals_chosen_together_equal_brute_force(seed):
    rng = np.random.default_rng(seed)
    layer_of = [0, 0, 1, 1, 2, 2]  # two sub-blocks per decoder layer (say a mixer and an MLP / experts)
    sensitivity, params, memory = [], [], []
    for _ in range(6):
        k = int(rng.integers(2, 4))
        sensitivity.append([0.0] + sorted(rng.uniform(0, 1, k - 1).tolist()))  # the full width costs nothing
        p = sorted(rng.integers(1, 20, k).tolist(), reverse=True)
        params.append(p)
        memory.append([int(v) for v in rng.integers(0, 5, k)])
    removal = {0: float(rng.uniform(0.5, 3)), 2: float(rng.uniform(0.5, 3))}  # layer 1 may not go
    costs = {"params": params, "memory": memory}
    budgets = {"params": 0.5 * sum(p[0] for p in params), "memory": 6}
    value, best = _brute(sensitivity, costs, budgets, layer_of, removal)
    if best is None:
        with pytest.raises(BudgetError):
            choose_with_removal(sensitivity, costs, budgets, layer_of=layer_of, removal=removal)
        return
    choice, removed = choose_with_removal(sensitivity, costs, budgets, layer_of=layer_of, removal=removal)
    got = sum(sensitivity[g][c] for g, c in enumerate(choice) if c is not None) + sum(
        removal[layer] for layer in removed
    )
    assert abs(got - value) < 1e-9
    assert all((c is None) == (layer_of[g] in removed) for g, c in enumerate(choice))
    assert sum(params[g][c] for g, c in enumerate(choice) if c is not None) <= budgets["params"]


def test_removal_is_chosen_when_it_is_the_cheapest_way_to_meet_a_budget():
    sensitivity = [[0.0, 5.0], [0.0, 5.0], [0.0, 5.0], [0.0, 5.0]]
    costs = {"params": [[10, 5], [10, 5], [10, 5], [10, 5]]}
    layer_of = [0, 0, 1, 1]
    choice, removed = choose_with_removal(
        sensitivity, costs, {"params": 20}, layer_of=layer_of, removal={0: 1.0, 1: 2.0}
    )
    assert removed == [0] and choice == [None, None, 0, 0]
    choice, removed = choose_with_removal(sensitivity, costs, {"params": 20}, layer_of=layer_of, removal={})
    assert (
        removed == [] and sum(c for c in choice) == 4
    )  # without removal: every sub-block halved (20 of sensitivity)


def test_measured_removal_sensitivity_is_the_kl_of_the_full_model_with_the_layer_skipped():
    model = random_dense_model("qwen3_5", seed=4)
    batches = [token_ids(seed=i, seq=10) for i in range(2)]
    measured = removal_sensitivity(model, batches)
    assert sorted(measured) == [0, 1, 2, 3]
    with torch.no_grad():
        for i in (1, 3):
            skipped = skipped_model(model, [i])
            kl, n = 0.0, 0
            for ids in batches:
                p = torch.log_softmax(model(input_ids=ids).logits.double(), -1)
                q = torch.log_softmax(skipped(input_ids=ids).logits.double(), -1)
                kl += float((p.exp() * (p - q)).sum())
                n += ids.numel()
            assert abs(measured[i][0] - kl / n) <= 1e-4 * max(kl / n, 1e-6), (i, measured[i][0], kl / n)
    proxy = block_influence(model, batches)
    assert set(proxy) == set(
        measured
    )  # the one-pass proxy covers the same layers (how well it ranks: BENCHMARKS)


# ---- removal in the whole-model search on real models -----------------------------------------------------------


def _kl_per_token(teacher, student, batches):
    kl, n = 0.0, 0
    with torch.no_grad():
        for ids in batches:
            p = torch.log_softmax(teacher(input_ids=ids).logits.double(), -1)
            q = torch.log_softmax(student(input_ids=ids).logits.double(), -1)
            kl += float((p.exp() * (p - q)).sum())
            n += ids.numel()
    return kl / n


def test_removal_sensitivity_and_a_joint_kl_with_a_removed_layer_equal_the_model_with_it_removed_on_disk(
    tmp_path,
):
    """The reference is the checkpoint written without the layer (``slice --remove-layers``) and loaded back,
    not a hook: the measured removal and the refinement's whole-plan KL with that layer's groups removed."""
    from gdnprune import checkpoint as ck
    from gdnprune.io.loading import load_pretrained
    from gdnprune.plan.choose.depth import LayerRest
    from gdnprune.plan.choose.evolve import REMOVED
    from gdnprune.plan.measure.joint import JointKL, plan_kl

    model = random_dense_model("qwen3_5", seed=4)
    model.save_pretrained(tmp_path / "src")
    batches = [token_ids(seed=i, batch=1, seq=10) for i in range(3)]
    measured = removal_sensitivity(model, batches)
    rests = [LayerRest(f"model.layers.{i}", layer, i) for i, layer in enumerate(model.model.layers)]
    joint = JointKL(model, batches, rests)
    for i in (0, 1):  # a GDN layer, a full-attention layer
        ck.slice_checkpoint(tmp_path / "src", tmp_path / f"cut{i}", remove_layers=[i], progress=False)
        cut = load_pretrained(tmp_path / f"cut{i}")
        assert cut.config.num_hidden_layers == 3
        expected = _kl_per_token(model, cut, batches)
        assert expected > 1e-5
        assert measured[i][0] == pytest.approx(expected, rel=1e-4)
        picks = [REMOVED if r.index == i else 0 for r in rests]
        assert plan_kl(joint, picks) == pytest.approx(expected, rel=1e-4)
    assert plan_kl(joint, [0] * len(rests)) == 0.0


def test_mutations_with_removal_keep_every_budget_and_remove_whole_layers():
    from gdnprune.plan.choose.evolve import REMOVED, feasible, mutate

    rng = np.random.default_rng(0)
    layer_of = [0, 0, 1, 1, 2, 2, 0, 1, 2]  # two sub-blocks and the rest of each of three layers
    costs = {"params": [[8, 4, 2], [6, 3], [8, 4, 2], [6, 3], [8, 4, 2], [6, 3], [1], [1], [1]]}
    budgets = {"params": 25}
    picks = [1, 1, 2, 1, 1, 1, 0, 0, 0]
    assert feasible(picks, costs, budgets)
    seen_removed = seen_back = 0
    for _ in range(400):
        new = mutate(picks, costs, budgets, rng, layer_of=layer_of, removable=[0, 1, 2])
        if new is None:
            continue
        assert feasible(new, costs, budgets)
        gone = {layer_of[g] for g, c in enumerate(new) if c == REMOVED}
        assert all((new[g] == REMOVED) == (layer_of[g] in gone) for g in range(len(new)))  # whole layers only
        assert len(gone) < 3  # never every layer
        seen_removed += len(gone) > len({layer_of[g] for g, c in enumerate(picks) if c == REMOVED})
        seen_back += len(gone) < len({layer_of[g] for g, c in enumerate(picks) if c == REMOVED})
        picks = new
    assert seen_removed and seen_back


def _source(root, model_type, seed):
    text = "layers go and experts stay or go under the budget"
    return scored_source(root, model_type, seed=seed, text=text, repeats=300, num_samples=2, seq_len=32)


def test_a_plan_of_expert_counts_counts_the_loaded_sliced_models_parameters_and_active_parameters(
    tmp_path, capsys
):
    """``--blocks experts``: the plan keeps fewer routed experts in some MoE layers; its kept parameters and
    active parameters (k experts' weights + every kept router row per MoE layer, a direct formula from the
    loaded model's tensors and config) are those of the sliced checkpoint loaded back."""
    import json

    from gdnprune.cli import main
    from gdnprune.io.loading import load_pretrained

    src, text, scores = _source(tmp_path, "qwen3_5_moe", seed=3)
    out = tmp_path / "plan.json"
    assert (
        main(
            [
                "plan",
                str(src),
                "--scores",
                str(scores),
                "--data",
                str(text),
                "--output",
                str(out),
                "--budget-params",
                "0.8",
                "--blocks",
                "experts",
                "--num-samples",
                "2",
                "--seq-len",
                "32",
                "-q",
            ]
        )
        == 0
    )
    capsys.readouterr()
    plan = json.loads(out.read_text())
    assert plan["layers"] and all(set(v) == {"num_experts"} for v in plan["layers"].values())
    assert any(v["num_experts"] < 4 for v in plan["layers"].values())
    assert main(["slice", str(src), "--plan", str(out), "-o", str(tmp_path / "sliced"), "-q"]) == 0

    def count(model):
        k = model.config.get_text_config(decoder=True).num_experts_per_tok
        total = active = 0.0
        for name, p in model.named_parameters():
            total += p.numel()
            if name.endswith((".mlp.experts.gate_up_proj", ".mlp.experts.down_proj")):
                active += p.numel() * k / p.shape[0]  # k of the layer's experts run per token
            else:
                active += p.numel()  # the router scores every kept expert
        return total, active

    full, cut = load_pretrained(src), load_pretrained(tmp_path / "sliced")
    assert [m.mlp.experts.gate_up_proj.shape[0] for m in cut.model.layers] == [
        plan["layers"].get(f"model.layers.{i}.mlp", {}).get("num_experts", 4) for i in range(4)
    ]
    (p_full, a_full), (p_cut, a_cut) = count(full), count(cut)
    totals = plan["totals"]
    assert (totals["model_params"], totals["model_params_kept"]) == (p_full, p_cut) and p_cut <= 0.8 * p_full
    assert totals["active_params"] == pytest.approx(a_full) and totals["active_params_kept"] == pytest.approx(
        a_cut
    )
    assert a_cut < a_full  # the router rows of the removed experts


def test_plan_and_prune_remove_decoder_layers_and_the_output_generates(tmp_path, capsys):
    """``--blocks depth`` under a parameter budget that no width can meet: the plan removes layers
    (``"removed": true``), and ``prune`` with it writes a model equal to the original with those layers
    skipped, which loads and generates with a cache."""
    import json

    from tiny_models import cached_decode_logits, logits

    from gdnprune.cli import main
    from gdnprune.io.loading import load_pretrained

    src, text, scores = _source(tmp_path, "qwen3_5", seed=5)
    out = tmp_path / "plan.json"
    assert (
        main(
            [
                "plan",
                str(src),
                "--scores",
                str(scores),
                "--data",
                str(text),
                "--output",
                str(out),
                "--budget-params",
                "0.8",
                "--blocks",
                "depth",
                "--num-samples",
                "2",
                "--seq-len",
                "32",
                "-q",
            ]
        )
        == 0
    )
    printed = capsys.readouterr().out
    plan = json.loads(out.read_text())
    removed = sorted(int(k.rsplit(".", 1)[1]) for k, v in plan["layers"].items() if v == {"removed": True})
    assert removed and len(plan["layers"]) == len(removed) and "removed decoder layers" in printed
    report = json.loads((tmp_path / "plan.sensitivity.json").read_text())
    assert len(report["removal"]) == 4 and all("block_influence" in e for e in report["removal"].values())
    # the cheapest removals that fit: no other set of layers meets the budget with a smaller summed KL
    import itertools

    kl = {e["layer"]: e["sensitivity"] for e in report["removal"].values()}
    size = {e["layer"]: e["params"] for e in report["removal"].values()}
    total, limit = plan["totals"]["model_params"], plan["budgets"]["params"]["limit"]
    best = min(
        (sum(kl[i] for i in s), sorted(s))
        for r in range(1, 4)
        for s in itertools.combinations(range(4), r)
        if total - sum(size[i] for i in s) <= limit
    )
    assert best[1] == removed

    assert (
        main(
            [
                "prune",
                str(src),
                "--data",
                str(text),
                "-o",
                str(tmp_path / "pruned"),
                "--budget-params",
                "0.8",
                "--blocks",
                "depth",
                "--num-samples",
                "2",
                "--plan-samples",
                "2",
                "--seq-len",
                "32",
                "-q",
            ]
        )
        == 0
    )
    assert "removed" in capsys.readouterr().out
    full, cut = load_pretrained(src), load_pretrained(tmp_path / "pruned")
    gone = json.loads((tmp_path / "pruned" / "gdnprune.json").read_text())["removed_layers"]
    assert gone and cut.config.num_hidden_layers == 4 - len(gone)
    assert sum(p.numel() for p in cut.parameters()) <= 0.8 * sum(p.numel() for p in full.parameters())
    ids = token_ids(seed=3, seq=8)
    expected = logits(skipped_model(full, gone), ids)
    assert torch.allclose(logits(cut, ids), expected, atol=1e-4 * expected.abs().max().item())
    assert torch.allclose(
        cached_decode_logits(cut, ids, 3), expected[:, -4:], atol=1e-4 * expected.abs().max().item()
    )
    assert cut.generate(ids[:1], max_new_tokens=4, do_sample=False).shape == (1, 12)


def test_the_proxy_cannot_rank_removals_against_widths_and_says_so():
    from gdnprune.plan import check_budgets, plan_model
    from gdnprune.scoring import score_model

    model = random_dense_model("qwen3_5", seed=1)
    ids = token_ids(seed=2, batch=2, seq=12)
    scores = score_model(model, [ids], progress=False)
    with pytest.raises(ValueError, match="cannot rank removing a decoder layer"):
        plan_model(model, None, scores, budget_params=0.8, blocks=["gdn", "depth"], sensitivity="proxy")
    plan, _ = plan_model(
        model, None, scores, budget_gdn_params=0.8, sensitivity="proxy"
    )  # GDN budgets: widths
    assert not any("removed" in v for v in plan["layers"].values())
    with pytest.raises(ValueError, match="uniform"):
        check_budgets(model, budget_params=0.8, blocks=["gdn", "depth"], uniform=True)
    # removal makes budgets reachable that widths alone are not, and the feasibility check says so first
    with pytest.raises(BudgetError):
        check_budgets(model, budget_params=0.45, blocks=["gdn"])
    check_budgets(model, budget_params=0.45, blocks=["gdn", "depth"])
    with pytest.raises(BudgetError):  # even with removal one full-attention layer stays
        check_budgets(model, budget_params=0.3, blocks=["gdn", "depth"])


def test_the_joint_kl_of_expert_and_shared_expert_cuts_in_one_layer_is_that_of_the_model_cut_in_memory():
    """Routed experts are planned at ``layers.N.mlp``, the shared expert inside it: a whole plan cutting both
    must cut both (the shared-expert candidate goes into the cut MoE block). Reference: ``slice_model``
    (a model built from the cut config, tested against router masking in test_experts.py)."""
    from gdnprune.io.loading import slice_model
    from gdnprune.model.subblock_shapes import ExpertShape, MLPShape
    from gdnprune.model.subblock_surgery import find_model_blocks, random_orders
    from gdnprune.plan.measure.joint import JointKL, plan_kl
    from gdnprune.plan.measure.subblocks import BlockToPlan

    model = random_dense_model("qwen3_5_moe", seed=6)
    g = torch.Generator().manual_seed(4)
    blocks = [b for b in find_model_blocks(model, ("experts", "shared_expert")) if ".layers.1." in b.prefix]
    orders = {b.prefix: random_orders(b, generator=g) for b in blocks}
    targets = {"experts": ExpertShape(2, 2), "shared_expert": MLPShape(8)}
    groups = [
        BlockToPlan(b, model.get_submodule(b.prefix), orders[b.prefix], [b.shape, targets[b.kind]])
        for b in blocks
    ]
    assert sorted(b.block.kind for b in groups) == ["experts", "shared_expert"]
    batches = [token_ids(seed=i, batch=1, seq=10) for i in range(2)]
    joint = JointKL(model, batches, groups)
    cut = slice_model(
        model,
        None,
        blocks={
            b.prefix: {"num_experts": 2} if b.kind == "experts" else {"shared_expert_intermediate_size": 8}
            for b in blocks
        },
        block_orders=orders,
    )
    expected = _kl_per_token(model, cut, batches)
    assert plan_kl(joint, [1, 1]) == pytest.approx(expected, rel=1e-4)
    only_experts = [1 if b.block.kind == "experts" else 0 for b in groups]
    assert abs(plan_kl(joint, only_experts) - expected) > 1e-3 * expected  # the shared-expert cut is in it


def test_a_refined_plan_with_removal_and_expert_counts_meets_its_budgets_and_is_no_worse():
    from gdnprune.plan import plan_model
    from gdnprune.scoring import score_model

    model = random_dense_model("qwen3_5_moe", seed=1)
    ids = token_ids(seed=2, batch=4, seq=16)
    scores = score_model(model, [ids], progress=False, blocks=True)
    plan, report = plan_model(
        model,
        [ids[:2], ids[2:]],
        scores,
        budget_params=0.55,
        budget_active_params=0.7,
        dim_step="1/2",
        sensitivity="measured",
        evolve_generations=4,
        evolve_offspring=4,
        progress=False,
    )
    refined = report["evolution"]
    assert refined["kl"] <= refined["seed_kl"]
    totals = plan["totals"]
    assert totals["model_params_kept"] <= 0.55 * totals["model_params"] + 1e-6
    assert totals["active_params_kept"] <= 0.7 * totals["active_params"] + 1e-6
    removed = plan["predicted"]["removed_layers"]
    assert removed == sorted(e["layer"] for e in report["removal"].values() if e["removed"])
    assert all(not k.startswith(tuple(f"model.layers.{i}." for i in removed)) for k in plan["layers"])
    assert any("num_experts" in v for v in plan["layers"].values())


def test_a_rung_that_removes_a_layer_keeps_its_groups_smallest_candidates():
    from gdnprune.plan.measure.halving import near

    sizes = np.array([4.0, 1.0, 3.0, 2.0])
    alive = np.array([True, True, False, True])
    assert near(sizes, alive, None, 2).tolist() == [False, True, False, True]  # removed: nearest to size 0
    assert near(sizes, alive, 0, 1).tolist() == [True, False, False, False]


@pytest.mark.parametrize("seed", range(6))
def test_one_full_attention_layer_always_stays_in_the_milp_and_in_every_mutation(seed):
    """``keep_one_of`` (a hybrid model's full-attention layers): the MILP equals brute force over the removals
    that keep one of them, and no mutation of the refinement removes the last one."""
    from gdnprune.plan.choose.evolve import REMOVED, mutate

    rng = np.random.default_rng(seed)
    layer_of = [0, 1, 2, 3]
    sensitivity = [[0.0] + sorted(rng.uniform(0, 1, 2).tolist()) for _ in layer_of]
    params = [sorted(rng.integers(5, 20, 3).tolist(), reverse=True) for _ in layer_of]
    removal = {layer: float(rng.uniform(0.01, 0.3)) for layer in layer_of}
    removal[1], removal[3] = 0.001, 0.002  # the attention layers are the cheapest to remove
    budgets = {"params": 0.3 * sum(p[0] for p in params)}
    value, best = _brute(sensitivity, {"params": params}, budgets, layer_of, removal, keep_one_of=[1, 3])
    if best is None:
        with pytest.raises(BudgetError):
            choose_with_removal(
                sensitivity,
                {"params": params},
                budgets,
                layer_of=layer_of,
                removal=removal,
                keep_one_of=[1, 3],
            )
        return
    choice, removed = choose_with_removal(
        sensitivity, {"params": params}, budgets, layer_of=layer_of, removal=removal, keep_one_of=[1, 3]
    )
    assert not {1, 3} <= set(removed)
    got = sum(sensitivity[g][c] for g, c in enumerate(choice) if c is not None) + sum(
        removal[layer] for layer in removed
    )
    assert abs(got - value) < 1e-9
    free, _ = choose_with_removal(
        sensitivity, {"params": params}, budgets, layer_of=layer_of, removal=removal
    )
    picks = [REMOVED if c is None else c for c in choice]
    for _ in range(200):
        picks = (
            mutate(
                picks,
                {"params": params},
                budgets,
                rng,
                layer_of=layer_of,
                removable=layer_of,
                keep_one_of=[1, 3],
            )
            or picks
        )
        assert not (picks[1] == REMOVED and picks[3] == REMOVED)
