"""Scoring on many processes: torchrun with 2 gloo ranks, shares and their merge, and the helpers behind them.

The multi-process tests share one real ``torch.distributed.run`` launch (the code path of ``torchrun``; the
suite's one launch, a session fixture of ``suite.py`` shared with the other tests that read it:
``tests/launches.py``)
whose two workers run ``gdnprune score`` through the CLI four times and ``gdnprune plan``
once: projection, the plan's sensitivity, activation, a rank that fails with a user error, and a rank that
is stuck while the other one times out; each claim is its own test. Everything else runs in process.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from launches import SAMPLES, SEQ

from gdnprune.cli import main
from gdnprune.demo_data import train_text
from gdnprune.runtime.distributed import (
    RankFailedError,
    all_reduce_sum,
    exchange,
    fail_together,
    launch_info,
    local_gpus,
    shard_indices,
)
from gdnprune.scoring import load_partial, load_scores, merge_partials


@pytest.fixture(scope="module")
def model_dir(launch_model):
    return launch_model  # the shared launch's model (tests/launches.py)


@pytest.fixture(scope="module")
def text_file(launch_text):
    return launch_text


def _common(model_dir, *extra):
    return [
        "score",
        *([str(model_dir)] if model_dir else []),
        "--num-samples",
        str(SAMPLES),
        "--seq-len",
        str(SEQ),
        "--batch-size",
        "2",
        "--quiet",
        "--threads",
        "1",
        *extra,
    ]


@pytest.fixture(scope="module")
def single(model_dir, text_file, tmp_path_factory):
    """Single-process scores files of both methods (the reference)."""
    out = tmp_path_factory.mktemp("single")
    for method in ("projection", "activation"):
        assert (
            main(
                _common(
                    model_dir,
                    "--data",
                    str(text_file),
                    "--method",
                    method,
                    "--output",
                    str(out / f"{method}.json"),
                )
            )
            == 0
        )
    return {m: load_scores(out / f"{m}.json") for m in ("projection", "activation")}


def assert_same_scores(a: dict, b: dict) -> None:
    """Identical orders, raw scores within 1e-9 relative, the same token counts and settings."""
    assert list(a["layers"]) == list(b["layers"])
    for key in ("method", "num_tokens", "measures", "seed", "calibration"):
        assert a.get(key) == b.get(key), key
    for prefix, pa in a["layers"].items():
        pb = b["layers"][prefix]
        assert sorted(pa) == sorted(pb)
        for key, value in pa.items():
            if key.endswith("_scores"):
                x, y = torch.tensor(value, dtype=torch.float64), torch.tensor(pb[key], dtype=torch.float64)
                assert ((x - y).abs() <= 1e-9 * y.abs()).all(), (prefix, key)
            else:
                assert value == pb[key], (prefix, key)


# ---- helpers ------------------------------------------------------------------------------------------------


def test_shares_tile_the_items_in_order_and_differ_by_at_most_one():
    for n in (0, 1, 5, 7, 128):
        for world in (1, 2, 3, 8):
            shares = [shard_indices(n, r, world) for r in range(world)]
            assert [i for s in shares for i in s] == list(range(n))
            assert max(map(len, shares)) - min(map(len, shares)) <= 1
    assert shard_indices(5, 0, 2) == range(0, 3) and shard_indices(5, 1, 2) == range(3, 5)
    with pytest.raises(ValueError, match="0 <= rank < world"):
        shard_indices(4, 2, 2)


def test_launch_info_reads_torchrun_and_mpi_variables():
    assert launch_info({}) is None and launch_info({"WORLD_SIZE": "1", "RANK": "0"}) is None
    info = launch_info({"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"})
    assert (info.rank, info.world_size, info.local_rank, info.local_world_size) == (3, 4, 1, 2)
    info = launch_info(
        {"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2"}
    )  # accelerate's mpirun launch
    assert (info.rank, info.world_size, info.local_rank, info.local_world_size) == (1, 2, 1, 2)
    with pytest.raises(ValueError, match="no RANK"):
        launch_info({"WORLD_SIZE": "2"})
    with pytest.raises(ValueError, match=r"RANK='x': expected an integer"):
        launch_info({"WORLD_SIZE": "2", "RANK": "x"})
    with pytest.raises(ValueError, match=r"outside \[0, 2\)"):
        launch_info({"WORLD_SIZE": "2", "RANK": "2"})


def test_one_process_needs_no_group():
    x = torch.ones(3, dtype=torch.float64)
    assert all_reduce_sum([x])[0] is x and x.tolist() == [1.0, 1.0, 1.0]
    assert exchange("v") == ["v"] and local_gpus() is None
    with fail_together():
        pass
    with pytest.raises(KeyError):
        with fail_together():
            raise KeyError("raised as it is")
    error = RankFailedError(1, 2, "the data file is missing", user_error=True)
    assert str(error) == "rank 1 failed: the data file is missing" and error.user_error


# ---- shares and their merge -------------------------------------------------------------------------------------


@pytest.mark.parametrize("method", ["projection", "activation"])
def test_the_merge_of_every_share_equals_the_single_process_scores(
    method, model_dir, text_file, single, tmp_path
):
    parts = []
    for i in range(3):
        parts.append(tmp_path / f"part{i}.safetensors")
        assert (
            main(
                _common(
                    model_dir,
                    "--data",
                    str(text_file),
                    "--method",
                    method,
                    "--shard",
                    f"{i}/3",
                    "--partial",
                    str(parts[i]),
                )
            )
            == 0
        )
    meta, statistics = load_partial(parts[2])
    assert meta["shard"] == {"index": 2, "count": 3, "windows": [4, 5], "total_windows": SAMPLES}
    assert meta["model"]["config_sha256"] and len(meta["data"]["windows_sha256"]) == 64
    assert meta["calibration"] == {
        "num_samples": SAMPLES,
        "seq_len": SEQ,
        "seq_len_source": "given",
        "batch_size": 2,
        "dtype": "float32",
    }
    assert int(next(iter(statistics.layers.values())).stats["num_tokens"]) == SEQ
    out = tmp_path / "merged.json"
    assert main(["score", "--merge", *map(str, reversed(parts)), "--output", str(out), "--quiet"]) == 0
    merged = load_scores(out)
    assert_same_scores(merged, single[method])
    assert merged["world_size"] == 3 and merged["shards"] == 3


def test_a_merge_refuses_incomplete_overlapping_and_mismatched_sets(model_dir, text_file, tmp_path, capsys):
    def part(name, *extra, shard="0/2"):
        path = tmp_path / name
        assert (
            main(
                _common(
                    model_dir,
                    "--data",
                    str(text_file),
                    "--shard",
                    shard,
                    "--partial",
                    str(path),
                    "--method",
                    "activation",
                    *extra,
                )
            )
            == 0
        )
        return str(path)

    p0, p1 = part("p0", shard="0/2"), part("p1", shard="1/2")
    q1 = part("q1", "--seq-len", "64", shard="1/2")  # the last --seq-len wins
    r1 = part("r1", "--batch-size", "1", shard="1/2")
    s1 = part("s1", shard="1/3")
    other_text = tmp_path / "other.txt"
    other_text.write_text(train_text()[3000:6000], encoding="utf-8")
    d1 = str(tmp_path / "d1")
    assert (
        main(
            _common(
                model_dir,
                "--data",
                str(other_text),
                "--shard",
                "1/2",
                "--partial",
                d1,
                "--method",
                "activation",
            )
        )
        == 0
    )
    other_model = tmp_path / "other_model"
    shutil.copytree(model_dir, other_model)
    config = json.loads((other_model / "config.json").read_text())
    (other_model / "config.json").write_text(json.dumps({**config, "rms_norm_eps": 1e-5}))
    m1 = str(tmp_path / "m1")
    assert (
        main(
            _common(
                other_model,
                "--data",
                str(text_file),
                "--shard",
                "1/2",
                "--partial",
                m1,
                "--method",
                "activation",
            )
        )
        == 0
    )
    cases = [
        ([p0], "incomplete set of partials: share(s) 1 of 2 missing"),
        ([p0, p0], "overlapping partials"),
        ([p0, q1], "differ in calibration/seq_len: 64 vs 72"),
        ([p0, d1], "differ in calibration windows"),
        ([p0, m1], "differ in model configurations"),
        ([p0, r1], "differ in calibration/batch_size: 1 vs 2"),
        ([p0, s1], "differ in shard/count"),
        ([p0, str(text_file)], "not a safetensors file"),
    ]
    for files, expected in cases:
        assert main(["score", "--merge", *files, "--output", str(tmp_path / "m.json")]) == 2
        assert expected in capsys.readouterr().err, expected
    assert not (tmp_path / "m.json").exists()
    with pytest.raises(ValueError, match="differ in calibration windows"):
        merge_partials([p1, d1])
    assert main(["score", "--merge", p0, p1, "--output", str(tmp_path / "m.json"), "--quiet"]) == 0
    # a partial is not replaced without --overwrite
    assert main(_common(model_dir, "--data", str(text_file), "--shard", "0/2", "--partial", p0)) == 2
    assert "already exists" in capsys.readouterr().err


def test_score_says_which_options_go_together(model_dir, text_file, tmp_path, capsys):
    a, b = tmp_path / "a", tmp_path / "b"  # partial files that exist: the options are what is wrong
    a.write_text("{}")
    b.write_text("{}")
    a, b = str(a), str(b)
    cases = [
        (
            _common(model_dir, "--data", str(text_file), "--shard", "0/2", "--output", "x.json"),
            "give --partial FILE",
        ),
        (_common(model_dir, "--data", str(text_file), "--partial", "p", "--output", "x.json"), "not both"),
        (_common(model_dir, "--merge", a, b, "--output", "x.json"), "remove MODEL_DIR"),
        (_common(None, "--merge", a), "--merge needs --output"),
        (_common(None, "--data", str(text_file), "--output", "x.json"), "expected MODEL_DIR"),
        (_common(model_dir, "--output", "x.json"), "expected --data FILE"),
        (_common(model_dir, "--data", str(text_file)), "expected --output"),
    ]
    for argv, expected in cases:
        assert main(argv) == 2, argv
        assert expected in capsys.readouterr().err, expected
    for bad in ("2/2", "1", "a/b", "5/3", "0/0"):
        with pytest.raises(SystemExit):
            main(_common(model_dir, "--data", str(text_file), "--shard", bad, "--partial", "p"))
        assert "expected i/n" in capsys.readouterr().err


# ---- two real processes -----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def torchrun(launch):
    """The suite's one 2-process launch (tests/launches.py, shared with other tests): its folder, holding
    what each rank reported (``rank0.json``, ``rank1.json``) and what rank 0 wrote."""
    ranks = [launch.folder / f"rank{r}.json" for r in (0, 1)]
    assert all(p.exists() for p in ranks), launch.stderr[-3000:]
    return launch.folder


def _ranks(folder) -> list[dict]:
    return [json.loads((folder / f"rank{r}.json").read_text()) for r in (0, 1)]


@pytest.mark.slow
def test_two_processes_under_torchrun_equal_one(torchrun, single):
    ranks = _ranks(torchrun)
    # the results equal one process's; only rank 0 wrote them
    for method in ("projection", "activation"):
        assert ranks[0][method]["code"] == ranks[1][method]["code"] == 0 and ranks[1][method]["err"] == ""
        scores = load_scores(torchrun / f"{method}.json")
        assert scores["world_size"] == 2 and single[method]["world_size"] == 1
        assert_same_scores(scores, single[method])


@pytest.mark.slow
def test_the_plan_on_two_ranks_equals_one_process_on_the_same_windows(
    torchrun, model_dir, text_file, tmp_path
):
    ranks = _ranks(torchrun)
    # the plan: one file, written by rank 0, the same as one process measures on the same windows
    assert ranks[0]["plan"]["code"] == ranks[1]["plan"]["code"] == 0, ranks[0]["plan"]["err"]
    plan = json.loads((torchrun / "plan.json").read_text())
    report = json.loads((torchrun / "plan.sensitivity.json").read_text())
    alone = tmp_path / "alone.json"
    assert (
        main(
            [
                "plan",
                str(model_dir),
                "--scores",
                str(torchrun / "projection.json"),
                "--data",
                str(text_file),
                "--output",
                str(alone),
                "--budget-gdn-params",
                "0.5",
                "--dim-step",
                "1/2",
                "--num-samples",
                "4",
                "--seq-len",
                str(SEQ),
                "--batch-size",
                "1",
                "--quiet",
            ]
        )
        == 0
    )
    assert json.loads(alone.read_text())["layers"] == plan["layers"]
    single_report = json.loads((tmp_path / "alone.sensitivity.json").read_text())
    assert report["tokens"] == single_report["tokens"] == 4 * SEQ
    for prefix, layer in report["layers"].items():
        assert [c["sensitivity"] for c in layer["candidates"]] == pytest.approx(
            [c["sensitivity"] for c in single_report["layers"][prefix]["candidates"]], rel=1e-6, abs=1e-9
        )


@pytest.mark.slow
def test_a_user_error_on_one_rank_stops_both_with_its_message(torchrun):
    ranks = _ranks(torchrun)
    # a user error on rank 1 stops both ranks with its message, exit 2; nothing is written
    assert ranks[1]["failure"]["code"] == 2
    assert (
        "error: rank 1 of 2: " in ranks[1]["failure"]["err"] and "missing.txt" in ranks[1]["failure"]["err"]
    )
    assert ranks[0]["failure"]["code"] == 2
    assert "error: rank 0 of 2: rank 1 failed:" in ranks[0]["failure"]["err"]
    assert "missing.txt" in ranks[0]["failure"]["err"]
    assert not (torchrun / "failure.json").exists()


@pytest.mark.slow
def test_a_stuck_rank_makes_the_other_give_up_after_the_timeout(torchrun):
    ranks = _ranks(torchrun)
    # a stuck rank: the other one gives up after --dist-timeout instead of waiting forever
    assert ranks[0]["stuck"]["code"] == 1
    assert "rank 0 of 2: gave up waiting for the other ranks" in ranks[0]["stuck"]["err"]
    assert "did not answer within 3 s" in ranks[0]["stuck"]["err"]
    assert ranks[1]["stuck"]["code"] != 0
    assert not (torchrun / "stuck.json").exists()


def test_gpu_blocks_split_a_machine_by_local_rank():
    from gdnprune.runtime.distributed import gpu_block

    assert [gpu_block(r, 2, 8) for r in range(2)] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert [gpu_block(r, 3, 8) for r in range(3)] == [[0, 1], [2, 3, 4], [5, 6, 7]]
    with pytest.raises(ValueError, match="local rank 0 of 4 gets no GPU: only 2 GPU"):
        gpu_block(0, 4, 2)


def test_a_group_that_cannot_form_says_so_instead_of_hanging(
    monkeypatch, model_dir, text_file, tmp_path, capsys
):
    """Rank 0 of 2 alone: its store waits for rank 1, gives up after --dist-timeout, and the message says why."""
    import socket

    import torch.distributed as dist

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    argv = _common(
        model_dir, "--data", str(text_file), "--output", str(tmp_path / "s.json"), "--dist-timeout", "0.5"
    )
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert (
        "rank 0 could not form the process group of 2 processes at 127.0.0.1:" in err
        and "within 0.5 s" in err
    )
    assert not dist.is_initialized() and not (tmp_path / "s.json").exists()
    monkeypatch.delenv("MASTER_PORT")
    assert main(argv) == 2
    assert "needs MASTER_PORT in the environment" in capsys.readouterr().err
