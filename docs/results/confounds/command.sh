#!/usr/bin/env bash
# Regenerates docs/results/confounds: confound (a) of deep_long_seeds, the step GSPO takes. Calibration on tuning
# seeds 100-102 (the rules in conf/search/matched_step.yaml and matched_clip.yaml), then the matched arms on report
# seeds 0-9, each compared with deep_long_seeds' other arm on the same seeds from the same portable cold start.
#   docs/results/confounds/command.sh            # after docs/results/deep_long_seeds/command.sh
set -euo pipefail
source "$(dirname "$0")/../args.sh"
takes_no_arguments "$@"
cd "$(dirname "$0")/../../.."
C=multirun/confounds
python -m experiments.train -m search=matched_step hydra.sweep.dir=$C/matched_step
for s in 1 10 30 100 300 1000; do
  python -m experiments.train -m search=matched_clip algo.clip_low="$(python -c "print(3e-4*$s)")" \
    algo.clip_high="$(python -c "print(4e-4*$s)")" hydra.sweep.dir=$C/matched_clip_s$s
done
python -m analysis.calibrate $C/matched_clip_s1 $C/matched_step --knob trainer.lr --measure kl/old_k3 \
  --target algo.name=gspo algo.clip_low=0.0003 --grid algo.name=grpo --out docs/results/confounds/step
python -m analysis.calibrate $C/matched_step $C/matched_clip_s* --knob algo.clip_low --measure clip/token_frac \
  --target algo.name=grpo trainer.lr=0.0003 --grid algo.name=gspo --out docs/results/confounds/clip
# The matched arms (their experiment files carry the calibrated values) on report seeds 0-9, each report of its own
# runs, then paired with deep_long_seeds' arms on the same seeds and start (analysis.compare reads its per-seed table;
# the matched GRPO is renamed, since deep_long_seeds has a GRPO at lr 3e-4 too; --family is the comparison each
# experiment file declares).
D=docs/results/confounds
python -m experiments.train -m experiment=confound_step hydra.sweep.dir=$C/confound_step
python -m analysis.report $C/confound_step --out $D/step_arms
python -m analysis.compare docs/results/deep_long_seeds $D/step_arms:grpo=grpo-lr2.7e-4 --baseline grpo-lr2.7e-4 \
  --family gspo --out $D/step_compared
python -m experiments.train -m experiment=confound_clip hydra.sweep.dir=$C/confound_clip
python -m analysis.report $C/confound_clip --out $D/clip_arms
python -m analysis.compare docs/results/deep_long_seeds $D/clip_arms:gspo=gspo-wide-clip --baseline grpo \
  --family gspo-wide-clip --out $D/clip_compared
