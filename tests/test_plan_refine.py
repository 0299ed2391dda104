"""The cheaper sensitivity (successive halving) and the joint refinement (evolution over whole plans)."""

from __future__ import annotations

import itertools
import json

import numpy as np
import pytest
import torch
from launches import REFINED
from tiny_models import build_model, cut_model

from gdnprune.cli import main
from gdnprune.io.plan_file import constraint_violations
from gdnprune.model.geometry import GDNShape, orders_from_payload
from gdnprune.model.layouts import find_gdn_modules
from gdnprune.plan import choose, layer_candidates, plan_model
from gdnprune.plan.choose.evolve import evolve, feasible, mutate
from gdnprune.plan.choose.solve import choose_among
from gdnprune.plan.measure.halving import dominated, halving_sensitivity, near, rungs
from gdnprune.plan.measure.joint import JointKL, evolve_plan, refine_plan
from gdnprune.plan.measure.sensitivity import LayerToPlan, measured_sensitivity
from gdnprune.scoring import score_model, scores_to_permutations

pytestmark = pytest.mark.filterwarnings("ignore::gdnprune.checkpoint.UnsortedInputWarning")

SHAPE = GDNShape(num_key_heads=2, num_value_heads=4, key_head_dim=8, value_head_dim=8)


def windows(n=4, length=40, seed=0, vocab=128):
    return torch.randint(0, vocab, (n, length), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def case():
    """A tiny qwen3_5 model (2 GDN layers), its scores, and every layer's candidates at a 1/2 grid."""
    model = build_model("qwen3_5", SHAPE, seed=7)
    x = windows()
    scores = score_model(model, [x], progress=False)
    layers, table = [], []
    for prefix, module in find_gdn_modules(model):
        cands = layer_candidates(
            prefix,
            SHAPE,
            {n: tuple(p.shape) for n, p in module.named_parameters()},
            "qwen3_5",
            module.conv_kernel_size,
            dim_step="1/2",
        )
        layers.append(
            LayerToPlan(
                prefix,
                module,
                orders_from_payload(scores["layers"][prefix], SHAPE),
                [c.target for c in cands],
            )
        )
        table.append(cands)
    costs = {
        "params": [[c.params for c in cands] for cands in table],
        "state": [[c.state for c in cands] for cands in table],
    }
    return model, x, scores, layers, table, costs


# ---- successive halving ----------------------------------------------------------------------------------


def test_rungs_and_the_survivors_near_the_choice():
    assert (
        rungs(16) == [1, 4, 16] and rungs(16, 16) == [16] and rungs(5, 2, 2) == [2, 4, 5] and rungs(1) == [1]
    )
    sizes = np.array([5.0, 1.0, 4.0, 2.0, 3.0])
    alive = np.array([True, True, True, False, True])
    # alive in size order: 1 (1.0), 4 (3.0), 2 (4.0), 0 (5.0); nearest to candidate 2 first, ties to the larger
    assert np.flatnonzero(near(sizes, alive, 2, 1)).tolist() == [2]
    assert sorted(np.flatnonzero(near(sizes, alive, 2, 2)).tolist()) == [0, 2]
    assert sorted(np.flatnonzero(near(sizes, alive, 2, 3)).tolist()) == [0, 2, 4]


def test_dominance_needs_a_cheaper_candidate_better_beyond_the_noise():
    costs = np.array([[10.0], [5.0], [5.0], [1.0]])
    kl = np.array(
        [
            [1.0, 1.2, 0.8, 1.0],  # costs most; candidate 1 is better by far on every window
            [0.1, 0.2, 0.1, 0.2],
            [0.3, 0.1, 0.2, 0.05],  # same cost as 1, better on average by less than two standard errors
            [2.0, 2.0, 2.0, 2.0],
        ]
    )  # cheapest: nothing can dominate it
    alive = np.ones(4, dtype=bool)
    assert dominated(kl, costs, alive).tolist() == [True, False, False, False]
    # brute force over pairs with the same rule
    for a, b in itertools.permutations(range(4), 2):
        d = kl[a] - kl[b]
        beyond = d.mean() > max(2 * d.std(ddof=1) / 2, 0.02 * kl[a].mean())
        if costs[b, 0] <= costs[a, 0] and beyond:
            assert dominated(kl, costs, alive)[a]
    assert not dominated(kl, costs, np.array([True, False, False, True])).any()  # its dominators are gone


def test_halving_with_every_window_in_its_first_rung_is_the_full_measurement(case):
    """Of every candidate some choice within the budget holds (by brute force over the choices); the others
    are never measured (windows 0)."""
    model, x, _, layers, table, costs = case
    budgets = {"params": 0.5 * sum(c[0] for c in costs["params"])}
    batches = [x[:2], x[2:]]
    full = measured_sensitivity(model, batches, layers, progress=False)
    halved = halving_sensitivity(model, batches, layers, costs, budgets, first=4, progress=False)
    assert halved["rungs"] == [4]
    held = [set() for _ in layers]
    for combo in itertools.product(*(range(len(layer.candidates)) for layer in layers)):
        if sum(costs["params"][li][c] for li, c in enumerate(combo)) <= budgets["params"]:
            for li, c in enumerate(combo):
                held[li].add(c)
    assert 0 < sum(len(h) for h in held) < sum(len(layer.candidates) for layer in layers)
    for li, layer in enumerate(layers):
        some = sorted(held[li])
        kl, loss = halved["kl"][layer.prefix], halved["loss"][layer.prefix]
        assert [kl[c] for c in some] == pytest.approx(
            [full["kl"][layer.prefix][c] for c in some], rel=1e-5, abs=1e-8
        )
        assert [loss[c] for c in some] == pytest.approx(
            [full["loss"][layer.prefix][c] for c in some], rel=1e-5
        )
        for c, n in enumerate(halved["windows"][layer.prefix]):
            kept = c in held[li] or layer.candidates[c] == layer.shape  # its own geometry: KL 0, exact
            assert n == (4 if kept else 0)
            assert halved["survivors"][layer.prefix][c] == kept
    kl_full = [full["kl"][layer.prefix] for layer in layers]
    kl_half = [halved["kl"][layer.prefix] for layer in layers]
    survivors = [halved["survivors"][layer.prefix] for layer in layers]
    assert choose_among(kl_half, costs, budgets, survivors) == choose(kl_full, costs, budgets)
    own = sum(1 for li, layer in enumerate(layers) if layer.candidates.index(layer.shape) in held[li])
    assert halved["forwards"] == 4 * (sum(len(h) for h in held) - own)  # its own geometry: never measured


def test_halving_measures_its_survivors_exactly_and_the_others_on_fewer_windows(case):
    model, x, _, layers, table, costs = case
    budgets = {"params": 0.5 * sum(c[0] for c in costs["params"])}
    batches = [x[:2], x[2:]]
    full = measured_sensitivity(model, batches, layers, progress=False)
    halved = halving_sensitivity(model, batches, layers, costs, budgets, first=1, grow=2, progress=False)
    assert halved["rungs"] == [1, 2, 4]
    assert halved["forwards"] < 4 * sum(len(layer.candidates) - 1 for layer in layers)
    for layer in layers:
        seen, alive = halved["windows"][layer.prefix], halved["survivors"][layer.prefix]
        assert 0 < sum(alive) < len(alive) and seen[0] == 4  # the full candidate: KL 0, exact
        for c, (n, kept) in enumerate(zip(seen, alive)):
            assert (n == 4) == kept or c == 0
            if n == 4:
                assert halved["kl"][layer.prefix][c] == pytest.approx(
                    full["kl"][layer.prefix][c], rel=1e-5, abs=1e-8
                )


# ---- the refinement's mutations and search ---------------------------------------------------------------


def _constrained_layers(tp, multiple_of):
    model = build_model("qwen3_5", GDNShape(4, 8, 8, 8), seed=1)
    out = []
    for prefix, module in find_gdn_modules(model) * 2:  # 4 layers
        out.append(
            layer_candidates(
                prefix,
                GDNShape(4, 8, 8, 8),
                {n: tuple(p.shape) for n, p in module.named_parameters()},
                "qwen3_5",
                4,
                dim_step="1/4",
                tp=tp,
                multiple_of=multiple_of,
            )
        )
    return out


@pytest.mark.parametrize("tp,multiple_of", [(None, None), (2, 4)])
def test_every_mutation_keeps_every_budget_and_constraint(tp, multiple_of):
    table = _constrained_layers(tp, multiple_of)
    costs = {
        "params": [[c.params for c in cands] for cands in table],
        "state": [[c.state for c in cands] for cands in table],
    }
    budgets = {
        "params": 0.45 * sum(c[0] for c in costs["params"]),
        "state": 0.6 * sum(c[0] for c in costs["state"]),
    }
    rng = np.random.default_rng(0)
    picks = choose([list(rng.random(len(cands))) for cands in table], costs, budgets)
    moved = 0
    for _ in range(400):
        child = mutate(picks, costs, budgets, rng)
        if child is None:
            continue
        moved += child != picks
        for name, limit in budgets.items():  # every budget, summed here
            assert sum(costs[name][layer][c] for layer, c in enumerate(child)) <= limit
        assert all(0 <= c < len(cands) for c, cands in zip(child, table))
        targets = {f"layer{k}": table[k][c].target for k, c in enumerate(child)}
        assert constraint_violations(targets, tp=tp, multiple_of=multiple_of) == []
        picks = child
    assert moved > 100


def _toy_problem(layers=3, options=4, windows=6, seed=0):
    """Costs and a non-additive fitness: the damage of a plan is the squared sum of its layers' damage, and
    cutting two neighbouring layers costs extra."""
    rng = np.random.default_rng(seed)
    size = [sorted(rng.integers(1, 20, options), reverse=True) for _ in range(layers)]
    damage = [[(size[k][0] - s) ** 1.5 * rng.uniform(0.5, 2) for s in size[k]] for k in range(layers)]
    noise = rng.uniform(0.8, 1.2, windows)
    costs = {"params": [[float(s) for s in layer] for layer in size]}
    budgets = {"params": 0.6 * sum(layer[0] for layer in size)}
    calls = []

    def fitness(plans, lo, hi):
        calls.append((len(plans), lo, hi))
        out = []
        for picks in plans:
            d = [damage[k][c] for k, c in enumerate(picks)]
            joint = sum(d) ** 2 / 10 + sum(a * b for a, b in zip(d, d[1:])) / 3
            out.append([joint * noise[w] for w in range(lo, hi)])
        return out

    return costs, budgets, damage, fitness, [1.0] * windows, calls


def test_evolution_is_deterministic_never_worse_and_finds_the_joint_optimum():
    costs, budgets, damage, fitness, weights, calls = _toy_problem(layers=4, options=5, seed=1)
    seed_picks = choose(damage, costs, budgets)
    first = evolve(costs, budgets, seed_picks, fitness, weights, generations=30, offspring=6, seed=3)
    again = evolve(costs, budgets, seed_picks, fitness, weights, generations=30, offspring=6, seed=3)
    assert first == again
    assert first["kl"] <= first["seed_kl"] and feasible(first["picks"], costs, budgets)
    assert first["kl"] == pytest.approx(np.mean(fitness([first["picks"]], 0, 6)[0]))
    assert [h["kl"] for h in first["history"]] == sorted((h["kl"] for h in first["history"]), reverse=True)
    # brute force over every feasible plan
    best = min(
        np.mean(fitness([list(p)], 0, 6)[0])
        for p in itertools.product(range(5), repeat=4)
        if feasible(p, costs, budgets)
    )
    assert (
        first["kl"] == pytest.approx(best) and first["seed_kl"] > best
    )  # the additive choice is not optimal
    # staged: most offspring are seen on the first quarter of the windows only
    assert (6, 0, 2) in calls and any(n < 6 and hi == 6 for n, _, hi in calls)


def test_the_joint_kl_is_the_kl_of_the_whole_cut_model(case):
    model, x, scores, layers, table, costs = case
    fitness = JointKL(model, [x], layers)
    picks = [5, 9]
    values = fitness([picks, [0, 0]], 0, 4)
    permutations = scores_to_permutations(scores)
    cut = cut_model(
        model, {layer.prefix: layer.candidates[c] for layer, c in zip(layers, picks)}, permutations
    )
    with torch.no_grad():
        teacher = model(input_ids=x).logits.log_softmax(-1)
        student = cut(input_ids=x).logits.log_softmax(-1)
    expected = (teacher.exp() * (teacher - student)).sum(-1).mean(-1)
    assert values[0] == pytest.approx(expected.tolist(), rel=1e-4, abs=1e-7)
    assert values[1] == [0.0] * 4


def test_plan_models_old_refine_keywords_warn_and_reach_the_evolutionary_search(case):
    """``refine_generations``, ``refine_offspring``, ``refine_seed`` are the old names of the ``evolve_*``
    keywords: they warn and are passed on (no batches: the search refuses to start, naming itself)."""
    model, x, scores, *_ = case
    for old, value in (("refine_generations", 1), ("refine_offspring", 3), ("refine_seed", 2)):
        new = old.replace("refine", "evolve")
        given = {old: value} if old == "refine_generations" else {old: value, "evolve_generations": 1}
        with pytest.warns(FutureWarning, match=f"`{old}` is deprecated.*use `{new}`"):
            with pytest.raises(ValueError, match="evolutionary search .* needs calibration batches"):
                plan_model(
                    model, None, scores, budget_gdn_params=0.5, blocks=["gdn"], progress=False, **given
                )
        with pytest.raises(TypeError, match=f"`{old}` and `{new}`"):
            plan_model(model, None, scores, budget_gdn_params=0.5, progress=False, **{old: value, new: value})
    with pytest.raises(ValueError, match="evolutionary search"):  # the new names reach it as well
        plan_model(
            model, [x], scores, budget_gdn_params=0.5, uniform=True, evolve_generations=1, progress=False
        )


def test_refining_a_real_plan_never_makes_it_worse_and_repeats_for_a_seed(case):
    model, x, _, layers, table, costs = case
    budgets = {"params": 0.4 * sum(c[0] for c in costs["params"])}
    full = measured_sensitivity(model, [x], layers, progress=False)
    picks = choose([full["kl"][layer.prefix] for layer in layers], costs, budgets)
    result = evolve_plan(
        model, [x], layers, costs, budgets, picks, generations=3, offspring=4, seed=1, progress=False
    )
    with pytest.warns(FutureWarning, match="refine_plan is deprecated.*use evolve_plan"):  # the old name
        again = refine_plan(
            model, [x], layers, costs, budgets, picks, generations=3, offspring=4, seed=1, progress=False
        )
    assert result["picks"] == again["picks"] and result["history"] == again["history"]
    assert result["kl"] <= result["seed_kl"] and feasible(result["picks"], costs, budgets)
    assert len(result["history"]) == 3 and result["windows"] == 4


# ---- the command line, the report and the plot -----------------------------------------------------------


def test_the_lower_envelope_falls_from_the_smallest_candidate_to_the_full_layer():
    from gdnprune.plan.report.plot import lower_envelope

    points = [(100, 0.0), (60, 0.3), (70, 0.5), (40, 0.9), (50, 0.2), (10, 2.0)]
    assert lower_envelope(points) == [(10, 2.0), (40, 0.9), (50, 0.2), (100, 0.0)]


def test_default_threads_follow_the_work_and_the_free_cores(monkeypatch):
    import os

    from gdnprune.cli._runtime import default_threads

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)), raising=False)
    monkeypatch.setattr(os, "getloadavg", lambda: (3.2, 0.0, 0.0))
    assert default_threads(128, 256) == 1  # the demo model: a tiny forward
    assert default_threads(4096, 512) == 5  # big, but only 8 - 3 cores are free
    monkeypatch.setattr(os, "getloadavg", lambda: (12.0, 0.0, 0.0))
    assert default_threads(4096, 512) == 1


