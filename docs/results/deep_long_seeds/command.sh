#!/usr/bin/env bash
# Regenerates docs/results/deep_long_seeds: deep_long's most separated cell (lr 3e-4) on seeds 0-2; 9 runs,
# 0.61 CPU-hours.
exec "$(dirname "$0")/../experiment.sh" deep_long_seeds checkpoints/cold_start/qwen30b_l16-scratchpad model=qwen30b_l16 dataset=scratchpad sft.batch_size=32
