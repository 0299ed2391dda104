"""The suite's hooks and fixtures that need torch (tests/conftest.py registers this module where tests run:
in a plain run and in each pytest-xdist worker, not in xdist's controller, which only hands out the files)."""

import gc
import json
import threading
from pathlib import Path

import pytest
import torch
from helpers import GC_THRESHOLD, scored_source
from launches import (
    TRAINED_MOE,
    Launch,
    shared_folder,
    shared_inputs,
    shared_launch,
    write_inputs_unless_busy,
)

# one thread: the test models are tiny, and on a shared machine extra threads spin and slow everything down
torch.set_num_threads(1)
# the young generation collected every 50,000 new objects (helpers.GC_THRESHOLD): 3 % less CPU on
# test_plan_halving and test_core_models
gc.set_threshold(*GC_THRESHOLD)


def pytest_collection_finish(session: pytest.Session) -> None:
    """Freeze what the collection left (torch, transformers, lm-eval, the test modules: millions of objects that
    live until the end) out of the cyclic garbage collector's reach. Each full collection walked them all, about
    0.4 s here, and the Trainer runs one at the start of every training (accelerate's ``free_memory``): a
    third of test_distill_pipeline's CPU time went to it. Reference counting still frees them as before."""
    gc.freeze()


@pytest.fixture(scope="module", autouse=True)
def _freeze_before_each_module():
    """The same at each test file's start, before its own fixtures: the previous files' garbage collected, what
    lives on (the session's fixtures, lazily imported modules) frozen, so that a file's collections walk only
    its own objects."""
    gc.collect()
    gc.freeze()


# the suite's one 2-process launch (tests/launches.py) and its inputs: once per session, whichever workers
# read it (the first one asking runs it, the others wait for its record)


@pytest.fixture(scope="session")
def launch_inputs(tmp_path_factory) -> Path:
    """The folder of the launch's inputs (tests/launches.py's shared_inputs)."""
    return shared_inputs(shared_folder(tmp_path_factory))


@pytest.fixture(scope="session")
def launch_model(launch_inputs) -> Path:
    return launch_inputs / "model"


@pytest.fixture(scope="session")
def launch_text(launch_inputs) -> Path:
    return launch_inputs / "calib.txt"


@pytest.fixture(scope="session")
def launch(tmp_path_factory) -> Launch:
    return shared_launch(shared_folder(tmp_path_factory), TRAINED_MOE)


@pytest.fixture(scope="session", autouse=True)
def launch_in_background(request, tmp_path_factory):
    """When any collected test reads the launch: start it with the session, in a thread of this worker, so that it
    runs beside the other tests instead of being waited for by its first reader (whose ``launch`` then finds
    its record, or waits on its lock for the rest). Joined at the session's end: no launch outlives pytest.
    A failure here is left to the readers, which run the launch again and report it. Its inputs are written
    first, here, by the worker that finds the lock free: the thread only waits on the launch's process."""
    if not any("launch" in item.fixturenames for item in request.session.items):
        yield
        return
    folder = shared_folder(tmp_path_factory)
    write_inputs_unless_busy(folder)

    def run() -> None:
        try:
            shared_launch(folder, TRAINED_MOE)
        except Exception:  # noqa: BLE001 - the readers' own call reports it
            pass

    thread = threading.Thread(target=run, name="launch", daemon=True)
    thread.start()
    yield
    thread.join()


# lm-eval's simple_evaluate, the tests' reference, without its environment report


@pytest.fixture(scope="module")
def no_environment_report():
    """``simple_evaluate`` adds torch's environment report to its results: ``pip list``, compiler and driver
    versions, a second or two of subprocesses per call. No reference reads it; the numbers are unchanged."""
    import lm_eval.evaluator  # lazy: the eval extra, imported only by the files that use it

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(lm_eval.evaluator, "add_env_info", lambda results: None)
        yield


# the plan tests' model folder with its scores (test_plan_search, test_plan_refine)


@pytest.fixture(scope="module")
def scored_folder(tmp_path_factory):
    """A qwen3_5 model folder, its calibration text and the scores file `score` writes from them (one per
    test module that asks; tests/helpers.py's scored_source)."""
    src, text, scores = scored_source(tmp_path_factory.mktemp("plan_cli"))
    assert json.loads(scores.read_text())["layers"]
    return src, text, scores
