#!/usr/bin/env bash
# Regenerates docs/results/<name> for a result that is one experiment file: the cold start it starts from (made
# first when missing, by `python -m experiments.sft` with the given overrides), the experiment's runs in a new sweep
# directory (with the run overrides after `--`, e.g. other seeds), then the report.
#   docs/results/experiment.sh NAME CHECKPOINT [SFT OVERRIDES...] [-- RUN OVERRIDES...]
#   docs/results/experiment.sh claim1_deep checkpoints/cold_start/qwen30b_l16-addition model=qwen30b_l16
#   docs/results/experiment.sh deep_long_seeds checkpoints/cold_start/qwen30b_l16-scratchpad model=qwen30b_l16 \
#     dataset=scratchpad sft.batch_size=32 -- seed=10,11,12,13          # seeds the result was not reported on
# NAME is an experiment file of conf/experiment. The SFT overrides are the recipe of the start at CHECKPOINT, as the
# result's command writes it: model=, dataset=, routers= and keys under model., dataset., routers., sft. (anything
# else, a seed=... without its `--` say, is refused: once the start exists they would not be used).
# The report goes to docs/results/NAME, or, when run overrides are given, to reports/NAME-<date> (the committed
# result stays what its own command made).
set -euo pipefail
source "$(dirname "$0")/args.sh"
cd "$(dirname "$0")/../.."
(($# >= 2)) || refuse "expected NAME CHECKPOINT [SFT OVERRIDES...] [-- RUN OVERRIDES...], got '$*'"
name=$1 checkpoint=$2
shift 2
test -f "conf/experiment/$name.yaml" ||
  refuse "NAME '$name' is not an experiment (allowed: the files of conf/experiment)"
[[ $checkpoint != *=* && $checkpoint != -* ]] ||
  refuse "CHECKPOINT '$checkpoint' is not a cold start's folder (e.g. checkpoints/cold_start/tiny_moe-addition)"
sft=() runs=()
while (($#)); do
  if [[ $1 == -- ]]; then shift; runs=("$@"); break; fi
  sft+=("$1"); shift
done
check_sft_overrides "${sft[@]}"
check_run_overrides "${runs[@]}"
destinations "$name" "${runs[@]}"
test -f "$checkpoint/config.json" || python -m experiments.sft "${sft[@]}"
sweep=multirun/$name/$stamp
python -m experiments.train -m experiment="$name" hydra.sweep.dir="$sweep" "${runs[@]}"
python -m analysis.report "$sweep" --out "$results_home"
