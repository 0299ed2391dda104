"""How ``make test`` shares the suite between its pytest-xdist workers (``-n 2 --dist loadfile``).

A unit of work is a test file: one worker runs all of it, so its module fixtures are built once. The files
that read the session's one 2-process launch (``launch`` in conftest.py) are one unit together, so that the
launch runs once. The slowest units go first (conftest.py sorts each worker's collection by :func:`rank`, the
scheduler keeps that order): a long file that started last would keep one worker busy while the other idles.

Imported by conftest.py's hooks only under xdist (it imports xdist).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from xdist.scheduler import LoadFileScheduling

#: the files that read the ``launch`` fixture (conftest.py checks that no other file does)
LAUNCH_FILES = ("test_distributed.py", "test_first_hour.py", "test_plan_bld.py", "test_plan_rank.py")

#: the units that take longest, slowest first (the sum of their tests' times in a whole `make test` run with
#: `--junitxml`); a unit not listed keeps its collection order after these
SLOWEST_FIRST = (
    "test_distill_pipeline.py",
    "test_distill_fsdp.py",
    "test_install.py",
    "test_eval_tasks.py",
    "test_distill.py",
    "launch",
    "test_plan_refine.py",
    "test_demo.py",
    "test_distill_cli.py",
    "test_eval.py",
)


def unit(path: str | Path) -> str:
    """The unit of work of a test file: ``launch`` for the files sharing the launch, else the file's name."""
    name = Path(path).name
    return "launch" if name in LAUNCH_FILES else name


def rank(path: str | Path) -> int:
    """Where a test file's unit goes in the run: its place in :data:`SLOWEST_FIRST`, else after them all."""
    name = unit(path)
    return SLOWEST_FIRST.index(name) if name in SLOWEST_FIRST else len(SLOWEST_FIRST)


class FileUnits(LoadFileScheduling):
    """xdist's ``loadfile`` scheduling with the launch's files as one unit, in the workers' order."""

    def __init__(self, config: pytest.Config, log=None) -> None:
        super().__init__(config, log)
        # keep the collection's order (slowest first), not xdist's default of the most tests first
        config.option.loadscopereorder = False

    def _split_scope(self, nodeid: str) -> str:
        return unit(nodeid.split("::", 1)[0])
