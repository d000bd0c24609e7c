#!/usr/bin/env bash
# Regenerates docs/results/async, the staleness sweep on an MoE; docs/results/async/preregistration.md fixed the
# rungs, lags, arms, the rule that picks the cells, the primary measure, the family and the stop rule before any run.
#   docs/results/async/command.sh map      the map on tuning seed 100: every arm at lags 0, 1, 2, 4, 8 from start 0 of
#                                          the sigmoid + bias rung (glm4_moe_l16), then of the balanced softmax rung
#                                          (qwen30b_l16), then the dense control's arms without routing
#                                          (qwen30b_l16_dense); a report per rung, Figures 0, 9 and 11 alone
#   docs/results/async/command.sh rule     the pre-registered rule applied to the committed maps' per_seed.csv: each
#                                          arm's fall from lag 0 to each k, the rung and the lag k* the cells run at
#   docs/results/async/command.sh cells RUNG K   the cells at the rung (glm4_moe_l16 or qwen30b_l16) and lag K (1, 2, 4
#                                          or 8) the rule chose, from 8 starts of the rung's recipe and of the dense
#                                          control's x RL seeds 0, 1 (seed 0 on every start, then seed 1): on the rung
#                                          six arms at K and three at lag 0, on the dense control MiniRL at 0 and K;
#                                          a report per model, then the declared family (python -m analysis.family);
#   docs/results/async/command.sh n4       exploratory, outside the declared family (exploratory_n4.md, declared
#                                          before the cells were read): the cells' rung from its starts 0-7 on seed 0 at
#                                          N = 4 mini-batches a rollout batch, minirl at lags 0 and 2 and minirl_r3 at
#                                          2; a report, then its family of two (analysis.family --family
#                                          docs/results/async/exploratory_n4_family.yaml)
# Every sweep resumes (resume=auto): run again, a command goes on where it stopped (a finished run is left as it is, a
# killed one starts again), so the cells can span sessions.
# Sweeps run one job at a time on one thread (hydra.launcher.n_jobs=2 in the arguments runs two side by side). Extra
# arguments after the mode are run overrides, passed to every sweep; any but hydra.launcher.n_jobs makes other runs
# than the documented ones, whose sweeps go to multirun/async/other-<date> and reports to reports/async-<date>.
set -euo pipefail
source "$(dirname "$0")/../args.sh"
mode=${1:-}
shift || true
case $mode in
  map | n4) ;;
  rule) (($# == 0)) || refuse "rule takes no arguments (got '$1'): it reads the committed maps" ;;
  cells)
    rung=${1:-} lag=${2:-}
    [[ $rung == glm4_moe_l16 || $rung == qwen30b_l16 ]] ||
      refuse "cells needs the rung the rule chose first (glm4_moe_l16 or qwen30b_l16), got '$rung'"
    [[ $lag =~ ^[1248]$ ]] || refuse "cells needs the lag the rule chose after the rung (1, 2, 4 or 8), got '$lag'"
    shift 2 ;;
  *) refuse "mode '$mode' is not one of: map, rule, cells RUNG K, n4" ;;
