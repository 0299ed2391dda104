"""Rank after a short recovery, and depth that never loses to widths (issue 31).

The MILP's solution pool against brute force; a pool of one is the plain plan; the ranking's winner is the
least recovered KL it lists, and distilling the winner again, cut and trained by hand from the plan file,
gives the same one-shot and recovered KL; a plan whose removal loses to widths on the whole cut model gives
way to the best widths-only plan; options that cannot rank are refused; two processes under torchrun rank
as one process does (the suite's shared launch, tests/launches.py).
"""

from __future__ import annotations

import itertools
import json
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import random_dense_model, token_ids
from launches import SEQ

from gdnprune.checkpoint import slice_checkpoint
from gdnprune.cli import main
from gdnprune.distill import DistillConfig, distill
from gdnprune.gated_delta_net import GDNPermutation, GDNShape
from gdnprune.io.loading import load_pretrained, slice_model
from gdnprune.plan import PlanOptions, plan_model
from gdnprune.plan.api import search
from gdnprune.plan.choose.depth import choose_with_removal, pool_with_removal
from gdnprune.plan.choose.evolve import feasible
from gdnprune.plan.choose.solve import BudgetError, choose_pool
from gdnprune.plan.rank import candidate_plans
from gdnprune.plan.report.results import Choice, Sensitivities
from gdnprune.plan.stages import check_depth, choose_plan, choose_plans
from gdnprune.scoring import score_model

# ---- the solution pool -----------------------------------------------------------------------------------------


def _objective(sensitivity, picks, layer_of=None, removal=None):
    removed = {layer_of[g] for g, p in enumerate(picks) if p is None} if layer_of else set()
    return sum(v[p] for v, p in zip(sensitivity, picks) if p is not None) + sum(removal[i] for i in removed)


def _every_choice(sensitivity, costs, budgets, layer_of=None, removal=None):
    """Every choice that meets the budgets, best first (brute force), as (objective, picks)."""
    out = []
    layers = sorted(removal or {})
    for gone in itertools.chain.from_iterable(
        itertools.combinations(layers, k) for k in range(max(1, len(layers)))
    ):
        options = [
            [None] if layer_of and layer_of[g] in gone else range(len(v)) for g, v in enumerate(sensitivity)
        ]
        for picks in itertools.product(*options):
            if all(
                sum(costs[n][g][p] for g, p in enumerate(picks) if p is not None) <= b
                for n, b in budgets.items()
            ):
                out.append((_objective(sensitivity, picks, layer_of, removal), list(picks)))
    return sorted(out, key=lambda e: e[0])


@pytest.mark.parametrize("seed", range(3))
def test_the_pool_is_the_k_best_distinct_choices_by_brute_force(seed):
    rng = np.random.default_rng(seed)
    sens = [[0.0, *sorted(rng.random(3) * 0.1)] for _ in range(4)]  # smaller candidates: more sensitivity
    costs = {
        "params": [[10, 7, 5, 2] for _ in range(4)],
        "state": [list(rng.integers(1, 9, 4)) for _ in range(4)],
    }
    budgets = {"params": 26, "state": 20}
    pool = choose_pool(sens, costs, budgets, 6)
    best = _every_choice(sens, costs, budgets)
    assert len(pool) == min(6, len(best)) and len({tuple(p) for p in pool}) == len(pool)
    assert all(feasible(p, costs, budgets) for p in pool)
    assert [_objective(sens, p) for p in pool] == pytest.approx([o for o, _ in best[: len(pool)]], abs=1e-12)
    assert pool[0] == choose_pool(sens, costs, budgets, 1)[0]
    # fewer choices than asked: all of them; none: BudgetError
    assert len(choose_pool(sens, costs, {"params": 8}, 50)) == len(_every_choice(sens, costs, {"params": 8}))
    with pytest.raises(BudgetError):
        choose_pool(sens, costs, {"params": 7}, 2)
    # with removal: a layer's two groups go together, and the pool is again the k best by brute force
    layer_of, removal = [0, 0, 1, 1], {0: 0.02, 1: 0.03}
    pool = pool_with_removal(sens, costs, budgets, 12, layer_of=layer_of, removal=removal)
    best = _every_choice(sens, costs, budgets, layer_of, removal)
    assert len({tuple(p) for p in pool}) == len(pool) == 12
    assert [_objective(sens, p, layer_of, removal) for p in pool] == pytest.approx(
        [o for o, _ in best[:12]], abs=1e-12
    )
    assert any(None in p for p in pool)  # removals are in the pool, each a whole layer
    assert all((p[0] is None) == (p[1] is None) and (p[2] is None) == (p[3] is None) for p in pool)
    assert pool[0] == choose_with_removal(sens, costs, budgets, layer_of=layer_of, removal=removal)[0]


