"""Routing variants (`routing_variant=`): full replay, soft replay and router-shift weighting against hand-computed
values, their extremes against the switches they interpolate (bit for bit), every objective through them, and the
combinations they refuse."""

from __future__ import annotations

import contextlib
import copy
import math
import re
from dataclasses import dataclass, fields
from pathlib import Path
from types import SimpleNamespace
from typing import ClassVar

import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from algos import OBJECTIVES, build_objective
from algos.corrections import build_correction
from algos.objective import POLICY_LOSS, TOKEN_RATIO_VAR
from algos.routing_variants import ROUTING_VARIANTS, RoutingVariant, VariantNeeds, build_routing_variant
from algos.routing_variants.full_replay import GateReplay
from algos.routing_variants.predictive import LOSS as PREDICTIVE_LOSS
from algos.routing_variants.predictive import PREDICTED_ACC
from algos.routing_variants.router_shift import DEVIATION as SHIFT_DEVIATION
from algos.routing_variants.router_shift import FLOOR_FRAC as SHIFT_FLOOR_FRAC
from algos.routing_variants.router_shift import WEIGHT as SHIFT_WEIGHT
from algos.routing_variants.router_shift import KeepOwnRouting, router_shift
from algos.routing_variants.soft_replay import KEPT as SOFT_REPLAY_KEPT
from algos.routing_variants.soft_replay import SoftReplayRule, fill_rejected, kept_experts
from experiments.config import register_configs
from experiments.step.engines import HFEngine, Sampling
from experiments.step.metrics import DRIFT_PER_UPDATE, GRAD_NORM, REWARD, per_layer
from experiments.step.scoring import FED, ScoreOptions, score_responses
from experiments.train import RLTrainer, train
from models.registry import ConfigError
from models.routing.flips import flip_routing
from models.routing.hooks import ReplayedRoutes, record_routing, replay_routing
from models.routing.trace import find_routers
from tests.test_objectives import batch_from_ratios, loss_and_grad
from tests.test_routing import _batch, _forward, _perturb_routers, _record_then_perturb
from tests.test_train import compose_train, first_step_inputs, read_metrics

CONF = Path(__file__).resolve().parents[1] / "conf"
ROUTER = SimpleNamespace(norm_topk_prob=True)  # what the rules read of a router: whether its family renormalises


def _routes(experts: list[list[int]], weights: torch.Tensor | None = None) -> ReplayedRoutes:
    return ReplayedRoutes(torch.tensor(experts), weights, None)


# -- soft replay by hand ------------------------------------------------------------------------------------------


def test_soft_replay_keeps_by_rank_or_probability_and_fills_from_the_routers_ranking():
    probs = torch.tensor(
        [
            [0.30, 0.25, 0.20, 0.12, 0.08, 0.05],  # ranked 0 1 2 3 4 5
            [0.05, 0.10, 0.15, 0.20, 0.22, 0.28],  # ranked 5 4 3 2 1 0
            [0.30, 0.25, 0.20, 0.12, 0.08, 0.05],
        ]
    )
    replayed = torch.tensor([[3, 5], [4, 1], [4, 5]])
    # top-(k+1) = top-3; or at least 0.1. Token 0: expert 3 is 4th but has 0.12; token 1: 4 is 2nd, 1 has 0.10.
    keep = kept_experts(probs, replayed, top_margin=1, min_prob=0.1)
    assert keep.tolist() == [[True, False], [True, True], [False, False]]
    assert kept_experts(probs, replayed, top_margin=1, min_prob=None).tolist() == [
        [False, False],
        [True, False],
        [False, False],
    ]
    # A rejected slot takes the router's own choice, then its ranking, skipping what is chosen: token 0 keeps 3 and
    # gets 0; token 2 gets the router's own two.
    own = probs.topk(2, dim=-1).indices
    assert fill_rejected(probs, own, replayed, keep).tolist() == [[3, 0], [4, 1], [0, 1]]
    one_kept = torch.tensor([[False, True]])
    assert fill_rejected(probs[:1], own[:1], torch.tensor([[2, 5]]), one_kept).tolist() == [[0, 5]]
    # A rejected expert the router itself chose is its choice again; an own choice changed by flips comes first.
    assert fill_rejected(probs[:1], own[:1], torch.tensor([[0, 5]]), one_kept).tolist() == [[0, 5]]
    flipped = torch.tensor([[2, 3]])
    assert fill_rejected(probs[:1], flipped, torch.tensor([[1, 5]]), one_kept).tolist() == [[2, 5]]
    assert fill_rejected(probs[:1], flipped, torch.tensor([[1, 5]]), torch.tensor([[False, False]])).tolist() == [
        [2, 3]
    ]


