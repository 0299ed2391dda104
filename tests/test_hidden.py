"""The hidden size (the residual stream's width): a cut equals a model built by hand from the first K channels,
a sort keeps the logits, in memory and on disk, for every family.

The reference (:func:`hand_cut`) knows nothing of the hidden-size table: it builds the model class anew from a
config with ``hidden_size=K`` and fills every parameter from the full model's, keeping, along each axis whose
size changed (``m * H`` -> ``m * K``), the first ``K`` channels of each of the ``m`` copies (after the order).
A table that misses a tensor, or cuts one it should not, gives a model whose shapes or logits differ.
"""

from __future__ import annotations

import copy
import json
import re

import pytest
import torch
from helpers import DENSE_SHAPE, add_mtp, assert_same, mtp_tensors, scored_source
from safetensors.torch import load_file, save_file
from tiny_models import MODEL_TYPES, build_model

from gdnprune import demo_data
from gdnprune.checkpoint import open_checkpoint, slice_checkpoint, sort_checkpoint
from gdnprune.cli import main
from gdnprune.io.loading import load_pretrained, slice_model
from gdnprune.io.scores_file import check_scores
from gdnprune.model.hidden import find_hidden
from gdnprune.model.kernels import cpu_gdn_kernels
from gdnprune.model.layouts import HIDDEN_FREE, HIDDEN_RULES, hidden_free, hidden_rules
from gdnprune.model.subblock_surgery import find_model_hidden
from gdnprune.plan.api import plan_model
from gdnprune.plan.measure.hidden import WholeKL
from gdnprune.scoring import score_model
from gdnprune.scoring.api import measure_statistics
from gdnprune.scoring.payload import hidden_scores

FAMILIES = ["qwen3_5", "qwen3_5_vl", "qwen3_5_moe", "qwen3_next", "qwen4_exp", "olmo_hybrid"]
K = 40  # of 64


def noisy_model(model_type: str, seed: int = 0):
    """A tiny model whose every parameter is random (a fresh init has equal norm weights, which would hide a
    norm left in the wrong order)."""
    model = build_model(model_type, DENSE_SHAPE, seed=seed)
    g = torch.Generator().manual_seed(seed + 11)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            if name.endswith("norm.weight"):
                p.copy_((1.0 if model_type == "olmo_hybrid" else 0.0) + 0.5 * noise)
            elif name.endswith(("A_log", "dt_bias")):
                continue
            else:
                p.copy_(noise * (p.shape[-1] ** -0.5 if p.dim() > 1 else 0.1))
    return model.eval()


def _cut_config(config, k: int):
    config = copy.deepcopy(config)
    text = config.get_text_config(decoder=True)
    if getattr(text, "head_dim", None) is None:
        text.head_dim = text.hidden_size // text.num_attention_heads
    text.hidden_size = k
    vision = getattr(config, "vision_config", None)
    if vision is not None:
        vision.out_hidden_size = k
    return config


def hand_cut(model, k: int, order: torch.Tensor | None = None):
    """``model`` with hidden size ``k``, built by hand (see the module docstring)."""
    hidden = model.config.get_text_config(decoder=True).hidden_size
    order = torch.arange(hidden) if order is None else order
    new = type(model)(_cut_config(model.config, k)).eval()
    full = model.state_dict()
    state = {}
    for name, p in new.state_dict().items():
        t = full[name]
        for axis, (a, b) in enumerate(zip(t.shape, p.shape)):
            if a != b:
                copies = a // hidden
                assert a == copies * hidden and b == copies * k, (name, t.shape, p.shape)
                index = torch.cat([c * hidden + order[:k] for c in range(copies)])
                t = t.index_select(axis, index)
        state[name] = t
    new.load_state_dict(state, strict=True)
    return new


def _ids(seed=0):
    return torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def _logits(model, ids):
    return model(input_ids=ids).logits


