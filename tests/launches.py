"""The suite's one 2-process launch, shared by every test that reads it (``launch`` in ``suite.py``):
starting torchrun and two ranks that import torch costs more than what they then run.

It runs once per test session, whatever the pytest-xdist workers: the first worker that asks runs it, under a
file lock in a folder every worker sees (:func:`shared_launch`); the others wait for it and read its record.
So the files that read it need not run on one worker.

One real ``torch.distributed.run`` launch (the code path of ``torchrun``) in its own session, whose two
workers run the CLI in turn:

* ``open_windows`` of 3 shards with one cache folder (test_corpus), ``score`` (projection), ``plan`` (measured
  sensitivity), ``plan --rank-by-distill`` (test_plan_rank),
  ``plan --sensitivity bld`` (test_plan_bld), ``plan --refine-generations`` (test_plan_refine), ``eval``
  (test_eval), ``score`` (activation), a ``score`` whose data
  is missing on rank 1 (a user error) and a ``score`` where rank 1 is stuck while rank 0 times out; each
  call's exit code and stderr go to ``rank<R>.json`` (test_distributed); then a distillation with DDP
  (test_distill); an MoE student's distillation, stopped by SIGTERM and resumed, under DDP and FSDP2
  (test_distill_pipeline); loading into FSDP2 shards and distillations under FSDP2 (test_sharded_loading);
  distillations under FSDP2, one stopped by SIGTERM and resumed (test_distill_fsdp); a step under FSDP2 of
  a student of the real-count model, 48 layers of 512 experts (test_scale);
* last, a long ``score`` of the trained MoE model with its progress bar on the real stderr, in a folder of
  its own, which the test's Ctrl-C stops: SIGINT to the launch's whole process group, as a terminal sends
  it (test_first_hour).

Beside it, the suite's one fresh ``gdnprune`` process (:func:`fresh_process`), shared the same way: ``verify``,
``eval -q``, ``score`` and ``score -q`` in one new interpreter, for what only a new one shows (test_first_hour,
test_eval).
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import transformers
from helpers import CHILD_GC, child_env, corpus_docs, mixed_mc_folder, python_command, write_jsonl
from launch_runs import build_folders, build_moe_student, build_scale
from tiny_models import TEXT, gdn_kwargs, randomize_gdn

from gdnprune.demo_data import build_byte_tokenizer, demo_model_path, train_text, validation_text
from gdnprune.gated_delta_net import GDNShape

SHAPE = GDNShape(num_key_heads=2, num_value_heads=4, key_head_dim=8, value_head_dim=6)
SEQ, SAMPLES = 72, 5  # 5 windows: uneven shares, and the loss tokens depend on the global window index

#: the options of the refined plan (test_plan_refine runs them in one process)
REFINED = ["--budget-gdn-params", "0.4", "--dim-step", "1/2", "--num-samples", "4", "--seq-len", "40"]
REFINED += ["--refine-generations", "2", "--refine-offspring", "3", "--quiet", "--threads", "1"]

WORKER = textwrap.dedent(
    """
    import contextlib, gc, io, json, os, sys, threading, time
    from transformers import AutoTokenizer
    from gdnprune.cli import main
    from gdnprune.corpus.dataset import open_windows
    from gdnprune.demo_data import demo_model_path
    from gdnprune.runtime.distributed import process_group
    from launches import REFINED, eval_argv

    model, data, out, samples, seq, moe, interrupted = sys.argv[1:8]
    rank = int(os.environ["RANK"])
    common = ["score", model, "--num-samples", samples, "--seq-len", seq, "--batch-size", "2", "--quiet",
              "--threads", "1"]
    results = {}

    def call(name, *argv):
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            code = main(common + list(argv))
        results[name] = {"code": code, "err": err.getvalue()}

    # the corpus on the ranks: one tokenises the shards, the other waits and reuses its cache (test_corpus)
    with process_group():
        ds = open_windows(os.path.dirname(model) + "/shards", AutoTokenizer.from_pretrained(demo_model_path()),
                          seq_len=20, cache_dir=out + "/corpus_cache")
        mine = ds.shard(rank, int(os.environ["WORLD_SIZE"]))
        results["corpus"] = dict(reused=ds.windows.streams[0].reused, indices=list(mine.indices),
                                 windows=mine.tensor().tolist())
    call("projection", "--data", data, "--output", out + "/projection.json")
    gc.freeze()  # what the first command imported, out of the collector's full passes (tests/suite.py says why)
    # the plan's measured sensitivity on the same two ranks: each measures its share of the windows
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = main(["plan", model, "--scores", out + "/projection.json", "--data", data, "--output",
                     out + "/plan.json", "--budget-gdn-params", "0.5", "--dim-step", "1/2", "--num-samples", "4",
                     "--seq-len", seq, "--batch-size", "1", "--quiet", "--threads", "1"])
    results["plan"] = {"code": code, "err": err.getvalue()}
    # the plan ranked by distillation: each rank distils its own candidates (test_plan_rank)
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = main(["plan", model, "--scores", out + "/projection.json", "--data", data, "--output",
                     out + "/ranked.json", "--budget-gdn-params", "0.5", "--dim-step", "1/2", "--num-samples", "4",
                     "--seq-len", seq, "--batch-size", "1", "--rank-by-distill", "2", "--rank-steps", "2",
                     "--threads", "1"])
    results["ranked"] = {"code": code, "err": err.getvalue()}
    # the same plan with the BLD sensitivity: each rank trains and measures its share of the candidates
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = main(["plan", model, "--scores", out + "/projection.json", "--data", data, "--output",
                     out + "/plan_bld.json", "--budget-gdn-params", "0.5", "--dim-step", "1/2", "--num-samples",
                     "4", "--seq-len", seq, "--batch-size", "1", "--quiet", "--threads", "1", "--sensitivity",
                     "bld", "--bld-steps", "3"])
    results["plan_bld"] = {"code": code, "err": err.getvalue()}
    # the plan's successive halving and evolutionary refinement, spread over the ranks (test_plan_refine)
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = main(["plan", model, "--scores", out + "/projection.json", "--data", data, "--output",
                     out + "/refined.json", *REFINED])
    results["refined"] = {"code": code, "err": err.getvalue()}
    call("activation", "--data", data, "--method", "activation", "--output", out + "/activation.json")
    call("failure", "--data", data if rank == 0 else out + "/missing.txt", "--output", out + "/failure.json")
    # lm-eval on the ranks: each scores its share of the documents, rank 0 prints the table (test_eval; after the
    # calls whose messages test_distributed reads, but for the stuck one, which must come last)
    os.environ["EVAL_RECORD"] = out + "/eval.log"  # the mixed_mc task's hook: which rank scored each document
    err, printed = io.StringIO(), io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(printed):
        code = main([*eval_argv(os.path.dirname(model)), "-o", out + "/eval"])
    results["eval"] = {"code": code, "err": err.getvalue(), "out": printed.getvalue()}
    # rank 1 is stuck opening a FIFO nobody writes to, until rank 0 has given up waiting for it
    fifo = out + "/stuck.fifo"

    def release():
        while not os.path.exists(out + "/rank0.json"):
            time.sleep(0.05)
        open(fifo, "w").close()

    if rank == 1:
        threading.Thread(target=release, daemon=True).start()
    call("stuck", "--data", data if rank == 0 else fifo, "--output", out + "/stuck.json", "--dist-timeout", "3")
    with open(out + "/.rank%d.json" % rank, "w") as f:
        json.dump(results, f)
    os.rename(out + "/.rank%d.json" % rank, out + "/rank%d.json" % rank)
    # distillation with DDP on the ranks (test_distill): after the calls that set their own timeouts, since
    # the Trainer's process group stays; rank 0 saves the run
    from launch_runs import ddp_run, fsdp_distill, load_and_distill, moe_resume, two_processes, vocab_parallel_run
    gc.collect()  # what the plans and the eval imported, frozen too: each training's start runs a full collection
    gc.freeze()
    with contextlib.redirect_stderr(io.StringIO()):
        ddp_run(out + "/distill_two.pt")
    # an MoE student's run, the run SIGTERM stops and its resume, under DDP then FSDP2 (test_distill_pipeline;
    # before the other FSDP2 runs)
    with contextlib.redirect_stderr(io.StringIO()):
        moe_resume(os.path.dirname(model) + "/pipeline_moe")
    # loading into FSDP2 shards, then distillations under FSDP2 (test_sharded_loading)
    with contextlib.redirect_stderr(io.StringIO()):
        load_and_distill(os.path.dirname(model) + "/sharded_loading")
    # distillation under FSDP2: the cases, a run stopped by SIGTERM and its resume (test_distill_fsdp)
    with contextlib.redirect_stderr(io.StringIO()):
        two_processes(os.path.dirname(model) + "/distill_fsdp")
    # the vocabulary-parallel loss and lookup against the whole formulas (test_vocab_parallel_loss)
    with contextlib.redirect_stderr(io.StringIO()):
        vocab_parallel_run(os.path.dirname(model) + "/vocab_parallel")
    # distillation under FSDP2 of a student of the real-count model (48 layers, 512 experts; test_scale)
    with contextlib.redirect_stderr(io.StringIO()):
        fsdp_distill(os.path.dirname(model) + "/scale")
    # last: a long run, as a user starts it, that the test interrupts with Ctrl-C
    os.chdir(interrupted)
    sys.exit(main(["score", moe, "--data", "calib.txt", "-o", "scores.json", "--num-samples", "1024"]))
