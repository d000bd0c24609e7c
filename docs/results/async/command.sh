#!/usr/bin/env bash
# Regenerates docs/results/async, the staleness sweep on an MoE; docs/results/async/preregistration.md fixed the
# rungs, lags, arms, the rule that picks the cells, the primary measure, the family and the stop rule before any run.
#   docs/results/async/command.sh map      the map on tuning seed 100: every arm at lags 0, 1, 2, 4, 8 from start 0 of
#                                          the sigmoid + bias rung (glm4_moe_l16), then of the balanced softmax rung
#                                          (qwen30b_l16), then the dense control's arms without routing
#                                          (qwen30b_l16_dense); a report per rung
# Sweeps run one job at a time on one thread (hydra.launcher.n_jobs=2 in the arguments runs two side by side). Extra
# arguments after the mode are run overrides, passed to every sweep; any but hydra.launcher.n_jobs makes other runs
# than the documented ones, whose sweeps go to multirun/async/other-<date> and reports to reports/async-<date>.
set -euo pipefail
source "$(dirname "$0")/../args.sh"
mode=${1:-}
shift || true
case $mode in
  map) ;;
  *) refuse "mode '$mode' is not one of: map" ;;
esac
check_run_overrides "$@"
destinations async --threads-pinned "$@"
cd "$(dirname "$0")/../../.."
starts=docs/results/router_starts.sh
sigmoid=glm4_moe_l16-addition-balanced-target softmax=qwen30b_l16-addition-balanced dense=qwen30b_l16_dense-addition
sweep() {  # sweep NAME MODEL RECIPE OVERRIDES...: the map's sweep of MODEL from start 0 of RECIPE
  local name=$1 model=$2 recipe=$3
  shift 3
  python -m experiments.train -m experiment=async_map "hydra.sweeper.params.model=$model" \
    "model.path=$PWD/$($starts --path 0 "$recipe")" hydra.launcher.n_jobs=1 "hydra.sweep.dir=$sweeps_home/$name" "$@"
}
case $mode in
  map)
    $starts $sigmoid $softmax $dense
    sweep map_glm4_moe_l16 glm4_moe_l16 $sigmoid "$@"
    python -m analysis.report "$sweeps_home/map_glm4_moe_l16" --out "$results_home/map/glm4_moe_l16" --dpi 72
    sweep map_qwen30b_l16 qwen30b_l16 $softmax "$@"
    python -m analysis.report "$sweeps_home/map_qwen30b_l16" --out "$results_home/map/qwen30b_l16" --dpi 72
    sweep map_qwen30b_l16_dense qwen30b_l16_dense $dense \
      hydra.sweeper.params.arm=grpo_naive_async,grpo_decoupled,minirl,gspo "$@"
    python -m analysis.report "$sweeps_home/map_qwen30b_l16_dense" --out "$results_home/map/qwen30b_l16_dense" --dpi 72
    ;;
esac