@pytest.mark.parametrize("model_type", FAMILIES)
def test_cut_in_memory_is_the_model_built_from_the_first_k_channels(model_type):
    model = noisy_model(model_type)
    ids = _ids()
    order = torch.randperm(64, generator=torch.Generator().manual_seed(3))
    sliced = slice_model(model, hidden_size=K, hidden_order={"channels": order})
    reference = hand_cut(model, K, order)
    torch.testing.assert_close(_logits(sliced, ids), _logits(reference, ids), atol=1e-4, rtol=1e-4)
    assert sliced.config.get_text_config(decoder=True).hidden_size == K
    # sorting alone keeps the function
    sorted_model = slice_model(model, hidden_order={"channels": order})
    assert_same(_logits(sorted_model, ids), _logits(model, ids))


def test_the_table_names_every_tensor_on_the_stream():
    found = find_model_hidden(noisy_model("qwen3_5_moe"))
    names = set(found.rules)
    assert "model.embed_tokens.weight" in names and "model.norm.weight" in names
    assert "model.layers.0.mlp.experts.gate_up_proj" in names and "model.layers.0.mlp.gate.weight" in names
    assert "model.layers.0.linear_attn.norm.weight" not in names  # the GDN norm is over the value dim
    assert [r.axis for r in found.rules["model.layers.0.mlp.experts.down_proj"]] == [1]


def test_every_name_matches_the_rules_its_own_regular_expressions_match():
    """The tables are matched once per name with its layer and expert numbers set to 0 (a 512-expert model has
    75,944 names); the reference is every pattern searched in the name itself, on every tensor of every family
    (per-expert names and the MTP head's included) and on numbers of several digits."""
    names = {n for t in MODEL_TYPES for n in noisy_model(t).state_dict()} | set(mtp_tensors(torch.float32))
    names |= {n.replace(".0.", ".47.").replace(".1.", ".511.") for n in names}
    names |= {
        f"model.layers.12.mlp.experts.{e}.{p}.weight" for e in (0, 7, 300) for p in ("gate_proj", "down_proj")
    }
    for name in sorted(names):
        assert hidden_rules(name) == tuple(r for r in HIDDEN_RULES if re.search(r.name, name)), name
        assert hidden_free(name) == any(re.search(p, name) for p in HIDDEN_FREE), name


def test_a_tensor_the_table_does_not_know_is_refused():
    shapes = {"model.embed_tokens.weight": (128, 64), "model.layers.0.mystery.weight": (64, 64)}
    with pytest.raises(ValueError, match=r"mystery.*not in the hidden-size table"):
        find_hidden(shapes, {"hidden_size": 64})
    with pytest.raises(ValueError, match="do not fit hidden_size 64"):
        find_hidden({"model.embed_tokens.weight": (128, 60)}, {"hidden_size": 64})


# ---- scoring -------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def scored():
    model = noisy_model("qwen3_5", seed=2)
    batches = [_ids(s) for s in range(3)]
    return model, batches, score_model(model, batches, progress=False, blocks=["gdn", "mlp", "hidden"])


def test_score_orders_the_hidden_channels_and_the_order_keeps_the_logits(scored):
    model, batches, scores = scored
    payload = check_scores(scores)["hidden"]
    assert payload["shape"] == {"hidden_size": 64} and payload["measure"] == "activation"
    order = payload["channel_order_most_important_first"]
    assert sorted(order) == list(range(64))
    assert order == sorted(range(64), key=lambda i: -payload["channel_scores"][i])
    sorted_model = slice_model(model, hidden_order=payload)
    assert_same(_logits(sorted_model, batches[0]), _logits(model, batches[0]))


