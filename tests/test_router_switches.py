"""Router switches (`routers=[...]`, `algos.routers`): the balancing losses and the bias update against formulas by
hand, freezing, lagged replay (lag 0 is R2 bit for bit), what the bias does under replay, and every refusal."""

from __future__ import annotations

import copy
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from algos.objective import POLICY_LOSS, TOKEN_RATIO_VAR
from algos.routers import ROUTER_SWITCHES
from algos.routers.balancing import global_balance_loss, sequence_balance_loss
from algos.routers.bias_update import BIAS, ROUTE_CHANGE, TRAINED_ROUTE_CHANGE, update_biases
from algos.routers.lagged_replay import LAG
from experiments.config import register_configs
from experiments.step.metrics import DRIFT_PER_UPDATE, GRAD_NORM, REWARD
from experiments.step.scoring import ScoreOptions
from experiments.train import RLTrainer, train
from models.routing.hooks import RouterCalls
from models.routing.trace import find_routers
from tests.test_sigmoid_family import SIGMOID
from tests.test_train import compose_train, experts_used, first_step_inputs, read_metrics

CONF = Path(__file__).resolve().parents[1] / "conf"
GLM = ["model.architecture=glm4_moe", *(f"model.{key}={value}" for key, value in SIGMOID.items())]


def _softmax_router(top_k=2):
    return SimpleNamespace(top_k=top_k)


def _sigmoid_router(bias, top_k=1):
    return SimpleNamespace(
        top_k=top_k,
        e_score_correction_bias=torch.tensor(bias),
        num_group=1,
        topk_group=1,
        norm_topk_prob=True,
        routed_scaling_factor=1.0,
    )


# -- the losses by hand -------------------------------------------------------------------------------------------


def test_global_balance_loss_and_its_gradient_by_hand():
    """One layer, E = 3, top-1, three tokens, the last padding: f = (1/2, 1/2, 0) (the two real tokens choose 0 and
    1), P the mean softmax over the real tokens, L = E·Σ f·P; dL/dz_t,j = E·w_t/W · p_t,j (f_j − Σ_e f_e p_t,e)."""
    logits = torch.tensor([[2.0, 0.0, -1.0], [0.0, 1.0, 0.5], [5.0, 0.0, 0.0]], requires_grad=True)
    weights = torch.tensor([[1.0, 1.0, 0.0]])
    loss, value = global_balance_loss(RouterCalls([(_softmax_router(1), logits)], weights))
    p = torch.softmax(logits.detach(), -1)
    f = torch.tensor([0.5, 0.5, 0.0])
    P = p[:2].mean(0)
    assert value == pytest.approx(float(3 * (f * P).sum()))
    (grad,) = torch.autograd.grad(loss, logits)
    by_hand = 3 * 1.0 / 2 * p * (f - (p * f).sum(-1, keepdim=True))
    by_hand[2] = 0.0
    torch.testing.assert_close(grad, by_hand)


def test_sequence_balance_loss_by_hand_on_sigmoid_scores():
    """DeepSeek-V3 eqs. 17-20 per sequence, top-1 of E = 2, s' = s / Σ s: sequence 0 has two tokens both choosing
    expert 0 (f = (2, 0), L_0 = 2·P_0), sequence 1 one token choosing expert 1 (f = (0, 2), L_1 = 2·P_1); the loss is
    their mean. The bias chooses: token 2 has the lower score on expert 1 but a bias of 1 on it."""
    logits = torch.tensor([[1.0, 0.0], [2.0, -1.0], [0.5, 0.0], [0.0, 0.0]])
    router = _sigmoid_router([0.0, 1.0])
    weights = torch.tensor([[1.0, 1.0], [1.0, 0.0]])  # rows are sequences; the last token is padding
    _, value = sequence_balance_loss(RouterCalls([(router, logits)], weights))
    s = torch.sigmoid(logits)
    normal = s / s.sum(-1, keepdim=True)
    # with the bias, token 0 (s = .73, .5 + 1) and token 1 (.88, .27 + 1) choose expert 1 too: check the counts
    assert value == pytest.approx(float((2 * normal[:2, 1].mean() + 2 * normal[2, 1]) / 2))
    unbiased = _sigmoid_router([0.0, 0.0])
    _, plain = sequence_balance_loss(RouterCalls([(unbiased, logits)], weights))
    assert plain == pytest.approx(float((2 * normal[:2, 0].mean() + 2 * normal[2, 0]) / 2))


