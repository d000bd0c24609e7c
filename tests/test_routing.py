"""Routing record / replay / drift on a real (micro) Qwen3-MoE."""

from __future__ import annotations

import math
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from experiments.step.metrics import (
    DRIFT,
    FRAGILE,
    LOGIT_MARGIN,
    MARGIN,
    TOPK_MARGIN_MEAN,
    TOPK_MARGIN_MEDIAN,
    TOPK_MARGIN_SMALL,
    TOPK_MASS,
    drift_metrics,
    per_layer,
)
from experiments.step.scoring import position_ids
from models.moe_backend import apply_moe_backend
from models.policy import ModelConfig, build_policy
from models.routing.families import replayed_gate_weights, route, router_logprobs, selection_scores
from models.routing.hooks import RouterCalls, record_routing, replay_routing
from models.routing.measures import MarginSummary, gate_shift, routing_drift, top_gap_share, topk_margin
from models.routing.trace import NO_ROUTE, RoutingTrace, find_routers
from models.statistics import median_interval, weighted_median
from tests.conftest import MICRO_MODEL


def _batch(tokenizer, texts=("12+34=5", "7+8=15", "99+1=100")):
    enc = tokenizer(list(texts), return_tensors="pt", padding=True, add_special_tokens=False)
    return enc["input_ids"], enc["attention_mask"]


def _forward(model, ids, mask):
    return model(input_ids=ids, attention_mask=mask, position_ids=position_ids(mask))


class ExpertsSpy:
    """Captures the `top_k_index` every experts module actually received (what the layer computed with)."""

    def __init__(self, model):
        self.calls: dict[str, list[torch.Tensor]] = {}
        self.handles = []
        for name in find_routers(model):
            block = model.get_submodule(name.rsplit(".", 1)[0])
            self.handles.append(block.experts.register_forward_pre_hook(self._hook(name)))

    def _hook(self, name):
        def hook(module, args):
            self.calls.setdefault(name, []).append(args[1].detach().clone())

        return hook

    def used(self, call: int = 0) -> torch.Tensor:
        return torch.stack([calls[call] for calls in self.calls.values()])  # [L, B*S, K]

    def remove(self):
        for handle in self.handles:
            handle.remove()


def _perturb_routers(model, scale=5.0, seed=1):
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for router in find_routers(model).values():
            router.weight.add_(torch.randn(router.weight.shape, generator=generator) * scale)


def _record_then_perturb(model, tokenizer):
    """Record the routing of a batch, then move every router far enough that its own choice changes."""
    ids, mask = _batch(tokenizer)
    with record_routing(model) as recording:
        _forward(model, ids, mask)
    _perturb_routers(model)
    return ids, mask, recording.trace


