#!/usr/bin/env bash
# Re-reads every standing claim of docs/results under its experiment's declared comparison (issue 45 item 2): the
# primary measure (the mean gain over the run), the family the experiment file now declares, Holm's correction over
# it, from each result's committed per-seed table (no run is made again). One folder per result.
set -euo pipefail
source "$(dirname "$0")/../args.sh"
takes_no_arguments "$@"
cd "$(dirname "$0")/../../.."
R=docs/results
out=$R/reread
compare() {  # compare NAME REPORT FAMILY...
  local name=$1 report=$2
  shift 2
  python -m analysis.compare "$R/$report" --baseline grpo --primary gain_area --family "$@" --out "$out/$name"
}
compare flip_dose_seeds flip_dose_seeds gspo
compare router_noise_dose router_noise_dose "grpo + r2" gspo "grpo + r3 (bf16 engine)"
compare deep_long_seeds deep_long_seeds/all_arms gspo "grpo + r2"
compare long_answers_ten_seeds long_answers/ten_seeds gspo "grpo + r2"
compare few_experts few_experts gspo
for start in qwen30b_l16 glm4_moe_l16 glm4_moe_l16_target; do
  compare "real_routers_$start" "real_routers/$start" "grpo + r2" gspo "grpo + r3 (bf16 engine)"
done
python -m analysis.compare $R/deep_long_seeds $R/confounds/step_arms:grpo=grpo-lr2.7e-4 --baseline grpo-lr2.7e-4 \
  --primary gain_area --family gspo --out $out/confound_step
python -m analysis.compare $R/deep_long_seeds $R/confounds/clip_arms:gspo=gspo-wide-clip --baseline grpo \
  --primary gain_area --family gspo-wide-clip --out $out/confound_clip
