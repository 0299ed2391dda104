"""Whole-model plans (issue 21): attention heads, MLP and shared-expert channels as plan candidates beside
the GDN layers. Their measured sensitivity against the full model with the removed output columns zeroed;
the MILP with the whole-model budgets against brute force; a plan that meets every budget on the loaded
sliced model, counted independently; the GDN-only path unchanged."""

from __future__ import annotations

import pytest
import torch
from helpers import (
    DENSE,
    kept_by_orders,
    random_block_orders,
    random_dense_model,
    scored_source,
    token_ids,
    zeroed_model,
)

from gdnprune.model.subblock_shapes import AttentionShape, MLPShape
from gdnprune.model.subblock_surgery import find_model_blocks
from gdnprune.plan.measure.halving import halving_sensitivity
from gdnprune.plan.measure.sensitivity import measured_sensitivity
from gdnprune.plan.measure.subblocks import BlockToPlan


def _kl(teacher, student):
    t, s = teacher.log_softmax(-1), student.log_softmax(-1)
    return float((t.exp() * (t - s)).sum(-1).mean())


@pytest.mark.parametrize("model_type", ["qwen3_5", "qwen3_5_moe"])
def test_sub_block_sensitivity_is_the_kl_of_the_model_with_the_removed_columns_zeroed(model_type):
    model = random_dense_model(model_type, seed=2)
    orders = random_block_orders(model, seed=5)
    blocks = find_model_blocks(model, DENSE)
    targets = {"mlp": MLPShape(40), "shared_expert": MLPShape(12)}
    to_plan = [
        BlockToPlan(
            b,
            model.get_submodule(b.prefix),
            orders[b.prefix],
            [b.shape, AttentionShape(2, 1, b.shape.head_dim) if b.kind == "attention" else targets[b.kind]],
        )
        for b in blocks
    ]
    assert {b.kind for b in blocks} == (
        {"attention", "shared_expert"} if "moe" in model_type else {"attention", "mlp"}
    )
    ids = token_ids(seed=4, batch=2, seq=10)
    result = measured_sensitivity(model, [ids[:1], ids[1:]], to_plan, progress=False)
    with torch.no_grad():
        teacher = model(input_ids=ids).logits
        for layer in to_plan:
            fields = {
                "attention": {"num_attention_heads": 2, "num_key_value_heads": 1},
                "mlp": {"intermediate_size": 40},
                "shared_expert": {"shared_expert_intermediate_size": 12},
            }[layer.block.kind]
            ref = zeroed_model(
                model,
                {layer.prefix: (layer.block.kind, kept_by_orders(layer.block, orders[layer.prefix], fields))},
            )
            expected = _kl(teacher, ref(input_ids=ids).logits)
            assert result["kl"][layer.prefix][0] == 0.0
            assert expected > 1e-6
            assert result["kl"][layer.prefix][1] == pytest.approx(expected, rel=1e-3, abs=1e-7), layer.prefix
    # successive halving runs on the same candidates: with every window in its first rung it is the full measurement
    costs = {"params": [[float(layer.block.parameters(t)) for t in layer.candidates] for layer in to_plan]}
    budget = {"params": sum(c[0] for c in costs["params"])}
    halved = halving_sensitivity(model, [ids[:1], ids[1:]], to_plan, costs, budget, first=2, progress=False)
    for layer in to_plan:
        assert halved["kl"][layer.prefix] == pytest.approx(result["kl"][layer.prefix], rel=1e-5, abs=1e-9)


# ---- the exact choice under the whole-model budgets -----------------------------------------------------------


