"""A new user's first hour, driven from the outside as they met it: the words on the door say what the tool
cuts, every path is checked before a model loads (and never sent to the Hub), a read-only output is the
user's mistake named in their words, a misspelled or abbreviated flag gets the command's usage and the
closest flag."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import child_env, python_command, tmpfs
from launches import fresh_process, shared_folder

from gdnprune.cli import COMMANDS, build_parser, main

ROOT = Path(__file__).resolve().parent.parent
TRAINED = ROOT / "tests" / "data" / "trained"
MOE = TRAINED / "qwen3_5_moe"
#: a legal cut of the trained MoE model's GDN layers (4 key heads, 8 value heads)
CUT = ["--num-key-heads", "2", "--num-value-heads", "4"]


def _gdnprune(*args: str, cwd: Path, timeout: float = 120) -> subprocess.CompletedProcess:
    """``python -m gdnprune ARGS`` in a fresh process, offline, as a user runs it."""
    return subprocess.run(
        python_command("gdnprune", *args),
        cwd=cwd,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


# ---- the words on the door --------------------------------------------------------------------------------


def _readme() -> str:
    return (ROOT / "README.md").read_text()


def test_the_first_lines_say_every_kind_of_block_is_cut():
    opening = _readme().split("\n## ", 1)[0].lower()
    for kind in (
        "gatedeltanet",
        "attention heads",
        "mlp",
        "expert",
        "whole decoder layers",
        "--budget-params",
    ):
        assert kind in opening.replace("gateddeltanet", "gatedeltanet"), kind
    description = (
        re.search(r'(?m)^description = "(.*)"$', (ROOT / "pyproject.toml").read_text()).group(1).lower()
    )
    helptext = " ".join(build_parser().format_help().lower().split())
    for text in (description, helptext):
        assert all(word in text for word in ("attention heads", "mlp", "experts", "layers")), text


def test_readme_keeps_the_quick_start_and_shows_every_command():
    text = _readme()
    assert "make demo" in text and "make test" in text and "pip install ." in text
    sections = re.findall(r"(?m)^## (.+)$", text)
    assert sections[:3] == ["Install", "Quick start", "The pipeline, one command at a time"], sections
    pipeline = text.split("## The pipeline, one command at a time", 1)[1].split("\n## ", 1)[0]
    examples = set(re.findall(r"(?m)^gdnprune (\w+) ", pipeline))
    assert set(COMMANDS) - {"demo"} <= examples, set(COMMANDS) - examples
    assert len(text.splitlines()) < 200  # a page, not a manual: the reference lives in docs/


def test_user_documentation_has_no_issue_numbers_and_no_dead_links():
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    for page in pages:
        text = page.read_text()
        assert not re.search(r"\bissues? \d+", text, re.IGNORECASE), page
        for target in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", text):
            assert (page.parent / target).exists(), f"{page.name} links to {target}, which does not exist"


# ---- fail fast --------------------------------------------------------------------------------------------

_NO_DATA = "nope.txt: no such file or folder"

#: command line -> the flag (or positional) the one-line error must name, and what it must say was found;
#: every case has a real model (the trained tiny MoE) everywhere but in the path under test
FAIL_FAST = {
    "distill student": (
        ["distill", "cut", "--teacher", "{moe}", "--data", "t.txt", "-o", "o", "--steps", "1"],
        "STUDENT",
        "no such directory 'cut'",
    ),
    "distill teacher": (
        ["distill", "{moe}", "--teacher", "Qwen/Qwen3.5-4B", "--data", "t.txt", "-o", "o", "--steps", "1"],
        "--teacher",
        "no such directory 'Qwen/Qwen3.5-4B'",
    ),
    "verify": (["verify", "{moe}", "nope", "--data", "t.txt"], "MODEL_B", "no such directory 'nope'"),
    "score": (["score", "nope", "--data", "t.txt", "-o", "s.json"], "MODEL_DIR", "no such directory"),
    "score merge": (["score", "--merge", "part0.safetensors", "-o", "s.json"], "--merge", "no such path"),
    "plan scores": (
        [
            "plan",
            "{moe}",
            "--scores",
            "nope.json",
            "--data",
            "t.txt",
            "--budget-params",
            "0.5",
            "-o",
            "p.json",
        ],
        "--scores",
        "no such path 'nope.json'",
    ),
    "prune plan": (
        ["prune", "{moe}", "--data", "t.txt", "--plan", "folder", "-o", "out"],
        "--plan",
        "a folder 'folder'",
    ),
    "prune model": (
        ["prune", "t.txt", "--data", "t.txt", "--budget-params", "0.5", "-o", "out"],
        "MODEL_DIR",
        "a file 't.txt'",
    ),
    "sort scores": (["sort", "{moe}", "--scores", "nope.json", "-o", "out"], "--scores", "no such path"),
    "slice plan": (["slice", "{moe}", "--plan", "nope.json", "-o", "out"], "--plan", "no such path"),
    "slice folder without config": (
        ["slice", "folder", "-o", "out", *CUT],
        "MODEL_DIR",
        "without config.json",
    ),
    "output under a file": (["slice", "{moe}", "-o", "t.txt/out", *CUT], "--output", "t.txt is a file"),
    # a --data source that names nothing: refused before torch, transformers or datasets load
    "score data": (["score", "{moe}", "--data", "nope.txt", "-o", "s.json"], "--data", _NO_DATA),
    "plan data": (
        [
            "plan",
            "{moe}",
            "--scores",
            "t.txt",
            "--data",
            "nope.txt",
            "--budget-params",
            "0.5",
            "-o",
            "p.json",
        ],
        "--data",
        _NO_DATA,
    ),
    "prune data": (
        ["prune", "{moe}", "--data", "nope.txt", "--budget-params", "0.5", "-o", "o"],
        "--data",
        _NO_DATA,
    ),
    "distill data": (
        ["distill", "{moe}", "--teacher", "{moe}", "--data", "t.txt", "nope.txt", "-o", "o", "--steps", "1"],
        "--data",
        _NO_DATA,
    ),
    "distill eval data": (
        [
            "distill",
            "{moe}",
            "--teacher",
            "{moe}",
            "--data",
            "t.txt",
            "--eval-data",
            "no*.txt",
            "-o",
            "o",
            "--steps",
            "1",
        ],
        "--eval-data",
        "no*.txt: the glob matches no data file",
    ),
    "verify data": (["verify", "{moe}", "{moe}", "--data", "nope.txt"], "--data", _NO_DATA),
    "eval data": (
        ["eval", "{moe}", "--tasks", "nats_per_byte", "--data", "nope.txt", "-o", "o"],
        "--data",
        "expected a UTF-8 text file, found no such path 'nope.txt'",
    ),
    "eval model": (["eval", "nope", "--tasks", "passkey", "-o", "o"], "MODEL", "no such directory 'nope'"),
    "bench model": (
        ["bench", "{moe}", "nope", "--workload", "prefill:1:8"],
        "MODEL",
        "no such directory 'nope'",
    ),
}

_RUN_ALL = """
import contextlib, io, json, sys
from gdnprune.cli import main
out = {}
for name, argv in json.loads(sys.argv[1]).items():
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = main(argv)
    out[name] = [code, err.getvalue()]
