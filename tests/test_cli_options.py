"""One vocabulary across the commands (issue 19, part 3): the options table is up to date, one concept has one
name, numbers are checked when the command line is read, deprecated spellings still work and say so, and the
messages and exit codes a user meets are the documented ones."""

from __future__ import annotations

import argparse
import errno
import fnmatch
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import BYTES_TARGET as TARGET
from helpers import build_source, child_env, scores_for, tmpfs

from gdnprune.cli import exit_code, main

ROOT = Path(__file__).resolve().parent.parent
TARGET_ARGS = [a for k, v in TARGET.items() for a in (f"--{k.replace('_', '-')}", str(v))]


def _cli_doc():
    spec = importlib.util.spec_from_file_location("cli_doc", ROOT / "scripts" / "cli_doc.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


CLI_DOC = _cli_doc()
COMMANDS = CLI_DOC.subparsers()

#: options whose help names the command's own object (its output, its data, its default), so that the help
#: may differ between commands; flags, value type, choices and kind must still agree
PER_COMMAND = {
    "output",
    "overwrite",
    "data",
    "num_samples",
    "seq_len",
    "seed",
    "threads",
    "batch_size",
    "json",
    "scores",
    "plan",
    "dequantize",
    "compensation_stats",
    "eval_samples",
    "dtype",
    "blocks",  # what the kinds of block are for: ordered (score) or shrunk (plan, prune)
    "workload",
}  # dtype: of the forward passes' weights, or (distill) of the trained parameters; workload: several (bench)
# or the one of --budget-latency (plan, prune)
#: (vocabulary differences that are known and accepted: none)
#: eval's --data is one UTF-8 text file, the data of its nats_per_byte lm-eval task (lm-eval reads the file
#: itself), not a corpus: the one place --data takes a single FILE
KNOWN_EXCEPTIONS: set[tuple[str, str]] = {("eval", "kind"), ("eval", "metavar:data")}
#: old spellings: none may be a visible option of any command
RETIRED = {
    "--compensation",
    "--calibration-windows",
    "--validation-windows",
    "--num-sequences",
    "--bf16",
    "--refine",
    "--refine-samples",
    "--refine-generations",
    "--refine-offspring",
    "--refine-seed",
    "--sub-blocks",
}
#: concept words -> the dests (fnmatch patterns) a flag or dest holding that word may map to: one word, one
#: concept (the glossary of ARCHITECTURE.md). A word with no dest left is retired: no visible flag may use it.
CONCEPTS = {
    "blocks": {"blocks"},
    "sub": set(),  # --sub-blocks: the kinds of block are --blocks
    "refine": set(),  # two searches had this word: the lane search and the evolutionary search
    "lane": {"lane_search", "lane_search_samples"},
    "evolve": {"evolve_generations", "evolve_offspring", "evolve_seed"},
    "compensate": {"compensate"},  # how the refit runs
    "compensation": {"compensation_stats"},  # the statistics file
    "budget": {"budget_*"},
    "samples": {"*samples"},  # a number of calibration windows
    "seed": {"seed", "evolve_seed"},
    "layers": {"remove_layers"},  # decoder layers
    "plan": {"plan", "plan_samples", "no_plan"},
    "scores": {"scores"},
    "shard": {"shard"},
}


def _visible(parser):
    return [a for a in CLI_DOC._options(parser) if a.option_strings]


def test_docs_cli_md_is_generated_from_the_parsers():
    assert (ROOT / "docs" / "cli.md").read_text() == CLI_DOC.render(), (
        "docs/cli.md is out of date: run python scripts/cli_doc.py"
    )


def vocabulary_problems(commands) -> list[str]:
    """Every place where one concept has two names, or one name two meanings, across ``commands``."""
    by_dest, by_flag, problems = {}, {}, []
    for command, parser in commands.items():
        for action in _visible(parser):
            by_dest.setdefault(action.dest, []).append((command, action))
            for flag in action.option_strings:
                by_flag.setdefault(flag, set()).add(action.dest)
                if flag in RETIRED and (command, flag) not in KNOWN_EXCEPTIONS:
                    problems.append(f"{command} {flag}: a retired spelling")
    for flag, dests in by_flag.items():
        if len(dests) > 1:
            problems.append(f"{flag} stores into {sorted(dests)}: one flag, one meaning")
    for dest, uses in by_dest.items():
        first_command, first = uses[0]
        for command, action in uses[1:]:
            same = {
                "flags": sorted(action.option_strings) == sorted(first.option_strings),
                "type": action.type is first.type,
                "choices": tuple(action.choices or ()) == tuple(first.choices or ()),
                "kind": type(action) is type(first) and action.nargs == first.nargs,
                "help": dest in PER_COMMAND or action.help == first.help,
                "metavar": dest in {"output", "overwrite"} or action.metavar == first.metavar,
            }
            for what, ok in same.items():
                key = f"{what}:{dest}" if what in ("help", "metavar") else what
                if (
                    not ok
                    and (command, key) not in KNOWN_EXCEPTIONS
                    and (first_command, key) not in KNOWN_EXCEPTIONS
                ):
                    problems.append(f"{dest}: {command} and {first_command} differ in {what}")
    return problems


def concept_problems(commands) -> list[str]:
    """Every flag or dest of ``commands`` that holds a concept word of :data:`CONCEPTS` but stores into a dest
    outside that word's family: one word used for two concepts."""
    problems = []
    for command, parser in commands.items():
        for action in _visible(parser):
            names = [*(f.lstrip("-") for f in action.option_strings if f.startswith("--")), action.dest]
            words = {w for name in names for w in name.replace("_", "-").split("-")}
            for word in sorted(words & set(CONCEPTS)):
                if not any(fnmatch.fnmatchcase(action.dest, pattern) for pattern in CONCEPTS[word]):
                    flags = "/".join(action.option_strings)
                    problems.append(
                        f"{command} {flags} -> {action.dest}: {word!r} means {sorted(CONCEPTS[word])}"
                    )
    return problems


def test_one_word_has_one_meaning_across_commands():
    problems = concept_problems(COMMANDS)
    assert not problems, "\n".join(problems)


def test_the_word_checker_sees_one_word_for_two_concepts():
    a, b = argparse.ArgumentParser(), argparse.ArgumentParser()
    a.add_argument("--refine", choices=("lanes",))  # a retired word
    b.add_argument("--lane-search-generations", dest="evolve_generations")  # the lane word for the evolution
    b.add_argument("--blocks", dest="blocks", action="store_true")
    b.add_argument("--sub-blocks", dest="blocks")  # retired word, right dest
    b.add_argument("--compensation", dest="compensate")  # the statistics' word for the refit's mode
    b.add_argument("--plan-seed", dest="seed")  # 'seed' fits, 'plan' names another concept
    problems = "\n".join(concept_problems({"a": a, "b": b}))
    for expected in (
        "a --refine -> refine: 'refine' means []",
        "b --lane-search-generations -> evolve_generations: 'lane' means",
        "b --sub-blocks -> blocks: 'sub' means []",
        "b --compensation -> compensate: 'compensation' means ['compensation_stats']",
        "b --plan-seed -> seed: 'plan' means",
    ):
        assert expected in problems, problems
    assert "b --blocks" not in problems and "'seed'" not in problems, problems


def test_score_and_plan_take_the_same_blocks_and_score_leaves_the_hidden_channels_out_by_default():
    from gdnprune.model.subblock_geometry import KINDS

    score, plan = ({a.dest: a for a in _visible(COMMANDS[c])}["blocks"] for c in ("score", "plan"))
    assert score.metavar == plan.metavar == "LIST"
    assert plan.default.split(",") == ["gdn", *KINDS, "depth", "hidden"]  # every kind of block there is
    # a sort by the hidden order rewrites every tensor: score orders the hidden channels where asked to
    assert score.default.split(",") == ["gdn", *KINDS, "depth"]


def test_one_concept_has_one_name_across_commands():
    problems = vocabulary_problems(COMMANDS)
    assert not problems, "\n".join(problems)


def test_the_checker_sees_two_names_for_one_concept_and_two_meanings_for_one_name():
    from gdnprune.cli._options import positive_int

    a, b = argparse.ArgumentParser(), argparse.ArgumentParser()
    a.add_argument("--quiet", "-q", action="store_true", help="no progress bars and no notes")
    b.add_argument("--quiet", action="store_true", help="no progress bars and no notes")  # -q missing
    a.add_argument("--num-samples", type=positive_int, metavar="N", help="windows")
    b.add_argument("--num-samples", type=int, metavar="N", help="windows")  # not checked the same way
    a.add_argument("--compensate", dest="compensate", choices=("statistics", "sequential"))
    b.add_argument("--compensate", dest="compensation_stats", metavar="FILE")  # one flag, two meanings
    b.add_argument("--calibration-windows", type=positive_int)  # a retired spelling
    problems = "\n".join(vocabulary_problems({"a": a, "b": b}))
    for expected in (
        "quiet: b and a differ in flags",
        "num_samples: b and a differ in type",
        "--compensate stores into ['compensate', 'compensation_stats']",
        "b --calibration-windows: a retired spelling",
    ):
        assert expected in problems, problems


def test_every_writing_command_has_the_same_output_options():
    for command, parser in COMMANDS.items():
        flags = {f for a in _visible(parser) for f in a.option_strings}
        if "--output" in flags:
            assert {"-o", "--overwrite", "-q", "--quiet"} <= flags, command
    for command in ("score", "plan"):  # both run under a process group
        assert "--dist-timeout" in {f for a in _visible(COMMANDS[command]) for f in a.option_strings}


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["score", "m", "--lane-search-samples", "0"], "expected a positive integer, got 0"),
        (["score", "m", "--num-samples", "-3"], "expected a positive integer, got -3"),
        (["verify", "a", "b", "--tolerance", "-1"], "expected a finite number >= 0, got '-1'"),
        (["verify", "a", "b", "--tolerance", "nan"], "expected a finite number >= 0, got 'nan'"),
        (["slice", "m", "-o", "x", "--ridge", "0"], "expected a finite number > 0, got '0'"),
        (["slice", "m", "-o", "x", "--ridge", "inf"], "expected a finite number > 0, got 'inf'"),
        (
            ["plan", "m", "--scores", "s", "-o", "p", "--dist-timeout", "0"],
            "expected a number of seconds > 0",
        ),
        (["demo", "--threads", "0"], "expected a positive integer, got 0"),
        (["demo", "--num-random", "-1"], "expected an integer >= 0, got -1"),
    ],
)
def test_numbers_are_checked_when_the_command_line_is_read(argv, expected, capsys):
    with pytest.raises(SystemExit) as stop:
        main(argv)
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert expected in err and "Traceback" not in err, err


