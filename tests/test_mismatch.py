"""Training–inference mismatch: engines that differ from the trainer on purpose, rollout corrections and MiniRL
against hand-computed values, the mismatch metrics, r3 under a mismatched engine, and the ratio decomposition."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from omegaconf import open_dict

from algos import build_objective
from algos.corrections import CorrectionInputs, build_correction
from algos.corrections.base import seq_frac, token_frac
from algos.minirl import TRUNCATED as MINIRL_TRUNCATED
from algos.objective import CLIP, POLICY_LOSS, TOKEN_RATIO_MEAN
from experiments.step.batch import collect_rollout
from experiments.step.engines import EngineNumerics, HFEngine, Sampling
from experiments.step.engines.hf import fake_quantize
from experiments.step.metrics import (
    CHI2_SEQ,
    CHI2_TOKEN,
    ENGINE_EXPERTS,
    ESS,
    EXTREME_TOKENS,
    IS_WEIGHT_MAX,
    IS_WEIGHT_MIN,
    MISMATCH_K1,
    MISMATCH_K3,
    ROUTING_SHARE,
    ROUTING_VAR,
    TOTAL_VAR,
    WEIGHTS_VAR,
    decomposition_metrics,
    mismatch_metrics,
)
from experiments.step.scoring import FED, ScoreOptions, score_responses
from experiments.step.trainer import RLTrainer
from experiments.tasks import build_task
from experiments.train import train
from models.routing.measures import routing_drift
from tests.test_objectives import batch_from_ratios, loss_and_grad
from tests.test_train import compose_train, experts_used, first_step_inputs, read_metrics


def inputs_from(rho: list[list[float]], advantages: list[float], theta: list[list[float]] | None = None):
    """CorrectionInputs of two-token rows whose mismatch ratios ρ (and π_θ/μ_old ratios) are given."""
    log_rho = torch.log(torch.tensor(rho))
    theta_log = torch.log(torch.tensor(theta)) if theta is not None else log_rho
    mask = torch.ones_like(log_rho, dtype=torch.bool)
    return CorrectionInputs(log_rho=log_rho, theta_log_ratio=theta_log, mask=mask, advantages=torch.tensor(advantages))


# -- corrections against hand-computed weights ---------------------------------------------------------------------


def test_tis_truncates_token_and_sequence_weights():
    inputs = inputs_from([[0.5, 3.0], [1.5, 1.2]], [1.0, -1.0])
    token = build_correction("tis", level="token", threshold=2.0)(inputs)
    torch.testing.assert_close(token.weight, torch.tensor([[0.5, 2.0], [1.5, 1.2]]))
    assert float(token.metrics[token_frac("truncated")]) == pytest.approx(1 / 4)
    sequence = build_correction("tis", level="sequence", threshold=2.0)(inputs)
    # products 1.5 and 1.8: both under C, broadcast to their tokens
    torch.testing.assert_close(sequence.weight, torch.tensor([[1.5, 1.5], [1.8, 1.8]]))
    assert float(sequence.metrics[seq_frac("truncated")]) == 0.0


def test_mis_masks_instead_of_truncating():
    inputs = inputs_from([[0.5, 3.0], [1.5, 1.2]], [1.0, -1.0])
    token = build_correction("mis", level="token", threshold=2.0)(inputs)
    torch.testing.assert_close(token.weight, torch.tensor([[0.5, 0.0], [1.5, 1.2]]))
    sequence = build_correction("mis", level="sequence", threshold=1.6)(inputs)  # products 1.5 (kept), 1.8 (masked)
    torch.testing.assert_close(sequence.weight, torch.tensor([[1.5, 1.5], [0.0, 0.0]]))
    assert float(sequence.metrics[seq_frac("masked")]) == 0.5


def test_icepop_keeps_the_band_and_masks_both_sides():
    inputs = inputs_from([[0.4, 0.6], [4.0, 6.0]], [1.0, 1.0])
    out = build_correction("icepop", low=0.5, high=5.0)(inputs)
    torch.testing.assert_close(out.weight, torch.tensor([[0.0, 0.6], [4.0, 0.0]]))
    assert float(out.metrics[token_frac("masked")]) == 0.5


def test_geometric_rejection_removes_whole_responses():
    # geometric means: sqrt(1.0 * 1.001) ≈ 1.0005 (kept), sqrt(1.01 * 1.01) = 1.01 (rejected)
    inputs = inputs_from([[1.0, 1.001], [1.01, 1.01]], [1.0, 1.0])
    out = build_correction("geo_rs", low=0.999, high=1.001)(inputs)
    torch.testing.assert_close(out.weight, torch.tensor([[1.0, 1.0], [0.0, 0.0]]))


def test_opsm_masks_only_negative_responses_the_policy_drifted_from():
    # mean log(μ_old/π_θ): row 0 −log 0.5 ≈ 0.69 > δ, row 1 the same but positive, row 2 0.05 < δ
    theta = [[0.5, 0.5], [0.5, 0.5], [0.95, 0.95]]
    inputs = inputs_from([[1.0, 1.0]] * 3, [-1.0, 1.0, -1.0], theta=theta)
    out = build_correction("opsm", delta=0.5)(inputs)
    torch.testing.assert_close(out.weight, torch.tensor([[0.0, 0.0], [1.0, 1.0], [1.0, 1.0]]))
    assert float(out.metrics[seq_frac("opsm_masked")]) == pytest.approx(1 / 3)


def test_a_correction_weight_scales_each_tokens_loss_and_gradient():
    """GRPO with weights w: every token's gradient is w_t times the unweighted one; the denominators stay."""
    inputs = batch_from_ratios([[1.1, 0.9], [1.0, 1.05]], [1.0, -1.0], width=2)
    weight = torch.tensor([[2.0, 0.0], [0.5, 1.0]])
    plain_out, plain = loss_and_grad(build_objective("grpo"), inputs)
    weighted_out, weighted = loss_and_grad(build_objective("grpo"), {**inputs, "weight": weight})
    torch.testing.assert_close(weighted, plain * weight)
    assert weighted_out.loss != plain_out.loss