out["torch loaded"] = "torch" in sys.modules
out["transformers loaded"] = "transformers" in sys.modules
print(json.dumps(out))
"""


def test_every_path_is_checked_before_any_model_loads(tmp_path):
    """Each mistake answers with exit 2 and one line naming the flag, what was expected and what was found,
    in a process that never imported torch or transformers (so no model loaded and nothing asked the Hub)."""
    (tmp_path / "t.txt").write_text("hello world\n")
    (tmp_path / "folder").mkdir()
    cases = {name: [a.replace("{moe}", str(MOE)) for a in argv] for name, (argv, _, _) in FAIL_FAST.items()}
    done = subprocess.run(
        [sys.executable, "-c", _RUN_ALL, json.dumps(cases)],
        cwd=tmp_path,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    results = json.loads(done.stdout)
    assert results.pop("torch loaded") is False and results.pop("transformers loaded") is False
    for name, (code, err) in results.items():
        _, flag, found = FAIL_FAST[name]
        command = cases[name][0]
        assert code == 2, (name, err)
        lines = err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"gdnprune {command}: error: {flag}: "), (name, err)
        assert any(w in lines[0] for w in ("expected", "cannot write", "no such file", "matches no data")), (
            name,
            err,
        )
        assert found in lines[0], (name, err)
    assert sorted(os.listdir(tmp_path)) == ["folder", "t.txt"]  # nothing written


def test_a_hub_name_gets_a_hint_to_download_it(tmp_path):
    result = _gdnprune("inspect", "Qwen/Qwen3.5-4B", cwd=tmp_path)
    assert result.returncode == 2 and "hf download Qwen/Qwen3.5-4B" in result.stderr, result.stderr


# ---- an output on a read-only mount -----------------------------------------------------------------------


@pytest.fixture
def read_only_mount(tmp_path):
    """A read-only tmpfs: writes fail with EROFS, whoever the process is."""
    with tmpfs(tmp_path / "ro_mount", "ro,size=8m", "a read-only tmpfs (chmod does not stop root)") as mnt:
        yield mnt


def test_an_output_on_a_read_only_mount_is_named_and_exits_2(read_only_mount, tmp_path, capsys):
    out = read_only_mount / "out"
    with pytest.raises(OSError) as really:  # the mount does reject writes
        (read_only_mount / "probe").write_text("x")
    assert really.value.errno == 30
    for argv in (["slice", str(MOE), "-o", str(out), "-q", *CUT], ["demo", "-o", str(out / "deeper")]):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "--output" in err and "read-only file system" in err, err
        assert repr(str(out if argv[0] == "slice" else out / "deeper")) in err and ".gdnprune-" not in err, (
            err
        )


def test_the_library_names_the_output_not_its_temporary_folder(read_only_mount):
    from gdnprune.checkpoint import slice_checkpoint
    from gdnprune.checkpoint.output import OutputError

    out = read_only_mount / "sliced"
    with pytest.raises(
        OutputError, match=rf"cannot write the output {re.escape(str(out))}: .* read-only file"
    ):
        slice_checkpoint(MOE, out, target={"num_key_heads": 2, "num_value_heads": 4})


# ---- misspelled and abbreviated flags ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("typo", "meant"),
    [("--budjet-params", "--budget-params"), ("--dat", "--data"), ("--budget-param", "--budget-params")],
)
def test_a_flag_typo_shows_the_commands_usage_and_the_closest_flag(typo, meant, tmp_path):
    argv = ["prune", str(MOE), "--data", "t.txt", "--budget-params", "0.5", "-o", "out"]
    argv[argv.index(meant)] = typo
    result = _gdnprune(*argv, cwd=tmp_path)
    assert result.returncode == 2
    assert result.stderr.startswith("usage: gdnprune prune "), result.stderr
    assert result.stderr.strip().splitlines()[-1] == (
        f"gdnprune prune: error: unrecognized argument {typo}; did you mean {meant}?"
    )


def test_no_parser_accepts_abbreviations():
    parser = build_parser()
    subparsers = parser._subparsers._group_actions[0].choices
    assert set(subparsers) == set(COMMANDS)
    assert parser.allow_abbrev is False and all(p.allow_abbrev is False for p in subparsers.values())


# ---- inspect: every kind of block a plan can cut -----------------------------------------------------------


def _stored_sizes(folder: Path) -> dict[str, int]:
    """Tensor name -> element count, read from the safetensors header by hand (no gdnprune code)."""
    raw = (folder / "model.safetensors").read_bytes()
    header = json.loads(raw[8 : 8 + int.from_bytes(raw[:8], "little")])
    return {name: math.prod(meta["shape"]) for name, meta in header.items() if name != "__metadata__"}


def test_inspect_shows_every_kind_of_block_of_a_moe_model(tmp_path):
    result = _gdnprune("inspect", str(MOE), cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    text = result.stdout
    sizes = _stored_sizes(MOE)

    def under(prefix: str, but: tuple[str, ...] = ()) -> int:
        return sum(
            n
            for k, n in sizes.items()
            if k.startswith(prefix + ".") and not k[len(prefix) + 1 :].startswith(but)
        )

    expected = {  # prefix -> parameters, as the plan counts a block: every tensor of its module
        "model.layers.0.linear_attn": under("model.layers.0.linear_attn"),
        "model.layers.2.self_attn": under("model.layers.2.self_attn"),
        "model.layers.1.mlp.shared_expert": under("model.layers.1.mlp.shared_expert"),
        "model.layers.1.mlp": under("model.layers.1.mlp", ("shared_expert.", "shared_expert_gate.")),
    }
    for prefix, count in expected.items():
        assert re.search(rf"(?m)^  {re.escape(prefix)}  .* {count:,}$", text), (prefix, count, text)
    for title in ("GDN layers", "attention", "shared experts", "routed experts", "decoder layers"):
        assert re.search(rf"(?m)^{title}", text), title
    for layer in range(3):  # a removal takes every tensor of the decoder layer
        count = under(f"model.layers.{layer}")
        assert re.search(rf"(?m)^  {layer}  .* {count:,}  ", text), (layer, count)
    total = sum(sizes.values())
    assert f"total: {total:,}" in text and "other: " not in text
    kept = total - sum(under(f"model.layers.{i}") for i in range(3))  # embeddings and the final norm ...
    others = re.search(r"not cut \(embeddings, norms, \.\.\.\): ([\d,]+)", text)
    assert others and int(others.group(1).replace(",", "")) >= kept


# ---- the kernel note --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def one_child(launch_inputs, tmp_path_factory) -> dict[str, tuple[int, str]]:
    """Command name -> (exit code, stderr) of ``verify`` (first: transformers' kernel-fallback lines come at a
    process's first model), ``score`` and ``score -q``, as a user runs them (stderr a pipe): commands of the
    suite's one fresh process (tests/launches.py's :func:`fresh_process`)."""
    runs, _ = fresh_process(shared_folder(tmp_path_factory), launch_inputs)
    return {name: (runs[name].code, runs[name].err) for name in ("verify", "score", "score -q")}


def test_no_kernel_note_on_a_cpu(one_child):
    """On a CPU the fast GDN kernels cannot run: transformers' fallback lines are dropped and no note asks
    the user to install them."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is present: the note is due here")
    code, err = one_child["verify"]
    assert code == 0, err
    assert "flash-linear-attention" not in err and "falling back" not in err, err


