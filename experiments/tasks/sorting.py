"""Sorting a short string of digits: a second small task with a verifiable answer and a length knob.

Chosen over countdown because the tiny MoE learns it from demonstrations in minutes: each output character
depends on digit counts in the prompt, not on a search. Measured with `model=tiny_moe` (batch 128, AdamW lr 1e-3,
greedy, 100 held-out prompts): length 5 reached 45% exact after 20 steps and 67% after 60; length 8 reached
3% after 20 steps and 33% after 40.
"""

import random
from dataclasses import dataclass

from experiments.tasks.base import TASKS, Example, SyntheticTask
from models.registry import ConfigError


@TASKS.register("sorting")
@dataclass(frozen=True)
class SortingTask(SyntheticTask):
    """Sort digits in ascending order.

    Prompt: `"sort {digits}="` where the digits are `length` characters drawn uniformly from 0-9 (repeats
    allowed). Answer and demonstration: the same digits in ascending order.
    Example (length=5): prompt `"sort 83157="`, answer `"13578"`.

    Difficulty knob: `length`, the number of digits to sort.
    Reward: 1.0 for the sorted string (surrounding whitespace ignored); otherwise 0.5 x the fraction of
    answer characters that the completion has at the same position, e.g. `"13587"` for `"13578"` earns 0.3.
    `is_correct` means reward 1.0.
    """

    length: int = 5  # digits to sort, the difficulty knob

    def validate(self) -> None:
        if self.length < 2:
            raise ConfigError(f"sorting.length={self.length} must be >= 2 (one digit is already sorted)")

    def distinct_prompts(self) -> int:
        return 10**self.length

    def draw(self, rng: random.Random) -> Example:
        digits = "".join(rng.choice("0123456789") for _ in range(self.length))
        answer = "".join(sorted(digits))
        return Example(prompt=f"sort {digits}=", answer=answer, demonstration=answer)