def test_minirl_loss_and_gradient_by_hand():
    """J = (1/B) Σ_i Σ_t M_t · sg[min(π_θ/μ_old, 5)] · Â_i · log π_θ: gradient −M_t·w_t·Â_i / B per token."""
    inputs = batch_from_ratios([[1.1, 1.5], [0.7, 1.0]], [1.0, -1.0], width=2)  # ratios against π_old
    # μ_old differs from π_old: π_θ/μ_old = 8 (truncated to 5) for token (0, 0), 2 elsewhere
    rollout_logp = inputs["logp"] - math.log(2.0)
    rollout_logp[0, 0] = inputs["logp"][0, 0] - math.log(8.0)
    out, grad = loss_and_grad(build_objective("minirl"), {**inputs, "rollout_logp": rollout_logp})
    # token (0, 1): Â > 0 and r = 1.5 > 1.27 → masked; token (1, 0): Â < 0 and r = 0.7 < 0.8 → masked
    expected = torch.tensor([[-5.0 * 1.0 / 2, 0.0], [0.0, -2.0 * -1.0 / 2]])
    torch.testing.assert_close(grad, expected)
    logp = inputs["logp"]
    expected_loss = -(5.0 * 1.0 * logp[0, 0] + 2.0 * -1.0 * logp[1, 1]) / 2
    assert float(out.loss.detach()) == pytest.approx(float(expected_loss), rel=1e-5)
    assert out.metrics[CLIP] == 0.5 and out.metrics[MINIRL_TRUNCATED] == 0.25


def test_minirl_without_the_staleness_mask_keeps_every_token():
    inputs = batch_from_ratios([[1.1, 1.5], [0.7, 1.0]], [1.0, -1.0], width=2)
    rollout_logp = inputs["logp"] - math.log(2.0)
    out, grad = loss_and_grad(build_objective("minirl", mask_stale=False), {**inputs, "rollout_logp": rollout_logp})
    torch.testing.assert_close(grad, torch.tensor([[-1.0, -1.0], [1.0, 1.0]]))  # −w·Â/B with w = 2 everywhere
    assert out.metrics[CLIP] == 0.0


