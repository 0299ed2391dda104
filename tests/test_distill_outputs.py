"""What a distillation run writes and says: the DistillConfig form and the older keyword form, the real last
train loss and the mean of the last logging window, the output in the student's own dtype, checkpoints
removed unless kept, a full disk, the host memory of the estimate, a corpus too small for one step."""

from __future__ import annotations

import errno
import json
import shutil
import signal
import subprocess
import warnings
from pathlib import Path

import pytest
import torch
from helpers import pair, windows
from safetensors import safe_open
from transformers import TrainerCallback

from gdnprune.cli import main
from gdnprune.demo_data import train_text
from gdnprune.distill import DiskFullError, DistillConfig, distill
from gdnprune.distill.records import DiskFullGuard


@pytest.fixture(scope="module", autouse=True)
def _data_cache(tmp_path_factory):
    """The tokenised corpora of these tests go to a temporary folder, not the user's datasets cache."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("GDNPRUNE_DATA_CACHE", str(tmp_path_factory.mktemp("data_cache")))
        yield


FAMILY = Path(__file__).parent / "data" / "trained" / "olmo_hybrid"  # stored in bfloat16


def _weights(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_the_config_form_and_the_older_keyword_form_train_the_same_and_the_older_one_warns(tmp_path):
    options = dict(steps=3, batch_size=4, lr=3e-3, lm_weight=0.3, log_every=1, progress=False)
    teacher, student = pair()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the new form warns of nothing
        new = distill(student, teacher, windows(8), DistillConfig(**options))
    teacher_old, student_old = pair()
    with pytest.warns(FutureWarning, match="pass the options as one DistillConfig"):
        old = distill(student_old, teacher_old, windows(8), None, **options)
    assert [h["loss"] for h in new["history"] if "loss" in h] == [
        h["loss"] for h in old["history"] if "loss" in h
    ]
    a, b = _weights(student), _weights(student_old)
    assert all(torch.equal(a[k], b[k]) for k in a)
    with pytest.raises(TypeError):
        distill(student, teacher, windows(8), None, steps=1, no_such_option=1)


def test_the_final_loss_is_the_last_steps_and_the_window_mean_is_over_the_steps_since_the_last_log(tmp_path):
    """Reference: the Trainer's own log of every step (log_every=1) in a run with the same seed."""
    options = dict(steps=7, batch_size=4, lr=3e-3, progress=False)
    every = distill(*reversed(pair()), windows(12), DistillConfig(log_every=1, **options))
    per_step = {h["step"]: h["loss"] for h in every["history"] if "loss" in h}
    assert sorted(per_step) == list(range(1, 8))
    sparse = distill(*reversed(pair()), windows(12), DistillConfig(log_every=5, **options))
    logged = [h["step"] for h in sparse["history"] if "loss" in h]
    assert logged == [1, 5]  # the last logged value is not the last step's
    losses = sparse["losses"]
    assert losses["last"] == pytest.approx(per_step[7], rel=1e-6) and sparse["train_loss"] == losses["last"]
    assert losses["window"] == (6, 7)
    assert losses["window_mean"] == pytest.approx((per_step[6] + per_step[7]) / 2, rel=1e-6)


def _dtypes(folder: Path) -> set[str]:
    with safe_open(folder / "model.safetensors", "pt") as f:
        return {str(f.get_slice(k).get_dtype()) for k in f.keys()}


@pytest.fixture(scope="module")
def text(tmp_path_factory):
    path = tmp_path_factory.mktemp("outputs") / "train.txt"
    path.write_text(train_text()[:8000])
    return path


def _args(out: Path, text: Path, *extra: str) -> list[str]:
    return [
        "distill", str(FAMILY), "--teacher", str(FAMILY), "--data", str(text), "-o", str(out),
        "--steps", "2", "--batch-size", "2", "--seq-len", "32", "--save-every", "1", "--lm-weight", "0.5", *extra,
    ]  # fmt: skip


