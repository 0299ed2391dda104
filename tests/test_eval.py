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
import sys
from pathlib import Path

import pytest

from gdnprune import demo_data
from gdnprune.cli import main

lm_eval = pytest.importorskip("lm_eval")
from lm_eval.tasks import TaskManager  # noqa: E402

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

LIMIT = 6
DEMO = demo_data.demo_model_path()
#: a multiple-choice task the model can do better than chance on: which continuation is Python's
CHOICES = [
    ("def f(x):\n    return", [" x", " }"]),
    ("import os\nimport", [" sys", " ((("]),
    ("for i in range(10):\n   ", [" print(i)", " ]]]"]),
    ("class A:\n    def", [" __init__", " 123"]),
    ("The return value is", [" None", " zq"]),
    ("if x is", [" None", " ???"]),
    ("while True:\n    ", ["break", "}{"]),
    ("try:\n    pass\nexcept", [" ValueError", " 9"]),
]


def _mc_folder(root: Path, name: str = "python_mc", wrong: tuple[int, ...] = ()) -> Path:
    """A folder with the multiple-choice task ``name`` over :data:`CHOICES`, the nonsense choice labelled
    right in the rows ``wrong``."""
    folder = root / f"{name}_tasks"
    folder.mkdir()
    rows = [{"query": q, "choices": c, "label": int(i in wrong)} for i, (q, c) in enumerate(CHOICES)]
    data = folder / f"{name}.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    (folder / f"{name}.yaml").write_text(
        f"task: {name}\n"
        "dataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {str(data)!r}\n"
        "test_split: test\n"
        "output_type: multiple_choice\n"
        'doc_to_text: "{{query}}"\n'
        "doc_to_choice: choices\n"
        "doc_to_target: label\n"
        'target_delimiter: ""\n'
        "metric_list:\n  - metric: acc\n  - metric: acc_norm\n"
        "metadata:\n  version: 1.0\n",
        encoding="utf-8",
    )
    return folder


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
    return {"root": root, "text": text, "mc": _mc_folder(root), "het": het, "contained": contained}


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


# ---- what the user sees: the table, not lm-eval's chatter --------------------------------------------------


#: hook of a multiple-choice task that appends (rank, query) of each document it scores to $EVAL_RECORD
RECORD_HOOK = """import json, os


def process_results(doc, results):
    with open(os.environ["EVAL_RECORD"], "a") as f:
        f.write(json.dumps({"rank": int(os.environ.get("RANK", "0")), "query": doc["query"]}) + "\\n")
    best = max(range(len(results)), key=lambda i: results[i][0])
    return {"acc": float(best == doc["label"])}
"""
RECORD_YAML = """process_results: !function record.process_results
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
"""


def _cli(
    *argv: str, cwd: Path, launcher: tuple[str, ...] = (), record: Path | None = None
) -> subprocess.CompletedProcess:
    """``gdnprune`` in a process of its own (optionally under ``launcher``), from ``cwd``, one thread;
    ``record``: the file of :data:`RECORD_HOOK`."""
    env = {
        k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR")
    }
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(sys.path), HF_HUB_OFFLINE="1")
    env.update(HF_DATASETS_OFFLINE="1", EVAL_RECORD=str(record or cwd / "record.log"))
    command = [sys.executable, "-m", *launcher, *(["-m"] if launcher else []), "gdnprune", *argv]
    return subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)


# one `gdnprune eval -q` in a process of its own, outside a git repository: the quiet output's test reads it, and
# it is the one-process reference of the two-process run (5 documents per task; in mixed_mc the odd rows count
# the nonsense choice as right, and its hook records which rank scored each document)
EVAL_TASKS = "mixed_mc,passkey,mqar,nats_per_byte"


def _eval_args(inputs: dict[str, Path], mixed: Path) -> list[str]:
    args = ["eval", str(DEMO), "--tasks", EVAL_TASKS, "--context-lengths", "128"]
    args += ["--include-path", str(mixed), "--data", str(inputs["text"]), "--limit", "5"]
    return args + ["--batch-size", "2", "--threads", "1", "-q"]


