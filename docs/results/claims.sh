#!/usr/bin/env bash
# Regenerates docs/results/<claim> for a claim of docs/reproduce.md that is one experiment file: the paper_moe cold
# start, the experiment's runs on seeds 0-2 (two jobs side by side on 2 cores), the report.
#   docs/results/claims.sh CLAIM      CLAIM: claim1_fig3, claim2_onpolicy or claim3_offpolicy (claims 4 and 5 are
#                                     more than one experiment: their own command.sh)
#   docs/results/claims.sh claim1_fig3
set -euo pipefail
source "$(dirname "$0")/args.sh"
claim=${1:-}
case $claim in
  claim1_fig3 | claim2_onpolicy | claim3_offpolicy) ;;
  *) refuse "claim '$claim' is not one of: claim1_fig3, claim2_onpolicy, claim3_offpolicy (claims 4 and 5: their" \
       "own command.sh)" ;;
esac
(($# == 1)) || refuse "$command_file takes one claim (got also '$2')"
cd "$(dirname "$0")/../.."
test -f checkpoints/cold_start/paper_moe-addition/config.json || python -m experiments.sft model=paper_moe
out=multirun/$claim/$stamp
python -m experiments.train -m experiment=$claim hydra.sweep.dir=$out hydra/launcher=joblib hydra.launcher.n_jobs=2 \
  trainer.threads=1
python -m analysis.report $out --out docs/results/$claim
