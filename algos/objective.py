"""The base every policy-optimisation objective derives from, and what calling one returns.

An objective is a frozen dataclass whose fields are its hyperparameters (so it doubles as a typed Hydra schema).
Subclasses say how a batch turns into a per-token policy loss (`policy_loss`) and which hyperparameter values
they accept (`validate`); the base does the rest the same way for all of them:

1. validate the inputs and build the fp32, padding-safe quantities (`algos.common.PolicyBatch`);
2. add the KL penalty to the reference policy, β·k3 per token with k3 = exp(ref − logp) − (ref − logp) − 1
   (DeepSeekMath eq. 4), to the per-token policy loss, and aggregate the sum with the objective's mode;
3. compute the shared metrics (`algos.metrics`).

Every objective has the hyperparameter `kl_coef` (β; default 0, as in the GSPO paper's comparison and in DAPO,
Dr. GRPO, CISPO; DeepSeekMath's GRPO used 0.04); `ref_logp` is required when it is positive.
"""

import math
import typing
from abc import ABC, abstractmethod
from dataclasses import dataclass, fields
from types import NoneType
from typing import ClassVar

from torch import Tensor

from algos.common import LOSS_AGG_MODES, PolicyBatch, PolicyLoss, aggregate, k3
from algos.metrics import policy_metrics


@dataclass(frozen=True)
class ObjectiveOutput:
    """loss: 0-dim tensor to minimise (differentiable in logp); metrics: shared and objective-specific floats."""

    loss: Tensor
    metrics: dict[str, float]


@dataclass(frozen=True)
class Objective(ABC):
    """Base of every objective. Call it with keyword arguments:

    logp      [B, T] log π_θ of the response tokens (carries the gradient; any float dtype, used in fp32)
    old_logp  [B, T] log π_old of the same tokens (no gradient)
    advantages [B]   one advantage per response
    mask      [B, T] bool or 0/1, valid response tokens; padded positions may hold anything, NaN included
    ref_logp  [B, T] log π_ref, needed when kl_coef > 0
    """

    registry_name: ClassVar[str] = "objective"  # set by algos.registry.register_objective

    kl_coef: float = 0.0

    def __post_init__(self) -> None:
        self._check_field_types()
        self._check_non_negative("kl_coef")
        self.validate()

    @abstractmethod
    def validate(self) -> None:
        """Raise ValueError for hyperparameter values this objective cannot use."""

    @abstractmethod
    def policy_loss(self, batch: PolicyBatch) -> PolicyLoss:
        """The per-token policy loss of `batch`, where its clip binds, and how to aggregate it."""

    def __call__(
        self, *, logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor, ref_logp: Tensor | None = None
    ) -> ObjectiveOutput:
        if self.kl_coef > 0 and ref_logp is None:
            raise ValueError(f"{self.registry_name}: kl_coef = {self.kl_coef} > 0 needs ref_logp (log π_ref, [B, T])")
        batch = PolicyBatch.from_inputs(
            logp=logp, old_logp=old_logp, advantages=advantages, mask=mask, ref_logp=ref_logp
        )
        policy = self.policy_loss(batch)
        policy_only = aggregate(policy.per_token, batch.mask, policy.aggregation, policy.norm_tokens)
        loss = policy_only
        if self.kl_coef > 0:
            per_token = policy.per_token + self.kl_coef * k3(batch.ref_log_ratio)
            loss = aggregate(per_token, batch.mask, policy.aggregation, policy.norm_tokens)
        return ObjectiveOutput(loss=loss, metrics=policy_metrics(batch, policy, policy_only))

    # Validation helpers: every message names the objective, the hyperparameter, the value and what is allowed.

    def _fail(self, message: str) -> typing.NoReturn:
        raise ValueError(f"{self.registry_name}: {message}")

    def _check_non_negative(self, *names: str) -> None:
        for name in names:
            value = getattr(self, name)
            if value is not None and value < 0:
                self._fail(f"{name} must be >= 0, got {value}")

    def _check_positive(self, *names: str) -> None:
        for name in names:
            value = getattr(self, name)
            if value is not None and value <= 0:
                self._fail(f"{name} must be > 0, got {value}")

    def _check_ratio_lower_clip(self, name: str) -> None:
        """A ratio-space lower clip ε keeps the bound 1 − ε positive: 0 <= ε < 1."""
        self._check_non_negative(name)
        value = getattr(self, name)
        if value is not None and value >= 1:
            self._fail(f"{name} must be < 1 so that the lower ratio bound 1 - {name} stays positive, got {value}")

    def _check_loss_agg(self, name: str = "loss_agg") -> None:
        value = getattr(self, name)
        if value not in LOSS_AGG_MODES:
            self._fail(f"{name} must be one of {', '.join(LOSS_AGG_MODES)}; got {value!r}")

    def _check_field_types(self) -> None:
        """Fields are float, int, str, bool or `X | None`; ints are accepted (and stored) as floats."""
        hints = typing.get_type_hints(type(self))
        for f in fields(self):
            value = getattr(self, f.name)
            expected = hints[f.name]
            options = typing.get_args(expected) or (expected,)
            if value is None:
                if NoneType not in options:
                    self._fail(f"{f.name} must not be None")
                continue
            kind = next(option for option in options if option is not NoneType)
            if kind is float and isinstance(value, int) and not isinstance(value, bool):
                value = float(value)
                object.__setattr__(self, f.name, value)
            if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
                self._fail(f"{f.name} must be of type {expected}, got {value!r} ({type(value).__name__})")
            if kind is float and not math.isfinite(value):
                self._fail(f"{f.name} must be finite, got {value}")