def test_the_bias_update_by_hand():
    """Top-1 of E = 3, four tokens choosing experts 0, 0, 0, 1: expert 0 is overloaded (3 > 4/3) and moves down by
    the rate, experts 1 and 2 up. A rate of 0.3 lets expert 1 overtake expert 0 for token 2, whose scores are close:
    one of the four activated experts changes, on an unreplayed token; replayed tokens are immune."""
    logits = torch.tensor([[5.0, -2.0, -3.0], [3.0, -1.0, -2.0], [0.2, 0.0, -2.0], [-1.0, 2.0, -2.0]])
    router = _sigmoid_router([0.0, 0.0, 0.0])
    weights = torch.ones(1, 4)
    metrics = update_biases(RouterCalls([(router, logits)], weights), rate=0.3, summed=lambda t: t)
    torch.testing.assert_close(router.e_score_correction_bias, torch.tensor([-0.3, 0.3, 0.3]))
    assert metrics[ROUTE_CHANGE] == pytest.approx(1 / 4) and metrics[TRAINED_ROUTE_CHANGE] == pytest.approx(1 / 4)
    assert metrics[BIAS] == pytest.approx(0.3)
    replayed = torch.tensor([[False, False, True, False]])  # token 2's experts were forced: the change is not trained
    router = _sigmoid_router([0.0, 0.0, 0.0])
    metrics = update_biases(RouterCalls([(router, logits)], weights, replayed), rate=0.3, summed=lambda t: t)
    assert metrics[ROUTE_CHANGE] == pytest.approx(1 / 4) and metrics[TRAINED_ROUTE_CHANGE] == 0.0


# -- through the loop ---------------------------------------------------------------------------------------------


def test_aux_loss_adds_its_coefficient_times_the_logged_loss(monkeypatch):
    """The update's loss is the objective's plus coef · the global-batch loss the step logs as moe/aux_loss."""
    trainer = RLTrainer(compose_train("routers=[aux_loss]", "routers.aux_loss.coef=0.5"))
    _, _, minibatches, old = first_step_inputs(trainer)
    seen = []
    backward = torch.Tensor.backward
    monkeypatch.setattr(
        torch.Tensor, "backward", lambda self, *a, **k: seen.append(float(self.detach())) or backward(self, *a, **k)
    )
    metrics = trainer.update(minibatches[0], old[0])
    assert seen[0] == pytest.approx(metrics[POLICY_LOSS] + 0.5 * metrics["moe/aux_loss"], rel=1e-5)


def test_freeze_keeps_the_routers_out_of_training():
    trainer = RLTrainer(compose_train("routers=[freeze]", "trainer.lr=5e-2"))
    routers = [router.weight for router in find_routers(trainer.model).values()]
    before = [weight.detach().clone() for weight in routers]
    optimized = {id(p) for group in trainer.optimizer.param_groups for p in group["params"]}
    assert not any(id(weight) in optimized for weight in routers)
    others = [p.detach().clone() for p in trainer.model.parameters() if p.requires_grad]
    trainer.step()
    assert all(torch.equal(a, b) for a, b in zip(routers, before)) and all(w.grad is None for w in routers)
    after = [p for p in trainer.model.parameters() if p.requires_grad]
    assert any(not torch.equal(a, b) for a, b in zip(after, others)), "the rest of the policy trains"


