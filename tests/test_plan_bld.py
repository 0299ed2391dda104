"""Blockwise local distillation as a sensitivity (issue 31): candidates recovered on their block's output.

References are written here from plain forwards: the block inputs and outputs come from hooks on the
unpruned model, the block error from the trained module's own outputs, the KL from whole-model logits with
the trained module put in place by hand.
"""

from __future__ import annotations

import json

import pytest
import torch
from helpers import SOURCE_SHAPE as SHAPE
from tiny_models import build_model

from gdnprune.cli import main
from gdnprune.cli.plan import BLD_STEPS, SENSITIVITIES
from gdnprune.model.forwards import parent_and_name
from gdnprune.model.geometry import GDNShape, orders_from_payload
from gdnprune.model.layouts import find_gdn_modules
from gdnprune.plan.api import SENSITIVITIES as LIBRARY_SENSITIVITIES
from gdnprune.plan.measure.bld import (
    DEFAULT_STEPS,
    bld_sensitivity,
    block_error,
    distill_block,
    evaluation_batches,
)
from gdnprune.plan.measure.sensitivity import (
    LayerToPlan,
    candidate_module,
    measured_sensitivity,
    sorted_state,
)
from gdnprune.scoring import score_model

pytestmark = pytest.mark.filterwarnings("ignore::gdnprune.checkpoint.UnsortedInputWarning")

TARGETS = [GDNShape(1, 2, 8, 6), GDNShape(2, 2, 5, 4)]


@pytest.fixture(scope="module")
def setup():
    model = build_model("qwen3_5", SHAPE, seed=3)
    x = torch.randint(0, 128, (2, 48), generator=torch.Generator().manual_seed(0))
    scores = score_model(model, [x], progress=False)
    prefix, module = find_gdn_modules(model)[0]
    layer = LayerToPlan(
        prefix,
        module,
        orders_from_payload(scores["layers"][prefix], GDNShape.from_module(module)),
        [GDNShape.from_module(module), *TARGETS],
    )
    return model, [x[:1], x[1:]], layer


def _block_data(model, batches, module):
    """(args, kwargs, output) of ``module`` on every batch, from hooks on a plain forward of the model."""
    seen: list[list] = []

    def keep_input(module, args, kwargs):
        seen.append([args, kwargs])

    def keep_output(module, args, output):
        seen[-1].append(output)

    pre = module.register_forward_pre_hook(keep_input, with_kwargs=True)
    post = module.register_forward_hook(keep_output)
    with torch.no_grad():
        for x in batches:
            model(input_ids=x, use_cache=False)
    pre.remove()
    post.remove()
    return [(tuple(a), dict(k), y[0] if isinstance(y, tuple) else y) for a, k, y in seen]


def _error(module, data) -> float:
    """sum ||module(x) - y||^2 / sum ||y||^2 over the cached block inputs and outputs."""
    with torch.no_grad():
        num = sum(float((module(*a, **k) - y).pow(2).sum()) for a, k, y in data)
    return num / sum(float(y.pow(2).sum()) for _, _, y in data)


def test_a_bld_trained_candidate_reproduces_its_block_better_than_the_one_shot_cut(setup):
    model, batches, layer = setup
    data = _block_data(model, batches, layer.module)
    state = sorted_state(layer)
    for target in TARGETS:
        cut = candidate_module(layer, state, target, model.config, torch.device("cpu"))
        weights = {k: v.clone() for k, v in cut.state_dict().items()}
        trained, before, after = distill_block(cut, data, steps=10, lr=1e-3)

        assert before == pytest.approx(_error(cut, data), rel=1e-4)
        assert after == pytest.approx(_error(trained, data), rel=1e-4)
        assert _error(trained, data) < _error(cut, data)
        # the cut itself is left as it was (its weights are the sorted model's)
        assert all(torch.equal(v, weights[k]) for k, v in cut.state_dict().items())


@pytest.mark.parametrize("block", ["linear_attn", "self_attn", "mlp"])
def test_joined_batches_give_every_batch_s_block_output(setup, block):
    """The block errors run on the calibration batches joined into one: the same outputs as batch by batch."""
    model = setup[0]
    x = torch.randint(0, 128, (4, 40), generator=torch.Generator().manual_seed(1))
    layer = next(m for m in model.model.layers if hasattr(m, block))
    module = getattr(layer, block)
    data = _block_data(model, [x[:3], x[3:]], module)  # batches of 3 windows and 1
    joined = evaluation_batches(data)
    assert len(joined) == 1 and joined[0][2].shape[0] == 4
    args, kwargs, _ = joined[0]
    with torch.no_grad():
        out = module(*args, **kwargs)
    out = out[0] if isinstance(out, tuple) else out
    torch.testing.assert_close(out, torch.cat([y for _, _, y in data]), rtol=1e-5, atol=1e-6)
    assert block_error(module, joined, torch.float32) < 1e-10
    # a token limit keeps the batches apart; batches of another structure do not join
    assert [e[2].shape[0] for e in evaluation_batches(data, max_tokens=100)] == [3, 1]
    odd = [data[0], (data[1][0], {**data[1][1], "extra": 1}, data[1][2])]
    assert len(evaluation_batches(odd)) == 2


