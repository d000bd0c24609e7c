"""The SYNTHETIC router noise (`routing.perturb_rate`, `models.routing.perturbation`): it moves the asked share of
activated experts on the tokens it is sized on, touches nothing but the routers, and unlike the flips the policy
carries it: the next rollout samples with it, the next step starts on-policy from it, and replay meets it."""

from __future__ import annotations

import re

import pytest
import torch

from experiments.step.metrics import DRIFT_PER_UPDATE, ENTROPY, PERTURB_FRAC, REWARD
from models.routing.hooks import record_routing
from models.routing.perturbation import moved_share, perturb_routers, router_inputs
from models.routing.trace import find_routers
from tests.test_routing import _batch, _forward

TEXTS = tuple(f"{a}+{b}={a + b}" for a in range(10, 90, 7) for b in range(3, 60, 11))  # 72 prompts, many tokens


def test_moved_share_counts_new_experts_per_token():
    before = torch.tensor([[0, 1], [2, 3]])
    assert moved_share(before, torch.tensor([[1, 0], [2, 3]])) == 0.0  # the same set, another order
    assert moved_share(before, torch.tensor([[0, 5], [4, 5]])) == 0.75


@pytest.mark.parametrize("rate", [0.05, 0.2])
def test_the_noise_moves_the_asked_share_of_experts_on_its_tokens_and_only_the_routers(micro_policy, rate):
    model, tokenizer = micro_policy
    ids, mask = _batch(tokenizer, TEXTS)
    untouched = {name: p.detach().clone() for name, p in model.named_parameters()}
    with torch.no_grad(), router_inputs(model) as inputs, record_routing(model) as before:
        _forward(model, ids, mask)
    done = perturb_routers(model, inputs, rate, torch.Generator().manual_seed(0))
    # every layer on its own captured inputs: about the asked share, never below it (the bisection keeps the upper
    # end of its bracket); a token's routes in later layers also change through earlier layers' new outputs
    assert all(rate <= moved < rate + 0.03 for moved in done.moved)
    valid = mask.bool()
    for layer, (name, router) in enumerate(find_routers(model).items()):
        rows = torch.cat(inputs[name])
        with torch.no_grad():
            assert moved_share(before.trace.experts[layer][valid].long(), router(rows)[2]) == done.moved[layer]
    routers = {f"{name}.weight" for name in find_routers(model)}
    for name, parameter in model.named_parameters():
        assert torch.equal(parameter, untouched[name]) != (name in routers), name


def test_rate_zero_leaves_the_weights_bit_for_bit(micro_policy):
    model, tokenizer = micro_policy
    ids, mask = _batch(tokenizer)
    untouched = [p.detach().clone() for p in model.parameters()]
    with torch.no_grad(), router_inputs(model) as inputs:
        _forward(model, ids, mask)
    assert perturb_routers(model, inputs, 0.0, torch.Generator()).share == 0.0
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), untouched))


def _run(tmp_path, name, *overrides):
    from experiments.train import train
    from tests.test_train import compose_train, read_metrics

    run_dir = tmp_path / name
    # lr 1e-4: an update's own drift is small beside the noise's
    summary = train(compose_train("trainer.steps=2", "trainer.threads=1", "trainer.lr=1e-4", *overrides), run_dir)
    return summary, read_metrics(run_dir)


def test_the_policy_carries_the_noise_and_replay_meets_it(tmp_path):
    _, plain = _run(tmp_path, "plain")
    summary, noisy = _run(tmp_path, "noisy", "routing.perturb_rate=0.2")
    _, r2 = _run(tmp_path, "r2", "routing.replay=r2", "routing.perturb_rate=0.2")
    assert summary["synthetic_perturb_rate"] == 0.2 and summary["first_minibatch_on_policy"]
    # step 1 samples before any noise; its update's drift includes the noise after minibatch 0's update
    assert noisy[0][REWARD] == plain[0][REWARD]
    assert noisy[0][DRIFT_PER_UPDATE] > plain[0][DRIFT_PER_UPDATE] + 0.1
    assert 0.2 <= noisy[0]["minibatches"][0][PERTURB_FRAC] < 0.25
    # step 2 samples with the perturbed routers (unlike the flips, which never reach a rollout)
    assert noisy[1][ENTROPY] != plain[1][ENTROPY]
    # and still starts on-policy: θ_old is the perturbed policy itself, so minibatch 0's π_old is its own update
    # forward and its ratios are exactly 1 by the hooks' wiring. The zero guards that wiring (the noise lands between
    # steps, never between π_old and the first update); it measures nothing.
    assert noisy[1]["minibatches"][0]["ratio/token_var"] == 0.0
    # R2 replays θ_old's experts within the step, but the next rollout is the perturbed policy's as for every arm
    assert r2[0][DRIFT_PER_UPDATE] > 0.1 and r2[1][ENTROPY] != plain[1][ENTROPY]


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["routing.perturb_rate=-0.1"], "routing.perturb_rate=-0.1 must be in [0, 1)"),
        (
            ["routing.perturb_rate=0.1", "model.architecture=qwen3"],
            "routing.perturb_rate=0.1 perturbs routers: needs an MoE",
        ),
    ],
)
def test_bad_perturbation_settings_are_refused_before_any_work(overrides, message):
    from experiments.step.checks import check_run
    from models.registry import ConfigError
    from tests.test_train import compose_train

    with pytest.raises(ConfigError, match=re.escape(message)):
        check_run(compose_train(*overrides))
    with pytest.raises(ConfigError, match="run it on one rank"):
        check_run(compose_train("routing.perturb_rate=0.1"), world=2)


def test_a_perturbation_rate_of_one_ends_the_run_in_one_line_before_any_step(tmp_path):
    from experiments.train import train
    from tests.test_train import compose_train

    with pytest.raises(SystemExit) as refused:
        train(compose_train("routing.perturb_rate=1.0"), tmp_path)
    assert not (tmp_path / "metrics.jsonl").exists()
    assert str(refused.value) == (
        "moe-rl-lab: routing.perturb_rate=1.0 must be in [0, 1) (the share of activated experts the router noise "
        "moves after each update)"
    )
