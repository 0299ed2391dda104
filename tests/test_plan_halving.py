"""Verified successive halving (issue 31): the choice measured on every window before it is trusted."""

from __future__ import annotations

import itertools
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from gdnprune import demo_data
from gdnprune.io.loading import load_pretrained
from gdnprune.model.geometry import GDNShape, orders_from_payload
from gdnprune.model.layouts import detect_layout, find_gdn_modules
from gdnprune.plan import choose, layer_candidates
from gdnprune.plan.choose.solve import choose_among
from gdnprune.plan.measure.halving import (
    budget_tables,
    exact_choice,
    feasible,
    front,
    halving_sensitivity,
    merged_choice,
    optimistic,
    ratio_bound,
    rungs,
    verify,
)
from gdnprune.plan.measure.sensitivity import LayerToPlan, measured_sensitivity
from gdnprune.scoring import score_model

pytestmark = pytest.mark.filterwarnings("ignore::gdnprune.checkpoint.UnsortedInputWarning")

TRAINED = Path(__file__).parent / "data" / "trained"


def test_front_keeps_what_no_cheaper_candidate_beats():
    rng = np.random.default_rng(0)
    table = rng.integers(1, 6, (12, 2)).astype(float)
    estimate = rng.uniform(0, 1, 12)
    on = front(estimate, table)
    for a in range(12):  # brute force over pairs
        beaten = any(b != a and np.all(table[b] <= table[a]) and estimate[b] < estimate[a] for b in range(12))
        assert on[a] == (not beaten)


def test_optimistic_is_exact_when_measured_in_full_and_scaled_by_the_lowest_ratio_otherwise():
    rng = np.random.default_rng(1)
    kl = [rng.uniform(0.1, 1.0, (5, 4)), rng.uniform(0.1, 1.0, (4, 4))]
    seen = [np.array([4, 4, 1, 2, 4]), np.array([4, 1, 4, 2])]
    full = [np.array([False] * 5), np.array([True, False, False, False])]
    kl[1][0] = 0.0  # the full geometry: KL 0
    weights = np.array([1.0, 2.0, 1.0, 3.0])

    def mean(row, n):
        return sum(row[w] * weights[w] for w in range(n)) / sum(weights[:n])

    done = [(0, 0), (0, 1), (0, 4), (1, 2)]  # measured on every window, not the full geometry
    out = optimistic(kl, seen, full, weights)
    for li in range(2):
        for c in range(len(kl[li])):
            n = int(seen[li][c])
            if full[li][c]:
                expected = 0.0
            elif n == 4:
                expected = mean(kl[li][c], 4)
            else:
                ratio = min(1.0, min(mean(kl[g][b], 4) / mean(kl[g][b], n) for g, b in done))
                expected = mean(kl[li][c], n) * ratio
            assert out[li][c] == pytest.approx(expected, rel=1e-12)


def test_optimistic_per_layer_takes_the_ratios_of_the_own_layer_once_it_has_three_measured_in_full():
    rng = np.random.default_rng(4)
    windows = 6
    kl = [rng.uniform(0.1, 1.0, (6, windows)), rng.uniform(0.1, 1.0, (5, windows))]
    kl[1] *= np.linspace(2.0, 0.5, windows)  # layer 1's windows get easier: its ratios are below layer 0's
    seen = [np.array([6, 6, 6, 1, 2, 6]), np.array([6, 6, 1, 2, 3])]  # layer 0: 4 in full, layer 1: 2
    full = [np.zeros(6, dtype=bool), np.zeros(5, dtype=bool)]
    weights = rng.uniform(1.0, 3.0, windows)

    def mean(row, n):
        return sum(row[w] * weights[w] for w in range(n)) / sum(weights[:n])

    def ratios(cells, n):
        return [mean(kl[li][c], windows) / mean(kl[li][c], n) for li, c in cells]

    done = [[(0, c) for c in (0, 1, 2, 5)], [(1, 0), (1, 1)]]
    for confidence in (None, 2.0):
        out = optimistic(kl, seen, full, weights, confidence=confidence, per_layer=True)
        pooled = optimistic(kl, seen, full, weights, confidence=confidence)
        for li in range(2):
            for c in range(len(kl[li])):
                n = int(seen[li][c])
                if n == windows:
                    assert out[li][c] == pytest.approx(mean(kl[li][c], windows), rel=1e-12)
                    continue
                own = ratio_bound(np.array(ratios(done[li], n)), confidence)
                every = ratio_bound(np.array(ratios(done[0] + done[1], n)), confidence)
                expected = own if li == 0 else every  # layer 1: 2 in full, fewer than 3: every layer's
                assert out[li][c] == pytest.approx(mean(kl[li][c], n) * expected, rel=1e-12)
                assert pooled[li][c] == pytest.approx(mean(kl[li][c], n) * every, rel=1e-12)
    low = ratio_bound(np.array(ratios(done[0] + done[1], 1)))
    assert low < ratio_bound(np.array(ratios(done[0], 1)))  # the layers' ratios differ: a real difference


