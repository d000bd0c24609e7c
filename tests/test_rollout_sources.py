"""The rollout sources behind `rollout.source` (experiments/step/sources): a setting that names no source, or belongs
to a source the run does not use, is refused in one line before any work; whether the engine is the trainer's own
module is decided once, in the plan, and the engine built is what the plan says; runs recorded before
`rollout.source` existed resume and are read as the source they ran; `Add a rollout source` in docs/extending.md
runs as printed. The lagged source's own behaviour is tests/test_async.py's, the concurrent source's
tests/test_concurrent.py's."""

from __future__ import annotations

from pathlib import Path

import pytest

from analysis.configs import as_today, schema_defaults
from experiments.run.resume import described, differences, settings
from experiments.step.checks import check_run
from experiments.step.metrics import ENGINE_VERSION, LAG, STEP
from experiments.step.sources import ROLLOUT_SOURCES
from experiments.step.trainer import RLTrainer
from experiments.train import train
from models.cpu_kernels import weights_sha256
from models.registry import ConfigError
from tests.test_train import compose_train, read_metrics


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


# -- runs recorded before rollout.source ------------------------------------------------------------------------------


def recorded_before_the_source(*overrides: str, concurrent: bool = False) -> dict:
    """The settings a run of `overrides` recorded before `rollout.source` and `rollout.overflow` existed, when
    `rollout.concurrent` named the concurrent sampler."""
    recorded = settings(compose_train(*overrides))
    del recorded["rollout.source"], recorded["rollout.overflow"]
    return {**recorded, "rollout.concurrent": concurrent}


@pytest.mark.parametrize(
    "then, concurrent, now, refused",
    [
        ([], False, [], None),
        (["rollout.lag=2"], False, ["rollout.source=lagged", "rollout.lag=2"], None),
        ([], True, ["rollout.source=concurrent"], None),
        # a sweep over lags under the lagged source continues its runs at lag 0, which were synchronous
        ([], False, ["rollout.source=lagged", "rollout.lag=0"], None),
        ([], False, ["rollout.source=concurrent"], "rollout.source='synchronous' there, 'concurrent' here"),
        ([], True, [], "rollout.source='concurrent' there, 'synchronous' here"),
    ],
)
def test_a_run_recorded_before_the_source_resumes_as_the_source_it_ran(then, concurrent, now, refused):
    found = differences(recorded_before_the_source(*then, concurrent=concurrent), compose_train(*now))
    assert (described(found) or None) == refused


def test_analysis_reads_a_run_recorded_before_the_source_as_the_source_it_ran():
    defaults = schema_defaults()
    old = {key: value for key, value in recorded_before_the_source().items() if key != "rollout.lag"}
    assert as_today({**old, "rollout.lag": 2}, defaults)["rollout.source"] == "lagged"
    assert as_today({**old, "rollout.concurrent": True}, defaults)["rollout.source"] == "concurrent"
    synchronous = as_today(old, defaults)
    assert synchronous["rollout.source"] == "synchronous" and "rollout.concurrent" not in synchronous
    assert synchronous["rollout.overflow"] == "wait", "added since: at the schema's default"


# -- the documented example ---------------------------------------------------------------------------------------


def test_the_documented_example_source_samples_every_step_with_the_start(tmp_path):
    """`Add a rollout source` in docs/extending.md is code a newcomer copies: it must run as printed, through the loop.
    Its engine is a copy that keeps the start's weights while the trainer's move, its rows are stamped version 0, and
    π_old is the trainer's recompute."""
    readme = (Path(__file__).resolve().parents[1] / "docs" / "extending.md").read_text(encoding="utf-8")
    code = readme.split("## Add a rollout source", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    try:
        exec(compile(code, "docs/extending.md", "exec", dont_inherit=True), {"__name__": "readme"})
        trainer = RLTrainer(compose_train("rollout.source=frozen", "trainer.lr=3e-2"))
        assert not trainer.plan.engine_is_trainer and trainer.plan.pi_old == "decoupled"
        assert "the engine samples with the start's weights: its numbers are not π_old's" == trainer.plan.why
        served = []
        for _ in range(3):
            record = trainer.step()
            served.append((record[ENGINE_VERSION], record[LAG]))
            assert weights_sha256(trainer.rollouts.engine.model) == trainer.start_sha256, "the engine kept the start"
        assert weights_sha256(trainer.model) != trainer.start_sha256, "the trainer's weights moved"
        assert served == [(0, 0), (0, 1), (0, 2)]
        summary = train(compose_train("rollout.source=frozen", "trainer.steps=2"), tmp_path / "run")
        assert summary["status"] == "finished" and summary["rollouts"].startswith("frozen: the engine samples")
        assert [row[STEP] for row in read_metrics(tmp_path / "run")] == [1, 2]
    finally:
        ROLLOUT_SOURCES._classes.pop("frozen", None)
