#!/usr/bin/env bash
# The GPU checks on a bare CUDA machine without network, in one command: install what travelled, build MegaBlocks,
# then run `python -m benchmarks.gpu_checks` one step at a time, each under its own time limit.
#
#   OUT=/some/dir bash benchmarks/gpu_checks.sh [SECONDS]
#
# What travels beside the repository (ignored by git, named in the device call's carry):
#   .gpu/whl   wheels of what the machine's Python lacks or has too old: hydra-core, omegaconf, antlr4 (built from
#              its sdist, py3-none-any), transformers and what its version needs (huggingface-hub, httpx2, ...)
#   .gpu/src   the source packages of megablocks 0.10.0, stanford-stk 0.7.1 and grouped_gemm 0.3.0 (its CUTLASS
#              headers inside), built here against the machine's torch; or .gpu/built, their wheels from an earlier
#              run (this script copies what it builds to $OUT), installed instead of building again.
# Writes to $OUT: gpu_checks.log (everything printed), gpu_checks.json (rewritten after every step), build.tsv
# (package, seconds, exit code) and the built wheels. SECONDS (default 560) is the whole run's budget: each step
# gets its own share, never more than what is left, and a step cut off is recorded as such, the next one runs.
set -u -o pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:?set OUT to the directory the results go to}
BUDGET=${1:-560}
START=$SECONDS
SITE=/tmp/site
LOG=$OUT/gpu_checks.log
JSON=$OUT/gpu_checks.json
BUILD_LOG=$OUT/build.tsv
mkdir -p "$OUT" "$SITE"
command -v nvcc >/dev/null || export PATH=$PATH:/usr/local/cuda/bin  # torch's extension builder finds CUDA by nvcc
: >"$BUILD_LOG"
export PYTHONPATH=$SITE${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 WANDB_MODE=disabled
exec > >(tee -a "$LOG") 2>&1
TEE=$!

left() { echo $((BUDGET - (SECONDS - START))); }

echo "== setup: wheels"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .gpu/whl/*.whl \
  || echo "wheels failed to install"

# Build one source package into a wheel (kept for the next run) and install it; record its seconds and exit code.
build() {
  local sdist=$1 name
  name=$(basename "$sdist" .tar.gz)
  local t0=$SECONDS
  TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=${MAX_JOBS:-16} python3 -m pip wheel -q --no-index --no-build-isolation --no-deps \
    --no-cache-dir -w "/tmp/built" "$sdist" >"/tmp/build_$name.log" 2>&1
  local rc=$?
  printf '%s\t%s\t%s\n' "$name" $((SECONDS - t0)) "$rc" >>"$BUILD_LOG"
  [ $rc -eq 0 ] || tail -n 30 "/tmp/build_$name.log"
}

echo "== setup: MegaBlocks, stanford-stk, grouped_gemm"
mkdir -p /tmp/built
if ls .gpu/built/*.whl >/dev/null 2>&1; then
  cp .gpu/built/*.whl /tmp/built/
  printf 'prebuilt\t0\t0\n' >>"$BUILD_LOG"
else
  # The two CUDA builds compile side by side (two translation units each); stanford-stk is pure Python. Wait for
  # these by their ids: a bare `wait` would also wait for the log's tee, which never ends.
  pids=()
  for sdist in .gpu/src/*.tar.gz; do build "$sdist" & pids+=($!); done
  wait "${pids[@]}"
fi
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" /tmp/built/*.whl \
  || echo "built wheels failed to install"
cp /tmp/built/*.whl "$OUT/" 2>/dev/null
cat "$BUILD_LOG"
python3 -c "import torch, transformers, hydra; print('torch', torch.__version__, 'transformers', transformers.__version__)"
python3 -c "import megablocks.ops, grouped_gemm.ops; print('megablocks and grouped_gemm import')"

# step name and its share of the budget in seconds, in order of worth; the GPU tests run before the probe, which
# only runs in what is left
unrun=()
STEPS="versions:30 parity:60 replay:60 rl_runs:120 expert_speed:90 rl_step:180 gpu_tests:120 probe:240"
for entry in $STEPS; do
  step=${entry%%:*}
  share=${entry##*:}
  # 15 s kept back for the one call that records the steps left unrun
  remaining=$(($(left) - 15))
  limit=$((share < remaining ? share : remaining))
  if [ "$limit" -lt 10 ]; then
    unrun+=(--note "$step" "not run: the budget of ${BUDGET} s was spent")
    continue
  fi
  # the step's subprocesses (a training run, pytest) end before the step does; rl_runs starts two
  runs=$([ "$step" = rl_runs ] && echo 2 || echo 1)
  echo "== $step (at most $limit s; $(left) s left)"
  timeout -k 5 "$limit" python3 -m benchmarks.gpu_checks --out "$JSON" --step "$step" --build-log "$BUILD_LOG" \
    --work /tmp/gpu_checks_runs --run-timeout $(((limit - 10) / runs))
  rc=$?
  if [ $rc -eq 124 ] || [ $rc -eq 137 ]; then
    python3 -m benchmarks.gpu_checks --out "$JSON" --note "$step" "cut off at its limit of ${limit} s"
  fi
done
[ ${#unrun[@]} -eq 0 ] || python3 -m benchmarks.gpu_checks --out "$JSON" "${unrun[@]}"
echo "== done in $((SECONDS - START)) s"
exec >&- 2>&-  # the log's last lines reach the file before the script returns
wait "$TEE"
