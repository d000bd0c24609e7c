#!/usr/bin/env bash
# Regenerates docs/results/router_noise_dose: the pilot on tuning seed 100 that chose the doses (its report in
# pilot/), then the SYNTHETIC router-noise dose-response on report seeds 0-9 (160 runs) and its report.
set -euo pipefail
cd "$(dirname "$0")/../../.."
test -f checkpoints/cold_start/tiny_moe-addition/config.json || python -m experiments.sft
stamp=$(date +%Y-%m-%d_%H-%M-%S)
python -m experiments.train -m search=router_noise_pilot hydra.sweep.dir=multirun/router_noise_pilot/$stamp
python -m analysis.report multirun/router_noise_pilot/$stamp --out docs/results/router_noise_dose/pilot
exec docs/results/experiment.sh router_noise_dose checkpoints/cold_start/tiny_moe-addition "$@"
