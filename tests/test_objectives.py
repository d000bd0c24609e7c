"""Objectives against hand-derived losses and gradients, their shared metrics, aggregation, numerics and errors.

Convention of the hand-built batches: old_logp = -2 on valid tokens and logp = old_logp + log r, so each test
reads as a list of token ratios r; gradients are d loss / d logp.
"""

import math
import re
from dataclasses import FrozenInstanceError, fields
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from algos import OBJECTIVES, ObjectiveOutput, build_objective
from algos.aggregation import LOSS_AGG_MODES, aggregate
from algos.objective import (
    CLIP,
    CLIP_SEQ,
    KL_OLD,
    KL_REF,
    POLICY_LOSS,
    SEQ_RATIO_MEAN,
    SEQ_RATIO_VAR,
    TOKEN_RATIO_MAX,
    TOKEN_RATIO_MEAN,
    TOKEN_RATIO_VAR,
    ObjectiveInputs,
)
from experiments.config import register_configs

CONF_ALGO = Path(__file__).resolve().parents[1] / "conf" / "algo"
TOL = dict(rtol=1e-5, atol=1e-6)


def batch_from_ratios(ratios: list[list[float]], advantages: list[float], width: int) -> dict[str, torch.Tensor]:
    """Padded [B, width] inputs whose valid token ratios are `ratios` (padding: logp = old_logp = 0)."""
    batch = len(ratios)
    old_logp = torch.zeros(batch, width)
    logp = torch.zeros(batch, width)
    mask = torch.zeros(batch, width, dtype=torch.bool)
    for i, row in enumerate(ratios):
        n = len(row)
        old_logp[i, :n] = -2.0
        logp[i, :n] = -2.0 + torch.log(torch.tensor(row, dtype=torch.float64)).float()
        mask[i, :n] = True
    return dict(logp=logp, old_logp=old_logp, advantages=torch.tensor(advantages), mask=mask)


def call(objective, logp: torch.Tensor, totals=None, **inputs: torch.Tensor) -> ObjectiveOutput:
    """The objective on keyword inputs, as the trainer calls it: π_θ's log-probs, the `ObjectiveInputs`, the totals."""
    return objective(logp, ObjectiveInputs(**inputs), totals)


def loss_and_grad(objective, inputs: dict[str, torch.Tensor]) -> tuple[ObjectiveOutput, torch.Tensor]:
    logp = inputs["logp"].clone().requires_grad_(True)
    out = call(objective, **{**inputs, "logp": logp})
    (grad,) = torch.autograd.grad(out.loss, logp)
    return out, grad


# Two responses: Â = +1 with ratios (1.1, 1.5); Â = -2 with ratios (0.9, 0.5, 1.3).
TOKEN_CASE = batch_from_ratios([[1.1, 1.5], [0.9, 0.5, 1.3]], [1.0, -2.0], width=3)


def test_grpo_matches_hand_derived_loss_and_gradient():
    # clip (0.8, 1.27): 1.5 binds (Â > 0), 0.5 binds (Â < 0), 1.3 does not (Â < 0 keeps the larger loss).
    out, grad = loss_and_grad(build_objective("grpo"), TOKEN_CASE)
    seq0 = (-1.1 - 1.27) / 2
    seq1 = (2 * 0.9 + 2 * 0.8 + 2 * 1.3) / 3
    assert out.loss.item() == pytest.approx((seq0 + seq1) / 2, rel=1e-6)
    # Unclipped token: -Â·r / (|y_i|·B); clipped tokens and padding: 0.
    expected = torch.tensor([[-1.1 / 4, 0.0, 0.0], [2 * 0.9 / 6, 0.0, 2 * 1.3 / 6]])
    torch.testing.assert_close(grad, expected, **TOL)
    assert out.metrics[CLIP] == pytest.approx(2 / 5)
    assert out.metrics[CLIP_SEQ] == pytest.approx(1.0)
    assert out.metrics[TOKEN_RATIO_MEAN] == pytest.approx(5.3 / 5, rel=1e-6)
    assert out.metrics[TOKEN_RATIO_MAX] == pytest.approx(1.5, rel=1e-6)
    token_ratios = torch.tensor([1.1, 1.5, 0.9, 0.5, 1.3])
    assert out.metrics[TOKEN_RATIO_VAR] == pytest.approx(token_ratios.var(unbiased=False).item(), rel=1e-5)
    seq_ratios = [math.sqrt(1.1 * 1.5), (0.9 * 0.5 * 1.3) ** (1 / 3)]
    assert out.metrics[SEQ_RATIO_MEAN] == pytest.approx(sum(seq_ratios) / 2, rel=1e-6)
    assert out.metrics[KL_OLD] == pytest.approx(sum(r - 1 - math.log(r) for r in token_ratios.tolist()) / 5)
    assert out.metrics[POLICY_LOSS] == pytest.approx(out.loss.item())
    assert KL_REF not in out.metrics


