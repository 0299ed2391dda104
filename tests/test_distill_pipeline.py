"""`prune --budget-params` then `distill`, as a user runs them, on every trained tiny family (uniform and
per-layer students, dense and MoE), and resume after an interruption equals the uninterrupted run (one
process on every family; DDP and FSDP2 on the MoE student, loaded straight into its shards under FSDP2)."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest
import torch
from launch_runs import prune_args
from safetensors.torch import load_file, save_file
from transformers import TrainerCallback

from gdnprune import load_pretrained
from gdnprune.cli import main
from gdnprune.demo_data import train_text
from gdnprune.distill import DistillConfig, distill_checkpoint
from gdnprune.distill.output import CheckpointKeysError, load_model_weights
from gdnprune.distill.trainer import freeze_outside_text


@pytest.fixture(scope="module", autouse=True)
def _data_cache(tmp_path_factory):
    """The tokenised corpora of these tests go to a temporary folder, not the user's datasets cache."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("GDNPRUNE_DATA_CACHE", str(tmp_path_factory.mktemp("data_cache")))
        yield


TRAINED = Path(__file__).parent / "data" / "trained"
FAMILIES = sorted(p.name for p in TRAINED.iterdir() if (p / "config.json").is_file())
MOE = "qwen3_5_moe"


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    folder = tmp_path_factory.mktemp("pipeline")
    (folder / "train.txt").write_text(train_text()[:20000])
    return folder


@pytest.fixture(scope="module")
def pruned(root, launch_inputs):
    """``pruned(family, uniform)``: the folder `gdnprune prune --budget-params 0.5` writes (built once)."""
    made: dict[tuple[str, bool], Path] = {}

    def get(family: str, uniform: bool) -> Path:
        # the per-layer MoE student: the shared launch's (tests/launches.py), the same prune
        if family == MOE and not uniform:
            return launch_inputs / "pipeline_moe" / "student"
        if (family, uniform) not in made:
            out = root / f"{family}_{'uniform' if uniform else 'layers'}"
            args = prune_args(family, root / "train.txt", out)
            assert main(args + (["--uniform"] if uniform else [])) == 0
            made[family, uniform] = out
        return made[family, uniform]

    return get


def _per_layer(folder: Path) -> dict | None:
    config = json.loads((folder / "config.json").read_text())
    return config.get("per_layer_config") or config.get("text_config", {}).get("per_layer_config")


@pytest.mark.parametrize("uniform", [False, True], ids=["per_layer", "uniform"])
@pytest.mark.parametrize("family", FAMILIES)
def test_distill_runs_on_what_prune_with_a_whole_model_budget_writes(
    family, uniform, pruned, root, tmp_path, capsys
):
    student = pruned(family, uniform)
    assert (_per_layer(student) is None) == uniform  # the case asked for: one geometry, or one per layer

    def args(out: Path, *extra: str) -> list[str]:
        return [
            "distill", str(student), "--teacher", str(TRAINED / family), "--data", str(root / "train.txt"),
            "-o", str(out), "--batch-size", "2", "--seq-len", "32", "--num-samples", "4", *extra,
        ]  # fmt: skip

    out = tmp_path / "out"
    assert main(args(out, "--steps", "2")) == 0
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err and "expected peak memory per process" in captured.out
    assert _per_layer(out) == _per_layer(student)
    shapes = {k: tuple(v.shape) for k, v in load_pretrained(student).state_dict().items()}
    assert {k: tuple(v.shape) for k, v in load_pretrained(out).state_dict().items()} == shapes
    assert main(args(tmp_path / "quiet", "--steps", "1", "--quiet")) == 0


class _StopAt(TrainerCallback):
    """Ctrl-C at the end of step ``step`` (the run saves a checkpoint there and returns)."""

    def __init__(self, step: int):
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            signal.raise_signal(signal.SIGINT)


def _run(student: Path, teacher: Path, data: Path, out: Path, callbacks=(), **extra):
    options = dict(steps=4, batch_size=2, lr=3e-3, lm_weight=0.3, save_every=10, log_every=1, progress=False)
    config = DistillConfig(output_dir=out, **{**options, **extra})
    return distill_checkpoint(student, teacher, data, config, seq_len=32, num_samples=8, callbacks=callbacks)


