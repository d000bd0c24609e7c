"""The sigmoid family (DeepSeek-V3, GLM-4.5: sigmoid scores plus a selection bias, group-limited top-k, a shared
expert) built in code and from a checkpoint: the routing transformers computes, exact replay of experts and gate
weights, the bias that chooses and never weighs, packed scoring, and every objective x replay mode through the loop."""

from __future__ import annotations

import math

import pytest
import torch

from algos import OBJECTIVES
from algos.objective import POLICY_LOSS
from algos.routing_variants.full_replay import GateReplay
from experiments.step.metrics import (
    DRIFT,
    DRIFT_PER_UPDATE,
    ENGINE_EXPERTS,
    GRAD_NORM,
    TOPK_MARGIN_MEDIAN,
    TOPK_MARGIN_SMALL,
    per_layer,
)
from experiments.train import train
from models.policy import ModelConfig, build_policy, describe_policy
from models.routing.families import chosen, has_selection_bias, route
from models.routing.flips import flip_routing
from models.routing.hooks import RouterCalls, record_routing, replay_routing, router_calls
from models.routing.measures import routing_drift
from models.routing.trace import find_routers
from tests.conftest import MICRO_MODEL
from tests.test_routing import _batch, _forward, _perturb_routers
from tests.test_shared_prefix import G, _score
from tests.test_shared_prefix import _batch as _packed_batch
from tests.test_train import compose_train, read_metrics

FAMILIES = ("deepseek_v3", "glm4_moe")
# The micro MoE as the sigmoid family: 8 experts in 4 groups of 2, each token's top-2 within its best 2 groups.
SIGMOID = {"n_group": 4, "topk_group": 2, "qk_rope_head_dim": 4}


def _policy(architecture: str, **options):
    model, tokenizer = build_policy(
        ModelConfig(
            **{**MICRO_MODEL, **SIGMOID, "architecture": architecture, "experts_implementation": "eager", **options}
        )
    )
    return model.eval(), tokenizer


def _move_biases(model, scale=0.5, seed=2):
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for router in find_routers(model).values():
            router.e_score_correction_bias.add_(torch.randn(router.num_experts, generator=generator) * scale)


class RouterSpy:
    """Every router call's input logits and output `(weights, indices)`, and what each experts module received."""

    def __init__(self, model):
        self.calls, self.received = [], []
        self.handles = [
            router.register_forward_hook(lambda module, args, out: self.calls.append((module, out)))
            for router in find_routers(model).values()
        ]
        self.handles += [
            model.get_submodule(name.rsplit(".", 1)[0]).experts.register_forward_pre_hook(
                lambda module, args: self.received.append((args[1].detach().clone(), args[2].detach().clone()))
            )
            for name in find_routers(model)
        ]

    def remove(self):
        for handle in self.handles:
            handle.remove()


@pytest.mark.parametrize("architecture", FAMILIES)
def test_route_is_what_transformers_routers_compute(architecture):
    model, tokenizer = _policy(architecture)
    assert all(has_selection_bias(router) for router in find_routers(model).values())
    _move_biases(model)
    spy = RouterSpy(model)
    with torch.no_grad():
        _forward(model, *_batch(tokenizer))
    spy.remove()
    assert len(spy.calls) == 2
    for router, (logits, weights, indices) in spy.calls:
        ours_weights, ours = route(router, logits)
        theirs_order, ours_order = indices.sort(-1), ours.sort(-1)
        assert torch.equal(theirs_order.values, ours_order.values), "the same experts"
        assert torch.equal(weights.gather(-1, theirs_order.indices), ours_weights.gather(-1, ours_order.indices))