def test_dapo_is_a_token_mean_with_clip_higher():
    # clip (0.8, 1.28); the same tokens bind as for GRPO, now every token weighs 1/5.
    out, grad = loss_and_grad(build_objective("dapo"), TOKEN_CASE)
    assert out.loss.item() == pytest.approx((-1.1 - 1.28 + 1.8 + 1.6 + 2.6) / 5, rel=1e-6)
    torch.testing.assert_close(grad, torch.tensor([[-1.1 / 5, 0, 0], [2 * 0.9 / 5, 0, 2 * 1.3 / 5]]), **TOL)


def test_dr_grpo_divides_the_token_sum_by_a_constant():
    # clip (0.8, 1.2); sum of per-token losses = -1.1 - 1.2 + 1.8 + 1.6 + 2.6 = 3.7.
    out, grad = loss_and_grad(build_objective("dr_grpo"), TOKEN_CASE)
    assert out.loss.item() == pytest.approx(3.7 / (2 * 3), rel=1e-6)  # B · T with T the padded length
    torch.testing.assert_close(grad, torch.tensor([[-1.1 / 6, 0, 0], [2 * 0.9 / 6, 0, 2 * 1.3 / 6]]), **TOL)
    out, grad = loss_and_grad(build_objective("dr_grpo", norm_tokens=10), TOKEN_CASE)
    assert out.loss.item() == pytest.approx(3.7 / (2 * 10), rel=1e-6)
    torch.testing.assert_close(grad, torch.tensor([[-1.1 / 20, 0, 0], [2 * 0.9 / 20, 0, 2 * 1.3 / 20]]), **TOL)


def test_cispo_clips_the_weight_and_keeps_every_token_gradient():
    inputs = TOKEN_CASE
    out, grad = loss_and_grad(build_objective("cispo"), inputs)
    # No lower bound, cap 1.2: weights (1.1, 1.2 | 0.9, 0.5, 1.2). Gradient -w·Â / (number of tokens).
    weights = torch.tensor([[1.1, 1.2, 0.0], [0.9, 0.5, 1.2]])
    advantages = torch.tensor([[1.0], [-2.0]])
    torch.testing.assert_close(grad, -weights * advantages / 5, **TOL)
    logp = torch.where(inputs["mask"], inputs["logp"], 0.0)
    assert out.loss.item() == pytest.approx((-weights * advantages * logp).sum().item() / 5, rel=1e-5)
    assert out.metrics[CLIP] == pytest.approx(2 / 5)  # 1.5 and 1.3 were capped, whatever Â's sign
    assert out.metrics[CLIP_SEQ] == pytest.approx(1.0)

    out, grad = loss_and_grad(build_objective("cispo", clip_low=0.2), inputs)
    weights[1, 1] = 0.8
    torch.testing.assert_close(grad, -weights * advantages / 5, **TOL)
    assert out.metrics[CLIP] == pytest.approx(3 / 5)


