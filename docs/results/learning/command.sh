#!/usr/bin/env bash
# Regenerates docs/results/learning, the standing questions asked where the baseline learns (issue 63, parts 3-5), as
# docs/results/learning/preregistration.md fixed them before the learnability map's results were read. Every mode
# runs in the regime the map's rule chose (docs/results/learnability/map/regime.json, written by
# `docs/results/learnability/command.sh map`): it is refused in one line until that file exists.
#   docs/results/learning/command.sh starts   the family's ten starts of each recipe, start 3 on (starts 0-2 picked
#                                             the regime): glm4_moe_l16-addition-balanced-target-t1000 (sigmoid + bias)
#                                             and qwen30b_l16-addition-balanced-t1000 (balanced softmax); a start that
#                                             misses its SFT's 45% target is replaced by the next number, and named;
#                                             with hydra.launcher.n_jobs=2 the two recipes' starts side by side
#   docs/results/learning/command.sh sync     the synchronous family against a bf16 engine, seed 0 on every start,
#                                             then seed 1: on the sigmoid + bias rung GRPO, GSPO, GRPO + R2, GRPO + R3
#                                             and GRPO + PR2 at predictor lr_scale 1 and 1e4; on the softmax rung GRPO
#                                             and GSPO; a report per rung, then every result's baseline
#   docs/results/learning/command.sh lagmap   the lag map that picks k*: the naive asynchronous arm and MiniRL at
#                                             k = 0, 1, 2, 4 on the sigmoid + bias rung from the learnability map's
#                                             starts 0-2, seed 100, the fp32 engine; its report, then k* by the old rule
#                                             (python -m analysis.staleness_lag: lagmap/k_star.json); the report
#                                             draws Figures 0, 9 and 11 alone (docs/ is held under 10 MB)
#   docs/results/learning/command.sh staleness   the staleness cells at k = 0 and k* (lagmap/k_star.json: refused in
#                                             one line until it exists) from the sigmoid rung's family starts, seed 0
#                                             on every start before seed 1: GRPO (π_old = μ_old), GRPO + TIS, MiniRL,
#                                             MiniRL + R3 and GSPO at k*, GRPO + TIS, MiniRL and GSPO at 0; their
#                                             report, then the declared family of nine (family.yaml) once the
#                                             synchronous reports are there too
# Every sweep resumes (resume=auto): run again, a command goes on where it stopped. One run at a time on one thread
# (hydra.launcher.n_jobs=2 in the arguments runs two side by side). Extra arguments after the mode are run
# overrides, passed to every sweep; any but hydra.launcher.n_jobs makes other runs than the documented ones, whose
# sweeps go to multirun/learning/other-<date> and reports to reports/learning-<date>.
set -euo pipefail
source "$(dirname "$0")/../args.sh"
mode=${1:-}
shift || true
[[ $mode == starts || $mode == sync || $mode == lagmap || $mode == staleness ]] ||
  refuse "mode '$mode' is not one of: starts, sync, lagmap, staleness"
check_run_overrides "$@"
destinations learning --threads-pinned "$@"
cd "$(dirname "$0")/../../.."
k_star_file=${K_STAR:-$results_home/lagmap/k_star.json}  # the lag map's k* (a test's own elsewhere)
if [[ $mode == staleness && ! -f $k_star_file ]]; then
  refuse "$k_star_file does not exist: the staleness cells run at the k* the lag map picks (command.sh lagmap)"
fi
[[ $mode == starts ]] || read_regime "the learning study"
starts=docs/results/router_starts.sh
# The figures the reports keep (docs/ is held under 10 MB; the same report without --figures draws every one): the
# pre-registration's part 5 from the synchronous family (reward and held-out accuracy against step and compute, the
# clipped share, GRPO with and without replay, drift per layer against step, the ratio variances), and the staleness
# cells' lag figures (drift against the engine, every arm per lag against step, the gain per lag)
family_figures="--dpi 100 --figures 0 1 2 3 4b 5" staleness_figures="--dpi 100 --figures 0 9 10 11"
sigmoid=glm4_moe_l16-addition-balanced-target-t1000 softmax=qwen30b_l16-addition-balanced-t1000
FIRST_START=3 FAMILY_STARTS=10 LAST_START=29  # a recipe that misses its target past start 29 is refused, not retried

