"""The drift probe (`python -m experiments.probe`) on the micro MoE: a setting per learning rate with the drift after
one update per layer, the routing share and the routers' margins; the engine-precision entries; bad settings."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
from hydra import compose, initialize_config_dir

from experiments.config import PROJECT_ROOT
from experiments.probe import PHASE as PROBE_PHASE
from experiments.probe import SETTING_STEP as PROBE_SETTING_STEP
from experiments.probe import run_probe
from experiments.step.metrics import (
    DRIFT_PER_UPDATE,
    ENGINE_EXPERTS,
    MARGIN,
    ROUTING_SHARE,
    STEP,
    TOPK_MARGIN_MEDIAN,
    TOPK_MARGIN_SMALL,
)
from tests.conftest import MICRO_RUN

PROBE_RUN = [o for o in MICRO_RUN if not o.startswith("trainer.steps=")]
PROBE_RUN += ["model.path=null", "probe.warm_steps=1", "probe.measure_steps=2"]


def compose_probe(*overrides: str):
    with initialize_config_dir(config_dir=str(PROJECT_ROOT / "conf"), version_base="1.3"):
        return compose("probe", overrides=[*PROBE_RUN, *overrides])


def test_the_probe_measures_each_learning_rate_and_each_engine_precision(tmp_path):
    summary = run_probe(compose_probe("probe.lrs=[1e-4,3e-2]", "probe.precisions=[bf16,fp16]"), tmp_path)
    low, high = summary["settings"]
    assert [low["lr"], high["lr"]] == [1e-4, 3e-2]
    for setting in (low, high):
        assert len(setting["drift_per_layer"]) == 2
        assert setting[DRIFT_PER_UPDATE] == pytest.approx(sum(setting["drift_per_layer"]) / 2)
        assert math.isfinite(setting[ROUTING_SHARE]) and setting[MARGIN] > 0
        # pooled over the measured steps' off-policy minibatches (1 of 2 per step), with its standard error
        assert setting[ROUTING_SHARE + "_n"] == 2 and setting[ROUTING_SHARE + "_sem"] >= 0
        assert setting[DRIFT_PER_UPDATE + "_n"] == 2
        # the scale-free margin at the top-k cut, over tokens and layers and per layer
        assert 0 <= setting[TOPK_MARGIN_MEDIAN] <= 1 and 0 <= setting[TOPK_MARGIN_SMALL] <= 1
        assert len(setting["topk_margin_median_per_layer"]) == 2
    # a step 300x larger moves more experts: the probe's drift follows the update, not the sampling
    assert high[DRIFT_PER_UPDATE] > low[DRIFT_PER_UPDATE]
    assert 2 <= summary["answer_tokens"] <= 4  # up to 3 digits of a 2-digit sum, and eos
    assert [m["precision"] for m in summary["precision_mismatch"]] == ["bf16", "fp16"]
    assert all(0 <= m[ENGINE_EXPERTS] <= 1 for m in summary["precision_mismatch"])
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    # warm and measured steps of both rates, then one step per engine precision
    assert [line[PROBE_PHASE] for line in lines] == ["warm", "measure", "measure"] * 2 + [
        "precision_bf16",
        "precision_fp16",
    ]
    assert [line[STEP] for line in lines] == list(range(1, 9))  # one increasing step for the log and W&B
    assert [line[PROBE_SETTING_STEP] for line in lines] == [1, 2, 3] * 2 + [1, 1]
    assert json.loads((tmp_path / "summary.json").read_text())["settings"][1]["lr"] == 3e-2


@pytest.mark.parametrize(
    "override, message",
    [
        ("probe.lrs=[]", "probe.lrs=[] must be a non-empty list of learning rates > 0"),
        ("probe.measure_steps=0", "probe.measure_steps=0 >= 1"),
        ("trainer.minibatches=1", "trainer.minibatches=1: the drift after one update is measured on minibatch 1"),
        ("routing.replay=r2", "routing.replay=r2: the probe measures the drift and routing share that replay"),
    ],
)
def test_bad_probe_settings_are_refused_in_one_line(tmp_path, override, message):
    with pytest.raises(SystemExit) as refused:
        run_probe(compose_probe(override), tmp_path)
    assert str(refused.value).startswith("moe-rl-lab: ") and message in str(refused.value)
    assert "\n" not in str(refused.value) and not (tmp_path / "metrics.jsonl").exists()


@pytest.mark.slow
def test_the_probe_on_the_command_line_refuses_in_one_line(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "experiments.probe", *PROBE_RUN, "probe.measure_steps=0", f"hydra.run.dir={tmp_path}"],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 1 and "Traceback" not in result.stderr
    line = result.stderr.strip().splitlines()[-1]
    assert line.startswith("moe-rl-lab: ") and "probe.measure_steps=0 >= 1" in line


def test_a_learning_rate_that_diverges_is_an_entry_that_says_so_and_the_next_is_probed(tmp_path, capsys):
    summary = run_probe(compose_probe("probe.lrs=[1e30,1e-3]", "probe.precisions=[]"), tmp_path)
    broken, healthy = summary["settings"]
    assert broken["lr"] == 1e30 and "NaN or inf" in broken["diverged"]
    assert healthy["lr"] == 1e-3 and healthy[DRIFT_PER_UPDATE] >= 0
    assert "lr 1e+30 diverged at step" in capsys.readouterr().err


@pytest.mark.parametrize(
    "override, message",
    [
        ("model=tiny_dense", "model 'micro_moe' is dense: the probe measures how far an update moves the routing"),
        (
            "model.path={missing}",
            "model.path='{missing}' does not exist: make this cold start with `python -m "
            "experiments.sft model=micro_moe dataset=addition sft.output_dir={missing}`",
        ),
    ],
)
def test_the_probe_refuses_in_its_own_terms_before_it_claims_its_directory(tmp_path, override, message):
    """A dense model was refused in terms of routing.decompose_every, a key the probe sets itself, and both cases
    only after the run directory was claimed and W&B started."""
    missing = tmp_path / "no_cold_start"
    with pytest.raises(SystemExit) as raised:
        run_probe(compose_probe(override.format(missing=missing)), tmp_path / "run")
    assert message.format(missing=missing) in str(raised.value) and "\n" not in str(raised.value)
    assert not (tmp_path / "run").exists(), "nothing is written before the refusal"
