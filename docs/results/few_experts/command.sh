#!/usr/bin/env bash
# Regenerates docs/results/few_experts: deep_long_seeds' cell on qwen30b_l16_e16 (16 experts top-2, the same depth
# and active width), report seeds 0-9, from its own portable cold start (deep_long_seeds' SFT recipe); GRPO and GSPO,
# 20 runs. The committed report was made as five sweeps of two seeds, two side by side on one thread each
# (`python -m experiments.train -m experiment=few_experts seed=0,1 hydra.sweep.dir=multirun/few_experts/s01
# trainer.threads=1`, ... s89; the first also ran GRPO + R2, the experiment's arms then), then
# `python -m analysis.report multirun/few_experts/s01 ... multirun/few_experts/s89 --out docs/results/few_experts`.
#   docs/results/few_experts/command.sh -- RUN OVERRIDES...   other runs (e.g. -- seed=10,11), reported in reports/
source "$(dirname "$0")/../args.sh"
only_run_overrides "$@"
exec "$(dirname "$0")/../experiment.sh" few_experts checkpoints/cold_start/qwen30b_l16_e16-scratchpad \
  model=qwen30b_l16_e16 dataset=scratchpad sft.batch_size=32 "$@"
