"""Servable plans (issue 30): one geometry per kind of block plus whole decoder layers removed. The exact
choice against brute force on small cost tables; a servable output loads in plain transformers from a
standard config, equal to ``load_pretrained`` and to the original model cut and shortened by hand; plans that
need ``per_layer_config`` refused; a servable search on a real model gives one geometry per kind."""

from __future__ import annotations

import copy
import ctypes
import itertools
import json
import os

import numpy as np
import pytest
import torch
from helpers import make_source, random_dense_model
from tiny_models import cut_model
from transformers import AutoModelForCausalLM

from gdnprune import load_pretrained
from gdnprune.cli import main
from gdnprune.io.plan_file import PLAN_FORMAT, PLAN_VERSION, servable_problems
from gdnprune.model.geometry import GDNShape
from gdnprune.model.subblock_geometry import block_kind_of
from gdnprune.model.subblock_shapes import MLPShape
from gdnprune.plan import AXES, parse_dim_step, plan_model
from gdnprune.plan.choose.servable import SERVABLE_NOTE, choose_servable
from gdnprune.plan.choose.solve import BudgetError, choose, silenced_stdout
from gdnprune.plan.measure.problem import Grid, build_problem
from gdnprune.plan.snap import plan_picks, plan_targets
from gdnprune.scoring import score_model, scores_to_permutations

pytestmark = pytest.mark.filterwarnings("ignore::gdnprune.checkpoint.UnsortedInputWarning")

# ---- the exact choice against brute force -------------------------------------------------------------------


def _table(rng, kinds, layer_of):
    """Random groups: per kind a few shared geometries (plus one geometry only some groups have)."""
    geometries = {k: [f"{k}{j}" for j in range(int(rng.integers(2, 4)))] for k in dict.fromkeys(kinds)}
    keys, sens, params, state = [], [], [], []
    for g, kind in enumerate(kinds):
        mine = list(geometries[kind]) + ([f"{kind}-own{g}"] if rng.random() < 0.5 else [])
        keys.append(mine)
        size = rng.uniform(1, 10, len(mine))
        params.append(list(size))
        state.append(list(rng.uniform(0, 5, len(mine))))
        sens.append(list(rng.uniform(0, 3, len(mine)) / size))
    return keys, sens, {"params": params, "state": state}


def _brute(keys, sens, costs, budgets, kinds, layer_of, removal, keep_one_of):
    """Every geometry per kind times every set of removed layers (never all, one of keep_one_of kept)."""
    order = list(dict.fromkeys(kinds))
    shared = {
        k: [
            key
            for key in keys[kinds.index(k)]
            if all(key in keys[g] for g, kk in enumerate(kinds) if kk == k)
        ]
        for k in order
    }
    layers = sorted(removal)
    best = None
    for combo in itertools.product(*(shared[k] for k in order)):
        geometry = dict(zip(order, combo))
        for r in range(len(layers) + 1):
            for gone in itertools.combinations(layers, r):
                if len(gone) == len(set(layer_of)) or (keep_one_of and set(keep_one_of) <= set(gone)):
                    continue
                picks = [
                    None if layer_of[g] in gone else keys[g].index(geometry[kinds[g]])
                    for g in range(len(keys))
                ]
                spent = {
                    n: sum(c[g][p] for g, p in enumerate(picks) if p is not None) for n, c in costs.items()
                }
                if any(spent[n] > budgets[n] + 1e-9 for n in budgets):
                    continue
                value = sum(sens[g][p] for g, p in enumerate(picks) if p is not None) + sum(
                    removal[i] for i in gone
                )
                if best is None or value < best[0] - 1e-12:
                    best = (value, picks, sorted(gone))
    return best