def test_the_output_keeps_the_students_dtype_and_a_finished_run_removes_its_checkpoints(
    text, tmp_path, capsys
):
    assert _dtypes(FAMILY) == {"BF16"}
    out = tmp_path / "default"
    assert main(_args(out, text, "-q")) == 0  # trained in float32 (--dtype's default)
    said = capsys.readouterr().out
    assert _dtypes(out) == {"BF16"} and json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    assert not list(out.glob("checkpoint-*")) and "removed the checkpoints of the finished run" in said
    assert "(checkpoint-1);" in said  # the last step wrote none: the final model holds its state
    manifest = json.loads((out / "gdnprune.json").read_text())
    log = json.loads((out / "distill_log.json").read_text())
    assert manifest["final"]["train_loss"] > 0 and manifest["final"]["train_loss_window"] == [2, 2]
    assert [h["step"] for h in log["history"] if "loss" in h] == [1]  # logged: step 1 only
    kept = tmp_path / "kept"
    assert main(_args(kept, text, "-q", "--output-dtype", "float32", "--keep-checkpoints", "2")) == 0
    said = capsys.readouterr().out
    assert _dtypes(kept) == {"F32"}
    assert sorted(p.name for p in kept.glob("checkpoint-*")) == ["checkpoint-1", "checkpoint-2"]
    assert "kept the checkpoints" in said


def test_dry_run_gives_host_memory_per_process(text, capsys):
    assert main(_args(Path("unused"), text, "--dry-run")) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if "host memory per process" in x)
    with safe_open(FAMILY / "model.safetensors", "pt") as f:  # the parameters, read from the file
        count = sum(torch.Size(f.get_slice(k).get_shape()).numel() for k in f.keys())
    # loading reads the whole student and the whole teacher, both in float32 (--dtype's default)
    assert f"host memory per process: {2 * 4 * count / 1e6:,.2f} MB while loading" in line
    assert "while training" in line


def test_a_corpus_too_small_for_one_step_is_said_before_any_model_loads(tmp_path, capsys):
    tiny = tmp_path / "tiny.txt"
    tiny.write_text("a few bytes of text, " * 3)
    assert main(_args(tmp_path / "out", tiny, "-q", "--batch-size", "4")) == 2
    err = capsys.readouterr().err
    assert "--data: expected at least --batch-size=4 windows of 32 tokens for one step, found 1" in err
    assert not (tmp_path / "out").exists()


def _tiny_filesystem(path: Path, size: str) -> bool:
    path.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True
    )
    return done.returncode == 0


def test_a_full_disk_says_the_folder_and_the_bytes_and_leaves_no_model(text, tmp_path, capsys):
    mount = tmp_path / "small"
    if _tiny_filesystem(mount, "600k"):  # root: a real 600 KiB file system under the output
        try:
            out = mount / "out"
            assert main(_args(out, text, "-q")) == 1
            err = capsys.readouterr().err.strip().splitlines()
            assert len(err) == 1 and "Traceback" not in err[0]
            assert f"no space left on the device of {out}: a checkpoint" in err[0] and "bytes" in err[0]
            assert not (out / "config.json").exists() and not (out / "model.safetensors").exists()
            assert not list(out.glob("checkpoint-*")) and not list(out.glob(".final*"))
        finally:
            subprocess.run(["umount", str(mount)], check=True)
    else:  # no mount allowed: a real write into a full device, through the same guard
        model = pair()[1]
        with pytest.raises(DiskFullError) as caught, DiskFullGuard(tmp_path, model):
            with open("/dev/full", "wb") as full:
                full.write(b"x" * 4096)
                full.flush()
        assert caught.value.errno == errno.ENOSPC and str(tmp_path) in str(caught.value)
    shutil.rmtree(mount, ignore_errors=True)


class _CtrlCAt(TrainerCallback):
    def __init__(self, step: int):
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            signal.raise_signal(signal.SIGINT)


def test_a_checkpoint_records_its_data_position_and_resume_refuses_other_data(tmp_path):
    config = DistillConfig(
        output_dir=tmp_path / "run", steps=5, batch_size=4, lr=3e-3, save_every=10, progress=False
    )
    teacher, student = pair()
    stopped = distill(student, teacher, windows(12), config, callbacks=[_CtrlCAt(4)])
    assert stopped["interrupted"] and stopped["steps"] == 4
    position = json.loads((tmp_path / "run" / "checkpoint-4" / "data_position.json").read_text())
    # 12 windows, 4 per step: 3 steps per epoch, so step 4 is the first step of the second epoch
    assert position["steps"] == 4 and position["windows"] == 12 and position["windows_per_step"] == 4
    assert (position["epoch"], position["windows_read_in_epoch"]) == (1, 4)
    assert position["data"] == stopped["config"]["train_sha256"]
    (tmp_path / "run" / "distill_log.json").unlink()  # the checkpoint alone says which data it was trained on
    with pytest.raises(ValueError, match="resume: expected the training data of .*checkpoint-4"):
        distill(*reversed(pair()), windows(12, seed=3), config.replace(resume=True))
