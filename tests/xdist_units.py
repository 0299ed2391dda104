"""How ``make test`` shares the suite between its pytest-xdist workers (``-n 2 --dist loadfile``).

A unit of work is a test file: one worker runs all of it, so its module fixtures are built once. The session's
one 2-process launch (``launch`` in suite.py) is shared across the workers through a file lock
(tests/launches.py), so the files that read it need not be one unit. The slowest units go first (conftest.py
sorts each worker's collection by :func:`rank`, the scheduler keeps that order), those that read the launch
after those that do not: a long file that started last would keep one worker busy while the other idles, and
a reader that came early would wait for the launch.

Imported by conftest.py's hooks only under xdist (it imports xdist).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from xdist.scheduler import LoadFileScheduling

#: the units that take longest (the sum of their tests' times in a whole run with `--durations=80`), in the
#: order the workers take them: first the slow units that do not read the shared launch, so that the launch
#: (started with the session, beside them) is done by the time the slow units that read it reach their
#: reader, each at its end (test_distill_pipeline, test_eval, test_plan_rank); before, both workers sat
#: waiting on it for 20-35 s; a unit not listed keeps its collection order after these
SLOWEST_FIRST = (
    "test_eval_tasks.py",
    "test_distill_cli.py",
    "test_install.py",
    "test_plan_recall.py",
    "test_demo.py",
    "test_plan_halving.py",
    "test_self_contained.py",
    "test_hidden.py",
    # readers of the launch from here on
    "test_distill_pipeline.py",
    "test_eval.py",
    "test_scale.py",
    "test_plan_rank.py",
    "test_distill.py",
    "test_plan_refine.py",
    "test_plan_whole.py",
    "test_distributed.py",
    "test_distill_outputs.py",
    "test_distill_fsdp.py",
    "test_sharded_loading.py",
    "test_corpus.py",
    "test_first_hour.py",
)


def rank(path: str | Path) -> int:
    """Where a test file goes in the run: its place in :data:`SLOWEST_FIRST`, else after them all."""
    name = Path(path).name
    return SLOWEST_FIRST.index(name) if name in SLOWEST_FIRST else len(SLOWEST_FIRST)


class FileUnits(LoadFileScheduling):
    """xdist's ``loadfile`` scheduling, in the order of the workers' collections (slowest first)."""

    def __init__(self, config: pytest.Config, log=None) -> None:
        super().__init__(config, log)
        # keep the collection's order (slowest first), not xdist's default of the most tests first
        config.option.loadscopereorder = False
