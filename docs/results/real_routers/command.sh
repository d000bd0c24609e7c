#!/usr/bin/env bash
# Regenerates docs/results/real_routers: GRPO, GRPO + R2, GSPO and GRPO + R3 (bf16 engine) on the 16-layer, 128-expert
# top-8 rung from cold starts balanced as real MoEs are trained (conf/experiment/real_routers.yaml says the cell and
# the rule that chose it). The balanced cold starts are made by docs/results/router_starts.sh; the runs
# go in sweeps of two seeds per model (a run costs ~1.4 CPU-minutes; two sweeps side by side on one thread each), then
# one report per model. Extra arguments (overrides other than the seed) are passed to every sweep.
set -euo pipefail
cd "$(dirname "$0")/../../.."
docs/results/router_starts.sh qwen30b_l16-addition-balanced glm4_moe_l16-addition-balanced
for model in qwen30b_l16 glm4_moe_l16; do
  sweeps=()
  for seeds in 0,1 2,3 4,5 6,7 8,9; do
    dir=multirun/real_routers/${model}_s${seeds/,/}
    python -m experiments.train -m experiment=real_routers model=$model seed=$seeds trainer.threads=1 \
      hydra.sweep.dir=$dir "$@"
    sweeps+=("$dir")
  done
  python -m analysis.report "${sweeps[@]}" --out docs/results/real_routers/$model
done