def test_gspo_matches_hand_derived_loss_and_gradient():
    # Sequence log-ratios: mean(3e-4, 1e-4) = 2e-4 (Â = +1, inside 1 + 4e-4: unclipped);
    # -1e-3 (Â = -2, below 1 - 3e-4: binds); 2e-3 (Â = -1, above the range but Â < 0: unclipped).
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 0, 0]], dtype=torch.bool)
    log_ratio = torch.tensor([[3e-4, 1e-4, 0.0], [-1e-3, -1e-3, -1e-3], [2e-3, 0.0, 0.0]])
    inputs = dict(logp=log_ratio, old_logp=torch.zeros(3, 3), advantages=torch.tensor([1.0, -2.0, -1.0]), mask=mask)
    out, grad = loss_and_grad(build_objective("gspo"), inputs)
    s0, s2 = math.exp(2e-4), math.exp(2e-3)
    assert out.loss.item() == pytest.approx((-s0 + 2 * (1 - 3e-4) + s2) / 3, rel=1e-6)
    # Eq. 10: -Â_i·s_i / (|y_i|·B) on every token of an unclipped response.
    expected = torch.tensor([[-s0 / 6, -s0 / 6, 0.0], [0.0, 0.0, 0.0], [s2 / 3, 0.0, 0.0]])
    torch.testing.assert_close(grad, expected, **TOL)
    assert out.metrics[CLIP_SEQ] == pytest.approx(1 / 3)
    assert out.metrics[CLIP] == pytest.approx(3 / 6)  # token-weighted: the clipped response has 3
    assert out.metrics[SEQ_RATIO_MEAN] == pytest.approx((s0 + math.exp(-1e-3) + s2) / 3, rel=1e-6)


def test_gspo_token_equals_gspo_in_value_gradient_and_metrics():
    torch.manual_seed(0)
    batch, width = 6, 7
    lengths = torch.tensor([7, 5, 1, 3, 6, 2])
    mask = torch.arange(width)[None, :] < lengths[:, None]
    old_logp = -torch.rand(batch, width) * 3
    logp = old_logp + torch.randn(batch, width) * 1e-3  # some responses clip at 3e-4 / 4e-4, some do not
    inputs = dict(logp=logp, old_logp=old_logp, advantages=torch.randn(batch), mask=mask)
    gspo, gspo_grad = loss_and_grad(build_objective("gspo"), inputs)
    token, token_grad = loss_and_grad(build_objective("gspo_token"), inputs)
    assert 0 < gspo.metrics[CLIP_SEQ] < 1
    assert torch.allclose(gspo.loss, token.loss, rtol=1e-6, atol=1e-7)
    assert torch.allclose(gspo_grad, token_grad, rtol=1e-6, atol=1e-8)
    assert gspo.metrics == pytest.approx(token.metrics)


def test_gmpo_clips_log_ratios_sign_aware_inside_the_geometric_mean():
    # Â = +1, log-ratios (0.2, 0.6): 0.6 binds at 0.4 -> mean 0.3.
    # Â = -2, log-ratios (-0.1, -0.7, 0.5): -0.7 binds at -0.4, 0.5 does not (Â < 0) -> mean 0.
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]], dtype=torch.bool)
    log_ratio = torch.tensor([[0.2, 0.6, 0.0], [-0.1, -0.7, 0.5]])
    old_logp = torch.full((2, 3), -1.0)
    inputs = dict(logp=old_logp + log_ratio, old_logp=old_logp, advantages=torch.tensor([1.0, -2.0]), mask=mask)
    out, grad = loss_and_grad(build_objective("gmpo"), inputs)
    assert out.loss.item() == pytest.approx((-math.exp(0.3) + 2.0) / 2, rel=1e-6)
    # d/d logp_t of -Â·exp(mean) = -Â·ratio_i / |y_i| for unclipped tokens, over B.
    expected = torch.tensor([[-math.exp(0.3) / 4, 0.0, 0.0], [1 / 3, 0.0, 1 / 3]])
    torch.testing.assert_close(grad, expected, **TOL)
    assert out.metrics[CLIP] == pytest.approx(2 / 5)
    assert out.metrics[CLIP_SEQ] == pytest.approx(1.0)


def sech2(x: float) -> float:
    return 1 / math.cosh(x) ** 2


