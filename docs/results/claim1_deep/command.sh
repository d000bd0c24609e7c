#!/usr/bin/env bash
# Regenerates docs/results/claim1_deep: claim 1 (GRPO, GRPO + R2, GSPO) on seeds 0-2 at the phase diagram's cell
# the rule of docs/results/README.md picked (qwen30b_l16, lr 1e-4), 60 steps; 9 runs, 0.23 CPU-hours.
exec "$(dirname "$0")/../experiment.sh" claim1_deep checkpoints/cold_start/qwen30b_l16-addition model=qwen30b_l16