def _logged(folder: Path) -> list[float]:
    return [
        h["loss"] for h in json.loads((folder / "distill_log.json").read_text())["history"] if "loss" in h
    ]


def _weights(folder: Path) -> dict[str, torch.Tensor]:
    return load_file(folder / "model.safetensors")


@pytest.mark.parametrize("family", FAMILIES)
def test_resume_after_ctrl_c_equals_the_uninterrupted_run(family, pruned, root, tmp_path):
    student, teacher, data = pruned(family, False), TRAINED / family, root / "train.txt"
    straight = _run(student, teacher, data, tmp_path / "straight")
    stopped = _run(student, teacher, data, tmp_path / "run", callbacks=[_StopAt(2)])
    assert stopped["interrupted"] and stopped["steps"] == 2
    resumed = _run(student, teacher, data, tmp_path / "run", resume=True)
    assert resumed["resumed_from"].endswith("checkpoint-2") and resumed["steps"] == 4
    losses = [[h["loss"] for h in r["history"] if "loss" in h] for r in (straight, resumed)]
    assert losses[0] == losses[1]
    a, b = _weights(tmp_path / "straight"), _weights(tmp_path / "run")
    assert a.keys() == b.keys()
    for name, value in a.items():
        assert torch.equal(b[name], value), name


def test_checkpoint_weights_load_in_either_form_and_any_other_key_is_an_error(pruned, tmp_path):
    """A model with fused experts reads its own tensors and save_pretrained's one tensor per expert alike."""
    model = load_pretrained(pruned(MOE, False), dtype=torch.float32)
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    assert any(k.endswith("experts.gate_up_proj") for k in expected)  # fused in memory
    own, saved = tmp_path / "own", tmp_path / "saved"
    own.mkdir()
    save_file({k: v for k, v in expected.items() if k != "lm_head.weight"}, own / "model.safetensors")
    model.save_pretrained(saved)
    assert any(".experts.0.gate_proj." in k for k in load_file(saved / "model.safetensors"))  # per expert
    for folder in (own, saved):
        fresh = load_pretrained(pruned(MOE, False), dtype=torch.float32)
        with torch.no_grad():
            for p in fresh.parameters():
                p.zero_()
        load_model_weights(fresh, folder)
        for name, value in fresh.state_dict().items():
            assert torch.equal(value, expected[name]), (folder.name, name)
    broken = tmp_path / "broken"
    broken.mkdir()
    tensors = load_file(saved / "model.safetensors")
    dropped = next(k for k in tensors if ".experts.1.down_proj" in k)
    save_file({k: v for k, v in tensors.items() if k != dropped} | {"extra.weight": torch.zeros(2)},
              broken / "model.safetensors")  # fmt: skip
    with pytest.raises(
        CheckpointKeysError, match=r"1 missing \(.*experts\.1\.down_proj.*1 unexpected \(extra"
    ):
        load_model_weights(model, broken)


def test_a_vision_language_student_trains_its_text_part_only():
    """The vision tower, which text windows never reach, is frozen: the optimizer then holds state for every
    parameter it steps, as an FSDP2 resume needs (a VL student's resume failed on the vision tower's missing
    AdamW state); a text model keeps every parameter trainable."""
    vl = load_pretrained(TRAINED / "qwen3_5_vl", dtype=torch.float32)
    freeze_outside_text(vl)
    frozen = {n for n, p in vl.named_parameters() if not p.requires_grad}
    assert frozen and frozen == {n for n, _ in vl.named_parameters() if n.startswith("model.visual.")}
    moe = load_pretrained(TRAINED / MOE, dtype=torch.float32)
    freeze_outside_text(moe)
    assert all(p.requires_grad for p in moe.parameters())


def test_resume_of_an_moe_student_under_ddp_and_fsdp2_equals_the_uninterrupted_run(launch, launch_inputs):
    """The runs of :func:`moe_resume`, a part of the suite's shared launch."""
    root = launch_inputs / "pipeline_moe"
    assert (root / "fsdp" / "run" / "model.safetensors").exists(), launch.stderr[-4000:]
    for engine in ("ddp", "fsdp"):
        a, b = (
            load_pretrained(root / engine / d, dtype=torch.float32).state_dict() for d in ("straight", "run")
        )
        for name, value in a.items():
            torch.testing.assert_close(b[name], value, rtol=1e-5, atol=1e-6, msg=f"{engine} {name}")