def test_lagged_replay_at_lag_0_is_r2_bit_for_bit(tmp_path):
    r2 = read_metrics(_run(tmp_path / "r2", "routing.replay=r2"))
    lag0 = read_metrics(
        _run(tmp_path / "lag0", "routing.replay=r2", "routers=[lagged_replay]", "routers.lagged_replay.lag=0")
    )
    for key in (POLICY_LOSS, TOKEN_RATIO_VAR, DRIFT_PER_UPDATE, REWARD, GRAD_NORM):
        assert [line[key] for line in lag0] == [line[key] for line in r2], key


def _run(run_dir, *overrides):
    train(compose_train("trainer.steps=2", "trainer.threads=1", *overrides), run_dir)
    return run_dir


def test_lagged_replay_replays_the_experts_of_the_weights_lag_updates_back(monkeypatch):
    """lag 1: in step 2 every update computes with the experts the policy routed to one applied update before
    θ_old (the weights after step 1's first update), on every fed position; in step 1 no update had been made, so
    the starting weights route (the lag served is 0)."""
    trainer = RLTrainer(
        compose_train(
            "routing.replay=r2",
            "routers=[lagged_replay]",
            "routers.lagged_replay.lag=1",
            "trainer.lr=5e-2",
            "trainer.minibatch_layout=rows",
        )
    )
    snapshots = []
    check = trainer._refuse_non_finite_weights  # runs right after each applied optimizer step
    monkeypatch.setattr(
        trainer,
        "_refuse_non_finite_weights",
        lambda update: snapshots.append(copy.deepcopy(trainer.model)) or check(update),
    )
    first = trainer.step()
    assert [mb[LAG] for mb in first["minibatches"]] == [0.0, 0.0]
    assert len(snapshots) == 2
    lagged = snapshots[0]  # one update before θ_old = the weights after step 1's last update
    _, _, minibatches, old = first_step_inputs(trainer)
    used, handles = experts_used(trainer.model)
    for mb, old_policy in zip(minibatches, old):
        with torch.no_grad():
            expected = trainer.score(lagged, mb, ScoreOptions(record=True)).routes
        assert torch.equal(old_policy.replay.experts, expected.experts)
        used.clear()
        metrics = trainer.update(mb, old_policy)
        assert metrics[LAG] == 1.0
        L, B, S, K = expected.shape
        fed = expected.recorded()[0].reshape(-1)
        routed = torch.stack(used[:L]).reshape(L, B * S, K)
        assert torch.equal(routed[:, fed], expected.experts.reshape(L, B * S, K)[:, fed].long())
    for handle in handles:
        handle.remove()


def test_lagged_replay_logs_the_lag_it_serves_while_its_history_fills(monkeypatch):
    """lag 3, two updates a step: step 2 replays the starting weights, 2 updates before θ_old, and step 3 the
    weights after the run's first update, 3 before. While the history filled, routers/replay_lag logged 0 in step
    2 (the served lag changed only when the oldest weights kept did), though 2 updates separated them from θ_old."""
    trainer = RLTrainer(
        compose_train("routing.replay=r2", "routers=[lagged_replay]", "routers.lagged_replay.lag=3", "trainer.lr=5e-2")
    )
    start = {name: tensor.clone() for name, tensor in trainer.model.state_dict().items()}
    snapshots = []
    check = trainer._refuse_non_finite_weights  # runs right after each applied optimizer step
    monkeypatch.setattr(
        trainer,
        "_refuse_non_finite_weights",
        lambda update: (
            snapshots.append({name: tensor.clone() for name, tensor in trainer.model.state_dict().items()})
            or check(update)
        ),
    )
    routed_with = []  # what the copy held when it routed, at every π_old pass
    serve = type(trainer.switches[0]).routing_model
    monkeypatch.setattr(
        type(trainer.switches[0]),
        "routing_model",
        lambda switch: (
            routed_with.append({name: tensor.clone() for name, tensor in serve(switch).state_dict().items()})
            or serve(switch)
        ),
    )
    served = [[mb[LAG] for mb in trainer.step()["minibatches"]] for _ in range(3)]
    assert served == [[0.0, 0.0], [2.0, 2.0], [3.0, 3.0]]
    assert len(routed_with) == 3 * 2  # one π_old pass per minibatch: the start in steps 1 and 2, then update 1's
    assert all(torch.equal(routed_with[2][name], start[name]) for name in start)
    assert all(torch.equal(routed_with[4][name], snapshots[0][name]) for name in start)
    assert not all(torch.equal(snapshots[0][name], start[name]) for name in start), "the first update moved weights"


