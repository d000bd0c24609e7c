#!/usr/bin/env bash
# Regenerates docs/results/router_noise_dose: the pilot on tuning seed 100 that chose the doses (its report in
# pilot/, its figures at a lower resolution: it only picks doses), then the SYNTHETIC router-noise dose-response on
# report seeds 0-9 (160 runs) and its report. The committed report was re-made after replay stayed finite under large
# drift (2026-12-05, an Intel Xeon): the pilot and the 160 runs as one sweep each, two runs side by side on one thread
# each (`python -m experiments.train -m search=router_noise_pilot hydra/launcher=joblib hydra.launcher.n_jobs=2`, the
# same for experiment=router_noise_dose), then `python -m analysis.report` of each sweep.
#   docs/results/router_noise_dose/command.sh -- RUN OVERRIDES...   other runs of the dose-response (e.g.
#     -- seed=10,11), without the pilot, reported in reports/ (docs/results/experiment.sh)
set -euo pipefail
source "$(dirname "$0")/../args.sh"
only_run_overrides "$@"
cd "$(dirname "$0")/../../.."
if (($# == 0)); then
  test -f checkpoints/cold_start/tiny_moe-addition/config.json || python -m experiments.sft
  python -m experiments.train -m search=router_noise_pilot hydra.sweep.dir=multirun/router_noise_pilot/$stamp
  python -m analysis.report multirun/router_noise_pilot/$stamp --out docs/results/router_noise_dose/pilot --dpi 72
fi
exec docs/results/experiment.sh router_noise_dose checkpoints/cold_start/tiny_moe-addition "$@"
