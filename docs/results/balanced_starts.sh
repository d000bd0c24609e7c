#!/usr/bin/env bash
# Makes, once each, the cold starts balanced as real MoEs are trained, on the 16-layer 128-expert top-8 rung: the
# softmax rung (qwen30b_l16) with Qwen3's global-batch auxiliary loss, its sigmoid + bias twin (glm4_moe_l16) with
# the bias update and sequence-wise loss, each after 200 pretraining steps on the mixture of the lab's tasks (issue
# 31's recipe, one thread each: ~6 and ~11 CPU-minutes here). The one place this recipe is written; the results
# that start from these checkpoints (margins, drift_law_routers, real_routers) call this script.
set -euo pipefail
cd "$(dirname "$0")/../.."
C=checkpoints/cold_start
test -f $C/qwen30b_l16-addition-balanced/config.json || python -m experiments.sft model=qwen30b_l16 \
  'routers=[aux_loss]' sft.pretrain_steps=200 sft.output_dir=$C/qwen30b_l16-addition-balanced
test -f $C/glm4_moe_l16-addition-balanced/config.json || python -m experiments.sft model=glm4_moe_l16 \
  'routers=[bias_update]' sft.pretrain_steps=200 sft.output_dir=$C/glm4_moe_l16-addition-balanced
