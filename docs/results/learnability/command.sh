#!/usr/bin/env bash
# Regenerates docs/results/learnability, why the synchronous baseline stays flat in the async cells and where it
# learns (issue 63; the plan, written before the runs, and the reading: docs/results/learnability/diagnosis.md).
#   docs/results/learnability/command.sh diagnosis   GRPO on seeds 0, 1 from start 0 of the async cells' sigmoid + bias
#                                                    recipe (glm4_moe_l16-addition-balanced-target) and of
#                                                    real_routers' balanced softmax recipe (qwen30b_l16-addition-balanced)
#                                                    in four settings (experiment=learnability_diagnosis): the async
#                                                    cell's (async), real_routers' (real), the async cell's with 16
#                                                    prompts a step (batch16), at lr 3e-5 (lr3e-5), evaluated as the
#                                                    cells were (cells_eval) and with MiniRL, the cells' arm (minirl);
#                                                    a report per start and setting, then the table of every run
#                                                    (python -m analysis.learnability)
#   docs/results/learnability/command.sh map         the learnability map, as docs/results/learnability/
#                                                    preregistration.md fixed it before its first run: starts 0-2 of
#                                                    the three NAME-t1000 recipes, RL seed 100, GRPO at the centre (16
#                                                    prompts a step, N = 2, lr 1e-4, 150 steps) and at one lever at a
#                                                    time (p8, p32, lr3e-5, lr3e-4, g16, h400), MiniRL and GSPO at the
#                                                    centre, the dense control's GRPO at the centre; then the table
#                                                    and the pre-registered rule's verdict (rule.md)
#   docs/results/learnability/command.sh extension   the map's one declared extension, run because no lever met the
#                                                    rule: GRPO at lr 3e-5 with 32 prompts a step for 400 steps from
#                                                    the same six MoE starts; then the rule again over the map and it
#                                                    (rule.md, regime.json)
# Every sweep resumes (resume=auto): run again, it goes on where it stopped. One run at a time on one thread
# (hydra.launcher.n_jobs=2 in the arguments runs two side by side). Extra arguments are run overrides passed to every
# sweep; any but hydra.launcher.n_jobs makes other runs than the documented ones, whose sweeps go to
# multirun/learnability/other-<date> and reports to reports/learnability-<date>.
set -euo pipefail
source "$(dirname "$0")/../args.sh"
mode=${1:-}
shift || true
[[ $mode == diagnosis || $mode == map || $mode == extension ]] ||
  refuse "mode '$mode' is not one of: diagnosis, map, extension"
check_run_overrides "$@"
destinations learnability --threads-pinned "$@"
cd "$(dirname "$0")/../../.."
starts=docs/results/router_starts.sh
if [[ $mode == map || $mode == extension ]]; then
  sigmoid=glm4_moe_l16-addition-balanced-target-t1000 softmax=qwen30b_l16-addition-balanced-t1000
  dense=qwen30b_l16_dense-addition-t1000
  $starts --starts 3 $sigmoid $softmax $dense
  # Setting outermost, then rung: a command stopped part-way leaves each setting it reached on every start. The three
  # starts of a rung are one sweep (model.path swept), so that hydra.launcher.n_jobs=2 runs two of them side by side.
  settings=(centre p8 p32 lr3e-5 lr3e-4 g16 h400)
  [[ $mode == map ]] || settings=(extension)
  for setting in "${settings[@]}"; do
    case $setting in
      centre) changes=(arm=grpo,minirl,gspo) ;;
      p8) changes=(trainer.prompts_per_step=8) ;;
      p32) changes=(trainer.prompts_per_step=32) ;;
      lr3e-5) changes=(trainer.lr=3e-5) ;;
      lr3e-4) changes=(trainer.lr=3e-4) ;;
      g16) changes=(trainer.group_size=16) ;;
      h400) changes=(trainer.steps=400) ;;
      extension) changes=(trainer.lr=3e-5 trainer.prompts_per_step=32 trainer.steps=400) ;;
    esac
    for rung in glm4_moe_l16 qwen30b_l16 qwen30b_l16_dense; do
      runs=("${changes[@]}")
      case $rung in
        glm4_moe_l16) recipe=$sigmoid ;;
        qwen30b_l16) recipe=$softmax ;;
        qwen30b_l16_dense) [[ $setting == centre ]] || continue; recipe=$dense runs=(arm=grpo) ;;
      esac
      paths=$PWD/$($starts --path 0 $recipe),$PWD/$($starts --path 1 $recipe),$PWD/$($starts --path 2 $recipe)
      python -m experiments.train -m experiment=learnability_map "hydra.sweeper.params.model=$rung" \
        "model.path=$paths" hydra.launcher.n_jobs=1 "hydra.sweep.dir=$sweeps_home/map_${rung}_$setting" \
        resume=auto "${runs[@]}" "$@"
    done
  done
  python -m analysis.learnability "$sweeps_home"/map_* --out "$results_home/map" --rule
  exit 0
fi
sigmoid=glm4_moe_l16-addition-balanced-target softmax=qwen30b_l16-addition-balanced
$starts $sigmoid $softmax
# Setting outermost: a command stopped part-way leaves each setting it reached on both starts.
# cells_eval and minirl were added after the first async runs gained (diagnosis.md says so): the async cell's recipe
# evaluated as the cells were (the first 128 test prompts every 10 steps, greedy only), and with the cells' own arm.
for setting in async real batch16 lr3e-5 cells_eval minirl; do
  case $setting in
    async) changes=() ;;
    real) changes=(trainer.prompts_per_step=32 trainer.minibatches=4 trainer.steps=60 trainer.eval_every=10) ;;
    batch16) changes=(trainer.prompts_per_step=16) ;;
    lr3e-5) changes=(trainer.lr=3e-5) ;;
    cells_eval)
      changes=(trainer.eval_prompts=128 trainer.eval_every=10 trainer.eval_samples=0 trainer.eval_train=false) ;;
    minirl) changes=(hydra.sweeper.params.arm=minirl comparison.baseline=minirl) ;;
  esac
  for rung in glm4_moe_l16 qwen30b_l16; do
    if [[ $rung == glm4_moe_l16 ]]; then recipe=$sigmoid; else recipe=$softmax; fi
    name=diagnosis_${rung}_$setting
    python -m experiments.train -m experiment=learnability_diagnosis "hydra.sweeper.params.model=$rung" \
      "model.path=$PWD/$($starts --path 0 $recipe)" hydra.launcher.n_jobs=1 "hydra.sweep.dir=$sweeps_home/$name" \
      resume=auto "${changes[@]}" "$@"
    python -m analysis.report "$sweeps_home/$name" --out "$results_home/diagnosis/$rung/$setting" --dpi 72
  done
done
python -m analysis.learnability "$sweeps_home"/diagnosis_* --out "$results_home/diagnosis"
