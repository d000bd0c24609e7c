#!/usr/bin/env bash
# Regenerates docs/results/flip_dose: the SYNTHETIC flip dose-response on the tiny MoE, seeds 0-2; 63 runs,
# 0.55 CPU-hours.
exec "$(dirname "$0")/../experiment.sh" flip_dose checkpoints/cold_start/tiny_moe-addition
