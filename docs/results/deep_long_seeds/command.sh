#!/usr/bin/env bash
# Regenerates docs/results/deep_long_seeds: deep_long's most separated cell (qwen30b_l16, 32-token answers, lr 3e-4)
# on report seeds 0-9 from the portable cold start; 30 runs in one sweep and one report.
# The committed folder was made in parts, from the same start (sha256 afbf8c7e8aa6) and seeds:
#   report.md       GSPO and GRPO (20 runs, three sweeps of the one cell after a stop)
#   r2/             GRPO + R2, a later session:
#     python -m experiments.train -m experiment=deep_long_seeds arm=grpo_r2 hydra.sweep.dir=$R2
#     python -m analysis.report $R2 --out docs/results/deep_long_seeds/r2
#   rerun_check/    GRPO seeds 0-1 made again by that session from its own fresh checkout and cold start: every number
#                   of per_seed.csv equals the committed one (arm=grpo seed=0,1, then analysis.report as above)
#   all_arms/       the three arms paired over the seeds:
#     python -m analysis.compare docs/results/deep_long_seeds docs/results/deep_long_seeds/r2 \
#       --out docs/results/deep_long_seeds/all_arms
#   docs/results/deep_long_seeds/command.sh -- RUN OVERRIDES...   other runs (e.g. -- seed=10,11), reported in reports/
source "$(dirname "$0")/../args.sh"
only_run_overrides "$@"
exec "$(dirname "$0")/../experiment.sh" deep_long_seeds checkpoints/cold_start/qwen30b_l16-scratchpad \
  model=qwen30b_l16 dataset=scratchpad sft.batch_size=32 "$@"