def test_commands_show_their_own_bars_never_transformers_and_none_under_quiet(one_child):
    """On stderr (a pipe here, as a user runs the command) a command draws its own bar, never transformers'
    weight-loading bar; with -q nothing at all."""
    for name in ("verify", "score"):
        code, loud = one_child[name]
        assert code == 0 and "Loading weights" not in loud and "it/s]" not in loud, loud
    assert "scoring: 100%" in one_child["score"][1]  # gdnprune's own bar
    code, quiet = one_child["score -q"]
    assert code == 0 and quiet.strip() == "", quiet


def test_the_kernel_note_is_shown_once_on_its_own_line_where_a_gpu_is(capsys):
    """With a GPU (given here: this machine may have none), the note replaces transformers' lines once, and a
    progress bar on the same stream does not swallow it: it gets a line of its own."""
    import logging
    import sys

    from tqdm import tqdm

    from gdnprune.cli._runtime import _FALLBACK, _LOGGER, _FallbackNote

    note = _FallbackNote("score", quiet=False, gpu=True)
    logger = logging.getLogger(_LOGGER)
    logger.addFilter(note)
    try:
        with tqdm(total=10, file=sys.stderr, desc="scoring", ascii=True) as bar:
            bar.update(3)
            for kernel in ("chunk_gated_delta_rule", "causal_conv1d"):
                logger.warning(f"{kernel} is missing, {_FALLBACK}")
            bar.update(7)
    finally:
        logger.removeFilter(note)
    lines = re.split(r"[\r\n]", capsys.readouterr().err)
    notes = [line for line in lines if "note:" in line]
    assert len(notes) == 1 and notes[0].startswith("gdnprune score: note: the GDN layers run"), lines
    assert "pip install flash-linear-attention" in notes[0] and not any(_FALLBACK in line for line in lines)