esac
check_run_overrides "$@"
destinations async --threads-pinned "$@"
cd "$(dirname "$0")/../../.."
starts=docs/results/router_starts.sh
sigmoid=glm4_moe_l16-addition-balanced-target softmax=qwen30b_l16-addition-balanced dense=qwen30b_l16_dense-addition
sweep() {  # sweep NAME MODEL RECIPE START OVERRIDES...: a sweep of MODEL from start START of RECIPE, resumed if begun
  local name=$1 model=$2 recipe=$3 start=$4
  shift 4
  python -m experiments.train -m experiment=async_map "hydra.sweeper.params.model=$model" \
    "model.path=$PWD/$($starts --path "$start" "$recipe")" hydra.launcher.n_jobs=1 \
    "hydra.sweep.dir=$sweeps_home/$name" resume=auto "$@"
}
case $mode in
  map)
    map_figures="--figures 0 9 11"  # a map is read through its tables: its response figure, drift and gain per lag
    $starts $sigmoid $softmax $dense
    sweep map_glm4_moe_l16 glm4_moe_l16 $sigmoid 0 "$@"
    python -m analysis.report "$sweeps_home/map_glm4_moe_l16" --out "$results_home/map/glm4_moe_l16" \
      --dpi 72 $map_figures
    sweep map_qwen30b_l16 qwen30b_l16 $softmax 0 "$@"
    python -m analysis.report "$sweeps_home/map_qwen30b_l16" --out "$results_home/map/qwen30b_l16" \
      --dpi 72 $map_figures
    sweep map_qwen30b_l16_dense qwen30b_l16_dense $dense 0 \
      arm=grpo_naive_async,grpo_decoupled,minirl,gspo "$@"
    python -m analysis.report "$sweeps_home/map_qwen30b_l16_dense" --out "$results_home/map/qwen30b_l16_dense" \
      --dpi 72 $map_figures
    ;;
  cells)
    if [[ $rung == glm4_moe_l16 ]]; then recipe=$sigmoid; else recipe=$softmax; fi
    $starts --starts 8 $recipe $dense
    # RL seed outermost: the eight starts on seed 0 first, then on seed 1, so that runs stopped part-way leave every
    # start with the same seeds (the two-level interval weighs every start alike)
    moe=() controls=()
    for seed in 0 1; do
      for start in 0 1 2 3 4 5 6 7; do
        unit=start${start}_seed$seed
        sweep "cells_${rung}_lag${lag}_$unit" $rung $recipe $start "seed=$seed" "rollout.lag=$lag" \
          arm=grpo_naive_async,grpo_decoupled,minirl,minirl_r3,minirl_pr2,gspo "$@"
        sweep "cells_${rung}_lag0_$unit" $rung $recipe $start "seed=$seed" rollout.lag=0 \
          arm=minirl,grpo_decoupled,gspo "$@"
        sweep "cells_qwen30b_l16_dense_lag${lag}_$unit" qwen30b_l16_dense $dense $start "seed=$seed" \
          "rollout.lag=0,$lag" arm=minirl "$@"
        moe+=("$sweeps_home/cells_${rung}_lag${lag}_$unit" "$sweeps_home/cells_${rung}_lag0_$unit")
        controls+=("$sweeps_home/cells_qwen30b_l16_dense_lag${lag}_$unit")
      done
    done
    python -m analysis.report "${moe[@]}" --out "$results_home/cells/$rung" --dpi 72
    python -m analysis.report "${controls[@]}" --out "$results_home/cells/qwen30b_l16_dense" --dpi 72
    python -m analysis.family --moe "$results_home/cells/$rung" --dense "$results_home/cells/qwen30b_l16_dense" \
      --lag "$lag" --out "$results_home/contrasts"
    ;;
  n4)
    $starts --starts 8 $sigmoid
    # the rollout batch twice the cells' (16 prompts), the mini-batch theirs (4 prompts x 8): k = 2 is 8 updates behind
    n4=(trainer.minibatches=4 trainer.prompts_per_step=16 seed=0)
    runs=()
    for start in 0 1 2 3 4 5 6 7; do
      sweep "n4_lag2_start$start" glm4_moe_l16 $sigmoid $start "${n4[@]}" rollout.lag=2 arm=minirl,minirl_r3 "$@"
      sweep "n4_lag0_start$start" glm4_moe_l16 $sigmoid $start "${n4[@]}" rollout.lag=0 arm=minirl "$@"
      runs+=("$sweeps_home/n4_lag2_start$start" "$sweeps_home/n4_lag0_start$start")
    done
    python -m analysis.report "${runs[@]}" --out "$results_home/exploratory_n4/glm4_moe_l16" --dpi 72
    python -m analysis.family --family docs/results/async/exploratory_n4_family.yaml \
      --moe "$results_home/exploratory_n4/glm4_moe_l16" --lag 2 --out "$results_home/exploratory_n4/contrasts"
    ;;
esac
if [[ $mode == rule ]]; then
  exec python - "$results_home/map" <<'RULE'
import csv, sys
from pathlib import Path

# docs/results/async/preregistration.md, "The map, and the rule that picks the cells": an arm's fall at lag k is its
# gain_area at k = 0 minus at k (one run each); the rung is the sigmoid one unless only the softmax one has an arm that
# falls by >= 0.05; k* is that rung's smallest k at which MiniRL or the naive async arm falls by >= 0.05, else 8. A run
# that stopped itself counts, scored as failed (the stop rule); one crashed or killed is excluded, and its lag missing.
FALL, LAGS, RULE_ARMS = 0.05, (1, 2, 4, 8), ("minirl", "grpo (π_old = μ_old)")
maps = Path(sys.argv[1])
falls = {}
for rung in ("glm4_moe_l16", "qwen30b_l16"):
    table = maps / rung / "per_seed.csv"
    if not table.is_file():
        sys.exit(f"error: {table} is missing: `command.sh map` makes it")
    area = {(r["arm"], int(float(r["rollout.lag"]))): float(r["gain_area"])
            for r in csv.DictReader(table.open(encoding="utf-8")) if r["counted"] != "excluded"}
    falls[rung] = {(arm, k): area[arm, 0] - area[arm, k] for arm, k in area if k and (arm, 0) in area}
    print(f"{rung}: fall of gain_area from lag 0 (positive: the arm learns less behind)")
    for arm in sorted({arm for arm, _ in falls[rung]}):
        print(f"  {arm:26s}" + "".join(f"  k={k}: {falls[rung].get((arm, k), float('nan')):+.3f}" for k in LAGS))
    missing = [(arm, k) for arm in RULE_ARMS for k in LAGS if (arm, k) not in falls[rung]]
    if missing:
        sys.exit(f"error: the rule needs every lag of {', '.join(RULE_ARMS)} on {rung}; missing {missing}")
falls_any = {rung: any(f >= FALL for f in table.values()) for rung, table in falls.items()}
rung = "qwen30b_l16" if falls_any["qwen30b_l16"] and not falls_any["glm4_moe_l16"] else "glm4_moe_l16"
k_star = next((k for k in LAGS if any(falls[rung][arm, k] >= FALL for arm in RULE_ARMS)), None)
print(f"rung: {rung}; k*: {k_star if k_star is not None else 8}"
      + ("" if k_star is not None else " (no fall of 0.05 on either rung: the null at the largest lag)"))
RULE
fi