@pytest.mark.parametrize("seed", range(8))
def test_the_milp_with_whole_model_budgets_equals_brute_force(seed):
    """GDN groups cost GDN parameters, state and memory; sub-block groups cost parameters and KV memory; both
    sit on a fixed part (embeddings, norms, what no candidate changes) that every whole-model budget counts."""
    import itertools

    import numpy as np

    from gdnprune.plan import BudgetError, choose

    rng = np.random.default_rng(seed)
    groups = []
    for g in range(5):
        k = int(rng.integers(2, 4))
        gdn = g < 2
        params = sorted(rng.integers(5, 40, k).tolist(), reverse=True)
        memory = sorted(rng.integers(1, 12, k).tolist(), reverse=True)
        groups.append(
            {
                "kl": [0.0] + sorted(rng.uniform(0, 1, k - 1).tolist()),
                "params": params,
                "gdn_params": params if gdn else [0] * k,
                "state": memory if gdn else [0] * k,
                "memory": memory if gdn or g == 2 else [0] * k,
            }
        )  # group 2: an attention (KV cache)
    fixed = {"params": 50, "memory": 7}
    full = {
        n: sum(gr[n][0] for gr in groups) + fixed.get(n, 0)
        for n in ("params", "gdn_params", "state", "memory")
    }
    limits = {
        "params": 0.6 * full["params"],
        "memory": 0.7 * full["memory"],
        "gdn_params": 0.8 * full["gdn_params"],
        "state": 0.9 * full["state"],
    }
    best = (np.inf, None)
    for pick in itertools.product(*[range(len(gr["kl"])) for gr in groups]):
        if all(
            fixed.get(n, 0) + sum(gr[n][c] for gr, c in zip(groups, pick)) <= limit
            for n, limit in limits.items()
        ):
            value = sum(gr["kl"][c] for gr, c in zip(groups, pick))
            if value < best[0]:
                best = (value, pick)
    costs = {n: [gr[n] for gr in groups] for n in limits}
    budgets = {n: limit - fixed.get(n, 0) for n, limit in limits.items()}
    if best[1] is None:
        with pytest.raises(BudgetError):
            choose([gr["kl"] for gr in groups], costs, budgets)
        return
    picks = choose([gr["kl"] for gr in groups], costs, budgets)
    assert sum(gr["kl"][c] for gr, c in zip(groups, picks)) == pytest.approx(best[0], abs=1e-12)


# ---- a whole-model plan on a real tiny checkpoint --------------------------------------------------------------


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    text = "the model sorts heads and channels and slices them"
    return scored_source(tmp_path_factory.mktemp("plan_whole"), seed=6, text=text, seq_len=40)


def _count(model, context):
    """Parameters (sum of numel, a tied tensor once) and memory per sequence of a loaded model, by DESIGN.md's
    formula for the GDN state (float32) and 2 * kv_heads * head_dim * context * bytes per attention layer."""
    from gdnprune.model.layouts import find_gdn_modules

    params = sum(p.numel() for p in model.parameters())
    state = (
        sum(
            m.num_v_heads * m.head_k_dim * m.head_v_dim
            + (2 * m.num_k_heads * m.head_k_dim + m.num_v_heads * m.head_v_dim) * (m.conv_kernel_size - 1)
            for _, m in find_gdn_modules(model)
        )
        * 4
    )
    kv = sum(
        2 * m.k_proj.weight.shape[0] * context * m.k_proj.weight.element_size()
        for name, m in model.named_modules()
        if name.endswith("self_attn")
    )
    return params, state + kv


