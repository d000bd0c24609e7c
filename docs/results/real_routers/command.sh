#!/usr/bin/env bash
# Regenerates docs/results/real_routers: GRPO, GRPO + R2, GSPO and GRPO + R3 (bf16 engine) on the 16-layer, 128-expert
# top-8 rung from cold starts balanced as real MoEs are trained (conf/experiment/real_routers.yaml says the cell and
# the rule that chose it), made by docs/results/router_starts.sh: the softmax rung's, the sigmoid + bias twin's, and
# the twin's with the SFT budget that reaches the target (glm4_moe_l16_target). The runs go in sweeps of two seeds
# (a run costs ~1.4-1.7 CPU-minutes; two sweeps side by side on one thread each), then one report per start. Extra
# arguments are run overrides (other than the seed, which each sweep sets), passed to every sweep; any but
# hydra.launcher.n_jobs makes other runs than the documented ones, whose sweeps go to multirun/real_routers/other-<date>
# and reports to reports/real_routers-<date>.
set -euo pipefail
source "$(dirname "$0")/../args.sh"
check_run_overrides "$@"
for override; do
  [[ $override != seed=* ]] || refuse "'$override': each sweep sets its own seeds (0-9, two a sweep)"
done
destinations real_routers --threads-pinned "$@"
cd "$(dirname "$0")/../../.."
C=checkpoints/cold_start
docs/results/router_starts.sh qwen30b_l16-addition-balanced glm4_moe_l16-addition-balanced \
  glm4_moe_l16-addition-balanced-target
for result in qwen30b_l16:qwen30b_l16-addition-balanced glm4_moe_l16:glm4_moe_l16-addition-balanced \
              glm4_moe_l16_target:glm4_moe_l16-addition-balanced-target; do
  name=${result%%:*} start=${result#*:}
  sweeps=()
  for seeds in 0,1 2,3 4,5 6,7 8,9; do
    dir=$sweeps_home/${name}_s${seeds/,/}
    python -m experiments.train -m experiment=real_routers "model=${start%%-*}" "model.path=$PWD/$C/$start" \
      seed=$seeds trainer.threads=1 hydra.sweep.dir=$dir "$@"
    sweeps+=("$dir")
  done
  python -m analysis.report "${sweeps[@]}" --out "$results_home/$name"
done
