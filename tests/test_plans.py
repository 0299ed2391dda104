"""Per-layer widths: plan files, heterogeneous slicing, per_layer_config, load_pretrained, constraints."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers
from helpers import SOURCE_SHAPE, leftovers, make_source
from tiny_models import cached_decode_logits, cut_model

from gdnprune import load_pretrained
from gdnprune.checkpoint import (
    find_gdn_layers,
    inspect_checkpoint,
    open_checkpoint,
    slice_checkpoint,
    sort_checkpoint,
)
from gdnprune.cli import main
from gdnprune.io.plan_file import PlanError, constraint_violations, kernel_warnings, resolve_plan
from gdnprune.model.geometry import GDNShape

pytestmark = pytest.mark.filterwarnings("ignore::gdnprune.checkpoint.UnsortedInputWarning")

FAMILIES = ["qwen3_5", "qwen3_5_vl", "qwen3_5_moe", "qwen3_next", "olmo_hybrid"]
# SOURCE_SHAPE is Hk 2, Hv 4, dk 8, dv 6; the tiny models have GDN layers 0 and 2
SMALL = GDNShape(num_key_heads=1, num_value_heads=2, key_head_dim=5, value_head_dim=4)
WIDE = GDNShape(num_key_heads=2, num_value_heads=2, key_head_dim=8, value_head_dim=3)


def prefixes(model_type: str) -> tuple[str, str]:
    base = "model.language_model." if model_type == "qwen3_5_vl" else "model."
    return f"{base}layers.0.linear_attn", f"{base}layers.2.linear_attn"


def plan_of(targets: dict, **extra) -> dict:
    return {
        "format": "gdnprune-plan",
        "version": 1,
        "layers": {p: t.as_dict() for p, t in targets.items()},
        **extra,
    }


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    root = tmp_path_factory.mktemp("plan_sources")
    return {mt: make_source(root / mt, mt, seed=i, sharded=i % 2 == 0) for i, mt in enumerate(FAMILIES)}


def ids(n=2, length=80, seed=0):
    return torch.randint(0, 128, (n, length), generator=torch.Generator().manual_seed(seed))


# ---- the plan file ---------------------------------------------------------------------------------------


def test_plan_fields_default_and_aliases():
    shapes = {
        "model.language_model.layers.0.linear_attn": SOURCE_SHAPE,
        "model.language_model.layers.2.linear_attn": SOURCE_SHAPE,
    }
    plan = {
        "format": "gdnprune-plan",
        "version": 1,
        "default": {"value_head_dim": 4},
        "layers": {"model.layers.0.linear_attn": {"num_key_heads": 1, "num_value_heads": 2}},
    }
    targets = resolve_plan(plan, shapes)
    assert targets["model.language_model.layers.0.linear_attn"] == SOURCE_SHAPE.replace(
        num_key_heads=1, num_value_heads=2
    )
    assert targets["model.language_model.layers.2.linear_attn"] == SOURCE_SHAPE.replace(value_head_dim=4)
    no_default = dict(plan, default=None)
    assert resolve_plan(no_default, shapes)["model.language_model.layers.2.linear_attn"] == SOURCE_SHAPE


@pytest.mark.parametrize(
    "plan, message",
    [
        ({"format": "other", "version": 1, "layers": {}}, "not a gdnprune plan"),
        ({"format": "gdnprune-plan", "version": 3, "layers": {}}, "unsupported plan version"),
        ({"format": "gdnprune-plan", "version": 1, "layers": {}}, "nothing to cut"),
        (
            {"format": "gdnprune-plan", "version": 1, "layers": {"model.layers.0.linear_attn": {"heads": 1}}},
            "unknown fields",
        ),
        (
            {
                "format": "gdnprune-plan",
                "version": 1,
                "layers": {"model.layers.0.linear_attn": {"num_key_heads": 1.0}},
            },
            "positive integer",
        ),
        (
            {
                "format": "gdnprune-plan",
                "version": 1,
                "layers": {"model.layers.0.linear_attn": {"num_key_heads": True}},
            },
            "positive integer",
        ),
        (
            {
                "format": "gdnprune-plan",
                "version": 1,
                "layers": {"model.layers.7.linear_attn": {"num_key_heads": 1}},
            },
            "not a GDN layer",
        ),
        (
            {
                "format": "gdnprune-plan",
                "version": 1,
                "layers": {"model.layers.0.linear_attn": {"num_key_heads": 3}},
                "default": {"key_head_dim": 9},
            },
            "2 layer(s) of the plan do not fit",
        ),
    ],
)
def test_bad_plans_are_refused_with_what_was_expected(plan, message):
    shapes = {"model.layers.0.linear_attn": SOURCE_SHAPE, "model.layers.2.linear_attn": SOURCE_SHAPE}
    with pytest.raises(PlanError, match=message.replace("(", r"\(").replace(")", r"\)")):
        resolve_plan(plan, shapes)


def test_a_bad_plan_exits_2_and_writes_nothing(sources, tmp_path, capsys):
    (tmp_path / "plan.json").write_text(json.dumps(plan_of({"model.layers.5.linear_attn": SMALL})))
    out = tmp_path / "new" / "out"
    assert (
        main(["slice", str(sources["qwen3_5"]), "--plan", str(tmp_path / "plan.json"), "-o", str(out), "-q"])
        == 2
    )
    assert "not a GDN layer" in capsys.readouterr().err
    assert not (tmp_path / "new").exists() and leftovers(tmp_path) == []
    assert (
        main(
            [
                "slice",
                str(sources["qwen3_5"]),
                "--plan",
                str(tmp_path / "plan.json"),
                "--num-key-heads",
                "1",
                "-o",
                str(out),
            ]
        )
        == 2
    )
    assert "not both" in capsys.readouterr().err


# ---- heterogeneous checkpoints ----------------------------------------------------------------------------


@pytest.mark.parametrize("model_type", FAMILIES)
def test_a_per_layer_slice_loads_with_load_pretrained_and_matches_module_surgery(
    model_type, sources, tmp_path
):
    first, second = prefixes(model_type)
    targets = {first: SMALL, second: WIDE}
    out = tmp_path / "out"
    manifest = slice_checkpoint(sources[model_type], out, plan=plan_of(targets), progress=False)
    assert manifest["target"] is None and manifest["layers"][first]["target"] == SMALL.as_dict()

    config = json.loads((out / "config.json").read_text())
    holder = config.get("text_config", config)
    assert holder["per_layer_config"]  # transformers' own convention, not a key of ours
    with pytest.raises(
        transformers.AmbiguousGlobalPerLayerAttributeError
        if hasattr(transformers, "AmbiguousGlobalPerLayerAttributeError")
        else RuntimeError
    ):
        transformers.AutoModelForCausalLM.from_pretrained(out)  # fails loudly, never loads wrong shapes

    model, info = load_pretrained(out, dtype=torch.float32, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys"))
    layers = dict((p, m) for p, m in _gdn(model))
    assert GDNShape.from_module(layers[_module_prefix(model, first)]) == SMALL
    assert GDNShape.from_module(layers[_module_prefix(model, second)]) == WIDE

    reference = cut_model(_source_model(sources[model_type], model_type), _module_targets(model, targets))
    x = ids()
    with torch.no_grad():
        got, want = model.eval()(input_ids=x).logits, reference(input_ids=x).logits
    assert (got - want).abs().max() < 1e-5
    decoded = cached_decode_logits(model, x, steps=4)  # the recurrent cache holds per-layer state shapes
    assert (decoded - got[:, -5:]).abs().max() < 1e-4

    # the heterogeneous checkpoint can be inspected, sliced again and sorted: pruning can be iterated
    info = inspect_checkpoint(out)
    assert info["heterogeneous"] and info["gdn_shape"] is None
    assert [layer["num_value_heads"] for layer in info["layers"]] == [2, 2]
    again = tmp_path / "again"
    slice_checkpoint(out, again, {"value_head_dim": 3}, progress=False)
    shapes = {layer.prefix: layer.shape for layer in find_gdn_layers(open_checkpoint(again))[0]}
    assert shapes == {first: SMALL.replace(value_head_dim=3), second: WIDE}


def _gdn(model):
    from gdnprune.model.layouts import find_gdn_modules

    return find_gdn_modules(model)


def _module_prefix(model, checkpoint_prefix: str) -> str:
    """The module name of a checkpoint's GDN layer (a VL checkpoint loaded as itself keeps its prefix)."""
    names = [p for p, _ in _gdn(model)]
    return (
        checkpoint_prefix if checkpoint_prefix in names else checkpoint_prefix.replace("language_model.", "")
    )