@pytest.mark.parametrize("seed", range(12))
def test_the_servable_choice_equals_brute_force(seed):
    rng = np.random.default_rng(seed)
    layer_of = [0, 0, 1, 1, 2, 2, 3]  # four decoder layers: (gdn | attention, mlp) each, one lone group
    kinds = ["gdn", "mlp", "attention", "mlp", "gdn", "mlp", "attention"]
    keys, sens, costs = _table(rng, kinds, layer_of)
    removal = {i: float(rng.uniform(0.5, 4)) for i in range(4)}
    keep_one_of = [1, 3]  # the attention layers
    full = {n: sum(max(g) for g in c) for n, c in costs.items()}
    checked = 0
    for share in (0.3, 0.5, 0.7, 0.95):
        budgets = {"params": share * full["params"], "state": (share + 0.1) * full["state"]}
        best = _brute(keys, sens, costs, budgets, kinds, layer_of, removal, keep_one_of)
        if best is None:
            with pytest.raises(BudgetError):
                choose_servable(
                    keys,
                    sens,
                    costs,
                    budgets,
                    kinds=kinds,
                    layer_of=layer_of,
                    removal=removal,
                    keep_one_of=keep_one_of,
                )
            continue
        picks, gone = choose_servable(
            keys,
            sens,
            costs,
            budgets,
            kinds=kinds,
            layer_of=layer_of,
            removal=removal,
            keep_one_of=keep_one_of,
        )
        value = sum(sens[g][p] for g, p in enumerate(picks) if p is not None) + sum(removal[i] for i in gone)
        assert value == pytest.approx(best[0], rel=1e-9, abs=1e-12)
        assert all((p is None) == (layer_of[g] in gone) for g, p in enumerate(picks))
        for kind in set(kinds):  # one geometry per kind over the kept groups
            assert len({keys[g][p] for g, p in enumerate(picks) if kinds[g] == kind and p is not None}) <= 1
        for n, b in budgets.items():
            assert sum(costs[n][g][p] for g, p in enumerate(picks) if p is not None) <= b + 1e-6
        assert not set(keep_one_of) <= set(gone)
        checked += 1
    assert checked >= 2


def test_without_removal_the_servable_choice_is_the_uniform_one():
    rng = np.random.default_rng(5)
    kinds = ["gdn", "gdn", "mlp", "mlp"]
    keys, sens, costs = _table(rng, kinds, [0, 1, 0, 1])
    budgets = {"params": 0.8 * sum(max(g) for g in costs["params"])}
    best = _brute(keys, sens, {"params": costs["params"]}, budgets, kinds, [0, 1, 0, 1], {}, [])
    assert best is not None
    picks, gone = choose_servable(
        keys, sens, {"params": costs["params"]}, budgets, kinds=kinds, layer_of=[], removal={}
    )
    assert gone == [] and None not in picks
    assert sum(sens[g][p] for g, p in enumerate(picks)) == pytest.approx(best[0])


def test_the_solver_leaves_the_standard_output_clean(capfd):
    """HiGHS prints some lines with C's printf whatever its options: the solves send descriptor 1 to the null
    device, flush C's buffers before restoring it (nothing comes out later), and restore it on errors too."""
    libc = ctypes.CDLL(None)
    stdout = ctypes.c_void_p.in_dll(libc, "stdout")
    capfd.readouterr()
    libc.fflush(None)
    buffer = ctypes.create_string_buffer(1 << 16)  # _IOFBF: as C's stdout is on a pipe or file (not under -u)
    libc.setvbuf(stdout, buffer, 0, len(buffer))
    try:
        with silenced_stdout():
            libc.printf(b"from C, buffered\n")  # not flushed: the silencer must flush it into the null device
            os.write(1, b"from the descriptor\n")
        os.write(1, b"after\n")
        libc.fflush(None)
    finally:  # unbuffered (_IONBF) from here on: no buffer of ours is left behind
        libc.fflush(None)
        libc.setvbuf(stdout, None, 2, 0)
    assert capfd.readouterr().out == "after\n"
    with pytest.raises(RuntimeError), silenced_stdout():
        raise RuntimeError("inside")
    os.write(1, b"restored\n")
    assert capfd.readouterr().out == "restored\n"
    rng = np.random.default_rng(3)  # real solves, servable (with removal) and plain, print nothing either
    layer_of, kinds = [0, 0, 1, 1, 2, 2, 3], ["gdn", "mlp", "attention", "mlp", "gdn", "mlp", "attention"]
    keys, sens, costs = _table(rng, kinds, layer_of)
    budgets = {"params": 0.6 * sum(max(g) for g in costs["params"])}
    removal = {i: 1.0 for i in range(4)}
    choose_servable(
        keys, sens, costs, budgets, kinds=kinds, layer_of=layer_of, removal=removal, keep_one_of=[1, 3]
    )
    choose(sens, {"params": costs["params"]}, budgets)
    libc.fflush(None)
    assert capfd.readouterr().out == ""


def test_servable_problems_name_the_kinds_that_differ():
    a, b = GDNShape(2, 4, 8, 6), GDNShape(1, 2, 8, 6)
    assert servable_problems({0: a, 2: a}, {"mlp": {0: 64, 1: 64}}) == []
    assert servable_problems({0: a, 2: b}, {}, removed=[2]) == []
    problems = servable_problems({0: a, 2: b}, {"mlp": {0: 64, 1: 32}})
    assert len(problems) == 2 and problems[0].startswith("gdn layers differ") and "mlp" in problems[1]