def test_sapo_soft_gate_loss_gradient_and_gate_metric():
    # Â = +1 (τ = 1): ratios (1, 1.5). Â = -2 (τ = 1.05): ratio 0.5.
    inputs = batch_from_ratios([[1.0, 1.5], [0.5]], [1.0, -2.0], width=2)
    out, grad = loss_and_grad(build_objective("sapo"), inputs)

    def f(r: float, tau: float) -> float:
        return 4 / tau / (1 + math.exp(-tau * (r - 1)))

    seq0 = (-f(1.0, 1.0) - f(1.5, 1.0)) / 2
    seq1 = 2 * f(0.5, 1.05)
    assert out.loss.item() == pytest.approx((seq0 + seq1) / 2, rel=1e-6)
    # Per token: -Â·sech²(τ(r-1)/2)·r / (|y_i|·B).
    expected = torch.tensor([[-1.0 / 4, -sech2(0.25) * 1.5 / 4], [2 * sech2(1.05 * -0.5 / 2) * 0.5 / 2, 0.0]])
    torch.testing.assert_close(grad, expected, **TOL)
    assert out.metrics[CLIP] == 0.0 and out.metrics[CLIP_SEQ] == 0.0
    gate = (1 + sech2(0.25) + sech2(1.05 * -0.5 / 2)) / 3
    assert out.metrics["sapo/gate_weight_mean"] == pytest.approx(gate, rel=1e-6)


def ragged_batch(seed: int = 0) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([4, 1, 6, 3])
    mask = torch.arange(6)[None, :] < lengths[:, None]
    logp = -torch.rand(4, 6, generator=generator) * 3
    return dict(
        logp=logp,
        old_logp=logp.clone(),
        advantages=torch.tensor([1.5, -0.5, 0.7, -1.2]),
        mask=mask,
        rollout_logp=logp.clone(),
    )  # on-policy: the engine that sampled is π_θ too (read by MiniRL)


@pytest.mark.parametrize("name", sorted(OBJECTIVES))
def test_on_policy_ratios_are_exactly_one_and_nothing_clips(name):
    out, grad = loss_and_grad(build_objective(name), ragged_batch())
    m = out.metrics
    assert (m[TOKEN_RATIO_MEAN], m[TOKEN_RATIO_MAX], m[SEQ_RATIO_MEAN]) == (1.0, 1.0, 1.0)
    assert (m[TOKEN_RATIO_VAR], m[SEQ_RATIO_VAR], m[KL_OLD]) == (0.0, 0.0, 0.0)
    assert (m[CLIP], m[CLIP_SEQ]) == (0.0, 0.0)
    assert torch.isfinite(grad).all()


def test_on_policy_grpo_gspo_gspo_token_sapo_share_one_gradient():
    inputs = ragged_batch()
    lengths = inputs["mask"].sum(dim=1, keepdim=True)
    expected = torch.where(inputs["mask"], -inputs["advantages"][:, None] / (lengths * 4), 0.0)
    for name in ("grpo", "gspo", "gspo_token", "sapo"):
        _, grad = loss_and_grad(build_objective(name), inputs)
        torch.testing.assert_close(grad, expected, **TOL, msg=name)


def test_aggregation_modes_on_a_hand_built_loss_with_padding():
    nan = float("nan")
    loss = torch.tensor([[1.0, 2.0, 3.0, nan], [4.0, 5.0, nan, float("inf")], [nan, nan, nan, nan]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [0, 0, 0, 0]], dtype=torch.bool)
    assert aggregate(loss, mask, "token-mean").item() == pytest.approx(15 / 5)
    assert aggregate(loss, mask, "seq-mean-token-mean").item() == pytest.approx((2.0 + 4.5) / 2)  # empty seq left out
    assert aggregate(loss, mask, "seq-mean-token-sum").item() == pytest.approx((6.0 + 9.0) / 2)
    assert aggregate(loss, mask, "seq-mean-token-sum-norm").item() == pytest.approx(15 / (3 * 4))
    assert aggregate(loss, mask, "seq-mean-token-sum-norm", norm_tokens=10).item() == pytest.approx(15 / 30)
    empty = torch.zeros_like(mask)
    for mode in LOSS_AGG_MODES:
        assert aggregate(loss, empty, mode).item() == 0.0
    with pytest.raises(ValueError, match=", ".join(LOSS_AGG_MODES)):
        aggregate(loss, mask, "sum")


