"""Worker process for the peer loop: TRL's `GRPOTrainer` on the same workload, one generation batch per "go".

    python -m benchmarks.trl_worker --overrides '["algo=gspo"]' [--workload deep] [--threads N]

Needs the optional `bench` extra (`pip install -e '.[bench]'`: trl, datasets, accelerate). The run is built
from the same composed config as our loop (model, tokenizer, task prompts, batch geometry, learning rate, clip
range), with the settings that make TRL do the work of one of our RL steps:
- one generation batch is `prompts_per_step x group_size` completions, trained as `minibatches` AdamW updates
  (`steps_per_generation = minibatches`, `per_device_train_batch_size = batch / minibatches`, no gradient
  accumulation, `num_iterations=1`); since the batch outlives one update, TRL scores it once without gradient for
  the old log-probs, as our loop does;
- `min_new_tokens = max_new_tokens`, so every completion has the same length (as our engine's in this workload);
- fp32 on CPU (`use_cpu`, and `bf16=False`, which TRL would otherwise switch on), activation checkpointing off
  (TRL's default is on), `beta=0` (no reference model), constant learning rate, no reports, no checkpoints;
- `grpo`: token-level ratios with per-sequence token means (`loss_type="grpo"`); `gspo`: sequence-level ratios.
  TRL keeps its router load-balancing loss (coefficient from the model config): our loop also asks the routers
  for their logits, for its routing metrics. TRL has no Routing Replay; `routing.*` is ignored here.
A step is timed from "go" to the end of the batch's last optimizer step. `model.generate` and TRL's
`_generate_and_score_completions` are wrapped to split it into generation, scoring and training.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar, cast

for _name, _value in {
    "HF_HUB_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "HF_HUB_DISABLE_TELEMETRY": "1",
    "TOKENIZERS_PARALLELISM": "false",
}.items():
    os.environ.setdefault(_name, _value)

import torch  # noqa: E402
from omegaconf import DictConfig  # noqa: E402

from benchmarks.worker import Channel, peak_rss_mib  # noqa: E402
from benchmarks.workload import WORKLOADS, compose_workload  # noqa: E402
from experiments.tasks import build_task  # noqa: E402
from models.policy import ModelConfig, build_policy  # noqa: E402
from models.registry import node_settings  # noqa: E402

if TYPE_CHECKING:
    from transformers import GenerationMixin, TrainerControl, TrainerState, TrainingArguments
    from trl import GRPOConfig

T = TypeVar("T")

# Our objective -> TRL's importance-sampling level; both aggregate per sequence, then over sequences.
IMPORTANCE_SAMPLING_LEVEL = {"grpo": "token", "gspo": "sequence"}


def trl_arguments(cfg: DictConfig, output_dir: str) -> GRPOConfig:
    """The `GRPOConfig` that makes one TRL generation batch the work of one of our RL steps."""
    from trl import GRPOConfig

    algo = cfg.algo.name
    if algo not in IMPORTANCE_SAMPLING_LEVEL:
        raise ValueError(f"algo={algo!r}: the TRL peer runs only {sorted(IMPORTANCE_SAMPLING_LEVEL)}")
    t = cfg.trainer
    batch = t.prompts_per_step * t.group_size
    return GRPOConfig(
        output_dir=output_dir,
        use_cpu=True,
        bf16=False,
        fp16=False,
        report_to="none",
        save_strategy="no",
        logging_strategy="steps",
        logging_steps=1,
        disable_tqdm=True,
        seed=cfg.seed,
        dataloader_num_workers=0,
        per_device_train_batch_size=batch // t.minibatches,
        gradient_accumulation_steps=1,
        steps_per_generation=t.minibatches,
        num_iterations=1,
        num_generations=t.group_size,
        max_completion_length=t.max_new_tokens,
        generation_kwargs={"min_new_tokens": t.max_new_tokens},
        temperature=t.temperature,
        learning_rate=t.lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
        adam_beta1=t.adam_beta1,
        adam_beta2=t.adam_beta2,
        weight_decay=t.weight_decay,
        max_grad_norm=t.grad_clip,
        beta=0.0,
        activation_checkpointing=False,
        importance_sampling_level=IMPORTANCE_SAMPLING_LEVEL[algo],
        epsilon=cfg.algo.clip_low,
        epsilon_high=cfg.algo.clip_high,
        loss_type="grpo",
        max_steps=100_000 * t.minibatches,  # the parent stops the run
    )


class _Timers:
    """Per-batch seconds of the wrapped calls and the completion tokens the reward function saw."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.generate_s = 0.0
        self.score_s = 0.0
        self.tokens = 0

    def wrap(self, fn: Callable[..., T], field: str) -> Callable[..., T]:
        def timed(*args: Any, **kwargs: Any) -> T:
            start = time.perf_counter()
            out = fn(*args, **kwargs)
            setattr(self, field, getattr(self, field) + time.perf_counter() - start)
            return out

        return timed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--overrides", default="[]", help="JSON list of Hydra overrides on top of the workload")
    parser.add_argument("--workload", choices=list(WORKLOADS), default="tiny", help="bench-tiny or bench-deep")
    parser.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    args = parser.parse_args()
    channel = Channel()
    if args.threads:
        torch.set_num_threads(args.threads)
    import transformers
    import trl
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOTrainer

    transformers.logging.set_verbosity_error()
    # TRL runs the model as its users get it, as in the peer benchmark: transformers' default experts and attention.
    transformers_defaults = ["model.experts_implementation=grouped_mm", "model.attn_implementation=sdpa"]
    cfg = compose_workload([*json.loads(args.overrides), *transformers_defaults], args.workload)
    model, tokenizer = build_policy(ModelConfig(**node_settings(cfg.model)))
    dataset_cfg = dict(node_settings(cfg.dataset))
    task = build_task(dataset_cfg.pop("name"), **dataset_cfg)
    examples = task.examples("train")
    dataset = Dataset.from_dict({"prompt": [e.prompt for e in examples], "index": list(range(len(examples)))})
    timers = _Timers()

    def task_reward(
        prompts: list[str],
        completions: list[str],
        index: list[int],
        completion_ids: list[list[int]] | None = None,
        **kwargs: Any,
    ) -> list[float]:
        # TRL hands every reward function the completions' token ids.
        timers.tokens += sum(len(ids) for ids in cast(list[list[int]], completion_ids))
        return [task.reward(text, examples[i]) for text, i in zip(completions, index)]

    causal_lm = cast("GenerationMixin", model)  # a causal LM generates; PreTrainedModel alone does not say so
    causal_lm.generate = timers.wrap(causal_lm.generate, "generate_s")
    minibatches = cfg.trainer.minibatches

    class Lockstep(TrainerCallback):
        """Wait for "go" before each generation batch; report the batch after its last optimizer step."""

        def on_train_begin(
            self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
        ) -> None:
            channel.send(
                "ready",
                threads=torch.get_num_threads(),
                parameters=sum(p.numel() for p in model.parameters()),
                versions={"trl": trl.__version__, "transformers": transformers.__version__},
                experts_implementation=model.config._experts_implementation,
            )
            self._next(control)

        def on_step_end(
            self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
        ) -> None:
            if state.global_step % minibatches:
                return
            seconds = time.perf_counter() - self.start
            channel.send(
                "step",
                seconds=seconds,
                rollout_s=timers.generate_s,
                score_s=timers.score_s - timers.generate_s,
                train_s=seconds - timers.score_s,
                tokens=timers.tokens,
                rss_mib=peak_rss_mib(),
            )
            self._next(control)

        def _next(self, control: TrainerControl) -> None:
            if channel.wait():
                timers.reset()
                self.start = time.perf_counter()
            else:
                control.should_training_stop = True

    with tempfile.TemporaryDirectory(prefix="bench_trl_") as output_dir:
        trainer = GRPOTrainer(
            model=model,
            reward_funcs=task_reward,
            args=trl_arguments(cfg, output_dir),
            train_dataset=dataset,
            processing_class=tokenizer,
            callbacks=[Lockstep()],
        )
        trainer._generate_and_score_completions = timers.wrap(trainer._generate_and_score_completions, "score_s")
        trainer.train()


if __name__ == "__main__":
    main()
