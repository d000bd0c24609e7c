#!/usr/bin/env bash
# Regenerates docs/results/length_diagram: the tiny MoE's scratchpad cold starts (answers of 16 and 32 tokens), then
# GRPO, GRPO + R2 and GSPO over lr 1e-4, 3e-4, 1e-3 on tuning seed 100 (18 runs of 40 steps); then the report.
set -euo pipefail
source "$(dirname "$0")/../args.sh"
takes_no_arguments "$@"
cd "$(dirname "$0")/../../.."
C=checkpoints/cold_start
for d in 8 16; do
  test -f $C/tiny_moe-scratchpad$d/config.json || python -m experiments.sft model=tiny_moe dataset=scratchpad \
    dataset.digits=$d "sft.output_dir=$C/tiny_moe-scratchpad$d"
done
sweep=multirun/length_diagram/$(date +%Y-%m-%d_%H-%M-%S)
python -m experiments.train -m experiment=length_diagram hydra.sweep.dir="$sweep"
python -m analysis.report "$sweep" --out docs/results/length_diagram
