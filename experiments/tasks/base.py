"""What a verifiable task is: examples with a canonical answer, and a reward the task itself owns.

The shape follows nanochat's Task abstraction (a dataset plus its evaluation criterion): the training loop,
SFT and evaluation never look inside an answer, they only call `examples`, `reward` and `is_correct`. Tasks deal
in text only; tokenisation belongs to the policy.

A task is a frozen dataclass whose fields are its parameters (the Hydra `dataset` group is generated from
those fields), registered under a name with `TASKS.register`.
"""

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar

from models.registry import check_fields

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
        check_fields(self, self.name)

    @abstractmethod
    def examples(self, split: str) -> list[Example]:
        """The examples of `split` ("train" or "test"), in a fixed order."""

    @abstractmethod
    def reward(self, completion: str, example: Example) -> float:
        """A score in [0, 1] for `completion` (decoded text up to, not including, eos); 1.0 means correct."""

    def is_correct(self, completion: str, example: Example) -> bool:
        """What accuracy counts: full reward."""
        return self.reward(completion, example) == 1.0


def check_split(split: str) -> None:
    if split not in SPLITS:
        raise ValueError(f"split={split!r} is not one of {list(SPLITS)}")