def test_budgets_are_checked_before_any_forward(case):
    from gdnprune.plan import BudgetError, plan_model

    model, _, scores, *_ = case

    def batches():
        raise AssertionError("a forward ran before the budgets were checked")
        yield

    with pytest.raises(BudgetError, match="no plan meets the budgets"):
        plan_model(model, batches(), scores, budget_gdn_params=0.001, dim_step="1/2", progress=False)


def test_prune_says_no_plan_meets_the_budgets_before_it_scores(scored_folder, tmp_path, capsys, monkeypatch):
    import gdnprune.prune

    src, text, _ = scored_folder

    def never(*args, **kwargs):
        raise AssertionError("scored before the budgets were checked")

    # where prune looks it up (patching gdnprune.scoring would bind `never` into a first import of prune)
    monkeypatch.setattr(gdnprune.prune, "score_checkpoint", never)
    assert (
        main(
            [
                "prune",
                str(src),
                "--data",
                str(text),
                "-o",
                str(tmp_path / "p"),
                "--budget-gdn-params",
                "0.001",
                "--quiet",
            ]
        )
        == 2
    )
    assert "no plan meets the budgets" in capsys.readouterr().err
    assert not (tmp_path / "p").exists()


def test_plan_command_refines_and_reports_what_was_measured(scored_folder, tmp_path, capsys):
    src, text, scores = scored_folder
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
                "--budget-gdn-params",
                "0.4",
                "--dim-step",
                "1/2",
                "--num-samples",
                "4",
                "--seq-len",
                "72",
                "--refine-generations",
                "2",
                "--refine-offspring",
                "3",
                "-q",
            ]
        )
        == 0
    )
    stdout = capsys.readouterr().out
    assert "evolutionary search: KL of the whole cut model" in stdout
    plan = json.loads(out.read_text())
    report = json.loads((tmp_path / "plan.sensitivity.json").read_text())
    # the GDN budget measures on recall windows: the 4 calibration windows, each followed by its probe
    assert plan["sensitivity"] == report["sensitivity"] == "halving" and report["rungs"] == [1, 4, 8]
    assert plan["evolved"]["kl"] <= plan["evolved"]["seed_kl"] and plan["evolved"]["generations"] == 2
    assert [h["generation"] for h in report["evolution"]["history"]] == [1, 2]
    for layer in report["layers"].values():
        windows = [c["windows"] for c in layer["candidates"]]
        assert set(windows) <= {0, 1, 4, 8} and 8 in windows  # 0: no choice within the budget holds it
        assert all(c["windows"] == 8 for c in layer["candidates"] if c["survivor"])
    assert (tmp_path / "plan.sensitivity.png").stat().st_size > 1000
    with pytest.raises(SystemExit) as exit_:
        main(
            [
                "plan",
                str(src),
                "--scores",
                str(scores),
                "--output",
                str(tmp_path / "x.json"),
                "--budget-gdn-params",
                "0.5",
                "--sensitivity",
                "proxy",
                "--refine-generations",
                "-1",
            ]
        )
    assert exit_.value.code == 2
    assert "expected an integer >= 0" in capsys.readouterr().err