def _flat_recorded(trace: RoutingTrace, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    L, B, S, K = trace.shape
    return trace.experts.reshape(L, B * S, K).long(), mask.reshape(-1).bool()


def test_record_marks_padding_with_sentinel(micro_policy):
    model, tokenizer = micro_policy
    ids, mask = _batch(tokenizer)
    with record_routing(model) as recording:
        _forward(model, ids, mask)
    trace = recording.trace
    assert trace.shape == (2, ids.shape[0], ids.shape[1], 2)
    padded = mask == 0
    assert padded.any()
    assert (trace.experts[:, padded] == NO_ROUTE).all()
    assert ((trace.experts[:, ~padded] >= 0) & (trace.experts[:, ~padded] < 8)).all()


def test_replay_reproduces_recorded_experts_after_large_router_change(micro_policy):
    model, tokenizer = micro_policy
    ids, mask, old = _record_then_perturb(model, tokenizer)

    # Without replay the perturbed routers choose different experts.
    with record_routing(model) as free:
        _forward(model, ids, mask)
    assert routing_drift(old, free.trace, mask).expert_change_frac > 0.3

    spy = ExpertsSpy(model)
    model.zero_grad()
    with replay_routing(model, old) as replay:
        out = _forward(model, ids, mask)
        out.logits[mask.bool()].logsumexp(-1).sum().backward()
    spy.remove()
    recorded, valid = _flat_recorded(old, mask)
    used = spy.used()
    assert torch.equal(used[:, valid], recorded[:, valid])
    # The router's own (free) choice stays measurable during the replayed forward, without an extra pass.
    assert torch.equal(replay.router_choice.experts, free.trace.experts)
    # Gate weights come from the current router probabilities: the routers still learn.
    for router in find_routers(model).values():
        assert router.weight.grad is not None and router.weight.grad.abs().sum() > 0


def test_replayed_gates_follow_current_router_probabilities(micro_policy):
    """Replaying a trace of the model's own choice changes nothing: same experts, same renormalised gates."""
    model, tokenizer = micro_policy
    ids, mask = _batch(tokenizer)
    with record_routing(model) as recording:
        free = _forward(model, ids, mask).logits
    with replay_routing(model, recording.trace):
        replayed = _forward(model, ids, mask).logits
    valid = mask.bool()
    torch.testing.assert_close(replayed[valid], free[valid], rtol=0, atol=1e-5)


# Every family that gathers gates at replayed experts: the softmax family renormalised (Qwen3-MoE) and not, and the
# sigmoid family (GLM-4.5's grouped-query attention, DeepSeek-V3's latent attention).
FAMILY_BUILDS = {
    "softmax, renormalised": dict(architecture="qwen3_moe"),
    "softmax, unnormalised": dict(architecture="qwen3_moe", norm_topk_prob=False),
    "sigmoid (glm4_moe)": dict(architecture="glm4_moe", n_group=4, topk_group=2),
    "sigmoid (deepseek_v3)": dict(architecture="deepseek_v3", n_group=4, topk_group=2, qk_rope_head_dim=4),
}


@pytest.mark.parametrize("gap", [0.0, 5.0, 60.0, 120.0, 400.0])
@pytest.mark.parametrize("family", ["softmax, renormalised", "sigmoid (glm4_moe)"])
def test_replayed_gates_are_the_quotient_whatever_the_logit_gap(family, gap):
    """The replayed experts [1, 2] sit `gap` below expert 0. Their gates are p_e / (p_1 + p_2) (times the sigmoid
    family's scaling, with its 1e-20), as float64 computes them, and their gradients finite: past a gap of ~100 the
    softmax probabilities underflow in fp32 and the plain quotient is 0/0."""
    router = (
        SimpleNamespace(top_k=2, norm_topk_prob=True)
        if family.startswith("softmax")
        else SimpleNamespace(
            top_k=2,
            num_experts=4,
            e_score_correction_bias=torch.zeros(4),
            num_group=1,
            topk_group=1,
            norm_topk_prob=True,
            routed_scaling_factor=2.5,
        )
    )
    logits = torch.tensor([[gap, 0.3, -0.2, -1.0]], requires_grad=True)
    replayed = torch.tensor([[1, 2]])
    weights = replayed_gate_weights(router, logits, replayed, logits)
    exact = logits.detach().double()
    if family.startswith("softmax"):
        scores = torch.softmax(exact, -1)[0, [1, 2]]
        expected = torch.softmax(exact[0, [1, 2]], -1)  # the global normaliser cancels: exact at any gap
    else:
        scores = torch.sigmoid(exact)[0, [1, 2]]
        expected = scores / (scores.sum() + 1e-20) * 2.5
    torch.testing.assert_close(weights[0].double(), expected, rtol=1e-6, atol=0)
    (weights[0, 0] * 3 + weights[0, 1]).backward()
    assert torch.isfinite(logits.grad).all() and logits.grad[0, 1:3].abs().sum() > 0
    if gap < 60 and family.startswith("softmax"):  # nothing underflows: transformers' own arithmetic, bit for bit
        probs = torch.softmax(logits.detach(), -1)[0, [1, 2]]
        assert torch.equal(weights[0].detach(), probs / probs.sum())


@pytest.mark.parametrize("family", list(FAMILY_BUILDS))
def test_replay_stays_finite_when_the_router_moved_past_the_replayed_experts(family):
    """A recorded trace replayed after the routers moved far (perturbed, then scaled so that logit gaps reach the
    hundreds): for tokens whose recorded experts the moved router ranks far below its best, their probabilities
    underflow in fp32. The replayed forward's logits, its loss and every router's gradient stay finite, and the
    recorded experts are still the ones computed with."""
    model, tokenizer = build_policy(
        ModelConfig(**{**MICRO_MODEL, "experts_implementation": "eager", **FAMILY_BUILDS[family]})
    )
    model.eval()
    ids, mask, old = _record_then_perturb(model, tokenizer)
    with torch.no_grad():
        for router in find_routers(model).values():
            router.weight.mul_(200.0)
    with record_routing(model) as free:
        _forward(model, ids, mask)
    assert routing_drift(old, free.trace, mask).expert_change_frac > 0.3
    spy = ExpertsSpy(model)
    model.zero_grad()
    with replay_routing(model, old):
        out = _forward(model, ids, mask)
        loss = out.logits[mask.bool()].log_softmax(-1)[:, 0].mean()
        loss.backward()
    spy.remove()
    recorded, valid = _flat_recorded(old, mask)
    assert torch.equal(spy.used()[:, valid], recorded[:, valid])
    assert torch.isfinite(out.logits[mask.bool()]).all() and torch.isfinite(loss)
    for router in find_routers(model).values():
        assert torch.isfinite(router.weight.grad).all()


def test_replay_holds_under_activation_checkpointing(micro_policy):
    model, tokenizer = micro_policy
    ids, mask, old = _record_then_perturb(model, tokenizer)
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    spy = ExpertsSpy(model)
    with replay_routing(model, old):
        out = _forward(model, ids, mask)
        out.logits[mask.bool()].logsumexp(-1).sum().backward()
    spy.remove()
    recorded, valid = _flat_recorded(old, mask)
    calls = len(next(iter(spy.calls.values())))
    assert calls == 2, "activation checkpointing should re-run each MoE layer once in backward"
    for call in range(calls):
        assert torch.equal(spy.used(call)[:, valid], recorded[:, valid])


def test_replay_works_with_the_reference_dmoe_backend(micro_policy):
    model, tokenizer = micro_policy
    ids, mask, old = _record_then_perturb(model, tokenizer)  # recorded with transformers' experts
    apply_moe_backend(model, "torch_dmoe")
    spy = ExpertsSpy(model)
    with replay_routing(model, old):
        _forward(model, ids, mask)
    spy.remove()
    recorded, valid = _flat_recorded(old, mask)
    assert torch.equal(spy.used()[:, valid], recorded[:, valid])


def test_generate_trace_lines_up_with_tokens(micro_policy):
    model, tokenizer = micro_policy
    ids, mask = _batch(tokenizer, ("12+34=", "7+8=", "5+5="))
    torch.manual_seed(0)
    with record_routing(model, generate=True) as recording:
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=6,
            min_new_tokens=6,
            do_sample=True,
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.eos_token_id,
        )
    trace = recording.trace
    assert trace.shape[1:3] == tuple(out.shape)
    # The last sampled token was never fed back through the model.
    assert (trace.experts[:, :, -1] == NO_ROUTE).all()
    full_mask = torch.cat([mask, torch.ones(out.shape[0], 6, dtype=mask.dtype)], dim=1)
    with record_routing(model) as scored:
        _forward(model, out, full_mask)
    # Every token the model saw during generation (prefill + decode steps) was routed as in one full forward.
    seen = full_mask.bool().clone()
    seen[:, -1] = False
    drift = routing_drift(trace, scored.trace, seen)
    assert drift.tokens == int(seen.sum())
    assert drift.expert_change_frac == 0.0