def _module_targets(model, targets: dict) -> dict:
    return {_module_prefix(model, p): t for p, t in targets.items()}


def _source_model(folder: Path, model_type: str):
    return load_pretrained(folder, dtype=torch.float32).eval()


def test_a_uniform_plan_writes_the_plain_config(sources, tmp_path):
    first, second = prefixes("qwen3_next")
    out = tmp_path / "out"
    manifest = slice_checkpoint(
        sources["qwen3_next"], out, plan=plan_of({first: SMALL, second: SMALL}), progress=False
    )
    config = json.loads((out / "config.json").read_text())
    assert "per_layer_config" not in config and config["linear_num_value_heads"] == 2
    assert manifest["target"] == SMALL.as_dict()
    transformers.AutoModelForCausalLM.from_pretrained(out)  # vLLM and plain transformers read it


def test_a_heterogeneous_checkpoint_can_be_scored_sorted_and_verified(sources, tmp_path):
    from gdnprune.checkpoint import verify_checkpoints
    from gdnprune.scoring import score_model

    first, second = prefixes("qwen3_5")
    het = tmp_path / "het"
    slice_checkpoint(sources["qwen3_5"], het, plan=plan_of({first: SMALL, second: WIDE}), progress=False)
    model = load_pretrained(het, dtype=torch.float32)
    scores = score_model(model, [ids(2, 72)], progress=False)
    assert scores["layers"][first]["shape"] == SMALL.as_dict()
    sorted_dir = tmp_path / "sorted"
    sort_checkpoint(het, scores, sorted_dir, progress=False)
    result = verify_checkpoints(het, sorted_dir)
    assert result["within_tolerance"] and result["max_abs_diff"] < 1e-4


