"""Multi-digit addition "a+b=", the cold-start and RL task of the tiny MoE."""

import random
from dataclasses import dataclass

from models.registry import ConfigError
from experiments.tasks.base import Example, Task
from experiments.tasks.registry import TASKS
from experiments.tasks.synthetic import check_split_sizes, draw_split, in_place_reward


@TASKS.register("addition")
@dataclass(frozen=True)
class AdditionTask(Task):
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
    train_size: int = 20000  # distinct problems in the train split
    test_size: int = 500  # distinct problems in the held-out split (disjoint from train)
    seed: int = 0  # the splits are a deterministic function of this seed

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.digits < 1:
            raise ConfigError(f"addition.digits={self.digits} must be >= 1")
        check_split_sizes("addition", 10 ** (2 * self.digits), self.train_size, self.test_size)

    def _draw(self, rng: random.Random) -> Example:
        a, b = rng.randrange(10**self.digits), rng.randrange(10**self.digits)
        answer = str(a + b)
        return Example(prompt=f"{a}+{b}=", answer=answer, demonstration=answer)

    def examples(self, split: str) -> list[Example]:
        return draw_split(self._draw, split, self.train_size, self.test_size, self.seed)

    def reward(self, completion: str, example: Example) -> float:
        return in_place_reward(completion, example.answer)
