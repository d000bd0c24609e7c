#!/usr/bin/env bash
# Regenerates docs/results/flip_dose: the SYNTHETIC flip dose-response on the tiny MoE, seeds 0-2; 63 runs,
# 0.55 CPU-hours.
#   docs/results/flip_dose/command.sh -- RUN OVERRIDES...   other runs (e.g. -- seed=10,11), reported in reports/
source "$(dirname "$0")/../args.sh"
only_run_overrides "$@"
exec "$(dirname "$0")/../experiment.sh" flip_dose checkpoints/cold_start/tiny_moe-addition "$@"
