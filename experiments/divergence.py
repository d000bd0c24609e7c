"""A run whose numbers turned non-finite for good ends as `diverged`: the error that says so, and the watch on sampling.

Where it is detected, each time before a non-finite number would crash the run somewhere unrelated or corrupt it
silently (`experiments.train` then ends the run with one line, its log whole and `summary.json` status `diverged`):
- the loss or gradient of an update (`experiments.trainer`): the update is skipped and counted
  (`optim/skipped_steps`), and `trainer.max_consecutive_skips` skipped in a row end the run;
- the weights after an optimizer step (`experiments.trainer`): every later forward would be NaN;
- the logits a rollout or an evaluation samples from (`FiniteLogits`, in the HF engine's `generate`): finite weights
  can still overflow in a forward (a learning rate far too large, an fp16 engine copy), and then `torch.multinomial`
  stops with an error that names none of this, while a greedy argmax silently picks a token.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from transformers import LogitsProcessor


class Diverged(ArithmeticError):
    """The run's numbers are non-finite and will stay so; the message (one line) says which, and where."""


class FiniteLogits(LogitsProcessor):
    """A `generate` logits processor that watches every decode step for a row whose logits hold NaN or +inf (or only
    -inf): there is no distribution to sample from. Such a row is recorded and given uniform logits, so that
    `generate` finishes on every rank (a rank that stopped inside it would leave the others waiting in its
    collectives); the caller asks `seen` after `generate` and raises `Diverged`, on every rank at once."""

    def __init__(self) -> None:
        self.met = False

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        broken = ~torch.isfinite(scores.amax(dim=-1))  # amax is NaN with a NaN, inf with +inf, -inf when all are
        if not bool(broken.any()):
            return scores
        self.met = True
        return torch.where(broken[:, None], torch.zeros_like(scores), scores)

    def seen(self, device: torch.device, synced: bool) -> bool:
        """Whether any decode step met such logits: on this rank, or on any rank when `synced` (FSDP2 ranks)."""
        if not synced:
            return self.met
        met = torch.tensor(float(self.met), device=device)
        dist.all_reduce(met, op=dist.ReduceOp.MAX)
        return bool(met)