@pytest.mark.parametrize("steps, minibatches, lag, refused", [(3, 2, 5, True), (3, 2, 4, False), (1, 4, 1, True)])
def test_a_lag_no_step_of_the_run_reaches_is_refused_at_start_up(tmp_path, steps, minibatches, lag, refused):
    """lag 5 in a run of 3 steps x 2 updates: θ_old of the last step is 4 updates from the start, so every update
    replayed the start's experts, silently (only history bounded the lag)."""
    cfg = compose_train(
        "routing.replay=r2",
        "routers=[lagged_replay]",
        f"routers.lagged_replay.lag={lag}",
        f"trainer.steps={steps}",
        f"trainer.minibatches={minibatches}",
    )
    if not refused:
        assert train(cfg, tmp_path)["status"] == "finished"
        assert read_metrics(tmp_path)[-1]["minibatches"][0][LAG] == lag, "the last step serves the lag asked for"
        return
    with pytest.raises(SystemExit) as raised:
        train(cfg, tmp_path)
    reached = (steps - 1) * minibatches
    assert (
        f"routers.lagged_replay lag={lag} is never served: the run makes {reached} optimizer updates before its "
        f"last step starts"
    ) in str(raised.value) and "\n" not in str(raised.value)
    assert not (tmp_path / "metrics.jsonl").exists()


def test_the_bias_moves_the_routers_own_routes_and_not_replayed_training_routes(tmp_path):
    """glm4_moe with the bias update: without replay what it moves is what the next update trains on; under r2 the
    off-policy minibatches are replayed, so none of what it moves there is trained on, while the router's own choice
    (the next rollout's) moves as much."""
    free = read_metrics(_run(tmp_path / "free", *GLM, "routers=[bias_update]", "routers.bias_update.rate=0.3"))
    replayed = read_metrics(
        _run(tmp_path / "r2", *GLM, "routers=[bias_update]", "routers.bias_update.rate=0.3", "routing.replay=r2")
    )
    assert all(
        mb[ROUTE_CHANGE] > 0 and mb[TRAINED_ROUTE_CHANGE] == mb[ROUTE_CHANGE]
        for line in free
        for mb in line["minibatches"]
    )
    off_policy = [mb for line in replayed for mb in line["minibatches"] if mb["minibatch"] > 0]
    assert all(mb[ROUTE_CHANGE] > 0 and mb[TRAINED_ROUTE_CHANGE] == 0.0 for mb in off_policy)
    assert replayed[-1][BIAS] > replayed[0][BIAS] > 0


# -- configuration and refusals -----------------------------------------------------------------------------------


