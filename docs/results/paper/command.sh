#!/usr/bin/env bash
# Regenerates docs/results/paper (docs/reproduce.md, "experiment=paper"): the tiny_moe and deep_moe cold starts, the
# 18 runs, one report per model. The reports were made before packed groups became the default layout:
# trainer.minibatch_layout=rows reproduces them exactly.
set -euo pipefail
source "$(dirname "$0")/../args.sh"
takes_no_arguments "$@"
cd "$(dirname "$0")/../../.."
for m in tiny_moe deep_moe; do
  test -f checkpoints/cold_start/$m-addition/config.json || python -m experiments.sft model=$m
  out=multirun/paper/$m-$(date +%Y-%m-%d_%H-%M-%S)
  python -m experiments.train -m experiment=paper model=$m trainer.minibatch_layout=rows hydra.sweep.dir=$out \
    hydra/launcher=joblib hydra.launcher.n_jobs=2 trainer.threads=1
  python -m analysis.report $out --out docs/results/paper/$m
done