"""
)


def build_model(path: Path) -> Path:
    """The launch's model: a random Qwen3.5 text model with a byte tokenizer, saved into ``path``."""
    torch.manual_seed(0)
    config = transformers.Qwen3_5TextConfig(**{**TEXT, "vocab_size": 257}, **gdn_kwargs(SHAPE))
    model = transformers.Qwen3_5ForCausalLM(config).eval()
    randomize_gdn(model)
    model.save_pretrained(path)
    build_byte_tokenizer().save_pretrained(path)
    return path


def write_text(path: Path) -> Path:
    """The launch's calibration text."""
    path.write_text(train_text()[:3000], encoding="utf-8")
    return path


@dataclass
class Launch:
    """What the launch left: ``folder`` holds ``rank0.json``, ``rank1.json`` and what rank 0 wrote;
    ``interrupted`` is the folder of the score that Ctrl-C stopped; ``stderr`` and ``returncode`` are the
    launcher's."""

    folder: Path
    interrupted: Path
    stderr: str
    returncode: int
    #: the launch still ran when the Ctrl-C came (it did not end by itself before)
    running_at_ctrl_c: bool


def run_launch(model_dir: Path, text_file: Path, moe: Path, folder: Path) -> Launch:
    """Run the launch in ``folder``; Ctrl-C once both ranks wrote their results and the last score's progress
    bar shows windows being scored."""
    worker = folder / "worker.py"
    worker.write_text(CHILD_GC + WORKER, encoding="utf-8")  # the collector set as in the workers
    os.mkfifo(folder / "stuck.fifo")
    interrupted = folder / "interrupted"
    interrupted.mkdir()
    # 225 KB: 1,757 windows of 128 tokens, of which the score asks 1,024 (512 a rank: seconds of scoring after the
    # bar shows, for the Ctrl-C to come in); tokenising the 1.8 MB it had before cost each rank 1.5 s more
    (interrupted / "calib.txt").write_text("The quick brown fox jumps over the lazy dog. " * 5_000)
    env = child_env()
    argv = python_command("torch.distributed.run", "--standalone", "--nproc_per_node", "2", worker)
    argv += [str(model_dir), str(text_file), str(folder), str(SAMPLES), str(SEQ), str(moe), str(interrupted)]
    err_path = folder / "stderr.txt"
    with open(err_path, "w") as err_file:
        proc = subprocess.Popen(
            argv, cwd=folder, env=env, stdout=subprocess.DEVNULL, stderr=err_file, start_new_session=True
        )
        try:
            deadline = time.monotonic() + 600  # the launch runs many commands: a bound on a hang
            while proc.poll() is None and time.monotonic() < deadline and not _scoring(folder, err_path):
                time.sleep(0.5)  # until rank 0's progress bar shows the windows being scored
            running = proc.poll() is None
            if running:
                os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C in a terminal does
                proc.wait(timeout=120)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    return Launch(folder, interrupted, err_path.read_text(), proc.returncode, running)