# ---- Ctrl-C under torchrun --------------------------------------------------------------------------------


@pytest.mark.slow
def test_ctrl_c_under_torchrun_says_one_line_and_leaves_nothing(launch):
    """Ctrl-C signals the launch's whole process group: torchrun forwards SIGINT to its ranks, each stops and
    removes what it started, and one line (rank 0's) says so. torchrun itself then ends with its own
    ``SignalException`` traceback and exit 1, which gdnprune cannot change: the README says so.

    The launch is the suite's one 2-process launch (tests/launches.py): its last command, a ``score`` of the
    trained MoE model with a progress bar, runs until the Ctrl-C, which comes once the bar shows windows being
    scored; the launch's earlier commands wrote their messages elsewhere."""
    err = launch.stderr
    assert launch.running_at_ctrl_c, err
    ours = [line for line in re.split(r"[\r\n]", err) if line.startswith("gdnprune")]
    assert ours == ["gdnprune score: interrupted by SIGINT; stopped without leaving a partial output"], err
    assert launch.returncode != 0
    assert sorted(os.listdir(launch.interrupted)) == ["calib.txt"]  # no scores file, no temporary file


# ---- the sensitivity plot ---------------------------------------------------------------------------------


def _report() -> dict:
    """A plan report by hand: two GDN layers with equal sensitivities (their lines coincide), two MLPs whose
    KLs span four decades, a removal panel."""

    def block(kls, chosen, kind=None):
        cands = [{"params": 1000 - 200 * i, "sensitivity": kl, "windows": 8} for i, kl in enumerate(kls)]
        return {"candidates": cands, "chosen": chosen, **({"kind": kind} if kind else {})}

    same = [0.0, 0.01, 0.05, 0.2]
    return {
        "sensitivity": "measured",
        "layers": {
            "model.layers.0.linear_attn": block(same, 1),
            "model.layers.1.linear_attn": block(same, 2),
        },
        "blocks": {
            "model.layers.0.mlp": block([0.0, 1e-5, 1e-3, 0.1], 2, "mlp"),
            "model.layers.1.mlp": block([0.0, 2e-5, 3e-3, 0.2], 1, "mlp"),
        },
        "removal": {
            "model.layers.0": {"layer": 0, "sensitivity": 0.4, "removed": False},
            "model.layers.1": {"layer": 1, "sensitivity": 0.02, "removed": True},
        },
    }


