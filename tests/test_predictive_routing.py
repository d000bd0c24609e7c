"""Predictive Routing Replay (`routing_variant=predictive`, algos/routing_variants/predictive.py) against its definition
on the micro MoE: a predictor fitted to a planted drift predicts it, a zero predictor samples and trains as R3 bit for
bit, the first minibatch trains no predictor, the engine's predicted route is what training replays, the trainer's
forwards never route by a predictor, a lagged run routes with its own version's predictor and resumes exactly, and
what PR2 cannot serve is refused in one line before any work."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from algos.routing_variants import build_routing_variant
from algos.routing_variants.predictive import LOSS, PREDICTED_ACC, UNPREDICTED_ACC, topk_agreement
from experiments.step.engines import HFEngine, Sampling
from experiments.step.metrics import MINIBATCHES
from experiments.step.scoring import ScoreOptions
from experiments.step.trainer import RLTrainer
from experiments.train import train
from models.policy import ModelConfig, build_policy
from models.routing.families import selection_scores
from models.routing.predictor import add_predictors, predicted_route, predictors, without_predictors
from models.routing.trace import RoutingTrace, find_routers
from tests.conftest import MICRO_MODEL
from tests.test_sigmoid_family import SIGMOID, _move_biases
from tests.test_train import compose_train, experts_used, first_step_inputs, read_metrics, train_stopped_after

PR2 = ("routing.replay=r3", "routing_variant=predictive")


def _states(engine_router: torch.nn.Module, tokens: int, generator: torch.Generator) -> RoutingTrace:
    """What an engine records for one MoE layer: random router inputs, the engine router's logits and its own route."""
    inputs = torch.randn(tokens, engine_router.weight.shape[1], generator=generator)
    with torch.no_grad():
        logits, _, own = engine_router(inputs)
    return RoutingTrace(
        own[None, None], ("layer",), engine_router.num_experts, inputs=inputs[None, None], logits=logits[None, None]
    )


def test_a_predictor_fitted_to_a_planted_drift_predicts_it(micro_policy):
    """The router moves by a fixed D after the engine recorded its logits; fitted by PR2's loss (`Predictive.fit`, the
    current router the teacher) on random inputs, h·W_p recovers h·Dᵀ up to the per-token constant a softmax cannot
    see, and the engine's predicted route finds the moved router's top-k where its own route does not."""
    model, _ = micro_policy
    add_predictors(model)
    router = next(iter(find_routers(model).values()))
    engine = copy.deepcopy(router).requires_grad_(False)  # the router as the engine sampled with it
    generator = torch.Generator().manual_seed(0)
    drift = 0.5 * torch.randn(router.weight.shape, generator=generator)
    with torch.no_grad():
        router.weight.add_(drift)
    variant = build_routing_variant("predictive")
    optimizer = torch.optim.Adam(router.predictor.parameters(), lr=3e-2)
    for _ in range(400):
        fit = variant.fit([router], _states(engine, 256, generator), train=True, tokens=256, ranks=1)
        optimizer.zero_grad()
        fit.loss.backward()
        optimizer.step()
    trace = _states(engine, 4096, generator)
    inputs, logits, own = trace.inputs[0, 0], trace.logits[0, 0], trace.experts[0, 0]
    with torch.no_grad():
        centred = lambda change: change - change.mean(-1, keepdim=True)  # noqa: E731
        predicted_change, planted = centred(router.predictor(inputs)), centred(inputs @ drift.T)
        assert (predicted_change - planted).abs().max() < 0.05 * planted.abs().max()
        engine.predictor.load_state_dict(router.predictor.state_dict())  # the engine takes the trained version
        _, predicted = predicted_route(engine, inputs, logits, torch.zeros_like(own, dtype=torch.float32), own)
        moved = router(inputs)[2]
    assert topk_agreement(predicted, moved).mean() > 0.98 > 0.8 > topk_agreement(own, moved).mean()
    measured = variant.fit(
        [router],
        RoutingTrace(predicted[None, None], ("layer",), router.num_experts, inputs=trace.inputs, logits=trace.logits),
        train=False,
        tokens=4096,
        ranks=1,
    ).metrics(lambda total: total)
    assert measured[PREDICTED_ACC] > 0.98 > 0.8 > measured[UNPREDICTED_ACC]
    assert LOSS not in measured, "no loss is logged where none was trained"