@pytest.mark.parametrize("name", sorted(OBJECTIVES))
def test_nan_and_inf_in_padding_change_nothing(name):
    objective = build_objective(name, kl_coef=0.1)
    torch.manual_seed(1)
    clean = ragged_batch()
    clean["logp"] = clean["logp"] + torch.randn(4, 6) * 0.05
    clean["ref_logp"] = clean["old_logp"] + torch.randn(4, 6) * 0.05
    poisoned = {key: value.clone() for key, value in clean.items()}
    padding = ~clean["mask"]
    poisoned["logp"][padding] = float("nan")
    poisoned["old_logp"][padding] = float("inf")
    poisoned["ref_logp"][padding] = float("-inf")
    clean_out, clean_grad = loss_and_grad(objective, clean)
    out, grad = loss_and_grad(objective, poisoned)
    assert torch.isfinite(out.loss) and torch.isfinite(grad).all()
    assert torch.equal(out.loss, clean_out.loss) and torch.equal(grad, clean_grad)
    assert out.metrics == clean_out.metrics


@pytest.mark.parametrize("name", sorted(OBJECTIVES))
def test_huge_log_ratios_are_clamped_to_finite_loss_and_gradient(name):
    inputs = ragged_batch()
    inputs["logp"][0, 0] += 100.0  # Â > 0
    inputs["logp"][3, 1] += 100.0  # Â < 0: the unclipped branch of PPO keeps r itself
    inputs["logp"][2, 2] -= 100.0
    inputs["logp"][1, 0] += 100.0  # a one-token response: its sequence log-ratio hits the ±10 bound too
    out, grad = loss_and_grad(build_objective(name), inputs)
    assert torch.isfinite(out.loss) and torch.isfinite(grad).all()
    assert all(math.isfinite(value) for value in out.metrics.values())


def test_kl_penalty_is_k3_added_per_token_and_aggregated_like_the_loss():
    # On-policy, Â = 1: policy loss -1 per token. ref - logp = (ln 2, 0): k3 = (1 - ln 2, 0).
    logp = torch.tensor([[-1.0, -2.0]])
    ref_logp = logp + torch.tensor([[math.log(2.0), 0.0]])
    inputs = dict(
        logp=logp, old_logp=logp.clone(), advantages=torch.tensor([1.0]), mask=torch.ones(1, 2), ref_logp=ref_logp
    )
    out, grad = loss_and_grad(build_objective("grpo", kl_coef=0.1), inputs)
    assert out.loss.item() == pytest.approx((-2 + 0.1 * (1 - math.log(2))) / 2, rel=1e-6)
    # d k3 / d logp = 1 - exp(ref - logp) = -1 on the first token.
    torch.testing.assert_close(grad, torch.tensor([[(-1 - 0.1) / 2, -1 / 2]]), **TOL)
    assert out.metrics[POLICY_LOSS] == pytest.approx(-1.0)
    assert out.metrics[KL_REF] == pytest.approx((1 - math.log(2)) / 2, rel=1e-6)

    out = call(build_objective("dr_grpo", kl_coef=0.1), **inputs)  # same terms over B · T = 2
    assert out.loss.item() == pytest.approx((-2 + 0.1 * (1 - math.log(2))) / 2, rel=1e-6)
    out = call(build_objective("grpo"), **inputs)  # β = 0: the KL is reported, not added
    assert out.loss.item() == pytest.approx(-1.0) and out.metrics[KL_REF] > 0


def expected_kl_term(estimator: str, theta: torch.Tensor, old_logp: torch.Tensor, ref_logp: torch.Tensor):
    """E_{y ~ π_old}[KL term of the loss] and its gradient in the logits θ of π_θ = softmax(θ), exactly: the
    objective is called on each outcome y of the categorical alone (one response of one token, Â = 0 so that only
    the KL term is left) and the results are summed with weights π_old(y)."""
    theta = theta.detach().requires_grad_(True)
    logp = torch.log_softmax(theta, dim=0)
    objective = build_objective("grpo", kl_coef=1.0, kl_estimator=estimator)
    value = torch.zeros(())
    for y in range(theta.numel()):
        out = call(
            objective,
            logp=logp[y].view(1, 1),
            old_logp=old_logp[y].view(1, 1),
            advantages=torch.zeros(1),
            mask=torch.ones(1, 1),
            ref_logp=ref_logp[y].view(1, 1),
        )
        value = value + old_logp[y].exp() * out.loss
    (grad,) = torch.autograd.grad(value, theta)
    return value.detach(), grad


