"""Self-contained outputs (``--self-contained``, issue 21): a folder whose GDN layers, attention heads and MLP
channels differ per layer loads with plain ``AutoModelForCausalLM.from_pretrained(folder,
trust_remote_code=True)`` in an interpreter where gdnprune cannot be imported.

The interpreter: this Python with ``-I -S`` (no PYTHONPATH, no current folder, no ``.pth`` files, so not
the editable install of gdnprune), ``sys.path`` = the site-packages folders (torch, transformers) and an
import hook that refuses ``gdnprune`` (in case it is installed there as a package). It checks that
``import gdnprune`` fails before it loads anything. The reference logits come from
:func:`gdnprune.load_pretrained` of the same folders in this process (gdnprune's loader, itself checked
against models with zeroed output columns in ``test_dense_axes``); cached decoding is compared with the
model's own full forward.
"""

from __future__ import annotations

import json
import os
import site
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import CHILD_GC, assert_same, random_dense_model
from tiny_models import logits

from gdnprune import checkpoint as ck
from gdnprune.checkpoint.remote_code import MODELING_NAME, SelfContainedError, auto_map, modeling_source
from gdnprune.cli import main
from gdnprune.io.loading import load_pretrained
from gdnprune.model.subblock_surgery import find_model_blocks

pytestmark = pytest.mark.filterwarnings("ignore::gdnprune.checkpoint.UnsortedInputWarning")

FAMILIES = ["qwen3_5", "qwen3_5_vl", "qwen3_5_moe", "qwen3_next", "olmo_hybrid"]
STEPS = 4
SAVE = ["qwen3_5", "qwen3_5_vl"]  # saved by the loaded model and loaded again

CHILD = r"""
import importlib.abc, json, sys
sys.path[:0] = PATHS

class NoGdnprune(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "gdnprune" or name.startswith("gdnprune."):
            raise ImportError(f"{name} is not importable here")

sys.meta_path.insert(0, NoGdnprune())
try:
    import gdnprune
    report = {"gdnprune_imported": gdnprune.__file__}
except ImportError:
    report = {"gdnprune_imported": None}

import torch, transformers
from transformers import AutoModelForCausalLM

ids = torch.load(IDS)

@torch.no_grad()
def run(model):
    full = model(input_ids=ids).logits
    out = model(input_ids=ids[:, :-STEPS], use_cache=True)
    cache, seq = out.past_key_values, [out.logits[:, -1]]
    for t in range(ids.shape[1] - STEPS, ids.shape[1]):
        out = model(input_ids=ids[:, t:t + 1], past_key_values=cache, use_cache=True)
        cache = out.past_key_values
        seq.append(out.logits[:, -1])
    return full, torch.stack(seq, dim=1)

results = {}
for name, folder in FOLDERS.items():
    entry = report.setdefault(name, {})
    try:  # without the modeling file: transformers' own classes cannot build per-layer sizes
        AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=False)
        entry["plain"] = "loaded"
    except Exception as exc:
        entry["plain"] = type(exc).__name__
    model, info = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True, output_loading_info=True)
    entry["class"] = f"{type(model).__module__}.{type(model).__name__}"
    entry["base"] = f"{type(model).__mro__[1].__module__}.{type(model).__mro__[1].__name__}"
    entry["loading_info"] = {k: sorted(map(str, v)) for k, v in info.items() if v}
    full, cached = run(model.eval())
    results[name] = {"full": full, "cached": cached}
    if name in SAVE:
        model.save_pretrained(SAVED + "/" + name)
        again = AutoModelForCausalLM.from_pretrained(SAVED + "/" + name, trust_remote_code=True).eval()
        with torch.no_grad():
            results[name]["reloaded"] = again(input_ids=ids).logits
report["modules"] = sorted(m for m in sys.modules if m.split(".")[0] == "gdnprune")
torch.save(results, OUT)
print(json.dumps(report))
"""


