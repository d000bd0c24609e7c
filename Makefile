# Two entry points for a fresh machine: `make run` (the main job) and `make test` (the suite).
# Each creates .venv when missing and installs what it needs. The CPU build of torch goes in first:
# a bare `torch` requirement would pull a multi-GB CUDA build.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-dev
COLD_START := checkpoints/cold_start

.PHONY: install test run sft bench report clean

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@$(PY) -c "import torch" 2>/dev/null || $(VENV)/bin/pip install --quiet torch==2.13.0
	$(VENV)/bin/pip install --quiet -e '.[dev]'
	@touch $@

install: $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -q

$(COLD_START)/config.json: | $(STAMP)
	$(PY) -m experiments.sft

sft: $(COLD_START)/config.json

run: $(STAMP) $(COLD_START)/config.json
	$(PY) -m experiments.quickstart

bench: $(STAMP)
	$(PY) -m benchmarks.rl_step

clean:
	rm -rf outputs multirun wandb reports
