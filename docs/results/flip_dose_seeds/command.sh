#!/usr/bin/env bash
# Regenerates docs/results/flip_dose_seeds: the SYNTHETIC flips at p = 0, 0.1, 0.2 on the tiny MoE, report seeds 0-9
# from the portable cold start; 90 runs.
exec "$(dirname "$0")/../experiment.sh" flip_dose_seeds checkpoints/cold_start/tiny_moe-addition "$@"
