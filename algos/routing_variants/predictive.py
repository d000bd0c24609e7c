"""Predictive Routing Replay (PR2; arXiv 2606.00395, May 2026): R3 whose replayed route is predicted, so that it goes
less stale while the router moves during the step's updates (what the paper calls router staleness).

Beside every MoE router l a linear predictor W_p of the short-horizon change of its logits (`models.routing.predictor`:
`Linear(H, E, bias=False)`, zero at the start). The rollout engine routes every token by the predicted logits and
records that route with the router's input h_old and logits p_old; training replays the route as R3 replays the
engine's (the π_old recompute and every update forward, by ID: gates from the current router at those experts); the
predictor is fitted to the current router on the engine's own inputs:

    engine     Î_t = TopK(selection_scores(p_old,t + h_old,t · W_p), k), gated by the engine router's scores at Î_t
    training   replay Î_t (routing.replay=r3)
    predictor  L_PR2 = Σ_l mean_t KL( sg[softmax(z_θ,t)] ‖ softmax(p_old,t + h_old,t · W_p) ), z_θ,t = router_θ(h_old,t)

with t over the minibatch's routed tokens and z_θ the current router's logits on the same inputs: a stop-gradient
teacher. L_PR2 is added to the update's loss from the second minibatch of a step on (Algorithm 3 of the paper: none on
the first mini-step, where θ = θ_old); W_p is trained by the run's AdamW at `trainer.lr × lr_scale`, outside the
policy's gradient clip (its gradient is not the policy's, and must not shrink the policy's step).

What the predictor learns. Teacher and student read the same h_old, so the target is the router's own weight
change since the version the engine sampled with: h_old · (W_θ − W_engine)ᵀ after k + i router updates (k =
`rollout.lag`, i the update within the step); the next rollout routes by where the router went over that horizon.
The KL between softmaxes sees no change shared by every expert, and W_p's rows keep summing to zero from their zero
start: for the sigmoid family, whose ranking is not shift-invariant, that shared part of the change is not predicted.

Where the paper and its first author's code differ, and what we chose:
- where the route and (h_old, p_old) are recorded: the paper's placement, in the engine while it samples (the hf
  engine routes through `models.routing.predictor.route_by_predictors` and records the states with the route). The
  author's Miles port (radixark/miles #1362; DaizeDong/miles `predictive_router_replay.py`) records them in the
  trainer's π_old pass, R2-style. vLLM routes inside its kernels: `rollout.engine=vllm` is refused.
- `routing.replay=r3` is required, the other modes refused: the predicted route exists only in the engine's recording,
  so r2 would replay θ_old's own routes and none nothing, and the predictor would route tokens no update trains on.
  Implying r3 instead would make `routing.replay` misstate what the run replayed.
- the predicted route's gates are the engine router's own scores at the predicted experts, so μ_old is the engine's
  forward with those experts; a token whose predicted experts are the router's own keeps the router's output as it
  is, so the zero W_p of a run's start samples bit for bit as R3 does.
- tokens: every routed token of the minibatch's rows, prompts included (padding and the last sampled token carry no
  route), weighted alike as the paper's E_t; under several ranks the mean over every rank's tokens.
- `lr_scale` = 1: W_p's Adam step is then about the router's own change per update (about lr per weight), which W_p
  is to add up over k + i updates. The port's docs give 1e4 for the paper and its verl fork uses 1000, at LLM learning
  rates near 1e-6; at this lab's 3e-4 to 1e-2 those would move every entry of W_p by 0.3 or more per update, far past
  any change of the router's. Measured on the tests' micro MoE (docs/routing.md): 0.3 to 3 agree alike, and from 10
  on the predicted route's agreement with the router falls with the multiplier.
- not built: the port's additions beyond the paper (delta clipping, flip fallback, loss re-weighting; off in its
  paper-faithful arm) and its L2 / delta-KL losses.

Logged per update: `routing/predictive_loss` (L_PR2, where it is trained: from the second update of a step on);
`routing/predicted_route_acc`, |Î ∩ I_θ| / k with I_θ the current router's own top-k on h_old, and beside it
`routing/unpredicted_route_acc`, the same of TopK(p_old), the route R3 would have replayed (ranked with the current
router's selection bias for the sigmoid family): whether prediction helps. Means over layers, and per layer.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar, cast

import torch
import torch.nn.functional as F

from algos.routing_variants.base import ROUTING_VARIANTS, RoutingVariant, VariantNeeds
from models.routing.families import router_top_k, router_weight, selection_scores
from models.routing.predictor import add_predictors, predicted_logits
from models.routing.trace import RoutingTrace

LOSS, PREDICTED_ACC, UNPREDICTED_ACC = (
    "routing/predictive_loss",
    "routing/predicted_route_acc",
    "routing/unpredicted_route_acc",
)


def predictive_kl(current: torch.Tensor, predicted: torch.Tensor) -> torch.Tensor:
    """`[T]` fp32: KL(softmax(current) ‖ softmax(predicted)) of each token's `[T, E]` logits, in log space; `current`
    is a stop-gradient teacher."""
    target = torch.log_softmax(current.detach().float(), dim=-1)
    return F.kl_div(torch.log_softmax(predicted.float(), dim=-1), target, reduction="none", log_target=True).sum(-1)


def topk_agreement(route: torch.Tensor, reference: torch.Tensor) -> torch.Tensor:
    """`[T]` fp32: the share of each token's experts in `route [T, K]` that `reference [T, K]` chose too."""
    return (route.long().unsqueeze(-1) == reference.long().unsqueeze(-2)).any(-1).float().mean(-1)