def _plan(model):
    """A version-2 plan: one GDN layer cut, every attention and MLP sub-block its own size, and in MoE models
    every layer its own number of routed experts (4 experts, 2 per token: 2, 3 or 4 kept)."""
    layers = {}
    blocks = find_model_blocks(model)
    for i, b in enumerate(b for b in blocks if b.kind != "experts"):
        layers[b.prefix] = {
            "attention": {"num_attention_heads": 2 * (i % 2 + 1), "num_key_value_heads": i % 2 + 1},
            "mlp": {"intermediate_size": 16 + 8 * i},
            "shared_expert": {"shared_expert_intermediate_size": 8 + 4 * i},
        }[b.kind]
    for i, b in enumerate(b for b in blocks if b.kind == "experts"):
        layers[b.prefix] = {"num_experts": 2 + i % 3}
    gdn = (
        "model.language_model.layers.0.linear_attn"
        if hasattr(model.model, "language_model")
        else "model.layers.0.linear_attn"
    )
    layers[gdn] = {"num_key_heads": 1, "num_value_heads": 2}
    return {"format": "gdnprune-plan", "version": 2, "layers": layers}


def _isolated_python(script: str, tmp_path: Path, **values) -> subprocess.Popen:
    """Start ``script`` where gdnprune is not importable (:func:`_report` waits for it)."""
    paths = [p for p in site.getsitepackages() if os.path.isdir(p)]
    text = CHILD_GC + "".join(f"{k} = {v!r}\n" for k, v in {"PATHS": paths, **values}.items()) + script
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "HF_", "TRANSFORMERS"))}
    env.update(
        HF_HOME=str(tmp_path / "hf"),
        HF_MODULES_CACHE=str(tmp_path / "modules"),
        HF_HUB_OFFLINE="1",
        OMP_NUM_THREADS="1",
    )
    return subprocess.Popen(
        [sys.executable, "-I", "-S", "-c", text],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=tmp_path,
    )


