"""``gdnprune eval`` against lm-eval run directly, and its errors.

References: lm-eval's own ``simple_evaluate`` with its own model loader (``model="hf"``, a path) on the same
task folder; for a per-layer model, the ``--self-contained`` copy loaded by lm-eval with
``trust_remote_code``. The models: the bundled byte-level demo model (uniform) and a per-layer slice of it.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
from helpers import CHOICES, mc_folder
from launches import FreshRun, fresh_process, shared_folder

from gdnprune import demo_data
from gdnprune.cli import main

lm_eval = pytest.importorskip("lm_eval")
from lm_eval.tasks import TaskManager  # noqa: E402

pytestmark = pytest.mark.usefixtures("no_environment_report")

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

LIMIT = 6
DEMO = demo_data.demo_model_path()


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("eval")
    text = root / "val.txt"
    text.write_text(demo_data.validation_text()[: 256 * 5], encoding="utf-8")
    plan = root / "plan.json"
    plan.write_text(
        json.dumps(
            {
                "format": "gdnprune-plan",
                "version": 1,
                "layers": {
                    "model.layers.0.linear_attn": {"num_value_heads": 4},
                    "model.layers.2.linear_attn": {"key_head_dim": 16, "value_head_dim": 16},
                },
            }
        )
    )
    het, contained = root / "het", root / "het_contained"
    for out, extra in ((het, []), (contained, ["--self-contained"])):
        code = main(["slice", str(DEMO), "--plan", str(plan), "-o", str(out), "--quiet", *extra])
        assert code == 0
    return {"root": root, "text": text, "mc": mc_folder(root), "het": het, "contained": contained}


def _direct(path: Path, tasks: list[str], folders: list[Path], **model_args) -> dict:
    """lm-eval alone: its own loader of the folder, its own TaskManager."""
    manager = TaskManager(include_path=[str(f) for f in folders], include_defaults=False)
    out = lm_eval.simple_evaluate(
        model="hf",
        model_args={"pretrained": str(path), "dtype": "float32", "device": "cpu", **model_args},
        tasks=tasks,
        task_manager=manager,
        batch_size=4,
        limit=LIMIT,
        log_samples=False,
        random_seed=0,
        numpy_random_seed=0,
        torch_random_seed=0,
        fewshot_random_seed=0,
    )
    return out["results"]


def _gdnprune(models: list[Path], out: Path, tasks: str, *extra: str) -> dict:
    args = ["eval", *map(str, models), "--tasks", tasks, "-o", str(out), "--limit", str(LIMIT)]
    code = main([*args, "--batch-size", "4", "--device", "cpu", "--quiet", *extra])
    assert code == 0
    return json.loads((out / "results.json").read_text())


def _metrics(results: dict) -> dict:
    return {k: v for k, v in results.items() if k not in ("alias", "name", "sample_len")}


def test_eval_of_a_uniform_model_equals_lm_eval_run_directly(inputs, capsys):
    out = inputs["root"] / "uniform"
    report = _gdnprune(
        [DEMO],
        out,
        "python_mc,nats_per_byte",
        "--include-path",
        str(inputs["mc"]),
        "--data",
        str(inputs["text"]),
    )
    ours = report["models"][0]["results"]
    direct = _direct(DEMO, ["python_mc", "nats_per_byte"], [inputs["mc"], out / "tasks"])
    assert _metrics(ours["python_mc"]) == _metrics(direct["python_mc"])
    assert ours["nats_per_byte"]["nats_per_byte,none"] == direct["nats_per_byte"]["nats_per_byte,none"]
    assert ours["python_mc"]["acc,none"] > 0.5  # the trained model prefers Python: the task measures it
    printed = capsys.readouterr().out
    assert "| demo_model | 898,512 | 898,512 |" in printed and "python_mc acc" in printed
    assert (out / "results.md").read_text() in printed
    assert report["models"][0]["parameters"] == 898_512


def test_eval_of_a_per_layer_model_equals_its_self_contained_copy_in_lm_eval(inputs):
    config = json.loads((inputs["het"] / "config.json").read_text())
    assert config.get("per_layer_config")  # the model really is heterogeneous
    out = inputs["root"] / "het_eval"
    report = _gdnprune(
        [inputs["het"]],
        out,
        "python_mc,nats_per_byte",
        "--include-path",
        str(inputs["mc"]),
        "--data",
        str(inputs["text"]),
    )
    ours = report["models"][0]["results"]
    direct = _direct(
        inputs["contained"],
        ["python_mc", "nats_per_byte"],
        [inputs["mc"], out / "tasks"],
        trust_remote_code=True,
    )
    assert _metrics(ours["python_mc"]) == _metrics(direct["python_mc"])
    assert ours["nats_per_byte"]["nats_per_byte,none"] == direct["nats_per_byte"]["nats_per_byte,none"]
    full = json.loads((inputs["root"] / "uniform" / "results.json").read_text())["models"][0]
    assert report["models"][0]["parameters"] < full["parameters"]


def _expect_exit_2(args: list[str], capsys, *words: str) -> None:
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    for word in words:
        assert word in err, err


def test_the_table_marks_a_recall_drop_beyond_its_standard_error():
    """A probe cell below the first model's by more than hypot(its stderr, the first's) gets the mark; a
    smaller drop, a rise and any other metric do not."""
    from gdnprune.evaluation.report import DROP, ModelResult, markdown_table

    def row(name, acc, se, nats):
        results = {
            "passkey_256": {"acc,none": acc, "acc_stderr,none": se},
            "needle_256_50": {"acc,none": acc},
            "nats_per_byte": {"nats_per_byte,none": nats},
        }
        return ModelResult("", name, 1, 1, results)

    rows = [row("teacher", 0.9, 0.03, 1.0), row("cut", 0.8, 0.04, 3.0), row("near", 0.86, 0.04, 1.0)]
    lines = markdown_table(rows).splitlines()
    cut, near = lines[3], lines[4]
    assert cut.count(DROP) == 2  # 0.1 > hypot(0.03, 0.04) = 0.05; the needle without stderr: 0.1 > 0
    assert near.count(DROP) == 1  # 0.04 < 0.05, but the needle's 0.04 > 0
    assert DROP not in lines[2] and lines[-1].startswith(f"{DROP}: recall below teacher's")
    assert DROP not in markdown_table([rows[0], row("better", 1.0, 0.0, 9.0)])


def test_eval_runs_the_needle_grid_and_the_ruler_tasks_at_lengths_from_the_models_positions(inputs):
    """No --context-lengths: the demo model's 256 positions give 128 and 256 characters (a byte tokenizer:
    one character a token); the grid is drawn as needle.png, one panel per model."""
    out = inputs["root"] / "needles"
    report = _gdnprune([DEMO, inputs["het"]], out, "needle,multikey,vartrack,passkey", "--limit", "2")
    tasks = set(report["models"][1]["results"])
    expected = {f"needle_{n}_{d}" for n in (128, 256) for d in (0, 25, 50, 75, 100)}
    assert expected | {"multikey_256", "vartrack_256", "passkey_128", "passkey_256"} <= tasks
    assert not any(t.endswith("_1024") or t.startswith("multikey_128") for t in tasks)
    assert (out / "needle.png").stat().st_size > 1000


def test_bad_inputs_exit_2_with_one_line(inputs, capsys):
    root = inputs["root"]
    base = ["eval", str(DEMO), "-o", str(root / "never")]
    _expect_exit_2(
        [*base, "--tasks", "passkey", "--context-lengths", "256,1024"],
        capsys,
        "--context-lengths",
        "1024",
        "max_position_embeddings",
        "256",
    )
    _expect_exit_2(
        [*base, "--tasks", "python_mc", "--include-path", str(inputs["text"])],
        capsys,
        "--include-path",
        "not a folder",
    )
    empty = root / "empty"
    empty.mkdir()
    _expect_exit_2(
        [*base, "--tasks", "python_mc", "--include-path", str(empty)], capsys, "--include-path", "no .yaml"
    )
    _expect_exit_2([*base, "--tasks", "nats_per_byte"], capsys, "--data")
    broken = root / "broken"
    shutil.copytree(DEMO, broken)
    (broken / "model.safetensors").write_bytes(b"not safetensors")
    _expect_exit_2(
        ["eval", str(broken), "-o", str(root / "never"), "--tasks", "passkey", "--context-lengths", "256"],
        capsys,
        "broken",
        "does not load",
    )
    _expect_exit_2(
        [
            "eval",
            str(root / "nowhere"),
            "-o",
            str(root / "never"),
            "--tasks",
            "passkey",
            "--context-lengths",
            "256",
        ],
        capsys,
        "nowhere",
        "config.json",
    )
    assert not (root / "never").exists()


def test_an_unknown_task_names_the_closest_known_ones(inputs, capsys):
    _expect_exit_2(
        [
            "eval",
            str(DEMO),
            "-o",
            str(inputs["root"] / "never"),
            "--tasks",
            "paskey",
            "--context-lengths",
            "256",
        ],
        capsys,
        "unknown task 'paskey'",
        "passkey",
    )


def test_declared_names_read_each_way_a_yaml_names_a_task(tmp_path):
    """Names given as a value, quoted, as a flow list, as a block list, as group members (``- task:``), in a
    template without ``.yaml``; lm-eval's own index of the folder holds no name outside them."""
    from lm_eval.tasks._index import TaskIndex

    from gdnprune.evaluation.api import declared_names

    (tmp_path / "a.yaml").write_text(
        "task: alpha\ntag:\n  - t_one\n  # a comment\n  - t_two\nmetric_list: []\n"
    )
    (tmp_path / "b.yaml").write_text('"task": "beta"\n"dataset_name": "x"\ntag: [t_three, "t_four"]\n')
    (tmp_path / "g.yaml").write_text(
        "group: gamma\ntask:\n  - task: delta\n    include: _template\n  - epsilon\naggregate_metric_list: []\n"
    )
    (tmp_path / "_template").write_text("tag: t_five  # from the template\noutput_type: loglikelihood\n")
    (tmp_path / "notes.md").write_text("task: not_a_task\n")
    expected = {"alpha", "beta", "gamma", "delta", "epsilon", "t_one", "t_two", "t_three", "t_four", "t_five"}
    assert declared_names(tmp_path) == expected
    assert set(TaskIndex.build([tmp_path])) <= expected


