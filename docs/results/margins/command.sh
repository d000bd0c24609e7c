#!/usr/bin/env bash
# Regenerates docs/results/margins: the top-k margin of today's cold start recipe and of the balanced one (the
# family's own balancing and a pretraining phase on the mixture of tasks), for the softmax ladder rung qwen30b_l16
# and its sigmoid + bias twin glm4_moe_l16, against the anchors of real checkpoints. One thread per cold start.
set -euo pipefail
cd "$(dirname "$0")/../../.."
C=checkpoints/cold_start
python -m experiments.sft model=qwen30b_l16
python -m experiments.sft model=glm4_moe_l16
docs/results/balanced_starts.sh
python -m analysis.margins $C/qwen30b_l16-addition $C/qwen30b_l16-addition-balanced $C/glm4_moe_l16-addition \
  $C/glm4_moe_l16-addition-balanced --out docs/results/margins