def test_prune_with_a_plan_uses_its_scores_or_says_why_not(scored_folder, tmp_path, capsys):
    import shutil

    src, text, scores = scored_folder
    plan = tmp_path / "plan.json"
    assert (
        main(
            [
                "plan",
                str(src),
                "--scores",
                str(scores),
                "--output",
                str(plan),
                "--budget-gdn-params",
                "0.5",
                "--sensitivity",
                "proxy",
                "--dim-step",
                "1/2",
                "-q",
            ]
        )
        == 0
    )
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
                "--plan",
                str(plan),
                "--scores",
                str(scores),
                "--quiet",
            ]
        )
        == 0
    )
    assert "sorted by" in capsys.readouterr().out
    manifest = json.loads((out / "gdnprune.json").read_text())
    sha = json.loads(plan.read_text())["scores"]["sha256"]
    assert manifest["plan"]["metadata"]["scores"]["sha256"] == manifest["scores"]["sha256"] == sha
    assert manifest["plan"]["path"] == str(plan.resolve())
    # other scores: refused before anything is scored or written
    other = tmp_path / "other.json"
    shutil.copy(scores, other)
    with open(other, "a") as f:
        f.write("\n")
    assert (
        main(
            [
                "prune",
                str(src),
                "--data",
                str(text),
                "-o",
                str(tmp_path / "p2"),
                "--plan",
                str(plan),
                "--scores",
                str(other),
                "--quiet",
            ]
        )
        == 2
    )
    assert "the plan was searched on the scores with sha256" in capsys.readouterr().err
    assert not (tmp_path / "p2").exists()
    # scored afresh: a warning names the scores the plan was searched on
    assert (
        main(
            [
                "prune",
                str(src),
                "--data",
                str(text),
                "-o",
                str(tmp_path / "p3"),
                "--plan",
                str(plan),
                "--num-samples",
                "2",
                "--seq-len",
                "72",
                "--quiet",
            ]
        )
        == 0
    )
    assert "gdnprune prune: warning: the plan was searched on the scores" in capsys.readouterr().err


