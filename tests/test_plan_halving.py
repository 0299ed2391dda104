"""Verified successive halving (issue 31): the choice measured on every window before it is trusted."""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import pytest
import torch

from gdnprune import demo_data
from gdnprune.geometry import GDNShape, orders_from_payload
from gdnprune.layouts import detect_layout, find_gdn_modules
from gdnprune.loading import load_pretrained
from gdnprune.plan import choose, layer_candidates
from gdnprune.plan.halving import budget_tables, front, halving_sensitivity, optimistic, rungs, verify
from gdnprune.plan.sensitivity import LayerToPlan, measured_sensitivity
from gdnprune.plan.solve import choose_among
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


@pytest.mark.parametrize("seed", range(6))
def test_verify_finds_the_brute_force_choice_when_windows_scale_every_candidate_alike(seed):
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
        measure, kl, seen, full, np.ones(windows), rungs(windows), pick, *budget_tables(costs, budgets, sizes)
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
    assert halved["forwards"] < every
    assert halved["verify_rounds"] >= 1
