#!/usr/bin/env bash
# Regenerates docs/results/deep_long_seeds: deep_long's most separated cell (qwen30b_l16, 32-token answers, lr 3e-4)
# on report seeds 0-9 from the portable cold start; 30 runs.
exec "$(dirname "$0")/../experiment.sh" deep_long_seeds checkpoints/cold_start/qwen30b_l16-scratchpad model=qwen30b_l16 dataset=scratchpad sft.batch_size=32 "$@"
