"""The pipeline at a published model's counts: Qwen3-Next-80B-A3B's 48 layers (36 GDN, 12 attention), 512
routed experts of which 10 per token, a shared expert and an MTP layer, at tiny widths (gdnprune.model.family;
75,944 tensors on disk, one per expert, as the released checkpoint stores them). One run of the CLI, shared by
the assertions: inspect, estimate and a dry run, score, sort (every expert's bytes moved to its rank), slice to
under half the parameters, the cut model loaded and run; distill under FSDP2 on 2 processes is a part of the
suite's shared launch (tests/launches.py, :func:`fsdp_distill`). Each forward of this model costs a second
here, so the suite keeps to these; benchmarks/scale.py runs the whole pipeline on every member (the plan's
search, eval and bench included) and measures what each stage costs."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import pytest
import torch
from launch_runs import SCALE_MEMBER as MEMBER
from launch_runs import STUDENT_EXPERTS

from gdnprune.cli import main
from gdnprune.io.loading import load_causal_lm, load_pretrained
from gdnprune.model.family import member

EXPERTS_KEPT = 200  # of 512: the routed experts hold 91 % of the parameters, so the cut keeps under half


def _run(*argv: str) -> tuple[int, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(argv))
    return code, out.getvalue() + err.getvalue()


@pytest.fixture(scope="module")
def run(launch_inputs, tmp_path_factory):
    """Every command once on the real-count model; returns the folders and each command's exit code and text."""
    root, out = launch_inputs / "scale", tmp_path_factory.mktemp("scale")
    model, calib = root / "model", root / "calib.txt"
    done = {"inspect": _run("inspect", str(model), "--json")}
    done["estimate"] = _run("estimate", str(model), "--stages", "score,plan,prune,distill")
    common = ["--data", str(calib), "--seq-len", "32", "--batch-size", "2", "--threads", "1", "-q"]
    done["dry"] = _run(
        "prune", str(model), "--budget-params", "0.5", "--dry-run", "-o", str(out / "x"), *common
    )
    done["score"] = _run("score", str(model), "--num-samples", "2", "-o", str(out / "scores.json"), *common)
    done["sort"] = _run(
        "sort", str(model), "--scores", str(out / "scores.json"), "-o", str(out / "sorted"), "-q"
    )
    done["slice"] = _run(
        "slice", str(out / "sorted"), "--num-experts", str(EXPERTS_KEPT), "-o", str(out / "sliced"), "-q"
    )
    # a plan of the GDN layers from the scores alone (the proxy sensitivity: the KL search costs minutes at this
    # depth, and benchmarks/scale.py runs it, every block cut, in `prune --budget-params 0.5`), its slice, eval, bench
    done["plan"] = _run(
        "plan", str(model), "--scores", str(out / "scores.json"), "--budget-gdn-params", "0.5", "--blocks", "gdn",
        "--sensitivity", "proxy", "--dim-step", "1/2", "-o", str(out / "plan.json"), *common,
    )  # fmt: skip
    done["slice_plan"] = _run(
        "slice", str(out / "sorted"), "--plan", str(out / "plan.json"), "-o", str(out / "planned"), "-q"
    )
    done["eval"] = _run(
        "eval", str(out / "planned"), "--tasks", "nats_per_byte", "--data", str(calib), "--limit", "1",
        "--context-lengths", "128", "--batch-size", "1", "--threads", "1", "-q", "-o", str(out / "eval"),
    )  # fmt: skip
    done["bench"] = _run(
        "bench", str(out / "planned"), "--workload", "prefill:1:16", "--repeats", "1", "--warmup-calls", "0",
        "--device", "cpu", "--threads", "1", "-q", "-o", str(out / "bench"),
    )  # fmt: skip
    return {"root": root, "out": out, "done": done}


def test_every_command_runs_at_the_real_counts(run):
    failed = {k: text[-2000:] for k, (code, text) in run["done"].items() if code != 0}
    assert not failed