def shared_folder(tmp_path_factory) -> Path:
    """A folder of this test session that every pytest-xdist worker sees (under xdist, the parent of the
    workers' own base folders; in a plain run, its base folder)."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


@contextlib.contextmanager
def _locked(folder: Path) -> Iterator[Path]:
    """``folder / "launch"``, made, with this process alone in it (an exclusive lock: the other workers wait)."""
    with open(folder / "launch.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            (folder / "launch").mkdir(exist_ok=True)
            yield folder / "launch"
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def shared_inputs(folder: Path) -> Path:
    """The launch's inputs in the shared ``folder``, written by the first worker asking: its model (``model``),
    calibration text (``calib.txt``), the eval's text (``val.txt``) and task folder
    (:func:`helpers.mixed_mc_folder`), 3 JSONL shards (``shards``), the folders test_sharded_loading loads
    (``sharded_loading``) and test_distill_pipeline's MoE student (``pipeline_moe``). Returns the folder
    holding them; once they are all written (``inputs.done``), without waiting for the lock, which the launch
    holds while it runs."""
    if (folder / "launch" / "inputs.done").exists():
        return folder / "launch"
    with _locked(folder) as root:
        if not (root / "inputs.done").exists():
            _write_inputs(root)
        return root


def write_inputs_unless_busy(folder: Path) -> None:
    """:func:`shared_inputs`, unless another worker holds the lock (it writes them, or runs the launch): then
    nothing, at once. Building them changes torch's process-wide state (the default dtype while a bfloat16
    model loads, the global seed), so it must not run in a thread beside the tests."""
    if (folder / "launch" / "inputs.done").exists():
        return
    with open(folder / "launch.lock", "a") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return
        try:
            (folder / "launch").mkdir(exist_ok=True)
            if not (folder / "launch" / "inputs.done").exists():
                _write_inputs(folder / "launch")
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _write_inputs(root: Path) -> None:
    write_text(root / "calib.txt")
    (root / "val.txt").write_text(validation_text()[: 256 * 5], encoding="utf-8")
    shutil.rmtree(root / "mixed_mc_tasks", ignore_errors=True)
    mixed_mc_folder(root)
    shutil.rmtree(root / "shards", ignore_errors=True)
    (root / "shards").mkdir()
    for i in range(3):
        write_jsonl(root / "shards" / f"{i}.jsonl", corpus_docs(f"shard{i}", 40))
    shutil.rmtree(root / "sharded_loading", ignore_errors=True)
    build_folders(root / "sharded_loading")
    shutil.rmtree(root / "pipeline_moe", ignore_errors=True)
    build_moe_student(root / "pipeline_moe")
    build_model(root / "model")
    shutil.rmtree(root / "scale", ignore_errors=True)
    build_scale(root / "scale")
    (root / "inputs.done").touch()


def eval_argv(inputs: str | Path) -> list[str]:
    """``gdnprune eval -q`` of the demo model on four tasks (5 documents each), ``mixed_mc`` from the shared
    ``inputs`` (:func:`shared_inputs`), without its output (``-o``)."""
    inputs = Path(inputs)
    argv = ["eval", str(demo_model_path()), "--tasks", "mixed_mc,passkey,mqar,nats_per_byte"]
    argv += ["--context-lengths", "128", "--include-path", str(inputs / "mixed_mc_tasks")]
    return argv + [
        "--data",
        str(inputs / "val.txt"),
        "--limit",
        "5",
        "--batch-size",
        "2",
        "--threads",
        "1",
        "-q",
    ]


def shared_launch(folder: Path, moe: Path) -> Launch:
    """The launch of the shared ``folder``: run by the first worker asking (:func:`run_launch`), its record
    (``launch.json``) read by the others."""
    inputs = shared_inputs(folder)
    model, text = inputs / "model", inputs / "calib.txt"
    with _locked(folder) as root:
        record = root / "launch.json"
        if not record.exists():
            shutil.rmtree(root / "run", ignore_errors=True)  # what a failed run left
            (root / "run").mkdir()
            done = run_launch(model, text, moe, root / "run")
            fields = {k: str(v) if isinstance(v, Path) else v for k, v in dataclasses.asdict(done).items()}
            record.write_text(json.dumps(fields), encoding="utf-8")
        fields = json.loads(record.read_text(encoding="utf-8"))
    return Launch(**{**fields, "folder": Path(fields["folder"]), "interrupted": Path(fields["interrupted"])})


def _scoring(folder: Path, err_path: Path) -> bool:
    ranks_done = all((folder / f"rank{r}.json").exists() for r in (0, 1))
    return ranks_done and "%|" in err_path.read_text()


# ---- the suite's one fresh gdnprune process ---------------------------------------------------------------

#: the trained MoE model: the launch's last, interrupted score reads it, and ``verify`` compares it with itself
TRAINED_MOE = Path(__file__).resolve().parent / "data" / "trained" / "qwen3_5_moe"
#: the commands of the fresh process, in their order: what a process shows once (transformers' kernel-fallback
#: lines, at its first model) goes to the first, ``verify`` (test_first_hour); ``eval -q``, the first to import
#: lm-eval (test_eval: its quiet output, and the one-process reference of the launch's eval on two ranks); then
#: ``score`` of the bundled model without and with ``-q`` (test_first_hour: whose progress bars show)
FRESH_COMMANDS = ("verify", "eval -q", "score", "score -q")
#: the line that the child writes to stdout and stderr after each command
SPLIT = "----- next command -----"
_FRESH = """
import json, sys
from gdnprune.cli import main
codes = []
for argv in json.loads(sys.argv[1]):
    codes.append(main(argv))
    for stream in (sys.stdout, sys.stderr):
        stream.write("\\n" + SPLIT + "\\n")
        stream.flush()
