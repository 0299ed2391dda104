"""Sequential (cut-aware) compensation: every layer's refit checked with real forwards of tiny models, the
identity cases, the held-out loss of the trained bundled model, and ``prune --compensate sequential``."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from helpers import SOURCE_SHAPE, refit_by_hand, trained_demo_case
from tiny_models import build_model

from gdnprune import load_pretrained
from gdnprune.io.loading import slice_model
from gdnprune.model.geometry import GDNShape
from gdnprune.model.layouts import find_gdn_modules
from gdnprune.quality import compensate
from gdnprune.scoring import score_model, scores_to_permutations

# value heads, value channels, key channels (no change of the out_proj width), and all at once
CUTS = [GDNShape(1, 2, 8, 6), GDNShape(2, 4, 8, 3), GDNShape(2, 4, 4, 6), GDNShape(1, 2, 5, 4)]


def _out(module):
    return getattr(module, "out_proj", None) or module.o_proj


def _inputs(net, prefix, x):
    """The out_proj input of GDN layer ``prefix`` and the input of the decoder layer that holds it."""
    module = dict(find_gdn_modules(net))[prefix]
    block = next(b for b in net.get_decoder().layers if any(m is module for m in b.modules()))
    seen = {}
    handles = [
        _out(module).register_forward_pre_hook(lambda m, a: seen.update(o=a[0].double())),
        block.register_forward_pre_hook(
            lambda m, a, k: seen.update(x=(a[0] if a else k["hidden_states"]).double()), with_kwargs=True
        ),
    ]
    with torch.no_grad():
        net(input_ids=x, use_cache=False)
    for handle in handles:
        handle.remove()
    return seen["o"], seen["x"]


def _setup(model_type, seed=11):
    model = build_model(model_type, SOURCE_SHAPE, seed=seed)
    calib = torch.randint(0, 128, (4, 80), generator=torch.Generator().manual_seed(1))
    return model, calib, scores_to_permutations(score_model(model, [calib], progress=False))


@pytest.mark.parametrize(
    "model_type,reference",
    [
        ("qwen3_5", "stream"),
        ("qwen3_5", "full"),
        ("qwen3_5", "cut"),
        ("qwen3_next", "stream"),
        ("olmo_hybrid", "stream"),
    ],
)
def test_every_refitted_layer_reconstructs_better_than_the_plain_cut_on_its_own_inputs(model_type, reference):
    model, calib, permutations = _setup(model_type)
    batches = list(calib.split(2))
    for target in CUTS:
        plain = slice_model(model, target, permutations)
        refit = slice_model(model, target, permutations)
        report = compensate.sequential_refit(model, refit, batches, reference=reference)
        assert list(report) == [p for p, _ in find_gdn_modules(model)]  # every layer from the first cut on
        plain_layers, refit_layers = dict(find_gdn_modules(plain)), dict(find_gdn_modules(refit))
        for prefix, full in find_gdn_modules(model):
            # the refitted model's own inputs to this layer (earlier layers refitted), and the reference
            o, x_cut = _inputs(refit, prefix, calib)
            o_full, x_full = _inputs(model, prefix, calib)
            y = o_full @ _out(full).weight.detach().double().T
            if reference == "stream":
                y = y + x_full - x_cut
            elif reference == "cut":  # the full layer on the refitted model's inputs
                swapped = slice_model(model, {p: GDNShape.from_module(m) for p, m in find_gdn_modules(model)})
                for p, m in find_gdn_modules(refit):
                    if p != prefix:
                        parent, _, name = p.rpartition(".")
                        setattr(swapped.get_submodule(parent), name, m)
                y = _inputs(swapped, prefix, calib)[0] @ _out(full).weight.detach().double().T
            w_plain = _out(plain_layers[prefix]).weight.detach().double()
            w_refit = _out(refit_layers[prefix]).weight.detach().double()
            assert np.allclose(report[prefix]["columns"], w_refit.numpy())
            before = float(((y - o @ w_plain.T) ** 2).sum())
            after = float(((y - o @ w_refit.T) ** 2).sum())
            assert after <= before * (1 + 1e-9), (target, prefix)
            assert report[prefix]["error_refit"] == pytest.approx(
                after, rel=1e-6, abs=1e-9 * float((y * y).sum())
            )
            assert report[prefix]["error_plain"] == pytest.approx(
                before, rel=1e-6, abs=1e-9 * float((y * y).sum())
            )
            if target != GDNShape(2, 4, 4, 6) or prefix != next(iter(report)):
                continue
            assert after < 0.9 * before  # a key-dim cut, which the statistics cannot compensate, is


def test_nothing_cut_changes_nothing_and_an_unchanged_layer_keeps_its_columns():
    model, calib, permutations = _setup("qwen3_5")
    batches = [calib]
    sorted_only = slice_model(model, SOURCE_SHAPE, permutations)
    before = {k: v.clone() for k, v in sorted_only.state_dict().items()}
    assert compensate.sequential_refit(model, sorted_only, batches) == {}
    assert all(torch.equal(before[k], v) for k, v in sorted_only.state_dict().items())
    # only the second layer cut: the first is not refitted; with reference "cut", a layer whose own width is
    # kept computes the full layer on the same inputs, so its refit is its own (permuted) columns
    first, second = [p for p, _ in find_gdn_modules(model)]
    small = slice_model(model, {first: SOURCE_SHAPE, second: GDNShape(1, 2, 8, 6)}, permutations)
    kept = _out(dict(find_gdn_modules(small))[first]).weight.clone()
    assert list(compensate.sequential_refit(model, small, batches)) == [second]
    assert torch.equal(_out(dict(find_gdn_modules(small))[first]).weight, kept)
    small = slice_model(model, {first: GDNShape(1, 2, 8, 6), second: SOURCE_SHAPE}, permutations)
    kept = _out(dict(find_gdn_modules(small))[second]).weight.detach().double().clone()
    report = compensate.sequential_refit(model, small, batches, reference="cut")
    assert np.allclose(report[second]["columns"], kept.numpy(), rtol=1e-5, atol=1e-6)  # float32 forwards
    with pytest.raises(ValueError, match="reference"):
        compensate.sequential_refit(model, small, batches, reference="other")


def test_sequential_refit_reduces_the_heldout_loss_of_the_trained_model_more_than_the_statistics():
    model, calib, permutations, stats, loss = trained_demo_case()
    base = loss(model)
    for target in (GDNShape(3, 3, 24, 24), GDNShape(4, 8, 16, 32)):  # combined; key dims only
        plain = slice_model(model, target, permutations)
        statistics = loss(refit_by_hand(model, plain, target, permutations, stats)) - base
        compensate.sequential_refit(model, plain, list(calib.split(4)))
        sequential = loss(plain) - base
        assert sequential < statistics, target


def test_prune_compensate_sequential_writes_the_in_memory_refit(tmp_path):
    from helpers import make_source
    from transformers import AutoTokenizer

    from gdnprune.cli import main
    from gdnprune.quality.calibration import calibration_windows
    from gdnprune.scoring import score_checkpoint

    src = make_source(tmp_path / "model", "qwen3_5", seed=22)
    text = tmp_path / "calib.txt"
    text.write_text(" ".join(["the model sorts heads and slices them"] * 300))
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
                "--key-head-dim",
                "5",
                "--compensate",
                "sequential",
                "--data",
                str(text),
                "--num-samples",
                "4",
                "--seq-len",
                "72",
                "--batch-size",
                "2",
                "--quiet",
            ]
        )
        == 0
    )
    manifest = json.loads((out / "gdnprune.json").read_text())
    assert manifest["compensation"]["method"] == "sequential"
    assert len(manifest["compensation"]["layers"]) == 2
    got = load_pretrained(out, dtype=torch.float32)
    model = load_pretrained(src, dtype=torch.float32)
    scores = score_checkpoint(src, text, num_samples=4, seq_len=72, batch_size=2, progress=False)
    small = slice_model(
        model, {"num_key_heads": 1, "num_value_heads": 2, "key_head_dim": 5}, scores["layers"]
    )
    plain = {p: _out(m).weight.clone() for p, m in find_gdn_modules(small)}
    windows = calibration_windows(text, AutoTokenizer.from_pretrained(src), seq_len=72, num_samples=4)
    compensate.sequential_refit(model, small, list(windows.split(2)))
    for (prefix, a), (_, b) in zip(find_gdn_modules(got), find_gdn_modules(small)):
        assert torch.allclose(_out(a).weight, _out(b).weight, rtol=1e-5, atol=1e-6), prefix
        assert not torch.allclose(_out(a).weight, plain[prefix], rtol=1e-3, atol=1e-4), prefix
        for name, tensor in a.state_dict().items():  # everything else is the plain cut
            if "out_proj" not in name:
                assert torch.equal(tensor, b.state_dict()[name]), (prefix, name)


def test_a_per_position_weight_weights_each_tokens_squared_error():
    """Batches that carry a per-position weight (KL_WEIGHT, as the recall windows do): the first refitted
    layer's columns are the weighted ridge solution written out by hand from its inputs."""
    from gdnprune.model.forwards import KL_WEIGHT

    model, calib, permutations = _setup("qwen3_5")
    weight = torch.rand(calib.shape, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    weight[:, : calib.shape[1] // 2] = 0.0  # the first half of every window not reconstructed at all
    batches = [{"input_ids": calib[i : i + 2], KL_WEIGHT: weight[i : i + 2]} for i in (0, 2)]
    target = GDNShape(1, 2, 8, 6)
    small = slice_model(model, target, permutations)
    plain = slice_model(model, target, permutations)
    report = compensate.sequential_refit(model, small, batches)
    first, full = find_gdn_modules(model)[0]
    o, x_cut = _inputs(plain, first, calib)
    o_full, x_full = _inputs(model, first, calib)
    y = o_full @ _out(full).weight.detach().double().T + x_full - x_cut
    o, y, w = o.reshape(-1, o.shape[-1]), y.reshape(-1, y.shape[-1]), weight.reshape(-1, 1)
    w_plain = _out(dict(find_gdn_modules(plain))[first]).weight.detach().double()
    auto = (o * w).T @ o
    lam = compensate.DEFAULT_RIDGE * float(torch.diagonal(auto).mean())
    by_hand = torch.linalg.solve(
        auto + lam * torch.eye(auto.shape[0], dtype=torch.float64), ((y * w).T @ o + lam * w_plain).T
    ).T
    assert np.allclose(report[first]["columns"], by_hand.numpy(), rtol=1e-4, atol=1e-6)
    unweighted = compensate.sequential_refit(model, slice_model(model, target, permutations), [calib])
    assert not np.allclose(unweighted[first]["columns"], by_hand.numpy(), rtol=1e-3, atol=1e-4)