@pytest.mark.parametrize("per_layer", [False, True])
@pytest.mark.parametrize("confidence", [None, 1.5])
@pytest.mark.parametrize("seed", range(6))
def test_verify_finds_the_brute_force_choice_when_windows_scale_every_candidate_alike(
    seed, confidence, per_layer
):
    """Window difficulty shared by every candidate (KL = candidate's level x window's difficulty): the
    optimistic estimates are then exact lower bounds, and the verified choice is the best one by brute force."""
    rng = np.random.default_rng(seed)
    windows = 16
    sizes = [7, 6, 8]
    params = [np.sort(rng.integers(1, 30, n))[::-1].astype(float) for n in sizes]
    level = [np.sort(rng.uniform(0.01, 1.0, n)) * rng.uniform(0.5, 2.0) for n in sizes]
    difficulty = rng.uniform(0.3, 3.0, windows)
    truth = [np.outer(v, difficulty) for v in level]
    costs = {"params": [p.tolist() for p in params]}
    budgets = {"params": 0.55 * sum(p[0] for p in params)}
    kl = [np.zeros_like(t) for t in truth]
    seen = [np.zeros(n, dtype=int) for n in sizes]
    full = [np.zeros(n, dtype=bool) for n in sizes]
    measured = []

    def measure(todo):
        for li, items in enumerate(todo):
            for c, upto in items:
                kl[li][c, seen[li][c] : upto] = truth[li][c, seen[li][c] : upto]
                measured.append(upto - seen[li][c])
                seen[li][c] = upto

    measure([[(c, 1) for c in range(n)] for n in sizes])  # a first rung: every candidate on one window

    def pick(estimate, alive):
        return choose_among(estimate, costs, budgets, alive)

    verify(
        measure,
        kl,
        seen,
        full,
        np.ones(windows),
        rungs(windows),
        pick,
        *budget_tables(costs, budgets, sizes),
        confidence=confidence,
        per_layer=per_layer,
    )
    means = [t.mean(1) for t in truth]
    best = min(
        (
            combo
            for combo in itertools.product(*(range(n) for n in sizes))
            if sum(params[li][c] for li, c in enumerate(combo)) <= budgets["params"]
        ),
        key=lambda combo: sum(means[li][c] for li, c in enumerate(combo)),
    )
    survivors = [s >= windows for s in seen]
    assert choose_among([k.mean(1) for k in kl], costs, budgets, survivors) == list(best)
    assert sum(measured) < windows * sum(sizes)  # fewer window forwards than the full measurement


@pytest.fixture(scope="module")
def case():
    """The trained tiny qwen3_next model (2 GDN layers: Hk 4, Hv 8, dk = dv = 16) on 8 windows of its training
    text, every layer's candidates at a 1/2 grid, and their full measurement: successive halving's verification
    rests on the windows' difficulty being shared by the candidates, as it is on a trained model and real text
    (on a random model and random tokens it need not be)."""
    model = load_pretrained(TRAINED / "qwen3_next", dtype=torch.float32).eval()
    x = demo_data.byte_windows(demo_data.train_text("pydoc"), 96, 16)
    scores = score_model(model, [x[8:]], progress=False)
    layers, table = [], []
    for prefix, module in find_gdn_modules(model):
        shape = GDNShape.from_module(module)
        tensors = {n: tuple(p.shape) for n, p in module.named_parameters()}
        cands = layer_candidates(
            prefix, shape, tensors, detect_layout(tensors).name, module.conv_kernel_size, dim_step="1/2"
        )
        layers.append(
            LayerToPlan(
                prefix,
                module,
                orders_from_payload(scores["layers"][prefix], shape),
                [c.target for c in cands],
            )
        )
        table.append(cands)
    costs = {
        "params": [[c.params for c in cands] for cands in table],
        "state": [[c.state for c in cands] for cands in table],
    }
    x = x[:8]
    full = measured_sensitivity(model, [x[:4], x[4:]], layers, progress=False)
    return model, x, layers, costs, full