# ---- constraints ---------------------------------------------------------------------------------------------


def test_constraints_are_listed_layer_by_layer():
    targets = {"a": GDNShape(2, 4, 128, 96), "b": GDNShape(3, 6, 120, 128), "c": GDNShape(4, 8, 8, 12)}
    lines = constraint_violations(targets, tp=2, multiple_of=16)
    assert [line.split(":")[0] for line in lines] == ["b", "c"]
    assert "divisible by `tp=2`" in lines[0] and "key_head_dim 120 is not a multiple of 16" in lines[0]
    assert constraint_violations(targets) == []
    notes = kernel_warnings(targets)
    assert [line.split(":")[0] for line in notes] == ["b", "c"]
    assert "< 16" in notes[1] and "pads" in notes[0]


def test_slice_refuses_a_plan_that_breaks_a_constraint(sources, tmp_path, capsys):
    first, second = prefixes("qwen3_5")
    (tmp_path / "plan.json").write_text(json.dumps(plan_of({first: SMALL, second: WIDE})))
    out = tmp_path / "out"
    assert (
        main(
            [
                "slice",
                str(sources["qwen3_5"]),
                "--plan",
                str(tmp_path / "plan.json"),
                "-o",
                str(out),
                "--tp",
                "2",
            ]
        )
        == 2
    )
    err = capsys.readouterr().err
    assert first in err and "--tp 2" in err and not out.exists()
    assert (
        main(["slice", str(sources["qwen3_5"]), "--plan", str(tmp_path / "plan.json"), "-o", str(out), "-q"])
        == 0
    )
    assert "flash-linear-attention" in capsys.readouterr().err  # dims 5 and 3: a warning, not an error


@pytest.mark.parametrize("model_type", ["qwen3_5_vl", "olmo_hybrid", "qwen4_exp"])
def test_slice_model_cuts_in_memory_and_saves_a_loadable_folder(model_type, tmp_path):
    from tiny_models import build_model

    from gdnprune.io.loading import slice_model
    from gdnprune.scoring import score_model, scores_to_permutations

    model = build_model(model_type, SOURCE_SHAPE, seed=2)
    x = ids()
    permutations = scores_to_permutations(score_model(model, [x], progress=False))
    first, second = [p for p, _ in _gdn(model)]
    targets = {first: SMALL, second: WIDE}
    small = slice_model(model, targets, permutations)
    reference = cut_model(model, targets, permutations)
    with torch.no_grad():
        assert torch.equal(small(input_ids=x).logits, reference(input_ids=x).logits)
    small.save_pretrained(tmp_path / "small")
    again = load_pretrained(tmp_path / "small", dtype=torch.float32)
    with torch.no_grad():
        assert torch.equal(again(input_ids=x).logits, reference(input_ids=x).logits)
    uniform = slice_model(model, {"num_key_heads": 1, "num_value_heads": 2})
    assert GDNShape.from_config(uniform.config) == SOURCE_SHAPE.replace(num_key_heads=1, num_value_heads=2)
