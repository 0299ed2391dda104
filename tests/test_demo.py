"""The demo pipeline end to end on the bundled model, on a reduced budget."""

import json

from gdnprune.cli import main
from gdnprune.demo import nested_targets
from gdnprune.gated_delta_net import GDNShape


def test_nested_targets_shrink_every_axis_and_are_nested():
    shape = GDNShape(4, 8, 32, 32)
    targets = nested_targets(shape)
    assert targets[0] == shape
    for big, small in zip(targets, targets[1:]):
        assert small != big
        for axis in ("num_key_heads", "value_heads_per_group", "key_head_dim", "value_head_dim"):
            assert getattr(small, axis) <= getattr(big, axis)
    last = targets[-1]
    assert all(getattr(last, a) < getattr(shape, a) for a in ("num_key_heads", "num_value_heads", "key_head_dim",
                                                               "value_head_dim"))


def test_demo_runs_end_to_end(tmp_path, capsys):
    out = tmp_path / "demo"
    code = main(["demo", "--output", str(out), "--calibration-windows", "8", "--num-random", "2",
                 "--validation-windows", "4", "--seq-len", "128", "--quiet"])
    assert code == 0
    results = json.loads((out / "results.json").read_text())
    assert results["sort_max_abs_logit_diff"] < 1e-4
    rows = results["rows"]
    assert len(rows) >= 6
    full = rows[0]["loss"]
    # unpruned: every ordering is the same model
    assert abs(full["importance"] - full["identity"]) < 1e-6 and abs(full["importance"] - full["random"]) < 1e-6
    # kept parameters shrink along the chain and cutting costs loss
    assert [r["gdn_params"] for r in rows] == sorted((r["gdn_params"] for r in rows), reverse=True)
    assert rows[-1]["loss"]["importance"] > full["importance"] + 0.5
    assert (out / "loss_vs_params.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    for name in ("sorted", "sliced"):
        assert (out / name / "config.json").is_file() and (out / name / "gdnprune.json").is_file()
    printed = capsys.readouterr().out
    assert "importance" in printed and "identity" in printed and "random" in printed