@pytest.mark.parametrize("budget", [("params", 0.75), ("params", 0.5), ("params", 0.3), ("state", 0.5)])
def test_verified_halving_chooses_the_exact_plan_with_fewer_forwards(case, budget):
    model, x, layers, costs, full = case
    kind, fraction = budget
    budgets = {kind: fraction * sum(c[0] for c in costs[kind])}
    exact = choose([full["kl"][layer.prefix] for layer in layers], costs, budgets)
    halved = halving_sensitivity(
        model, [x[:4], x[4:]], layers, costs, budgets, first=1, grow=2, progress=False
    )
    assert halved["rungs"] == [1, 2, 4, 8]
    kl = [halved["kl"][layer.prefix] for layer in layers]
    survivors = [halved["survivors"][layer.prefix] for layer in layers]
    picks = choose_among(kl, costs, budgets, survivors)
    assert picks == exact
    for layer, c in zip(layers, picks):  # the chosen candidates are measured on every window: exact KL
        assert halved["windows"][layer.prefix][c] == 8
        assert halved["kl"][layer.prefix][c] == pytest.approx(full["kl"][layer.prefix][c], rel=1e-5, abs=1e-8)
    every = 8 * sum(len(layer.candidates) - 1 for layer in layers)  # the full measurement's window forwards
    # counts of this case (84-198 forwards of 496, 1-17 rounds; 84-238 and 1-23 with every layer's ratios
    # pooled), not time: at most 45 % of the full measurement's forwards and 20 verification rounds (each
    # one MILP)
    assert halved["forwards"] <= 0.45 * every
    assert 1 <= halved["verify_rounds"] <= 20


@pytest.mark.parametrize("names", [["params"], ["params", "state"]])
def test_merged_choice_is_the_brute_force_choice(names):
    """Every choice enumerated: merging the layers' fronts finds the least summed KL within the budgets
    (among the allowed candidates), and None where no choice fits."""
    rng = np.random.default_rng(5)
    found = 0
    for _ in range(40):
        sizes = [int(k) for k in rng.integers(1, 7, 4)]
        costs = {n: [rng.integers(1, 20, k).astype(float).tolist() for k in sizes] for n in names}
        budgets = {n: float(rng.integers(12, 60)) for n in names}
        values = [rng.uniform(0.0, 1.0, k) for k in sizes]
        allowed = [rng.uniform(size=k) < 0.8 for k in sizes]
        tables, _ = budget_tables(costs, budgets, sizes)
        limits = np.array(list(budgets.values()))
        fits = [
            combo
            for combo in itertools.product(*(np.flatnonzero(a) for a in allowed))
            if all(sum(costs[n][li][c] for li, c in enumerate(combo)) <= budgets[n] for n in names)
        ]
        got = merged_choice(values, tables, limits, allowed)
        if not fits:
            assert got is None
            continue
        best = min(fits, key=lambda combo: sum(values[li][c] for li, c in enumerate(combo)))
        assert got == [int(c) for c in best]
        assert exact_choice(costs, budgets)(values, allowed) == got
        assert choose_among(values, costs, budgets, allowed) == got  # the MILP's choice (no ties here)
        found += 1
    assert found >= 10  # most trials have a choice within the budgets


