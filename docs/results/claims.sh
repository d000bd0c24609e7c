#!/usr/bin/env bash
# Regenerates docs/results/<claim> for a claim of docs/reproduce.md that is one experiment file: the paper_moe cold
# start, the experiment's runs on seeds 0-2 (two jobs side by side on 2 cores), the report.
#   docs/results/claims.sh claim1_fig3
set -euo pipefail
cd "$(dirname "$0")/../.."
claim=$1
test -f checkpoints/cold_start/paper_moe-addition/config.json || python -m experiments.sft model=paper_moe
out=multirun/$claim/$(date +%Y-%m-%d_%H-%M-%S)
python -m experiments.train -m experiment=$claim hydra.sweep.dir=$out hydra/launcher=joblib hydra.launcher.n_jobs=2 \
  trainer.threads=1
python -m analysis.report $out --out docs/results/$claim