@torch.no_grad()
def test_the_activation_statistics_are_the_norm_outputs(scored):
    """Minitron's measure from the hooks equals the mean |norm output| computed from the model's hidden states:
    the final norm's output is the decoder's last hidden state, an input norm's is the norm of a layer's input."""
    model, batches, _ = scored
    stats = measure_statistics(model, batches, progress=False, blocks=["gdn", "hidden"]).hidden
    with cpu_gdn_kernels():  # the kernel scoring runs (tests/test_kernels.py checks it against transformers')
        outs = [model.model(input_ids=b, output_hidden_states=True) for b in batches]
    tokens = sum(b.numel() for b in batches)
    final = sum(o.last_hidden_state.abs().sum((0, 1)).double() for o in outs) / tokens
    row = stats.norms.index("model.norm")
    torch.testing.assert_close(stats.stats["norm_abs"][row] / tokens, final)
    first = model.model.layers[2].input_layernorm
    layer2 = sum(first(o.hidden_states[2]).abs().sum((0, 1)).double() for o in outs) / tokens
    row = stats.norms.index("model.layers.2.input_layernorm")
    torch.testing.assert_close(stats.stats["norm_abs"][row] / tokens, layer2)
    scores = hidden_scores(stats.stats, "activation")
    torch.testing.assert_close(scores, (stats.stats["norm_abs"] / tokens).sum(0))
    assert len(stats.norms) == 2 * 4 + 1  # two norms per decoder layer and the final norm
    # the norms' mean squared input (the rescaled-norms correction reads it): a layer's input
    row = stats.norms.index("model.layers.2.input_layernorm")
    energy = sum(o.hidden_states[2].double().pow(2).sum((0, 1)) for o in outs) / tokens
    torch.testing.assert_close(stats.stats["input_sq"][row] / tokens, energy)


# ---- on disk -------------------------------------------------------------------------------------------


def _payload(order: torch.Tensor) -> dict:
    return {"shape": {"hidden_size": 64}, "channel_order_most_important_first": order.tolist()}


@pytest.mark.filterwarnings(
    "ignore::gdnprune.checkpoint.UnsortedInputWarning"
)  # the GDN layers are not sorted
@pytest.mark.parametrize(
    "model_type, form",
    [
        ("qwen3_5", "pretrained"),
        ("qwen3_5_vl", "pretrained"),
        ("olmo_hybrid", "pretrained"),
        ("qwen3_5_moe", "pretrained"),
        ("qwen4_exp", "pretrained"),
        ("qwen3_next", "fused"),
    ],
)
def test_sort_then_slice_hidden_size_on_disk_is_the_model_built_by_hand(tmp_path, model_type, form):
    """``sort`` with the hidden order keeps the logits; ``slice --hidden-size K`` of the sorted folder (with an
    MLP or expert cut beside it: two gathers of one tensor) loads as the model built by hand; ``mtp.*`` is cut
    too (its fc reads [embedding | hidden state])."""
    model = noisy_model(model_type, seed=4)
    src = tmp_path / "src"
    if form == "fused":
        src.mkdir()
        model.config.save_pretrained(src)
        save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(src / "model.safetensors"))
    else:
        model.save_pretrained(src, max_shard_size="40KB")
    add_mtp(src, mtp_tensors(torch.float32))
    order = torch.randperm(64, generator=torch.Generator().manual_seed(9))
    ids = _ids(4)
    sort_checkpoint(src, {"layers": {}, "hidden": _payload(order)}, tmp_path / "sorted", progress=False)
    assert_same(_logits(load_pretrained(tmp_path / "sorted"), ids), _logits(model, ids))
    moe = model_type in ("qwen3_5_moe", "qwen3_next", "qwen4_exp")
    blocks = {"num_experts": 2} if moe else {"intermediate_size": 40}
    slice_checkpoint(
        tmp_path / "sorted", tmp_path / "cut", target={"hidden_size": K, **blocks}, progress=False
    )
    reference = hand_cut(slice_model(model, blocks=blocks), K, order)
    torch.testing.assert_close(
        _logits(load_pretrained(tmp_path / "cut"), ids), _logits(reference, ids), atol=1e-4, rtol=1e-4
    )
    mtp = load_file(str(sorted((tmp_path / "cut").glob("*.safetensors"))[-1]))["mtp.fc.weight"]
    kept = order[:K]
    expected = mtp_tensors(torch.float32)["mtp.fc.weight"][kept][:, torch.cat([kept, 64 + kept])]
    assert torch.equal(mtp, expected)
    manifest = json.loads((tmp_path / "cut" / "gdnprune.json").read_text())
    assert manifest["hidden"]["target"]["hidden_size"] == K


# ---- the command line ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def scored_folder(tmp_path_factory):
    """A model folder, its calibration text, and its scores with the hidden channels (``--blocks ...,hidden``)."""
    src, calib, _ = scored_source(tmp_path_factory.mktemp("hidden_cli"))
    scores = src.parent / "hidden.scores.json"
    argv = [
        "score",
        str(src),
        "--data",
        str(calib),
        "--output",
        str(scores),
        "--blocks",
        "gdn,attention,mlp,hidden",
    ]
    assert main([*argv, "--num-samples", "4", "--seq-len", "72", "--quiet"]) == 0
    return src, calib, scores


