"""`python -m benchmarks.scale_out`: what parallel sweeps, data-parallel ranks and thread policies buy on this machine.

    python -m benchmarks.scale_out                 # every section
    python -m benchmarks.scale_out --contention    # one section: --contention, --sweep, --dp

Sections (each a ratio measured side by side in one run, since absolute times on a shared machine are not stable):
  --contention  the bench workload's grpo step (benchmarks.workload) under four thread policies, quiet and while
                another process keeps one core busy: threads that follow the free cores (trainer.threads=null,
                experiments/run/threads.py), every core with OpenMP's default spin-wait (torch's own default), every
                core with OMP_WAIT_POLICY=PASSIVE, and one thread. Workers step round robin in two blocks, quiet then
                busy, each block's first round untimed (the budget needs one step to see the load).
  --sweep       a sweep of the same jobs (tiny_moe, 3 arms x 2 seeds, --sweep-steps steps each) with Hydra's joblib
                launcher, 2 jobs x 1 thread, against the sequential launcher with 1 job x 2 threads: wall seconds of
                each whole sweep, run one after the other.
  --dp          the bench workload's grpo step (`perf/step_s` of a short run, its first step dropped) on 2 ranks x 1
                thread under torchrun (FSDP2, gloo) against 1 process x 2 threads, runs alternated A B A B.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from analysis.report import markdown_table
from benchmarks.rl_step import finish, machine, spread
from benchmarks.worker import Worker
from benchmarks.workload import BENCH_TINY, VARIANTS
from experiments.config import PROJECT_ROOT
from experiments.step.metrics import STEP_TIME

CORES = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
POLICIES = {
    # label: (trainer.threads, extra environment)
    "threads follow the free cores (trainer.threads=null)": (0, {}),
    f"{CORES} threads, OpenMP spin-wait (torch's default)": (CORES, {}),
    f"{CORES} threads, OMP_WAIT_POLICY=PASSIVE": (CORES, {"OMP_WAIT_POLICY": "PASSIVE"}),
    "1 thread": (1, {}),
}
SPIN_POLICY = f"{CORES} threads, OpenMP spin-wait (torch's default)"
BUSY_LOOP = [sys.executable, "-c", "while True: pass"]
SWEEP_JOBS = [
    "model=tiny_moe",
    "model.path=null",
    "arm=grpo,grpo_r2,gspo",
    "seed=0,1",
    "trainer.eval_prompts=0",
    "logger.wandb.mode=disabled",
]


def contention_section(args: argparse.Namespace, log_dir: Path, results: dict[str, Any]) -> None:
    workers: dict[str, Worker] = {}
    steps: dict[tuple[str, str], list[float]] = {}
    competitor = None
    try:
        for index, (label, (threads, env)) in enumerate(POLICIES.items()):
            worker_args = ["--overrides", json.dumps(VARIANTS["grpo"]), "--threads", str(threads)]
            workers[label] = Worker(
                label, "benchmarks.lab_worker", worker_args, log_dir / f"contention_{index}.log", env=env
            )
        for condition in ("quiet", "one core busy"):
            if condition != "quiet":
                competitor = subprocess.Popen(BUSY_LOOP)
                time.sleep(0.5)
            for round_index in range(1 + args.steps):
                order = list(workers) if round_index % 2 == 0 else list(workers)[::-1]
                for label in order:
                    report = workers[label].step()
                    if round_index:
                        steps.setdefault((label, condition), []).append(report["seconds"])
                print(
                    f"  contention, {condition}: round {round_index + 1}/{1 + args.steps}", file=sys.stderr, flush=True
                )
    finally:
        if competitor is not None:
            competitor.kill()
            competitor.wait()
        for worker in workers.values():
            worker.close()
    reference = statistics.median(steps[(SPIN_POLICY, "quiet")])
    rows = []
    for label in POLICIES:
        quiet, busy = steps[(label, "quiet")], steps[(label, "one core busy")]
        results["contention"][label] = {"quiet": quiet, "one core busy": busy}
        rows.append(
            [
                label,
                spread(quiet),
                spread(busy),
                f"{statistics.median(busy) / statistics.median(quiet):.2f}",
                f"{statistics.median(quiet) / reference:.2f}",
                f"{statistics.median(busy) / reference:.2f}",
            ]
        )
    print("\n## A step quiet and beside a busy process (grpo, bench workload; s)\n")
    print(
        markdown_table(
            [
                "threads",
                "quiet s",
                "one core busy s",
                "busy / quiet",
                f"quiet / {CORES}-thread spin quiet",
                f"busy / {CORES}-thread spin quiet",
            ],
            rows,
        )
    )


def _timed(command: list[str], log: Path, env: dict[str, str] | None = None) -> float:
    start = time.perf_counter()
    with log.open("w") as handle:
        done = subprocess.run(
            command, cwd=PROJECT_ROOT, stdout=handle, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})}
        )
    if done.returncode:
        raise SystemExit(f"benchmark command failed ({done.returncode}); its output: {log}")
    return time.perf_counter() - start


def sweep_section(args: argparse.Namespace, log_dir: Path, results: dict[str, Any]) -> None:
    base = [sys.executable, "-m", "experiments.train", "-m", *SWEEP_JOBS, f"trainer.steps={args.sweep_steps}"]
    parallel = [
        *base,
        "hydra/launcher=joblib",
        "hydra.launcher.n_jobs=2",
        "trainer.threads=1",
        f"hydra.sweep.dir={log_dir / 'sweep_parallel'}",
    ]
    sequential = [*base, "trainer.threads=2", f"hydra.sweep.dir={log_dir / 'sweep_sequential'}"]
    print("sweep: joblib 2 jobs x 1 thread, then the sequential launcher x 2 threads", file=sys.stderr, flush=True)
    parallel_s = _timed(parallel, log_dir / "sweep_parallel.log")
    sequential_s = _timed(sequential, log_dir / "sweep_sequential.log")
    results["sweep"] = {"parallel_s": parallel_s, "sequential_s": sequential_s, "jobs": 6, "steps": args.sweep_steps}
    print(f"\n## A sweep of 6 jobs x {args.sweep_steps} steps (tiny_moe)\n")
    print(
        markdown_table(
            ["launcher", "wall s", "sequential / this"],
            [
                ["joblib, 2 jobs x 1 thread", f"{parallel_s:.1f}", f"{sequential_s / parallel_s:.2f}"],
                ["sequential (basic), 1 job x 2 threads", f"{sequential_s:.1f}", "1.00"],
            ],
        )
    )


def _step_seconds(run_dir: Path) -> list[float]:
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [line[STEP_TIME] for line in lines[1:]]  # the first step pays for warm-up


def dp_section(args: argparse.Namespace, log_dir: Path, results: dict[str, Any]) -> None:
    run = [
        "-m",
        "experiments.train",
        *BENCH_TINY,
        *VARIANTS["grpo"],
        f"trainer.steps={1 + args.steps}",
        "trainer.threads=1",
    ]
    sides = {
        "2 ranks x 1 thread (torchrun, FSDP2, gloo)": [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node=2",
            *run,
        ],
        "1 process x 2 threads": [sys.executable, *run, "trainer.threads=2"],
    }
    seconds: dict[str, list[float]] = {label: [] for label in sides}
    for repeat in range(2):
        for index, (label, command) in enumerate(sides.items()):
            run_dir = log_dir / f"dp_{index}_{repeat}"
            print(f"dp: {label}, run {repeat + 1}/2", file=sys.stderr, flush=True)
            _timed(
                [*command, f"hydra.run.dir={run_dir}"],
                log_dir / f"dp_{index}_{repeat}.log",
                {"OMP_NUM_THREADS": "1"} if "ranks" in label else None,
            )
            seconds[label] += _step_seconds(run_dir)
    results["dp"] = seconds
    ranks, single = seconds.values()
    print("\n## The bench workload's step on 2 ranks against 1 process (grpo; s)\n")
    print(
        markdown_table(
            ["layout", "step s median (min-max)", "this / 1 process"],
            [
                [label, spread(values), f"{statistics.median(values) / statistics.median(single):.2f}"]
                for label, values in seconds.items()
            ],
        )
    )


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--contention", action="store_true", help="thread policies, quiet and beside a busy core")
    parser.add_argument("--sweep", action="store_true", help="joblib 2 x 1 thread against sequential x 2 threads")
    parser.add_argument("--dp", action="store_true", help="2 ranks x 1 thread against 1 process x 2 threads")
    parser.add_argument("--steps", type=int, default=4, help="timed steps per configuration and condition")
    parser.add_argument("--sweep-steps", type=int, default=10, help="RL steps of each sweep job")
    parser.add_argument("--json-out", type=Path, help="write every measured number here")
    args = parser.parse_args(argv)
    if args.steps < 1 or args.sweep_steps < 1:
        parser.error(f"--steps={args.steps} and --sweep-steps={args.sweep_steps} must be >= 1")
    if not (args.contention or args.sweep or args.dp):
        args.contention = args.sweep = args.dp = True
    info = machine()
    print(
        f"# benchmarks.scale_out on {info['cpu']} ({info['cores']} cores), torch {info['torch']}, "
        f"load {info['load_1min']:.1f}"
    )
    results: dict[str, Any] = {"machine": info, "contention": {}, "sweep": {}, "dp": {}}
    with tempfile.TemporaryDirectory(prefix="bench_scale_") as scratch:
        log_dir = Path(scratch)
        if args.contention:
            contention_section(args, log_dir, results)
        if args.sweep:
            sweep_section(args, log_dir, results)
        if args.dp:
            dp_section(args, log_dir, results)
    finish(results, args.json_out)
    return results


if __name__ == "__main__":
    main()
