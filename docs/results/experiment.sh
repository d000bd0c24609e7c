#!/usr/bin/env bash
# Regenerates docs/results/<name> for a result that is one experiment file: the cold start it starts from (made
# first when missing, by `python -m experiments.sft` with the given overrides), the experiment's runs in a new sweep
# directory, then the report.
#   docs/results/experiment.sh NAME CHECKPOINT [SFT OVERRIDES...]
#   docs/results/experiment.sh claim1_deep checkpoints/cold_start/qwen30b_l16-addition model=qwen30b_l16
set -euo pipefail
cd "$(dirname "$0")/../.."
name=$1 checkpoint=$2
shift 2
test -f "$checkpoint/config.json" || python -m experiments.sft "$@"
sweep=multirun/$name/$(date +%Y-%m-%d_%H-%M-%S)
python -m experiments.train -m experiment="$name" hydra.sweep.dir="$sweep"
python -m analysis.report "$sweep" --out "docs/results/$name"