def _trace(experts: list) -> RoutingTrace:
    tensor = torch.tensor(experts, dtype=torch.int16)
    return RoutingTrace(tensor, tuple(f"layer{i}" for i in range(tensor.shape[0])), num_experts=4)


def test_drift_on_hand_built_traces():
    # 2 layers, 1 row, 3 positions, top-2. Position 2 is masked out.
    old = _trace([[[[0, 1], [2, 3], [0, 1]]], [[[0, 1], [0, 2], [3, 2]]]])
    new = _trace([[[[1, 0], [2, 0], [3, 2]]], [[[0, 1], [1, 3], [0, 1]]]])
    mask = torch.tensor([[True, True, False]])
    drift = routing_drift(old, new, mask)
    # layer 0: token 0 keeps {0,1} (order is irrelevant), token 1 loses one of two slots -> 1/4
    # layer 1: token 0 keeps, token 1 changes both slots -> 2/4
    assert drift.per_layer.tolist() == [0.25, 0.5]
    assert drift.expert_change_frac == pytest.approx(0.375)
    assert drift.token_any_change_frac == pytest.approx(0.5)
    assert drift.tokens == 2
    assert drift_metrics(drift)[per_layer(DRIFT, 1)] == 0.5


def test_drift_ignores_unrecorded_positions():
    old = _trace([[[[NO_ROUTE, NO_ROUTE], [2, 3]]]])
    new = _trace([[[[0, 1], [2, 1]]]])
    drift = routing_drift(old, new, torch.ones(1, 2, dtype=torch.bool))
    assert drift.tokens == 1
    assert drift.expert_change_frac == pytest.approx(0.5)


