#!/usr/bin/env bash
# Regenerates docs/results/replay_variants: the routing variants (full replay with gate weights, soft replay,
# router-shift weighting) beside GRPO, GRPO + R2, GRPO + R3 and GSPO at 20% SYNTHETIC flips on the tiny MoE, seeds
# 0-2 (21 runs of 40 steps); then the report.
set -euo pipefail
cd "$(dirname "$0")/../../.."
test -f checkpoints/cold_start/tiny_moe-addition/config.json || python -m experiments.sft
sweep=multirun/replay_variants/$(date +%Y-%m-%d_%H-%M-%S)
python -m experiments.train -m experiment=replay_variants hydra.sweep.dir="$sweep"
python -m analysis.report "$sweep" --out docs/results/replay_variants
