#!/usr/bin/env bash
# Regenerates docs/results/claim2_onpolicy (docs/reproduce.md): the paper_moe cold start, the experiment's runs on
# seeds 0-2, the report. Two jobs side by side on 2 cores.
set -euo pipefail
cd "$(dirname "$0")/../../.."
test -f checkpoints/cold_start/paper_moe-addition/config.json || python -m experiments.sft model=paper_moe
out=multirun/claim2_onpolicy/$(date +%Y-%m-%d_%H-%M-%S)
python -m experiments.train -m experiment=claim2_onpolicy hydra.sweep.dir=$out hydra/launcher=joblib hydra.launcher.n_jobs=2 trainer.threads=1
python -m analysis.report $out --out docs/results/claim2_onpolicy