# ---- a real model ----------------------------------------------------------------------------------------------

STEPS = 3


@pytest.fixture(scope="module")
def setting():
    torch.manual_seed(0)
    model = random_dense_model("qwen3_5", seed=3)
    ids = token_ids(seed=4, batch=8, seq=24)
    scores = score_model(model, [ids], progress=False, blocks=None)
    return model, [ids[:4], ids[4:]], scores


@pytest.fixture(scope="module")
def ranked(setting):
    model, batches, scores = setting
    costs = []
    plan, report = plan_model(
        model,
        batches,
        scores,
        budget_params=0.7,
        blocks=["gdn", "attention", "mlp"],
        sensitivity="measured",
        dim_step="1/4",  # a coarser grid than the default 1/8: fewer candidates to measure, still many plans
        rank_by_distill=3,
        rank_steps=STEPS,
        rank_lr=3e-3,
        progress=False,
        on_rank_cost=costs.append,
    )
    return plan, report, costs


@pytest.fixture(scope="module")
def searched(setting):
    """One measured search with depth at 75 % of the parameters (read, never changed, by three tests): a
    budget where removing the last layer loses to widths on the whole cut model (at 60 % removing it is really
    better), which the depth test needs."""
    model, batches, scores = setting
    options = PlanOptions(
        budget_params=0.75,
        blocks=["gdn", "attention", "mlp", "depth"],
        sensitivity="measured",
        dim_step="1/4",  # a coarser grid than the default 1/8: fewer candidates to measure
    )
    return search(model, batches, scores, options, progress=False)


def test_a_pool_of_one_is_the_plain_plan(searched):
    done = searched
    plain = choose_plan(done.problem, done.sens, uniform=False)
    pool = choose_plans(done.problem, done.sens, 4)
    assert pool[0].picks == plain.picks and len({tuple(c.picks) for c in pool}) == 4
    budgets = done.problem.budgets
    assert all(feasible([-1 if p is None else p for p in c.picks], done.problem.costs, budgets) for c in pool)
    (name, first, _), *rest = candidate_plans(done.problem, done.sens, plain, 1)
    assert name == "milp 1" and first is plain and [n for n, _, _ in rest] in ([], ["uniform"])


def _cut_by_hand(model, plan, scores):
    """The plan's cut model, built from the plan file alone (as the demo cuts it; removed layers through the
    checkpoint path a user runs)."""
    layers = {k: v for k, v in plan["layers"].items() if not v.get("removed")}
    gdn = {p: t for p, t in layers.items() if "linear_attn" in p}
    blocks = {p: t for p, t in layers.items() if p not in gdn}
    shape = GDNShape.from_module(model.get_submodule(next(iter(gdn))))
    permutations = {p: GDNPermutation.from_score_payload(scores["layers"][p], shape) for p in gdn}
    small = slice_model(
        model, gdn, permutations, blocks=blocks, block_orders={p: scores["layers"][p] for p in blocks}
    )
    removed = [int(k.split(".")[-1]) for k, v in plan["layers"].items() if v.get("removed")]
    if not removed:
        return small
    with tempfile.TemporaryDirectory() as tmp:
        small.save_pretrained(Path(tmp) / "in")
        slice_checkpoint(Path(tmp) / "in", Path(tmp) / "out", remove_layers=removed)
        return load_pretrained(Path(tmp) / "out", dtype=torch.float32).eval()


@torch.no_grad()
def _kl(teacher, student, windows, last: bool = False) -> float:
    """Mean over windows of the per-position KL(teacher || student), by hand: over the predicted positions (as
    the distillation's loss), or every position with ``last`` (as the plan's measurements)."""
    values = []
    end = None if last else -1
    for w in windows:
        t = teacher(input_ids=w[None]).logits[0, :end].double().log_softmax(-1)
        s = student(input_ids=w[None]).logits[0, :end].double().log_softmax(-1)
        values.append(float((t.exp() * (t - s)).sum(-1).mean()))
    return float(np.mean(values))


