#!/usr/bin/env bash
# Regenerates docs/results/collapse, the collapse searched where the baseline learns (issue 63, part 4), as
# docs/results/collapse/preregistration.md fixed it before its first run. It runs in the regime the learnability map's
# rule chose (docs/results/learnability/map/regime.json): refused in one line until that file exists.
#   docs/results/collapse/command.sh minibatches   stage 1: GRPO, GRPO + R2 and GSPO with the regime's prompts a step
#                                                  split into N = 8, then N = 16 mini-batches, from the learnability
#                                                  map's starts 0-2 of glm4_moe_l16-addition-balanced-target-t1000,
#                                                  RL seed 100; a report per N (Figures 1, 3, 4b and 7)
# Every sweep resumes (resume=auto): run again, it goes on where it stopped. One run at a time on one thread
# (hydra.launcher.n_jobs=2 in the arguments runs two side by side). Extra arguments after the mode are run overrides,
# passed to every sweep; any but hydra.launcher.n_jobs makes other runs than the documented ones, whose sweeps go to
# multirun/collapse/other-<date> and reports to reports/collapse-<date>.
set -euo pipefail
source "$(dirname "$0")/../args.sh"
mode=${1:-}
shift || true
[[ $mode == minibatches ]] || refuse "mode '$mode' is not one of: minibatches"
check_run_overrides "$@"
destinations collapse --threads-pinned "$@"
cd "$(dirname "$0")/../../.."
read_regime "the collapse search"
starts=docs/results/router_starts.sh
sigmoid=glm4_moe_l16-addition-balanced-target-t1000
$starts --starts 3 $sigmoid
paths=$PWD/$($starts --path 0 $sigmoid),$PWD/$($starts --path 1 $sigmoid),$PWD/$($starts --path 2 $sigmoid)
# The figures each report keeps (docs/ is held under 10 MB; the same report without --figures draws every one): what
# a collapse shows, reward and held-out accuracy against step and compute, GRPO with and without replay, drift per
# layer against step, and what moves before the reward falls.
kept_figures="--dpi 100 --figures 1 3 4b 7"
# The regime's overrides first, the push after them: N is what this stage changes, whatever the regime's was.
for n in 8 16; do
  python -m experiments.train -m experiment=collapse_search "model.path=$paths" "${regime[@]}" \
    "trainer.minibatches=$n" hydra.launcher.n_jobs=1 "hydra.sweep.dir=$sweeps_home/minibatches_n$n" resume=auto "$@"
  python -m analysis.report "$sweeps_home/minibatches_n$n" --out "$results_home/minibatches/n$n" $kept_figures
done
