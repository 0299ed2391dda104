# Two-command quick start: `make demo` and `make test`. Each creates .venv with pinned dependencies.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: demo test bench clean

$(VENV)/.installed: requirements-dev.txt pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check -r requirements-dev.txt
	$(PY) -m pip install --quiet --disable-pip-version-check --no-deps --no-build-isolation -e .
	touch $@

demo: $(VENV)/.installed
	$(PY) -m gdnprune demo --output demo_output --overwrite

test: $(VENV)/.installed
	$(PY) -m pytest -q

clean:
	rm -rf $(VENV) demo_output .pytest_cache .hypothesis