def test_the_winner_is_the_least_recovered_kl_and_distilling_it_again_gives_its_numbers(setting, ranked):
    model, batches, scores = setting
    plan, report, costs = ranked
    ranking = report["ranking"]
    plans = ranking["plans"]
    names = [p["name"] for p in plans]
    assert names[:3] == ["milp 1", "milp 2", "milp 3"] and set(names) <= {
        "milp 1",
        "milp 2",
        "milp 3",
        "uniform",
    }
    recovered = [p["recovered_kl"] for p in plans]
    assert ranking["winner"] == plans[int(np.argmin(recovered))]["name"] == plan["ranked"]["winner"]
    assert [p["summed_sensitivity"] for p in plans[:3]] == sorted(p["summed_sensitivity"] for p in plans[:3])
    # the cost was said first (candidates x steps), then with the first step's seconds
    assert costs[0].total_steps == len(plans) * STEPS and costs[0].seconds_per_step is None
    assert costs[-1].seconds_per_step > 0 and ranking["cost"]["total_steps"] == len(plans) * STEPS
    # the winner again, by hand: cut from the plan file, distilled with the same recipe on the same windows
    ids = torch.cat(batches)
    train, heldout = ids[:6], ids[6:]
    assert (ranking["train_windows"], ranking["heldout_windows"]) == (6, 2)
    student = _cut_by_hand(model, plan, scores)
    winner = plans[names.index(ranking["winner"])]
    assert _kl(model, student, heldout) == pytest.approx(winner["one_shot_kl"], rel=1e-4)
    for p in student.parameters():
        p.requires_grad_(True)
    recipe = DistillConfig(steps=STEPS, batch_size=6, micro_batch_size=2, lr=3e-3, warmup=0.03, seed=0)
    distill(student, model, train, recipe.replace(log_every=STEPS, progress=False))
    assert _kl(model, student.eval(), heldout) == pytest.approx(winner["recovered_kl"], rel=1e-3)
    assert any(abs(p["recovered_kl"] - p["one_shot_kl"]) > 1e-6 for p in plans)  # the training moved them


def test_depth_that_loses_on_the_whole_cut_model_gives_way_to_widths_only(setting, searched):
    model, batches, scores = setting
    done = searched  # at 75 %: at 60 % removing the last layer is really better
    assert done.problem.given["params"] == 0.75
    problem, sens = done.problem, done.sens
    # the additive estimate of removing the last layer made nearly free: the MILP removes it, though its
    # measured KL (and the whole cut model's) is far from that
    last = max(sens.removal)
    fooled = Sensitivities(
        values=sens.values,
        seconds=sens.seconds,
        removal={**sens.removal, last: (1e-9, 0.0)},
        survivors=sens.survivors,
    )
    chosen = choose_plan(problem, fooled, uniform=False)
    assert chosen.removed == [last]
    kept = check_depth(model, batches, problem, chosen, fooled)
    check = kept.depth_check
    assert check.kept == "widths" and kept.removed == [] and check.removed == [last]
    assert check.widths_kl < check.depth_kl
    # both numbers are the KL of the whole cut models on the calibration windows, cut from the plan files
    windows = torch.cat(batches)
    for picks, removed, value in ((chosen.picks, [last], check.depth_kl), (kept.picks, [], check.widths_kl)):
        layers = problem.entries(picks)
        layers.update({f"model.layers.{i}": {"removed": True} for i in removed})
        student = _cut_by_hand(model, {"layers": layers}, scores)
        assert _kl(model, student, windows, last=True) == pytest.approx(value, rel=1e-4)
    # the honest estimate: the exact choice with its own check in the report
    assert done.report.as_dict().get("depth_check", {"kept": "depth"})["kept"] in ("depth", "widths")


def test_options_that_cannot_rank_are_refused_before_any_forward(
    setting, launch_model, launch_text, tmp_path, capsys
):
    model, batches, scores = setting
    for options, words in (
        (dict(rank_by_distill=2, uniform=True), "heterogeneous"),
        (dict(rank_by_distill=-1), "rank_by_distill"),
        (dict(rank_by_distill=2, rank_steps=0), "rank_steps"),
    ):
        with pytest.raises(ValueError, match=words):
            plan_model(model, batches, scores, budget_gdn_params=0.5, progress=False, **options)
    with pytest.raises(ValueError, match="calibration"):
        plan_model(model, None, scores, budget_gdn_params=0.5, sensitivity="proxy", rank_by_distill=2)
    base = ["plan", str(launch_model), "--scores", str(launch_text), "--data", str(launch_text)]
    base += ["--output", str(tmp_path / "p.json"), "--budget-params", "0.5", "--rank-by-distill", "2"]
    for flag in ("--servable", "--uniform"):
        assert main([*base, flag]) == 2
        err = capsys.readouterr().err
        assert f"--rank-by-distill: expected a heterogeneous plan search, found {flag}" in err, err
    assert not (tmp_path / "p.json").exists()