def test_a_cut_s_block_error_is_the_same_joined_or_batch_by_batch(setup):
    model, batches, layer = setup
    data = _block_data(model, batches, layer.module)
    cut = candidate_module(layer, sorted_state(layer), TARGETS[1], model.config, torch.device("cpu"))
    assert len(evaluation_batches(data)) == 1
    assert block_error(cut, evaluation_batches(data), torch.float32) == pytest.approx(
        _error(cut, data), rel=1e-5
    )


def test_bld_sensitivity_is_the_kl_of_the_model_with_the_recovered_block(setup):
    model, batches, layer = setup
    steps = 6
    result = bld_sensitivity(model, batches, [layer], steps=steps, lr=1e-3, progress=False)
    one_shot = measured_sensitivity(model, batches, [layer], progress=False)
    x = torch.cat(batches)
    data = _block_data(model, batches, layer.module)
    state = sorted_state(layer)
    with torch.no_grad():
        teacher = model(input_ids=x).logits.log_softmax(-1)
    kl = result["kl"][layer.prefix]
    # the full geometry: the sorted block, the same function (not trained, not measured, as `measured`)
    assert kl[0] == 0.0 and result["bld"]["error"][layer.prefix][0] == 0.0
    assert result["loss"][layer.prefix][0] == one_shot["loss"][layer.prefix][0] == result["base_loss"]
    for k, target in enumerate(TARGETS, start=1):
        cut = candidate_module(layer, state, target, model.config, torch.device("cpu"))
        trained, before, after = distill_block(cut, data, steps=steps, lr=1e-3)
        parent, attr = parent_and_name(model, layer.module)
        setattr(parent, attr, trained)
        try:
            with torch.no_grad():
                student = model(input_ids=x).logits.log_softmax(-1)
        finally:
            setattr(parent, attr, layer.module)
        reference = float((teacher.exp() * (teacher - student)).sum(-1).mean())
        assert kl[k] == pytest.approx(reference, rel=1e-3, abs=1e-7)
        assert result["bld"]["error"][layer.prefix][k] == pytest.approx(after, rel=1e-4)
        assert after < before  # (a lower block error need not give a lower KL: not asserted)
    # block errors batch by batch (no joined calls): the same table to float rounding
    apart = bld_sensitivity(model, batches, [layer], steps=steps, lr=1e-3, progress=False, max_tokens=0)
    for key in ("kl", "loss"):
        assert apart[key][layer.prefix] == pytest.approx(result[key][layer.prefix], rel=1e-4, abs=1e-7)
    for key in ("error_one_shot", "error"):
        assert apart["bld"][key][layer.prefix] == pytest.approx(result["bld"][key][layer.prefix], rel=1e-4)
    # no step: the measured sensitivity
    none = bld_sensitivity(model, batches, [layer], steps=0, progress=False)
    assert none["kl"][layer.prefix] == pytest.approx(one_shot["kl"][layer.prefix], rel=1e-5, abs=1e-7)


def test_the_cli_names_the_library_s_sensitivities():
    assert SENSITIVITIES == LIBRARY_SENSITIVITIES and BLD_STEPS == DEFAULT_STEPS


@pytest.mark.slow
def test_bld_on_two_ranks_equals_one_process(launch, tmp_path):
    """The shared 2-process launch (tests/launches.py) planned with --sensitivity bld; one process here."""
    from launches import SEQ

    ranks = [json.loads((launch.folder / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert ranks[0]["plan_bld"]["code"] == ranks[1]["plan_bld"]["code"] == 0, ranks[0]["plan_bld"]["err"]
    report = json.loads((launch.folder / "plan_bld.sensitivity.json").read_text())
    alone = tmp_path / "alone.json"
    model_dir = json.loads((launch.folder / "plan_bld.json").read_text())["model"]
    data = json.loads((launch.folder / "plan_bld.json").read_text())["calibration"]["data"]
    argv = ["plan", model_dir, "--scores", str(launch.folder / "projection.json"), "--data", data]
    argv += ["--output", str(alone), "--budget-gdn-params", "0.5", "--dim-step", "1/2", "--num-samples", "4"]
    argv += [
        "--seq-len",
        str(SEQ),
        "--batch-size",
        "1",
        "--quiet",
        "--sensitivity",
        "bld",
        "--bld-steps",
        "3",
    ]
    assert main(argv) == 0
    single = json.loads((tmp_path / "alone.sensitivity.json").read_text())
    assert report["bld"]["steps"] == single["bld"]["steps"] == 3
    for prefix, layer in report["layers"].items():
        assert [c["sensitivity"] for c in layer["candidates"]] == pytest.approx(
            [c["sensitivity"] for c in single["layers"][prefix]["candidates"]], rel=1e-4, abs=1e-8
        )