def test_soft_replay_gates_and_their_gradient_by_hand():
    """One token, E = 4: replayed (2, 3), only expert 2 passes min_prob = 0.1, slot 1 takes the router's best (0).
    The gates are the softmax over the chosen experts' logits, so d(c·w)/dz_j = w_j (c_j − c·w) on them, 0
    elsewhere."""
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0]], requires_grad=True)
    own = torch.tensor([[0, 1]])
    own_weights = torch.softmax(logits, -1).gather(-1, own)
    rule = SoftReplayRule(top_margin=0, min_prob=0.1)
    gates, chosen = rule(0, ROUTER, logits, own_weights / own_weights.sum(), own, _routes([[2, 3]]), first=True)
    assert chosen.tolist() == [[2, 0]]
    z = logits.detach()[0]
    expected = torch.exp(z[[2, 0]]) / torch.exp(z[[2, 0]]).sum()
    torch.testing.assert_close(gates[0], expected)
    c = torch.tensor([1.0, 3.0])
    (grad,) = torch.autograd.grad((gates[0] * c).sum(), logits)
    by_hand = torch.zeros(4)
    by_hand[[2, 0]] = expected * (c - (c * expected).sum())
    torch.testing.assert_close(grad[0], by_hand)
    assert (int(rule.kept[0]), int(rule.replayed[0])) == (1, 2)


def test_gate_replay_takes_the_recorded_gates_and_gives_the_router_no_gradient():
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0], [0.0, 0.1, 0.2, 0.3]], requires_grad=True)
    own = torch.tensor([[0, 1], [3, 2]])
    own_weights = torch.softmax(logits, -1).gather(-1, own)
    recorded = torch.tensor([[0.7, 0.3], [0.0, 0.0]])
    gates, chosen = GateReplay()(0, ROUTER, logits, own_weights, own, _routes([[2, 3], [-1, -1]], recorded), True)
    assert chosen.tolist() == [[2, 3], [3, 2]], "a token without a route keeps the router's choice"
    torch.testing.assert_close(gates[0], recorded[0])
    (grad,) = torch.autograd.grad(gates[0].sum() * 2.0, logits)
    assert torch.count_nonzero(grad) == 0


# -- router shift by hand -----------------------------------------------------------------------------------------


