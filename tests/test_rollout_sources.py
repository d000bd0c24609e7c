"""The rollout sources behind `rollout.source` (experiments/step/sources): a setting that names no source, or belongs
to a source the run does not use, is refused in one line before any work; whether the engine is the trainer's own
module is decided once, in the plan, and the engine built is what the plan says. The lagged source's own behaviour is
tests/test_async.py's, the concurrent source's tests/test_concurrent.py's."""

from __future__ import annotations

import pytest

from experiments.step.checks import check_run
from experiments.step.trainer import RLTrainer
from experiments.train import train
from models.registry import ConfigError
from tests.test_train import compose_train


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["rollout.source=async"], "rollout.source=async is not one of synchronous, lagged, concurrent"),
        (
            ["rollout.lag=2"],
            "rollout.lag=2 is a setting of rollout.source=lagged, and this run's source is synchronous: use "
            "rollout.source=lagged, or leave rollout.lag at 0",
        ),
        (
            ["rollout.max_staleness=3"],
            "rollout.max_staleness=3 is a setting of rollout.source=concurrent, and this run's source is synchronous",
        ),
        (
            ["rollout.source=lagged", "rollout.lag=2", "rollout.overflow=drop"],
            "rollout.overflow=drop is a setting of rollout.source=concurrent, and this run's source is lagged: use "
            "rollout.source=concurrent, or leave rollout.overflow at wait",
        ),
        (
            ["rollout.source=concurrent", "arm=minirl_pr2", "trainer.minibatches=2"],
            "routing_variant=predictive routes the engine by predictors the trainer adds to its model, which "
            "rollout.source=concurrent does not build: use rollout.source=lagged",
        ),
    ],
)
def test_a_setting_no_source_of_the_run_reads_is_refused_in_one_line_before_any_work(tmp_path, overrides, message):
    with pytest.raises(ConfigError, match=message):
        check_run(compose_train(*overrides), memory=False)
    with pytest.raises(SystemExit) as refused:
        train(compose_train(*overrides), tmp_path / "run")
    assert message in str(refused.value) and "\n" not in str(refused.value)
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


@pytest.mark.parametrize(
    "overrides, engine_is_trainer",
    [
        ([], True),
        (["rollout.precision=bf16"], False),  # an engine with numbers of its own: a copy
        (["rollout.source=lagged", "rollout.lag=0"], True),  # lag 0 is the synchronous loop
        (["rollout.source=lagged", "rollout.lag=2"], False),  # older weights: a copy
    ],
)
def test_the_engine_built_is_the_trainers_module_exactly_where_the_plan_says(overrides, engine_is_trainer):
    """The plan decides it once (`RolloutSource.engine_is_trainer`); where π_old comes from rests on it, and the engine
    the source builds must be what the plan says, or bypass would take a copy's numbers for π_old's."""
    trainer = RLTrainer(compose_train(*overrides))
    assert trainer.plan.engine_is_trainer is engine_is_trainer
    assert trainer.rollouts.engine.shares_trainer_weights is engine_is_trainer
    assert (trainer.rollouts.engine.model is trainer.model) is engine_is_trainer
    assert trainer.plan.pi_old == ("bypass" if engine_is_trainer else "decoupled")