def test_declared_names_hold_every_name_lm_evals_index_finds(tmp_path):
    """Against lm-eval's index (its YAML parser, includes resolved) of every 12th folder of its tasks: an
    unknown name is refused without indexing lm-eval's 14,000 task files, so no real task may be missing."""
    import lm_eval.tasks
    from lm_eval.tasks._index import TaskIndex

    from gdnprune.evaluation.api import declared_names

    root = Path(lm_eval.tasks.__file__).parent
    folders = sorted(p for p in root.iterdir() if p.is_dir() and p.name != "__pycache__")[::12]
    indexed = set(TaskIndex.build(folders))
    assert len(indexed) > 100
    assert indexed <= declared_names(root)


# ---- what the user sees: the table, not lm-eval's chatter --------------------------------------------------


# `gdnprune eval -q` in a new process, outside a git repository, with the arguments of the shared launch's eval on
# two ranks (tests/launches.py): the second command of the suite's one fresh process (:func:`fresh_process`),
# the first there to import lm-eval; the quiet output's test reads it, and it is the one-process reference of the
# two-process run


@pytest.fixture(scope="module")
def one_process(launch_inputs, tmp_path_factory) -> tuple[FreshRun, Path]:
    """The run, and the folder it ran in (``one``: its output, ``1.log``: its record)."""
    runs, cwd = fresh_process(shared_folder(tmp_path_factory), launch_inputs)
    return runs["eval -q"], cwd


