#!/usr/bin/env bash
# Regenerates docs/results/few_experts: deep_long_seeds' cell on qwen30b_l16_e16 (16 experts top-2, the same depth
# and active width), report seeds 0-9, from its own portable cold start (deep_long_seeds' SFT recipe); 30 runs.
exec "$(dirname "$0")/../experiment.sh" few_experts checkpoints/cold_start/qwen30b_l16_e16-scratchpad model=qwen30b_l16_e16 dataset=scratchpad sft.batch_size=32 "$@"
