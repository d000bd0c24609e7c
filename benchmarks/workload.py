"""The benchmark workload ("bench-tiny"): the TRL peer benchmark's RL step, expressed as our Hydra config.

One RL step: 32 addition prompts x 8 completions = 256 completions of exactly 16 new tokens (eos is banned before
the budget: `fixed_length`, so every loop and every step does identical work), split into 4 minibatches of 64, one AdamW update each, on
the 7.1 M-parameter random Qwen3-MoE of `conf/model/tiny_moe.yaml` (hidden 256, 4 MoE layers, 16 experts,
top-2, expert width 128). The TRL worker builds its run from the same composed config, so both loops see the
same model, tokenizer, prompts, batch geometry, learning rate and clip range.
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

# The loops the issue asks for, as overrides on top of the workload.
VARIANTS = {
    "grpo": ["algo=grpo"],
    "gspo": ["algo=gspo"],
    "grpo+r2": ["algo=grpo", "routing.replay=r2"],
}


def fixed_length(trainer) -> None:
    """Make `trainer`'s engine generate exactly `max_new_tokens` tokens per completion (the benchmark's workload;
    μ_old is still scored from the raw logits, before the eos ban)."""
    trainer.engine.min_new_tokens = trainer.cfg.trainer.max_new_tokens


def compose_workload(overrides: list[str]) -> DictConfig:
    """The training config of the workload with `overrides` applied last (later overrides win)."""
    register_configs()  # the typed schemas the yaml files extend
    with initialize_config_dir(config_dir=str(PROJECT_ROOT / "conf"), version_base="1.3"):
        return compose("train", overrides=[*BENCH_TINY, *overrides])
