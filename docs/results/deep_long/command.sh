#!/usr/bin/env bash
# Regenerates docs/results/deep_long: qwen30b_l16 on the scratchpad (32-token answers), GRPO, GRPO + R2 and GSPO
# at lr 1e-4 and 3e-4 on tuning seed 100; 6 runs, 0.4 CPU-hours.
#   docs/results/deep_long/command.sh -- RUN OVERRIDES...   other runs (e.g. -- seed=10,11), reported in reports/
source "$(dirname "$0")/../args.sh"
only_run_overrides "$@"
exec "$(dirname "$0")/../experiment.sh" deep_long checkpoints/cold_start/qwen30b_l16-scratchpad model=qwen30b_l16 \
  dataset=scratchpad sft.batch_size=32 "$@"