def test_a_whole_model_plan_meets_every_budget_on_the_loaded_sliced_model(folder, tmp_path, capsys):
    import json

    from gdnprune import load_pretrained
    from gdnprune.cli import main
    from gdnprune.io.plan_file import read_plan

    src, text, scores = folder
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
                "0.7",
                "--budget-memory",
                "0.6",
                "--context",
                "64",
                "--dim-step",
                "1/2",
                "--sensitivity",
                "measured",
                "--num-samples",
                "2",
                "--seq-len",
                "40",
                "-q",
            ]
        )
        == 0
    )
    stdout = capsys.readouterr().out
    assert "model parameters kept" in stdout and "split: " in stdout
    plan = json.loads(out.read_text())
    removed = sorted(int(k.rsplit(".", 1)[1]) for k, v in plan["layers"].items() if "removed" in v)
    assert plan["version"] == 2 and read_plan(out)["layers"] == {
        k: v for k, v in plan["layers"].items() if "removed" not in v
    }  # reads back as written
    assert read_plan(out).get("removed_layers", []) == removed == plan["predicted"]["removed_layers"]
    kinds = {
        (
            "attention"
            if k.endswith("self_attn")
            else "mlp"
            if k.endswith("mlp")
            else "gdn"
            if k.endswith("linear_attn")
            else "depth"
        )
        for k in plan["layers"]
    }
    assert kinds - {"depth"} == {"gdn", "attention", "mlp"}
    assert main(["slice", str(src), "--plan", str(out), "-o", str(tmp_path / "sliced"), "-q"]) == 0
    full = load_pretrained(src, dtype=torch.float32)
    sliced = load_pretrained(tmp_path / "sliced", dtype=torch.float32)
    (p_full, m_full), (p_cut, m_cut) = _count(full, 64), _count(sliced, 64)
    assert p_cut <= 0.7 * p_full and m_cut <= 0.6 * m_full
    assert p_cut < p_full and m_cut < m_full
    # the plan's own totals are those counts
    totals = plan["totals"]
    assert (totals["model_params"], totals["model_params_kept"]) == (p_full, p_cut)
    assert (totals["memory_bytes"], totals["memory_bytes_kept"]) == (m_full, m_cut)
    assert sum(v["params_kept"] for v in totals["split"].values()) == p_cut
    # the plan is the exact optimum over the report's candidates (brute force over its measured sensitivities)
    report = json.loads((tmp_path / "plan.sensitivity.json").read_text())
    _check_optimal(report, plan, _layer_costs(full, 64))
    # the removal candidates: every decoder layer, measured, and the chosen ones are the plan's
    assert sorted(e["layer"] for e in report["removal"].values()) == list(
        range(full.config.num_hidden_layers)
    )
    assert sorted(e["layer"] for e in report["removal"].values() if e["removed"]) == removed
    assert all(e["sensitivity"] > 0 for e in report["removal"].values())
    if removed:  # a removed layer's sub-blocks have no width in the plan
        assert all(g["chosen"] is None for k, g in report["blocks"].items() if f"layers.{removed[0]}." in k)


def _layer_costs(model, context):
    """Per decoder layer of a loaded model, counted directly: its parameters and its memory per sequence
    (as :func:`_count` counts them)."""
    out = {}
    for i, layer in enumerate(model.model.layers):
        params = sum(p.numel() for p in layer.parameters())
        memory = 0
        if hasattr(layer, "linear_attn"):
            m = layer.linear_attn
            memory += (
                m.num_v_heads * m.head_k_dim * m.head_v_dim
                + (2 * m.num_k_heads * m.head_k_dim + m.num_v_heads * m.head_v_dim) * (m.conv_kernel_size - 1)
            ) * 4
        if hasattr(layer, "self_attn"):
            w = layer.self_attn.k_proj.weight
            memory += 2 * w.shape[0] * context * w.element_size()
        out[i] = {"params": params, "memory": memory}
    return out


