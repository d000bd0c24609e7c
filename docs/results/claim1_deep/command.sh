#!/usr/bin/env bash
# Regenerates docs/results/claim1_deep: claim 1 (GRPO, GRPO + R2, GSPO) on seeds 0-2 at the phase diagram's cell the
# rule of docs/results/README.md picked (qwen30b_l16, lr 1e-4), 60 steps; then the report.
set -euo pipefail
cd "$(dirname "$0")/../../.."
test -f checkpoints/cold_start/qwen30b_l16-addition/config.json || python -m experiments.sft model=qwen30b_l16
sweep=multirun/claim1_deep/$(date +%Y-%m-%d_%H-%M-%S)
python -m experiments.train -m experiment=claim1_deep hydra.sweep.dir="$sweep"
python -m analysis.report "$sweep" --out docs/results/claim1_deep
