import importlib
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))


def pytest_configure(config: pytest.Config) -> None:
    """The hooks and fixtures of tests/suite.py (it imports torch, transformers and gdnprune) where tests run: in
    a plain run and in each pytest-xdist worker. Not in xdist's controller, which only hands out the files:
    importing them there kept the workers from starting for 6 s."""
    if os.environ.get("PYTEST_XDIST_WORKER") or not config.getoption("numprocesses", None):
        config.pluginmanager.register(importlib.import_module("suite"), "gdnprune_suite")


# pytest-xdist (`make test` runs `-n 2 --dist loadfile`): test files are the units of work, the slowest first
# (tests/xdist_units.py)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log):
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist_units import FileUnits  # lazy: imports xdist, there only when it runs

    return FileUnits(config, log)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """On an xdist worker: the slowest units first (a stable sort: each file keeps its order)."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return  # a plain run keeps pytest's order
    from xdist_units import rank  # lazy: imports xdist, there only when it runs

    items.sort(key=lambda item: rank(item.path))
