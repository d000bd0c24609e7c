#!/usr/bin/env bash
# Regenerates docs/results/drift_law: the drift probe on every cold start of the lab (addition at 2 to 48 MoE layers,
# 16 to 128 experts; the scratchpad task at 16, 32 and 64 answer tokens), then the law fitted over them.
# About 0.4 CPU-hours of probes, after the cold starts (docs/results/cold_starts/command.sh makes the deep ones).
set -euo pipefail
source "$(dirname "$0")/../args.sh"
takes_no_arguments "$@"
cd "$(dirname "$0")/../../.."
C=checkpoints/cold_start
ADDITION="paper_moe_l2 paper_moe_l4 paper_moe tiny_moe deep_moe granite1b_l16 granite1b_l32 granite1b_l48"
ADDITION+=" qwen30b_l16 qwen30b_l32 qwen30b_l48"
for m in $ADDITION; do test -f $C/$m-addition/config.json || python -m experiments.sft model=$m; done
test -f $C/tiny_moe-scratchpad/config.json || python -m experiments.sft model=tiny_moe dataset=scratchpad
for d in 8 32; do
  test -f $C/tiny_moe-scratchpad$d/config.json || python -m experiments.sft model=tiny_moe dataset=scratchpad \
    dataset.digits=$d sft.batch_size=$((d == 32 ? 32 : 128)) "sft.output_dir=$C/tiny_moe-scratchpad$d"
done
test -f $C/qwen30b_l16-scratchpad/config.json ||
  python -m experiments.sft model=qwen30b_l16 dataset=scratchpad sft.batch_size=32

out=multirun/probe/$(date +%Y-%m-%d_%H-%M-%S)
LRS='probe.lrs=[1e-5,3e-5,1e-4,3e-4,1e-3]'
PRECISIONS='probe.precisions=[bf16,fp16]'
python -m experiments.probe -m model=${ADDITION// /,} "$LRS" "$PRECISIONS" hydra.sweep.dir=$out/addition
for d in 8 16 32; do
  path=$C/tiny_moe-scratchpad$([ $d = 16 ] || echo $d)
  python -m experiments.probe model=tiny_moe dataset=scratchpad dataset.digits=$d model.path=$path \
    trainer.max_new_tokens=$((2 * d + 1)) "$LRS" "$PRECISIONS" hydra.run.dir=$out/scratchpad/tiny_moe_d$d
done
python -m experiments.probe model=qwen30b_l16 dataset=scratchpad trainer.max_new_tokens=33 "$LRS" "$PRECISIONS" \
  hydra.run.dir=$out/scratchpad/qwen30b_l16_d16
python -m analysis.drift_law $out --out docs/results/drift_law
