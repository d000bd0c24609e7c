#!/usr/bin/env bash
# Regenerates docs/results/staleness; docs/results/staleness/preregistration.md fixed the rule, the primary measure,
# the family and the stop rule before any of these runs.
#   docs/results/staleness/command.sh map          the map on tuning seed 100 from start 0: every arm at N = 1, 2, 4, 8
#                                                  mini-batches per rollout batch on the sigmoid + bias rung, and at
#                                                  N = 8 on the balanced softmax rung (the control); a report per rung
#   docs/results/staleness/command.sh cells N...   the cells the rule chose (each N one of 1, 2, 4, 8), from 6 starts x
#                                                  seeds 0, 1 of the MiniRL arms (seed 0 on every start, then seed 1)
# Sweeps run one job at a time on one thread (hydra.launcher.n_jobs=2 in the arguments runs two side by side).
# Extra arguments after the mode's own are run overrides, passed to every sweep; any but hydra.launcher.n_jobs makes
# other runs than the documented ones, whose sweeps go to multirun/staleness/other-<date> and reports to
# reports/staleness-<date>.
set -euo pipefail
source "$(dirname "$0")/../args.sh"
mode=${1:-}
shift || true
case $mode in
  map) ;;
  cells)
    cells=()
    while (($#)) && ! is_override "$1"; do
      [[ $1 =~ ^[1248]$ ]] || refuse "cell N '$1' is not one of 1, 2, 4, 8 (the N of the map)"
      cells+=("$1"); shift
    done
    ((${#cells[@]})) || refuse "cells needs the N the rule chose (1, 2, 4 or 8)" ;;
  *) refuse "mode '$mode' is not one of: map, cells N..." ;;
esac
check_run_overrides "$@"
destinations staleness --threads-pinned "$@"
cd "$(dirname "$0")/../../.."
starts=docs/results/router_starts.sh
sigmoid=glm4_moe_l16-addition-balanced-target softmax=qwen30b_l16-addition-balanced
sweep() {  # sweep NAME N OVERRIDES...: the experiment at N mini-batches of 4 prompts each
  local name=$1 n=$2
  shift 2
  python -m experiments.train -m experiment=staleness "trainer.minibatches=$n" "trainer.prompts_per_step=$((4 * n))" \
    hydra.launcher.n_jobs=1 "hydra.sweep.dir=$sweeps_home/$name" "$@"
}
case $mode in
  map)
    $starts $sigmoid $softmax
    for n in 1 2 4 8; do sweep "map_glm4_moe_l16_n$n" $n "$@"; done
    # one report of the four N (a cell each); the map only picks cells: its figures at a lower resolution
    python -m analysis.report "$sweeps_home"/map_glm4_moe_l16_n{1,2,4,8} --out "$results_home/map/glm4_moe_l16" \
      --dpi 72
    sweep map_qwen30b_l16_n8 8 hydra.sweeper.params.model=qwen30b_l16 "model.path=$PWD/$($starts --path 0 $softmax)" \
      "$@"
    python -m analysis.report "$sweeps_home/map_qwen30b_l16_n8" --out "$results_home/map/qwen30b_l16_n8" --dpi 72
    python -m analysis.panels "$sweeps_home"/map_glm4_moe_l16_n* --by trainer.minibatches --out "$results_home/map"
    ;;
  cells)
    $starts --starts 6 $sigmoid
    # RL seed outermost: the six starts on seed 0 first, then on seed 1, so that runs stopped part-way leave every
    # start with the same seeds (the two-level interval resamples starts; a start with more seeds would weigh alike)
    for n in "${cells[@]}"; do
      sweeps=()
      for seed in 0 1; do
        for k in 0 1 2 3 4 5; do
          sweep "cells_n${n}_start${k}_seed$seed" "$n" "model.path=$PWD/$($starts --path $k $sigmoid)" "seed=$seed" \
            arm=minirl_no_clip,minirl,minirl_r2,minirl_r3 "$@"
          sweeps+=("$sweeps_home/cells_n${n}_start${k}_seed$seed")
        done
      done
      python -m analysis.report "${sweeps[@]}" --out "$results_home/n$n" --dpi 80
    done
    python -m analysis.panels "$sweeps_home"/cells_n* --by trainer.minibatches --out "$results_home"
    ;;
esac
