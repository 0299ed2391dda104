# Two-command quick start: `make demo` and `make test`. Each creates .venv with pinned dependencies.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python

#: what ruff lints and format-checks (mypy reads its files from pyproject.toml: src/)
LINT_PATHS := src tests benchmarks scripts examples

.PHONY: demo test lint bench clean

$(VENV)/.installed: requirements-dev.txt pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check -r requirements-dev.txt
	$(PY) -m pip install --quiet --disable-pip-version-check --no-deps --no-build-isolation -e .
	touch $@

demo: $(VENV)/.installed
	$(PY) -m gdnprune demo --output demo_output --overwrite

# Static checks first: ruff (lint and format) and mypy on src/, zero findings.
lint: $(VENV)/.installed
	$(PY) -m ruff check $(LINT_PATHS)
	$(PY) -m ruff format --check $(LINT_PATHS)
	$(PY) -m mypy

# pytest-xdist: TEST_WORKERS processes share the suite, a test file each at a time, slowest files first
# (tests/xdist_units.py); `make test TEST_WORKERS=0` runs it in one process
TEST_WORKERS ?= 2

# PYTHONDONTWRITEBYTECODE unset: the suite's many processes (workers, launches, demos) then read the package's and
# the tests' compiled modules instead of compiling them again each (pytest's rewritten tests likewise)
test: lint
	PYTHONDONTWRITEBYTECODE= $(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile

# `make bench` lists the benchmarks and their claims; `make bench SUITE=transform ARGS="--rounds 6"` runs one
# (nice'd, one torch thread unless OMP_NUM_THREADS is set): python -m benchmarks SUITE ARGS
bench: $(VENV)/.installed
	OMP_NUM_THREADS=$${OMP_NUM_THREADS:-1} nice -n 10 $(PY) -m benchmarks $(SUITE) $(ARGS)

clean:
	rm -rf $(VENV) demo_output .pytest_cache .hypothesis .mypy_cache .ruff_cache