def test_minirl_without_train_inference_is_weighs_by_staleness_only():
    """The ablation's weight is min(π_θ/π_old, 5): the engine's numbers leave the gradient."""
    inputs = batch_from_ratios([[1.1, 1.2], [0.9, 1.0]], [1.0, -1.0], width=2)
    rollout_logp = inputs["logp"] - math.log(3.0)  # π_θ/μ_old = 3 everywhere
    _, grad = loss_and_grad(build_objective("minirl", train_infer_is=False), {**inputs, "rollout_logp": rollout_logp})
    expected = -torch.tensor([[1.1, 1.2], [0.9, 1.0]]) * torch.tensor([[1.0], [-1.0]]) / 2
    torch.testing.assert_close(grad, expected)
    _, corrected = loss_and_grad(build_objective("minirl"), {**inputs, "rollout_logp": rollout_logp})
    torch.testing.assert_close(corrected, expected * 3.0 / torch.tensor([[1.1, 1.2], [0.9, 1.0]]))


def test_mismatch_metrics_by_hand():
    log_rho = torch.log(torch.tensor([[2.0, 0.5], [1.0, 1.0]]))
    mask = torch.tensor([[True, True], [True, False]])
    m = mismatch_metrics(log_rho, mask)
    rho = torch.tensor([2.0, 0.5, 1.0])
    assert m[MISMATCH_K1] == pytest.approx(float(-torch.log(rho).mean()))
    assert m[MISMATCH_K3] == pytest.approx(float((rho - 1 - torch.log(rho)).mean()))
    assert m[CHI2_TOKEN] == pytest.approx(float((rho**2).mean() - 1))
    assert m[CHI2_SEQ] == pytest.approx(((2.0 * 0.5) ** 2 + 1.0) / 2 - 1)
    assert m[ESS] == pytest.approx(float(rho.mean() ** 2 / (rho**2).mean()))
    assert m[EXTREME_TOKENS] == pytest.approx(0.0), "ln 2 exactly is not beyond ln 2"
    assert (m[IS_WEIGHT_MIN], m[IS_WEIGHT_MAX]) == pytest.approx((0.5, 2.0))


# -- engines that differ from the trainer ----------------------------------------------------------------------------


def _engine_logp(micro_policy, numerics, seed=0):
    model, tokenizer = micro_policy
    task = build_task("addition", digits=2, train_size=50, test_size=10)
    engine = HFEngine(model, tokenizer, numerics=numerics, seed=seed)
    torch.manual_seed(0)
    rollout = collect_rollout(engine, task, task.examples("train")[:6], Sampling(4, 6, 1.0, record_routing=True))
    with torch.no_grad():
        trainer = score_responses(model, rollout, 1.0, ScoreOptions(record=True))
    seen = rollout.attention_mask[:, FED].bool()
    drift = routing_drift(trainer.routes, rollout.routes.positions(FED), seen)
    log_rho = trainer.logp - rollout.logp
    return mismatch_metrics(log_rho, rollout.response_mask)[MISMATCH_K3], drift.expert_change_frac


def test_an_engine_copy_with_every_setting_off_reproduces_the_trainer(micro_policy):
    kl, experts = _engine_logp(micro_policy, EngineNumerics())
    assert kl < 1e-10 and experts == 0.0


@pytest.mark.parametrize(
    "smaller, larger",
    [
        (EngineNumerics(router_noise=0.05), EngineNumerics(router_noise=1.0)),
        (EngineNumerics(weight_quant="int8"), EngineNumerics(weight_quant="fp8")),
        (EngineNumerics(), EngineNumerics(precision="bf16")),
    ],
)
def test_the_mismatch_is_there_and_grows_with_the_setting(micro_policy, smaller, larger):
    kl_small, _ = _engine_logp(micro_policy, smaller)
    kl_large, experts_large = _engine_logp(micro_policy, larger)
    assert kl_large > 1e-8 and kl_large > kl_small
    if larger.router_noise:
        assert experts_large > _engine_logp(micro_policy, smaller)[1]


def test_fake_quantization_is_per_output_channel():
    weight = torch.tensor([[1.0, 0.5, -0.26], [100.0, 1.0, 0.0]])
    q = fake_quantize(weight, "int8")
    assert torch.allclose(q[0], torch.round(weight[0] / (1 / 127)) * (1 / 127))
    assert q[1, 1] == pytest.approx(100 / 127), "row 1's scale is its own max / 127: its small values are coarse"


