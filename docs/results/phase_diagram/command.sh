#!/usr/bin/env bash
# Regenerates docs/results/phase_diagram: the deep ladder's cold starts (Qwen3-30B-A3B's routing at 16, 32 and 48
# MoE layers), then GRPO, GRPO + R2, GSPO and GRPO + R3 (bf16 engine) over lr 1e-4, 3e-4, 1e-3 on tuning seed 100
# (36 runs of 40 steps, 1.6 CPU-hours), then the report.
set -euo pipefail
source "$(dirname "$0")/../args.sh"
takes_no_arguments "$@"
cd "$(dirname "$0")/../../.."
for m in qwen30b_l16 qwen30b_l32 qwen30b_l48; do
  test -f checkpoints/cold_start/$m-addition/config.json || python -m experiments.sft model=$m
done
sweep=multirun/phase_diagram/$(date +%Y-%m-%d_%H-%M-%S)
python -m experiments.train -m experiment=phase_diagram hydra.sweep.dir="$sweep"
python -m analysis.report "$sweep" --out docs/results/phase_diagram