@pytest.mark.parametrize(
    "command, old, new, dest, value",
    [
        ("demo", "--calibration-windows", "--num-samples", "num_samples", 8),
        ("demo", "--validation-windows", "--eval-samples", "eval_samples", 8),
        ("verify", "--num-sequences", "--num-samples", "num_samples", 3),
        ("slice", "--compensate", "--compensation-stats", "compensation_stats", "stats.safetensors"),
        ("score", "--refine", "--lane-search", "lane_search", ("lanes", True)),
        ("prune", "--refine", "--lane-search", "lane_search", ("lanes", True)),
        ("score", "--refine-samples", "--lane-search-samples", "lane_search_samples", 3),
        ("prune", "--refine-samples", "--lane-search-samples", "lane_search_samples", 3),
        ("plan", "--refine-generations", "--evolve-generations", "evolve_generations", 5),
        ("prune", "--refine-generations", "--evolve-generations", "evolve_generations", 5),
        ("plan", "--refine-offspring", "--evolve-offspring", "evolve_offspring", 3),
        ("plan", "--refine-seed", "--evolve-seed", "evolve_seed", 7),
        (
            "score",
            "--sub-blocks",
            "--blocks",
            "blocks",
            (None, "gdn,attention,mlp,shared_expert,experts,depth"),
        ),
    ],
)
def test_deprecated_spellings_still_work_and_say_so(command, old, new, dest, value, capsys, recwarn):
    from gdnprune.cli import build_parser

    positional = {
        "demo": [],
        "verify": ["a", "b"],
        "slice": ["m", "-o", "x"],
        "score": ["m", "-o", "s"],
        "plan": ["m", "--scores", "s", "-o", "p"],
        "prune": ["m", "-o", "x", "--data", "d"],
    }[command]
    given, expected = value if isinstance(value, tuple) else (value, value)
    args = build_parser(command).parse_args(
        [command, *positional, old, *([] if given is None else [str(given)])]
    )
    assert getattr(args, dest) == expected
    assert any(old in str(w.message) and new in str(w.message) for w in recwarn.list)


