#!/usr/bin/env bash
# Regenerates docs/results/drift_law_routers: the drift law again on the 16-layer, 128-expert top-8 rung with routers
# like real ones, the cold start's top-k margin and the router family as regressors (analysis.drift_law). Six cold
# starts on addition (docs/results/router_starts.sh), one thread each: the softmax rung (qwen30b_l16) and its
# sigmoid + bias twin (glm4_moe_l16), each as today's recipe, balanced as its family trains (Qwen3's auxiliary loss;
# the bias update), and with near-tied routers at init (router_init_std 0.03, a tenth of the default), so that the
# margin varies within each family by design; then the probe at five learning rates on each. Rule, fixed before the
# probes: the law answers issue 31's goal, ≥ 5% drift per update at a learning rate where every arm still learns
# (lr ≤ 1e-4 on this rung: phase_diagram, deep_long), by the margin it says that needs at lr 1e-4, against the
# margins the recipes reach.
set -euo pipefail
source "$(dirname "$0")/../args.sh"
takes_no_arguments "$@"
cd "$(dirname "$0")/../../.."
C=checkpoints/cold_start
docs/results/router_starts.sh
out=multirun/probe_routers/$(date +%Y-%m-%d_%H-%M-%S)
for name in qwen30b_l16-addition qwen30b_l16-addition-balanced qwen30b_l16-addition-tied glm4_moe_l16-addition \
  glm4_moe_l16-addition-balanced glm4_moe_l16-addition-tied; do
  python -m experiments.probe "model=${name%%-*}" "model.path=$C/$name" 'probe.lrs=[1e-5,3e-5,1e-4,3e-4,1e-3]' \
    'probe.precisions=[bf16]' "hydra.run.dir=$out/$name"
done
python -m analysis.drift_law "$out" --out docs/results/drift_law_routers
