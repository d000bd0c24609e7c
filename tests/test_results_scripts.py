"""docs/results/experiment.sh hands its arguments to the right commands: SFT overrides to the cold start, the ones
after `--` to the runs (other seeds), and a report of other seeds never overwrites the committed result;
docs/results/router_starts.sh refuses a start it has no recipe for before making any; docs/results/reasoning_gym/
command.sh makes the cold start its experiment starts from."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from experiments.config import PROJECT_ROOT

SCRIPT = PROJECT_ROOT / "docs" / "results" / "experiment.sh"


def recording_python(tmp_path) -> tuple[dict[str, str], Path]:
    """An environment whose `python` records each call's arguments in the returned file instead of running anything."""
    log = tmp_path / "calls"
    fake = tmp_path / "bin" / "python"
    fake.parent.mkdir()
    fake.write_text(f'#!/usr/bin/env bash\nprintf "%s\\t" "$@" >> {log}\necho >> {log}\n')
    fake.chmod(0o755)
    return {**os.environ, "PATH": f"{fake.parent}:{os.environ['PATH']}"}, log


def run_with_a_recording_python(tmp_path, *args: str) -> list[list[str]]:
    """Run experiment.sh with a recording `python` (`recording_python`): the calls it made, each its arguments."""
    env, log = recording_python(tmp_path)
    done = subprocess.run(["bash", str(SCRIPT), *args], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    return [line.rstrip("\t").split("\t") for line in log.read_text().splitlines()]


def test_overrides_after_the_separator_reach_the_runs_and_the_report_goes_elsewhere(tmp_path):
    sft, train, report = run_with_a_recording_python(
        tmp_path, "deep_long_seeds", str(tmp_path / "no-checkpoint"), "model=qwen30b_l16", "dataset=scratchpad",
        "--", "seed=10,11", "trainer.steps=2")
    assert sft == ["-m", "experiments.sft", "model=qwen30b_l16", "dataset=scratchpad"]
    assert train[:3] == ["-m", "experiments.train", "-m"] and train[3] == "experiment=deep_long_seeds"
    assert train[-2:] == ["seed=10,11", "trainer.steps=2"]
    assert report[:2] == ["-m", "analysis.report"] and report[-1].startswith("reports/deep_long_seeds-")


def test_without_run_overrides_the_result_is_regenerated_in_place(tmp_path):
    checkpoint = tmp_path / "ckpt"
    checkpoint.mkdir()
    (checkpoint / "config.json").write_text("{}")  # the cold start exists: no SFT
    train, report = run_with_a_recording_python(tmp_path, "flip_dose", str(checkpoint))
    assert train[3] == "experiment=flip_dose" and train[-1].startswith("hydra.sweep.dir=multirun/flip_dose/")
    assert report[-2:] == ["--out", "docs/results/flip_dose"]


def test_a_start_without_a_recipe_is_refused_before_any_is_made(tmp_path):
    env, log = recording_python(tmp_path)
    script = SCRIPT.parent / "router_starts.sh"
    done = subprocess.run(["bash", str(script), "glm4_moe_l16-addition-tied", "qwen30b_l16-addition-flat"], env=env,
                          capture_output=True, text=True)
    assert done.returncode == 2 and not log.exists()  # the known name before the unknown one is not made either
    assert done.stderr.strip() == ("error: no cold-start recipe named 'qwen30b_l16-addition-flat' (allowed: the eleven "
                                   f"listed in {script})")


def test_k_starts_of_a_recipe_draw_its_seeds_and_start_0_is_the_documented_one(tmp_path):
    env, log = recording_python(tmp_path)
    env["COLD_STARTS"] = str(tmp_path / "starts")
    script = SCRIPT.parent / "router_starts.sh"
    done = subprocess.run(["bash", str(script), "--starts", "3", "tiny_moe-addition"], env=env, capture_output=True,
                          text=True)
    assert done.returncode == 0, done.stderr
    calls = [line.rstrip("\t").split("\t") for line in log.read_text().splitlines()]
    assert calls == [["-m", "experiments.sft", "model=tiny_moe", f"sft.output_dir={tmp_path}/starts/tiny_moe-addition"],
                     *[["-m", "experiments.sft", "model=tiny_moe", f"model.init_seed={k}", f"seed={k}",
                        f"sft.output_dir={tmp_path}/starts/tiny_moe-addition-start{k}"] for k in (1, 2)]]
    where = subprocess.run(["bash", str(script), "--path", "2", "tiny_moe-addition"], env=env, capture_output=True,
                           text=True)
    assert where.stdout.strip() == f"{tmp_path}/starts/tiny_moe-addition-start2"
    for bad in ("0", "two"):
        refused = subprocess.run(["bash", str(script), "--starts", bad, "tiny_moe-addition"], env=env,
                                 capture_output=True, text=True)
        assert refused.returncode == 2 and f"--starts '{bad}' must be a whole number >= 1" in refused.stderr


def test_the_reasoning_gym_result_makes_the_cold_start_its_experiment_starts_from(tmp_path):
    """The cold-start recipe repeats the experiment's dataset settings (a cold start takes no experiment): the two must
    compose to the same task, and the start must land where the experiment's runs look for it."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from experiments.config import register_configs

    env, log = recording_python(tmp_path)
    env["COLD_STARTS"] = str(tmp_path / "starts")  # a folder without starts: both are made
    script = PROJECT_ROOT / "docs" / "results" / "reasoning_gym" / "command.sh"
    done = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    calls = [line.rstrip("\t").split("\t") for line in log.read_text().splitlines()]
    runs = [call for call in calls if call[:2] == ["-m", "experiments.train"]]
    assert [run[3] for run in runs] == ["experiment=reasoning_gym", "experiment=addition_cell"]
    reports = [call for call in calls if call[:2] == ["-m", "analysis.report"]]
    # a report per task: one of both would pool the two recipes' starts as two starts of one recipe
    assert [report[report.index("--out") + 1] for report in reports] == [
        "docs/results/reasoning_gym", "docs/results/reasoning_gym/addition"]
    swept = [report[2:report.index("--out")] for report in reports]  # the sweeps each report reads
    assert [len(sweeps) for sweeps in swept] == [1, 1]
    assert swept[0][0].endswith("/reasoning_gym") and swept[1][0].endswith("/addition")
    register_configs()
    with initialize_config_dir(config_dir=str(PROJECT_ROOT / "conf"), version_base="1.3"):
        experiment = compose("train", overrides=["experiment=reasoning_gym"])
        cold_starts = [compose("sft", overrides=call[2:]) for call in calls if call[:2] == ["-m", "experiments.sft"]]
    assert [cfg.dataset.name for cfg in cold_starts] == ["reasoning_gym", "addition"]
    made = cold_starts[0]
    assert OmegaConf.to_container(made.dataset) == OmegaConf.to_container(experiment.dataset)
    name = "tiny_moe-reasoning_gym-basic_arithmetic"
    assert made.sft.output_dir == f"{tmp_path}/starts/{name}"
    assert experiment.model.path == str(PROJECT_ROOT / "checkpoints" / "cold_start" / name)