# ---- messages and exit codes --------------------------------------------------------------------------


def test_library_errors_name_keywords_and_the_cli_names_flags(tmp_path, capsys):
    from gdnprune.checkpoint import sort_checkpoint

    src = build_source(tmp_path / "model", "qwen3_next")
    scores = tmp_path / "scores.json"
    scores.write_text(json.dumps(scores_for(src, "qwen3_next")))
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(ValueError) as caught:
        sort_checkpoint(src, scores, out)
    assert "overwrite=True" in str(caught.value) and "--" not in str(caught.value)
    assert main(["sort", str(src), "--scores", str(scores), "-o", str(out), "-q"]) == 2
    err = capsys.readouterr().err
    assert "pass --overwrite to replace it" in err and "overwrite=True" not in err, err


def test_exit_code_tells_the_users_mistake_from_the_environments_failure():
    assert exit_code(OSError(errno.ENOSPC, "No space left on device")) == 1
    assert exit_code(OSError(errno.EIO, "Input/output error")) == 1
    assert exit_code(FileNotFoundError(errno.ENOENT, "No such file or directory")) == 2
    assert exit_code(ValueError("bad target")) == 2
    assert exit_code(PermissionError(errno.EACCES, "Permission denied")) == 2
    from gdnprune import cli
    from gdnprune.runtime import distributed, fileio

    # one table: the CLI and a failing rank classify an OSError the same way
    assert cli.USER_ERRNOS is distributed.USER_ERRNOS is fileio.USER_ERRNOS