def test_score_sort_slice_hidden_size_on_the_command_line(scored_folder, tmp_path, capsys):
    src, _, scores = scored_folder
    assert "hidden" in json.loads(scores.read_text())  # --blocks ...,hidden orders the hidden channels
    assert main(["sort", str(src), "--scores", str(scores), "-o", str(tmp_path / "sorted"), "-q"]) == 0
    ids = _ids(5)
    full = load_pretrained(src)
    assert_same(_logits(load_pretrained(tmp_path / "sorted"), ids), _logits(full, ids))
    capsys.readouterr()
    assert (
        main(["slice", str(tmp_path / "sorted"), "--hidden-size", "24", "-o", str(tmp_path / "cut"), "-q"])
        == 0
    )
    assert "hidden size 64 -> 24" in capsys.readouterr().out
    cut = load_pretrained(tmp_path / "cut")
    assert cut.config.hidden_size == 24 and cut.model.embed_tokens.weight.shape[1] == 24
    assert main(["inspect", str(tmp_path / "cut")]) == 0
    before, after = open_checkpoint(tmp_path / "sorted"), open_checkpoint(tmp_path / "cut")
    # on the stream: every tensor whose shape the cut changed (counted without the hidden-size table)
    changed = [n for n in after.names if after.tensor(n).shape != before.tensor(n).shape]
    on_stream = sum(after.tensor(n).numel for n in changed)
    assert f"hidden size 24: {on_stream:,} parameters on the residual stream" in capsys.readouterr().out
    assert (
        main(["slice", str(tmp_path / "sorted"), "--hidden-size", "65", "-o", str(tmp_path / "x"), "-q"]) == 2
    )
    assert "hidden_size 65 > 64" in capsys.readouterr().err


def test_prune_may_choose_a_smaller_hidden_size(scored_folder, tmp_path, capsys):
    """A budget that no plan meets at the full hidden size: the plan with ``hidden`` in ``--blocks`` cuts it."""
    src, text, scores = scored_folder
    out = tmp_path / "pruned"
    argv = ["prune", str(src), "--data", str(text), "--scores", str(scores), "-o", str(out)]
    argv += ["--budget-params", "0.45", "--blocks", "mlp,hidden", "--hidden-sizes", "32", "--dim-step", "1/2"]
    argv += ["--sensitivity", "measured", "--plan-samples", "2", "--seq-len", "24", "-q"]
    assert main(argv) == 0
    full, cut = load_pretrained(src), load_pretrained(out)
    assert cut.config.hidden_size == 32
    assert sum(p.numel() for p in cut.parameters()) <= 0.45 * sum(p.numel() for p in full.parameters())
    manifest = json.loads((out / "gdnprune.json").read_text())
    plan = manifest["plan"]["metadata"]
    assert plan["hidden"]["hidden_size"] == 32
    assert plan["hidden"]["candidates"][0] == {"hidden_size": 64, "feasible": False}
    assert manifest["hidden"]["target"]["hidden_size"] == 32
    assert "hidden size 64 -> 32" in capsys.readouterr().out
    argv[0], argv[argv.index("-o") + 1] = "plan", str(tmp_path / "plan.json")
    argv[argv.index("--plan-samples")] = "--num-samples"
    assert main(argv) == 0
    assert "hidden size: 64 -> 32 (the whole cut model's KL at each size tried: 64 (no plan fits), 32 KL" in (
        capsys.readouterr().out
    )
    assert json.loads((tmp_path / "plan.json").read_text())["default"] == {"hidden_size": 32}