def test_the_engine_copy_takes_the_trainers_weights_after_a_step(tmp_path):
    trainer = RLTrainer(compose_train("rollout.precision=bf16", "trainer.lr=5e-2"))
    engine = trainer.rollouts.engine
    assert not engine.shares_trainer_weights and trainer.plan.pi_old == "decoupled"
    trainer.step()
    for (name, mine), (_, theirs) in zip(engine.model.named_parameters(), trainer.model.named_parameters()):
        assert mine.dtype == torch.bfloat16 and torch.equal(mine, theirs.to(torch.bfloat16)), name


# -- in the loop --------------------------------------------------------------------------------------------------


def test_with_the_trainers_own_engine_mismatch_is_zero_and_decoupled_equals_bypass(tmp_path):
    runs = {}
    for pi_old in ("bypass", "decoupled"):
        train(compose_train(f"trainer.pi_old={pi_old}", "trainer.steps=2"), tmp_path / pi_old)
        runs[pi_old] = read_metrics(tmp_path / pi_old)
    for bypass, decoupled in zip(runs["bypass"], runs["decoupled"]):
        assert bypass[MISMATCH_K3] < 1e-9 and decoupled[MISMATCH_K3] < 1e-9
        for a, b in zip(bypass["minibatches"], decoupled["minibatches"]):
            assert a[POLICY_LOSS] == pytest.approx(b[POLICY_LOSS], abs=1e-5)
            assert a[TOKEN_RATIO_MEAN] == pytest.approx(b[TOKEN_RATIO_MEAN], abs=1e-5)


def test_a_mismatched_engine_is_measured_corrected_and_recorded(tmp_path):
    summary = train(compose_train("rollout.router_noise=0.5", "correction=tis", "trainer.steps=2"), tmp_path)
    assert summary["pi_old"] == "decoupled" and summary["correction"] == "tis"
    assert "router_noise=0.5" in summary["engine_numerics"]
    line = read_metrics(tmp_path)[0]
    assert line[MISMATCH_K3] > 0 and line[ENGINE_EXPERTS] > 0
    assert all(token_frac("truncated") in mb for mb in line["minibatches"])


def test_r3_under_a_mismatched_engine_replays_the_engines_experts():
    trainer = RLTrainer(compose_train("routing.replay=r3", "rollout.router_noise=1.0", "trainer.lr=5e-2"))
    _, _, minibatches, old = first_step_inputs(trainer)
    used, handles = experts_used(trainer.model)
    from models.shared_prefix import SharedPrefix

    noisy_somewhere = False
    for mb, old_policy in zip(minibatches, old):
        used.clear()
        trainer.update(mb, old_policy)
        L, B, S, K = mb.engine_routes.shape
        fed = mb.attention_mask[:, FED]
        packing = SharedPrefix.from_rows(fed, mb.prompt_width - 1, trainer.cfg.trainer.group_size, torch.float32)
        routed = packing.unpack(torch.stack(used).reshape(L, packing.groups, packing.length, K), dim=1)
        valid = fed.reshape(-1).bool()
        engine = mb.engine_routes.experts.reshape(L, B * S, K).long()[:, valid]
        assert torch.equal(routed.reshape(L, B * S, K)[:, valid], engine)
        noisy_somewhere |= old_policy.routes is not None and not torch.equal(
            old_policy.routes.experts.reshape(L, B * S, K).long()[:, valid], engine
        )
    for handle in handles:
        handle.remove()
    assert noisy_somewhere, "the engine's noise must have chosen other experts than the trainer somewhere"


@pytest.mark.parametrize("replay", ["none", "r2"])
def test_the_decomposition_parts_sum_to_the_total_log_ratio(tmp_path, replay):
    trainer = RLTrainer(compose_train(f"routing.replay={replay}", "routing.decompose_every=1", "trainer.lr=5e-2"))
    _, _, minibatches, old = first_step_inputs(trainer)
    trainer.update(minibatches[0], old[0])
    mb = minibatches[1]
    with torch.no_grad():
        own = trainer.score(trainer.model, mb).logp
        theta_old = old[1].replay if old[1].replay is not None else old[1].routes
        replayed = trainer.score(trainer.model, mb, ScoreOptions(replay=theta_old)).logp
    routing, weights = own - replayed, replayed - old[1].logp
    mask = mb.response_mask
    torch.testing.assert_close((routing + weights)[mask], (own - old[1].logp)[mask], rtol=0, atol=1e-6)
    assert float(routing[mask].abs().max()) > 0, "a large update moves the routing: the routing part is not empty"
    metrics = trainer.update(mb, old[1])
    expected = decomposition_metrics(routing, weights, mask)
    for name in (ROUTING_VAR, WEIGHTS_VAR, TOTAL_VAR, ROUTING_SHARE):
        assert metrics[name] == pytest.approx(expected[name], rel=1e-4, abs=1e-9)


