"""How every RL step of a run gets its numbers: decided once at start-up, recorded in `summary.json`, read by the step.

Where π_old (the denominator of the importance ratios) comes from, how the batch is split into minibatches, what
the engine and the trainer's π_old pass must record: each decision is made here from the settings and what the
parts can do, and a combination that cannot be served is refused in one line (`ConfigError`) with what to use.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from experiments.step.engines.base import RolloutEngine
from models.grouped_attention import NAME as PACKED_ATTENTION
from models.registry import ConfigError


class Replay(StrEnum):
    """Routing Replay (GSPO paper §5.3; Ma et al., arXiv 2510.11370)."""

    none = "none"
    r2 = "r2"  # replay θ_old's routing, recorded by the trainer in its π_old pass
    r3 = "r3"  # replay the rollout engine's routing, recorded while it sampled


class PiOld(StrEnum):
    """Where π_old, the denominator of the importance ratios, comes from (verl's names)."""

    auto = "auto"  # bypass when the engine is the trainer's own model and no replay needs the trainer's pass
    bypass = "bypass"  # π_old := μ_old, the rollout engine's own log-probs: no extra forward
    decoupled = "decoupled"  # the trainer recomputes π_old at θ_old, without gradient, in the training shapes


class Layout(StrEnum):
    """How the rollout batch splits into minibatches and how they are fed to the model."""

    auto = "auto"  # groups where possible (prompts divide into the minibatches, packed attention), else rows
    groups = "groups"  # whole groups per minibatch, each fed as one packed sequence (its prompt once)
    rows = "rows"  # completions shuffled across groups, every row fed in full (TRL's layout)


@dataclass(frozen=True)
class StepPlan:
    """How every RL step of a run gets its numbers (the module docstring); the step reads these fields only."""

    replay: Replay
    pi_old: PiOld  # bypass or decoupled (auto resolved)
    why: str  # one sentence on where π_old comes from
    layout: Layout  # groups or rows (auto resolved)
    track_routing: bool  # measure θ's routing against θ_old's in every update
    engine_is_trainer: bool  # the engine samples with the trainer's own module: μ_old is π_old's own numbers
    # π_old of the first minibatch is its own update forward: θ = θ_old there, and the same forward is what a
    # recompute would run (or, engine = trainer, what μ_old computed). Not with synthetic flips (the update's forward
    # is then not θ_old's), nor when r2 replays gate weights (the update takes θ_old's gates as recorded constants).
    first_minibatch_on_policy: bool
    engine_records_routing: bool  # r3 replays it; under bypass it is θ_old's routing; else compared with the trainer's
    engine_records_gates: bool  # r3 replays the engine's gate weights too (full replay)
    # the engine routes by the routers' predictors and records their inputs and logits (Predictive Routing Replay)
    engine_predicts_routes: bool
    # the engine's routing, where it is θ_old's (bypass) or compared with it, comes with its gate weights when the
    # engine reports them: the drift by gate mass reads them (`metrics.GATE_DRIFT`)
    engine_gates_measured: bool
    pi_old_records_gates: bool  # the π_old pass records θ_old's gates: r2 replays them, or router shift reads them
    reads_old_router: bool  # the routing variant reads θ_old's router log-probabilities, from the π_old pass
    flip_rate: float = 0.0  # synthetic routing drift in the update forwards (routing.flip_rate)
    perturb_rate: float = 0.0  # synthetic router noise after each optimizer update (routing.perturb_rate)
    routing_variant: str = "none"  # `algos.routing_variants`: what replayed forwards or the ratios do beyond ID replay

    def describe(self) -> dict[str, Any]:
        described = {
            "pi_old": self.pi_old,
            "pi_old_why": self.why,
            "minibatch_layout": self.layout,
            "replay": self.replay,
            "routing_variant": self.routing_variant,
            "first_minibatch_on_policy": self.first_minibatch_on_policy,
        }
        if self.flip_rate:
            described["synthetic_flip_rate"] = self.flip_rate
        if self.perturb_rate:
            described["synthetic_perturb_rate"] = self.perturb_rate
        return described


def plan_step(
    cfg: Any,
    is_moe: bool,
    engine: type[RolloutEngine],
    source: Any,
    variant: Any,
    reads_pi_old: str | None = None,
    world: int = 1,
) -> StepPlan:
    """Decide the step of the run `cfg` on `world` ranks. `engine`: the rollout engine's class; `source`: the rollout
    source's class (`experiments.step.sources.RolloutSource`), which says whether the engine that samples is the
    trainer's own module and how far behind θ_old it samples; `variant`: the routing variant
    (`algos.routing_variants`), whose declared needs (`VariantNeeds`) are read here and nowhere else; `reads_pi_old`:
    what, besides replay, needs the trainer's own π_old (a rollout correction's name), or None."""
    replay = Replay(cfg.routing.replay)
    engine_is_trainer = source.engine_is_trainer(cfg.rollout, engine)
    needs = variant.needs
    pi_old, why = _pi_old(
        PiOld(cfg.trainer.pi_old),
        replay,
        engine_is_trainer,
        engine.returns_logprobs,
        reads_pi_old,
        variant.name if needs.old_router else None,
        source.behind(cfg.rollout),
    )
    track_routing = is_moe and (cfg.routing.metrics or replay != Replay.none or cfg.routing.decompose_every > 0)
    flip_rate = float(cfg.routing.flip_rate)
    own_forward_is_old = pi_old == PiOld.decoupled or engine_is_trainer
    r2_gates = needs.gate_weights and replay == Replay.r2
    return StepPlan(
        replay=replay,
        pi_old=pi_old,
        why=why,
        layout=_layout(cfg, world),
        track_routing=track_routing,
        engine_is_trainer=engine_is_trainer,
        first_minibatch_on_policy=own_forward_is_old and flip_rate == 0 and not r2_gates,
        engine_records_routing=replay == Replay.r3
        or (track_routing and engine.returns_routing and (pi_old == PiOld.bypass or not engine_is_trainer)),
        engine_records_gates=needs.gate_weights and replay == Replay.r3,
        engine_predicts_routes=needs.predicted_routes,
        engine_gates_measured=track_routing and engine.returns_routing and engine.returns_gate_weights,
        pi_old_records_gates=r2_gates or needs.old_router,
        reads_old_router=needs.old_router,
        flip_rate=flip_rate,
        perturb_rate=float(cfg.routing.perturb_rate),
        routing_variant=variant.name,
    )


def _pi_old(
    asked: PiOld,
    replay: Replay,
    engine_is_trainer: bool,
    engine_returns_logprobs: bool,
    reads_pi_old: str | None,
    reads_old_router: str | None,
    behind: str | None,
) -> tuple[PiOld, str]:
    """Where π_old comes from, and why. `behind`: how far behind θ_old the engine samples, as a clause
    (`RolloutSource.behind`), or None where it samples with θ_old itself."""
    if asked == PiOld.bypass and replay == Replay.r2:
        raise ConfigError(
            "trainer.pi_old=bypass with routing.replay=r2: R2 replays θ_old's routing, which only the trainer's own "
            "π_old pass records; use trainer.pi_old=decoupled or auto"
        )
    if asked == PiOld.bypass and reads_pi_old:
        raise ConfigError(
            f"correction={reads_pi_old} weighs tokens by π_old/μ_old, which trainer.pi_old=bypass makes 1 (π_old := "
            "μ_old): use trainer.pi_old=decoupled or auto, or correction=opsm / none"
        )
    if asked == PiOld.bypass and reads_old_router:
        raise ConfigError(
            f"trainer.pi_old=bypass with routing_variant={reads_old_router}: it compares the router with θ_old's, "
            "whose "
            "log-probabilities only the trainer's own π_old pass records; use trainer.pi_old=decoupled or auto"
        )
    also = f"; {behind}" if behind else ""
    if asked == PiOld.decoupled:
        return asked, "asked: the trainer recomputes π_old at θ_old" + also
    if asked == PiOld.bypass:
        return asked, "asked: π_old := μ_old, the engine's log-probs" + (
            f" (naive asynchronous RL){also}" if behind else ""
        )
    if replay == Replay.r2:
        return PiOld.decoupled, "r2 records θ_old's routing in the trainer's π_old pass" + also
    if replay == Replay.r3:
        return PiOld.decoupled, "r3 replays the engine's routing in the trainer's π_old pass" + also
    if reads_old_router:
        return PiOld.decoupled, (
            f"routing_variant={reads_old_router} reads θ_old's router in the trainer's π_old pass" + also
        )
    if behind:
        return PiOld.decoupled, f"{behind}: its numbers are not π_old's"
    if not engine_is_trainer:
        return PiOld.decoupled, "the engine is not the trainer's model: its numbers are not π_old's"
    if not engine_returns_logprobs:
        return PiOld.decoupled, "the engine returns no log-probs: π_old is the trainer's own pass"
    if reads_pi_old:
        return PiOld.decoupled, f"correction={reads_pi_old} weighs tokens by π_old/μ_old"
    return PiOld.bypass, "the engine is the trainer's own model: μ_old is π_old's own numbers, no recompute"


def _layout(cfg: Any, world: int) -> Layout:
    t = cfg.trainer
    packable = cfg.model.attn_implementation == PACKED_ATTENTION
    prompts = t.prompts_per_step // world
    divides = prompts % t.minibatches == 0
    if t.minibatch_layout == Layout.auto:
        return Layout.groups if divides and packable else Layout.rows
    if t.minibatch_layout == Layout.groups and not divides:
        raise ConfigError(
            f"trainer.minibatch_layout=groups puts whole groups in each minibatch, but trainer.minibatches="
            f"{t.minibatches} does not divide trainer.prompts_per_step={t.prompts_per_step}"
            + (f" / {world} ranks" if world > 1 else "")
            + "; use rows or auto"
        )
    if t.minibatch_layout == Layout.groups and not packable:
        raise ConfigError(
            f"trainer.minibatch_layout=groups feeds packed groups, which needs model.attn_implementation="
            f"{PACKED_ATTENTION} (this model uses {cfg.model.attn_implementation!r}); use rows or auto"
        )
    return Layout(t.minibatch_layout)