family_starts() {  # family_starts RECIPE: the family's starts of RECIPE, comma-separated paths, made where missing
  local recipe=$1 k=$FIRST_START path found=()
  while ((${#found[@]} < FAMILY_STARTS)); do
    ((k <= LAST_START)) || refuse "$recipe: fewer than $FAMILY_STARTS of starts $FIRST_START-$LAST_START meet the target"
    path=$($starts --path $k "$recipe")
    [[ -f $path/cold_start.json ]] || $starts --only $k "$recipe" >&2
    [[ -f $path/cold_start.json ]] || refuse "start $k of $recipe was not made: $path holds no cold_start.json"
    if python -c 'import json, sys; sys.exit(not json.load(open(sys.argv[1]))["reached_target"])' \
      "$path/cold_start.json"; then
      found+=("$PWD/$path")
    else
      echo "$recipe: start $k missed its SFT's target, replaced by the next start" >&2
    fi
    k=$((k + 1))
  done
  (IFS=,; echo "${found[*]}")
}

sweep() {  # sweep EXPERIMENT NAME RUNG PATHS OVERRIDES...: a sweep of RUNG from the starts PATHS in the regime
  local experiment=$1 name=$2 rung=$3 paths=$4
  shift 4
  python -m experiments.train -m "experiment=$experiment" "hydra.sweeper.params.model=$rung" "model.path=$paths" \
    "${regime[@]}" hydra.launcher.n_jobs=1 "hydra.sweep.dir=$sweeps_home/$name" resume=auto "$@"
}

if [[ $mode == lagmap ]]; then
  $starts --starts 3 $sigmoid
  paths=$PWD/$($starts --path 0 $sigmoid),$PWD/$($starts --path 1 $sigmoid),$PWD/$($starts --path 2 $sigmoid)
  sweep learning_staleness lagmap_glm4_moe_l16 glm4_moe_l16 "$paths" rollout.lag=0,1,2,4 "$@"
  python -m analysis.report "$sweeps_home/lagmap_glm4_moe_l16" --out "$results_home/lagmap/glm4_moe_l16" --dpi 72 \
    --figures 0 9 11  # a map is read through its tables: its response figure, drift and gain per lag
  python -m analysis.staleness_lag "$results_home/lagmap/glm4_moe_l16" --out "$results_home/lagmap"
  exit 0
fi

if [[ $mode == starts ]]; then
  if [[ " $* " =~ \ hydra\.launcher\.n_jobs=([2-9]|[1-9][0-9]+)\  ]]; then  # two or more side by side: a recipe each
    family_starts $sigmoid >/dev/null &
    sigmoid_made=$!
    family_starts $softmax >/dev/null &
    softmax_made=$!
    failed=0  # each recipe's refusal is its own line; the command ends once both have ended
    wait $sigmoid_made || failed=$?
    wait $softmax_made || failed=$?
    exit $failed
  fi
  family_starts $sigmoid >/dev/null
  family_starts $softmax >/dev/null
  exit 0
fi
sigmoid_starts=$(family_starts $sigmoid)
softmax_starts=$(family_starts $softmax)
if [[ $mode == staleness ]]; then
  k=$(python -c 'import json, sys; print(json.load(open(sys.argv[1]))["k_star"])' "$k_star_file")
  for seed in 0 1; do
    sweep learning_staleness staleness_glm4_moe_l16_lag${k}_s$seed glm4_moe_l16 "$sigmoid_starts" \
      "hydra.sweeper.params.seed=$seed" "rollout.lag=$k" \
      "hydra.sweeper.params.arm=grpo_naive_async,grpo_decoupled,minirl,minirl_r3,gspo" "$@"
    sweep learning_staleness staleness_glm4_moe_l16_lag0_s$seed glm4_moe_l16 "$sigmoid_starts" \
      "hydra.sweeper.params.seed=$seed" rollout.lag=0 \
      "hydra.sweeper.params.arm=grpo_decoupled,minirl,gspo" "$@"
  done
  python -m analysis.report "$sweeps_home"/staleness_glm4_moe_l16_* --out "$results_home/staleness/glm4_moe_l16" \
    $staleness_figures
  [[ -d $results_home/sync/glm4_moe_l16 && -d $results_home/sync/qwen30b_l16 ]] || exit 0
  python -m analysis.family --family docs/results/learning/family.yaml \
    --table "sigmoid=$results_home/sync/glm4_moe_l16" --table "softmax=$results_home/sync/qwen30b_l16" \
    --table "staleness=$results_home/staleness/glm4_moe_l16" --lag "$k" --out "$results_home/family"
  exit 0
fi
# Seed outermost: a command stopped part-way leaves seed 0 on every start before any seed 1.
for seed in 0 1; do
  sweep learning_family sync_glm4_moe_l16_s$seed glm4_moe_l16 "$sigmoid_starts" "hydra.sweeper.params.seed=$seed" \
    "hydra.sweeper.params.arm=grpo,gspo,grpo_r2,grpo_r3" "$@"
  sweep learning_family sync_glm4_moe_l16_pr2_s$seed glm4_moe_l16 "$sigmoid_starts" "hydra.sweeper.params.seed=$seed" \
    hydra.sweeper.params.arm=grpo_pr2 routing_variant.lr_scale=1,10000 "$@"
  sweep learning_family sync_qwen30b_l16_s$seed qwen30b_l16 "$softmax_starts" "hydra.sweeper.params.seed=$seed" "$@"
done
python -m analysis.report "$sweeps_home"/sync_glm4_moe_l16_* --out "$results_home/sync/glm4_moe_l16" $family_figures
python -m analysis.report "$sweeps_home"/sync_qwen30b_l16_s* --out "$results_home/sync/qwen30b_l16" $family_figures
