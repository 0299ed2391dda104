"""What gdnprune guarantees when things go wrong around it: signals, aliases, permissions, stale folders,
inputs that change while read, junk inputs. docs/commands.md ("Safety") lists these guarantees.

Signals are sent to real child processes (``python -c`` running the CLI on a numpy-built checkpoint, so no
torch import: each child takes well under a second); a patched function prints a marker and waits, so
that the signal arrives at a known point.
"""

from __future__ import annotations

import json
import os
import re
import select
import shutil
import signal
import stat
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import BYTES_TARGET, build_source, scores_for
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from gdnprune.checkpoint import output as output_mod
from gdnprune.cli import main
from gdnprune.io.scores_file import check_scores, read_scores, resolve_orders
from gdnprune.model.geometry import GDNShape

TARGET_ARGS = [a for k, v in BYTES_TARGET.items() for a in (f"--{k.replace('_', '-')}", str(v))]


@pytest.fixture
def source(tmp_path):
    src = build_source(tmp_path / "model", "qwen3_next")
    (tmp_path / "scores.json").write_text(json.dumps(scores_for(src, "qwen3_next")))
    return src


def leftovers(parent: Path) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if "gdnprune-" in p.name)


def tree(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


# ---- children that stop at a known point ------------------------------------------------------------------

_CHILD = """
import os, signal, sys, time
import gdnprune.checkpoint.engine as engine, gdnprune.checkpoint.output as output
def marker(text):
    sys.stdout.write(text + "\\n"); sys.stdout.flush()
{patch}
from gdnprune.cli import main
sys.exit(main({argv!r}))
"""


def start_child(argv: list[str], patch: str) -> subprocess.Popen:
    code = _CHILD.format(patch=textwrap.dedent(patch), argv=[str(a) for a in argv])
    return subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def wait_for(child: subprocess.Popen, text: str, timeout: float = 60) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        ready, _, _ = select.select([child.stdout], [], [], deadline - time.time())
        if ready:
            line = child.stdout.readline()
            if line.strip() == text:
                return
            if not line and child.poll() is not None:
                break
    child.kill()
    raise AssertionError(f"the child never printed {text!r}: {child.stderr.read()}")


PAUSE_IN_COPY = """
real_copy = engine.copy_range
def copy_range(*args, **kwargs):
    marker("PAUSE")
    time.sleep(60)
    return real_copy(*args, **kwargs)
engine.copy_range = copy_range
"""


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP, signal.SIGINT])
def test_a_signal_during_sort_removes_everything_and_exits_128_plus_the_signal(sig, source, tmp_path):
    out = tmp_path / "new" / "out"
    child = start_child(
        ["sort", source, "--scores", tmp_path / "scores.json", "-o", out, "-q"], PAUSE_IN_COPY
    )
    wait_for(child, "PAUSE")
    child.send_signal(sig)
    _, err = child.communicate(timeout=60)
    assert child.returncode == 128 + sig
    assert err.strip().splitlines() == [
        f"gdnprune sort: interrupted by {signal.Signals(sig).name}; stopped without leaving a partial output"
    ]
    assert not (
        tmp_path / "new"
    ).exists()  # neither the output, its temporary folder, nor the parent made for it


def test_a_second_ctrl_c_during_cleanup_does_not_stop_the_cleanup(source, tmp_path):
    out = tmp_path / "out"
    patch = (
        PAUSE_IN_COPY
        + """
real_rmtree = output.shutil.rmtree
def rmtree(*args, **kwargs):
    marker("CLEANING")
    time.sleep(1.0)
    return real_rmtree(*args, **kwargs)
output.shutil.rmtree = rmtree
"""
    )
    child = start_child(["slice", source, "-o", out, "-q", *TARGET_ARGS], patch)
    wait_for(child, "PAUSE")
    child.send_signal(signal.SIGINT)
    wait_for(child, "CLEANING")
    child.send_signal(signal.SIGINT)  # held until the cleanup is done, then dropped
    child.communicate(timeout=60)
    assert child.returncode == 130
    assert not out.exists() and leftovers(tmp_path) == []


