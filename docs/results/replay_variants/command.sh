#!/usr/bin/env bash
# Regenerates docs/results/replay_variants: the routing variants (full replay with gate weights, soft replay,
# router-shift weighting) beside GRPO, GRPO + R2, GRPO + R3 and GSPO at 20% SYNTHETIC flips on the tiny MoE, seeds
# 0-2; 21 runs, 0.2 CPU-hours.
#   docs/results/replay_variants/command.sh -- RUN OVERRIDES...   other runs (e.g. -- seed=10,11), reported in reports/
source "$(dirname "$0")/../args.sh"
only_run_overrides "$@"
exec "$(dirname "$0")/../experiment.sh" replay_variants checkpoints/cold_start/tiny_moe-addition "$@"
