#!/usr/bin/env bash
# Regenerates docs/results/flip_dose: the SYNTHETIC flip dose-response (experiment=flip_dose) on seeds 0-2, then its
# report. 63 runs of 40 RL steps on tiny_moe; 75 minutes on 2 cores with one job at a time beside other work.
set -euo pipefail
cd "$(dirname "$0")/../../.."
test -f checkpoints/cold_start/tiny_moe-addition/config.json || python -m experiments.sft
sweep=multirun/flip_dose/$(date +%Y-%m-%d_%H-%M-%S)
python -m experiments.train -m experiment=flip_dose hydra.sweep.dir="$sweep"
python -m analysis.report "$sweep" --out docs/results/flip_dose
