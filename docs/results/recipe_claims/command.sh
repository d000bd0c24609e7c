#!/usr/bin/env bash
# Regenerates docs/results/recipe_claims (the pre-registration beside this file fixed the claims, the measure, the
# families and the stop rule before any run): each claim's cell from 6 cold starts of its recipe x RL seeds 0, 1.
#   docs/results/recipe_claims/command.sh deep_long     claims (a) and (b): GRPO, GSPO, wide-clip GSPO at lr 3e-4 and
#                                                       GRPO at the KL-matched 2.7e-4, then the two reports
#   docs/results/recipe_claims/command.sh few_experts   claim (c): GRPO and GSPO on 16 experts top-2
# Sweeps run one job at a time on one thread; extra arguments after the mode are passed to every sweep.
set -euo pipefail
cd "$(dirname "$0")/../../.."
starts=docs/results/router_starts.sh
out=docs/results/recipe_claims
mode=${1:-}
shift || true
sweep() {  # sweep NAME START_PATH OVERRIDES...
  local name=$1 path=$2
  shift 2
  python -m experiments.train -m "model.path=$PWD/$path" hydra.launcher.n_jobs=1 \
    "hydra.sweep.dir=multirun/recipe_claims/$name" "$@"
}
case $mode in
  deep_long)
    recipe=qwen30b_l16-scratchpad
    $starts --starts 6 $recipe
    arms=() matched=()
    for k in 0 1 2 3 4 5; do
      path=$($starts --path $k $recipe)
      sweep "deep_long_start$k" "$path" experiment=deep_long_starts "$@"
      sweep "deep_long_matched_step_start$k" "$path" experiment=deep_long_starts arm=grpo trainer.lr=2.7e-4 "$@"
      arms+=("multirun/recipe_claims/deep_long_start$k")
      matched+=("multirun/recipe_claims/deep_long_matched_step_start$k")
    done
    python -m analysis.report "${arms[@]}" --out $out/deep_long
    python -m analysis.report "${matched[@]}" --out $out/deep_long_matched_step
    python -m analysis.compare $out/deep_long "$out/deep_long_matched_step:grpo=grpo-lr2.7e-4" \
      --baseline grpo-lr2.7e-4 --family "gspo (clip_high=0.0004)" --out $out/deep_long_step_compared
    ;;
  few_experts)
    recipe=qwen30b_l16_e16-scratchpad
    $starts --starts 6 $recipe
    sweeps=()
    for k in 0 1 2 3 4 5; do
      sweep "few_experts_start$k" "$($starts --path $k $recipe)" experiment=few_experts_starts "$@"
      sweeps+=("multirun/recipe_claims/few_experts_start$k")
    done
    python -m analysis.report "${sweeps[@]}" --out $out/few_experts
    ;;
  *) echo "error: mode '$mode' is not one of: deep_long, few_experts" >&2; exit 2 ;;
esac