def test_router_shift_by_hand():
    """L = 2, K = 2, three tokens, the last one padding. d^ℓ = mean_k |Δ log r|, Δ = mean_ℓ d^ℓ,
    γ̃ = max(e^{−Δ}, 0.8)."""
    old = torch.log(
        torch.tensor([[[[0.5, 0.3], [0.4, 0.4], [0.9, 0.05]]], [[[0.6, 0.2], [0.4, 0.4], [0.5, 0.5]]]])
    )  # [L, B, T, K]
    new = torch.log(torch.tensor([[[[0.5, 0.3], [0.2, 0.4], [0.1, 0.9]]], [[[0.6, 0.1], [0.1, 0.4], [0.9, 0.1]]]]))
    mask = torch.tensor([[True, True, False]])
    shift = router_shift(new, old, mask, floor=0.8)
    half_ln2, ln2 = math.log(2) / 2, math.log(2)
    torch.testing.assert_close(shift.deviation[:, 0], torch.tensor([[0.0, half_ln2, 0.0], [half_ln2, ln2, 0.0]]))
    delta = [half_ln2 / 2, (half_ln2 + ln2) / 2]  # e^{-Δ}: 0.841 (kept), 0.595 (floored to 0.8)
    torch.testing.assert_close(shift.log_weight, torch.tensor([[-delta[0], math.log(0.8), 0.0]]))
    assert shift.floored.tolist() == [[False, True, False]]
    metrics = shift.metrics(mask)
    assert metrics[SHIFT_WEIGHT] == pytest.approx((math.exp(-delta[0]) + 0.8) / 2)
    assert metrics[SHIFT_FLOOR_FRAC] == pytest.approx(0.5)
    assert metrics[SHIFT_DEVIATION] == pytest.approx(sum(delta) / 2)
    assert metrics[per_layer(SHIFT_DEVIATION, 1)] == pytest.approx((half_ln2 + ln2) / 2)
    unfloored = router_shift(new, old, mask, floor=0.0)
    assert unfloored.log_weight[0, 1] == pytest.approx(-delta[1]) and not unfloored.floored.any()


def test_router_shift_scales_the_ratio_before_grpos_clip():
    """GRPO (clip 0.8 / 1.27) on r̃ = γ̃·r: token (1, 0) has r = 0.9 inside the band but r̃ = 0.72 below it, so it
    clips; unclipped tokens get −Â·r̃ / (|y|·B)."""
    inputs = batch_from_ratios([[1.1, 1.5], [0.9, 1.0]], [1.0, -1.0], width=2)
    gamma = torch.tensor([[0.9, 1.0], [0.8, 0.95]])
    out, grad = loss_and_grad(build_objective("grpo"), {**inputs, "old_logp": inputs["old_logp"] - torch.log(gamma)})
    torch.testing.assert_close(grad, torch.tensor([[-0.99 / 4, 0.0], [0.0, 0.95 / 4]]))
    assert out.loss.item() == pytest.approx(((-0.99 - 1.27) / 2 + (0.8 + 0.95) / 2) / 2, rel=1e-5)
    _, plain = loss_and_grad(build_objective("grpo"), inputs)
    assert plain[1, 0] == pytest.approx(0.9 / 4), "without the factor the token is inside the band"


def test_router_shift_enters_gspos_sequence_ratio_as_a_geometric_mean():
    inputs = batch_from_ratios([[1.0002, 1.0]], [1.0], width=2)
    gamma = torch.tensor([[1.0, 0.9995]])
    out, grad = loss_and_grad(build_objective("gspo"), {**inputs, "old_logp": inputs["old_logp"] - torch.log(gamma)})
    s = math.sqrt(1.0002 * 0.9995)  # inside GSPO's (1 − 3e-4, 1 + 4e-4): unclipped, loss −Â·s̃
    assert out.loss.item() == pytest.approx(-s, rel=1e-6)
    torch.testing.assert_close(grad, torch.full((1, 2), -s / 2))


# -- the variants on a real (micro) MoE -------------------------------------------------------------------------


