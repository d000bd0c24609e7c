"""What the synthetic tasks share: held-out-first split drawing and the in-place partial-credit reward.

Splits: the test set is drawn first (distinct prompts), then the train set is drawn from what is left, so no
prompt is in both and the test set does not move when `train_size` changes. Both come from one
`random.Random(seed)`, so a seed fixes the data.

Reward (the peer TRL benchmark's, `shared/bench/trl_baseline`): 1.0 when the completion, stripped of
surrounding whitespace, is exactly the answer; otherwise 0.5 x the fraction of answer characters that the
stripped completion has at the same position. Characters past the answer's length earn nothing and cost
nothing; an empty completion earns 0.
"""

import random
from collections.abc import Callable

from models.registry import ConfigError
from experiments.tasks.base import Example, check_split


def check_split_sizes(task: str, num_distinct: int, train_size: int, test_size: int) -> None:
    """Sizes must be positive, and the test set may take at most half of the `num_distinct` prompts.

    The half keeps most prompts available for training and keeps rejection sampling of both splits cheap.
    """
    if train_size < 1:
        raise ConfigError(f"{task}.train_size={train_size} must be >= 1")
    if test_size < 1:
        raise ConfigError(f"{task}.test_size={test_size} must be >= 1")
    if test_size > num_distinct // 2:
        raise ConfigError(
            f"{task}.test_size={test_size} is more than half of the {num_distinct} distinct prompts at this "
            f"difficulty; use test_size <= {num_distinct // 2} or a harder setting"
        )


def draw_split(draw: Callable[[random.Random], Example], split: str, train_size: int, test_size: int,
               seed: int) -> list[Example]:
    """`split` of a task whose examples come from `draw(rng)`: distinct test prompts first, then train without them.

    Train examples may repeat (small tasks have few prompts); test examples never do.
    """
    check_split(split)
    rng = random.Random(seed)
    test: dict[str, Example] = {}
    while len(test) < test_size:
        example = draw(rng)
        test.setdefault(example.prompt, example)
    if split == "test":
        return list(test.values())
    train: list[Example] = []
    while len(train) < train_size:
        example = draw(rng)
        if example.prompt not in test:
            train.append(example)
    return train


def in_place_reward(completion: str, answer: str) -> float:
    """1.0 if `completion.strip() == answer`, else 0.5 x (share of answer characters matched at their position)."""
    completion = completion.strip()
    if completion == answer:
        return 1.0
    in_place = sum(1 for got, want in zip(completion, answer) if got == want)
    return 0.5 * in_place / len(answer)
