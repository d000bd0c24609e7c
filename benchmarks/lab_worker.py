"""Worker process for our RL loop: `RLTrainer.step()` plus the run logger, one step per "go" (see `worker`).

    python -m benchmarks.lab_worker --overrides '["algo=gspo"]' [--threads N]

A step is timed as a training run spends it: `RLTrainer.step()` and then `RunLogger.log` (metrics.jsonl, and
W&B when `logger.wandb.mode` is not `disabled`). The breakdown is the trainer's own `perf/*` metrics.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

os.environ.setdefault("WANDB_SILENT", "true")

import torch  # noqa: E402

from benchmarks.worker import Channel, peak_rss_mib  # noqa: E402
from benchmarks.workload import compose_workload  # noqa: E402
from experiments.logger import RunLogger  # noqa: E402
from experiments.train import RLTrainer, run_name  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--overrides", default="[]", help="JSON list of Hydra overrides on top of the workload")
    parser.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    args = parser.parse_args()
    channel = Channel()
    overrides = json.loads(args.overrides)
    if args.threads:
        overrides.append(f"trainer.threads={args.threads}")
    cfg = compose_workload(overrides)
    trainer = RLTrainer(cfg)
    prompt_widths: list[int] = []
    sample = trainer.rollout

    def rollout():
        # The prompt width (left-padded) is part of the work: the FLOP count of the roofline needs it.
        batch = sample()
        prompt_widths.append(batch.prompt_width)
        return batch

    trainer.rollout = rollout
    with tempfile.TemporaryDirectory(prefix="bench_lab_") as run_dir:
        logger = RunLogger(run_dir, cfg, run_name(cfg), [], None)
        channel.send(
            "ready",
            threads=torch.get_num_threads(),
            parameters=sum(p.numel() for p in trainer.model.parameters()),
            wandb=logger.wandb_active,
        )
        while channel.wait():
            tokens_before = trainer.tokens_seen
            start = time.perf_counter()
            record = trainer.step()
            logged = time.perf_counter()
            logger.log(record)
            end = time.perf_counter()
            channel.send(
                "step",
                seconds=end - start,
                rollout_s=record["perf/rollout_s"],
                score_s=record["perf/score_s"],
                train_s=record["perf/train_s"],
                log_s=end - logged,
                tokens=trainer.tokens_seen - tokens_before,
                prompt_width=prompt_widths[-1],
                reward=record["reward/mean"],
                rss_mib=peak_rss_mib(),
            )
        logger.finish({"status": "benchmark"})


if __name__ == "__main__":
    main()