# ---- two processes ---------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_two_processes_rank_as_one_process_does(launch, launch_model, launch_text, tmp_path, capsys):
    """Under torchrun each rank distils its own candidates (i on rank i % 2) and every rank reports the same
    ranking; it equals one process's on the same windows, and rank 0 alone said the cost."""
    ranks = [json.loads((launch.folder / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert ranks[0]["ranked"]["code"] == ranks[1]["ranked"]["code"] == 0, ranks[0]["ranked"]["err"][-2000:]
    assert (
        "distillation steps each" in ranks[0]["ranked"]["err"]
        and "distillation steps" not in ranks[1]["ranked"]["err"]
    )
    two = json.loads((launch.folder / "ranked.sensitivity.json").read_text())["ranking"]
    out = tmp_path / "alone.json"
    argv = [
        "plan",
        str(launch_model),
        "--scores",
        str(launch.folder / "projection.json"),
        "--data",
        str(launch_text),
    ]
    argv += ["--output", str(out), "--budget-gdn-params", "0.5", "--dim-step", "1/2", "--num-samples", "4"]
    argv += [
        "--seq-len",
        str(SEQ),
        "--batch-size",
        "1",
        "--rank-by-distill",
        "2",
        "--rank-steps",
        "2",
        "--threads",
        "1",
    ]
    assert main(argv) == 0
    printed = capsys.readouterr()
    assert "ranking 3 plans by 2 distillation steps each (6 steps over 1 process)" in printed.err
    assert "ranked by distillation: 3 plans x 2 steps" in printed.out
    one = json.loads((tmp_path / "alone.sensitivity.json").read_text())["ranking"]
    assert two["cost"]["processes"] == 2 and one["cost"]["processes"] == 1
    assert (
        [p["name"] for p in two["plans"]]
        == [p["name"] for p in one["plans"]]
        == ["milp 1", "milp 2", "uniform"]
    )
    for a, b in zip(two["plans"], one["plans"]):
        assert a["one_shot_kl"] == pytest.approx(b["one_shot_kl"], rel=1e-5)
        assert a["recovered_kl"] == pytest.approx(b["recovered_kl"], rel=1e-4)
    assert two["winner"] == one["winner"]
    assert (
        json.loads((launch.folder / "ranked.json").read_text())["layers"]
        == json.loads(out.read_text())["layers"]
    )


def test_the_evolutionary_search_hands_its_best_distinct_plans_to_the_ranking(searched):
    from gdnprune.plan.choose.evolve import evolve

    # a fitness in plain Python: per window, a made-up loss of the plan (larger candidates: less)
    def fitness(plans, lo, hi):
        return [
            [sum((c + 1) * (w + 1) * 0.01 * (g + 1) for g, c in enumerate(p)) for w in range(lo, hi)]
            for p in plans
        ]

    costs = {"params": [[10, 7, 5, 2] for _ in range(3)]}
    result = evolve(costs, {"params": 22}, [0, 3, 3], fitness, [1.0] * 4, generations=6, offspring=4, seed=1)
    population = result["population"]
    mean = [float(np.mean(fitness([p], 0, 4)[0])) for p in population]
    assert population[0] == result["picks"] and mean == sorted(mean) and len(population) > 2
    assert len({tuple(p) for p in population}) == len(population)
    assert all(feasible(p, costs, {"params": 22}) for p in population)
    # the ranking takes them as its candidates, best first, removed layers (-1) as None
    done = searched
    n = len(done.problem.groups) + len(done.problem.rests)
    first = done.choice.picks
    other = choose_plans(done.problem, done.sens, 2)[1].picks
    refined = Choice(
        picks=first, evolution={"population": [[-1 if p is None else p for p in q] for q in (first, other)]}
    )
    candidates = candidate_plans(done.problem, done.sens, refined, 3)
    assert [name for name, _, _ in candidates][:2] == ["evolved 1", "evolved 2"]
    assert candidates[0][1] is refined and candidates[1][1].picks == other and len(other) == n