def test_soft_replay_at_its_extremes_is_id_replay_and_no_replay_bit_for_bit(micro_policy):
    model, tokenizer = micro_policy
    ids, mask, old = _record_then_perturb(model, tokenizer)
    valid = mask.bool()

    def logits(rule=None, replay=True):
        with torch.no_grad(), replay_routing(model, old, rule) if replay else contextlib.nullcontext():
            return _forward(model, ids, mask).logits[valid]

    replayed, free = logits(), logits(replay=False)
    assert not torch.equal(replayed, free), "the perturbed routers must route otherwise than the trace"
    assert torch.equal(logits(SoftReplayRule(top_margin=2, min_prob=0.0)), replayed)
    assert torch.equal(logits(SoftReplayRule(top_margin=None, min_prob=2.0)), free)
    assert torch.equal(logits(SoftReplayRule(top_margin=None, min_prob=None)), free)

    # With synthetic flips replay still overrides them, and keeping nothing is the flipped forward.
    def flipped(rule=None, replay=True):
        with flip_routing(model, 0.5, torch.Generator().manual_seed(0)):
            return logits(rule, replay)

    assert torch.equal(flipped(SoftReplayRule(top_margin=2, min_prob=0.0)), flipped())
    assert torch.equal(flipped(SoftReplayRule(top_margin=None, min_prob=None)), flipped(replay=False))
    assert not torch.equal(flipped(replay=False), free)
    between = SoftReplayRule(top_margin=1, min_prob=None)
    middle = logits(between)
    kept = sum(int(n) for n in between.kept.values()) / sum(int(n) for n in between.replayed.values())
    assert 0.0 < kept < 1.0
    assert not torch.equal(middle, replayed) and not torch.equal(middle, free)


def test_full_replay_reproduces_the_recorded_forward_and_cuts_the_routers_gradient(micro_policy):
    model, tokenizer = micro_policy
    ids, mask = _batch(tokenizer)
    valid = mask.bool()
    with record_routing(model, gates=True) as recording:
        recorded = _forward(model, ids, mask).logits[valid]
    trace = recording.trace
    with replay_routing(model, trace, GateReplay()):
        torch.testing.assert_close(_forward(model, ids, mask).logits[valid], recorded, rtol=0, atol=0)
    for rule, router_learns in ((GateReplay(), False), (None, True)):
        model.zero_grad()
        with replay_routing(model, trace, rule):
            _forward(model, ids, mask).logits[valid].logsumexp(-1).sum().backward()
        for router in find_routers(model).values():
            assert bool(torch.count_nonzero(router.weight.grad)) is router_learns
    # The routers no longer matter: move them (or flip every expert), and the replayed forward computes what was
    # recorded, to the rounding of expert matmuls over other row counts (padding, which has no route, moves).
    _perturb_routers(model)
    with torch.no_grad(), replay_routing(model, trace, GateReplay()):
        torch.testing.assert_close(_forward(model, ids, mask).logits[valid], recorded, rtol=0, atol=1e-6)
    with (
        torch.no_grad(),
        flip_routing(model, 1.0, torch.Generator().manual_seed(0)),
        replay_routing(model, trace, GateReplay()),
    ):
        torch.testing.assert_close(_forward(model, ids, mask).logits[valid], recorded, rtol=0, atol=1e-6)


def test_a_trace_without_gates_cannot_be_replayed_with_them(micro_policy):
    model, tokenizer = micro_policy
    ids, mask = _batch(tokenizer)
    with record_routing(model) as recording:
        _forward(model, ids, mask)
    with pytest.raises(ValueError, match="GateReplay replays gate weights, and this routing trace was recorded"):
        with replay_routing(model, recording.trace, GateReplay()):
            pass


def test_the_engine_records_the_gates_a_scoring_forward_computes(micro_policy):
    model, tokenizer = micro_policy
    torch.manual_seed(0)
    samples = HFEngine(model, tokenizer).sample(
        ["12+34=", "7+8="], Sampling(3, 4, 1.0, record_routing=True, record_gates=True)
    )
    with torch.no_grad():
        scored = score_responses(model, samples, 1.0, ScoreOptions(record=True, record_gates=True))
    engine = samples.routes.positions(FED)
    valid = samples.attention_mask[:, FED].bool()
    assert torch.equal(engine.experts[:, valid], scored.routes.experts[:, valid])
    for part in ("weights", "logprobs"):
        torch.testing.assert_close(
            getattr(engine, part)[:, valid], getattr(scored.routes, part)[:, valid], rtol=0, atol=1e-5
        )
    assert (engine.weights[:, ~valid] == 0).all()


# -- through the RL loop ------------------------------------------------------------------------------------------


