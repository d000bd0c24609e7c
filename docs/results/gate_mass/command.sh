#!/usr/bin/env bash
# Regenerates docs/results/gate_mass: how much of a token's gate mass its best expert holds in the cold starts the
# results start from (issue 45 item 5), beside the top-k margins (analysis.margins: the "gate mass, best / last"
# column, medians over tokens and layers of the held-out demonstrations). The starts: tiny_moe's addition start (the
# quickstart, flip_dose_seeds, addition_cell), the balanced softmax rung (real_routers' qwen30b_l16, the staleness
# control), the six starts of the balanced sigmoid + bias rung the staleness cells run from, and the six starts of
# deep_long's recipe (deep_long_seeds, the confounds, recipe_claims' claims (a) and (b)) and of its 16-expert top-2
# twin (few_experts, recipe_claims' claim (c)).
set -euo pipefail
source "$(dirname "$0")/../args.sh"
takes_no_arguments "$@"
cd "$(dirname "$0")/../../.."
S=docs/results/router_starts.sh
$S tiny_moe-addition qwen30b_l16-addition-balanced
$S --starts 6 glm4_moe_l16-addition-balanced-target qwen30b_l16-scratchpad qwen30b_l16_e16-scratchpad
glm4=() deep=() few=()
for k in 0 1 2 3 4 5; do
  glm4+=("$($S --path $k glm4_moe_l16-addition-balanced-target)")
  deep+=("$($S --path $k qwen30b_l16-scratchpad)")
  few+=("$($S --path $k qwen30b_l16_e16-scratchpad)")
done
python -m analysis.margins "$($S --path 0 tiny_moe-addition)" "$($S --path 0 qwen30b_l16-addition-balanced)" \
  "${glm4[@]}" "${deep[@]}" "${few[@]}" --out docs/results/gate_mass
