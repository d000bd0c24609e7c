#!/usr/bin/env bash
# Regenerates docs/results/claim4_early_warning (docs/reproduce.md): every collapse the lab has, so the claim's runs
# and those of the searches that collapsed (claim4_lr_sweep_partial was stopped after 12 of its 18 jobs; run whole it
# adds GRPO + R2 at lr 3e-4 and 1e-3). Two jobs side by side on 2 cores.
set -euo pipefail
source "$(dirname "$0")/../args.sh"
takes_no_arguments "$@"
cd "$(dirname "$0")/../../.."
test -f checkpoints/cold_start/paper_moe-addition/config.json || python -m experiments.sft model=paper_moe
out=multirun/claim4_early_warning/$(date +%Y-%m-%d_%H-%M-%S)
for experiment in claim4_early_warning claim4_lr_sweep_partial; do
  python -m experiments.train -m experiment=$experiment hydra.sweep.dir=$out/$experiment hydra/launcher=joblib \
    hydra.launcher.n_jobs=2 trainer.threads=1
done
for search in fig3_n8_search onpolicy_mismatch_search; do
  python -m experiments.train -m search=$search hydra.sweep.dir=$out/$search hydra/launcher=joblib \
    hydra.launcher.n_jobs=2 trainer.threads=1
done
python -m analysis.report $out/claim4_early_warning $out/claim4_lr_sweep_partial $out/fig3_n8_search \
  $out/onpolicy_mismatch_search --out docs/results/claim4_early_warning
