"""What the concurrent source does past its bound (`rollout.overflow`): the three things the field does with a batch
that would be trained more than `rollout.max_staleness` = B versions after the weights that sampled it.

    wait    the worker starts batch b only once version b − 1 − B is published, so no batch is ever sampled past
            the bound; the worker idles there until the trainer publishes (AReaL, NeMo-RL, SkyRL)
    drop    the worker starts batch b once the trainer has taken batch b − 1 − B: a queue of B + 1 batches, which a
            worker ahead of a slower trainer fills with the version it holds while the trainer trains, so a batch
            may come to its step one version past the bound; such a batch is dropped, counted and never trained, and
            the step takes the next (TRL's `max_staleness`, prime-rl's `max_off_policy_steps`)
    count   the same queue; a batch past the bound is trained, and its rows counted (PipelineRL)

Version t is the weights after step t and step s trains from θ_old = version s − 1: a row sampled with version v is
(s − 1) − v behind when step s trains it. Under wait and count batch b is step b's; under drop a dropped batch's step
takes the next one, so batch b serves step b or a later one.

The seam is two questions: what the worker waits for before it samples a batch (`may_start`), and what the trainer
does with a batch taken for a step (`verdict`). A new policy is one class here, registered by name.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from enum import StrEnum
from typing import ClassVar

from models.registry import Registry


class Verdict(StrEnum):
    """What the trainer does with a batch taken for a step."""

    train = "train"
    drop = "drop"  # counted, never trained; the step takes the next batch
    refuse = "refuse"  # past a bound the worker's gate should have held: the run ends, naming it


class OverflowPolicy(ABC):
    """One policy past the bound (module docstring)."""

    name: ClassVar[str] = "overflow"  # the registry key, set by `OVERFLOW_POLICIES.register`
    what: ClassVar[str] = ""  # what happens past the bound, as `summary.json`'s `rollouts` says it

    @abstractmethod
    def may_start(self, batch: int, bound: int, published: int, taken: int) -> bool:
        """Whether the worker may sample batch `batch` now that version `published` is the newest published and the
        trainer has taken `taken` batches."""

    @abstractmethod
    def verdict(self, past: int) -> Verdict:
        """What the trainer does with a batch `past` of whose rows are past the bound when its step trains."""


OVERFLOW_POLICIES: Registry[OverflowPolicy] = Registry("overflow policy", OverflowPolicy, fields_are_parameters=False)


@OVERFLOW_POLICIES.register("wait")
class Wait(OverflowPolicy):
    what = "waits for newer weights before sampling: no row is sampled past it"

    def may_start(self, batch: int, bound: int, published: int, taken: int) -> bool:
        return published >= batch - 1 - bound

    def verdict(self, past: int) -> Verdict:
        return Verdict.refuse if past else Verdict.train


class Queued(OverflowPolicy, ABC):
    """A worker held by a queue of bound + 1 batches the trainer has not taken, not by the versions published."""

    def may_start(self, batch: int, bound: int, published: int, taken: int) -> bool:
        return taken >= batch - 1 - bound


@OVERFLOW_POLICIES.register("drop")
class Drop(Queued):
    what = "drops the batch, never trained (the worker holds a queue of bound + 1 batches)"

    def verdict(self, past: int) -> Verdict:
        return Verdict.drop if past else Verdict.train


@OVERFLOW_POLICIES.register("count")
class Count(Queued):
    what = "trains the batch, counting its rows (the worker holds a queue of bound + 1 batches)"

    def verdict(self, past: int) -> Verdict:
        return Verdict.train