def test_two_processes_under_torchrun_find_the_plan_one_process_finds(
    launch, launch_model, launch_text, tmp_path
):
    """The halving's candidates and the refinement's offspring are spread over 2 gloo ranks (the suite's shared
    launch, tests/launches.py); the plan, every sensitivity and every generation's fitness equal one
    process's."""
    ranks = [json.loads((launch.folder / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert ranks[0]["refined"]["code"] == ranks[1]["refined"]["code"] == 0, ranks[0]["refined"]["err"][-3000:]
    scores = launch.folder / "projection.json"
    argv = ["plan", str(launch_model), "--scores", str(scores), "--data", str(launch_text)]
    assert main([*argv, "--output", str(tmp_path / "one.json"), *REFINED]) == 0
    two, one = (json.loads(p.read_text()) for p in (launch.folder / "refined.json", tmp_path / "one.json"))
    assert two["layers"] == one["layers"] and two["evolved"] == one["evolved"]
    two, one = (
        json.loads(p.read_text())
        for p in (launch.folder / "refined.sensitivity.json", tmp_path / "one.sensitivity.json")
    )
    assert two["evolution"]["history"] == one["evolution"]["history"]
    assert two["forwards"] == one["forwards"] and two["rungs"] == one["rungs"]
    for prefix, layer in one["layers"].items():
        assert [(c["sensitivity"], c["windows"]) for c in two["layers"][prefix]["candidates"]] == [
            (c["sensitivity"], c["windows"]) for c in layer["candidates"]
        ]