def test_ctrl_c_right_after_the_temporary_folder_is_made_leaves_nothing(source, tmp_path):
    out = tmp_path / "out"
    patch = """
real_mkdtemp = output.tempfile.mkdtemp
def mkdtemp(*args, **kwargs):
    path = real_mkdtemp(*args, **kwargs)
    os.kill(os.getpid(), signal.SIGINT)  # arrives before the code that would remove the folder on error
    return path
output.tempfile.mkdtemp = mkdtemp
"""
    child = start_child(["slice", source, "-o", out, "-q", *TARGET_ARGS], patch)
    child.communicate(timeout=60)
    assert child.returncode == 130
    assert not out.exists() and leftovers(tmp_path) == []


def test_ctrl_c_during_the_overwrite_swap_completes_it_and_says_so(source, tmp_path):
    out = tmp_path / "out"
    assert main(["slice", str(source), "-o", str(out), "-q", *TARGET_ARGS]) == 0
    before = json.loads((out / "gdnprune.json").read_text())["created"]
    patch = f"""
real_rename = os.rename
def rename(src, dst):
    if str(src) == {str(out)!r}:
        os.kill(os.getpid(), signal.SIGINT)  # between moving the old output aside and moving the new one in
    return real_rename(src, dst)
os.rename = rename
"""
    child = start_child(
        ["sort", source, "--scores", tmp_path / "scores.json", "-o", out, "-q", "--overwrite"], patch
    )
    _, err = child.communicate(timeout=60)
    assert child.returncode == 0, err
    assert "the move was completed first" in err and str(out) in err
    manifest = json.loads((out / "gdnprune.json").read_text())
    assert manifest["operation"] == "sort" and manifest["created"] >= before
    assert leftovers(tmp_path) == []


# ---- stale temporary folders -------------------------------------------------------------------------------


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def _stale(parent: Path, out_name: str, suffix: str, owner: dict | None) -> Path:
    folder = parent / f".{out_name}.gdnprune-{suffix}"
    folder.mkdir()
    (folder / "model-00001-of-00003.safetensors").write_bytes(b"x" * 1000)
    if owner is not None:
        (folder / output_mod.OWNER_NAME).write_text(json.dumps(owner))
    return folder


def test_stale_temporary_folders_are_removed_when_provably_stale_and_named_otherwise(
    source, tmp_path, capsys
):
    import socket

    host = socket.gethostname()
    dead = _stale(
        tmp_path,
        "out",
        "dead",
        {"pid": _dead_pid(), "start": "1", "host": host, "boot_id": output_mod._boot_id()},
    )
    alive = _stale(tmp_path, "out", "alive", output_mod._owner())  # this very process: alive
    unknown = _stale(tmp_path, "out", "unknown", None)
    other_host = _stale(tmp_path, "out", "remote", {"pid": 1, "start": "1", "host": host + "-elsewhere"})
    assert main(["slice", str(source), "-o", str(tmp_path / "out"), "-q", *TARGET_ARGS]) == 0
    err = capsys.readouterr().err
    assert not dead.exists() and f"removed {dead}" in err
    for kept in (alive, unknown, other_host):
        assert kept.exists() and f"{kept} is a temporary folder of another gdnprune run" in err


def test_a_previous_output_left_aside_by_a_killed_overwrite_is_restored(source, tmp_path, capsys):
    out = tmp_path / "out"
    aside = _stale(
        tmp_path,
        "out",
        "old-x",
        {"pid": _dead_pid(), "start": "1", "host": __import__("socket").gethostname()},
    )
    (aside / "previous").mkdir()
    (aside / "previous" / "config.json").write_text('{"previous": true}')
    assert main(["slice", str(source), "-o", str(out), "-q", *TARGET_ARGS]) == 2  # out exists again: refused
    err = capsys.readouterr().err
    assert "restored the previous output" in err and "already exists" in err
    assert json.loads((out / "config.json").read_text()) == {"previous": True} and not aside.exists()


