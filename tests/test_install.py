"""A plain ``pip install gdnprune`` (no extras) runs the main job: ``demo`` and ``distill`` (issue 19, part 0).

What the fresh-install test proves, and what it does not:

* It builds a fresh virtual environment and installs this source tree into it with pip, *without extras*,
  through the package's own metadata (``pyproject.toml``), and then runs the installed ``gdnprune`` console
  script: a short ``demo`` (which distills too) and, side by side with it, a 2-step ``distill`` of a trained
  test model cut by ``slice``. Nothing of the test session's ``PYTHONPATH`` or editable install reaches it.
* So that torch is never downloaded, the new environment sees the packages of the environment running the
  tests through one ``.pth`` line pointing at a folder of links to them, *minus* ``accelerate``,
  ``matplotlib``, ``lm_eval`` and ``gdnprune`` itself. The test first checks that ``accelerate`` (needed by
  the transformers Trainer), ``matplotlib`` and ``lm_eval`` cannot be imported there, so when the commands
  succeed it is because pip installed ``accelerate`` as a core dependency, from the configured package
  index, and because the commands run without the ``plot`` and ``eval`` extras (each says so in one line,
  no traceback).
* Everything already present is constrained to its installed version (torch cannot be replaced or
  downloaded), and ``accelerate`` to its pin in ``requirements-dev.txt``: pip fails if that pin does not
  satisfy the core dependency. It does not prove that pip can *resolve* torch and the other core
  dependencies from scratch (that needs a download of torch); ``test_dev_pins_satisfy_core_dependencies``
  checks their declared ranges against the pins instead.
* The package is built without build isolation, with the ``setuptools`` of the running environment (a
  build-isolated install would download setuptools).
"""

from __future__ import annotations

import importlib.metadata
import os
import re
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
#: the distillation's teacher, and its student once cut (a trained test model: its tokenizer comes along)
TRAINED = ROOT / "tests" / "data" / "trained" / "qwen3_next"
#: what the fresh environment must not see from the running one: the package, what pip must install, and the
#: extras (``plot``: matplotlib; ``eval``: lm-eval), which a plain install does not bring
HIDDEN = re.compile(
    r"^(gdnprune|_?_?editable__|accelerate|matplotlib|mpl_toolkits|pylab\.py|lm_eval)", re.IGNORECASE
)
#: the modules of the extras: absent before the install and after it
EXTRAS = ("matplotlib", "lm_eval")


def _dev_pins() -> dict[str, str]:
    pins = {}
    for line in (ROOT / "requirements-dev.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if "==" in line:
            name, version = line.split("==", 1)
            pins[name.strip().lower()] = version.strip()
    return pins


def test_dev_pins_satisfy_core_dependencies():
    """Every core dependency is pinned in requirements-dev.txt, and the pin satisfies pyproject's range."""
    tomllib = pytest.importorskip("tomllib")
    from packaging.requirements import Requirement

    pins = _dev_pins()
    deps = [
        Requirement(d)
        for d in tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    ]
    assert "accelerate" in {d.name for d in deps}, (
        "the Trainer (demo, distill) needs accelerate: a core dependency"
    )
    for dep in deps:
        assert dep.name.lower() in pins, (
            f"{dep.name} is a core dependency but not pinned in requirements-dev.txt"
        )
        assert dep.specifier.contains(pins[dep.name.lower()], prereleases=True), (
            f"requirements-dev.txt pins {dep.name}=={pins[dep.name.lower()]}, outside pyproject's {dep}"
        )


def _view_of_running_environment(view: Path) -> list[str]:
    """Links to the running environment's packages except HIDDEN; returns the constraints that pin them."""
    view.mkdir()
    seen = set()
    for key in ("purelib", "platlib"):
        site = Path(sysconfig.get_paths()[key])
        if site in seen or not site.is_dir():
            continue
        seen.add(site)
        for entry in site.iterdir():
            if HIDDEN.match(entry.name) or entry.suffix == ".pth" or entry.name == "__pycache__":
                continue
            if not (view / entry.name).exists():
                (view / entry.name).symlink_to(entry)
    constraints = []
    for dist in importlib.metadata.distributions(path=[str(view)]):
        name = dist.metadata["Name"]
        if name:
            constraints.append(f"{name}=={dist.version}")
    return constraints


def _run(cmd, env, cwd, timeout=300):
    return subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout)


def _start(cmd, env, cwd) -> subprocess.Popen:
    return subprocess.Popen(cmd, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _finish(process: subprocess.Popen, timeout: float = 300) -> subprocess.CompletedProcess:
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    finally:
        process.kill()
    return subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)


