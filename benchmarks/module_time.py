"""Where a step's time goes inside the model: self time per kind of module, per phase of the RL step.

Forward hooks on the model's modules, grouped into parts that exist in every supported MoE family (experts,
router, attention, norms, LM head, embeddings, the rest of the model's forward), time each call with a wall clock.
A part is charged its *self* time: a norm inside attention (Qwen3's q/k norms) counts as norm, not twice. Time in
the phase that no model forward covers is what happens around the model: `generate`'s bookkeeping and sampling in
the rollout; backward, objective and optimizer in training (hooks see forwards only), unless those calls are
wrapped with `ModuleTimer.around`.

Why not torch.profiler: it times each operator in isolation and inflates small ones several-fold on this kind of
machine (KV-cache concatenation: 138 ms under the profiler, 45 ms timed in place), and why not py-spy: it needs
ptrace, which containers often deny. These hooks cost a few microseconds per module call.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from models.moe_backend import find_moe_experts
from models.routing.trace import find_routers

if TYPE_CHECKING:
    from transformers import PreTrainedModel

MODEL_PARTS = ("experts", "router", "attention", "norms", "lm head", "embeddings", "rest of the model")
# Calls outside the model's forwards that `ModuleTimer.around` can time as parts too.
PARTS = (*MODEL_PARTS, "backward", "gradient clipping", "optimizer step")


def module_parts(model: PreTrainedModel) -> dict[torch.nn.Module, str]:
    """The timed modules of `model` and the part each belongs to (the model itself is "rest of the model")."""
    parts = {module: "experts" for module in find_moe_experts(model).values()}
    parts.update({module: "router" for module in find_routers(model).values()})
    for name, module in model.named_modules():
        if name.endswith(".self_attn"):
            parts[module] = "attention"
        elif type(module).__name__.endswith("RMSNorm"):
            parts[module] = "norms"
    parts[model.get_output_embeddings()] = "lm head"
    parts[model.get_input_embeddings()] = "embeddings"
    parts[model] = "rest of the model"
    return parts


class ModuleTimer:
    """Self time per part of `model`'s forwards, accumulated under the current `phase` until `take()`."""

    def __init__(self, model: PreTrainedModel, clock: Callable[[], float] = time.perf_counter) -> None:
        self.clock = clock
        self.phase = "unattributed"
        self.totals: dict[str, dict[str, float]] = {}
        self._stack: list[list[float]] = []  # [start, time spent in timed children] per open call
        self._handles = []
        for module, part in module_parts(model).items():
            self._handles.append(module.register_forward_pre_hook(self._enter))
            self._handles.append(module.register_forward_hook(self._leave_as(part)))

    def around(self, function: Callable[..., Any], part: str) -> Callable[..., Any]:
        """`function`, its calls charged to `part` (e.g. `Tensor.backward` as "backward")."""

        def timed(*args: object, **kwargs: object) -> object:
            self._enter(None, args)
            try:
                return function(*args, **kwargs)
            finally:
                self._leave_as(part)(None, args, None)

        return timed

    def _enter(self, module: torch.nn.Module | None, args: tuple[Any, ...]) -> None:
        self._stack.append([self.clock(), 0.0])

    def _leave_as(self, part: str) -> Callable[[torch.nn.Module | None, tuple[Any, ...], object], None]:
        def leave(module: torch.nn.Module | None, args: tuple[Any, ...], output: object) -> None:
            start, children = self._stack.pop()
            elapsed = self.clock() - start
            phase = self.totals.setdefault(self.phase, dict.fromkeys(PARTS, 0.0))
            phase[part] += elapsed - children
            if self._stack:
                self._stack[-1][1] += elapsed

        return leave

    def take(self) -> dict[str, dict[str, float]]:
        """Seconds per phase and part since the last `take()`; starts a new tally."""
        totals, self.totals = self.totals, {}
        return totals

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