def exact_kl(p_logits: torch.Tensor, q_logits: torch.Tensor, grad_of: torch.Tensor):
    """KL(p ‖ q) of two categoricals given by logits, and its gradient in `grad_of` (one of the two, a leaf)."""
    p, log_p, log_q = p_logits.softmax(0), p_logits.log_softmax(0), q_logits.log_softmax(0)
    kl = (p * (log_p - log_q)).sum()
    (grad,) = torch.autograd.grad(kl, grad_of)
    return kl.detach(), grad


@pytest.mark.parametrize("policy", ["on", "off"])
def test_the_expected_kl_gradient_of_each_estimator(policy):
    """unbiased_k3 (DeepSeek-V3.2 eq. 7) follows the forward KL's gradient ∇KL(π_θ ‖ π_ref) for tokens sampled from
    π_old, on- and off-policy; plain k3 follows the reverse KL's, ∇KL(π_ref ‖ π_θ), on-policy, and neither off it.
    Exact expectations over a 5-outcome categorical, θ ≠ θ_ref, and θ ≠ θ_old off-policy (loss values alone cannot
    tell these apart: a ratio without gradient gives eq. 7's value with the reverse KL's gradient)."""
    theta = torch.tensor([0.3, -1.2, 0.8, 0.0, -0.4], requires_grad=True)
    ref = torch.tensor([-0.5, 0.4, 0.9, -1.0, 0.2])
    theta_old = theta.detach() if policy == "on" else torch.tensor([1.0, -0.3, -0.6, 0.5, 0.1])
    old_logp, ref_logp = theta_old.log_softmax(0), ref.log_softmax(0)
    forward_value, forward_grad = exact_kl(theta, ref, grad_of=theta)
    _, reverse_grad = exact_kl(ref, theta, grad_of=theta)
    assert (forward_grad - reverse_grad).abs().max() > 0.05, "the case must tell the two KLs apart"

    value, grad = expected_kl_term("unbiased_k3", theta, old_logp, ref_logp)
    assert value.item() == pytest.approx(forward_value.item(), rel=1e-5)
    torch.testing.assert_close(grad, forward_grad, rtol=1e-5, atol=1e-6)

    value, grad = expected_kl_term("k3", theta, old_logp, ref_logp)
    if policy == "on":
        assert value.item() == pytest.approx(forward_value.item(), rel=1e-5)
        torch.testing.assert_close(grad, reverse_grad, rtol=1e-5, atol=1e-6)
    else:
        assert (grad - forward_grad).abs().max() > 0.01 and (grad - reverse_grad).abs().max() > 0.01


def test_unbiased_kl_gradient_per_token_is_the_ratio_times_the_log_ratio_to_the_reference():
    """d[(π_θ/π_old)·k3]/d log π_θ = (π_θ/π_old)·(log π_θ − log π_ref): the ratio's own gradient included."""
    inputs = batch_from_ratios([[1.5, 1.0]], [0.0], width=2)
    ref_logp = inputs["logp"] + 0.3  # log(π_ref/π_θ) = 0.3 on both tokens
    out, grad = loss_and_grad(
        build_objective("grpo", kl_coef=1.0, kl_estimator="unbiased_k3"), {**inputs, "ref_logp": ref_logp}
    )
    k3 = math.exp(0.3) - 0.3 - 1
    assert out.loss.item() == pytest.approx((1.5 * k3 + k3) / 2, rel=1e-5)
    torch.testing.assert_close(grad, torch.tensor([[1.5, 1.0]]) * -0.3 / 2, **TOL)


