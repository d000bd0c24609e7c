#!/usr/bin/env bash
# Regenerates docs/results/replay_variants: the routing variants (full replay with gate weights, soft replay,
# router-shift weighting) beside GRPO, GRPO + R2, GRPO + R3 and GSPO at 20% SYNTHETIC flips on the tiny MoE, seeds
# 0-2; 21 runs, 0.2 CPU-hours.
exec "$(dirname "$0")/../experiment.sh" replay_variants checkpoints/cold_start/tiny_moe-addition
