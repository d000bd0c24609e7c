#!/usr/bin/env bash
# The cold-start recipes the results start from, written once, and K starts of each: a recipe is a cold start's SFT
# overrides; its start k (k = 0 .. K-1) draws the recipe's own seeds, the built model's weights (model.init_seed=k) and
# the SFT's data order and mixture (seed=k), so that a result can be a claim about the recipe, not one checkpoint.
# Start 0 is the documented one, at checkpoints/cold_start/NAME; start k >= 1 at checkpoints/cold_start/NAME-startk.
#   the 16-layer 128-expert top-8 rung whose routers the margins, drift_law_routers and real_routers compare: the
#   softmax rung (qwen30b_l16) and its sigmoid + bias twin (glm4_moe_l16), each
#     NAME-addition           today's recipe (the addition SFT alone)
#     NAME-addition-balanced  balanced as its family trains (issue 31): Qwen3's global-batch auxiliary loss, or the bias
#                             update and sequence-wise loss, after 200 pretraining steps on the mixture of the lab's
#                             tasks
#     NAME-addition-tied      routers near-tied at init (router_init_std 0.03, a tenth of the default)
#   glm4_moe_l16-addition-balanced-target, the balanced sigmoid start with the SFT budget raised from 600 to 1,200
#     steps, so that it can reach the 45% target that 600 did not (29.7% on the machine of real_routers' results);
#   qwen30b_l16_dense-addition, the dense control of the softmax rung's active size (docs/results/async);
#   NAME-t1000 of glm4_moe_l16-addition-balanced-target, qwen30b_l16-addition-balanced and qwen30b_l16_dense-addition:
#     the same recipe with 1,000 held-out prompts (docs/results/learnability's map);
#   the claims' starts: qwen30b_l16-scratchpad (deep_long_seeds and the confounds), qwen30b_l16_e16-scratchpad
#     (few_experts), tiny_moe-addition (the quickstart, flip_dose_seeds, router_noise_dose, addition_cell);
#   tiny_moe-reasoning_gym-basic_arithmetic, a reasoning-gym task's (experiment=reasoning_gym; its dataset settings
#     are the experiment's, and its budget 1,000 steps).
# One thread each, 3-15 CPU-minutes a start. An unknown name or option, or a bad K, is refused before any start is
# made.
#   docs/results/router_starts.sh                                            # the rung's six, start 0 each
#   docs/results/router_starts.sh qwen30b_l16-addition-balanced              # only the named ones
#   docs/results/router_starts.sh --starts 6 glm4_moe_l16-addition-balanced-target   # starts 0-5 of a recipe
#   docs/results/router_starts.sh --only 7 qwen30b_l16-addition-balanced-t1000   # start 7 alone (none below it)
#   docs/results/router_starts.sh --path 3 qwen30b_l16-scratchpad            # print where start 3 lives, make nothing
set -euo pipefail -f  # -f: the recipes' overrides hold brackets, never globs
source "$(dirname "$0")/args.sh"
cd "$(dirname "$0")/../.."
C=${COLD_STARTS:-checkpoints/cold_start}  # where the starts live (a test's own folder)
recipe() {  # the SFT overrides of recipe $1
  case $1 in
    qwen30b_l16-addition) echo "model=qwen30b_l16" ;;
    qwen30b_l16-addition-balanced) echo "model=qwen30b_l16 routers=[aux_loss] sft.pretrain_steps=200" ;;
    qwen30b_l16-addition-tied) echo "model=qwen30b_l16 model.router_init_std=0.03" ;;
    glm4_moe_l16-addition) echo "model=glm4_moe_l16" ;;
    glm4_moe_l16-addition-balanced) echo "model=glm4_moe_l16 routers=[bias_update] sft.pretrain_steps=200" ;;
    glm4_moe_l16-addition-tied) echo "model=glm4_moe_l16 model.router_init_std=0.03" ;;
    glm4_moe_l16-addition-balanced-target)
      echo "model=glm4_moe_l16 routers=[bias_update] sft.pretrain_steps=200 sft.max_steps=1200" ;;
    qwen30b_l16-scratchpad) echo "model=qwen30b_l16 dataset=scratchpad sft.batch_size=32" ;;
    qwen30b_l16_e16-scratchpad) echo "model=qwen30b_l16_e16 dataset=scratchpad sft.batch_size=32" ;;
    qwen30b_l16_dense-addition) echo "model=qwen30b_l16_dense" ;;
    # The learnability map's (docs/results/learnability/preregistration.md): the same recipes with 1,000 held-out
    # prompts, which the SFT never trains on (the test split is drawn first, then the train split from the rest).
    glm4_moe_l16-addition-balanced-target-t1000)
      echo "$(recipe glm4_moe_l16-addition-balanced-target) dataset.test_size=1000" ;;
    qwen30b_l16-addition-balanced-t1000) echo "$(recipe qwen30b_l16-addition-balanced) dataset.test_size=1000" ;;
    qwen30b_l16_dense-addition-t1000) echo "$(recipe qwen30b_l16_dense-addition) dataset.test_size=1000" ;;
    tiny_moe-addition) echo "model=tiny_moe" ;;
    tiny_moe-reasoning_gym-basic_arithmetic)
      echo "model=tiny_moe dataset=reasoning_gym dataset.task=basic_arithmetic +dataset.params.max_terms=2" \
        "+dataset.params.max_digits=2 +dataset.params.operators=[+,-] +dataset.params.allow_parentheses=false" \
        "+dataset.params.allow_negation=false sft.max_steps=1000" ;;
    *) refuse "no cold-start recipe named '$1' (allowed: the fifteen listed in $command_file)" ;;
  esac
}
start_dir() {  # where start $2 of recipe $1 lives
  if (($2 == 0)); then echo "$C/$1"; else echo "$C/$1-start$2"; fi
}
starts= path= only=
while (($#)); do
  case $1 in
    --starts | --path | --only)
      (($# >= 2)) || refuse "$1 needs a value (--starts K: starts 0 .. K-1 of each recipe; --only K: start K alone;" \
        "--path K: where start K lives)"
      case $1 in --starts) starts=$2 ;; --path) path=$2 ;; --only) only=$2 ;; esac
      shift 2 ;;
    -*) refuse "option '$1' is not one of: --starts K, --only K, --path K, --help" ;;
    *) break ;;
  esac