def _metrics(tmp_path, name, *overrides):
    train(compose_train("trainer.steps=2", "trainer.threads=1", *overrides), tmp_path / name)
    return read_metrics(tmp_path / name)


def test_soft_replay_in_the_loop_at_its_extremes_is_r2_and_no_replay(tmp_path):
    r2 = _metrics(tmp_path, "r2", "routing.replay=r2")
    everything = _metrics(
        tmp_path, "all", "routing.replay=r2", "routing_variant=soft_replay", "routing_variant.min_prob=0"
    )
    none = _metrics(tmp_path, "none", "trainer.pi_old=decoupled")
    nothing = _metrics(
        tmp_path, "nothing", "routing.replay=r2", "routing_variant=soft_replay", "routing_variant.top_margin=null"
    )
    assert everything[1][SOFT_REPLAY_KEPT] == 1.0 and nothing[1][SOFT_REPLAY_KEPT] == 0.0
    for key in (POLICY_LOSS, TOKEN_RATIO_VAR, DRIFT_PER_UPDATE, REWARD):
        assert everything[1][key] == r2[1][key], key
        assert nothing[1][key] == none[1][key], key
    assert everything[1][POLICY_LOSS] != nothing[1][POLICY_LOSS]


def test_full_replay_leaves_the_routers_to_the_load_balancing_loss():
    """The policy loss reaches no router through recorded gates: after a step of full replay (r2, and r3 whose first
    minibatch replays the engine's gates too) the routers are where they were; with ID replay, or with the
    load-balancing loss, they move."""

    def routers_moved(*overrides):
        trainer = RLTrainer(compose_train("trainer.lr=5e-2", *overrides))
        before = [router.weight.detach().clone() for router in find_routers(trainer.model).values()]
        trainer.step()
        after = [router.weight for router in find_routers(trainer.model).values()]
        return any(not torch.equal(a, b) for a, b in zip(before, after))

    assert not routers_moved("routing.replay=r2", "routing_variant=full_replay")
    assert not routers_moved("routing.replay=r3", "routing_variant=full_replay")
    assert routers_moved("routing.replay=r2")
    assert routers_moved(
        "routing.replay=r2", "routing_variant=full_replay", "routers=[aux_loss]", "routers.aux_loss.coef=0.05"
    )


def _router_logprobs(model, mb) -> torch.Tensor:
    """`[L, N, S, E]` log-softmax of every router's logits over a minibatch fed row by row (hooks of its own)."""
    found = []
    handles = [
        router.register_forward_hook(lambda module, args, out: found.append(out[0].detach()))
        for router in find_routers(model).values()
    ]
    with torch.no_grad():
        score_responses(model, mb, 1.0)
    for handle in handles:
        handle.remove()
    n, width = mb.input_ids.shape
    return torch.stack([torch.log_softmax(logits.float(), -1).reshape(n, width - 1, -1) for logits in found])


def test_router_shift_hands_the_objective_pi_old_over_the_factor_recomputed_from_the_routers(monkeypatch):
    trainer = RLTrainer(
        compose_train(
            "routing_variant=router_shift",
            "routing_variant.floor=0.5",
            "trainer.minibatch_layout=rows",
            "trainer.lr=5e-2",
        )
    )
    _, _, minibatches, old = first_step_inputs(trainer)
    theta_old = copy.deepcopy(trainer.model)
    seen = []
    objective = trainer.objective

    def spy(logp, inputs, totals=None):  # what the objective is given, by name
        seen.append({"logp": logp, **vars(inputs)})
        return objective(logp, inputs, totals)

    monkeypatch.setattr(trainer, "objective", spy)
    first = trainer.update(minibatches[0], old[0])
    assert first[SHIFT_WEIGHT] == 1.0 and torch.equal(seen[0]["old_logp"], seen[0]["logp"].detach())
    mb = minibatches[1]
    before, now = _router_logprobs(theta_old, mb), _router_logprobs(trainer.model, mb)
    chosen = before.topk(2, dim=-1).indices  # θ_old's experts
    P, T = mb.prompt_width, mb.response_mask.shape[1]
    gap = (now.gather(-1, chosen) - before.gather(-1, chosen)).abs().mean(-1).mean(0)[:, P - 1 : P - 1 + T]
    expected = torch.where(mb.response_mask, old[1].logp + gap.clamp(max=-math.log(0.5)), old[1].logp)
    later = trainer.update(mb, old[1])
    assert gap[mb.response_mask].mean() > 0.05, "the update must move the routers for the check to mean anything"
    torch.testing.assert_close(seen[1]["old_logp"], expected, rtol=0, atol=1e-5)
    assert 0.5 <= later[SHIFT_WEIGHT] < 1.0


