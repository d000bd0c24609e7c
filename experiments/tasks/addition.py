"""Multi-digit addition "a+b=", the cold-start and RL task of the tiny MoE."""

import random
from dataclasses import dataclass

from experiments.tasks.base import TASKS, Example, SyntheticTask
from models.registry import ConfigError


@TASKS.register("addition")
@dataclass(frozen=True)
class AdditionTask(SyntheticTask):
    """Add two non-negative integers.

    Prompt: `"{a}+{b}="` with a and b drawn uniformly from [0, 10**digits), written in decimal without leading
    zeros (so shorter operands occur). Answer and demonstration: the sum in decimal, no leading zeros.
    Example (digits=2): prompt `"12+34="`, answer `"46"`.

    Difficulty knob: `digits`, the operand length (the answer has up to digits + 1 characters).
    Reward: 1.0 for the exact sum (surrounding whitespace ignored); otherwise 0.5 x the fraction of the sum's
    characters that the completion has at the same position, e.g. `"47"` for `"46"` earns 0.25 and `"46 0"`
    earns 0.5 (trailing text is not an exact answer). `is_correct` means reward 1.0.
    """

    digits: int = 2  # operand length, the difficulty knob

    def validate(self) -> None:
        if self.digits < 1:
            raise ConfigError(f"addition.digits={self.digits} must be >= 1")

    def distinct_prompts(self) -> int:
        return 10 ** (2 * self.digits)

    def draw(self, rng: random.Random) -> Example:
        a, b = rng.randrange(10**self.digits), rng.randrange(10**self.digits)
        answer = str(a + b)
        return Example(prompt=f"{a}+{b}=", answer=answer, demonstration=answer)
