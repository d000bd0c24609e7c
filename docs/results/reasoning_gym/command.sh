#!/usr/bin/env bash
# Regenerates docs/results/reasoning_gym: a reasoning-gym task beside addition in one RL cell (issue 47). The two
# cold starts (docs/results/router_starts.sh makes each one missing: basic_arithmetic with two terms of up to two
# digits and + or -, the dataset settings of conf/experiment/reasoning_gym.yaml, with a budget of 1,000 steps: one of
# 287 s stopped at 117 steps and 3.9% held-out greedy, where addition's tiny_moe start also stood below 10% until ~200
# steps); then experiment=reasoning_gym and experiment=addition_cell (GRPO, GRPO + R2, GSPO on seeds 0-2, tiny_moe,
# lr 1e-4, N = 4, 40 steps: 18 runs, two side by side on one thread each); then a report of each.
# Needs reasoning-gym, which make installs (the reasoning extra, at the lock's version).
set -euo pipefail
source "$(dirname "$0")/../args.sh"
takes_no_arguments "$@"
cd "$(dirname "$0")/../../.."
docs/results/router_starts.sh tiny_moe-reasoning_gym-basic_arithmetic tiny_moe-addition
out=multirun/reasoning_gym/$(date +%Y-%m-%d_%H-%M-%S)
python -m experiments.train -m experiment=reasoning_gym hydra.sweep.dir=$out/reasoning_gym
python -m experiments.train -m experiment=addition_cell hydra.sweep.dir=$out/addition
# one report per task: their runs start from different recipes' starts, which a report of both would pool as two
# starts of one recipe
python -m analysis.report $out/reasoning_gym --out docs/results/reasoning_gym --dpi 72
python -m analysis.report $out/addition --out docs/results/reasoning_gym/addition --dpi 72