# ---- the input under another path, or changing while read ---------------------------------------------------


def _refuses_the_alias(source: Path, data: Path, alias: Path, tmp_path: Path, capsys) -> None:
    """``alias`` is ``data`` (the folder that holds the model ``source``) under another path: an output there,
    or inside the model through it, is refused, and so is the alias of the model as input with ``data`` as output."""
    before = tree(source)
    for out in (alias / "model", alias / "model" / "inside"):
        assert (
            main(
                [
                    "sort",
                    str(source),
                    "--scores",
                    str(tmp_path / "scores.json"),
                    "-o",
                    str(out),
                    "--overwrite",
                    "-q",
                ]
            )
            == 2
        )
        assert "model folder" in capsys.readouterr().err
    assert (
        main(
            [
                "sort",
                str(alias / "model"),
                "--scores",
                str(tmp_path / "scores.json"),
                "-o",
                str(data),
                "--overwrite",
                "-q",
            ]
        )
        == 2
    )
    assert "model folder" in capsys.readouterr().err
    assert tree(source) == before


def test_an_output_that_is_the_input_through_a_bind_mount_is_refused(source, tmp_path, capsys):
    data, alias = source.parent, tmp_path / "alias"
    alias.mkdir()
    mounted = subprocess.run(["mount", "--bind", str(data), str(alias)], capture_output=True, text=True)
    if mounted.returncode:
        pytest.skip(
            f"mount --bind needs root (CAP_SYS_ADMIN): {' '.join(mounted.stderr.split())[:120]}; "
            "the symlink alias is tested on its own"
        )
    try:
        assert os.path.ismount(alias) and os.path.samefile(alias / "model", source)
        _refuses_the_alias(source, data, alias, tmp_path, capsys)
    finally:
        subprocess.run(["umount", str(alias)], check=True)


def test_an_output_that_is_the_input_through_a_symlink_is_refused(source, tmp_path, capsys):
    data, alias = source.parent, tmp_path / "alias"
    alias.symlink_to(data)
    _refuses_the_alias(source, data, alias, tmp_path, capsys)


def test_overwrite_never_replaces_a_folder_that_is_not_a_model_folder(source, tmp_path, capsys):
    home = tmp_path / "home"
    home.mkdir()
    (home / "notes.txt").write_text("precious")
    assert main(["slice", str(source), "-o", str(home), "-q", "--overwrite", *TARGET_ARGS]) == 2
    assert "not a model folder" in capsys.readouterr().err and (home / "notes.txt").read_text() == "precious"


