"""Long answers: multi-digit addition written out as a scratchpad, one (digit, carry) pair per column.

Why this task. The RL instability the lab studies is tied to long responses (token-level ratios multiply their noise
over every token; GSPO's length-normalised ratio averages it), and the addition and sorting tasks answer in 2-5
tokens. A long answer must still be learnable by a narrow, deep MoE from demonstrations in minutes, and its reward
must be checkable and give partial credit, so that RL has reward variance to work with. Here every answer token
depends on three tokens at fixed distances (the column's two operand digits and the previous carry), so a small
model learns the rule quickly, while a slip in one column carries into the next: exact answers stay hard and RL has
something to improve. The answer is 2 x `digits` tokens (32 at the default 16 digits, 128 at 64). Sorting needs
counts over the whole prompt and string reversal a lookup whose distance changes at every token; both train slower.

Format (digits=4, a = 1234, b = 5678, least significant column first):
    prompt  "48372615="   the columns' digit pairs a_i b_i: 4 8 | 3 7 | 2 6 | 1 5
    answer  "21119060"    per column the sum digit s_i and the carry c_(i+1): 2 1 | 1 1 | 9 0 | 6 0 (a + b = 6912)
Operands are zero-padded to `digits` digits, so every column exists and the distances are the same in every prompt.

Reward: 1.0 for the exact scratchpad; otherwise 0.5 x the share of its characters in place (the lab's synthetic-task
rule, `experiments.tasks.base.SyntheticTask.reward`), so a scratchpad with one wrong column still earns most of 0.5.
"""

import random
from dataclasses import dataclass

from experiments.tasks.base import TASKS, Example, SyntheticTask
from models.registry import ConfigError


def scratchpad(a: str, b: str) -> str:
    """The (sum digit, carry out) pairs of adding the digit strings `a` and `b`, least significant column first."""
    carry, out = 0, []
    for x, y in zip(reversed(a), reversed(b)):
        total = int(x) + int(y) + carry
        carry = total // 10
        out.append(f"{total % 10}{carry}")
    return "".join(out)


@TASKS.register("scratchpad")
@dataclass(frozen=True)
class ScratchpadAdditionTask(SyntheticTask):
    """Add two `digits`-digit numbers, column by column, writing each column's sum digit and carry.

    Prompt: the operands' digit pairs, least significant column first, then "=". Answer and demonstration: the
    scratchpad, 2 x `digits` characters (see the module docstring for an example). Difficulty and length knob:
    `digits`. Reward: 1.0 for the exact scratchpad, else 0.5 x the share of its characters in place.
    """

    digits: int = 16  # columns: the answer is 2 x digits tokens long, the prompt 2 x digits + 1

    def validate(self) -> None:
        if self.digits < 2:
            raise ConfigError(f"scratchpad.digits={self.digits} must be >= 2 (one column has no carry to pass on)")

    def distinct_prompts(self) -> int:
        return 10 ** (2 * self.digits)

    def draw(self, rng: random.Random) -> Example:
        a = "".join(rng.choice("0123456789") for _ in range(self.digits))
        b = "".join(rng.choice("0123456789") for _ in range(self.digits))
        columns = "".join(x + y for x, y in zip(reversed(a), reversed(b)))
        answer = scratchpad(a, b)
        return Example(prompt=f"{columns}=", answer=answer, demonstration=answer)