# ---- servable outputs -----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    root = tmp_path_factory.mktemp("servable")
    src = make_source(root / "model", "qwen3_5", seed=6)
    text = root / "calib.txt"
    text.write_text(" ".join(["the model sorts heads and channels and slices them"] * 400))
    scores = root / "scores.json"
    args = ["score", str(src), "--data", str(text), "--output", str(scores), "--num-samples", "4"]
    assert main([*args, "--seq-len", "40", "--sub-blocks", "--quiet"]) == 0
    return src, text, scores


TARGET = GDNShape(num_key_heads=1, num_value_heads=2, key_head_dim=8, value_head_dim=6)


def _write(path, layers, default=None):
    plan = {"format": "gdnprune-plan", "version": 2, "layers": layers}
    if default:
        plan["default"] = default
    path.write_text(json.dumps(plan))
    return path


def _by_hand(src, scores, target, removed):
    """The original model, its GDN layers cut by hand (tests/reference) and the ``removed`` decoder layers
    dropped by hand: a config written here and the kept layers' tensors renumbered."""
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    data = json.loads(scores.read_text())
    data["layers"] = {k: v for k, v in data["layers"].items() if block_kind_of(k) is None}  # GDN layers
    permutations = scores_to_permutations(data)
    gdn = [n for n, m in model.named_modules() if n.endswith("linear_attn")]
    cut = cut_model(model, {p: target for p in gdn}, permutations)
    config = copy.deepcopy(model.config)
    keep = [i for i in range(config.num_hidden_layers) if i not in removed]
    config.layer_types = [config.layer_types[i] for i in keep]
    config.num_hidden_layers = len(keep)
    config.linear_num_key_heads, config.linear_num_value_heads = target.num_key_heads, target.num_value_heads
    config.linear_key_head_dim, config.linear_value_head_dim = target.key_head_dim, target.value_head_dim
    small = AutoModelForCausalLM.from_config(config).eval()
    state = {}
    for name, tensor in cut.state_dict().items():
        parts = name.split(".")
        if parts[:2] == ["model", "layers"]:
            i = int(parts[2])
            if i in removed:
                continue
            parts[2] = str(keep.index(i))
        state[".".join(parts)] = tensor
    small.load_state_dict(state, strict=True)
    return small


def test_a_servable_output_with_removed_layers_loads_in_plain_transformers(folder, tmp_path, capsys):
    src, text, scores = folder
    plan = _write(tmp_path / "plan.json", {"model.layers.1": {"removed": True}}, TARGET.as_dict())
    out = tmp_path / "out"
    args = ["prune", str(src), "--data", str(text), "--scores", str(scores), "--plan", str(plan)]
    assert main([*args, "--servable", "--output", str(out), "--quiet"]) == 0
    config = json.loads((out / "config.json").read_text())
    assert "per_layer_config" not in config and "auto_map" not in config
    assert config["num_hidden_layers"] == 3
    assert config["layer_types"] == ["linear_attention", "linear_attention", "full_attention"]
    assert config["linear_num_key_heads"] == 1 and config["linear_num_value_heads"] == 2
    plain, info = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    assert type(plain).__name__ == "Qwen3_5ForCausalLM"
    ids = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        mine = plain.eval()(input_ids=ids).logits
        theirs = load_pretrained(out).eval()(input_ids=ids).logits
        hand = _by_hand(src, scores, TARGET, {1})(input_ids=ids).logits
    torch.testing.assert_close(mine, theirs, rtol=0, atol=0)
    torch.testing.assert_close(mine, hand, rtol=1e-5, atol=1e-5)