@pytest.mark.parametrize("architecture", FAMILIES)
def test_balancing_counts_the_experts_the_forward_chose_when_scores_tie(architecture):
    """Sign-stepped biases make sigmoid + bias scores tie exactly in fp32; what the balancing losses, the bias update
    and the cold start's load profile count (`chosen`) must then still be the forward's own experts, not another
    tie-break (a top-2k's first k, as the shared ranking once gave them, break it otherwise)."""
    # 32 experts top-4 in one group: there a top-2k breaks a tie at the cut otherwise than the top-k (on 8 it does not)
    model, tokenizer = _policy(architecture, num_experts=32, num_experts_per_tok=4, n_group=1, topk_group=1)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for router in find_routers(model).values():
            router.weight.zero_()  # every sigmoid score 0.5, so the bias alone ranks the experts
            bias = torch.rand(router.num_experts, generator=generator)
            order = bias.argsort(descending=True)
            bias[order[router.top_k]] = bias[order[router.top_k - 1]]  # the first left out ties the last chosen
            router.e_score_correction_bias.copy_(bias)
    spy = RouterSpy(model)
    ids, mask = _batch(tokenizer)
    # Every slot flipped (a hook that replaces the forward's experts, as replay does): what the counts read is
    # still the router's own top-k, taken before that hook, and no second top-k is needed for it.
    with torch.no_grad(), flip_routing(model, 1.0, generator) as flips, router_calls(model) as capture:
        _forward(model, ids, mask)
    spy.remove()
    assert flips.share == 1.0
    routers = RouterCalls.of(capture, mask)
    for layer, (router, (logits, _, indices)) in enumerate(spy.calls):
        used = torch.zeros_like(logits, dtype=torch.float32).scatter_(-1, indices, 1.0)
        assert torch.equal(chosen(router, logits), used)
        assert torch.equal(routers.chosen(layer), used)


@pytest.mark.parametrize("architecture", FAMILIES)
def test_replay_forces_experts_and_takes_gates_from_the_current_sigmoid_scores(architecture):
    """Replaying the model's own routing changes nothing; after the routers and biases move, a replayed forward
    computes with the recorded experts and with gates the current router gives them: sigmoid scores at the recorded
    experts, renormalised, times routed_scaling_factor, the bias nowhere."""
    model, tokenizer = _policy(architecture)
    ids, mask = _batch(tokenizer)
    valid = mask.bool()
    with torch.no_grad(), record_routing(model) as recording:
        free = _forward(model, ids, mask).logits
    old = recording.trace
    with torch.no_grad(), replay_routing(model, old) as replay:
        torch.testing.assert_close(_forward(model, ids, mask).logits[valid], free[valid], rtol=0, atol=1e-5)
    assert routing_drift(old, replay.router_choice, valid).expert_change_frac == 0.0
    _perturb_routers(model)
    _move_biases(model, scale=1.0)
    with torch.no_grad(), record_routing(model) as moved:
        _forward(model, ids, mask)
    assert routing_drift(old, moved.trace, valid).expert_change_frac > 0.3
    spy = RouterSpy(model)
    with torch.no_grad(), replay_routing(model, old):
        _forward(model, ids, mask)
    spy.remove()
    flat = valid.reshape(-1)
    for layer, ((router, (logits, _, _)), (experts, gates)) in enumerate(zip(spy.calls, spy.received)):
        recorded = old.experts[layer].reshape(-1, 2).long()
        assert torch.equal(experts[flat], recorded[flat])
        s = torch.sigmoid(logits[flat].float()).gather(-1, recorded[flat])
        torch.testing.assert_close(gates[flat], s / s.sum(-1, keepdim=True) * router.routed_scaling_factor)


@pytest.mark.parametrize("architecture", FAMILIES)
def test_the_bias_moves_the_routers_choice_and_not_a_replayed_forward(architecture):
    model, tokenizer = _policy(architecture)
    ids, mask = _batch(tokenizer)
    valid = mask.bool()
    with torch.no_grad(), record_routing(model, gates=True) as recording:
        recorded = _forward(model, ids, mask).logits[valid]
    trace = recording.trace

    def replayed(rule=None):
        with torch.no_grad(), replay_routing(model, trace, rule) as replay:
            return _forward(model, ids, mask).logits[valid], replay.router_choice

    before, _ = replayed()
    _move_biases(model, scale=2.0)
    after, choice = replayed()
    assert routing_drift(trace, choice, valid).expert_change_frac > 0.3, "the bias moved the router's own choice"
    # ID replay's experts and gates never read the bias: the same numbers, to the rounding of expert matmuls over
    # other row counts (padding, which has no route, follows the moved bias)
    torch.testing.assert_close(after, before, rtol=0, atol=1e-6)
    # Full replay (experts and gate weights as recorded) reproduces the recorded forward whatever moved.
    _perturb_routers(model)
    torch.testing.assert_close(replayed(GateReplay())[0], recorded, rtol=0, atol=1e-6)
    weights = trace.weights[:, valid]
    assert torch.allclose(weights.sum(-1), torch.full_like(weights.sum(-1), 2.5)), "renormalised, times the scale"