def test_low_precision_and_integer_masks_are_accepted():
    inputs = ragged_batch()
    reference = call(build_objective("grpo"), **inputs)
    as_int = call(build_objective("grpo"), **{**inputs, "mask": inputs["mask"].long()})
    assert torch.equal(reference.loss, as_int.loss)
    bf16 = {**inputs, "logp": inputs["logp"].bfloat16(), "old_logp": inputs["old_logp"].bfloat16()}
    out = call(build_objective("gspo"), **bf16)
    assert out.loss.dtype == torch.float32
    assert out.metrics[SEQ_RATIO_MEAN] == 1.0 and out.metrics[TOKEN_RATIO_VAR] == 0.0


def test_hyperparameters_are_dataclass_fields_with_the_documented_defaults():
    defaults = {
        "grpo": dict(clip_low=0.2, clip_high=0.27, loss_agg="seq-mean-token-mean", kl_coef=0.0),
        "gspo": dict(clip_low=3e-4, clip_high=4e-4, kl_coef=0.0),
        "gspo_token": dict(clip_low=3e-4, clip_high=4e-4, kl_coef=0.0),
        "dr_grpo": dict(clip_low=0.2, clip_high=0.2, loss_agg="seq-mean-token-sum-norm", norm_tokens=None, kl_coef=0.0),
        "dapo": dict(clip_low=0.2, clip_high=0.28, loss_agg="token-mean", kl_coef=0.0),
        "cispo": dict(clip_low=None, clip_high=0.2, kl_coef=0.0),
        "gmpo": dict(clip_low=0.4, clip_high=0.4, kl_coef=0.0),
        "sapo": dict(tau_pos=1.0, tau_neg=1.05, kl_coef=0.0),
    }
    assert set(defaults) <= set(OBJECTIVES)
    for name, expected in defaults.items():
        objective = build_objective(name)
        expected = {**expected, "kl_estimator": "k3"}
        assert {f.name: getattr(objective, f.name) for f in fields(objective)} == expected, name
    with pytest.raises(FrozenInstanceError):
        build_objective("grpo").clip_low = 0.1
    integer_clip = build_objective("grpo", clip_low=0).clip_low
    assert integer_clip == 0.0 and isinstance(integer_clip, float)


def test_unknown_objective_lists_the_valid_names():
    with pytest.raises(ValueError, match="'ppo'; valid names: " + ", ".join(sorted(OBJECTIVES))):
        build_objective("ppo")


def test_unknown_hyperparameter_is_named_with_the_allowed_ones():
    with pytest.raises(ValueError, match="epsilon") as info:
        build_objective("gspo", epsilon=3e-4)
    assert "kl_coef, kl_estimator, clip_low, clip_high" in str(info.value)


