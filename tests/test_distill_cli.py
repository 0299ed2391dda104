"""`gdnprune distill` from the command line, with a heterogeneous student (a per-layer plan's output)."""

from __future__ import annotations

import json

import pytest
import torch

from gdnprune import load_pretrained
from gdnprune.checkpoint import slice_checkpoint
from gdnprune.cli import main
from gdnprune.geometry import GDNShape
from gdnprune.layouts import find_gdn_modules
from test_checkpoint import make_source

pytestmark = pytest.mark.filterwarnings("ignore::gdnprune.checkpoint.UnsortedInputWarning")


def test_distill_a_heterogeneous_student_from_the_command_line(tmp_path, capsys):
    teacher = make_source(tmp_path / "teacher", "qwen3_5", seed=31)
    plan = {"format": "gdnprune-plan", "version": 1,
            "layers": {"model.layers.0.linear_attn": {"num_key_heads": 1, "num_value_heads": 2},
                       "model.layers.2.linear_attn": {"value_head_dim": 4}}}
    student = tmp_path / "student"
    slice_checkpoint(teacher, student, plan=plan, progress=False, self_contained=True)
    text = tmp_path / "train.txt"
    text.write_text(" ".join(["the model sorts heads and slices them"] * 200))
    out = tmp_path / "out"
    assert main(["distill", str(student), "--teacher", str(teacher), "--data", str(text), "--output", str(out),
                 "--steps", "3", "--batch-size", "2", "--seq-len", "40", "--lr", "1e-3", "--eval-data", str(text),
                 "--eval-samples", "2", "--eval-every", "3", "--quiet", "--threads", "1"]) == 0
    assert "3 steps" in capsys.readouterr().out
    config = json.loads((out / "config.json").read_text())
    assert config["per_layer_config"]  # still heterogeneous, in transformers' convention
    # and still self-contained (tests/test_self_contained.py): the student's modeling file and auto_map
    assert config["auto_map"] == json.loads((student / "config.json").read_text())["auto_map"]
    assert (out / "modeling_gdnprune.py").read_bytes() == (student / "modeling_gdnprune.py").read_bytes()
    model = load_pretrained(out, dtype=torch.float32)
    shapes = {p: GDNShape.from_module(m) for p, m in find_gdn_modules(model)}
    assert shapes["model.layers.0.linear_attn"].num_value_heads == 2
    assert shapes["model.layers.2.linear_attn"].value_head_dim == 4
    log = json.loads((out / "distill_log.json").read_text())
    assert log["format"] == "gdnprune-distill-log" and any("eval_kd_loss" in h for h in log["history"])
    assert (out / "tokenizer.json").is_file()
    # a teacher folder that transformers cannot load: one line, exit 2, nothing written
    broken = make_source(tmp_path / "broken", "qwen3_5", seed=32)
    config = json.loads((broken / "config.json").read_text())
    config["vocab_size"] = 99  # the weights have 128 rows
    (broken / "config.json").write_text(json.dumps(config))
    assert main(["distill", str(student), "--teacher", str(broken), "--data", str(text), "--output",
                 str(tmp_path / "x"), "--steps", "1", "--quiet"]) == 2
    assert "cannot load it" in capsys.readouterr().err and not (tmp_path / "x").exists()
