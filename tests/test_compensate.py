"""Least-squares compensation of out_proj: the math, real tiny models, and compensated checkpoint slicing."""

from __future__ import annotations

import hashlib
import json

import numpy as np
import pytest
import torch
from helpers import SOURCE_SHAPE, make_source, refit_by_hand, trained_demo_case
from hypothesis import given, settings
from hypothesis import strategies as st
from tiny_models import build_model

from gdnprune import load_pretrained
from gdnprune.checkpoint import codecs, sort_checkpoint, transform_checkpoint
from gdnprune.cli import main
from gdnprune.io.loading import slice_model
from gdnprune.model.geometry import GDNShape
from gdnprune.model.layouts import find_gdn_modules
from gdnprune.quality import compensate
from gdnprune.scoring import score_model, scores_to_permutations

pytestmark = pytest.mark.filterwarnings("ignore::gdnprune.checkpoint.UnsortedInputWarning")


def _problem(seed: int, h: int = 6, v: int = 10, n: int = 40):
    rng = np.random.default_rng(seed)
    o = rng.standard_normal((n, v)) @ rng.standard_normal((v, v))  # correlated channels
    return rng.standard_normal((h, v)), o.T @ o, o


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 10_000), keep=st.integers(1, 10), ridge=st.sampled_from([0.0, 1e-6, 1e-3, 1e-1, 10.0])
)
def test_compensation_never_increases_the_reconstruction_error(seed, keep, ridge):
    weight, moment, o = _problem(seed)
    kept = np.random.default_rng(seed + 1).permutation(10)[:keep]
    columns = compensate.compensated_columns(weight, moment, kept, ridge=ridge)
    plain = compensate.reconstruction_error(weight, moment, kept, weight[:, kept])
    assert compensate.reconstruction_error(weight, moment, kept, columns) <= plain * (1 + 1e-9) + 1e-9
    # the error from the moment equals the error on the tokens themselves
    direct = float(((o @ weight.T - o[:, kept] @ columns.T) ** 2).sum())
    scale = float(((o @ weight.T) ** 2).sum())  # the moment form subtracts terms of this size
    assert compensate.reconstruction_error(weight, moment, kept, columns) == pytest.approx(
        direct, rel=1e-8, abs=1e-10 * scale
    )


def test_nothing_removed_is_the_identity_and_small_ridge_is_least_squares():
    weight, moment, o = _problem(3)
    everything = np.random.default_rng(0).permutation(10)
    assert np.array_equal(compensate.compensated_columns(weight, moment, everything), weight[:, everything])
    kept = np.arange(6)
    columns = compensate.compensated_columns(weight, moment, kept, ridge=1e-12)
    least_squares = np.linalg.lstsq(o[:, kept], o @ weight.T, rcond=None)[0].T
    assert np.allclose(columns, least_squares, atol=1e-6)


def test_bf16_bytes_round_like_torch():
    values = torch.randn(1000, dtype=torch.float64) * 3
    ours = codecs.from_float(values.numpy(), "BF16")
    theirs = values.to(torch.bfloat16).view(torch.int16).numpy().astype("<i2").tobytes()
    assert ours == theirs
    back = codecs.to_float(ours, "BF16", (1000,))
    assert np.array_equal(back, values.to(torch.bfloat16).double().numpy())


# ---- real models ---------------------------------------------------------------------------------------------

HEAD_CUTS = [GDNShape(1, 2, 8, 6), GDNShape(2, 2, 8, 6), GDNShape(1, 1, 8, 6)]


def _layer_output_error(model, small, x) -> float:
    """Summed squared difference of every GDN layer's output (its out_proj output), full vs cut model, each
    run on the same layer inputs (hooks feed the full model's input to the cut layer)."""
    full_modules, small_modules = dict(find_gdn_modules(model)), dict(find_gdn_modules(small))
    error = 0.0
    for prefix, module in full_modules.items():
        seen = {}
        handle = module.register_forward_hook(
            lambda m, a, k, out, seen=seen: seen.update(
                input=a, kwargs=k, out=out[0] if isinstance(out, tuple) else out
            ),
            with_kwargs=True,
        )
        with torch.no_grad():
            model(input_ids=x, use_cache=False)
        handle.remove()
        with torch.no_grad():
            out = small_modules[prefix](*seen["input"], **seen["kwargs"])
        out = out[0] if isinstance(out, tuple) else out
        error += float(((out - seen["out"]) ** 2).sum())
    return error


@pytest.mark.parametrize("model_type", ["qwen3_5", "qwen3_next", "olmo_hybrid"])
def test_compensation_never_increases_the_calibration_error_of_real_layers(model_type):
    model = build_model(model_type, SOURCE_SHAPE, seed=11)
    calib = torch.randint(0, 128, (4, 80), generator=torch.Generator().manual_seed(1))
    permutations = scores_to_permutations(score_model(model, [calib], progress=False))
    stats = compensate.collect_statistics(model, [calib])
    for target in HEAD_CUTS:
        plain = slice_model(model, target, permutations)
        refit = refit_by_hand(model, plain, target, permutations, stats)
        assert _layer_output_error(model, refit, calib) <= _layer_output_error(model, plain, calib) * (
            1 + 1e-6
        )


