#!/usr/bin/env bash
# Regenerates docs/results/deep_long: qwen30b_l16 on the scratchpad (32-token answers): GRPO, GRPO + R2, GSPO at lr 1e-4 and 3e-4 on tuning seed 100 (6 runs); then the report.
set -euo pipefail
cd "$(dirname "$0")/../../.."
test -f checkpoints/cold_start/qwen30b_l16-scratchpad/config.json || python -m experiments.sft model=qwen30b_l16 dataset=scratchpad sft.batch_size=32
sweep=multirun/deep_long/$(date +%Y-%m-%d_%H-%M-%S)
python -m experiments.train -m experiment=deep_long hydra.sweep.dir="$sweep"
python -m analysis.report "$sweep" --out docs/results/deep_long
