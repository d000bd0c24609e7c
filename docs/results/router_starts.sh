#!/usr/bin/env bash
# Makes, once each, the cold starts of the 16-layer 128-expert top-8 rung whose routers the margins, drift_law_routers
# and real_routers results compare: the softmax rung (qwen30b_l16) and its sigmoid + bias twin (glm4_moe_l16), each
#   NAME-addition           today's recipe (the addition SFT alone)
#   NAME-addition-balanced  balanced as its family trains (issue 31): Qwen3's global-batch auxiliary loss, or the bias
#                           update and sequence-wise loss, after 200 pretraining steps on the mixture of the lab's tasks
#   NAME-addition-tied      routers near-tied at init (router_init_std 0.03, a tenth of the default)
# and glm4_moe_l16-addition-balanced-target, the balanced sigmoid start with the SFT budget raised from 600 to 1,200
# steps, so that it can reach the 45% target that 600 did not (29.7% on the machine of real_routers' results);
# one thread each, 5-14 CPU-minutes a start here. The one place these recipes are written.
#   docs/results/router_starts.sh                                 # the six above
#   docs/results/router_starts.sh qwen30b_l16-addition-balanced   # only the named ones
set -euo pipefail -f  # -f: the recipes' overrides hold brackets, never globs
cd "$(dirname "$0")/../.."
C=checkpoints/cold_start
recipe() {  # the SFT overrides of start $1
  case $1 in
    qwen30b_l16-addition) echo "model=qwen30b_l16" ;;
    qwen30b_l16-addition-balanced) echo "model=qwen30b_l16 routers=[aux_loss] sft.pretrain_steps=200" ;;
    qwen30b_l16-addition-tied) echo "model=qwen30b_l16 model.router_init_std=0.03" ;;
    glm4_moe_l16-addition) echo "model=glm4_moe_l16" ;;
    glm4_moe_l16-addition-balanced) echo "model=glm4_moe_l16 routers=[bias_update] sft.pretrain_steps=200" ;;
    glm4_moe_l16-addition-tied) echo "model=glm4_moe_l16 model.router_init_std=0.03" ;;
    glm4_moe_l16-addition-balanced-target)
      echo "model=glm4_moe_l16 routers=[bias_update] sft.pretrain_steps=200 sft.max_steps=1200" ;;
    *) echo "error: no cold start named '$1' (allowed: the seven listed in $0)" >&2; return 2 ;;
  esac
}
names=("$@")
((${#names[@]})) || names=(qwen30b_l16-addition qwen30b_l16-addition-balanced qwen30b_l16-addition-tied
                           glm4_moe_l16-addition glm4_moe_l16-addition-balanced glm4_moe_l16-addition-tied)
for name in "${names[@]}"; do recipe "$name" >/dev/null; done  # every name known before any work
for name in "${names[@]}"; do
  # shellcheck disable=SC2046  # a recipe is overrides without spaces inside any
  test -f "$C/$name/config.json" || python -m experiments.sft $(recipe "$name") "sft.output_dir=$C/$name"
done