@pytest.fixture
def tiny_tmpfs(tmp_path):
    """A 64 KiB tmpfs (mounting is the only reliable way to fill a disk as root)."""
    with tmpfs(
        tmp_path / "tiny", "size=64k", "a small tmpfs (a full disk cannot be simulated otherwise)"
    ) as mnt:
        yield mnt


def test_a_full_disk_exits_1_and_leaves_nothing(tmp_path, tiny_tmpfs, capsys):
    src = build_source(tmp_path / "model", "qwen3_next")
    (src / "padding.txt").write_bytes(os.urandom(256 * 1024))  # an other file that cannot fit in 64 KiB
    code = main(["slice", str(src), "-o", str(tiny_tmpfs / "sliced"), "-q", *TARGET_ARGS])
    err = capsys.readouterr().err
    assert code == 1, err
    errors = [line for line in err.splitlines() if line.startswith("gdnprune slice: error: ")]
    assert len(errors) == 1 and "No space left on device" in errors[0] and "Traceback" not in err, err
    assert os.listdir(tiny_tmpfs) == []  # the temporary folder is gone


def test_a_special_file_in_the_model_folder_is_skipped_with_a_note(tmp_path, capsys):
    src = build_source(tmp_path / "model", "qwen3_next")
    os.mkfifo(src / "pipe")
    out = tmp_path / "sliced"
    assert main(["slice", str(src), "-o", str(out), "-q", *TARGET_ARGS]) == 0
    err = capsys.readouterr().err
    notes = [line for line in err.splitlines() if "pipe" in line]
    assert len(notes) == 1 and notes[0].startswith("gdnprune slice: warning: ") and "skipped" in notes[0], err
    assert not (out / "pipe").exists() and (out / "config.json").is_file()


def test_inspect_says_what_the_percentage_is_of(tmp_path, capsys):
    src = build_source(tmp_path / "model", "qwen3_next")
    assert main(["inspect", str(src)]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert "of all parameters" in last, last


def test_demo_refuses_an_existing_folder_and_replaces_only_an_earlier_output(tmp_path, capsys):
    other = tmp_path / "mine"
    other.mkdir()
    (other / "notes.txt").write_text("keep me")
    small = [
        "--num-samples",
        "1",
        "--eval-samples",
        "1",
        "--num-random",
        "0",
        "--seq-len",
        "16",
        "--recover-steps",
        "0",
        "--no-plan",
        "--no-checkpoints",
        "--eval-limit",
        "0",
        "-q",
    ]
    assert main(["demo", "-o", str(other), *small]) == 2
    assert "already exists" in capsys.readouterr().err
    assert main(["demo", "-o", str(other), "--overwrite", *small]) == 2
    assert "refusing to replace" in capsys.readouterr().err and (other / "notes.txt").read_text() == "keep me"
    out = tmp_path / "demo"
    assert main(["demo", "-o", str(out), *small]) == 0
    first = json.loads((out / "results.json").read_text())
    assert main(["demo", "-o", str(out), "--overwrite", *small]) == 0
    assert json.loads((out / "results.json").read_text())["rows"] == first["rows"]
    assert sorted(os.listdir(tmp_path)) == ["demo", "mine"]  # no temporary folder left


def test_top_level_help_names_every_stage(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    for stage in ("score", "sort", "plan", "slice", "prune", "distill"):
        assert stage in out.split("positional arguments")[0], out


def test_a_command_leaves_the_heap_frozen_at_exit(tmp_path):
    """At exit, and only then, a process that ran a command has its objects out of the garbage collector's reach
    (the interpreter's last collection skips them); a handler registered before the command runs after its own."""
    script = (
        "import atexit, contextlib, gc, io\n"
        "atexit.register(lambda: print('frozen at exit:', gc.get_freeze_count() > 0))\n"
        "from gdnprune.cli import main\n"
        "with contextlib.suppress(SystemExit), contextlib.redirect_stdout(io.StringIO()):\n"
        "    main(['inspect', '--help'])\n"
        "print('frozen while running:', gc.get_freeze_count() > 0)\n"
    )
    done = subprocess.run([sys.executable, "-c", script], env=child_env(), cwd=tmp_path, capture_output=True,
                          text=True, timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["frozen while running: False", "frozen at exit: True"]
