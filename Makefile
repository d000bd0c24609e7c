# Two entry points for a fresh machine: `make run` (the main job) and `make test` (the suite).
# Each creates .venv when missing and installs what it needs. The CPU build of torch goes in first:
# a bare `torch` requirement would pull a multi-GB CUDA build.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-dev
COLD_START := checkpoints/cold_start/tiny_moe-addition
SWEEP := multirun/quickstart/$(shell date +%Y-%m-%d_%H-%M-%S)

.PHONY: install test run sft bench clean

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

# The main job: cold start (once), the quickstart sweep (GRPO, GRPO + r2, GSPO), then the stability report.
run: $(STAMP) $(COLD_START)/config.json
	$(PY) -m experiments.train -m experiment=quickstart hydra.sweep.dir=$(SWEEP)
	$(PY) -m analysis.report $(SWEEP) --out $(SWEEP)/report

# The RL step against TRL's GRPOTrainer and the machine's limit, overheads and scaling (README "Performance").
bench: $(STAMP)
	$(VENV)/bin/pip install --quiet -e '.[dev,bench]'
	$(PY) -m benchmarks.rl_step --all --json-out bench.json

clean:
	rm -rf outputs multirun wandb reports
