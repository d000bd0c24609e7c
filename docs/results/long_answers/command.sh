#!/usr/bin/env bash
# Regenerates docs/results/long_answers: the length diagram's most separated cell (tiny MoE, 32-token answers,
# lr 3e-4) on report seeds 0-9 from the portable cold start; 30 runs. The cold start's safety stop is raised: on a
# loaded machine its ~30 CPU-minutes can take over the default hour of wall time, which would cut it short.
#
# The committed report.md is seeds 0-2 from the cold start made before starts were pinned (0.945). From the pinned
# start (sha256 b3764d50fefb, 0.664), in sweeps of two seeds so that every arm of a seed lands together: seeds 0-3 in
# portable/, 4-9 in portable_s4_9/, and the ten paired in ten_seeds/ (analysis.compare refuses any seed whose arms
# start apart):
#   python -m experiments.train -m experiment=long_answers seed=0,1 hydra.sweep.dir=multirun/long_answers/s01
#   python -m experiments.train -m experiment=long_answers seed=2,3 hydra.sweep.dir=multirun/long_answers/s23
#   python -m analysis.report multirun/long_answers/s01 multirun/long_answers/s23 \
#     --out docs/results/long_answers/portable
#   for s in 4,5 6,7 8,9; do python -m experiments.train -m experiment=long_answers seed=$s hydra.launcher.n_jobs=1 \
#     hydra.sweep.dir=multirun/long_answers/s${s/,/}; done
#   python -m analysis.report multirun/long_answers/s45 multirun/long_answers/s67 multirun/long_answers/s89 \
#     --out docs/results/long_answers/portable_s4_9
#   python -m analysis.compare docs/results/long_answers/portable docs/results/long_answers/portable_s4_9 \
#     --out docs/results/long_answers/ten_seeds
#   docs/results/long_answers/command.sh -- RUN OVERRIDES...   other runs (e.g. -- seed=10,11), reported in reports/
source "$(dirname "$0")/../args.sh"
only_run_overrides "$@"
exec "$(dirname "$0")/../experiment.sh" long_answers checkpoints/cold_start/tiny_moe-scratchpad16 model=tiny_moe \
  dataset=scratchpad dataset.digits=16 sft.output_dir=checkpoints/cold_start/tiny_moe-scratchpad16 \
  sft.max_seconds=14400 "$@"