def test_rescaled_norms_on_disk_equal_in_memory(tmp_path):
    """The rescaled-norms correction: on disk (bytes decoded, rescaled, encoded) as in memory (torch); every
    norm's scale multiplied by sqrt(mean_kept E[x^2] / mean_all E[x^2]) of its input, from the scores."""
    model = noisy_model("qwen3_5", seed=6)
    scores = score_model(model, [_ids(s) for s in range(2)], progress=False, blocks=["gdn", "hidden"])
    payload = scores["hidden"]
    src = tmp_path / "src"
    model.save_pretrained(src)
    sort_checkpoint(src, scores, tmp_path / "sorted", progress=False)
    slice_checkpoint(
        tmp_path / "sorted", tmp_path / "cut", target={"hidden_size": K}, rescale_norms=scores, progress=False
    )
    on_disk = load_pretrained(tmp_path / "cut")
    in_memory = slice_model(model, hidden_size=K, hidden_order=payload, block_orders=None, rescale_norms=True)
    plain = slice_model(model, hidden_size=K, hidden_order=payload)
    ids = _ids(7)
    assert_same(_logits(on_disk, ids), _logits(in_memory, ids))
    energy = torch.tensor(payload["norm_input_sq"]["model.layers.1.input_layernorm"], dtype=torch.float64)
    kept = torch.tensor(payload["channel_order_most_important_first"][:K])
    factor = (energy[kept].mean() / energy.mean()).sqrt()
    name = "model.layers.1.input_layernorm.weight"
    torch.testing.assert_close(
        (1 + on_disk.state_dict()[name].double()), (1 + plain.state_dict()[name].double()) * factor
    )
    manifest = json.loads((tmp_path / "cut" / "gdnprune.json").read_text())
    assert manifest["hidden"]["nested"] is False and name in manifest["hidden"]["rescaled_norms"]
    # the scores must be those the input was sorted by
    other = dict(scores, hidden={**payload, "channel_order_most_important_first": list(range(64))})
    with pytest.raises(ValueError, match="not in the order of the scores"):
        slice_checkpoint(tmp_path / "sorted", tmp_path / "x", target={"hidden_size": K}, rescale_norms=other)


@pytest.mark.filterwarnings("ignore::gdnprune.checkpoint.UnsortedInputWarning")
def test_distill_eval_and_bench_take_a_cut_hidden_size(scored_folder, tmp_path, capsys, monkeypatch):
    """A student whose hidden size is cut distils from the full teacher (its own embedding and head), and
    ``eval`` and ``bench`` run it beside the teacher; ``mtp.*`` (cut with it) is carried over."""
    monkeypatch.setenv("GDNPRUNE_DATA_CACHE", str(tmp_path / "cache"))
    src, text, _ = scored_folder
    student, out = tmp_path / "student", tmp_path / "distilled"
    slice_checkpoint(src, student, target={"hidden_size": 40}, progress=False)
    argv = ["distill", str(student), "--teacher", str(src), "--data", str(text), "--output", str(out)]
    argv += ["--steps", "2", "--batch-size", "2", "--seq-len", "24", "--threads", "1", "--quiet"]
    assert main(argv) == 0
    model = load_pretrained(out)
    assert model.config.hidden_size == 40
    assert load_file(str(out / "model.safetensors"))["mtp.fc.weight"].shape == (40, 80)
    argv = [
        "bench",
        str(src),
        str(out),
        "--workload",
        "prefill:1:16",
        "--repeats",
        "1",
        "--warmup-calls",
        "0",
    ]
    assert main([*argv, "--device", "cpu", "--quiet", "-o", str(tmp_path / "bench")]) == 0
    rows = json.loads((tmp_path / "bench" / "results.json").read_text())["results"]
    assert rows[1]["parameters"] == sum(p.numel() for p in model.parameters()) < rows[0]["parameters"]
    # eval, on the bundled byte-level model and its hidden size cut to 96 (lm-eval needs a real tokenizer)
    demo = demo_data.demo_model_path()
    slice_checkpoint(demo, tmp_path / "demo96", target={"hidden_size": 96}, progress=False)
    valid = tmp_path / "valid.txt"
    valid.write_text(demo_data.validation_text()[:512], encoding="utf-8")
    argv = ["eval", str(demo), str(tmp_path / "demo96"), "--tasks", "nats_per_byte", "--data", str(valid)]
    assert main([*argv, "--limit", "2", "--device", "cpu", "--quiet", "-o", str(tmp_path / "eval")]) == 0
    models = json.loads((tmp_path / "eval" / "results.json").read_text())["models"]
    assert models[0]["parameters"] == 898_512 > models[1]["parameters"]
    assert all(m["results"]["nats_per_byte"]["nats_per_byte,none"] > 0 for m in models)


