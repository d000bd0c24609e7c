#!/usr/bin/env bash
# The concurrent source's Ray actors on the nodes of a SLURM allocation (docs/async.md, "The concurrent sampler on
# Ray"): a Ray head on the allocation's first node, which also runs the trainer; a Ray node on each other node, for the
# rollout actors; then the run, connected to the head by address; Ray stopped on every node however the job ends.
#
#   sbatch --nodes=3 conf/cluster/ray_slurm.sh [OVERRIDES...]        # from the project's root, its Python env active
#   bash conf/cluster/ray_slurm.sh --local-rehearsal [OVERRIDES...]  # the same steps on this machine (below)
#
# OVERRIDES are the run's (`python -m experiments.train` keys); they come last, so they win over the script's.
# ACTORS_PER_NODE (default 1) actors sample on each rollout node, each reserving an equal share of the node's CPUs:
# every rollout node's Ray resources hold exactly that many actors, so the actors spread evenly over the nodes (Ray's
# default scheduling would pack several onto one node while it has CPUs free). RAY_PORT (default 6379) is the head's.
#
# --local-rehearsal: two Ray nodes on this machine, on the loopback address (the head and a second node, one CPU
# each, so that each of the run's two actors can only land on one of them), then a run of 4 small steps connected
# by address, without token authentication (as tests/test_ray.py's cluster). It prints the node each actor ran on
# (its raylet's), its peak resident memory, the run's wall time and the bytes each weight version put into the
# object store.
#
# The trainer runs on the first node: launch.nproc_per_node=N among the OVERRIDES makes it N torchrun ranks there
# (FSDP2; rank 0 drives the actors and publishes the weights gathered from every rank's shards). The actors reserve no GPU (rollout.ray has no GPU
# setting), and Ray 2.60 leaves CUDA_VISIBLE_DEVICES as the node has it for an actor that reserves none: under
# device=cuda every actor of a node would sample on that node's first GPU, unaccounted for by Ray and untested here
# (no GPU); the script is rehearsed with a CPU run. A cluster with token authentication (Ray 2.60's default where a
# token exists) needs RAY_AUTH_MODE=token and the token (~/.ray/auth_token on a shared home, or RAY_AUTH_TOKEN) in the
# job's environment.
#SBATCH --job-name=moe-rl-ray
#SBATCH --nodes=3
#SBATCH --ntasks-per-node=1
#SBATCH --exclusive
#SBATCH --time=12:00:00
set -euo pipefail

refuse() {
  echo "ray_slurm.sh: $1" >&2
  exit 2
}

# sbatch runs a copy of this script from its spool folder: the project's root is where the job was submitted from.
cd "${SLURM_SUBMIT_DIR:-$(dirname "$0")/../..}"
test -f conf/train.yaml || refuse "run from the project's root (no conf/train.yaml in $PWD)"
command -v ray >/dev/null || refuse "no ray command: activate the project's env, with pip install -e '.[ray]'"

rehearsal=false
if [[ ${1:-} == --local-rehearsal ]]; then
  rehearsal=true
  shift
fi
port=${RAY_PORT:-6379}
pids=() # the `ray start --block` and srun processes this job started, stopped on exit