def test_a_shard_truncated_while_read_gives_a_clear_error(source, tmp_path, monkeypatch, capsys):
    from gdnprune.checkpoint import engine

    shards = sorted(source.glob("*.safetensors"))
    real = engine.copy_unchanged

    def truncate_then_copy(plan, on_chunk):
        if plan.index == 0:
            with open(shards[-1], "r+b") as f:
                f.truncate(os.path.getsize(shards[-1]) // 2)
        return real(plan, on_chunk)

    monkeypatch.setattr(engine, "copy_unchanged", truncate_then_copy)
    out = tmp_path / "out"
    monkeypatch.setattr("gdnprune.checkpoint.transform.copy_unchanged", truncate_then_copy)
    assert main(["sort", str(source), "--scores", str(tmp_path / "scores.json"), "-o", str(out), "-q"]) == 2
    assert "input changed while reading" in capsys.readouterr().err
    assert not out.exists() and leftovers(tmp_path) == []


def test_a_shard_rewritten_while_read_gives_a_clear_error(source, tmp_path, monkeypatch, capsys):
    from gdnprune.checkpoint import transform

    first = sorted(source.glob("*.safetensors"))[0]
    real = transform.copy_unchanged

    def touch_then_copy(plan, on_chunk):
        if plan.index == 0:
            os.utime(first, ns=(time.time_ns(), time.time_ns() + 10**9))  # same size, rewritten
        return real(plan, on_chunk)

    monkeypatch.setattr(transform, "copy_unchanged", touch_then_copy)
    out = tmp_path / "out"
    assert main(["slice", str(source), "-o", str(out), "-q", *TARGET_ARGS]) == 2
    assert "input changed while reading" in capsys.readouterr().err
    assert not out.exists() and leftovers(tmp_path) == []


# ---- outputs people can use --------------------------------------------------------------------------------


def test_outputs_follow_the_umask(source, tmp_path):
    from gdnprune.io.scores_file import save_scores

    previous = os.umask(0o002)
    try:
        out = tmp_path / "out"
        assert main(["slice", str(source), "-o", str(out), "-q", *TARGET_ARGS]) == 0
        scores = save_scores(
            scores_for(source, "qwen3_next")
            | {
                "layers": {
                    k: {
                        **v,
                        "shape": {
                            "num_key_heads": 2,
                            "num_value_heads": 6,
                            "key_head_dim": 6,
                            "value_head_dim": 4,
                        },
                    }
                    for k, v in scores_for(source, "qwen3_next")["layers"].items()
                }
            },
            tmp_path / "s.json",
        )
    finally:
        os.umask(previous)
    assert stat.S_IMODE(out.stat().st_mode) == 0o775
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in out.iterdir()}
    copied = modes.pop("tokenizer_config.json")  # copied as cp copies: the source's mode under the umask
    assert copied == stat.S_IMODE((source / "tokenizer_config.json").stat().st_mode) & ~0o002
    assert set(modes.values()) == {0o664}, modes  # written: 0666 under the umask, as save_pretrained writes
    assert stat.S_IMODE(scores.stat().st_mode) == 0o664


def test_a_late_input_error_leaves_no_folders_behind(source, tmp_path, capsys):
    (tmp_path / "bad.json").write_text(
        json.dumps(
            {"layers": {"model.layers.0.linear_attn": {"key_group_order_most_important_first": [0, 0]}}}
        )
    )
    out = tmp_path / "new1" / "new2" / "out"
    assert main(["sort", str(source), "--scores", str(tmp_path / "bad.json"), "-o", str(out), "-q"]) == 2
    assert "not a permutation" in capsys.readouterr().err
    assert not (tmp_path / "new1").exists()


def test_a_symlink_loop_in_the_model_folder_is_refused_in_one_line(source, tmp_path, capsys):
    (source / "loop").symlink_to(".")
    out = tmp_path / "out"
    assert main(["slice", str(source), "-o", str(out), "-q", *TARGET_ARGS]) == 2
    err = [line for line in capsys.readouterr().err.strip().splitlines() if ": error: " in line]
    assert len(err) == 1 and "symlink loop" in err[0] and len(err[0]) < 300
    assert not out.exists() and leftovers(tmp_path) == []


def test_subfolders_are_copied_without_their_weight_files(source, tmp_path, capsys):
    (source / "original").mkdir()
    (source / "original" / "consolidated.00.pth").write_bytes(b"w" * 100)
    (source / "original" / "params.json").write_text("{}")
    (source / "linked.json").symlink_to(source / "config.json")  # HF cache snapshots are symlinks to blobs
    out = tmp_path / "out"
    assert main(["slice", str(source), "-o", str(out), "-q", *TARGET_ARGS]) == 0
    assert "original/consolidated.00.pth" in capsys.readouterr().err
    assert (out / "original" / "params.json").is_file() and not (
        out / "original" / "consolidated.00.pth"
    ).exists()
    assert (
        not (out / "linked.json").is_symlink()
        and (out / "linked.json").read_bytes() == (source / "config.json").read_bytes()
    )


# ---- the core API takes the integers people have ---------------------------------------------------------


