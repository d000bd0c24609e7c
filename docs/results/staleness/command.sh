#!/usr/bin/env bash
# Regenerates docs/results/staleness; docs/results/staleness/preregistration.md fixed the rule, the primary measure,
# the family and the stop rule before any of these runs.
#   docs/results/staleness/command.sh map          the map on tuning seed 100 from start 0: every arm at N = 1, 2, 4, 8
#                                                  mini-batches per rollout batch on the sigmoid + bias rung, and at
#                                                  N = 8 on the balanced softmax rung (the control); a report per rung
#   docs/results/staleness/command.sh cells N...   the cells the rule chose, from 6 starts x seeds 0, 1 of the MiniRL arms
#                                                  (seed 0 on every start, then seed 1)
# Sweeps run one job at a time on one thread (hydra.launcher.n_jobs=2 in the arguments runs two side by side).
# Extra arguments after the mode's own are passed to every sweep.
set -euo pipefail
cd "$(dirname "$0")/../../.."
starts=docs/results/router_starts.sh
sigmoid=glm4_moe_l16-addition-balanced-target softmax=qwen30b_l16-addition-balanced
mode=${1:-}
shift || true
sweep() {  # sweep NAME N OVERRIDES...: the experiment at N mini-batches of 4 prompts each
  local name=$1 n=$2
  shift 2
  python -m experiments.train -m experiment=staleness "trainer.minibatches=$n" "trainer.prompts_per_step=$((4 * n))" \
    hydra.launcher.n_jobs=1 "hydra.sweep.dir=multirun/staleness/$name" "$@"
}
case $mode in
  map)
    $starts $sigmoid $softmax
    for n in 1 2 4 8; do sweep "map_glm4_moe_l16_n$n" $n "$@"; done
    # one report of the four N (a cell each); the map only picks cells: its figures at a lower resolution
    python -m analysis.report multirun/staleness/map_glm4_moe_l16_n{1,2,4,8} --out docs/results/staleness/map/glm4_moe_l16 \
      --dpi 72
    sweep map_qwen30b_l16_n8 8 hydra.sweeper.params.model=qwen30b_l16 "model.path=$PWD/$($starts --path 0 $softmax)" "$@"
    python -m analysis.report multirun/staleness/map_qwen30b_l16_n8 --out docs/results/staleness/map/qwen30b_l16_n8 --dpi 72
    python -m analysis.panels multirun/staleness/map_glm4_moe_l16_n* --by trainer.minibatches \
      --out docs/results/staleness/map
    ;;
  cells)
    (($#)) || { echo "error: cells needs the N the rule chose (1, 2, 4 or 8)" >&2; exit 2; }
    cells=()
    while (($#)) && [[ $1 =~ ^[1248]$ ]]; do cells+=("$1"); shift; done
    $starts --starts 6 $sigmoid
    # RL seed outermost: the six starts on seed 0 first, then on seed 1, so that runs stopped part-way leave every
    # start with the same seeds (the two-level interval resamples starts; a start with more seeds would weigh alike)
    for n in "${cells[@]}"; do
      sweeps=()
      for seed in 0 1; do
        for k in 0 1 2 3 4 5; do
          sweep "cells_n${n}_start${k}_seed$seed" "$n" "model.path=$PWD/$($starts --path $k $sigmoid)" "seed=$seed" \
            arm=minirl_no_clip,minirl,minirl_r2,minirl_r3 "$@"
          sweeps+=("multirun/staleness/cells_n${n}_start${k}_seed$seed")
        done
      done
      python -m analysis.report "${sweeps[@]}" --out "docs/results/staleness/n$n" --dpi 80
    done
    python -m analysis.panels multirun/staleness/cells_n* --by trainer.minibatches --out docs/results/staleness
    ;;
  *) echo "error: mode '$mode' is not one of: map, cells N..." >&2; exit 2 ;;
esac