def test_quiet_eval_prints_the_table_and_nothing_else(one_process):
    done, cwd = one_process
    # outside a git repository lm-eval's run record would print git's "fatal: not a git repository"
    git = subprocess.run(["git", "describe", "--always"], cwd=cwd, capture_output=True, text=True)
    assert git.returncode != 0 and "not a git repository" in git.stderr
    assert done.code == 0, done.err
    assert done.err == ""
    assert done.out == (cwd / "one" / "results.md").read_text()
    assert done.out.splitlines()[0].startswith("| model | parameters |")


def test_eval_shows_only_its_table_and_the_request_bars(inputs, capsys):
    out = inputs["root"] / "bars"
    args = ["eval", str(DEMO), "--tasks", "passkey,nats_per_byte", "--context-lengths", "128", "-o", str(out)]
    assert main([*args, "--data", str(inputs["text"]), "--limit", "2", "--threads", "1"]) == 0
    captured = capsys.readouterr()
    assert captured.out == (out / "results.md").read_text() + (
        f"wrote {out}: results.json, results.md, results.png, tasks/\n"
    )
    # lm-eval builds each task's requests under a bar without a name, and logs notes per task: neither shows
    shown = [part.strip() for part in captured.err.replace("\r", "\n").splitlines() if part.strip()]
    bars = ("Tokenizing inputs", "Running loglikelihood requests")  # transformers' "Loading weights": none
    assert any(s.startswith("Running loglikelihood requests") for s in shown)
    assert [s for s in shown if not s.startswith(bars)] == []