@pytest.mark.parametrize(
    "overrides",
    [
        ("routing.replay=r2", "routing_variant=full_replay"),
        ("routing.replay=r3", "routing_variant=soft_replay"),
        ("routing_variant=router_shift",),
        ("routing.replay=r3", "routing_variant=predictive"),
    ],
)
def test_every_objective_composes_with_every_variant(overrides):
    trainer = RLTrainer(compose_train("trainer.lr=5e-2", *overrides))
    _, _, minibatches, old = first_step_inputs(trainer)
    variant = trainer.variant.name
    start = copy.deepcopy((trainer.model.state_dict(), trainer.optimizer.state_dict()))
    for name in sorted(OBJECTIVES):
        trainer.model.load_state_dict(start[0])
        trainer.optimizer.load_state_dict(start[1])
        trainer.objective = build_objective(name)
        for mb, old_policy in zip(minibatches, old):
            metrics = trainer.update(mb, old_policy)
            assert math.isfinite(metrics[POLICY_LOSS]) and math.isfinite(metrics[GRAD_NORM]), (name, variant)
        if variant == "soft_replay":
            assert 0.0 < metrics[SOFT_REPLAY_KEPT] <= 1.0
        if variant == "router_shift":
            assert 0.8 <= metrics[SHIFT_WEIGHT] <= 1.0
        if variant == "predictive":
            assert math.isfinite(metrics[PREDICTIVE_LOSS]) and 0.0 <= metrics[PREDICTED_ACC] <= 1.0


# -- configuration and refusals -----------------------------------------------------------------------------------


def test_every_yaml_only_selects_its_variant_whose_defaults_compose():
    paths = sorted((CONF / "routing_variant").glob("*.yaml"))
    assert sorted(path.stem for path in paths) == sorted(ROUTING_VARIANTS)
    register_configs()
    for path in paths:
        name = path.stem
        assert OmegaConf.to_container(OmegaConf.load(path)) == {"defaults": [f"/schema/routing_variant/{name}@_here_"]}
        with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
            config = OmegaConf.to_container(compose("train", overrides=[f"routing_variant={name}"]).routing_variant)
        assert config.pop("name") == name
        assert config == {f.name: f.default for f in fields(ROUTING_VARIANTS[name])}, path.name


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            ["routing_variant=full_replay"],
            "routing_variant=full_replay replays the gate weights of a replayed routing: use routing.replay=r2 or r3, "
            "not "
            "none",
        ),
        (
            ["routing_variant=soft_replay"],
            "routing_variant=soft_replay keeps some of a replayed routing's experts: use routing.replay=r2 or r3, not "
            "none",
        ),
        (
            ["routing_variant=router_shift", "routing.replay=r3"],
            "routing_variant=router_shift weighs each token's ratio by how far the router moved, instead of replaying: "
            "use routing.replay=none, not r3",
        ),
        (
            ["routing_variant=router_shift", "trainer.pi_old=bypass"],
            "trainer.pi_old=bypass with routing_variant=router_shift: it compares the router with θ_old's",
        ),
        (
            [
                "routing_variant=router_shift",
                "model=tiny_dense",
                "model.hidden_size=32",
                "model.num_hidden_layers=2",
                "model.head_dim=8",
                "model.intermediate_size=64",
            ],
            "routing_variant=router_shift changes how MoE routers route or weigh tokens, and model 'micro_moe' has no "
            "MoE layers",
        ),
        (
            ["routing.replay=r2", "routing_variant=soft_replay", "routing_variant.top_margin=-1"],
            "routing_variant=soft_replay top_margin=-1 must be >= 0",
        ),
        (
            ["routing_variant=router_shift", "routing_variant.floor=1.5"],
            "routing_variant=router_shift floor=1.5 must be in [0, 1]",
        ),
    ],
)
def test_what_a_variant_cannot_serve_is_refused_in_one_line(tmp_path, overrides, message):
    with pytest.raises(SystemExit) as raised:
        train(compose_train(*overrides), tmp_path)
    text = str(raised.value)
    assert message in text and "\n" not in text


