"""Held-out evaluation: mean pass@1 over k samples per prompt, and greedy accuracy.

The same fixed prefix of the test split is used at every evaluation and in every run, so curves of different
algorithms and seeds are comparable point by point. The trainer evaluates its own policy (an `HFEngine` on its
model), whatever engine sampled the training rollouts.
"""

from __future__ import annotations

from experiments.step.engines.hf import RolloutEngine, collect_rollout
from experiments.tasks import Example, Task


def evaluate(
    engine: RolloutEngine,
    task: Task,
    examples: list[Example],
    samples: int,
    max_new_tokens: int,
    temperature: float,
) -> dict[str, float]:
    """`eval/accuracy`: mean over prompts of the share of `samples` sampled completions that are correct
    (the unbiased pass@1 estimate; absent when `samples` is 0); `eval/greedy_accuracy`: share of prompts answered
    correctly by greedy decoding."""
    metrics = {}
    if samples > 0:
        sampled = collect_rollout(engine, task, examples, samples, max_new_tokens, temperature)
        metrics["eval/accuracy"] = float(sampled.correct.float().mean())
    greedy = collect_rollout(engine, task, examples, 1, max_new_tokens, temperature, greedy=True)
    metrics["eval/greedy_accuracy"] = float(greedy.correct.float().mean())
    return metrics
