#!/usr/bin/env bash
# The arguments of the commands under docs/results, checked in one place. Every command sources this file first
# (`source "$(dirname "$0")/../args.sh"`, its arguments still in "$@"), so that:
#   --help or -h (before any `--`) prints the command's usage, the comment at its top, and exits 0 having done nothing;
#   a bad argument is refused in one line that names it and says what is allowed (exit 2), before any cold start,
#   sweep or report is made;
#   runs that overrides make other than the documented ones are reported in reports/, never over docs/results/NAME.
command_file=$0
stamp=$(date +%Y-%m-%d_%H-%M-%S)  # names the sweeps and reports a command makes

usage() {  # the comment at the top of the command file, without its '#'
  awk 'NR > 1 && !/^#/ { exit } NR > 1 { sub(/^# ?/, ""); print }' "$command_file"
}

refuse() {  # refuse WHY: one line on stderr, exit 2
  echo "error: $*" >&2
  exit 2
}

answer_help() {
  local argument
  for argument; do
    [[ $argument == -- ]] && return
    if [[ $argument == -h || $argument == --help ]]; then usage; exit 0; fi
  done
}
answer_help "$@"

takes_no_arguments() {  # a command that regenerates its documented result and nothing else
  (($# == 0)) || refuse "$command_file takes no arguments (got '$1'); --help says what it regenerates"
}

is_override() {  # a Hydra override: key=value, +key=value, ++key=value, ~key
  [[ $1 =~ ^(\+{0,2}[A-Za-z_][A-Za-z0-9_./@-]*=|~[A-Za-z_][A-Za-z0-9_./@-]*(=|$)) ]]
}

check_run_overrides() {
  local override
  for override; do
    is_override "$override" || refuse "'$override' is not a run override (key=value, e.g. seed=10,11)"
  done
}

# The SFT overrides experiment.sh takes before `--` are the recipe of the result's cold start, as the result's command
# writes it: the model, task and routers groups, keys under them, and the SFT's own settings (sft.*). Not the SFT's
# seed: a start's seeds are its number among its recipe's starts (router_starts.sh --starts), and a seed=... there is a
# run override that lost its `--`, which the start, once made, would silently drop.
check_sft_overrides() {
  local override
  for override; do
    [[ $override =~ ^\+{0,2}((model|dataset|routers)(\.[A-Za-z0-9_.]+)?|sft\.[A-Za-z0-9_.]+)= ]] ||
      refuse "'$override' is not a cold-start setting (allowed before --: model=, dataset=, routers= and keys under" \
        "model., dataset., routers., sft.); run overrides such as seed=10,11 go after --"
  done
}

# A result's command over experiment.sh takes nothing but run overrides after `--`: its cold start's recipe is its own.
only_run_overrides() {
  (($#)) || return 0
  [[ $1 == -- ]] || refuse "'$1' is not an argument of $command_file (allowed: -- RUN OVERRIDES..., e.g. -- seed=10,11)"
  shift
  (($#)) || refuse "-- needs the run overrides after it (e.g. -- seed=10,11)"
  check_run_overrides "$@"
}

# Where a command's sweeps and reports go (sets sweeps_home and results_home): multirun/NAME and docs/results/NAME for
# the documented runs; for runs that overrides make other, multirun/NAME/other-<date> and reports/NAME-<date>, so that
# neither the committed result nor the sweeps it was read from are written over. How many runs go side by side
# (hydra.launcher.n_jobs) leaves every run as documented where each run's threads are pinned (--threads-pinned): one
# thread each, a run computes the same bits beside another as alone.
destinations() {  # destinations NAME [--threads-pinned] OVERRIDES...
  local name=$1 threads_pinned=false override
  shift
  if [[ ${1:-} == --threads-pinned ]]; then threads_pinned=true; shift; fi
  sweeps_home=multirun/$name results_home=docs/results/$name
  for override; do
    [[ $threads_pinned == true && $override =~ ^hydra\.launcher\.n_jobs=[0-9]+$ ]] && continue
    sweeps_home=multirun/$name/other-$stamp results_home=reports/$name-$stamp
  done
}

# The regime the learnability map's rule chose (docs/results/learnability/map/regime.json; REGIME names another file,
# a test's own), as run overrides in the array `regime`; refused in one line, naming what runs there, until the rule
# has written it. Called from the repository's root.
read_regime() {  # read_regime WHAT
  local file=${REGIME:-docs/results/learnability/map/regime.json}
  [[ -f $file ]] ||
    refuse "$file does not exist: $1 runs in the regime the learnability map's rule chose, which" \
      "docs/results/learnability/command.sh writes there once the map (and its extension, where run) is whole"
  read -r -a regime <<<"$(python -c 'import json, sys; print(*json.load(open(sys.argv[1]))["overrides"])' "$file")"
}

# Run, not sourced: it makes nothing.
[[ ${BASH_SOURCE[0]} != "$0" ]] ||
  refuse "$0 is sourced by the commands under docs/results, not run (--help: what it checks)"