def test_r3_full_replay_needs_an_engine_that_reports_gate_weights(tmp_path, monkeypatch):
    from experiments.step.engines.vllm import VLLMEngine

    assert not VLLMEngine.returns_gate_weights, "vLLM returns the routed experts' ids only"
    monkeypatch.setattr(HFEngine, "returns_gate_weights", VLLMEngine.returns_gate_weights)  # vLLM, as the check sees it
    monkeypatch.setattr(HFEngine, "name", VLLMEngine.name)
    with pytest.raises(SystemExit) as raised:
        train(compose_train("routing.replay=r3", "routing_variant=full_replay"), tmp_path)
    assert str(raised.value) == (
        "moe-rl-lab: routing_variant=full_replay with routing.replay=r3 replays the engine's gate weights, and "
        "rollout.engine=vllm reports the experts' ids only: use rollout.engine=hf or routing.replay=r2"
    )


def test_replay_rules_that_keep_the_routers_choice_change_nothing(micro_policy):
    model, tokenizer = micro_policy
    ids, mask, old = _record_then_perturb(model, tokenizer)
    with torch.no_grad():
        free = _forward(model, ids, mask).logits
        with replay_routing(model, old, KeepOwnRouting(), score_replayed=True) as replay:
            kept = _forward(model, ids, mask).logits
    assert torch.equal(kept, free)
    scored, valid = replay.replayed_logprobs, mask.bool()
    assert scored.shape == old.shape and (scored[:, ~valid] == 0).all()
    assert (scored[:, valid] <= 0).all() and (scored[:, valid] < 0).any()


def test_a_checkpoint_from_before_routing_variants_resumes_as_none_and_no_other_variant():
    from experiments.run.resume import differences, settings

    none = compose_train("routing.replay=r2")
    before_variants = {key: value for key, value in settings(none).items() if not key.startswith("routing_variant.")}
    soft = compose_train("routing.replay=r2", "routing_variant=soft_replay")
    assert differences(before_variants, none) == []
    assert settings(soft)["routing_variant.top_margin"] == 2
    assert {difference.key for difference in differences(before_variants, soft)} >= {
        "routing_variant.name",
        "routing_variant.top_margin",
    }