@pytest.mark.parametrize("architecture", ["qwen3_moe", "deepseek_v3"])
def test_an_engine_with_zero_predictors_samples_bit_for_bit_as_without_them(architecture):
    """Both families: the sigmoid one's own top-k is unsorted, so only keeping the router's output where the predicted
    experts are its own makes the experts compute in the router's slot order, and the samples equal."""
    family = SIGMOID if architecture == "deepseek_v3" else {}
    model, tokenizer = build_policy(
        ModelConfig(**{**MICRO_MODEL, **family, "architecture": architecture, "experts_implementation": "eager"})
    )
    model.eval()
    if family:
        _move_biases(model)
    prompts, sampling = (
        ["12+34=", "7+8="],
        dict(group_size=3, max_new_tokens=6, temperature=1.0, record_routing=True, record_gates=True),
    )

    def sampled(predict: bool):
        torch.manual_seed(0)
        return HFEngine(model, tokenizer).sample(prompts, Sampling(**sampling, predict_routes=predict))

    plain = sampled(False)
    add_predictors(model)
    predicted = sampled(True)
    assert torch.equal(plain.input_ids, predicted.input_ids) and torch.equal(plain.logp, predicted.logp)
    for part in ("experts", "weights", "logprobs"):
        assert torch.equal(getattr(plain.routes, part), getattr(predicted.routes, part)), part
    assert plain.routes.inputs is None and predicted.routes.inputs is not None and predicted.routes.logits is not None
    # Where the predicted experts are the router's own, its output stays as it is: in its slot order (the sigmoid
    # family's top-k is unsorted, CUDA's in an order of its own) and with its own gate arithmetic.
    router = next(iter(find_routers(model).values()))
    inputs = torch.randn(16, router.weight.shape[1], generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        logits, weights, indices = router(inputs)
        kept = predicted_route(router, inputs, logits, weights.flip(-1), indices.flip(-1))
    assert torch.equal(kept[0], weights.flip(-1)) and torch.equal(kept[1], indices.flip(-1))


def test_at_its_zero_start_pr2_samples_and_trains_step_one_bit_for_bit_as_r3():
    r3, pr2 = RLTrainer(compose_train("routing.replay=r3")), RLTrainer(compose_train(*PR2))
    assert all(not predictor.weight.any() for predictor in predictors(pr2.model))
    plain, predicted = r3.step(), pr2.step()

    def same(mine: dict, theirs: dict) -> None:
        shared = [key for key in mine if key in theirs and not key.startswith("perf/") and key != MINIBATCHES]
        assert len(shared) > 30 and {key: mine[key] for key in shared} == {key: theirs[key] for key in shared}

    same(plain, predicted)
    for mine, theirs in zip(plain[MINIBATCHES], predicted[MINIBATCHES]):
        same(mine, theirs)
    assert PREDICTED_ACC in predicted and LOSS in predicted[MINIBATCHES][1]
    weights = without_predictors(pr2.model.state_dict())
    assert weights.keys() == r3.model.state_dict().keys()
    assert all(torch.equal(tensor, weights[name]) for name, tensor in r3.model.state_dict().items())


def test_the_first_minibatch_trains_no_predictor_and_the_second_its_kl_to_the_moved_router():
    trainer = RLTrainer(compose_train(*PR2, "trainer.lr=5e-2"))
    _, _, minibatches, old = first_step_inputs(trainer)
    mine = predictors(trainer.model)
    first = trainer.update(minibatches[0], old[0])
    assert LOSS not in first and PREDICTED_ACC in first
    assert all(predictor.weight.grad is None and not predictor.weight.any() for predictor in mine)
    # By hand, before the second update: Σ over layers of the mean over routed tokens of KL(softmax(z_θ) ‖
    # softmax(p_old)), the predictors being still zero, z_θ the router after one update on the engine's recorded inputs.
    states = minibatches[1].engine_routes
    routed = states.recorded()
    expected = 0.0
    with torch.no_grad():
        for layer, router in enumerate(find_routers(trainer.model).values()):
            current = router(states.inputs[layer][routed[layer]])[0].float()
            old_logits = states.logits[layer][routed[layer]].float()
            expected += F.kl_div(
                torch.log_softmax(old_logits, -1),
                torch.log_softmax(current, -1),
                log_target=True,
                reduction="batchmean",
            ).item()
    second = trainer.update(minibatches[1], old[1])
    assert second[LOSS] == pytest.approx(expected, rel=1e-5) and expected > 1e-4, "the routers moved: a loss to fit"
    assert all(predictor.weight.any() for predictor in mine), "the second update trained every predictor"


def test_the_engine_routes_by_its_predictors_only_while_it_samples_and_training_replays_that_route():
    trainer = RLTrainer(compose_train(*PR2, "trainer.minibatch_layout=rows"))
    assert trainer.rollouts.engine.shares_trainer_weights, "the engine samples with the trainer's own module"
    routers = list(find_routers(trainer.model).values())
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for predictor in predictors(trainer.model):
            predictor.weight.copy_(torch.randn(predictor.weight.shape, generator=generator))
    rollout, _, minibatches, old = first_step_inputs(trainer)
    assert not any(router._forward_hooks for router in routers), "no predicted routing outside the engine's sampling"
    routes, routed = rollout.routes, rollout.routes.recorded()
    with torch.no_grad():
        for layer, router in enumerate(routers):
            inputs, logits = routes.inputs[layer][routed[layer]], routes.logits[layer][routed[layer]]
            predicted = selection_scores(router, logits + router.predictor(inputs)).topk(router.top_k, -1).indices
            own = selection_scores(router, logits).topk(router.top_k, -1).indices
            recorded = routes.experts[layer][routed[layer]]
            assert (topk_agreement(recorded, predicted) == 1).all(), "the engine recorded the predicted route"
            assert (topk_agreement(recorded, own) < 1).any(), "and the prediction moved some tokens' experts"
    for mb, old_policy in zip(minibatches, old):
        assert torch.equal(old_policy.replay.experts, mb.engine_routes.experts)
        assert old_policy.replay.inputs is None, "a replayed forward carries no router states"
    # The trainer's own forward routes by its routers alone: as with every predictor at zero.
    mb = minibatches[1]
    own = trainer.score(trainer.model, mb, ScoreOptions(record=True)).routes.experts
    without = copy.deepcopy(trainer.model)
    for predictor in predictors(without):
        torch.nn.init.zeros_(predictor.weight)
    assert torch.equal(own, trainer.score(without, mb, ScoreOptions(record=True)).routes.experts)
    # The update computes with the engine's predicted route wherever it recorded one.
    used, handles = experts_used(trainer.model)
    trainer.update(mb, old[1])
    for handle in handles:
        handle.remove()
    replayed = mb.engine_routes
    for layer in range(len(routers)):
        where = replayed.recorded()[layer].reshape(-1)
        assert torch.equal(used[layer][where].long(), replayed.experts[layer].reshape(where.shape[0], -1)[where].long())


def test_under_a_lag_the_engine_routes_with_its_versions_predictor_and_a_killed_run_resumes_exactly(
    tmp_path, monkeypatch
):
    settings = [
        *PR2,
        "rollout.source=lagged",
        "rollout.lag=2",
        "trainer.steps=5",
        "trainer.checkpoint_every=1",
        "trainer.lr=3e-2",
        "trainer.save_checkpoint=true",
    ]
    served, made = {}, {}
    real_sample, real_publish = HFEngine.sample, RLTrainer.publish

    def sample(engine, prompts, sampling):
        if sampling.predict_routes:
            served[len(served) + 1] = [p.weight.detach().clone() for p in predictors(engine.model)]
        return real_sample(engine, prompts, sampling)

    def publish(trainer):
        made[trainer.step_index] = [p.weight.detach().clone() for p in predictors(trainer.model)]
        real_publish(trainer)

    monkeypatch.setattr(HFEngine, "sample", sample)
    monkeypatch.setattr(RLTrainer, "publish", publish)
    train(compose_train(*settings), tmp_path / "whole")
    monkeypatch.undo()
    for step, weights in served.items():
        version = step - 1 - 2
        expected = made[version] if version > 0 else [torch.zeros_like(w) for w in weights]
        assert all(torch.equal(mine, theirs) for mine, theirs in zip(weights, expected)), f"step {step}"
    assert any(weight.any() for weight in served[5]), "the engine routed with a trained predictor"
    exported = load_file(tmp_path / "whole" / "checkpoint" / "model.safetensors")
    assert exported and not any("predictor" in name for name in exported), "save_pretrained: the policy alone"

    train_stopped_after(3, compose_train(*settings), tmp_path / "killed", monkeypatch)
    train(compose_train(*settings, "resume=auto"), tmp_path / "killed")
    timeless = lambda rows: [{k: v for k, v in row.items() if not k.startswith("perf/")} for row in rows]  # noqa: E731
    whole = timeless(read_metrics(tmp_path / "whole"))
    assert timeless(read_metrics(tmp_path / "killed")) == whole and len(whole) == 5
    assert any(row[PREDICTED_ACC] != row[UNPREDICTED_ACC] for row in whole), "the prediction changed routes"


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            [
                "routing_variant=predictive",
                "model=tiny_dense",
                "model.hidden_size=32",
                "model.num_hidden_layers=2",
                "model.head_dim=8",
                "model.intermediate_size=64",
            ],
            "routing_variant=predictive changes how MoE routers route or weigh tokens, and model 'micro_moe' has no "
            "MoE "
            "layers",
        ),
        (
            [*PR2, "routing_variant.lr_scale=0"],
            "routing_variant=predictive lr_scale=0.0 must be a finite number > 0 (the predictors' learning rate as a "
            "multiple of trainer.lr)",
        ),
        ([*PR2, "routing_variant.lr_scale=-1"], "routing_variant=predictive lr_scale=-1.0 must be a finite number > 0"),
        (
            ["routing_variant=predictive"],
            "routing_variant=predictive replays the route the engine predicted, which only the engine's recording "
            "holds: "
            "use routing.replay=r3, not none",
        ),
        (["routing_variant=predictive", "routing.replay=r2"], "use routing.replay=r3, not r2"),
        (
            [*PR2, "trainer.minibatches=1"],
            "routing_variant=predictive trains its predictors from the second minibatch of a step on, and "
            "trainer.minibatches=1 has none: use trainer.minibatches >= 2",
        ),
    ],
)
def test_what_pr2_cannot_serve_is_refused_in_one_line_before_any_work(tmp_path, overrides, message):
    with pytest.raises(SystemExit) as raised:
        train(compose_train(*overrides), tmp_path)
    assert message in str(raised.value) and "\n" not in str(raised.value)
    assert not (tmp_path / "metrics.jsonl").exists()


def test_pr2_with_an_engine_that_routes_inside_its_kernels_is_refused(tmp_path, monkeypatch):
    from experiments.step.engines.vllm import VLLMEngine

    assert not VLLMEngine.routes_by_predictors
    monkeypatch.setattr(HFEngine, "routes_by_predictors", VLLMEngine.routes_by_predictors)  # vLLM, as the check sees it
    monkeypatch.setattr(HFEngine, "name", VLLMEngine.name)
    with pytest.raises(SystemExit) as raised:
        train(compose_train(*PR2), tmp_path)
    assert str(raised.value) == (
        "moe-rl-lab: routing_variant=predictive routes the engine by its routers' predictors, "
        "and rollout.engine=vllm routes inside its own kernels: use rollout.engine=hf"
    )
