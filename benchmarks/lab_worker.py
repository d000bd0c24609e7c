"""Worker process for our RL loop: `RLTrainer.step()` plus the run logger, one step per "go" (see `worker`).

    python -m benchmarks.lab_worker --overrides '["algo=gspo"]' [--workload deep] [--threads N]

A step is timed as a training run spends it: `RLTrainer.step()` and then `RunLogger.log` (metrics.jsonl, and
W&B when `logger.wandb.mode` is not `disabled`). The breakdown is the trainer's own `perf/*` metrics.
`--probe-generate`: after each timed step (outside its time), one plain `model.generate` call on the step's own
prompts with the rollout's sampling settings, reported as `generate_s`: the reference for rollout throughput.
`--profile`: each step also reports the self time of each part of the model's forwards, and of backward, gradient
clipping and the optimizer step, in the rollout and in scoring + training (`benchmarks.module_time`), as `profile`.
With `rollout.source=concurrent` a step's rollout is the wait for the sampler's batch, and the step also reports the
sampler's own `async/*` numbers (`experiments.step.sources.concurrent`).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from typing import TYPE_CHECKING, Any, cast

os.environ.setdefault("WANDB_SILENT", "true")

import torch  # noqa: E402

from benchmarks.module_time import ModuleTimer  # noqa: E402
from benchmarks.worker import Channel, peak_rss_mib  # noqa: E402
from benchmarks.workload import WORKLOADS, compose_workload, fixed_length  # noqa: E402
from experiments.run.logger import RunLogger  # noqa: E402
from experiments.run.summary import run_name  # noqa: E402
from experiments.run.threads import ThreadBudget  # noqa: E402
from experiments.step import metrics as m  # noqa: E402
from experiments.step.batch import Rollout, Served  # noqa: E402
from experiments.step.trainer import RLTrainer  # noqa: E402

if TYPE_CHECKING:
    from transformers import GenerationMixin

# The concurrent sampler's numbers a step reports as they are logged.
SAMPLER = (m.SAMPLE_TIME, m.SAMPLER_WAIT_TIME, m.STALENESS_MAX)


def time_plain_generate(trainer: RLTrainer, rollout: Rollout) -> float:
    """Seconds of one `model.generate` call on the rollout's prompts, sampling as the rollout does."""
    t = trainer.cfg.trainer
    tokenizer = trainer.tokenizer
    prompts = [example.prompt for example in rollout.examples]
    encoded = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False).to(trainer.device)
    options = dict(
        max_new_tokens=t.max_new_tokens,
        min_new_tokens=t.max_new_tokens,
        do_sample=True,
        temperature=t.temperature,
        top_k=0,
        top_p=1.0,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    start = time.perf_counter()
    with torch.no_grad():
        # A causal LM (transformers' *ForCausalLM) generates; PreTrainedModel alone does not say so.
        cast("GenerationMixin", trainer.model).generate(**encoded, **options)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--overrides", default="[]", help="JSON list of Hydra overrides on top of the workload")
    parser.add_argument("--workload", choices=list(WORKLOADS), default="tiny", help="bench-tiny or bench-deep")
    parser.add_argument(
        "--threads",
        type=int,
        default=0,
        help="torch intra-op threads (0: follow the cores left free, trainer.threads=null)",
    )
    parser.add_argument("--probe-generate", action="store_true", help="also time model.generate on each batch")
    parser.add_argument("--profile", action="store_true", help="also report self time per part of the model")
    args = parser.parse_args()
    channel = Channel()
    overrides = json.loads(args.overrides)
    overrides.append(f"trainer.threads={args.threads or 'null'}")
    cfg = compose_workload(overrides, args.workload)
    threads = ThreadBudget(cfg.trainer.threads)
    trainer = RLTrainer(cfg, min_new_tokens=fixed_length(cfg))
    rollouts: list[Rollout] = []
    take = trainer.rollouts.take

    timer = ModuleTimer(trainer.model) if args.profile else None
    if timer is not None:
        # This process only runs the benchmark: patching these is how their time reaches the timer.
        torch.Tensor.backward = timer.around(torch.Tensor.backward, "backward")
        torch.nn.utils.clip_grad_norm_ = timer.around(torch.nn.utils.clip_grad_norm_, "gradient clipping")
        trainer.optimizer.step = timer.around(trainer.optimizer.step, "optimizer step")

    def take_and_keep(step: int, seed: int) -> Served:
        # Kept for the report: the prompt width is part of the work (the roofline's FLOP count needs it), and the
        # generate probe reuses the prompts.
        if timer is not None:
            timer.phase = "rollout"
        served = take(step, seed)
        if timer is not None:
            timer.phase = "scoring + training"
        rollouts[:] = [served.rollout]
        return served

    trainer.rollouts.take = take_and_keep
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
            if timer is not None:
                timer.take()  # nothing before this step (the previous step's generate probe) counts
            used = torch.get_num_threads()  # the step's, which the budget may change after it
            start = time.perf_counter()
            threads.begin()
            record = trainer.step()
            threads.end()
            logged = time.perf_counter()
            logger.log(record)
            end = time.perf_counter()
            extra: dict[str, Any] = {"profile": timer.take()} if timer is not None else {}
            if args.probe_generate:
                extra["generate_s"] = time_plain_generate(trainer, rollouts[0])
            channel.send(
                "step",
                seconds=end - start,
                rollout_s=record[m.ROLLOUT_TIME],
                score_s=record[m.SCORE_TIME],
                train_s=record[m.TRAIN_TIME],
                log_s=end - logged,
                tokens=trainer.tokens_seen - tokens_before,
                prompt_width=rollouts[0].prompt_width,
                sequence_tokens=rollouts[0].input_ids.numel(),  # prompt + completion positions, padding included
                reward=record[m.REWARD],
                rss_mib=peak_rss_mib(),
                threads=used,
                **{name: record[name] for name in SAMPLER if name in record},
                **extra,
            )
        logger.finish({"status": "benchmark"})
    trainer.close()


if __name__ == "__main__":
    main()
