#!/usr/bin/env bash
# Regenerates docs/results/deep_long_seeds: deep_long's most separated cell (lr 3e-4) on seeds 0-2 (9 runs); then the report.
set -euo pipefail
cd "$(dirname "$0")/../../.."
test -f checkpoints/cold_start/qwen30b_l16-scratchpad/config.json || python -m experiments.sft model=qwen30b_l16 dataset=scratchpad sft.batch_size=32
sweep=multirun/deep_long_seeds/$(date +%Y-%m-%d_%H-%M-%S)
python -m experiments.train -m experiment=deep_long_seeds hydra.sweep.dir="$sweep"
python -m analysis.report "$sweep" --out docs/results/deep_long_seeds
