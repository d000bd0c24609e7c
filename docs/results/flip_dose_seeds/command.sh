#!/usr/bin/env bash
# Regenerates docs/results/flip_dose_seeds: the SYNTHETIC flips at p = 0, 0.1, 0.2 on the tiny MoE, report seeds 0-9
# from the portable cold start; 90 runs.
#   docs/results/flip_dose_seeds/command.sh -- RUN OVERRIDES...   other runs (e.g. -- seed=10,11), reported in reports/
source "$(dirname "$0")/../args.sh"
only_run_overrides "$@"
exec "$(dirname "$0")/../experiment.sh" flip_dose_seeds checkpoints/cold_start/tiny_moe-addition "$@"