# ---- several processes, as lm-eval under accelerate launch -----------------------------------------------------


@pytest.mark.slow
def test_two_processes_under_torchrun_give_the_results_of_one(launch, one_process):
    """The shared launch's eval (tests/launches.py) on two ranks: rank 0 takes 3 documents per task, rank 1
    takes 2 (lm-eval pads rank 1's share); mixed_mc's accuracy and standard error would differ from one
    process's if a rank's documents were lost or scored twice."""
    ranks = [json.loads((launch.folder / f"rank{r}.json").read_text())["eval"] for r in (0, 1)]
    assert ranks[0]["code"] == ranks[1]["code"] == 0, ranks[0]["err"][-3000:] + ranks[1]["err"][-3000:]
    one, one_dir = one_process
    assert one.code == 0, one.err[-3000:]
    # each rank scored its own share, and the two together every document once
    scored = [json.loads(line) for line in (launch.folder / "eval.log").read_text().splitlines()]
    alone = [json.loads(line) for line in (one_dir / "1.log").read_text().splitlines()]
    assert sorted(r["rank"] for r in scored) == [0, 0, 0, 1, 1]
    assert sorted(r["query"] for r in scored) == sorted(r["query"] for r in alone)
    assert sorted(r["query"] for r in alone) == sorted(q for q, _ in CHOICES[:5])
    # rank 0 alone printed the table
    assert (
        ranks[1]["out"] == ""
        and ranks[0]["out"] == one.out == (launch.folder / "eval" / "results.md").read_text()
    )
    ours = json.loads((launch.folder / "eval" / "results.json").read_text())["models"][0]["results"]
    single = json.loads((one_dir / "one" / "results.json").read_text())["models"][0]["results"]
    assert set(ours) == set(single) == {"mixed_mc", "passkey_128", "mqar_128", "nats_per_byte"}
    assert 0 < single["mixed_mc"]["acc,none"] < 1  # a standard error that depends on the count
    for task in ("mixed_mc", "passkey_128", "mqar_128"):
        assert _metrics(ours[task]) == _metrics(single[task])
    nats = ours["nats_per_byte"]["nats_per_byte,none"]
    assert nats == pytest.approx(single["nats_per_byte"]["nats_per_byte,none"], rel=1e-6)
