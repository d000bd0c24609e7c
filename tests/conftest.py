"""Shared fixtures: micro MoE policies (milliseconds per forward) and Hydra overrides for seconds-long RL runs."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("WANDB_SILENT", "true")

from models.policy import ModelConfig, build_policy  # noqa: E402

# A Qwen3-MoE small enough for many forwards per test, with the structure of the real thing: several MoE layers,
# top-2 of 8 experts, renormalised gates, decisive routers.
MICRO_MODEL = dict(
    name="micro_moe",
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    intermediate_size=64,
    num_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=16,
    max_position_embeddings=64,
    router_init_std=1.0,
)

# Hydra overrides for an RL run of a few seconds on the micro model.
MICRO_RUN = [f"model.{key}={value}" for key, value in MICRO_MODEL.items()] + [
    "trainer.steps=3",
    "trainer.prompts_per_step=4",
    "trainer.group_size=4",
    "trainer.minibatches=2",
    "trainer.max_new_tokens=4",
    "trainer.eval_every=0",
    "trainer.eval_prompts=4",
    "trainer.eval_samples=2",
    "trainer.lr=1e-2",
    "dataset.train_size=200",
    "dataset.test_size=20",
    "logger.wandb.mode=disabled",
]


@pytest.fixture(autouse=True)
def _single_thread():
    # Tests run beside other processes on 2 cores: one intra-op thread avoids OpenMP oversubscription.
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture
def micro_policy():
    """(model, tokenizer) of the micro MoE, fp32, eager experts (exact comparisons), eval mode."""
    model, tokenizer = build_policy(ModelConfig(**MICRO_MODEL, experts_implementation="eager"))
    return model.eval(), tokenizer
