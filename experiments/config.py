"""Typed Hydra configs: every config group has a dataclass schema in Hydra's ConfigStore.

A misspelt key or a value of the wrong type therefore fails at composition, with Hydra naming the key. The
schemas of the `algo` and `dataset` groups are generated from the objective and task dataclasses themselves
(`algos.OBJECTIVES`, `experiments.tasks.TASKS`), so a hyperparameter is declared in exactly one place.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from typing import Any

from pathlib import Path

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, OmegaConf

from models.policy import ModelConfig

PROJECT_ROOT = Path(__file__).resolve().parent.parent
REPLAY_MODES = ("none", "r2", "r3")
OLD_LOGPROB_SOURCES = ("auto", "rollout", "recompute")
MINIBATCH_LAYOUTS = ("auto", "groups", "rows")
LR_SCHEDULES = ("constant", "linear", "cosine")
WANDB_MODES = ("offline", "online", "disabled")


@dataclass
class RoutingConfig:
    """Routing Replay, orthogonal to the objective, and routing measurements."""

    replay: str = "none"  # none | r2 (record in the old-policy scoring pass) | r3 (record during generation)
    metrics: bool = True  # drift of the current routing against the old one, per minibatch


@dataclass
class TrainerConfig:
    """One RL step: `prompts_per_step` prompts x `group_size` completions, split into `minibatches` updates."""

    steps: int = 40
    prompts_per_step: int = 32
    group_size: int = 8
    minibatches: int = 4  # the GSPO paper's 4: every update after the first is off-policy
    max_new_tokens: int = 16
    temperature: float = 1.0
    fixed_length: bool = False  # benchmarks: always generate max_new_tokens tokens (identical work per step)
    # Where log π_θold comes from for the off-policy minibatches: `rollout` keeps the log-probs the sampler
    # computed (same weights, same fp32 model: θ_old's own numbers, no extra forward); `recompute` scores the
    # batch again without gradient. `auto`: rollout, unless Routing Replay needs the recompute pass (r2 records
    # θ_old's routing in it, r3 replays the rollout's routing in it).
    old_logprobs: str = "auto"
    # How the batch splits into minibatches and how they are fed. `groups`: each minibatch holds whole groups (the
    # prompts are shuffled, as in verl) and each group is fed as one packed sequence, its prompt computed once
    # (`models.shared_prefix`: same numbers, ~20% less work at the bench's sizes). `rows`: the completions are
    # shuffled across groups and every row is fed in full (TRL's layout). `auto`: groups when the prompts split
    # evenly into the minibatches and the model's attention follows packed layouts (grouped_eager), else rows.
    minibatch_layout: str = "auto"
    lr: float = 3e-4
    lr_schedule: str = "constant"
    warmup_steps: int = 0  # in optimizer updates
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    grad_clip: float = 1.0
    router_aux_loss_coef: float = 0.0  # load-balancing loss added to the policy loss (0: off, as in R3)
    max_consecutive_skips: int = 3  # non-finite loss/gradient steps in a row before the run stops
    eval_every: int = 10  # RL steps between held-out evaluations (0: only at the end)
    eval_prompts: int = 128
    eval_samples: int = 4  # k for mean pass@1
    save_checkpoint: bool = False
    threads: int | None = None  # torch CPU threads; null keeps torch's default


@dataclass
class WandbConfig:
    mode: str = "offline"  # offline (default: no network) | online | disabled
    project: str = "moe-rl-lab"
    entity: str | None = None
    group: str | None = None  # defaults to the sweep directory's name for multiruns
    job_type: str = "train"
    tags: list[str] = field(default_factory=list)


@dataclass
class LoggerConfig:
    wandb: WandbConfig = field(default_factory=WandbConfig)


@dataclass
class TrainConfig:
    algo: Any = MISSING
    model: ModelConfig = field(default_factory=ModelConfig)
    dataset: Any = MISSING
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    routing: RoutingConfig = field(default_factory=RoutingConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    seed: int = 0
    device: str = "cpu"


@dataclass
class SFTSettings:
    """Cold start: next-token training on task demonstrations until the held-out accuracy is useful."""

    max_steps: int = 600  # the budget that decides the checkpoint: the same on a loaded or an idle machine
    max_seconds: float = 900.0  # safety stop only (an idle 2-core machine reaches the target in about 2 minutes)
    batch_size: int = 128
    lr: float = 1e-3
    weight_decay: float = 0.0
    target_accuracy: float = 0.45  # stop once greedy held-out accuracy reaches this (RL needs reward variance)
    eval_every: int = 20
    eval_prompts: int = 256
    output_dir: str = MISSING  # where save_pretrained writes the checkpoint and tokenizer
    threads: int | None = None


@dataclass
class SFTConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    dataset: Any = MISSING
    sft: SFTSettings = field(default_factory=SFTSettings)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    seed: int = 0
    device: str = "cpu"


def _schema_from(cls: type, name: str, extra: list[tuple[str, type, Any]]) -> type:
    """A Hydra schema dataclass: `name` and `extra` fields, then the fields of `cls` with their defaults."""
    hints = typing.get_type_hints(cls)
    fields = [("name", str, field(default=name))]
    fields += [(key, typ, field(default=default)) for key, typ, default in extra]
    for f in dataclasses.fields(cls):
        if f.default is not dataclasses.MISSING:
            fields.append((f.name, hints[f.name], field(default=f.default)))
        else:
            fields.append((f.name, hints[f.name], field(default=MISSING)))
    return dataclasses.make_dataclass(f"{cls.__name__}Schema", fields)


def algo_hyperparameters(algo_cfg: Any) -> tuple[str, bool, dict[str, Any]]:
    """Split an `algo` node into (objective name, divide advantages by std, objective hyperparameters)."""
    params = dict(algo_cfg)
    return params.pop("name"), bool(params.pop("advantage_std")), params


def register_configs() -> None:
    """Store every schema; idempotent (Hydra's ConfigStore overwrites entries of the same name)."""
    from algos import OBJECTIVES
    from experiments.tasks import TASKS

    # `${project_root:}` in yaml: checkpoints and reports resolve against the project, not the working directory.
    OmegaConf.register_new_resolver("project_root", lambda: str(PROJECT_ROOT), replace=True)
    cs = ConfigStore.instance()
    cs.store(name="train_schema", node=TrainConfig)
    cs.store(name="sft_schema", node=SFTConfig)
    for name, cls in OBJECTIVES.items():
        cs.store(group="schema/algo", name=name, node=_schema_from(cls, name, [("advantage_std", bool, True)]))
    for name, cls in TASKS.items():
        cs.store(group="schema/dataset", name=name, node=_schema_from(cls, name, []))
