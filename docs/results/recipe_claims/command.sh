#!/usr/bin/env bash
# Regenerates docs/results/recipe_claims (the pre-registration beside this file fixed the claims, the measure, the
# families and the stop rule before any run): each claim's cell from 6 cold starts of its recipe x RL seeds 0, 1.
#   docs/results/recipe_claims/command.sh deep_long     claims (a) and (b): GRPO, GSPO, wide-clip GSPO at lr 3e-4 and
#                                                       GRPO at the KL-matched 2.7e-4, then the two reports
#   docs/results/recipe_claims/command.sh few_experts   claim (c): GRPO and GSPO on 16 experts top-2
#   docs/results/recipe_claims/command.sh MODE K SEED   only start K's sweeps at RL seed SEED (to share the units
#                                                       among cores), no report
#   docs/results/recipe_claims/command.sh MODE report   only the reports, over the units that ran
# RL seed outermost: the six starts on seed 0 first, then on seed 1, so that runs stopped part-way leave every start
# with the same seeds (the two-level interval weighs every start alike). One sweep per (start, seed), one job at a
# time on one thread.
set -euo pipefail
source "$(dirname "$0")/../args.sh"
cd "$(dirname "$0")/../../.."
starts=docs/results/router_starts.sh
out=docs/results/recipe_claims
runs=multirun/recipe_claims
mode=${1:-}
case $mode in
  deep_long) recipe=qwen30b_l16-scratchpad ;;
  few_experts) recipe=qwen30b_l16_e16-scratchpad ;;
  *) refuse "mode '$mode' is not one of: deep_long, few_experts" ;;
esac
sweep() {  # sweep NAME START SEED OVERRIDES...
  local name=$1 k=$2 seed=$3
  shift 3
  python -m experiments.train -m "model.path=$PWD/$($starts --path "$k" $recipe)" hydra.launcher.n_jobs=1 \
    "hydra.sweep.dir=$runs/${name}_start${k}_seed$seed" "seed=$seed" "$@"
}
unit() {  # unit START SEED: the mode's sweeps of one (start, seed)
  case $mode in
    deep_long)
      sweep deep_long "$1" "$2" experiment=deep_long_starts
      sweep deep_long_matched_step "$1" "$2" experiment=deep_long_starts arm=grpo trainer.lr=2.7e-4 ;;
    few_experts) sweep few_experts "$1" "$2" experiment=few_experts_starts ;;
  esac
}
report() {  # the reports over every (start, seed) that ran
  shopt -s nullglob
  case $mode in
    deep_long)
      python -m analysis.report $runs/deep_long_start* --out $out/deep_long --dpi 72
      python -m analysis.report $runs/deep_long_matched_step_start* --out $out/deep_long_matched_step --dpi 72
      python -m analysis.compare $out/deep_long "$out/deep_long_matched_step:grpo=grpo-lr2.7e-4" \
        --baseline grpo-lr2.7e-4 --family "gspo (clip_high=0.0004)" --out $out/deep_long_step_compared ;;
    few_experts) python -m analysis.report $runs/few_experts_start* --out $out/few_experts --dpi 72 ;;
  esac
}
if (($# == 2)) && [[ $2 == report ]]; then
  report
elif (($# == 3)); then
  [[ $2 =~ ^[0-5]$ && $3 =~ ^[01]$ ]] ||
    refuse "start '$2' and seed '$3' must be one of starts 0-5 and seeds 0, 1 (the pre-registered units)"
  unit "$2" "$3"
elif (($# == 1)); then
  $starts --starts 6 $recipe
  for seed in 0 1; do
    for k in 0 1 2 3 4 5; do unit $k $seed; done
  done
  report
else
  refuse "expected MODE, MODE K SEED or MODE report; got: $*"
fi
