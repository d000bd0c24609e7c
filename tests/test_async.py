"""Asynchronous RL on the micro MoE: the lagged source's exact lag (`rollout.source=lagged rollout.lag=k`,
experiments/step/sources/lagged.py, versions.py) serves the engine the weights of k versions before θ_old, R3 replays
the stale engine's routes, and bad lags are refused before any work."""

from __future__ import annotations

import pytest
import torch

from experiments.step.checks import check_run
from experiments.step.engines import HFEngine
from experiments.step.metrics import ENGINE_EXPERTS, ENGINE_GATES, ENGINE_VERSION, LAG, STEP
from experiments.step.old_policy import Recompute
from experiments.step.trainer import RLTrainer
from experiments.step.versions import WeightVersions
from experiments.train import train
from models.cpu_kernels import weights_sha256
from models.registry import ConfigError
from tests.test_train import compose_train, read_metrics

LAGGED = ["rollout.source=lagged"]


class Watched:
    """The sha256 of the trainer's weights after every step (version t after step t; version 0 the start) and of the
    engine's weights at every rollout, by step."""

    def __init__(self, monkeypatch) -> None:
        self.versions: dict[int, str] = {}
        self.engine: dict[int, str] = {}
        self.routes: dict[int, tuple] = {}  # step -> (the engine's recorded routes, what the π_old pass replayed)
        watched = self
        real_init, real_publish, real_sample = RLTrainer.__init__, RLTrainer.publish, HFEngine.sample

        def init(trainer, *args, **kwargs):
            real_init(trainer, *args, **kwargs)
            watched.versions[0] = weights_sha256(trainer.model)
            watched.trainer = trainer

        def publish(trainer):
            watched.versions[trainer.step_index] = weights_sha256(trainer.model)
            real_publish(trainer)

        def sample(engine, prompts, sampling):
            if engine is watched.trainer.rollouts.engine:
                watched.engine[watched.trainer.step_index] = weights_sha256(engine.model)
            return real_sample(engine, prompts, sampling)

        monkeypatch.setattr(RLTrainer, "__init__", init)
        monkeypatch.setattr(RLTrainer, "publish", publish)
        monkeypatch.setattr(HFEngine, "sample", sample)


@pytest.mark.parametrize("lag", [1, 2])
def test_under_a_lag_the_engine_samples_with_the_trainers_weights_k_versions_before_theta_old(
    tmp_path, monkeypatch, lag
):
    watched = Watched(monkeypatch)
    train(compose_train("trainer.steps=5", *LAGGED, f"rollout.lag={lag}"), tmp_path / "run")
    assert len(set(watched.versions.values())) == 6, "every step moved the weights: the versions are told apart"
    for step, sha in watched.engine.items():
        assert sha == watched.versions[max(0, step - 1 - lag)], f"step {step}"
    logged = read_metrics(tmp_path / "run")
    assert [row[LAG] for row in logged] == [min(lag, row[STEP] - 1) for row in logged]
    assert [row[ENGINE_VERSION] for row in logged] == [max(0, row[STEP] - 1 - lag) for row in logged]


@pytest.mark.parametrize("source", [[], [*LAGGED, "rollout.lag=0"]], ids=["synchronous", "lagged at 0"])
def test_without_a_lag_the_engine_is_the_trainer_and_nothing_is_logged_of_one(tmp_path, monkeypatch, source):
    watched = Watched(monkeypatch)
    train(compose_train("trainer.steps=3", *source), tmp_path / "run")
    engine = watched.trainer.rollouts.engine
    assert engine.shares_trainer_weights and not watched.trainer.rollouts.held()
    assert all(sha == watched.versions[step - 1] for step, sha in watched.engine.items())
    assert all(LAG not in row for row in read_metrics(tmp_path / "run"))


def test_r3_under_a_lag_replays_the_stale_engines_recorded_routes(tmp_path, monkeypatch):
    """The π_old recompute and the update replay exactly the routes the engine recorded while it sampled, k versions
    behind, and those differ from what θ_old's routers choose (else the test could not tell them apart)."""
    replayed = []
    real_call = Recompute.__call__

    def recompute(source, mb):
        old = real_call(source, mb)
        replayed.append((mb.engine_routes, old.replay, mb))
        return old

    monkeypatch.setattr(Recompute, "__call__", recompute)
    train(
        compose_train("trainer.steps=4", *LAGGED, "rollout.lag=2", "routing.replay=r3", "trainer.lr=3e-2"),
        tmp_path / "run",
    )
    assert replayed
    for engine_routes, replay, _ in replayed:
        assert replay is engine_routes and engine_routes is not None
    logged = read_metrics(tmp_path / "run")
    assert logged[0][ENGINE_EXPERTS] == 0 and logged[0][ENGINE_GATES] < 1e-5, "step 1 samples with θ_old itself"
    assert all(row[ENGINE_EXPERTS] > 0 and row[ENGINE_GATES] > 0 for row in logged[1:]), (
        "the stale engine's routes differ from θ_old's, in experts and in gate mass"
    )


def test_weight_versions_keep_what_the_engine_will_still_sample_with():
    versions = WeightVersions(2, {"w": torch.zeros(1)})
    served = [versions.publish(step, {"w": torch.full((1,), float(step))}) for step in range(1, 6)]
    assert [None if s is None else int(s["w"]) for s in served] == [None, None, 1, 2, 3]
    assert sorted(versions.state()) == [3, 4, 5] and versions.served == 3
    with pytest.raises(RuntimeError, match="version 7 published after version 5"):
        versions.publish(7, {"w": torch.zeros(1)})
    restored = WeightVersions(2, {"w": torch.zeros(1)})
    assert int(restored.restore(versions.state())["w"]) == 3 and sorted(restored.state()) == [3, 4, 5]
    with pytest.raises(ValueError, match="not the consecutive versions"):
        restored.restore({version: value for version, value in versions.state().items() if version != 4})


@pytest.mark.parametrize(
    "overrides, message",
    [
        ([*LAGGED, "rollout.lag=-1"], "rollout.lag=-1 must be >= 0"),
        ([*LAGGED, "rollout.lag=3"], "rollout.lag=3 is never reached in trainer.steps=3"),
    ],
)
def test_a_lag_the_run_cannot_serve_is_refused_before_any_work(tmp_path, overrides, message):
    with pytest.raises(ConfigError, match=message):
        check_run(compose_train(*overrides), memory=False)
    with pytest.raises(SystemExit, match=message):
        train(compose_train(*overrides), tmp_path / "run")
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


@pytest.mark.parametrize(
    "arm, pi_old, first_on_policy, correction",
    [
        ("grpo_naive_async", "bypass", False, "none"),  # π_old := μ_old, the stale engine's: no minibatch is on-policy
        ("grpo_decoupled", "decoupled", True, "tis"),  # π_old recomputed at θ_old, π_old/μ_old capped
        ("minirl", "decoupled", True, "none"),  # the weight against μ_old inside the objective, the mask against π_old
    ],
)
def test_the_async_arms_name_their_three_policies_under_a_lag(arm, pi_old, first_on_policy, correction):
    parts = check_run(compose_train(f"arm={arm}", *LAGGED, "rollout.lag=2"), memory=False)
    assert parts.plan.pi_old == pi_old and not parts.plan.engine_is_trainer
    assert parts.plan.first_minibatch_on_policy == first_on_policy
    assert parts.correction.name == correction
    assert "2 versions behind θ_old" in parts.plan.why