def _check_optimal(report, plan, layer_costs=None):
    """No combination of the report's candidates (and, with ``layer_costs`` — per decoder layer, what it costs
    as a whole —, of removed layers) that meets the plan's budgets has a lower summed KL: brute force."""
    import itertools
    import re

    def layer(key):
        return int(re.search(r"layers\.(\d+)", key).group(1))

    groups = [
        {
            "kl": [c["sensitivity"] for c in g["candidates"]],
            "params": [c["params"] for c in g["candidates"]],
            "memory": [c["state_bytes"] for c in g["candidates"]],
            "chosen": g["chosen"],
            "layer": layer(k),
        }
        for k, g in report["layers"].items()
    ]
    groups += [
        {
            "kl": [c["sensitivity"] for c in g["candidates"]],
            "params": [c["params"] for c in g["candidates"]],
            "memory": [c["memory"] for c in g["candidates"]],
            "chosen": g["chosen"],
            "layer": layer(k),
        }
        for k, g in report["blocks"].items()
    ]
    totals = plan["totals"]
    names = ("params", "memory")
    full = {"params": totals["model_params"], "memory": totals["memory_bytes"]}
    fixed = {n: full[n] - sum(g[n][0] for g in groups) for n in names}
    limits = {n: plan["budgets"][n]["limit"] for n in names}
    removal = (
        {e["layer"]: e["sensitivity"] for e in (report.get("removal") or {}).values()} if layer_costs else {}
    )
    rest = {
        i: {n: layer_costs[i][n] - sum(g[n][0] for g in groups if g["layer"] == i) for n in names}
        for i in removal
    }  # what a removed layer frees beyond its planned groups
    layers = sorted({g["layer"] for g in groups} | set(removal))
    per_layer = []  # every option of every decoder layer: (kl, costs) of a width choice of its groups, or removal
    for i in layers:
        mine = [g for g in groups if g["layer"] == i]
        options = [
            (
                sum(g["kl"][c] for g, c in zip(mine, pick)),
                {n: sum(g[n][c] for g, c in zip(mine, pick)) for n in names},
                pick,
            )
            for pick in itertools.product(*[range(len(g["kl"])) for g in mine])
        ]
        if i in removal:
            options.append((removal[i], {n: -rest[i][n] for n in names}, None))
        per_layer.append(options)
    assert np_prod([len(o) for o in per_layer]) < 3_000_000
    chosen = sum(g["kl"][g["chosen"]] for g in groups if g["chosen"] is not None) + sum(
        e["sensitivity"] for e in report.get("removal", {}).values() if e["removed"]
    )
    best = min(
        sum(o[0] for o in pick)
        for pick in itertools.product(*per_layer)
        if all(fixed[n] + sum(o[1][n] for o in pick) <= limits[n] + 1e-6 for n in names)
        and sum(o[2] is None for o in pick) < len(layers)
    )
    assert chosen == pytest.approx(best, abs=1e-12)


def np_prod(values):
    out = 1
    for v in values:
        out *= v
    return out


def test_only_gdn_budgets_cut_only_gdn_layers(folder):
    """``budget_gdn_params`` alone is the GDN-only search of before (same plan as the old ``budget_params``:
    checked against main when the option moved): no sub-block entry, the GDN budget met, the exact optimum."""
    from gdnprune.plan import plan_checkpoint

    src, text, scores = folder
    plan, report = plan_checkpoint(
        src,
        text,
        scores,
        num_samples=2,
        seq_len=40,
        budget_gdn_params=0.5,
        sensitivity="measured",
        dim_step="1/2",
        progress=False,
    )
    assert all(k.endswith("linear_attn") for k in plan["layers"]) and "blocks" not in report
    assert set(plan["budgets"]) == {"gdn_params"} and "model_params" not in plan["totals"]
    assert plan["totals"]["gdn_params_kept"] <= 0.5 * plan["totals"]["gdn_params"]
    import itertools

    groups = list(report["layers"].values())
    best = min(
        sum(g["candidates"][c]["sensitivity"] for g, c in zip(groups, pick))
        for pick in itertools.product(*[range(len(g["candidates"])) for g in groups])
        if sum(g["candidates"][c]["params"] for g, c in zip(groups, pick))
        <= plan["budgets"]["gdn_params"]["limit"]
    )
    assert plan["predicted"]["summed_sensitivity"] == pytest.approx(best, abs=1e-12)


def test_prune_with_a_whole_model_budget_halves_the_model_and_says_so(folder, tmp_path, capsys):
    from gdnprune import load_pretrained
    from gdnprune.cli import main

    src, text, _ = folder
    out = tmp_path / "pruned"
    assert (
        main(
            [
                "prune",
                str(src),
                "--data",
                str(text),
                "-o",
                str(out),
                "--budget-params",
                "0.5",
                "--dim-step",
                "1/2",
                "--num-samples",
                "4",
                "--plan-samples",
                "2",
                "--seq-len",
                "40",
                "-q",
            ]
        )
        == 0
    )
    stdout = capsys.readouterr().out
    assert "of the model's parameters kept" in stdout and "split: gdn" in stdout and "attention" in stdout
    full, cut = load_pretrained(src, dtype=torch.float32), load_pretrained(out, dtype=torch.float32)
    p_full, p_cut = (sum(p.numel() for p in m.parameters()) for m in (full, cut))
    assert p_cut <= 0.5 * p_full
    # attention and MLP widths were cut too, not only GDN layers
    shapes = {n: tuple(p.shape) for n, p in cut.named_parameters()}
    full_shapes = {n: tuple(p.shape) for n, p in full.named_parameters()}
    assert any(shapes[n] != full_shapes[n] for n in shapes if ".mlp." in n or ".self_attn." in n)
    # what no candidate changes cannot go: a budget below it is refused before any forward
    assert (
        main(
            [
                "prune",
                str(src),
                "--data",
                str(text),
                "-o",
                str(tmp_path / "x"),
                "--budget-params",
                "0.05",
                "--num-samples",
                "4",
                "--seq-len",
                "40",
                "-q",
            ]
        )
        == 2
    )
    assert "no plan meets the budgets" in capsys.readouterr().err


