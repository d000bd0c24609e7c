"""Lagged replay: Routing Replay whose experts come from the weights `lag` optimizer updates before θ_old, so that
no replay, R2 (lag 0: θ_old's own experts) and lagged replay sit on one axis beside R3 (the engine's experts). It is
DeepSeek-V4's anticipatory routing (V4 report, April 2026: expert choices taken from θ_{t−Δ}) put on the replay axis.

With θ_old the weights a step starts from and θ_{old−lag} those `lag` applied updates earlier, every minibatch of the
step is scored, in the π_old pass and in each π_θ forward, with the experts the policy at θ_{old−lag} routes it to
(one more no-grad forward per minibatch, on a copy of the policy holding those weights):

    π_old = π_θold(y | experts of θ_{old−lag}),   ratio = π_θ(y | experts of θ_{old−lag}) / π_old

so the first minibatch's ratio is exactly 1, as under R2 and R3, and drift is still measured against θ_old's own
routing. The weights after every applied update are kept (CPU copies; a skipped update changes nothing and does not
count); until the run has made `lag` updates the oldest weights kept, the starting ones, route, and
`routers/replay_lag` logs, at every update, the lag actually served: the applied updates between the weights that
routed it and θ_old (0 in the first step, then growing to `lag` as the history fills). A lag that no step of the run
reaches (more than the (trainer.steps − 1) × trainer.minibatches updates made before the last step starts) would
replay the start's experts throughout, and is refused at start-up. `lag=0` keeps nothing and installs nothing: R2,
bit for bit. Memory: `lag` + 1 copies of the policy's weights, the lag at most `history`. The copies are not in
checkpoints, so a run with a lag cannot resume (`trainer.checkpoint_every` must be 0), and they are whole models, so
it runs on one rank. It replays by ID (`routing_variant=none`).
"""

from __future__ import annotations

import copy
from collections import deque
from dataclasses import dataclass
from typing import ClassVar

import torch

from algos.routers.base import ROUTER_SWITCHES, RouterSwitch, RunFacts, Summed
from models.routing.hooks import RouterCalls

LAG = "routers/replay_lag"


class WeightHistory:
    """The policy's weights after its last `lag` applied updates and the current ones, and a copy of the policy that
    holds the oldest of them."""

    def __init__(self, model: torch.nn.Module, lag: int) -> None:
        self.kept: deque[dict[str, torch.Tensor]] = deque(maxlen=lag + 1)
        self.kept.append(self.snapshot(model))
        self.copy = copy.deepcopy(model).eval().requires_grad_(False)
        self.loaded: dict[str, torch.Tensor] | None = None
        self.served = 0  # applied updates between the weights the copy holds and the newest kept (θ_old)

    @staticmethod
    def snapshot(model: torch.nn.Module) -> dict[str, torch.Tensor]:
        return {name: tensor.detach().to("cpu", copy=True) for name, tensor in model.state_dict().items()}

    def oldest(self) -> torch.nn.Module:
        """The copy, holding the oldest weights kept (loaded when they changed since the last call). While the
        history fills, the oldest stay the starting weights and the lag they serve grows with every update kept."""
        if self.loaded is not self.kept[0]:
            self.copy.load_state_dict(self.kept[0])
            self.loaded = self.kept[0]
        self.served = len(self.kept) - 1
        return self.copy


@ROUTER_SWITCHES.register("lagged_replay")
@dataclass(frozen=True)
class LaggedReplay(RouterSwitch):
    replay_modes: ClassVar[tuple[str, ...]] = ("r2",)
    replay_modes_why: ClassVar[str] = "moves R2's experts back by `lag` updates"

    lag: int = 1  # applied optimizer updates between the weights that route and θ_old; 0 is R2
    history: int = 8  # the most updates back the run may keep weights for (each a copy of the policy): lag <= history
    # The weights kept, this instance's state that `start` sets. Declared a ClassVar (annotated only: no class value)
    # so that the dataclass does not make it a field, i.e. a parameter.
    _history: ClassVar[WeightHistory | None]

    def validate(self) -> None:
        if self.history < 1:
            self._fail(f"history={self.history} must be >= 1 (updates whose weights are kept)")
        if not 0 <= self.lag <= self.history:
            self._fail(
                f"lag={self.lag} must be between 0 (R2) and history={self.history}, the updates whose weights "
                "the run keeps"
            )

    def check(self, run: RunFacts) -> None:
        super().check(run)
        if not self.lag:
            return
        if run.routing_variant != "none":
            self._fail(
                f"replays the lagged experts by ID; routing_variant={run.routing_variant} changes replayed "
                "forwards: use routing_variant=none"
            )
        if run.world > 1:
            self._fail(
                f"keeps whole copies of the policy's weights, which {run.world} ranks hold sharded: run one rank"
            )
        if run.checkpoint_every:
            self._fail(
                f"keeps weight copies that checkpoints do not hold, so trainer.checkpoint_every="
                f"{run.checkpoint_every} would resume another run: use trainer.checkpoint_every=0"
            )
        reached = run.updates_before_last_step
        if reached is not None and self.lag > reached:
            self._fail(
                f"lag={self.lag} is never served: the run makes {reached} optimizer updates before its last "
                f"step starts ((trainer.steps - 1) x trainer.minibatches), so every step would replay the "
                f"experts of fewer updates back; use lag <= {reached} or a longer run"
            )

    def start(self, model: torch.nn.Module) -> None:
        # The history is state, not a parameter: held outside the frozen dataclass's fields.
        object.__setattr__(self, "_history", WeightHistory(model, self.lag) if self.lag else None)

    def after_update(self, model: torch.nn.Module, routers: RouterCalls, summed: Summed) -> dict[str, float]:
        if self._history is None:
            return {}
        served = self._history.served
        self._history.kept.append(WeightHistory.snapshot(model))
        return {LAG: float(served)}

    def routing_model(self) -> torch.nn.Module | None:
        return self._history.oldest() if self._history is not None else None
