"""``gdnprune bench`` end to end on tiny model folders: the documented results.json keys, the table, the plot,
a folder with per_layer_config, and the user's mistakes (exit 2, one line, before any model is loaded)."""

from __future__ import annotations

import json
import warnings

import pytest
from helpers import make_source

import gdnprune.io.loading
from gdnprune.checkpoint import slice_checkpoint
from gdnprune.cli import main
from gdnprune.gated_delta_net import GDNShape

#: the keys docs/bench.md documents
HEADER_KEYS = {
    "version",
    "models",
    "workloads",
    "device",
    "dtype",
    "repeats",
    "warmup_calls",
    "threads",
    "flash_linear_attention",
    "torch",
    "transformers",
    "machine",
    "results",
}
RESULT_KEYS = {
    "model",
    "parameters",
    "speedup",
    "workload",
    "phase",
    "batch",
    "context",
    "seconds",
    "repeats",
    "tokens_per_second",
    "ms_per_token",
    "device",
    "peak_memory_bytes",
    "memory_growth_bytes",
}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("bench")
    teacher = make_source(root / "teacher", "qwen3_5", seed=3, sharded=False)
    small = GDNShape(num_key_heads=1, num_value_heads=2, key_head_dim=8, value_head_dim=6)
    plan = {
        "format": "gdnprune-plan",
        "version": 1,
        "layers": {"model.layers.0.linear_attn": small.as_dict()},
    }
    pruned = root / "pruned"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # an unsorted input: irrelevant to timing
        slice_checkpoint(teacher, pruned, plan=plan, progress=False)
    return teacher, pruned, small


def test_bench_writes_results_table_and_plot(folders, tmp_path, capsys, monkeypatch):
    teacher, pruned, small = folders
    config = json.loads((pruned / "config.json").read_text())
    assert config.get("per_layer_config")  # the pruned folder needs gdnprune's loader
    loaded = []
    original = gdnprune.io.loading.load_pretrained
    monkeypatch.setattr(
        gdnprune.io.loading, "load_pretrained", lambda *a, **k: loaded.append(original(*a, **k)) or loaded[-1]
    )
    out = tmp_path / "bench"
    argv = ["bench", str(teacher), str(pruned), "--workload", "prefill:1:70", "--workload", "decode:2:9"]
    argv += ["--repeats", "3", "--warmup-calls", "1", "--device", "cpu", "--quiet", "-o", str(out)]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert sorted(p.name for p in out.iterdir()) == ["bench.png", "results.json", "results.md"]
    assert (out / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    results = json.loads((out / "results.json").read_text())
    assert set(results) == HEADER_KEYS
    assert results["workloads"] == ["prefill:1:70", "decode:2:9"]
    assert results["models"] == [str(teacher), str(pruned)] and results["device"] == "cpu"
    rows = results["results"]
    assert [(r["model"], r["workload"]) for r in rows] == [
        (str(teacher), "prefill:1:70"),
        (str(teacher), "decode:2:9"),
        (str(pruned), "prefill:1:70"),
        (str(pruned), "decode:2:9"),
    ]
    for row in rows:
        assert set(row) == RESULT_KEYS
        assert len(row["repeats"]) == 3 and row["seconds"] == sorted(row["repeats"])[1]
        tokens = 70 if row["phase"] == "prefill" else 2  # decode: one token per sequence per step
        assert row["tokens_per_second"] == pytest.approx(tokens / row["seconds"])
        assert row["ms_per_token"] == pytest.approx(1000 * row["seconds"] / tokens)
    first = {r["workload"]: r["seconds"] for r in rows[:2]}
    for row in rows:
        assert row["speedup"] == pytest.approx(first[row["workload"]] / row["seconds"])
    # the parameter counts are the loaded models' own, and the pruned model's GDN layer is its plan's
    assert [r["parameters"] for r in rows[::2]] == [sum(p.numel() for p in m.parameters()) for m in loaded]
    gdn = loaded[1].model.layers[0].linear_attn
    assert (gdn.num_k_heads, gdn.num_v_heads, gdn.head_k_dim, gdn.head_v_dim) == tuple(
        small.as_dict().values()
    )
    assert rows[2]["parameters"] < rows[0]["parameters"]
    table = (out / "results.md").read_text()
    assert (
        table.count("\n") == 2 + 4
        and "| teacher | prefill:1:70 |" in table
        and "| pruned | decode:2:9 |" in table
    )
    assert table.strip() in printed and "wrote" in printed


@pytest.mark.parametrize(
    "extra, says",
    [
        (["--workload", "prefill:1"], "--workload: expected PHASE:BATCH:CONTEXT"),
        (["--workload", "sample:1:8"], "phase: expected one of prefill, decode"),
        (["--workload", "decode:0:8"], "batch: expected an integer >= 1, got 0"),
        (["--workload", "decode:1:8", "--workload", "prefill:x:8"], "batch must be an integer"),
    ],
)
def test_malformed_workloads_exit_2_before_loading(folders, extra, says, capsys, monkeypatch):
    teacher, _, _ = folders
    monkeypatch.setattr(
        gdnprune.io.loading, "load_pretrained", lambda *a, **k: pytest.fail("a model was loaded")
    )
    assert main(["bench", str(teacher), *extra]) == 2
    err = capsys.readouterr().err
    assert says in err and err.count("\n") == 1 and err.startswith("gdnprune bench: error:")


def test_missing_model_folder_and_existing_output_exit_2(folders, tmp_path, capsys, monkeypatch):
    teacher, _, _ = folders
    monkeypatch.setattr(
        gdnprune.io.loading, "load_pretrained", lambda *a, **k: pytest.fail("a model was loaded")
    )
    missing = tmp_path / "nope"
    assert main(["bench", str(teacher), str(missing), "--workload", "prefill:1:8"]) == 2
    err = capsys.readouterr().err
    assert f"MODEL: expected a model folder (with config.json), found no such directory '{missing}'" in err
    assert err.count("\n") == 1
    out = tmp_path / "taken"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    assert main(["bench", str(teacher), "--workload", "prefill:1:8", "-o", str(out)]) == 2
    assert "already exists" in capsys.readouterr().err
    assert main(["bench", str(teacher), "--workload", "prefill:1:8", "-o", str(out), "--overwrite"]) == 2
    assert "not an earlier output" in capsys.readouterr().err
    assert (out / "keep.txt").read_text() == "mine"