def test_inspect_sees_every_layer_and_expert(run):
    info = json.loads(run["done"]["inspect"][1])
    real = member(MEMBER).values
    assert len(info["decoder_layers"]) == real["num_hidden_layers"] == 48
    experts = [b for b in info["sub_blocks"] if b.get("kind") == "experts"]
    assert len(experts) == 48 and {b["num_experts"] for b in experts} == {512}
    assert len(info["layers"]) == 36  # GDN layers, three in four
    assert "mtp." in info["passthrough"] or info["parameters_by_kind"]["other"] > 0


def test_estimate_and_the_dry_run_answer_without_loading(run):
    estimate, dry = run["done"]["estimate"][1], run["done"]["dry"][1]
    assert "75,944 tensors, 48 layers, 24,576 routed experts" in estimate
    for stage in ("score", "plan", "prune", "distill"):
        assert f"\n  {stage} " in estimate
    assert "\n  prune " in dry and not (run["out"] / "x").exists()


def test_sort_moves_every_expert_and_slice_keeps_under_half(run):
    from safetensors import safe_open

    out = run["out"]
    scores = json.loads((out / "scores.json").read_text())
    index = json.loads((run["root"] / "model" / "model.safetensors.index.json").read_text())["weight_map"]
    sorted_index = json.loads((out / "sorted" / "model.safetensors.index.json").read_text())["weight_map"]

    def tensor(folder, weight_map, name):
        with safe_open(str(folder / weight_map[name]), "pt") as f:
            return f.get_tensor(name)

    for layer in (0, 47):  # the first and the last layer: expert i of the sorted model is the order's i-th
        prefix = f"model.layers.{layer}.mlp"
        order = scores["layers"][prefix]["expert_order_most_important_first"]
        for i in (0, 1, 511):
            a = tensor(out / "sorted", sorted_index, f"{prefix}.experts.{i}.down_proj.weight")
            b = tensor(run["root"] / "model", index, f"{prefix}.experts.{order[i]}.down_proj.weight")
            assert torch.equal(a, b)
    full = sum(t.numel for t in _tensors(run["root"] / "model"))
    sliced = load_causal_lm(out / "sliced")  # an MoE folder: read by sharded loading's reader
    assert sum(p.numel() for p in sliced.parameters()) <= 0.5 * full
    assert all(layer.mlp.experts.gate_up_proj.shape[0] == EXPERTS_KEPT for layer in sliced.model.layers)
    with torch.no_grad():
        assert torch.isfinite(sliced(torch.tensor([list(b"the model sorts heads")])).logits).all()


def _tensors(folder: Path):
    from gdnprune.estimate.inventory import model_facts

    return [t for t in model_facts(folder).tensors if not t.name.startswith("mtp.")]


def test_distill_under_fsdp2_on_two_processes(launch, launch_inputs):
    """:func:`fsdp_distill`, a part of the suite's shared launch."""
    root = launch_inputs / "scale"
    record = root / "distill.json"
    assert record.exists() and json.loads(record.read_text())["code"] == 0, launch.stderr[-4000:]
    student = load_pretrained(root / "distilled")
    teacher_experts = json.loads((root / "model" / "config.json").read_text())["num_experts"]
    assert teacher_experts == 512 and student.config.num_experts == STUDENT_EXPERTS
    assert len(student.model.layers) == 48


def test_plan_slice_eval_and_bench_at_the_real_counts(run):
    """The plan keeps at most half of the GDN parameters, counted on the planned folder's loaded modules against
    the files' headers; eval and bench measure the planned model."""
    out = run["out"]
    gdn = [t.numel for t in _tensors(run["root"] / "model") if ".linear_attn." in t.name]
    planned = load_causal_lm(out / "planned")
    assert len(planned.model.layers) == 48
    kept = [p.numel() for n, p in planned.named_parameters() if ".linear_attn." in n]
    assert len(kept) == len(gdn) and sum(kept) <= 0.5 * sum(gdn)
    results = json.loads((out / "eval" / "results.json").read_text())
    nats = results["models"][0]["results"]["nats_per_byte"]["nats_per_byte,none"]
    assert 0 < nats < 20
    assert list((out / "bench").glob("*.json"))
