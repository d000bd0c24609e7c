#!/usr/bin/env bash
# Regenerates docs/results/claim5_decomposition (docs/reproduce.md): the cold starts at 2, 4 and 8 MoE layers, the
# decomposition along depth (experiment=decomposition) and along N (experiment=decomposition_n), the report.
set -euo pipefail
source "$(dirname "$0")/../args.sh"
takes_no_arguments "$@"
cd "$(dirname "$0")/../../.."
for m in paper_moe_l2 paper_moe_l4 paper_moe; do
  test -f checkpoints/cold_start/$m-addition/config.json || python -m experiments.sft model=$m
done
out=multirun/claim5_decomposition/$(date +%Y-%m-%d_%H-%M-%S)
python -m experiments.train -m experiment=decomposition hydra.sweep.dir=$out/decomposition hydra/launcher=joblib \
  hydra.launcher.n_jobs=2 trainer.threads=1
python -m experiments.train -m experiment=decomposition_n hydra.sweep.dir=$out/decomposition_n hydra/launcher=joblib \
  hydra.launcher.n_jobs=2 trainer.threads=1
python -m analysis.report $out/decomposition $out/decomposition_n --out docs/results/claim5_decomposition