def test_drift_refuses_mismatched_shapes():
    old = _trace([[[[0, 1], [2, 3]]]])
    with pytest.raises(ValueError, match="shapes"):
        routing_drift(old, _trace([[[[0, 1]]]]), torch.ones(1, 1, dtype=torch.bool))
    with pytest.raises(ValueError, match="mask"):
        routing_drift(old, old, torch.ones(1, 3, dtype=torch.bool))


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda t: RoutingTrace(t.experts[:1], t.layer_names[:1], t.num_experts), "MoE layers"),
        (lambda t: t.rows(slice(0, 2)), "batch x positions"),
        (lambda t: RoutingTrace(t.experts[..., :1], t.layer_names, t.num_experts), "top-k"),
        (lambda t: RoutingTrace(t.experts.clone().fill_(9), t.layer_names, t.num_experts), "expert id 9"),
        (lambda t: RoutingTrace(t.experts.clone().fill_(3), t.layer_names, t.num_experts), "same expert twice"),
        (
            lambda t: RoutingTrace(
                torch.where(torch.arange(2) == 0, t.experts, NO_ROUTE).to(t.experts.dtype), t.layer_names, t.num_experts
            ),
            "mixes NO_ROUTE",
        ),
    ],
)
def test_mismatched_trace_is_refused(micro_policy, mutate, message):
    model, tokenizer = micro_policy
    ids, mask = _batch(tokenizer)
    with record_routing(model) as recording:
        _forward(model, ids, mask)
    bad = mutate(recording.trace)
    with pytest.raises(ValueError, match=message):
        with replay_routing(model, bad):
            _forward(model, ids, mask)


def test_router_fragility_by_hand():
    import math

    from experiments.step.scoring import margin_stats, router_fragility

    # one layer, two tokens, 4 experts, top-2; the second token is padding (weight 0)
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0], [0.0, 0.0, 0.0, 0.0]])
    router = SimpleNamespace(top_k=2)  # a softmax-family router: no selection bias
    routers = RouterCalls([(router, logits)], torch.tensor([[1.0, 0.0]]))
    stats, margins = router_fragility(routers, margin=0.1)
    assert TOPK_MARGIN_MEDIAN not in stats  # a median is the caller's, once it holds every token (margin_stats)
    stats.update(margin_stats(margins, routers.flat_weights))
    p = torch.softmax(logits[0], -1)
    assert stats[TOPK_MASS] == pytest.approx(float(p[0] + p[1]))
    assert stats[MARGIN] == pytest.approx(float(p[1] - p[2]))
    assert stats[LOGIT_MARGIN] == pytest.approx(0.5)  # 1.0 - 0.5: log(p_2 / p_3)
    assert stats[LOGIT_MARGIN] == pytest.approx(math.log(float(p[1] / p[2])))
    assert stats[FRAGILE] == (1.0 if float(p[1] - p[2]) < 0.1 else 0.0)
    assert stats[per_layer(LOGIT_MARGIN, 0)] == stats[LOGIT_MARGIN]
    # the scale-free margin of the one real token: (p_1 - p_2) / (p_0 - p_3), its median, mean, and not below 0.01
    margin = float((p[1] - p[2]) / (p[0] - p[3]))
    assert stats[TOPK_MARGIN_MEDIAN] == pytest.approx(margin) and stats[TOPK_MARGIN_MEAN] == pytest.approx(margin)
    assert stats[TOPK_MARGIN_SMALL] == 0.0 and stats[per_layer(TOPK_MARGIN_MEDIAN, 0)] == pytest.approx(margin)


