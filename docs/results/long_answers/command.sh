#!/usr/bin/env bash
# Regenerates docs/results/long_answers: the length diagram's most separated cell (32-token answers, lr 3e-4)
# on seeds 0-2; 9 runs, 0.38 CPU-hours.
exec "$(dirname "$0")/../experiment.sh" long_answers checkpoints/cold_start/tiny_moe-scratchpad16 model=tiny_moe dataset=scratchpad dataset.digits=16 sft.output_dir=checkpoints/cold_start/tiny_moe-scratchpad16