def test_gdnshape_accepts_integral_numpy_and_torch_scalars_and_refuses_the_rest():
    shape = GDNShape(np.int64(2), np.int32(4), torch.tensor(8), np.array(6, dtype=np.uint8))
    assert shape == GDNShape(2, 4, 8, 6) and all(type(v) is int for v in shape.as_dict().values())
    for bad in (
        True,
        2.0,
        np.float64(2),
        torch.tensor(2.0),
        torch.tensor(True),
        np.bool_(True),
        torch.tensor([2]),
        np.array([2]),
        "2",
        None,
    ):
        with pytest.raises(ValueError, match="must be a positive integer"):
            GDNShape(bad, 4, 8, 6)


# ---- junk in, one clean error out ------------------------------------------------------------------------

_JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-5, 10) | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=12), children, max_size=4)
    ),
    max_leaves=20,
)
_ORDER_KEYS = [
    "key_group_order_most_important_first",
    "value_lane_order_most_important_first",
    "key_dim_order_most_important_first",
    "value_dim_order_most_important_first",
    "shape",
]
_PAYLOAD = st.dictionaries(st.sampled_from(_ORDER_KEYS), _JSON, max_size=5)


@settings(max_examples=150, deadline=None)
@given(
    scores=_JSON
    | st.fixed_dictionaries(
        {"layers": st.dictionaries(st.text(max_size=30), _PAYLOAD, max_size=3)},
        optional={"format": st.just("gdnprune-scores"), "version": st.just(1)},
    )
)
def test_the_scores_parsers_give_clean_errors_for_junk(scores):
    shapes = {"model.layers.0.linear_attn": GDNShape(2, 4, 8, 6)}
    for parse in (read_scores, check_scores, lambda s: resolve_orders(read_scores(s)["layers"], shapes)):
        try:
            parse(scores)
        except ValueError as exc:
            assert str(exc)  # a message, never a bare error
    # what a parser accepts has the structure it promises
    try:
        layers = read_scores(scores)["layers"]
    except ValueError:
        return
    assert isinstance(layers, dict) and all(isinstance(p, dict) for p in layers.values())


@st.composite
def _geometry(draw):
    hk, r = draw(st.integers(1, 3)), draw(st.integers(1, 3))
    return GDNShape(hk, hk * r, draw(st.integers(1, 4)), draw(st.integers(1, 4)))


@st.composite
def _valid_payload(draw, shape: GDNShape):
    """The four orders of a permutation of ``shape`` (as ``gdnprune score`` writes them) and its shape."""

    def perm(n):
        return draw(st.permutations(range(n)))

    return {
        "key_group_order_most_important_first": perm(shape.num_key_heads),
        "value_lane_order_most_important_first": [
            perm(shape.value_heads_per_group) for _ in range(shape.num_key_heads)
        ],
        "key_dim_order_most_important_first": [perm(shape.key_head_dim) for _ in range(shape.num_key_heads)],
        "value_dim_order_most_important_first": perm(shape.value_head_dim),
        "shape": shape.as_dict(),
    }


@settings(max_examples=60, deadline=None)
@given(data=st.data(), vl=st.booleans())
def test_the_scores_parsers_accept_every_valid_scores_file_and_keep_its_orders(data, vl):
    """The other half of the junk test: a parser that refused everything would pass it, not this."""
    from gdnprune.io.scores_file import SCORES_FORMAT, SCORES_VERSION
    from gdnprune.model.geometry import ORDER_KEYS

    shapes = {f"model.layers.{i}.linear_attn": data.draw(_geometry()) for i in (0, 2)}
    # a vision-language checkpoint's prefixes; scores written with or without "language_model."
    on_disk = {p.replace("model.", "model.language_model.") if vl else p: s for p, s in shapes.items()}
    layers = {p: data.draw(_valid_payload(s)) for p, s in shapes.items()}
    scores = {"format": SCORES_FORMAT, "version": SCORES_VERSION, "layers": layers, "method": "by hand"}
    assert read_scores(scores)["layers"] == layers
    assert check_scores(scores) == scores
    orders, missing = resolve_orders(read_scores(scores)["layers"], on_disk)
    assert missing == [] and set(orders) == set(on_disk)
    for prefix, payload in layers.items():
        got = orders[prefix.replace("model.", "model.language_model.") if vl else prefix]
        as_lists = {
            key: got[name].tolist()
            for name, key in zip(("key_groups", "value_lanes", "key_dim", "value_dim"), ORDER_KEYS)
        }
        assert as_lists == {
            k: [list(row) if isinstance(row, (list, tuple)) else row for row in v]
            for k, v in payload.items()
            if k != "shape"
        }