def test_every_switch_is_a_yaml_that_only_selects_it_and_all_compose_at_once():
    names = sorted(path.stem for path in (CONF / "routers").glob("*.yaml"))
    assert names == sorted(ROUTER_SWITCHES)
    assert all(
        (CONF / "routers" / f"{name}.yaml").read_text().startswith(f"# @package routers.{name}\n")
        and OmegaConf.to_container(OmegaConf.load(CONF / "routers" / f"{name}.yaml"))
        == {"defaults": [f"/schema/routers/{name}@_here_"]}
        for name in names
    )
    register_configs()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        composed = OmegaConf.to_container(compose("train", overrides=[f"routers=[{','.join(names)}]"]).routers)
    assert composed == {
        name: {
            "name": name,
            **{
                key: ROUTER_SWITCHES[name].__dataclass_fields__[key].default for key in ROUTER_SWITCHES.parameters(name)
            },
        }
        for name in names
    }
    cfg = compose_train("arm=grpo_frozen_routers")
    assert (cfg.algo.name, list(cfg.routers)) == ("grpo", ["freeze"])


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["routers=[aux_loss]", "routers.aux_loss.coef=0"], "routers.aux_loss coef=0.0 must be in (0, 1]"),
        (
            ["routers=[bias_update]", *GLM, "routers.bias_update.rate=1.5"],
            "routers.bias_update rate=1.5 must be in (0, 1)",
        ),
        (
            ["routers=[bias_update]", *GLM, "routers.bias_update.seq_coef=-1"],
            "routers.bias_update seq_coef=-1.0 must be in [0, 1]",
        ),
        (
            ["routers=[bias_update]"],
            "routers.bias_update moves a selection bias, and model 'micro_moe' routes by softmax without one",
        ),
        (
            ["routers=[lagged_replay]", "routing.replay=r2", "routers.lagged_replay.lag=9"],
            "routers.lagged_replay lag=9 must be between 0 (R2) and history=8",
        ),
        (
            ["routers=[lagged_replay]", "routing.replay=r2", "routers.lagged_replay.lag=-1"],
            "routers.lagged_replay lag=-1 must be between 0 (R2) and history=8",
        ),
        (
            ["routers=[lagged_replay]"],
            "routers.lagged_replay moves R2's experts back by `lag` updates: use routing.replay=r2, not none",
        ),
        (
            ["routers=[lagged_replay]", "routing.replay=r2", "trainer.checkpoint_every=1"],
            "trainer.checkpoint_every=1 would resume another run",
        ),
        (
            ["routers=[lagged_replay]", "routing.replay=r2", "routing_variant=soft_replay"],
            "routing_variant=soft_replay changes replayed forwards: use routing_variant=none",
        ),
        (
            ["routers=[freeze]", "trainer.router_lr_scale=10"],
            "routers.freeze leaves the routers out of the optimizer, so trainer.router_lr_scale=10.0 would scale "
            "nothing",
        ),
        (
            ["trainer.router_lr_scale=0"],
            "trainer.router_lr_scale=0.0 must be a finite number > 0 (to freeze the routers: routers=[freeze])",
        ),
        (
            [
                "routers=[aux_loss]",
                "model=tiny_dense",
                "model.hidden_size=32",
                "model.num_hidden_layers=2",
                "model.head_dim=8",
                "model.intermediate_size=64",
            ],
            "routers=[aux_loss] act on MoE routers",
        ),
    ],
)
def test_what_a_switch_cannot_serve_is_refused_in_one_line(tmp_path, overrides, message):
    with pytest.raises(SystemExit) as raised:
        train(compose_train(*overrides), tmp_path)
    text = str(raised.value)
    assert message in text and "\n" not in text


@pytest.mark.parametrize("coef, refused", [(0.0, None), (0.05, "trainer.router_aux_loss_coef=0.05 there, absent here")])
def test_a_run_recorded_with_the_retired_aux_loss_coefficient_resumes_only_without_the_loss(coef, refused):
    """`trainer.router_aux_loss_coef` became `routers=[aux_loss]`: a run recorded at 0 trained as today's config does
    without the switch and resumes; one recorded with the loss on is another experiment than a resume without it,
    though today's config no longer holds the key that says so."""
    from experiments.run.resume import described, differences, settings

    today = compose_train()
    recorded = {**settings(today), "trainer.router_aux_loss_coef": coef}
    found = differences(recorded, today)
    assert (described(found) or None) == refused