def test_topk_margin_on_hand_made_scores():
    scores = torch.tensor(
        [
            [0.5, 0.3, 0.2, 0.1, 0.05, 0.0],  # top-4: (0.3 - 0.2) / (0.5 - 0.1) = 0.25
            [0.2, 0.2, 0.2, 0.2, 0.2, 0.2],  # a tie of the 2k best: at the cut, 0
            [0.9, 0.8, -math.inf, 0.7, -math.inf, -math.inf],  # groups left 3 experts: s[2k-1] is the lowest allowed
            [0.9, 0.4, 0.399, 0.1, 0.0, 0.0],  # just above the cut: (0.4 - 0.399) / 0.8
        ]
    )
    margins = topk_margin(scores, k=2)
    torch.testing.assert_close(margins, torch.tensor([0.25, 0.0, 0.5, 0.00125]))
    torch.testing.assert_close(topk_margin(10 * scores[[0, 3]] + 3, k=2), margins[[0, 3]])  # scale-free
    summary = MarginSummary.of(margins, torch.tensor([1.0, 1.0, 0.0, 2.0]))  # the third token is padding
    # weighted values 0 (1), 0.00125 (2), 0.25 (1): the median is where half of the weight 4 is reached
    assert summary.median == pytest.approx(0.00125, rel=1e-4)
    assert summary.mean == pytest.approx((0.25 + 2 * 0.00125) / 4)
    assert summary.small == pytest.approx(3 / 4)
    assert weighted_median(torch.tensor([3.0, 1.0, 2.0]), torch.ones(3)) == 2.0
    with pytest.raises(ValueError, match="more than 2 experts"):
        topk_margin(scores[:, :2], k=2)
    with pytest.raises(ValueError, match="3 allowed experts per token"):
        topk_margin(torch.tensor([[0.9, 0.8, -math.inf, -math.inf]]), k=2)


def test_the_best_experts_lead_over_the_same_spread_as_the_margin():
    """A softmax router whose best expert dominates: its logits' gap at the top-2 cut equals the lead's, yet in
    probabilities the lead takes most of the spread and the cut's margin is small; an even router is the reverse."""
    dominated = torch.softmax(torch.tensor([[4.0, 1.0, 0.0, -1.0, -2.0, -3.0]]), dim=-1)
    even = torch.softmax(torch.tensor([[0.4, 0.3, 0.0, -0.1, -2.0, -3.0]]), dim=-1)
    for scores in (dominated, even):
        top = scores.topk(4, dim=-1).values
        torch.testing.assert_close(top_gap_share(top), (top[:, 0] - top[:, 1]) / (top[:, 0] - top[:, 3]))
    assert float(top_gap_share(dominated.topk(4).values)) > 0.9 > 0.1 > float(topk_margin(dominated, k=2))
    assert float(top_gap_share(even.topk(4).values)) < float(topk_margin(even, k=2))
    ranked = torch.tensor([[0.9, 0.8, 0.7, -math.inf], [0.2, 0.2, 0.2, 0.2]])  # groups left 3; a tie
    torch.testing.assert_close(top_gap_share(ranked), torch.tensor([0.5, 0.0]))


