#!/usr/bin/env bash
# Regenerates docs/results/quickstart: what `make run` does (the tiny_moe addition cold start, once; the quickstart
# sweep, GRPO and GRPO + R2 on seeds 0-2 under SYNTHETIC flips and under SYNTHETIC router noise; its report), the
# report written here instead of inside the sweep.
set -euo pipefail
source "$(dirname "$0")/../args.sh"
takes_no_arguments "$@"
cd "$(dirname "$0")/../../.."
test -f checkpoints/cold_start/tiny_moe-addition/config.json || python -m experiments.sft
sweep=multirun/quickstart/$(date +%Y-%m-%d_%H-%M-%S)
python -m experiments.train -m experiment=quickstart hydra.sweep.dir="$sweep"
python -m analysis.report "$sweep" --out docs/results/quickstart