done
[[ -z $starts || -z $only ]] || refuse "--starts $starts and --only $only: give one (starts 0 .. K-1, or start K alone)"
starts=${starts:-1}
[[ $starts =~ ^[1-9][0-9]*$ ]] ||
  refuse "--starts '$starts' must be a whole number >= 1 (the starts 0 .. K-1 of each recipe)"
[[ -z $path || $path =~ ^[0-9]+$ ]] || refuse "--path '$path' must be a start's number (0, 1, ...)"
[[ -z $only || $only =~ ^[0-9]+$ ]] || refuse "--only '$only' must be a start's number (0, 1, ...)"
names=("$@")
((${#names[@]})) || names=(qwen30b_l16-addition qwen30b_l16-addition-balanced qwen30b_l16-addition-tied
                           glm4_moe_l16-addition glm4_moe_l16-addition-balanced glm4_moe_l16-addition-tied)
for name in "${names[@]}"; do recipe "$name" >/dev/null; done  # every name known before any work
if [[ -n $path ]]; then
  for name in "${names[@]}"; do start_dir "$name" "$path"; done
  exit 0
fi
first=0
[[ -z $only ]] || first=$((10#$only)) starts=$((10#$only + 1))
for name in "${names[@]}"; do
  for ((k = first; k < starts; k++)); do
    dir=$(start_dir "$name" $k)
    seeds=()
    ((k == 0)) || seeds=("model.init_seed=$k" "seed=$k")
    # shellcheck disable=SC2046  # a recipe is overrides without spaces inside any
    test -f "$dir/config.json" || python -m experiments.sft $(recipe "$name") "${seeds[@]}" "sft.output_dir=$dir"
  done
done