# Stop Ray on every node this job started it on, however the job ends (the run's failure or success, scancel's
# SIGTERM). `ray start --block` stops its node's processes (raylet, object store, actors; the head's GCS) on SIGTERM,
# and srun passes SIGTERM on to its tasks. `ray stop` is not used: it kills every Ray process of the host by name,
# another job's on a shared node included.
stop_ray() {
  local status=$?
  trap - EXIT INT TERM
  if ((${#pids[@]})); then
    kill -TERM "${pids[@]}" 2>/dev/null || true
    wait "${pids[@]}" 2>/dev/null || true
  fi
  exit "$status"
}
trap stop_ray EXIT
trap 'exit 143' INT TERM # through stop_ray, with the status of a job that was stopped

# Wait until the cluster at $1 offers $2 CPUs (every rollout node joined), up to two minutes: the run refuses a
# cluster with fewer CPUs than workers x worker_cpus at start-up, so it must not start before the nodes are in.
wait_for_cpus() {
  python - "$1" "$2" <<'EOF'
import logging, socket, sys, time
import ray
address, cpus = sys.argv[1], float(sys.argv[2])
host, port = address.rsplit(":", 1)
deadline = time.time() + 120
while True:  # the head's port first: ray.init on a port that is not yet open waits far longer than the head takes
    try:
        socket.create_connection((host, int(port)), timeout=1).close()
        break
    except OSError:
        if time.time() > deadline:
            sys.exit(f"ray_slurm.sh: the Ray head at {address} did not open its port within 120 s")
        time.sleep(1)
ray.init(address=address, logging_level=logging.WARNING, log_to_driver=False)
while (found := ray.cluster_resources().get("CPU", 0.0)) < cpus:
    if time.time() > deadline:
        sys.exit(f"ray_slurm.sh: the Ray cluster at {address} has {found:g} CPUs after 120 s, its actors {cpus:g}")
    time.sleep(1)
print(f"ray_slurm.sh: {len(ray.nodes())} Ray nodes, {found:g} CPUs for actors")
EOF
}

if $rehearsal; then
  # Both nodes on 127.0.0.1, token authentication off (only this host can reach the loopback address).
  export RAY_AUTH_MODE=disabled
  head=127.0.0.1
  rollout_nodes=2 actors_per_node=1 worker_cpus=1
  logs=$(mktemp -d /tmp/ray_rehearsal.XXXXXX)
  run_dir=$logs/run
  common=(--block --num-cpus=1 --disable-usage-stats --node-ip-address="$head")
  # The head holds one actor too: on one machine the head is one of the two nodes the actors spread over.
  ray start --head --port="$port" --include-dashboard=false "${common[@]}" >"$logs/head.log" 2>&1 &
  pids+=($!)
  wait_for_cpus "$head:$port" 1
  # A second node on the same host: its own raylet and object store, in the head's session folder.
  ray start --address="$head:$port" "${common[@]}" >"$logs/second.log" 2>&1 &
  pids+=($!)
  declare -A node_of=(["${pids[0]}"]=head ["${pids[1]}"]=second) # a raylet's parent: the `ray start` of its node
  # The run's size: 4 steps of 4 prompts x 4 samples of 4 new tokens, on the default model unless overridden.
  run=(trainer.steps=4 trainer.prompts_per_step=4 trainer.group_size=4 trainer.minibatches=2 trainer.max_new_tokens=4
    trainer.eval_every=0 trainer.eval_prompts=4 trainer.eval_samples=2 dataset.train_size=200 dataset.test_size=20
    logger.wandb.mode=disabled hydra.run.dir="$run_dir")
else
  [[ -n ${SLURM_JOB_ID:-} ]] || refuse "submit with sbatch (or run --local-rehearsal on one machine)"
  mapfile -t nodes < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
  ((${#nodes[@]} >= 2)) || refuse "the allocation has ${#nodes[@]} node: ask for 2 or more (sbatch --nodes=N)"
  rollout_nodes=$((${#nodes[@]} - 1))
  actors_per_node=${ACTORS_PER_NODE:-1}
  # Every rollout node is taken to have the CPUs of this one (--exclusive nodes of one kind).
  worker_cpus=$((SLURM_CPUS_ON_NODE / actors_per_node))
  ((worker_cpus >= 1)) || refuse "ACTORS_PER_NODE=$actors_per_node is more than a node's $SLURM_CPUS_ON_NODE CPUs"
  # This batch script runs on the allocation's first node: the head and the trainer. The address the other nodes
  # reach it by: HEAD_IP, else the first address its name resolves to.
  head=${HEAD_IP:-$(hostname --ip-address | awk '{print $1}')}
  [[ $head != 127.* ]] || refuse "this node's name resolves to $head, which other nodes cannot reach: set HEAD_IP"
  # --num-cpus=0 keeps actors off the trainer's node; the head's GCS and the object store, where the trainer puts
  # each version, live there.
  ray start --head --block --port="$port" --num-cpus=0 --include-dashboard=false --disable-usage-stats \
    --node-ip-address="$head" &
  pids+=($!)
  # One Ray node on each other node, as one srun step (one task per node) that lives until this job stops it.
  srun --nodes="$rollout_nodes" --ntasks="$rollout_nodes" --ntasks-per-node=1 --exclude="${nodes[0]}" \
    ray start --block --address="$head:$port" --num-cpus=$((actors_per_node * worker_cpus)) --disable-usage-stats &
  pids+=($!)
  run=()
fi

workers=$((rollout_nodes * actors_per_node))
wait_for_cpus "$head:$port" $((workers * worker_cpus))

# In the rehearsal, every half second: each actor's pid, the `ray start` of its node (its raylet's parent) and its
# resident memory, until the run ends.
if $rehearsal; then
  while sleep 0.5; do
    for pid in $(pgrep -f '^ray::RolloutActor' || true); do
      raylet=$(ps -o ppid= -p "$pid") || continue
      echo "$pid $(ps -o ppid= -p "$raylet") $(ps -o rss= -p "$pid")"
    done
  done >"$logs/actors.txt" 2>/dev/null &
  pids+=($!)
fi

# The trainer: one process on this node, connected to the head by address (without --local-rehearsal: the job's
# overrides alone say the run's size).
start=$SECONDS
python -m experiments.train rollout.source=concurrent rollout.transport=ray rollout.ray.address="$head:$port" \
  rollout.ray.workers="$workers" rollout.ray.worker_cpus="$worker_cpus" "${run[@]}" "$@"
echo "ray_slurm.sh: the run took $((SECONDS - start)) s"

if $rehearsal; then
  # Each actor once: the node it ran on, and the most resident memory it held.
  sort -k1,1n -k3,3n "$logs/actors.txt" |
    awk '{peak[$1] = $3; node[$1] = $2} END {for (p in peak) print p, node[p], peak[p]}' |
    while read -r pid node rss; do
      echo "ray_slurm.sh: actor $pid ran on the ${node_of[$node]:-unknown} node, peak RSS $((rss / 1024)) MiB"
    done
  python -c "import json, sys; print('ray_slurm.sh:', json.load(open(sys.argv[1]))['rollouts'])" "$run_dir/summary.json"
fi