def test_the_sensitivity_plot_labels_its_scales_and_tells_lines_apart(tmp_path):
    pytest.importorskip("matplotlib")
    import matplotlib
    from matplotlib.figure import Figure

    from gdnprune.plan.report.plot import plot_sensitivity, sensitivity_figure

    backend = matplotlib.get_backend()
    assert plot_sensitivity(_report(), tmp_path / "plan.png") is True
    assert (tmp_path / "plan.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert matplotlib.get_backend() == backend  # no global side effect
    figure = sensitivity_figure(_report())
    assert isinstance(figure, Figure)
    panels = [ax for ax in figure.axes if ax.get_visible()]
    assert [ax.get_title().split(":")[0] for ax in panels] == ["GDN layers", "MLP", "layer removal"]
    for ax in panels:
        assert "scale" in ax.get_ylabel() and ax.get_xlabel(), ax.get_title()
        labels = [t.get_text() for t in ax.get_yticklabels() if t.get_text()]
        assert len(labels) >= 3, (ax.get_title(), labels)  # a scale you can read, not one tick besides 0
    gdn, mlp = panels[0], panels[1]
    styles = [str(line.get_linestyle()) for line in gdn.get_lines()]
    assert len(styles) == 2 and len(set(styles)) == 2  # the coinciding lines are drawn differently
    assert mlp.get_yscale() == "symlog" and "log scale" in mlp.get_ylabel()  # four decades: log
    assert gdn.get_yscale() == "linear" and "linear scale" in gdn.get_ylabel()


def test_the_sensitivity_plot_draws_no_candidate_halving_never_measured():
    """Successive halving never measures what no plan within the budgets can hold (windows 0, KL 0): such a
    candidate is neither a point nor a step of its block's line, which stays at the measured values."""
    pytest.importorskip("matplotlib")
    from gdnprune.plan.report.plot import sensitivity_figure

    report = _report()
    cands = report["layers"]["model.layers.0.linear_attn"]["candidates"]
    cands.append({"params": 300, "sensitivity": 0.0, "windows": 0})  # the cheapest: would pull the line to 0
    gdn = [ax for ax in sensitivity_figure(report).axes if ax.get_visible()][0]
    xs = [x for line in gdn.get_lines() for x in line.get_xdata()]
    xs += [x for points in gdn.collections for x, _ in points.get_offsets()]
    assert 300 not in xs and 400 in xs  # 400: the cheapest measured candidate
