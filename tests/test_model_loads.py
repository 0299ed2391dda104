"""Models are loaded only when needed: ``prune`` loads its model once, the proxy plan reads no weights."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from helpers import scored_source
from safetensors import SafetensorError

import gdnprune.io.loading
from gdnprune import load_pretrained
from gdnprune.cli import main
from gdnprune.io.loading import empty_causal_lm, load_causal_lm
from gdnprune.model.layouts import find_gdn_modules
from gdnprune.plan import plan_checkpoint, plan_model


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return scored_source(tmp_path_factory.mktemp("loads"), seed=7)


def test_prune_with_a_searched_plan_and_sequential_refit_loads_the_model_once(folder, tmp_path, monkeypatch):
    src, text, _ = folder
    loads = []
    original = gdnprune.io.loading.load_pretrained
    monkeypatch.setattr(
        gdnprune.io.loading, "load_pretrained", lambda *a, **k: loads.append(a) or original(*a, **k)
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
                "--budget-gdn-params",
                "0.5",
                "--dim-step",
                "1/2",
                "--num-samples",
                "4",
                "--plan-samples",
                "2",
                "--seq-len",
                "72",
                "--compensate",
                "sequential",
                "--refine",
                "lanes",
                "--quiet",
            ]
        )
        == 0
    )
    assert len(loads) == 1  # scoring, lane refinement, the plan search and the refit share it
    manifest = json.loads((out / "gdnprune.json").read_text())
    assert manifest["compensation"]["method"] == "sequential" and manifest["plan"]


def _weightless_copy(src, dst):
    """``src`` with every safetensors file replaced by bytes that no loader can read."""
    shutil.copytree(src, dst)
    shards = sorted(dst.glob("*.safetensors"))
    assert shards
    for shard in shards:
        shard.write_bytes(b"not a safetensors file")
    return dst


def test_the_proxy_plan_reads_no_weights(folder, tmp_path):
    src, _, scores = folder
    shell = _weightless_copy(src, tmp_path / "shell")
    with pytest.raises(SafetensorError, match="header"):
        load_causal_lm(shell, device="cpu")  # the placeholders are really unreadable
    options = dict(sensitivity="proxy", budget_gdn_params=0.5, dim_step="1/2")
    plan, report = plan_checkpoint(shell, None, scores, **options)
    reference, reference_report = plan_model(
        load_pretrained(src, dtype=torch.float32), None, scores, **options
    )
    assert {k: v for k, v in plan.items() if k != "model"} == reference
    assert {k: v for k, v in report.items() if k != "seconds"} == {
        k: v for k, v in reference_report.items() if k != "seconds"
    }


def test_an_empty_model_has_the_loaded_models_modules_and_shapes_on_meta(folder):
    src, _, _ = folder
    empty, loaded = empty_causal_lm(src), load_causal_lm(src, device="cpu")
    assert type(empty) is type(loaded)
    assert {n: p.shape for n, p in empty.named_parameters()} == {
        n: p.shape for n, p in loaded.named_parameters()
    }
    assert {p.device.type for p in empty.parameters()} == {"meta"}
    assert [p for p, _ in find_gdn_modules(empty)] == [p for p, _ in find_gdn_modules(loaded)]
