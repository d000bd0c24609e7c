#!/usr/bin/env bash
# Regenerates docs/results/claim1_deep: claim 1 (GRPO, GRPO + R2, GSPO) on seeds 0-2 at the phase diagram's cell
# the rule of docs/results/README.md picked (qwen30b_l16, lr 1e-4), 60 steps; 9 runs, 0.23 CPU-hours.
#   docs/results/claim1_deep/command.sh -- RUN OVERRIDES...   other runs (e.g. -- seed=10,11), reported in reports/
source "$(dirname "$0")/../args.sh"
only_run_overrides "$@"
exec "$(dirname "$0")/../experiment.sh" claim1_deep checkpoints/cold_start/qwen30b_l16-addition model=qwen30b_l16 "$@"