def test_the_documented_example_routing_variant_replays_the_first_layers_only(micro_policy):
    """`Add a routing variant` in docs/extending.md is code a newcomer copies: it must run as printed."""
    from tests.test_routing import ExpertsSpy

    readme = (Path(__file__).resolve().parents[1] / "docs" / "extending.md").read_text(encoding="utf-8")
    section = readme.split("## Add a routing variant", 1)[1]
    code = section.split("```python\n", 1)[1].split("```", 1)[0]
    try:
        # dont_inherit: the recipe's module has no `from __future__ import annotations`, this one does
        exec(compile(code, "docs/extending.md", "exec", dont_inherit=True), {"__name__": "readme_example"})
        variant = build_routing_variant("shallow_replay", layers=1)
        model, tokenizer = micro_policy
        ids, mask, old = _record_then_perturb(model, tokenizer)
        spy = ExpertsSpy(model)
        with torch.no_grad(), replay_routing(model, old, variant.replay_rule()) as replay:
            _forward(model, ids, mask)
        spy.remove()
        L, B, S, K = old.shape
        valid = mask.reshape(-1).bool()
        used, own = spy.used()[:, valid], replay.router_choice.experts.reshape(L, B * S, K)[:, valid].long()
        assert torch.equal(used[0], old.experts[0].reshape(B * S, K)[valid].long()), "layer 0 is replayed"
        assert torch.equal(used[1], own[1]) and not torch.equal(own[1], old.experts[1].reshape(B * S, K)[valid].long())
        with pytest.raises(
            ConfigError,
            match="routing_variant=shallow_replay replays the first layers of a replayed "
            "routing: use routing.replay=r2 or r3, not none",
        ):
            variant.check("none", "micro_moe", True)
        with pytest.raises(ConfigError, match="layers=-1 must be >= 0"):
            build_routing_variant("shallow_replay", layers=-1)
    finally:
        ROUTING_VARIANTS._classes.pop("shallow_replay", None)


@pytest.mark.parametrize(
    "needs, overrides, served, refusal",
    [
        (
            VariantNeeds(old_router=True),
            (),
            {"pi_old": "decoupled", "pi_old_records_gates": True, "reads_old_router": True},
            ("trainer.pi_old=bypass", "trainer.pi_old=bypass with routing_variant=watching: it compares the router"),
        ),
        (
            VariantNeeds(predicted_routes=True),
            ("routing.replay=r3", "trainer.minibatches=2"),
            {"engine_predicts_routes": True, "reads_old_router": False},
            ("trainer.minibatches=1", "routing_variant=watching trains its predictors from the second minibatch"),
        ),
        (
            VariantNeeds(gate_weights=True),
            ("routing.replay=r3",),
            {"engine_records_gates": True, "pi_old_records_gates": False},
            ("vllm", "routing_variant=watching with routing.replay=r3 replays the engine's gate weights, and "),
        ),
    ],
    ids=["old_router", "predicted_routes", "gate_weights"],
)
def test_a_new_variant_is_served_and_refused_by_the_needs_it_declares(needs, overrides, served, refusal, monkeypatch):
    """A variant no module knows by name, declaring one need: the plan serves it (where π_old comes from, what the
    engine and the π_old pass record) and the start-up checks refuse what cannot serve it, naming the variant: the
    declaration is all a variant writes for it."""
    from experiments.step.checks import check_predictors, engine_needs
    from experiments.step.engines.vllm import VLLMEngine
    from experiments.step.plan import plan_step
    from experiments.step.sources import ROLLOUT_SOURCES

    @dataclass(frozen=True)
    class Watching(RoutingVariant):
        name: ClassVar[str] = "watching"

    monkeypatch.setattr(Watching, "needs", needs)
    cfg = compose_train(*overrides)
    source = ROLLOUT_SOURCES["synchronous"]
    plan = plan_step(cfg, True, HFEngine, source, Watching())
    assert {field: str(getattr(plan, field)) for field in served} == {k: str(v) for k, v in served.items()}
    declared_nothing = plan_step(cfg, True, HFEngine, source, build_routing_variant("none"))
    assert any(getattr(declared_nothing, field) != getattr(plan, field) for field in served)
    setting, message = refusal
    with pytest.raises(ConfigError, match=re.escape(message)):
        if setting == "trainer.pi_old=bypass":
            plan_step(compose_train(*overrides, setting), True, HFEngine, source, Watching())
        elif setting == "trainer.minibatches=1":
            check_predictors(plan_step(compose_train(*overrides, setting), True, HFEngine, source, Watching()), 1)
        else:
            monkeypatch.setattr(HFEngine, "returns_gate_weights", VLLMEngine.returns_gate_weights)
            monkeypatch.setattr(HFEngine, "name", VLLMEngine.name)
            HFEngine.check(cfg, 1, engine_needs(plan, build_objective("grpo"), build_correction("none")))
