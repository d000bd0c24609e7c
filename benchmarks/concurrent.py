"""`python -m benchmarks.concurrent`: the concurrent sampler's step throughput against the synchronous loop, side by
side in one run, as a ratio.

    python -m benchmarks.concurrent --rounds 4 --steps 4 --json-out concurrent.json

On a benchmark workload (`benchmarks.workload`, grpo; eos banned, so every step does the same work), two loops, each
in worker processes of its own (`benchmarks.lab_worker`): the synchronous loop as a run has it, its torch threads the
cores other processes leave free, measured again after every step (`trainer.threads=null`, `experiments.run.threads`;
`--threads N` fixes them), and the concurrent sampler (`rollout.source=concurrent`, `rollout.max_staleness=--bound`;
`experiments.step.sources.concurrent`), its trainer on one thread and its sampler process on one. Two threads of one
process on a machine that other jobs load wait for each other at every operator (a step of the synchronous loop took
35 s on two threads at a load of 12, and 4.2 s on the one thread its budget chose), which is why the run's budget, not
a fixed two, is the synchronous loop's. The loops take turns by blocks of `--steps` steps, the first loop alternating
by round, so that the load of a shared machine hits both alike. The concurrent loop starts afresh every round, its
first step untimed (it starts the sampler), and ends with its block: a sampler left running between blocks would
sample ahead, and take a core from the other loop's block.

A round's ratio is the synchronous loop's mean step time over the concurrent loop's: the concurrent mode's step
throughput against the synchronous loop's (above 1: more steps per second). Beside it, from the synchronous loop's
own breakdown, what the ratio would be with sampling and training on separate devices, each as fast as this whole
machine: a step then takes max(rollout, the rest of the step) instead of their sum. On one machine the concurrent
mode cannot reach that: the two processes split its cores and share its memory bandwidth.
"""

from __future__ import annotations

import argparse
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

SYNCHRONOUS, CONCURRENT = "synchronous", "concurrent"


def mean_step(steps: list[dict[str, Any]]) -> float:
    return statistics.mean(step["seconds"] for step in steps)


def separate_devices(steps: list[dict[str, Any]]) -> float:
    """The mean step time of the synchronous loop's steps with their rollout beside the rest of the step, not
    before it."""
    return statistics.mean(max(step["rollout_s"], step["seconds"] - step["rollout_s"]) for step in steps)


def worker_args(overrides: list[str], threads: int, workload: str) -> list[str]:
    return ["--overrides", json.dumps(overrides), "--threads", str(threads), "--workload", workload]


def concurrent_block(overrides: list[str], args: argparse.Namespace, log_dir: Path, index: int) -> list[dict[str, Any]]:
    """`--steps` timed steps of the concurrent loop, in a worker of their own that takes one untimed step first (it
    starts the sampler) and ends with the block, its sampler with it."""
    with Worker(
        CONCURRENT,
        "benchmarks.lab_worker",
        worker_args(overrides, 1, args.workload),
        log_dir / f"{CONCURRENT}_{index}.log",
    ) as worker:
        worker.step()
        return [worker.step() for _ in range(args.steps)]


def run(args: argparse.Namespace, log_dir: Path) -> dict[str, Any]:
    overrides = [*VARIANTS["grpo"], *args.override]
    concurrent = [*overrides, "rollout.source=concurrent", f"rollout.max_staleness={args.bound}"]
    rounds = []
    with Worker(
        SYNCHRONOUS,
        "benchmarks.lab_worker",
        worker_args(overrides, args.threads, args.workload),
        log_dir / f"{SYNCHRONOUS}.log",
    ) as synchronous:
        for _ in range(args.warmup):
            synchronous.step()
        for index in range(args.rounds):
            order = [SYNCHRONOUS, CONCURRENT] if index % 2 == 0 else [CONCURRENT, SYNCHRONOUS]
            steps = {}
            for label in order:
                steps[label] = (
                    concurrent_block(concurrent, args, log_dir, index)
                    if label == CONCURRENT
                    else [synchronous.step() for _ in range(args.steps)]
                )
            rounds.append(
                {
                    "order": order,
                    **steps,
                    "ratio": mean_step(steps[SYNCHRONOUS]) / mean_step(steps[CONCURRENT]),
                    "separate_devices": mean_step(steps[SYNCHRONOUS]) / separate_devices(steps[SYNCHRONOUS]),
                }
            )
            print(
                f"round {index + 1}: synchronous {mean_step(steps[SYNCHRONOUS]):.3f} s/step, concurrent "
                f"{mean_step(steps[CONCURRENT]):.3f} s/step, ratio {rounds[-1]['ratio']:.3f}",
                file=sys.stderr,
                flush=True,
            )
    return {
        "overrides": overrides,
        "concurrent_overrides": concurrent,
        "rounds": rounds,
        "ratios": [r["ratio"] for r in rounds],
        "separate_devices": [r["separate_devices"] for r in rounds],
    }


def report(results: dict[str, Any]) -> None:
    rounds = results["rounds"]

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
        ],
        [
            CONCURRENT,
            f"{threads(CONCURRENT)} + 1",
            over_rounds(CONCURRENT, "seconds"),
            over_rounds(CONCURRENT, "rollout_s"),
            over_rounds(CONCURRENT, m.SAMPLE_TIME),
            over_rounds(CONCURRENT, m.SAMPLER_WAIT_TIME),
            str(max(step[m.STALENESS_MAX] for r in rounds for step in r[CONCURRENT])),
        ],
    ]
    print("\n## Step time, mean over each round's block: median over rounds (min-max), s\n")
    print(
        markdown_table(
            [
                "loop",
                "threads",
                "step",
                "the step's wait for its rollout",
                "sampling",
                "sampler's wait at the bound",
                "staleness max",
            ],
            rows,
        )
    )
    print("\n## Step throughput, concurrent / synchronous: median over rounds (min-max)\n")
    print(
        markdown_table(
            ["measured here", "with separate devices (from the synchronous loop's breakdown)"],
            [[spread(results["ratios"]), spread(results["separate_devices"])]],
        )
    )


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
        f"threads, concurrent on 1 + 1, rollout.max_staleness={args.bound}"
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