print(json.dumps(codes))
"""


@dataclass
class FreshRun:
    """One command of the fresh process: its exit code, stdout and stderr (a pipe each, as a user's)."""

    code: int
    out: str
    err: str


def fresh_process(folder: Path, inputs: Path) -> tuple[dict[str, FreshRun], Path]:
    """The commands of :data:`FRESH_COMMANDS` run one after the other by ``gdnprune.cli.main`` in one new
    process, from a folder outside any git repository, with transformers' progress bars left on: a new
    interpreter costs 5-6 s of CPU importing torch and transformers, and each of these commands shows what only
    a new one shows. Run once per session, by the first pytest-xdist worker asking (a lock in the shared
    ``folder``; the others read its record). Returns each command's :class:`FreshRun` and the folder it ran in
    (``one``: the eval's output, ``1.log``: its record of the documents scored, :data:`helpers.RECORD_HOOK`)."""
    with open(folder / "fresh.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            cwd = folder / "fresh"
            if not (cwd / "runs.json").exists():
                shutil.rmtree(cwd, ignore_errors=True)  # what a failed run left
                cwd.mkdir()
                _run_fresh(cwd, inputs)
            runs = json.loads((cwd / "runs.json").read_text(encoding="utf-8"))
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    return {name: FreshRun(**run) for name, run in runs.items()}, cwd


def _run_fresh(cwd: Path, inputs: Path) -> None:
    (cwd / "t.txt").write_text("The quick brown fox jumps over the lazy dog. " * 20)
    (cwd / "text.txt").write_text("a few words of calibration text")
    score = ["score", str(demo_model_path()), "--data", "text.txt", "-o", "s.json", "--overwrite"]
    score += ["--num-samples", "1", "--seq-len", "8", "--threads", "1"]
    commands = {
        "verify": ["verify", str(TRAINED_MOE), str(TRAINED_MOE), "--data", "t.txt", "--num-samples", "1"],
        "eval -q": [*eval_argv(inputs), "-o", str(cwd / "one")],
        "score": score,
        "score -q": [*score, "-q"],
    }
    assert tuple(commands) == FRESH_COMMANDS
    env = child_env(EVAL_RECORD=str(cwd / "1.log"))
    for bars_off in ("TQDM_DISABLE", "HF_HUB_DISABLE_PROGRESS_BARS"):
        env.pop(bars_off, None)
    script = CHILD_GC + f"SPLIT = {SPLIT!r}\n" + _FRESH
    done = subprocess.run(
        [sys.executable, "-c", script, json.dumps(list(commands.values()))],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    outs, errs = done.stdout.split("\n" + SPLIT + "\n"), done.stderr.split("\n" + SPLIT + "\n")
    assert len(outs) == len(errs) == len(commands) + 1, done.stderr[-4000:]
    codes = json.loads(outs[-1])
    runs = {name: {"code": c, "out": o, "err": e} for name, c, o, e in zip(commands, codes, outs, errs)}
    (cwd / "runs.json").write_text(json.dumps(runs), encoding="utf-8")