@pytest.mark.parametrize("architecture", FAMILIES)
def test_a_checkpoint_of_the_family_loads_with_its_biases(tmp_path, architecture):
    model, tokenizer = _policy(architecture)
    _move_biases(model)
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    loaded, _ = build_policy(ModelConfig(name="ckpt", path=str(tmp_path), experts_implementation="eager"))
    assert describe_policy(loaded)["model_type"] == architecture and describe_policy(loaded)["num_experts"] == 8
    for (name, router), other in zip(find_routers(model).items(), find_routers(loaded).values()):
        assert torch.equal(router.e_score_correction_bias, other.e_score_correction_bias), name
    ids, mask = _batch(tokenizer)
    with torch.no_grad():
        assert torch.equal(_forward(loaded.eval(), ids, mask).logits, _forward(model, ids, mask).logits)


@pytest.mark.parametrize("architecture", FAMILIES)
def test_packed_scoring_equals_row_scoring(architecture):
    model, tokenizer = _policy(architecture, attn_implementation="grouped_eager")
    batch = _packed_batch(tokenizer)
    (rows, row_grads), (packed, packed_grads) = (_score(model, batch, g, record=True) for g in (1, G))
    response_mask = batch[3]
    torch.testing.assert_close(packed.logp[response_mask], rows.logp[response_mask], rtol=0, atol=2e-6)
    torch.testing.assert_close(packed.aux_loss, rows.aux_loss, rtol=1e-6, atol=1e-7)
    assert any("shared_experts" in name for name in packed_grads) and any(
        "gate.weight" in name for name in packed_grads
    )
    for name, grad in packed_grads.items():
        torch.testing.assert_close(grad, row_grads[name], rtol=1e-4, atol=1e-6, msg=name)
    assert torch.equal(packed.routes.experts, rows.routes.experts)


def test_sigmoid_settings_outside_their_ranges_are_refused():
    from models.registry import ConfigError

    for options, message in (
        ({"n_group": 3}, "model.n_group=3 must split model.num_experts=8"),
        (
            {"topk_group": 1, "n_group": 4, "num_experts_per_tok": 2},
            "groups of 2 experts must hold more than model.num_experts_per_tok=2",
        ),
        ({"qk_rope_head_dim": 8}, "model.qk_rope_head_dim=8 must be even"),
    ):
        with pytest.raises(ConfigError, match=message):
            _policy("deepseek_v3", **options)
    with pytest.raises(ConfigError, match="model.n_group=4 groups experts for the sigmoid family"):
        build_policy(ModelConfig(**MICRO_MODEL, n_group=4))


# -- through the RL loop ------------------------------------------------------------------------------------------


def _family_run(architecture: str) -> list[str]:
    return [f"model.architecture={architecture}", *(f"model.{key}={value}" for key, value in SIGMOID.items())]


@pytest.mark.parametrize("replay", ["none", "r2", "r3"])
@pytest.mark.parametrize("algo", sorted(OBJECTIVES))
def test_every_objective_and_replay_mode_runs_on_glm4_moe(tmp_path, algo, replay):
    _loop(tmp_path, "glm4_moe", f"algo={algo}", f"routing.replay={replay}")


@pytest.mark.parametrize("replay", ["none", "r2", "r3"])
def test_every_replay_mode_runs_on_deepseek_v3(tmp_path, replay):
    _loop(tmp_path, "deepseek_v3", "algo=grpo", f"routing.replay={replay}")


def _loop(tmp_path, architecture: str, *overrides: str) -> None:
    summary = train(compose_train(*_family_run(architecture), *overrides, "trainer.steps=2"), tmp_path)
    assert summary["status"] == "finished"
    lines = read_metrics(tmp_path)
    assert all(math.isfinite(line[POLICY_LOSS]) and math.isfinite(line[GRAD_NORM]) for line in lines)
    first = lines[0]
    # 0 by the hooks' wiring, not a measurement: the on-policy minibatch's θ_old routing is its own update forward's.
    # It guards that the family's selection (its bias, its groups) leaves minibatch 0 on-policy; the drift measured is
    # DRIFT_PER_UPDATE's, after minibatch 0's update.
    assert first["minibatches"][0][DRIFT] == 0.0 and DRIFT_PER_UPDATE in first
    assert 0.0 <= first[TOPK_MARGIN_MEDIAN] <= 1.0 and per_layer(TOPK_MARGIN_SMALL, 1) in first
    if "routing.replay=r3" in overrides:
        assert first[ENGINE_EXPERTS] == 0.0, "the HF engine routes as the trainer does, bias included"
