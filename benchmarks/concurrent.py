"""`python -m benchmarks.concurrent`: the concurrent source's step throughput against the synchronous loop, on each
transport, side by side in one run, as ratios.

    python -m benchmarks.concurrent --rounds 4 --steps 4 --json-out concurrent.json [--loops local,ray1,ray2]

On a benchmark workload (`benchmarks.workload`, grpo; eos banned, so every step does the same work), each loop in
worker processes of its own (`benchmarks.lab_worker`): the synchronous loop as a run has it, its torch threads the
cores other processes leave free, measured again after every step (`trainer.threads=null`, `experiments.run.threads`;
`--threads N` fixes them), and the concurrent source (`rollout.source=concurrent`, `rollout.max_staleness=--bound`;
`experiments.step.sources`), its trainer on one thread, on each transport `--loops` names: `local`, one worker
process and shared memory; `ray1` and `ray2`, one and two Ray actors on a Ray instance the run starts on this machine
(`rollout.transport=ray`), each sampler on one thread. Two threads of one process on a machine that other jobs load
wait for each other at every operator (a step of the synchronous loop took 35 s on two threads at a load of 12, and
4.2 s on the one thread its budget chose), which is why the run's budget, not a fixed two, is the synchronous loop's.
The loops take turns by blocks of `--steps` steps, in an order that changes by round (`round_order`), so that the
load of a shared machine hits them alike. A concurrent loop starts afresh every round, its first step untimed (it
starts the sampler: a process, or Ray and its actors), and ends with its block: a sampler left running between blocks
would sample ahead, and take a core from the other loops' blocks.

A round's ratio for a loop is the synchronous loop's mean step time over that loop's: its step throughput against the
synchronous loop's (above 1: more steps per second). Beside them, from the synchronous loop's own breakdown, what the
ratio would be with sampling and training on separate devices, each as fast as this whole machine: a step then takes
max(rollout, the rest of the step) instead of their sum. On one machine no concurrent loop can reach that: its
processes split the cores and share the memory bandwidth.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

from hydra.errors import HydraException
from omegaconf.errors import OmegaConfBaseException

from analysis.report import markdown_table
from benchmarks.rl_step import machine, spread
from benchmarks.worker import Worker
from benchmarks.workload import VARIANTS, WORKLOADS, compose_workload
from experiments.step import metrics as m

SYNCHRONOUS = "synchronous"
# The concurrent loops, each the synchronous loop's work with the concurrent source on one transport: the overrides
# that make it, on top of `rollout.source=concurrent` and the bound.
CONCURRENT_LOOPS = {
    "local": [],  # a worker process and shared memory (the default transport)
    "ray1": ["rollout.transport=ray"],  # one Ray actor, on a Ray instance the run starts on this machine
    "ray2": ["rollout.transport=ray", "rollout.ray.workers=2"],  # two Ray actors, batches handed out in turn
}
SAMPLERS = {"local": "1", "ray1": "1", "ray2": "2 × 1"}  # the sampling processes each loop runs, on a thread each


def mean_step(steps: list[dict[str, Any]]) -> float:
    return statistics.mean(step["seconds"] for step in steps)


def separate_devices(steps: list[dict[str, Any]]) -> float:
    """The mean step time of the synchronous loop's steps with their rollout beside the rest of the step, not
    before it."""
    return statistics.mean(max(step["rollout_s"], step["seconds"] - step["rollout_s"]) for step in steps)


def worker_args(overrides: list[str], threads: int, workload: str) -> list[str]:
    return ["--overrides", json.dumps(overrides), "--threads", str(threads), "--workload", workload]


def concurrent_block(
    label: str, overrides: list[str], args: argparse.Namespace, log_dir: Path, index: int
) -> list[dict[str, Any]]:
    """`--steps` timed steps of a concurrent loop, in a worker of its own that takes one untimed step first (it
    starts the sampler: a process, or a Ray instance and its actors) and ends with the block, its samplers with it."""
    with Worker(
        label, "benchmarks.lab_worker", worker_args(overrides, 1, args.workload), log_dir / f"{label}_{index}.log"
    ) as worker:
        worker.step()
        return [worker.step() for _ in range(args.steps)]


def round_order(loops: list[str], index: int) -> list[str]:
    """The loops of round `index` in the order they run: the concurrent ones rotated by round, the synchronous loop
    first in even rounds and last in odd ones, so that no loop always follows the same one."""
    shift = index % len(loops)
    rotated = loops[shift:] + loops[:shift]
    return [SYNCHRONOUS, *rotated] if index % 2 == 0 else [*rotated, SYNCHRONOUS]


def run(args: argparse.Namespace, log_dir: Path) -> dict[str, Any]:
    overrides = [*VARIANTS["grpo"], *args.override]
    concurrent = {
        label: [
            *overrides,
            "rollout.source=concurrent",
            f"rollout.max_staleness={args.bound}",
            *CONCURRENT_LOOPS[label],
        ]
        for label in args.loops
    }
    rounds: list[dict[str, Any]] = []
    with Worker(
        SYNCHRONOUS,
        "benchmarks.lab_worker",
        worker_args(overrides, args.threads, args.workload),
        log_dir / f"{SYNCHRONOUS}.log",
    ) as synchronous:
        for _ in range(args.warmup):
            synchronous.step()
        for index in range(args.rounds):
            order = round_order(args.loops, index)
            steps = {
                label: [synchronous.step() for _ in range(args.steps)]
                if label == SYNCHRONOUS
                else concurrent_block(label, concurrent[label], args, log_dir, index)
                for label in order
            }
            base = mean_step(steps[SYNCHRONOUS])
            ratios = {label: base / mean_step(steps[label]) for label in args.loops}
            rounds.append(
                {
                    "order": order,
                    **steps,
                    "ratio": ratios,
                    "separate_devices": base / separate_devices(steps[SYNCHRONOUS]),
                }
            )
            print(
                f"round {index + 1}: "
                + ", ".join(f"{label} {mean_step(steps[label]):.3f} s/step" for label in order)
                + "; ratios "
                + ", ".join(f"{label} {ratio:.3f}" for label, ratio in ratios.items()),
                file=sys.stderr,
                flush=True,
            )
    return {
        "overrides": overrides,
        "concurrent_overrides": concurrent,
        "rounds": rounds,
        "ratios": {label: [r["ratio"][label] for r in rounds] for label in args.loops},
        "separate_devices": [r["separate_devices"] for r in rounds],
    }


def report(results: dict[str, Any]) -> None:
    rounds = results["rounds"]
    loops = list(results["ratios"])

    def over_rounds(label: str, key: str) -> str:
        return spread([statistics.mean(step[key] for step in r[label]) for r in rounds])

    def threads(label: str) -> str:
        used = [step["threads"] for r in rounds for step in r[label]]
        return f"{min(used)}-{max(used)}" if min(used) != max(used) else str(used[0])

    rows = [
        [
            SYNCHRONOUS,
            threads(SYNCHRONOUS),
            over_rounds(SYNCHRONOUS, "seconds"),
            over_rounds(SYNCHRONOUS, "rollout_s"),
            over_rounds(SYNCHRONOUS, "rollout_s"),
            "",
            "",
            "",
        ]
    ] + [
        [
            label,
            f"{threads(label)} + {SAMPLERS[label]}",
            over_rounds(label, "seconds"),
            over_rounds(label, "rollout_s"),
            over_rounds(label, m.SAMPLE_TIME),
            over_rounds(label, m.SAMPLER_WAIT_TIME),
            str(max(step[m.STALENESS_MAX] for r in rounds for step in r[label])),
            spread(results["ratios"][label]),
        ]
        for label in loops
    ]
    print("\n## Step time, mean over each round's block: median over rounds (min-max), s\n")
    print(
        markdown_table(
            [
                "loop",
                "threads",
                "step",
                "the step's wait for its rollout",
                "sampling (one batch)",
                "samplers' wait at the bound",
                "staleness max",
                "step throughput / synchronous",
            ],
            rows,
        )
    )
    print("\n## With separate devices, from the synchronous loop's breakdown: median over rounds (min-max)\n")
    print(markdown_table(["step throughput / synchronous"], [[spread(results["separate_devices"])]]))


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", choices=list(WORKLOADS), default="tiny", help="benchmarks.workload's")
    parser.add_argument("--rounds", type=int, default=4, help="blocks of each loop")
    parser.add_argument("--steps", type=int, default=4, help="timed steps per block")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps of the synchronous loop before the first")
    parser.add_argument(
        "--threads",
        type=int,
        default=0,
        help="torch threads of the synchronous loop (0: a run's budget, the cores left free)",
    )
    parser.add_argument("--bound", type=int, default=1, help="the concurrent sampler's rollout.max_staleness")
    parser.add_argument(
        "--loops",
        default=",".join(CONCURRENT_LOOPS),
        help=f"the concurrent loops beside the synchronous one, comma-separated, of {', '.join(CONCURRENT_LOOPS)}",
    )
    parser.add_argument(
        "--override",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="extra Hydra override for both loops (repeatable)",
    )
    parser.add_argument("--json-out", type=Path, help="write every measured number here")
    parser.add_argument("--log-dir", type=Path, help="worker logs (default: a temporary directory)")
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.steps < 1 or args.warmup < 0 or args.threads < 0 or args.bound < 0:
        parser.error(
            f"--rounds={args.rounds} and --steps={args.steps} must be >= 1, --warmup={args.warmup}, "
            f"--threads={args.threads} and --bound={args.bound} >= 0"
        )
    args.loops = [label for label in args.loops.split(",") if label]
    unknown = [label for label in args.loops if label not in CONCURRENT_LOOPS]
    if unknown or not args.loops or len(set(args.loops)) != len(args.loops):
        parser.error(
            f"--loops={','.join(args.loops)}: name each of {', '.join(CONCURRENT_LOOPS)} at most once, at least one"
        )
    if any(label.startswith("ray") for label in args.loops) and importlib.util.find_spec("ray") is None:
        parser.error("--loops names a Ray loop, and Ray is not installed here: pip install -e '.[ray]'")
    try:  # a bad override fails here, before any worker starts
        compose_workload(args.override, args.workload)
    except (HydraException, OmegaConfBaseException) as error:
        parser.error(f"bad override in {' '.join(args.override)!r}: {error}")
    info = machine()
    print(
        f"# benchmarks.concurrent on {info['cpu']} ({info['cores']} cores), torch {info['torch']}, load "
        f"{info['load_1min']:.1f}"
    )
    print(
        f"workload bench-{args.workload}, grpo: {' '.join(WORKLOADS[args.workload] + args.override)}; {args.rounds} "
        f"rounds of {args.steps} timed steps per loop; synchronous on {args.threads or 'the free cores as'} "
        f"threads, {', '.join(args.loops)} with their trainer on 1 and each sampler on 1, "
        f"rollout.max_staleness={args.bound}"
    )
    with tempfile.TemporaryDirectory(prefix="bench_concurrent_") as scratch:
        log_dir = args.log_dir or Path(scratch)
        log_dir.mkdir(parents=True, exist_ok=True)
        results = {
            "machine": info,
            "argv": sys.argv[1:] if argv is None else argv,
            "workload": args.workload,
            **run(args, log_dir),
        }
    report(results)
    if args.json_out:
        args.json_out.parent.mkdir(parents=True, exist_ok=True)
        args.json_out.write_text(json.dumps(results, indent=1))
    return results


if __name__ == "__main__":
    main()
