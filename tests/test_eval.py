"""``gdnprune eval`` against lm-eval run directly, and its errors.

References: lm-eval's own ``simple_evaluate`` with its own model loader (``model="hf"``, a path) on the same
task folder; for a per-layer model, the ``--self-contained`` copy loaded by lm-eval with
``trust_remote_code``. The models: the bundled byte-level demo model (uniform) and a per-layer slice of it.
"""

from __future__ import annotations

import json
import os
import shutil
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


def _mc_folder(root: Path) -> Path:
    folder = root / "mc_tasks"
    folder.mkdir()
    rows = [{"query": q, "choices": c, "label": 0} for q, c in CHOICES]
    data = folder / "python_mc.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    (folder / "python_mc.yaml").write_text(
        "task: python_mc\n"
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