@pytest.mark.parametrize(
    "name, hyperparameters, message",
    [
        ("grpo", dict(clip_low=-0.1), "clip_low must be >= 0, got -0.1"),
        ("dapo", dict(clip_high=-0.2), "clip_high must be >= 0, got -0.2"),
        ("gmpo", dict(clip_high=-0.4), "clip_high must be >= 0"),
        ("grpo", dict(clip_low=1.0), "clip_low must be < 1"),
        ("dr_grpo", dict(clip_low=1.5), "clip_low must be < 1"),
        ("gspo", dict(clip_low=1.0), "clip_low must be < 1"),
        ("gspo_token", dict(clip_low=2.0), "clip_low must be < 1"),
        ("cispo", dict(clip_low=1.0), "clip_low must be < 1"),
        ("grpo", dict(loss_agg="sum"), "loss_agg='sum' is not one of " + str([str(m) for m in LOSS_AGG_MODES])),
        ("sapo", dict(kl_coef=-0.01), "kl_coef must be >= 0, got -0.01"),
        ("sapo", dict(tau_pos=0.0), "tau_pos must be > 0, got 0.0"),
        ("sapo", dict(tau_neg=-1.0), "tau_neg must be > 0"),
        ("dr_grpo", dict(norm_tokens=0), "norm_tokens must be > 0"),
        ("dr_grpo", dict(norm_tokens=512, loss_agg="token-mean"), "norm_tokens = 512 is only used by"),
        ("grpo", dict(clip_low="0.2"), "clip_low='0.2' must be of type"),
        ("dr_grpo", dict(norm_tokens=1.5), "norm_tokens=1.5 must be of type"),
        ("gspo", dict(clip_high=float("nan")), "clip_high=nan must be finite"),
        ("gspo", dict(clip_high=None), "clip_high must not be None"),
    ],
)
def test_bad_hyperparameter_values_are_rejected(name, hyperparameters, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        build_objective(name, **hyperparameters)


def test_a_log_space_clip_may_exceed_one():
    assert build_objective("gmpo", clip_low=1.5).clip_low == 1.5


def test_kl_coef_without_ref_logp_is_rejected():
    with pytest.raises(ValueError, match="kl_coef = 0.1 > 0 needs ref_logp"):
        call(build_objective("grpo", kl_coef=0.1), **ragged_batch())


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(old_logp=torch.zeros(4, 5)), r"old_logp must have the shape of logp \(4, 6\), got \(4, 5\)"),
        (dict(mask=torch.ones(3, 6, dtype=torch.bool)), "mask must have the shape of logp"),
        (dict(ref_logp=torch.zeros(4, 7)), "ref_logp must have the shape of logp"),
        (dict(advantages=torch.zeros(4, 1)), r"advantages must have shape \[B\] = \(4,\)"),
        (dict(logp=torch.zeros(24)), r"logp must have shape \[B, T\]"),
        (dict(mask=torch.full((4, 6), 2.0)), "mask must be bool or hold only 0 and 1"),
        (dict(logp=torch.zeros(4, 6, dtype=torch.long)), "logp must be a floating-point tensor"),
        (dict(advantages=[1.0, 2.0, 3.0, 4.0]), "advantages must be a torch.Tensor"),
    ],
)
def test_bad_inputs_are_rejected_with_the_offender_named(change, message):
    with pytest.raises(ValueError, match=message):
        call(build_objective("grpo"), **{**ragged_batch(), **change})


def test_every_yaml_only_selects_its_objective_whose_defaults_compose():
    paths = sorted(CONF_ALGO.glob("*.yaml"))
    assert sorted(path.stem for path in paths) == sorted(OBJECTIVES)
    register_configs()
    for path in paths:
        name = path.stem
        assert OmegaConf.to_container(OmegaConf.load(path)) == {"defaults": [f"/schema/algo/{name}@_here_"]}
        with initialize_config_dir(config_dir=str(CONF_ALGO.parent), version_base="1.3"):
            config = OmegaConf.to_container(compose("train", overrides=[f"algo={name}"]).algo)
        assert config.pop("name") == name
        assert config.pop("advantage_std") is OBJECTIVES[name].advantage_std is (name not in ("dr_grpo", "minirl"))
        defaults = {f.name: f.default for f in fields(OBJECTIVES[name])}
        assert config == defaults, path.name
        # The dataclass must also work as an OmegaConf structured schema (what experiments/config.py builds).
        assert OmegaConf.to_container(OmegaConf.structured(OBJECTIVES[name])) == defaults


def test_the_documented_example_objective_registers_and_has_the_documented_gradient():
    """`Add an algorithm` in docs/extending.md is code a newcomer copies: it must run as printed."""
    readme = (Path(__file__).resolve().parents[1] / "docs" / "extending.md").read_text(encoding="utf-8")
    section = readme.split("## Add an algorithm", 1)[1]
    code = section.split("```python\n", 1)[1].split("```", 1)[0]
    try:
        exec(compile(code, "docs/extending.md", "exec"), {"__name__": "readme_example"})
        inputs = batch_from_ratios([[1.3, 0.7], [1.0]], [2.0, -1.0], width=2)  # ratios play no part
        out, grad = loss_and_grad(build_objective("reinforce"), inputs)
        torch.testing.assert_close(grad, torch.tensor([[-2 / 4, -2 / 4], [1 / 2, 0.0]]))  # -Â_i / (|y_i|·B)
        assert out.metrics[CLIP] == 0.0
    finally:
        OBJECTIVES._classes.pop("reinforce", None)