@dataclass(frozen=True)
class PredictorFit:
    """The predictors' fit on one minibatch: `loss`, what the update adds to its loss (0 where it is not `trained`),
    and `sums [4, L]` (float64, over this rank's routed tokens, per MoE layer): Σ KL, Σ agreement of the engine's
    predicted route and of TopK(p_old) with the current router's own top-k, and the tokens."""

    loss: torch.Tensor | float
    trained: bool
    sums: torch.Tensor

    def metrics(self, summed: Callable[[torch.Tensor], torch.Tensor]) -> dict[str, float]:
        """Means over every rank's tokens (`summed` adds over ranks), per layer and over layers; the loss where it
        was trained."""
        kl, predicted, unpredicted, tokens = summed(self.sums)
        tokens = tokens.clamp_min(1)
        means = {PREDICTED_ACC: predicted / tokens, UNPREDICTED_ACC: unpredicted / tokens}
        if self.trained:
            means[LOSS] = kl / tokens
        metrics = {}
        for name, per_layer in means.items():
            metrics[name] = float(per_layer.sum() if name == LOSS else per_layer.mean())
            metrics.update({f"{name}/layer_{layer}": float(value) for layer, value in enumerate(per_layer)})
        return metrics


@ROUTING_VARIANTS.register("predictive")
@dataclass(frozen=True)
class Predictive(RoutingVariant):
    replay_modes: ClassVar[tuple[str, ...]] = ("r3",)
    replay_modes_why: ClassVar[str] = "replays the route the engine predicted, which only the engine's recording holds"
    needs: ClassVar[VariantNeeds] = VariantNeeds(predicted_routes=True)

    # The predictors' learning rate as a multiple of trainer.lr: 1 moves W_p about as fast as the routers move (the
    # paper's 1e4 is at LLM learning rates near 1e-6; module docstring).
    lr_scale: float = 1.0

    def validate(self) -> None:
        if not (math.isfinite(self.lr_scale) and self.lr_scale > 0):
            self._fail(
                f"lr_scale={self.lr_scale} must be a finite number > 0 (the predictors' learning rate as a "
                "multiple of trainer.lr)"
            )

    def start(self, model: torch.nn.Module) -> None:
        add_predictors(model)

    @property
    def predictor_lr_scale(self) -> float:
        return self.lr_scale

    def fit(
        self, routers: list[torch.nn.Module], trace: RoutingTrace, train: bool, tokens: float, ranks: int
    ) -> PredictorFit:
        """Fit the predictors of `routers` (the trainer's, in layer order) on the engine's recorded states in `trace`
        (the minibatch's), with gradient when `train`. `tokens`: the minibatch's routed tokens over every rank (the
        mean's denominator); `ranks`: how many ranks' gradients the data-parallel reduction averages (the loss is
        scaled back by it, as `algos.aggregation.Totals` does)."""
        routed = trace.recorded()
        # predicts_routes: the engine records the routers' states in every trace of this run.
        recorded_inputs, recorded_logits = cast(torch.Tensor, trace.inputs), cast(torch.Tensor, trace.logits)
        losses, sums = [], []
        for layer, router in enumerate(routers):
            device, dtype = router_weight(router).device, router_weight(router).dtype
            inputs = recorded_inputs[layer][routed[layer]].to(device, dtype)
            old = recorded_logits[layer][routed[layer]].to(device)
            with torch.no_grad():
                current, _, own = router(inputs)
                unpredicted = selection_scores(router, old).topk(router_top_k(router), dim=-1).indices
            with torch.set_grad_enabled(train):
                kl = predictive_kl(current, predicted_logits(router, inputs, old))
            losses.append(kl.sum())
            predicted = trace.experts[layer][routed[layer]].to(device)
            sums.append(
                torch.stack(
                    [
                        kl.detach().sum(),
                        topk_agreement(predicted, own).sum(),
                        topk_agreement(unpredicted, own).sum(),
                        routed[layer].sum().to(kl),
                    ]
                ).double()
            )
        loss = torch.stack(losses).sum() * ranks / max(tokens, 1.0) if train else 0.0
        return PredictorFit(loss, train, torch.stack(sums, dim=1))
