#!/usr/bin/env bash
# Regenerates docs/results/long_answers: the length diagram's most separated cell (tiny MoE, 32-token answers,
# lr 3e-4) on report seeds 0-9 from the portable cold start; 30 runs. The cold start's safety stop is raised: on a
# loaded machine its ~8 CPU-minutes can take over the default hour of wall time, which would cut it short.
exec "$(dirname "$0")/../experiment.sh" long_answers checkpoints/cold_start/tiny_moe-scratchpad16 model=tiny_moe dataset=scratchpad dataset.digits=16 sft.output_dir=checkpoints/cold_start/tiny_moe-scratchpad16 sft.max_seconds=14400 "$@"
