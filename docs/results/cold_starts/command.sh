#!/usr/bin/env bash
# Regenerates docs/results/cold_starts: every cold start the results start from, by the documented commands (one
# thread each: the same checkpoint on any machine with this torch build and instruction set), then their report.
# About 1.3 CPU-hours in all; the deep ladder alone (qwen30b_l*, granite1b_l*) about 40 CPU-minutes.
set -euo pipefail
source "$(dirname "$0")/../args.sh"
takes_no_arguments "$@"
cd "$(dirname "$0")/../../.."
C=checkpoints/cold_start
for m in tiny_moe paper_moe_l2 paper_moe_l4 paper_moe deep_moe granite1b_l16 granite1b_l32 granite1b_l48 \
         qwen30b_l16 qwen30b_l32 qwen30b_l48; do
  python -m experiments.sft model=$m
done
python -m experiments.sft model=tiny_moe dataset=scratchpad
python -m experiments.sft model=tiny_moe dataset=scratchpad dataset.digits=8 "sft.output_dir=$C/tiny_moe-scratchpad8"
python -m experiments.sft model=tiny_moe dataset=scratchpad dataset.digits=32 sft.batch_size=32 \
  "sft.output_dir=$C/tiny_moe-scratchpad32"
python -m experiments.sft model=qwen30b_l16 dataset=scratchpad sft.batch_size=32
python -m analysis.cold_starts outputs/sft --out docs/results/cold_starts