# -- bad input ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["correction=tis", "correction.threshold=0"], "correction tis: threshold must be > 0"),
        (["correction=icepop", "correction.low=5", "correction.high=1"], "needs 0 <= low < high"),
        (["correction=icepop", "correction.low=-1"], "needs 0 <= low < high"),
        (["correction=opsm", "correction.delta=-0.1"], "delta must be >= 0"),
        (["rollout.router_noise=-1"], "rollout.router_noise=-1.0 must be a finite number >= 0"),
        (["correction=tis", "trainer.pi_old=bypass"], "which trainer.pi_old=bypass makes 1"),
        (["algo=minirl", "correction=tis"], "would weigh the mismatch twice"),
        (["rollout.weight_quant=int8", "model.moe_backend=torch_dmoe"], "use model.moe_backend=hf"),
    ],
)
def test_bad_mismatch_settings_are_refused_in_one_line(tmp_path, overrides, message):
    with pytest.raises(SystemExit) as raised:
        train(compose_train(*overrides), tmp_path)
    assert message in str(raised.value) and "\n" not in str(raised.value)


@pytest.mark.parametrize("override", ["rollout.precision=fp4", "rollout.weight_quant=int4", "correction=tis2"])
def test_unknown_engine_settings_and_corrections_fail_at_composition(override):
    with pytest.raises(Exception, match=override.split("=")[1]):
        compose_train(override)


def test_an_engine_without_log_probs_cannot_feed_a_correction(monkeypatch):
    from experiments.step import trainer as trainer_module

    monkeypatch.setattr(trainer_module.HFEngine, "returns_logprobs", False)
    with pytest.raises(Exception, match="read μ_old's log-probs, which rollout.engine=hf does not return"):
        trainer_module.check_run(compose_train("correction=opsm"))


def _readme_recipe(title: str) -> str:
    readme = (Path(__file__).resolve().parents[1] / "docs" / "extending.md").read_text(encoding="utf-8")
    return readme.split(f"## {title}", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]


def test_the_documented_example_correction_weighs_by_the_untruncated_ratio_and_runs_in_the_loop(tmp_path):
    """`Add a correction` in docs/extending.md is code a newcomer copies: it must run as printed, and through the
    loop."""
    from algos.corrections import CORRECTIONS

    try:
        # dont_inherit: the recipe's module has no `from __future__ import annotations`, this one does
        code = compile(_readme_recipe("Add a correction"), "docs/extending.md", "exec", dont_inherit=True)
        exec(code, {"__name__": "readme"})
        inputs = inputs_from([[4.0, 0.5], [1.0, 30.0]], [1.0, -1.0])
        out = build_correction("plain_is")(inputs)
        torch.testing.assert_close(out.weight, torch.tensor([[4.0, 0.5], [1.0, 30.0]]))
        assert out.metrics[token_frac("upweighted")] == pytest.approx(2 / 4)  # 4 and 30: ρ > 1, log ρ > 0
        assert out.metrics[seq_frac("upweighted")] == pytest.approx(1.0)
        capped = build_correction("plain_is", max_log_weight=math.log(2.0))(inputs)
        torch.testing.assert_close(capped.weight, torch.tensor([[2.0, 0.5], [1.0, 2.0]]))
        with pytest.raises(Exception, match="max_log_weight must be > 0"):
            build_correction("plain_is", max_log_weight=0.0)
        cfg = compose_train("rollout.router_noise=0.5", "trainer.steps=1")
        with open_dict(cfg):
            cfg.correction = {"name": "plain_is", "max_log_weight": 10.0}
        summary = train(cfg, tmp_path)
        assert summary["correction"] == "plain_is" and summary["pi_old"] == "decoupled"
        assert all(token_frac("upweighted") in mb for mb in read_metrics(tmp_path)[0]["minibatches"])
    finally:
        CORRECTIONS._classes.pop("plain_is", None)