@settings(max_examples=150, deadline=None)
@given(
    config=_JSON
    | st.dictionaries(
        st.sampled_from(
            [
                "linear_num_key_heads",
                "linear_num_value_heads",
                "linear_key_head_dim",
                "linear_value_head_dim",
                "text_config",
            ]
        ),
        _JSON,
        max_size=5,
    )
)
def test_the_config_parser_gives_clean_errors_for_junk(config):
    try:
        shape = GDNShape.from_config(config)
    except ValueError as exc:
        assert str(exc)
        return
    assert isinstance(shape, GDNShape)  # accepted junk is a real geometry: positive ints, Hv a multiple of Hk


@settings(max_examples=60, deadline=None)
@given(
    shape=_geometry(),
    nested=st.booleans(),
    extra=st.dictionaries(st.sampled_from(["hidden_size", "model_type", "layer_types"]), _JSON),
)
def test_the_config_parser_reads_every_valid_geometry(shape, nested, extra):
    keys = {
        "linear_num_key_heads": shape.num_key_heads,
        "linear_num_value_heads": shape.num_value_heads,
        "linear_key_head_dim": shape.key_head_dim,
        "linear_value_head_dim": shape.value_head_dim,
    }
    config = {**extra, "text_config": {**extra, **keys}} if nested else {**extra, **keys}
    assert GDNShape.from_config(config) == shape


_ARG = st.sampled_from(
    [
        "--num-key-heads",
        "--num-value-heads",
        "--key-head-dim",
        "--value-head-dim",
        "--scores",
        "-o",
        "--overwrite",
        "-q",
        "--json",
        "0",
        "-1",
        "3",
        "x",
        "",
        "--",
        "--tolerance",
    ]
) | st.text(max_size=6)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(command=st.sampled_from(["inspect", "sort", "slice"]), args=st.lists(_ARG, max_size=6))
@example(command="inspect", args=["\n0"])  # argparse echoes the junk, newline and all, in its error line
def test_junk_command_lines_exit_cleanly(command, args, source, tmp_path, capsys):
    argv = [command, str(source), *args]
    if command != "inspect":
        argv += ["-o", str(tmp_path / "junk-out")]
    try:
        code = main(argv)
    except SystemExit as exc:  # argparse: usage error
        code = exc.code
    assert code in (0, 2)
    captured = capsys.readouterr()
    err = captured.err
    if code == 2:  # one error, at the end, that names the command and says what is wrong (argparse's words or
        # ours; the junk it quotes may hold newlines); before it only argparse's usage or our warnings
        found = re.search(rf"(?m)^gdnprune( {command})?: error: \S", err)
        assert found and err.count(": error: ") == 1, err
        before, after = err[: found.start()], err[found.end() :]
        assert not re.search(r"(?m)^(gdnprune|usage:|Traceback)", after), err  # the error is the last message
        assert before.startswith("usage:") or all(
            line.startswith(f"gdnprune {command}: warning: ") for line in before.splitlines()
        ), err
    else:  # it did what it was asked: printed help, an inspection, or wrote a model folder
        assert ": error: " not in err
        assert (
            captured.out.startswith("usage:")
            or (command == "inspect" and captured.out)
            or (tmp_path / "junk-out" / "config.json").is_file()
        ), captured
    shutil.rmtree(tmp_path / "junk-out", ignore_errors=True)
    assert leftovers(tmp_path) == []


