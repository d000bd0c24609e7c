#!/usr/bin/env bash
# Regenerates docs/results/cold_starts_portable: the cold starts this round's ten-seed results start from, made with
# the portable CPU kernels (the default), one thread each: the same bits on any x86-64 CPU with AVX2 and this torch
# build. About 20 CPU-minutes. A start's weights sha256 is what each RL run's summary names as start_sha256.
set -euo pipefail
source "$(dirname "$0")/../args.sh"
takes_no_arguments "$@"
cd "$(dirname "$0")/../../.."
python -m experiments.sft model=tiny_moe hydra.run.dir=outputs/sft_portable/tiny_moe-addition
python -m experiments.sft model=qwen30b_l16 dataset=scratchpad sft.batch_size=32 \
  hydra.run.dir=outputs/sft_portable/qwen30b_l16-scratchpad
python -m experiments.sft model=qwen30b_l16_e16 dataset=scratchpad sft.batch_size=32 \
  hydra.run.dir=outputs/sft_portable/qwen30b_l16_e16-scratchpad
python -m analysis.cold_starts outputs/sft_portable --out docs/results/cold_starts_portable
