"""The benchmark workloads: the TRL peer benchmark's RL step ("bench-tiny") and the lab's own ("bench-deep").

bench-tiny, one RL step: 32 addition prompts x 8 completions = 256 completions of exactly 16 new tokens (eos is banned
before the budget: `fixed_length`, so every loop and every step does identical work), split into 4 minibatches of 64,
one AdamW update each, on the 7.1 M-parameter random Qwen3-MoE of `conf/model/tiny_moe.yaml` (hidden 256, 4 MoE layers,
16 experts, top-2, expert width 128). The TRL worker builds its run from the same composed config, so both loops see the
same model, tokenizer, prompts, batch geometry, learning rate and clip range.

bench-deep, one RL step of the deep_long cell (`conf/experiment/deep_long.yaml` at the learning rate of its seeds,
`deep_long_seeds.yaml`): qwen30b_l16 from its config with random weights (16 MoE layers, 128 experts top-8, hidden
64, expert width 24), the scratchpad task, exactly 33 new tokens (the 32-token answer and its eos, the experiment's
budget) held fixed as bench-tiny holds its 16, and the experiment's batch: 32 prompts x 8, 4 minibatches. Here 128
narrow experts make per-expert dispatch, not arithmetic, the likely cost, where bench-tiny's 16 wide ones do not.
It is written as bench-tiny's settings with these replaced (later overrides win), so that a worker of an older
commit, which knows bench-tiny only, composes the same run when given the whole list as its overrides.
"""

from __future__ import annotations

from hydra import compose, initialize_config_dir
from omegaconf import DictConfig

from experiments.config import PROJECT_ROOT, register_configs

BENCH_TINY = [
    "model=tiny_moe",
    "model.path=null",
    "dataset=addition",
    "trainer.prompts_per_step=32",
    "trainer.group_size=8",
    "trainer.max_new_tokens=16",
    "trainer.minibatches=4",
    "trainer.lr=1e-5",
    "trainer.eval_every=0",
    "trainer.eval_prompts=0",  # the benchmark times RL steps only
    "logger.wandb.mode=disabled",
]

BENCH_DEEP = [*BENCH_TINY, "model=qwen30b_l16", "dataset=scratchpad", "trainer.max_new_tokens=33", "trainer.lr=3e-4"]

WORKLOADS = {"tiny": BENCH_TINY, "deep": BENCH_DEEP}

# The loops the issue asks for, as overrides on top of the workload.
VARIANTS = {"grpo": ["algo=grpo"], "gspo": ["algo=gspo"], "grpo+r2": ["algo=grpo", "routing.replay=r2"]}


def fixed_length(cfg: DictConfig) -> int:
    """The `min_new_tokens` (`RLTrainer`'s) that make its engine generate exactly `max_new_tokens` tokens per
    completion (the benchmark's workload; μ_old is still scored from the raw logits, before the eos ban)."""
    return cfg.trainer.max_new_tokens


def compose_workload(overrides: list[str], workload: str = "tiny") -> DictConfig:
    """The training config of `workload` (a key of `WORKLOADS`) with `overrides` applied last (later overrides
    win)."""
    if workload not in WORKLOADS:
        raise ValueError(f"workload {workload!r} is not one of {list(WORKLOADS)}")
    register_configs()  # the typed schemas the yaml files extend
    with initialize_config_dir(config_dir=str(PROJECT_ROOT / "conf"), version_base="1.3"):
        return compose("train", overrides=[*WORKLOADS[workload], *overrides])