@settings(max_examples=150, deadline=None)
@given(
    plan=_JSON
    | st.fixed_dictionaries(
        {
            "format": st.just("gdnprune-plan"),
            "version": st.just(1),
            "layers": st.dictionaries(
                st.text(max_size=30),
                _JSON
                | st.dictionaries(
                    st.sampled_from(
                        ["num_key_heads", "num_value_heads", "key_head_dim", "value_head_dim", "x"]
                    ),
                    _JSON,
                    max_size=4,
                ),
                max_size=3,
            ),
        },
        optional={"default": _JSON},
    )
)
def test_the_plan_parser_gives_clean_errors_for_junk(plan):
    from gdnprune.io.plan_file import read_plan, resolve_plan

    shapes = {"model.layers.0.linear_attn": GDNShape(2, 4, 8, 6)}
    for parse in (read_plan, lambda p: resolve_plan(p, shapes)):
        try:
            parse(plan)
        except ValueError as exc:
            assert str(exc)
    try:
        targets = resolve_plan(plan, shapes)
    except ValueError:
        return
    assert set(targets) == set(shapes) and all(isinstance(t, GDNShape) for t in targets.values())


@st.composite
def _fitting_fields(draw, shape: GDNShape):
    """Some of the four target fields, chosen so that the target fits ``shape``."""
    hk = draw(st.integers(1, shape.num_key_heads))
    fields = {
        "num_key_heads": hk,
        "num_value_heads": hk * draw(st.integers(1, shape.value_heads_per_group)),
        "key_head_dim": draw(st.integers(1, shape.key_head_dim)),
        "value_head_dim": draw(st.integers(1, shape.value_head_dim)),
    }
    keep = draw(st.sets(st.sampled_from(sorted(fields)), min_size=1))
    if keep & {
        "num_key_heads",
        "num_value_heads",
    }:  # a head count alone may not fit the other (Hv % Hk, lanes)
        keep |= {"num_key_heads", "num_value_heads"}
    return {k: v for k, v in fields.items() if k in keep}


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_the_plan_parser_accepts_every_fitting_plan_and_resolves_it(data):
    """The other half of the junk test: each layer gets its own fields, the default or its own shape, and a
    field not given keeps the layer's size."""
    from gdnprune.io.plan_file import read_plan, resolve_plan, save_plan

    shapes = {f"model.layers.{i}.linear_attn": data.draw(_geometry()) for i in range(3)}
    named = data.draw(st.sets(st.sampled_from(sorted(shapes))))
    layers = {p: data.draw(_fitting_fields(shapes[p])) for p in sorted(named)}
    unnamed_fit = {k: min(getattr(s, k) for s in shapes.values()) for k in ("key_head_dim", "value_head_dim")}
    default = data.draw(
        st.just(unnamed_fit) if not named else st.none() | st.just(unnamed_fit)
    )  # (a plan that
    # names no layer and has no default cuts nothing: refused)
    plan = {"format": "gdnprune-plan", "version": 1, "layers": layers, "predicted": {"kl": 0.5}}
    if default is not None:
        plan["default"] = default
    assert read_plan(plan)["layers"] == layers
    targets = resolve_plan(plan, shapes)
    for prefix, shape in shapes.items():
        fields = layers.get(prefix, default or {})
        want = {k: fields.get(k, v) for k, v in shape.as_dict().items()}
        assert targets[prefix].as_dict() == want, prefix
    import tempfile

    with tempfile.TemporaryDirectory() as folder:  # what save_plan writes, read_plan reads back the same
        path = save_plan(plan, Path(folder) / "plan.json")
        assert resolve_plan(path, shapes) == targets and json.loads(Path(path).read_text()) == plan
