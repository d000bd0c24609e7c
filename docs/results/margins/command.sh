#!/usr/bin/env bash
# Regenerates docs/results/margins: the top-k margin of the 16-layer rung's cold starts (docs/results/router_starts.sh:
# the softmax rung qwen30b_l16 and its sigmoid + bias twin glm4_moe_l16, each by today's recipe, balanced as its
# family trains, and with near-tied routers at init) against the anchors of real checkpoints.
set -euo pipefail
source "$(dirname "$0")/../args.sh"
takes_no_arguments "$@"
cd "$(dirname "$0")/../../.."
C=checkpoints/cold_start
docs/results/router_starts.sh
python -m analysis.margins $C/qwen30b_l16-addition $C/qwen30b_l16-addition-balanced $C/qwen30b_l16-addition-tied \
  $C/glm4_moe_l16-addition $C/glm4_moe_l16-addition-balanced $C/glm4_moe_l16-addition-tied --out docs/results/margins