def test_compensation_reduces_the_heldout_loss_increase_of_the_trained_model():
    """Each target on its own (an average would hide a regression on one): the refit helps where it is exact
    (removed key groups, removed lanes) and on a deep value-channel cut, and changes nothing on a key-dim cut
    (no out_proj column is removed). (A combined cut with dv halved, GDNShape(2, 4, 16, 16), is not asserted:
    there the RMSNorm renormalisation makes it worse on these windows, 1.27 -> 1.30.)"""
    model, calib, permutations, stats, loss = trained_demo_case()
    base = loss(model)
    for target in (
        GDNShape(2, 4, 32, 32),
        GDNShape(4, 4, 32, 32),
        GDNShape(4, 8, 32, 8),
        GDNShape(4, 8, 16, 32),
    ):
        plain = slice_model(model, target, permutations)
        increase = loss(plain) - base
        compensated = loss(refit_by_hand(model, plain, target, permutations, stats)) - base
        assert increase > 0.05, target
        if target.key_head_dim < 32:
            assert compensated == pytest.approx(increase, abs=1e-6), target
        else:
            assert compensated < 0.97 * increase, (target, compensated, increase)


# ---- checkpoints ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    root = tmp_path_factory.mktemp("comp")
    src = make_source(root / "model", "qwen3_5", seed=12, dtype=torch.bfloat16)
    model = load_pretrained(src, dtype=torch.float32)
    calib = torch.randint(0, 11, (4, 80), generator=torch.Generator().manual_seed(3))
    stats = compensate.collect_statistics(model, [calib])
    compensate.save_statistics(stats, root / "stats.safetensors", model=compensate.model_identity(src))
    scores = score_model(model, [calib], progress=False)
    return src, root / "stats.safetensors", scores, model


def test_slice_with_compensation_writes_the_refitted_out_proj(source, tmp_path):
    src, stats_path, scores, model = source
    target = GDNShape(1, 2, 8, 6)
    out = tmp_path / "out"
    manifest = transform_checkpoint(
        src,
        out,
        permutations=scores["layers"],
        target=target,
        operation="prune",
        compensation=stats_path,
        progress=False,
    )
    assert manifest["compensation"]["nested"] is False and len(manifest["compensation"]["layers"]) == 2
    got = load_pretrained(out, dtype=torch.float32)
    stats = compensate.load_statistics(stats_path)
    permutations = scores_to_permutations(scores)
    expected = refit_by_hand(model, slice_model(model, target, permutations), target, permutations, stats)
    for (prefix, a), (_, b) in zip(find_gdn_modules(got), find_gdn_modules(expected)):
        # the checkpoint is bf16: the refitted columns rounded once
        assert torch.equal(a.out_proj.weight, b.out_proj.weight.to(torch.bfloat16).float()), prefix


def test_compensation_follows_a_sorted_input_and_refuses_other_models(source, tmp_path, capsys):
    src, stats_path, scores, _ = source
    target = {"num_key_heads": 1, "num_value_heads": 2}
    direct = tmp_path / "direct"
    transform_checkpoint(
        src,
        direct,
        permutations=scores["layers"],
        target=target,
        operation="prune",
        compensation=stats_path,
        progress=False,
    )
    sort_checkpoint(src, scores, tmp_path / "sorted", progress=False)
    two_steps = tmp_path / "two_steps"
    assert (
        main(
            [
                "slice",
                str(tmp_path / "sorted"),
                "-o",
                str(two_steps),
                "--num-key-heads",
                "1",
                "--num-value-heads",
                "2",
                "--compensation-stats",
                str(stats_path),
                "-q",
            ]
        )
        == 0
    )
    for shard in sorted(direct.glob("*.safetensors")):
        assert shard.read_bytes() == (two_steps / shard.name).read_bytes()
    other = make_source(tmp_path / "other", "qwen3_5", seed=13)
    assert (
        main(
            [
                "slice",
                str(other),
                "-o",
                str(tmp_path / "x"),
                "--num-key-heads",
                "1",
                "--num-value-heads",
                "2",
                "--compensation-stats",
                str(stats_path),
            ]
        )
        == 2
    )
    assert "collected on" in capsys.readouterr().err
    (tmp_path / "junk.safetensors").write_bytes(b"junk")
    assert (
        main(
            [
                "slice",
                str(src),
                "-o",
                str(tmp_path / "y"),
                "--num-key-heads",
                "1",
                "--num-value-heads",
                "2",
                "--compensation-stats",
                str(tmp_path / "junk.safetensors"),
            ]
        )
        == 2
    )
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()
    recorded = json.loads((two_steps / "gdnprune.json").read_text())["compensation"]["statistics"]
    assert recorded == {
        "path": str(stats_path.resolve()),
        "sha256": hashlib.sha256(stats_path.read_bytes()).hexdigest(),
    }
