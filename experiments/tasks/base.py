"""What a verifiable task is: examples with a canonical answer, a reward the task itself owns, and the registry.

The shape follows nanochat's Task abstraction (a dataset plus its evaluation criterion): the training loop,
SFT and evaluation never look inside an answer, they only call `examples`, `reward` and `is_correct`. Tasks deal
in text only; tokenisation belongs to the policy.

A task is a frozen dataclass whose fields are its parameters (the Hydra `dataset` group is generated from those
fields), registered under a name with `TASKS.register`; `build_task(name, **params)` is how the loops get one.

The synthetic tasks (addition, sorting, scratchpad) share `SyntheticTask`: seeded splits and the in-place
partial-credit reward.
- Splits: the test set is drawn first (distinct prompts), then the train set is drawn from what is left, so no
  prompt is in both and the test set does not move when `train_size` changes. Both come from one
  `random.Random(seed)`, so a seed fixes the data.
- Reward (the TRL peer benchmark's): 1.0 when the completion, stripped of surrounding whitespace, is exactly the
  answer; otherwise 0.5 x the fraction of answer characters that the stripped completion has at the same position.
  Characters past the answer's length earn nothing and cost nothing; an empty completion earns 0.
"""

import random
import string
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, cast

from models.registry import ConfigError, Registry, check_fields

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

SPLITS = ("train", "test")


@dataclass(frozen=True)
class Example:
    """One prompt with its reference.

    prompt: the exact text fed to the model.
    answer: the canonical final answer that `Task.reward` compares a completion to.
    demonstration: the completion an SFT step teaches, without eos (the loop appends the tokenizer's).
    """

    prompt: str
    answer: str
    demonstration: str


class Task(ABC):
    """Base of every task. Subclasses are frozen dataclasses and call `super().__post_init__()` first."""

    name: ClassVar[str]  # the registry key, set by `TASKS.register`; not a parameter

    def __post_init__(self) -> None:
        check_fields(cast("DataclassInstance", self), self.name)  # a subclass: a frozen dataclass

    @abstractmethod
    def examples(self, split: str) -> list[Example]:
        """The examples of `split` ("train" or "test"), in a fixed order."""

    @abstractmethod
    def reward(self, completion: str, example: Example) -> float:
        """A score in [0, 1] for `completion` (decoded text up to, not including, eos); 1.0 means correct."""

    def is_correct(self, completion: str, example: Example) -> bool:
        """What accuracy counts: full reward."""
        return self.reward(completion, example) == 1.0


TASKS: Registry[Task] = Registry("task", Task)


def build_task(name: str, **params: object) -> Task:
    """The task registered as `name`, with `params` overriding its defaults."""
    return TASKS.build(name, **params)


def check_split(split: str) -> None:
    if split not in SPLITS:
        raise ValueError(f"split={split!r} is not one of {list(SPLITS)}")


def check_question_template(template: str, key: str) -> None:
    """Refuse a prompt template (the setting `key`) that is not `{question}` in literal text."""
    fields = {name for _, name, _, _ in string.Formatter().parse(template) if name is not None}
    if fields != {"question"}:
        raise ConfigError(
            f"{key}={template!r} must contain the field {{question}} and no other fields (found "
            f"{sorted(fields)}); write literal braces as {{{{ and }}}}"
        )


@dataclass(frozen=True, kw_only=True)
class SyntheticTask(Task):
    """A task drawn from a seeded generator, with the in-place partial-credit reward (the module docstring).
    Subclasses add their difficulty knob, check it in `validate`, and say how many distinct prompts it allows; the
    split settings below are keyword-only, so the knob stays a task's first parameter."""

    train_size: int = 20000  # problems in the train split (they may repeat; none is in the test split)
    test_size: int = 500  # distinct problems in the held-out split (disjoint from train)
    seed: int = 0  # the splits are a deterministic function of this seed

    def __post_init__(self) -> None:
        super().__post_init__()
        self.validate()
        if self.train_size < 1:
            raise ConfigError(f"{self.name}.train_size={self.train_size} must be >= 1")
        if self.test_size < 1:
            raise ConfigError(f"{self.name}.test_size={self.test_size} must be >= 1")
        # The test set may take at most half of the prompts: most stay for training, and drawing both splits by
        # rejection stays cheap.
        distinct = self.distinct_prompts()
        if self.test_size > distinct // 2:
            raise ConfigError(
                f"{self.name}.test_size={self.test_size} is more than half of the {distinct} distinct prompts at this "
                f"difficulty; use test_size <= {distinct // 2} or a harder setting"
            )

    @abstractmethod
    def validate(self) -> None:
        """Raise `ConfigError` for a difficulty this task cannot draw."""

    @abstractmethod
    def distinct_prompts(self) -> int:
        """How many different prompts the difficulty allows."""

    @abstractmethod
    def draw(self, rng: random.Random) -> Example:
        """One example from the generator `rng`."""

    def examples(self, split: str) -> list[Example]:
        """`split`: distinct test prompts first, then train examples without them (train examples may repeat)."""
        check_split(split)
        rng = random.Random(self.seed)
        test: dict[str, Example] = {}
        while len(test) < self.test_size:
            example = self.draw(rng)
            test.setdefault(example.prompt, example)
        if split == "test":
            return list(test.values())
        train: list[Example] = []
        while len(train) < self.train_size:
            example = self.draw(rng)
            if example.prompt not in test:
                train.append(example)
        return train

    def reward(self, completion: str, example: Example) -> float:
        """1.0 if `completion.strip()` is the answer, else 0.5 x (share of answer characters matched in place)."""
        completion = completion.strip()
        if completion == example.answer:
            return 1.0
        in_place = sum(1 for got, want in zip(completion, example.answer) if got == want)
        return 0.5 * in_place / len(example.answer)