def test_an_active_parameter_budget_on_a_moe_model_counts_the_routed_experts_at_k_of_e(tmp_path, capsys):
    """Qwen3.5-MoE: active parameters = every parameter less the routed experts' unused share (a token runs
    num_experts_per_tok of num_experts), counted on the loaded sliced model; the shared experts and attention
    shrink to meet it."""
    import json

    from gdnprune import load_pretrained
    from gdnprune.cli import main

    text = "experts route tokens and the plan counts them"
    src, text, scores = scored_source(
        tmp_path, "qwen3_5_moe", seed=2, text=text, repeats=300, num_samples=2, seq_len=32
    )
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
                "--budget-active-params",
                "0.8",
                "--blocks",
                "attention,shared_expert",
                "--dim-step",
                "1/2",
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
    assert not any(k.endswith("linear_attn") for k in plan["layers"])  # --blocks left the GDN layers out
    assert main(["slice", str(src), "--plan", str(out), "-o", str(tmp_path / "sliced"), "-q"]) == 0

    def active(model):
        text_config = model.config.get_text_config(decoder=True)
        share = text_config.num_experts_per_tok / text_config.num_experts
        total = 0.0
        for name, p in model.named_parameters():
            routed = ".mlp.experts." in name
            total += p.numel() * (share if routed else 1.0)
        return total

    full = load_pretrained(src, dtype=torch.float32)
    cut = load_pretrained(tmp_path / "sliced", dtype=torch.float32)
    assert active(full) != sum(p.numel() for p in full.parameters())  # the routed experts are there
    assert active(cut) <= 0.8 * active(full) < active(full)
    assert plan["totals"]["active_params"] == pytest.approx(active(full))
    assert plan["totals"]["active_params_kept"] == pytest.approx(active(cut))


def test_bad_whole_model_options_are_refused_before_any_forward_and_refinement_runs_on_sub_blocks():
    from gdnprune.plan import check_budgets, plan_model
    from gdnprune.scoring import GDN_ONLY, score_model

    model = random_dense_model("qwen3_5", seed=1)
    for options, words in (
        (dict(budget_memory=0.5), "`context`"),
        (dict(budget_params=0.5, blocks=["mlp", "ffn"]), "`blocks`"),
        (dict(budget_params=0.5, blocks=["mlp"], budget_state=0.5), "leaves them out"),
    ):
        with pytest.raises(ValueError, match=words):
            check_budgets(model, **options)
    ids = token_ids(seed=2, batch=4, seq=16)
    with pytest.raises(ValueError, match="sub-blocks"):  # scores without the sub-blocks' orders
        gdn_only = score_model(model, [ids], progress=False, blocks=GDN_ONLY)
        plan_model(model, [ids], gdn_only, budget_params=0.8, progress=False)
    scores = score_model(model, [ids], progress=False, blocks=True)
    plan, report = plan_model(
        model,
        [ids[:2], ids[2:]],
        scores,
        budget_params=0.75,
        blocks=["attention", "mlp"],
        sensitivity="measured",
        evolve_generations=2,
        evolve_offspring=3,
        progress=False,
    )
    refined = report["evolution"]
    assert (
        refined["kl"] <= refined["seed_kl"]
        and plan["totals"]["model_params_kept"] <= 0.75 * plan["totals"]["model_params"]
    )
    assert {k.rsplit(".", 1)[-1] for k in plan["layers"]} == {"self_attn", "mlp"}