def test_merged_choice_gives_up_past_its_state_limit_and_exact_choice_then_solves_the_milp():
    rng = np.random.default_rng(6)
    sizes = [12] * 6
    costs = {n: [rng.integers(1, 50, k).astype(float).tolist() for k in sizes] for n in ("params", "state")}
    budgets = {"params": 150.0, "state": 150.0}
    values = [rng.uniform(0.0, 1.0, k) for k in sizes]
    tables, _ = budget_tables(costs, budgets, sizes)
    limits = np.array(list(budgets.values()))
    assert merged_choice(values, tables, limits, max_states=8) is None
    exact = choose_among(values, costs, budgets, [np.ones(k, dtype=bool) for k in sizes])
    assert merged_choice(values, tables, limits) == exact
    assert exact_choice(costs, budgets)(values, [np.ones(k, dtype=bool) for k in sizes]) == exact


def test_halving_makes_the_same_choices_with_merged_fronts_as_with_the_milp(case):
    """The default choice (merged fronts) and the MILP give the same verified halving: the same windows for
    every candidate, the same forwards and rounds."""
    model, x, layers, costs, _ = case
    budgets = {"params": 0.3 * sum(c[0] for c in costs["params"])}
    runs = [
        halving_sensitivity(model, [x[:4], x[4:]], layers, costs, budgets, progress=False, merged=merged)
        for merged in (True, False)
    ]
    assert runs[0]["windows"] == runs[1]["windows"]
    assert runs[0]["forwards"] == runs[1]["forwards"] and runs[0]["verify_rounds"] == runs[1]["verify_rounds"]
    assert runs[0]["verify_rounds"] >= 1  # the choice was verified (a round of choices to compare)


def test_feasible_keeps_every_candidate_of_every_choice_within_the_budgets_and_only_those():
    """Brute force over every choice: a candidate some choice within the budgets holds is kept; with one
    budget, a kept candidate is held by some such choice (with several, the test is per budget: a superset)."""
    rng = np.random.default_rng(3)
    for trial in range(20):
        sizes = [4, 5, 3]
        names = ["params"] if trial % 2 else ["params", "state"]
        costs = {n: [rng.integers(1, 20, k).astype(float).tolist() for k in sizes] for n in names}
        budgets = {n: float(rng.integers(10, 45)) for n in names}
        tables, _ = budget_tables(costs, budgets, sizes)
        kept = feasible(tables, budgets)
        held = [np.zeros(k, dtype=bool) for k in sizes]
        for combo in itertools.product(*(range(k) for k in sizes)):
            if all(sum(costs[n][li][c] for li, c in enumerate(combo)) <= budgets[n] for n in names):
                for li, c in enumerate(combo):
                    held[li][c] = True
        for li in range(3):
            assert np.all(kept[li][held[li]])  # sound: nothing a choice holds is dropped
            if len(names) == 1:
                assert np.array_equal(kept[li], held[li])  # exact with one budget
        loose = feasible(tables, budgets, cheapest=False)  # the other layers may cost 0 (removed)
        for li in range(3):
            assert np.array_equal(loose[li], np.all(tables[li] <= np.array(list(budgets.values())), axis=1))


def test_ratio_bound_is_the_lowest_ratio_or_the_lower_prediction_bound_of_the_log_ratios():
    ratios = np.array([0.9, 1.1, 1.3, 0.8, 1.05])
    assert ratio_bound(ratios) == 0.8
    assert ratio_bound(np.array([1.2, 1.4])) == 1.0  # never above 1
    assert ratio_bound(np.zeros(0), 2.0) == 1.0
    assert ratio_bound(ratios[:2], 2.0) == 0.9  # fewer than 3: the lowest
    logs = [math.log(r) for r in ratios]
    mean = sum(logs) / 5
    sd = math.sqrt(sum((v - mean) ** 2 for v in logs) / 4)
    expected = math.exp(mean - 2.0 * sd * math.sqrt(1 + 1 / 5))
    assert expected < 0.8
    assert ratio_bound(ratios, 2.0) == pytest.approx(expected, rel=1e-12)
    many = np.array([1.0] * 30 + [0.9])  # tight but for one: the lowest is below the prediction bound
    assert ratio_bound(many, 2.0) == 0.9


def test_rungs_measure_every_window_at_once_when_the_first_rung_is_half_of_them_or_more():
    assert rungs(1) == [1] and rungs(2) == [2] and rungs(3) == [1, 3] and rungs(16) == [1, 4, 16]
    assert rungs(2, first=1) == [1, 2]  # an explicit first rung stands