def _report(process: subprocess.Popen) -> dict:
    """The last line of JSON of a finished :func:`_isolated_python`."""
    try:
        stdout, stderr = process.communicate(timeout=300)
    finally:
        process.kill()
    assert process.returncode == 0, stderr[-3000:]
    return json.loads(stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_heterogeneous_outputs_load_without_gdnprune(tmp_path):
    folders, models = {}, {}
    for i, model_type in enumerate(FAMILIES):
        model = random_dense_model(model_type, seed=i)
        model.save_pretrained(tmp_path / "src" / model_type)
        plan = _plan(model)
        out = tmp_path / "out" / model_type
        if model_type == "olmo_hybrid":  # through the command line (no torch there)
            (tmp_path / "plan.json").write_text(json.dumps(plan))
            assert (
                main(
                    [
                        "slice",
                        str(tmp_path / "src" / model_type),
                        "-o",
                        str(out),
                        "--plan",
                        str(tmp_path / "plan.json"),
                        "--self-contained",
                        "-q",
                    ]
                )
                == 0
            )
        else:
            manifest = ck.slice_checkpoint(
                tmp_path / "src" / model_type, out, plan=plan, self_contained=True, progress=False
            )
            assert manifest["self_contained"] == MODELING_NAME
        config = json.loads((out / "config.json").read_text())
        assert (config.get("text_config") or config)["per_layer_config"]  # heterogeneous indeed
        if "moe" in model_type or model_type == "qwen3_next":  # per-layer expert counts
            counts = {
                o.get("num_experts", config["num_experts"]) for o in config["per_layer_config"].values()
            }
            assert len(counts | {config["num_experts"]}) > 1
        assert config["auto_map"] == auto_map(config)
        assert (out / MODELING_NAME).read_bytes() == modeling_source()
        folders[model_type] = out
        models[model_type] = model

    # a self-contained output sliced again: with the option (idempotent), and without it (the file and
    # auto_map are copied with the other files)
    first = folders["qwen3_5"]
    ck.slice_checkpoint(first, tmp_path / "again", {"value_head_dim": 4}, self_contained=True, progress=False)
    ck.slice_checkpoint(first, tmp_path / "copied", {"key_head_dim": 4}, progress=False)
    for name in ("again", "copied"):
        assert (
            json.loads((tmp_path / name / "config.json").read_text())["auto_map"]
            == json.loads((first / "config.json").read_text())["auto_map"]
        )
        assert (tmp_path / name / MODELING_NAME).read_bytes() == modeling_source()
        folders[name] = tmp_path / name

    ids = torch.randint(0, 128, (2, 10), generator=torch.Generator().manual_seed(0))
    torch.save(ids, tmp_path / "ids.pt")
    child = _isolated_python(
        CHILD,
        tmp_path,
        FOLDERS={k: str(v) for k, v in folders.items()},
        IDS=str(tmp_path / "ids.pt"),
        OUT=str(tmp_path / "results.pt"),
        SAVED=str(tmp_path / "saved"),
        SAVE=SAVE,
        STEPS=STEPS,
    )
    references = {name: logits(load_pretrained(folder), ids) for name, folder in folders.items()}  # meanwhile
    report = _report(child)
    assert report["gdnprune_imported"] is None and report["modules"] == []
    results = torch.load(tmp_path / "results.pt")
    for name, folder in folders.items():
        entry = report[name]
        assert entry["plain"] == "AmbiguousGlobalPerLayerAttributeError"  # the modeling file is what loads it
        assert entry["class"].startswith("transformers_modules.") and ".modeling_gdnprune." in entry["class"]
        assert entry["base"].startswith("transformers.models.")
        assert entry["loading_info"] == {}
        full, cached = results[name]["full"], results[name]["cached"]
        assert_same(full, references[name])
        assert_same(cached, full[:, -STEPS - 1 :])
        if name in SAVE:  # save_pretrained wrote the modeling file and auto_map again
            assert torch.equal(results[name]["reloaded"], full)
            assert (
                json.loads((tmp_path / "saved" / name / "config.json").read_text())["auto_map"]
                == json.loads((folder / "config.json").read_text())["auto_map"]
            )
    # the cut is real: the outputs differ from the full models'
    full_model = logits(models["qwen3_5"], ids)
    assert (results["qwen3_5"]["full"] - full_model).abs().max() > 1e-2 * full_model.abs().max()


def test_families_and_foreign_modeling_code_are_refused_before_writing(tmp_path):
    with pytest.raises(SelfContainedError, match=r"model_type of .*found 'llama'"):
        auto_map({"model_type": "llama"})
    assert auto_map({"model_type": "qwen3_5"}) == {
        "AutoModelForCausalLM": "modeling_gdnprune.Qwen3_5ForConditionalGeneration",
        "AutoModelForImageTextToText": "modeling_gdnprune.Qwen3_5ForConditionalGeneration",
    }
    model = random_dense_model("qwen3_5")
    model.save_pretrained(tmp_path / "src")
    config = json.loads((tmp_path / "src" / "config.json").read_text())
    config["auto_map"] = {"AutoModelForCausalLM": "modeling_other.OtherForCausalLM"}
    (tmp_path / "src" / "config.json").write_text(json.dumps(config))
    with pytest.raises(SelfContainedError, match="modeling_other.OtherForCausalLM"):
        ck.slice_checkpoint(
            tmp_path / "src", tmp_path / "out", plan=_plan(model), self_contained=True, progress=False
        )
    assert sorted(os.listdir(tmp_path)) == ["src"]
    assert (
        main(
            [
                "slice",
                str(tmp_path / "src"),
                "-o",
                str(tmp_path / "out"),
                "--num-value-heads",
                "2",
                "--self-contained",
                "-q",
            ]
        )
        == 2
    )
    assert sorted(os.listdir(tmp_path)) == ["src"]