def test_the_median_interval_covers_the_true_median_when_tokens_of_a_sequence_move_together():
    """Sequences draw a shared offset and their tokens little noise around it (as a sequence's routes do): resampling
    whole sequences covers the population median (0) about 95% of the time; resampling tokens as if independent is
    far too narrow, which is why the margin's interval resamples sequences."""
    generator = torch.Generator().manual_seed(0)
    sequences, tokens = 40, 10
    groups = torch.arange(sequences).repeat_interleave(tokens)
    weights = torch.ones(sequences * tokens)
    covered = {"sequences": 0, "tokens": 0}
    for trial in range(100):
        values = torch.randn(sequences, generator=generator).repeat_interleave(tokens) + 0.1 * torch.randn(
            sequences * tokens, generator=generator
        )
        for name, unit in (("sequences", groups), ("tokens", torch.arange(sequences * tokens))):
            low, high = median_interval(values, weights, unit, resamples=400, seed=trial)
            assert low <= weighted_median(values, weights) <= high
            covered[name] += low <= 0.0 <= high
    assert covered["sequences"] >= 88 and covered["tokens"] <= 70
    padded = torch.cat([torch.ones(4), torch.zeros(4)])  # weight-0 tokens never become the median
    assert median_interval(torch.cat([torch.full((4,), 2.0), torch.zeros(4)]), padded, torch.arange(8)) == (2.0, 2.0)
    with pytest.raises(ValueError, match="level=1.5 must lie in"):
        median_interval(torch.ones(2), torch.ones(2), torch.arange(2), level=1.5)


def _sigmoid_router(bias, groups=2, kept=1):
    return SimpleNamespace(
        top_k=2,
        num_experts=4,
        e_score_correction_bias=torch.tensor(bias),
        num_group=groups,
        topk_group=kept,
        norm_topk_prob=True,
        routed_scaling_factor=2.5,
    )


def test_the_sigmoid_familys_bias_chooses_and_never_weighs():
    """E = 4 in 2 groups of 2, one group kept, top-2. s = sigmoid(z) = (.5, .731, .953, .5): group {2, 3} sums
    1.453 against 1.231, so the router takes {2, 3}; a bias of 0.5 on expert 0 lifts group {0, 1} to 1.731, and it
    takes {0, 1}. The gates are s at the chosen experts, renormalised, times 2.5, with or without the bias."""
    z = torch.tensor([[0.0, 1.0, 3.0, 0.0]])
    s = torch.sigmoid(z)[0]
    plain, biased = _sigmoid_router([0.0, 0.0, 0.0, 0.0]), _sigmoid_router([0.5, 0.0, 0.0, 0.0])
    assert selection_scores(plain, z)[0, :2].isinf().all() and torch.isfinite(selection_scores(plain, z)[0, 2:]).all()
    for router, experts in ((plain, [2, 3]), (biased, [0, 1])):
        weights, indices = route(router, z)
        assert sorted(indices[0].tolist()) == experts
        expected = s[indices[0]] / s[indices[0]].sum() * 2.5
        torch.testing.assert_close(weights[0], expected)
    # a replayed route's gates do not see the bias: the same numbers under both routers
    replayed = torch.tensor([[2, 3]])
    torch.testing.assert_close(
        replayed_gate_weights(biased, z, replayed, z), replayed_gate_weights(plain, z, replayed, z)
    )
    torch.testing.assert_close(router_logprobs(biased, z), torch.nn.functional.logsigmoid(z))


def test_the_gate_shift_weighs_a_changed_expert_by_the_gate_mass_it_carried():
    """Old {0: 0.9, 1: 0.1}, new {0: 0.8, 2: 0.2} (renormalised): ½(|0.8 − 0.9| + 0.2 + 0.1) = 0.2, where the count
    of changed experts says 1 of 2; the same routing is 0, a disjoint one 1; unnormalised gates (the sigmoid family's
    scaling) are normalised first, and a token outside the mask does not count."""
    old = RoutingTrace(torch.tensor([[[[0, 1], [0, 1]]]]), ("a",), 4, torch.tensor([[[[1.8, 0.2], [0.5, 0.5]]]]))
    new = RoutingTrace(torch.tensor([[[[0, 2], [2, 3]]]]), ("a",), 4, torch.tensor([[[[0.8, 0.2], [0.3, 0.7]]]]))
    mask = torch.tensor([[True, False]])
    assert gate_shift(old, new, mask).mean == pytest.approx(0.2)
    assert routing_drift(old, new, mask).expert_change_frac == pytest.approx(0.5)
    assert gate_shift(old, old, mask).mean == 0.0
    assert gate_shift(old, new, torch.tensor([[False, True]])).mean == pytest.approx(1.0)
    with pytest.raises(ValueError, match="recorded with their gates"):
        gate_shift(replace(old, weights=None), new, mask)
