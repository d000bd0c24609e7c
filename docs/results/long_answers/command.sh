#!/usr/bin/env bash
# Regenerates docs/results/long_answers: the length diagram's most separated cell (32-token answers, lr 3e-4) on seeds 0-2 (9 runs); then the report.
set -euo pipefail
cd "$(dirname "$0")/../../.."
test -f checkpoints/cold_start/tiny_moe-scratchpad16/config.json || python -m experiments.sft model=tiny_moe dataset=scratchpad dataset.digits=16 sft.output_dir=checkpoints/cold_start/tiny_moe-scratchpad16
sweep=multirun/long_answers/$(date +%Y-%m-%d_%H-%M-%S)
python -m experiments.train -m experiment=long_answers hydra.sweep.dir="$sweep"
python -m analysis.report "$sweep" --out docs/results/long_answers