def test_servable_refuses_a_plan_that_needs_per_layer_config_before_loading(folder, tmp_path, capsys):
    src, text, scores = folder
    plan = _write(tmp_path / "plan.json", {"model.layers.0.linear_attn": TARGET.as_dict()})
    out = tmp_path / "out"
    args = ["prune", str(src), "--data", str(text), "--scores", str(scores), "--plan", str(plan)]
    capsys.readouterr()
    assert main([*args, "--servable", "--output", str(out), "--quiet"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "per_layer_config" in err[0] and "gdn layers differ" in err[0]
    assert not out.exists()


def test_a_servable_search_gives_one_geometry_per_kind_and_says_so(folder):
    src, text, scores = folder
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    ids = torch.randint(0, 128, (4, 24), generator=torch.Generator().manual_seed(4))
    data = score_model(model, [ids], progress=False, blocks=True)
    plan, report = plan_model(
        model,
        [ids[:2], ids[2:]],
        data,
        budget_params=0.6,
        sensitivity="measured",
        dim_step="1/2",
        servable=True,
        progress=False,
    )
    assert plan["servable"] == SERVABLE_NOTE and report["servable"] == SERVABLE_NOTE and plan["uniform"]
    kinds: dict[str, set] = {}
    for key, entry in plan["layers"].items():
        if "removed" not in entry:
            kinds.setdefault(key.rsplit(".", 1)[-1], set()).add(json.dumps(entry, sort_keys=True))
    assert kinds and all(len(v) == 1 for v in kinds.values())
    for entry in plan["layers"].values():  # the default gives every kind's geometry too
        if "removed" not in entry:
            assert all(plan["default"][k] == v for k, v in entry.items())
    assert plan["totals"]["model_params_kept"] <= 0.6 * plan["totals"]["model_params"] + 1e-6
    assert not {1, 3} <= set(plan["predicted"]["removed_layers"])  # a full-attention layer stays


def test_snap_servable_gives_the_cost_of_servability(folder, tmp_path, capsys):
    src, text, scores = folder
    common = ["--scores", str(scores), "--data", str(text), "--sensitivity", "measured", "--num-samples", "4"]
    common += ["--seq-len", "24", "--quiet"]
    het = tmp_path / "het.json"
    grid = ["--dim-step", "1/2", "--blocks", "gdn,mlp,depth"]
    assert main(["plan", str(src), *common, "--budget-params", "0.7", *grid, "-o", str(het)]) == 0
    out = tmp_path / "servable.json"
    capsys.readouterr()
    assert main(["plan", str(src), *common, "--snap-servable", str(het), "-o", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "cost of servability" in printed and SERVABLE_NOTE in printed
    plan = json.loads(out.read_text())
    report = json.loads((tmp_path / "servable.sensitivity.json").read_text())
    cost = report["servability"]
    # the servable space is inside the heterogeneous one, and both were chosen exactly on these measurements
    assert cost["predicted"]["cost"] >= -1e-9 and cost["predicted"]["heterogeneous"] >= 0
    assert cost["measured_kl"]["heterogeneous"] >= 0 and cost["measured_kl"]["servable"] >= 0
    assert plan["servable"] == SERVABLE_NOTE and plan["budgets"] == json.loads(het.read_text())["budgets"]
    kinds: dict[str, set] = {}
    for key, entry in plan["layers"].items():
        if "removed" not in entry:
            kinds.setdefault(key.rsplit(".", 1)[-1], set()).add(json.dumps(entry, sort_keys=True))
    assert all(len(v) == 1 for v in kinds.values())
    capsys.readouterr()
    bad = ["plan", str(src), *common, "--snap-servable", str(het), "--budget-params", "0.5", "-o", str(out)]
    assert main([*bad, "--overwrite"]) == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 1


def test_plan_targets_reads_removals_and_widths_off_the_grid():
    """What the snap measures of a plan: each group's target, None where the plan removes its decoder layer
    (a plan file's ``{"removed": true}`` entry, as the search writes it), a width off the grid as it is."""
    model = random_dense_model("qwen3_5")
    given = dict(params=1.0, gdn_params=None, active_params=None, memory=None, state=None)
    problem = build_problem(
        model,
        given,
        None,
        context=None,
        blocks=("gdn", "mlp", "depth"),
        grid=Grid(parse_dim_step("1/2"), AXES),
        orders_applied=True,
        uniform=False,
    )
    gone = problem.rests[0].index
    picks = [None if problem.layer_of[g] == gone else 0 for g in range(len(problem.groups))]
    layers = problem.entries(picks)
    layers[problem.decoder_keys()[gone]] = {"removed": True}
    mlp = next(b for b in problem.blocks if problem.layer_of[problem.groups.index(b)] != gone)
    layers[problem.key_of.get(mlp.prefix, mlp.prefix)] = {"intermediate_size": 7}
    plan = {"format": PLAN_FORMAT, "version": PLAN_VERSION, "layers": layers}
    targets = plan_targets(problem, plan)
    for g, group in enumerate(problem.groups):
        removed = problem.layer_of[g] == gone
        want = None if removed else MLPShape(7) if group is mlp else group.candidates[0]
        assert targets[g] == want
    assert [t is None for t in targets[len(problem.groups) :]] == [r.index == gone for r in problem.rests]
    with pytest.raises(ValueError, match="not on the search grid"):
        plan_picks(problem, plan)
