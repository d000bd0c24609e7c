#!/usr/bin/env bash
# Regenerates docs/results/<name> for a result that is one experiment file: the cold start it starts from (made
# first when missing, by `python -m experiments.sft` with the given overrides), the experiment's runs in a new sweep
# directory (with the run overrides after `--`, e.g. other seeds), then the report.
#   docs/results/experiment.sh NAME CHECKPOINT [SFT OVERRIDES...] [-- RUN OVERRIDES...]
#   docs/results/experiment.sh claim1_deep checkpoints/cold_start/qwen30b_l16-addition model=qwen30b_l16
#   docs/results/experiment.sh deep_long_seeds checkpoints/cold_start/qwen30b_l16-scratchpad model=qwen30b_l16 \
#     dataset=scratchpad sft.batch_size=32 -- seed=10,11,12,13          # seeds the result was not reported on
# The report goes to docs/results/NAME, or, when run overrides are given, to reports/NAME-<date> (the committed
# result stays what its own command made).
set -euo pipefail
cd "$(dirname "$0")/../.."
name=$1 checkpoint=$2
shift 2
sft=() runs=()
while (($#)); do
  if [[ $1 == -- ]]; then shift; runs=("$@"); break; fi
  sft+=("$1"); shift
done
test -f "$checkpoint/config.json" || python -m experiments.sft "${sft[@]}"
stamp=$(date +%Y-%m-%d_%H-%M-%S)
sweep=multirun/$name/$stamp
python -m experiments.train -m experiment="$name" hydra.sweep.dir="$sweep" "${runs[@]}"
out=docs/results/$name
((${#runs[@]} == 0)) || out=reports/$name-$stamp
python -m analysis.report "$sweep" --out "$out"