@pytest.fixture(scope="module")
def mixed(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("mixed")
    folder = _mc_folder(root, "mixed_mc", wrong=(1, 3, 5, 7))
    (folder / "record.py").write_text(RECORD_HOOK, encoding="utf-8")
    yaml = (folder / "mixed_mc.yaml").read_text()
    yaml = yaml.replace("metric_list:\n  - metric: acc\n  - metric: acc_norm\n", "")
    (folder / "mixed_mc.yaml").write_text(yaml + RECORD_YAML, encoding="utf-8")
    return folder


@pytest.fixture(scope="module")
def one_process(inputs, mixed, tmp_path_factory) -> tuple[subprocess.CompletedProcess, Path]:
    """The run, and the folder it ran in (``one``: its output, ``1.log``: its record)."""
    cwd = tmp_path_factory.mktemp("one_process")
    done = _cli(*_eval_args(inputs, mixed), "-o", str(cwd / "one"), cwd=cwd, record=cwd / "1.log")
    return done, cwd


def test_quiet_eval_prints_the_table_and_nothing_else(one_process):
    done, cwd = one_process
    # outside a git repository lm-eval's run record would print git's "fatal: not a git repository"
    git = subprocess.run(["git", "describe", "--always"], cwd=cwd, capture_output=True, text=True)
    assert git.returncode != 0 and "not a git repository" in git.stderr
    assert done.returncode == 0, done.stderr
    assert done.stderr == ""
    assert done.stdout == (cwd / "one" / "results.md").read_text()
    assert done.stdout.splitlines()[0].startswith("| model | parameters |")


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
    bars = ("Loading weights", "Tokenizing inputs", "Running loglikelihood requests")
    assert any(s.startswith("Running loglikelihood requests") for s in shown)
    assert [s for s in shown if not s.startswith(bars)] == []


# ---- several processes, as lm-eval under accelerate launch -----------------------------------------------------


@pytest.mark.slow
def test_two_processes_under_torchrun_give_the_results_of_one(inputs, mixed, one_process, tmp_path):
    # rank 0 takes 3 documents per task, rank 1 takes 2 (lm-eval pads rank 1's share): mixed_mc's accuracy and
    # standard error would differ from one process's if a rank's documents were lost or scored twice
    launcher = ("torch.distributed.run", "--standalone", "--nproc_per_node", "2")
    args = _eval_args(inputs, mixed)
    two = _cli(*args, "-o", str(tmp_path / "two"), cwd=tmp_path, launcher=launcher, record=tmp_path / "2.log")
    assert two.returncode == 0, two.stderr[-3000:]
    one, one_dir = one_process
    assert one.returncode == 0, one.stderr[-3000:]
    # each rank scored its own share, and the two together every document once
    scored = [json.loads(line) for line in (tmp_path / "2.log").read_text().splitlines()]
    alone = [json.loads(line) for line in (one_dir / "1.log").read_text().splitlines()]
    assert sorted(r["rank"] for r in scored) == [0, 0, 0, 1, 1]
    assert sorted(r["query"] for r in scored) == sorted(r["query"] for r in alone)
    assert sorted(r["query"] for r in alone) == sorted(q for q, _ in CHOICES[:5])
    # rank 0 alone printed the table
    assert two.stdout == one.stdout == (tmp_path / "two" / "results.md").read_text()
    ours = json.loads((tmp_path / "two" / "results.json").read_text())["models"][0]["results"]
    single = json.loads((one_dir / "one" / "results.json").read_text())["models"][0]["results"]
    assert set(ours) == set(single) == {"mixed_mc", "passkey_128", "mqar_128", "nats_per_byte"}
    assert 0 < single["mixed_mc"]["acc,none"] < 1  # a standard error that depends on the count
    for task in ("mixed_mc", "passkey_128", "mqar_128"):
        assert _metrics(ours[task]) == _metrics(single[task])
    nats = ours["nats_per_byte"]["nats_per_byte,none"]
    assert nats == pytest.approx(single["nats_per_byte"]["nats_per_byte,none"], rel=1e-6)