@pytest.mark.slow
@pytest.mark.network
def test_plain_install_runs_demo_and_distill(tmp_path):
    pytest.importorskip("pip")
    view = tmp_path / "view"
    constraints = _view_of_running_environment(view)
    pins = _dev_pins()
    constraints.append(f"accelerate=={pins['accelerate']}")
    (tmp_path / "constraints.txt").write_text("\n".join(constraints) + "\n")

    venv = tmp_path / "fresh"
    subprocess.run(
        [getattr(sys, "_base_executable", sys.executable), "-m", "venv", "--without-pip", str(venv)],
        check=True,
    )
    python = venv / "bin" / "python"
    site = Path(
        _run(
            [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], None, tmp_path
        ).stdout.strip()
    )
    (site / "view.pth").write_text(f"{view}\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    env.update(OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", PIP_DISABLE_PIP_VERSION_CHECK="1")

    where = [
        str(python),
        "-c",
        "import importlib.util as u\n"
        "for m in ('torch', 'transformers', 'accelerate', 'matplotlib', 'lm_eval', 'gdnprune'):\n"
        "    spec = u.find_spec(m); print(m, spec.origin if spec else None)",
    ]  # finds, imports nothing
    before = _run(where, env, tmp_path)
    assert before.returncode == 0, before.stderr
    found = dict(line.split(" ", 1) for line in before.stdout.splitlines())
    assert found["torch"] != "None" and found["transformers"] != "None", found
    assert [m for m in ("accelerate", *EXTRAS, "gdnprune") if found[m] != "None"] == [], (
        f"the fresh environment must not see these before the install: {found}"
    )

    source = tmp_path / "source"  # pip builds in the source tree: build from a copy, never the checkout
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    shutil.copytree(ROOT / "src", source / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    install = _run(
        [
            sys.executable,
            "-m",
            "pip",
            "--python",
            str(python),
            "install",
            "--quiet",
            "--no-build-isolation",
            # pip's report on the other installed packages' requirements (the view's hundred: 1.3 s of CPU);
            # what this install resolves and installs is checked as before
            "--no-warn-conflicts",
            "--constraint",
            str(tmp_path / "constraints.txt"),
            str(source),
        ],
        env,
        tmp_path,
    )
    assert install.returncode == 0, install.stdout + install.stderr
    after = _run(where, env, tmp_path)
    found = dict(line.split(" ", 1) for line in after.stdout.splitlines())
    for module in ("accelerate", "gdnprune"):  # installed by pip, into the fresh environment
        assert found[module] != "None" and Path(found[module]).is_relative_to(venv), found
    assert [m for m in EXTRAS if found[m] != "None"] == [], found  # no extra came along

    gdnprune = str(venv / "bin" / "gdnprune")
    # the distillation's student: a trained test model cut by a torch-free `slice`, so that `distill` needs
    # nothing of the demo's and both commands run side by side (the second core is idle otherwise)
    student = _run(
        [
            gdnprune,
            "slice",
            str(TRAINED),
            "-o",
            "student",
            "--num-key-heads",
            "2",
            "--num-value-heads",
            "4",
            "-q",
        ],
        env,
        tmp_path,
    )
    assert student.returncode == 0, student.stdout + student.stderr
    (tmp_path / "train.txt").write_text("A plain install must run the main job. " * 200)
    demo = _start(
        [
            gdnprune,
            "demo",
            "--output",
            "demo",
            "--num-samples",
            "2",
            "--eval-samples",
            "2",
            "--num-random",
            "1",
            "--seq-len",
            "32",
            "--recover-steps",
            "2",
            "--quiet",
        ],
        env,
        tmp_path,
    )
    distill = _start(
        [
            gdnprune,
            "distill",
            "student",
            "--teacher",
            str(TRAINED),
            "--data",
            "train.txt",
            "--steps",
            "2",
            "--batch-size",
            "2",
            "--seq-len",
            "32",
            "--output",
            "rec",
            "--quiet",
        ],
        env,
        tmp_path,
    )
    demo, distill = _finish(demo), _finish(distill)
    assert demo.returncode == 0, demo.stdout + demo.stderr
    assert "recovery: validation loss" in demo.stdout
    assert (tmp_path / "demo" / "sliced" / "config.json").is_file()
    _one_line_about_matplotlib(demo)
    _one_line_about(demo, "lm-eval")  # the demo's eval table needs the eval extra: it says so and goes on

    assert distill.returncode == 0, distill.stdout + distill.stderr
    assert "2 steps" in distill.stdout and (tmp_path / "rec" / "model.safetensors").is_file()
    _one_line_about_matplotlib(distill)


def _one_line_about_matplotlib(result) -> None:
    _one_line_about(result, "matplotlib")


def _one_line_about(result, package: str) -> None:
    """The command said in one line, with how to install it, that ``package`` is missing; no traceback."""
    text = result.stdout + result.stderr
    assert "Traceback" not in text, text
    lines = [line for line in text.splitlines() if package in line]
    assert len(lines) == 1 and "install" in lines[0], text
