# Two commands: `make run` (train on the embedded default) and `make test` (the test suite).
# Both create the virtualenv on first use. Pass Hydra overrides with ARGS, e.g. make run ARGS="dp=cells".
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
ARGS ?=
PYTEST_ARGS ?=

.PHONY: setup run test test-fast bench clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install --upgrade pip
	# torch first and pinned: the local CPU wheel (an unpinned resolve downloads a CUDA build)
	$(VENV)/bin/pip install torch==2.13.0
	$(VENV)/bin/pip install -e ".[dev]"
	touch $@

setup: $(VENV)/.installed

run: setup
	$(PY) -m rlfw.train $(ARGS)

test: setup
	$(PY) -m pytest $(PYTEST_ARGS)

test-fast: setup
	$(PY) -m pytest -m "not e2e" $(PYTEST_ARGS)

bench: setup
	$(PY) bench/bench_learning.py

clean:
	rm -rf outputs .pytest_cache .hypothesis