def test_the_default_plan_cuts_the_hidden_size_where_the_scores_order_the_hidden_channels(scored):
    """plan's default blocks hold hidden, score's do not (a sort by a hidden order rewrites every tensor): the
    default plan tries the grid of hidden sizes where the scores order the hidden channels, and plans the
    widths alone, without an error, where they do not."""
    from gdnprune.plan.measure.subblocks import BLOCK_NAMES
    from gdnprune.scoring.hidden import hidden_asked

    model, batches, _ = scored
    assert "hidden" in BLOCK_NAMES and hidden_asked(None) is False
    scores = score_model(model, batches, progress=False, blocks=["gdn", "attention", "mlp", "hidden"])
    plan, _ = plan_model(model, batches, scores, budget_params=0.5, dim_step="1/2")
    assert [c["hidden_size"] for c in plan["hidden"]["candidates"]] == [64, 56, 48]
    without = {k: v for k, v in scores.items() if k != "hidden"}
    plan, _ = plan_model(model, batches, without, budget_params=0.5, dim_step="1/2")
    assert "hidden" not in plan and "hidden_size" not in (plan.get("default") or {})


def test_the_whole_model_kl_of_a_hidden_cut_is_the_kl_of_its_logits(scored):
    """The plan measures each hidden size's whole cut model by the KL per token from the full model, its
    logits computed a chunk of positions at a time: equal to the KL of the two models' whole logits."""
    model, batches, scores = scored
    small = slice_model(model, hidden_size=K, hidden_order=scores["hidden"])
    kl = WholeKL(model, batches, max_logits=700)  # chunks of 5 positions
    with torch.no_grad():
        t = torch.cat([model(input_ids=b).logits for b in batches]).log_softmax(-1)
        s = torch.cat([small(input_ids=b).logits for b in batches]).log_softmax(-1)
    direct = float((t.exp() * (t - s)).sum(-1).mean())
    assert kl(small) == pytest.approx(direct, rel=1e-4) and direct > 0.01
    assert kl(model) == pytest.approx(0.0, abs=1e-6)


@pytest.mark.filterwarnings("ignore::gdnprune.checkpoint.UnsortedInputWarning")
def test_a_per_layer_plan_with_a_hidden_size_loads_with_the_heterogeneous_loader(scored_folder, tmp_path):
    """A plan whose layers differ (per_layer_config) and whose default cuts the hidden size: the sliced folder
    loads with gdnprune.load_pretrained as the model cut in memory."""
    src, _, _ = scored_folder
    plan = {
        "format": "gdnprune-plan",
        "version": 2,
        "default": {"hidden_size": 40},
        "layers": {
            "model.layers.0.linear_attn": {"num_key_heads": 1, "num_value_heads": 2},
            "model.layers.3.mlp": {"intermediate_size": 24},
        },
    }
    slice_checkpoint(src, tmp_path / "cut", plan=plan, progress=False)
    loaded = load_pretrained(tmp_path / "cut")
    assert (
        loaded.config.hidden_size == 40
        and json.loads((tmp_path / "cut" / "config.json").read_text())["per_layer_config"]
    )
    full = load_pretrained(src)
    expected = slice_model(
        full,
        {"model.layers.0.linear_attn": {"num_key_heads": 1, "num_value_heads": 2}},
        blocks={"model.layers.3.mlp": {"intermediate_size": 24}},
        hidden_size=40,
    )
    ids = _ids(8)
    assert_same(_logits(loaded, ids), _logits(expected, ids))


def test_a_plan_of_the_hidden_size_says_what_it_does_not_combine_with(scored):
    model, batches, scores = scored
    with pytest.raises(ValueError, match="does not combine with `budget_latency`, the evolutionary search"):
        plan_model(model, batches, scores, budget_params=0.5, blocks=("mlp", "hidden"), evolve_generations=2)
    without = {k: v for k, v in scores.items() if k != "hidden"}
    with pytest.raises(ValueError, match="no order of the hidden channels"):
        plan_model(model, batches, without, budget_params=0.5, blocks=("mlp", "hidden"))
