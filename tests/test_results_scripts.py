"""docs/results/experiment.sh hands its arguments to the right commands: SFT overrides to the cold start, the ones
after `--` to the runs (other seeds), and a report of other seeds never overwrites the committed result;
docs/results/router_starts.sh refuses a start it has no recipe for before making any; docs/results/reasoning_gym/
command.sh makes the cold start its experiment starts from. Every command file under docs/results answers --help with
its usage and does nothing; a bad argument is refused in one line before any cold start, sweep or report; runs that
overrides make other than the documented ones are reported in reports/, never over the committed result."""

from __future__ import annotations

import itertools
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from analysis.report import report_order
from experiments.config import PROJECT_ROOT

RESULTS = PROJECT_ROOT / "docs" / "results"
SCRIPT = RESULTS / "experiment.sh"
SCRIPTS = sorted(RESULTS.rglob("*.sh"))  # every command file, and args.sh, the checks they source
COMMANDS = [script for script in SCRIPTS if script.name != "args.sh"]
# The results' commands over experiment.sh: their cold start's recipe is their own, other runs go after `--`.
OVER_EXPERIMENT_SH = [
    "claim1_deep",
    "deep_long",
    "deep_long_seeds",
    "few_experts",
    "flip_dose",
    "flip_dose_seeds",
    "long_answers",
    "replay_variants",
    "router_noise_dose",
]


def recording_python(tmp_path) -> tuple[dict[str, str], Path]:
    """An environment whose `python` records each call's arguments in the returned file instead of running anything."""
    log = tmp_path / "calls"
    fake = tmp_path / "bin" / "python"
    fake.parent.mkdir()
    fake.write_text(f'#!/usr/bin/env bash\nprintf "%s\\t" "$@" >> {log}\necho >> {log}\n')
    fake.chmod(0o755)
    return {**os.environ, "PATH": f"{fake.parent}:{os.environ['PATH']}"}, log


def calls_in(log: Path) -> list[list[str]]:
    """The calls a recording `python` made, each its arguments (none when it was never called)."""
    return [line.rstrip("\t").split("\t") for line in log.read_text().splitlines()] if log.exists() else []


def run_with_a_recording_python(tmp_path, *args: str) -> list[list[str]]:
    """Run experiment.sh with a recording `python` (`recording_python`): the calls it made, each its arguments."""
    env, log = recording_python(tmp_path)
    done = subprocess.run(["bash", str(SCRIPT), *args], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    return calls_in(log)


def test_overrides_after_the_separator_reach_the_runs_and_the_report_goes_elsewhere(tmp_path):
    sft, train, report = run_with_a_recording_python(
        tmp_path,
        "deep_long_seeds",
        str(tmp_path / "no-checkpoint"),
        "model=qwen30b_l16",
        "dataset=scratchpad",
        "--",
        "seed=10,11",
        "trainer.steps=2",
    )
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
    done = subprocess.run(
        ["bash", str(script), "glm4_moe_l16-addition-tied", "qwen30b_l16-addition-flat"],
        env=env,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 2 and not log.exists()  # the known name before the unknown one is not made either
    assert done.stderr.strip() == (
        f"error: no cold-start recipe named 'qwen30b_l16-addition-flat' (allowed: the fifteen listed in {script})"
    )


def test_k_starts_of_a_recipe_draw_its_seeds_and_start_0_is_the_documented_one(tmp_path):
    env, log = recording_python(tmp_path)
    env["COLD_STARTS"] = str(tmp_path / "starts")
    script = SCRIPT.parent / "router_starts.sh"
    done = subprocess.run(
        ["bash", str(script), "--starts", "3", "tiny_moe-addition"], env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    calls = calls_in(log)
    assert calls == [
        ["-m", "experiments.sft", "model=tiny_moe", f"sft.output_dir={tmp_path}/starts/tiny_moe-addition"],
        *[
            [
                "-m",
                "experiments.sft",
                "model=tiny_moe",
                f"model.init_seed={k}",
                f"seed={k}",
                f"sft.output_dir={tmp_path}/starts/tiny_moe-addition-start{k}",
            ]
            for k in (1, 2)
        ],
    ]
    where = subprocess.run(
        ["bash", str(script), "--path", "2", "tiny_moe-addition"], env=env, capture_output=True, text=True
    )
    assert where.stdout.strip() == f"{tmp_path}/starts/tiny_moe-addition-start2"
    for bad in ("0", "two"):
        refused = subprocess.run(
            ["bash", str(script), "--starts", bad, "tiny_moe-addition"], env=env, capture_output=True, text=True
        )
        assert refused.returncode == 2 and f"--starts '{bad}' must be a whole number >= 1" in refused.stderr


def test_the_reasoning_gym_result_makes_the_cold_start_its_experiment_starts_from(tmp_path):
    """The cold-start recipe repeats the experiment's dataset settings (a cold start takes no experiment): the two must
    compose to the same task, and the start must land where the experiment's runs look for it."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from experiments.config import register_configs

    env, log = recording_python(tmp_path)
    env["COLD_STARTS"] = str(tmp_path / "starts")  # a folder without starts: both are made
    script = RESULTS / "reasoning_gym" / "command.sh"
    done = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    calls = calls_in(log)
    runs = [call for call in calls if call[:2] == ["-m", "experiments.train"]]
    assert [run[3] for run in runs] == ["experiment=reasoning_gym", "experiment=addition_cell"]
    reports = [call for call in calls if call[:2] == ["-m", "analysis.report"]]
    # a report per task: one of both would pool the two recipes' starts as two starts of one recipe
    assert [report[report.index("--out") + 1] for report in reports] == [
        "docs/results/reasoning_gym",
        "docs/results/reasoning_gym/addition",
    ]
    swept = [report[2 : report.index("--out")] for report in reports]  # the sweeps each report reads
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


def run_script(tmp_path, script: Path, *args: str) -> tuple[subprocess.CompletedProcess, list[list[str]]]:
    """Run a command file with a recording `python` and the cold starts in a folder of its own: what it printed, and
    every call it made (any cold start, sweep or report is a call)."""
    own = Path(tempfile.mkdtemp(dir=tmp_path))
    env, log = recording_python(own)
    env["COLD_STARTS"] = str(own / "starts")
    done = subprocess.run(["bash", str(script), *args], env=env, capture_output=True, text=True)
    return done, calls_in(log)


def files_under_results() -> dict[Path, tuple[int, int]]:
    return {path: (path.stat().st_mtime_ns, path.stat().st_size) for path in RESULTS.rglob("*") if path.is_file()}


@pytest.fixture
def results_untouched():
    """docs/results after the test as before it: no file written, made or removed."""
    before = files_under_results()
    yield
    assert files_under_results() == before


def usage_comment(script: Path) -> str:
    """The comment at the top of a command file, after its #! line, without the '#'s."""
    comment = itertools.takewhile(lambda line: line.startswith("#"), script.read_text().splitlines()[1:])
    return "".join(re.sub(r"^# ?", "", line) + "\n" for line in comment)


def script_id(script: Path) -> str:
    return str(script.relative_to(RESULTS))


@pytest.mark.parametrize("flag", ["--help", "-h"])
@pytest.mark.parametrize("script", SCRIPTS, ids=script_id)
def test_help_prints_the_usage_at_the_top_of_the_file_and_does_nothing(tmp_path, results_untouched, script, flag):
    done, calls = run_script(tmp_path, script, flag)
    assert (done.returncode, done.stderr, calls) == (0, "", [])
    assert done.stdout == usage_comment(script) and done.stdout.strip()


def assert_refused(tmp_path, script: Path, args: list[str], named: str) -> None:
    """The command exits 2 with one line that names the bad value, having made no call (no cold start, sweep or
    report)."""
    done, calls = run_script(tmp_path, script, *args)
    assert (done.returncode, done.stdout, calls) == (2, "", []), done.stderr
    assert len(done.stderr.splitlines()) == 1 and done.stderr.startswith("error: "), done.stderr
    assert named in done.stderr and "unbound variable" not in done.stderr


@pytest.mark.parametrize("script", COMMANDS, ids=script_id)
def test_an_argument_no_command_takes_is_refused_in_one_line_before_any_work(tmp_path, results_untouched, script):
    assert_refused(tmp_path, script, ["no-such-argument"], "'no-such-argument'")


@pytest.mark.parametrize("name", OVER_EXPERIMENT_SH)
def test_a_run_override_without_its_separator_is_refused_not_dropped(tmp_path, results_untouched, name):
    """seed=10,11 before `--` was taken as an SFT setting, dropped when the start existed, and the default seeds
    written over the committed result."""
    assert_refused(tmp_path, RESULTS / name / "command.sh", ["seed=10,11"], "'seed=10,11'")
    assert_refused(tmp_path, RESULTS / name / "command.sh", ["--", "10,11"], "'10,11'")


@pytest.mark.parametrize(
    ("script", "args", "named"),
    [
        ("staleness/command.sh", ["cells", "3"], "'3'"),  # ran no cell, yet made six cold starts and rewrote the panels
        ("staleness/command.sh", ["cells", "0"], "'0'"),
        ("staleness/command.sh", ["cells", "2", "3"], "'3'"),
        ("staleness/command.sh", ["cells"], "cells needs the N"),
        ("staleness/command.sh", ["map", "8"], "'8'"),
        ("router_starts.sh", ["--starts"], "--starts needs a value"),  # exited 1 without a word
        ("router_starts.sh", ["--path"], "--path needs a value"),
        ("router_starts.sh", ["--start", "2", "tiny_moe-addition"], "'--start'"),
        ("experiment.sh", [], "expected NAME CHECKPOINT"),  # bash's "unbound variable"
        ("experiment.sh", ["flip_dose", "checkpoints/cold_start/tiny_moe-addition", "seed=10,11"], "'seed=10,11'"),
        ("experiment.sh", ["no_such_experiment", "checkpoints/cold_start/tiny_moe-addition"], "'no_such_experiment'"),
        ("experiment.sh", ["flip_dose", "model=tiny_moe"], "'model=tiny_moe'"),
        ("claims.sh", [], "claim ''"),  # bash's "unbound variable"
        ("claims.sh", ["claim4_early_warning"], "'claim4_early_warning'"),  # a part of claim 4 over its whole report
        ("claims.sh", ["claim1_fig3", "seed=3"], "'seed=3'"),
        ("recipe_claims/command.sh", ["deep_long", "report", "seed=3"], "'seed=3'"),
        ("real_routers/command.sh", ["seed=3"], "'seed=3'"),
    ],
)
def test_a_bad_argument_is_refused_in_one_line_before_any_work(tmp_path, results_untouched, script, args, named):
    assert_refused(tmp_path, RESULTS / script, args, named)


def outputs(calls: list[list[str]]) -> list[str]:
    """Where each report and panel a command made went."""
    return [call[call.index("--out") + 1] for call in calls if "--out" in call]


def test_overridden_runs_are_reported_elsewhere_and_runs_side_by_side_in_place(tmp_path, results_untouched):
    done, calls = run_script(tmp_path, RESULTS / "staleness" / "command.sh", "cells", "2", "trainer.lr=3e-4")
    assert done.returncode == 0, done.stderr
    sweeps = [arg for call in calls for arg in call if arg.startswith("hydra.sweep.dir=")]
    assert len(sweeps) == 12 and all(sweep.startswith("hydra.sweep.dir=multirun/staleness/other-") for sweep in sweeps)
    cell, panels = outputs(calls)
    assert re.fullmatch(r"reports/staleness-[0-9_-]+/n2", cell) and panels == cell.removesuffix("/n2")
    # one thread each (the experiment pins them), two runs side by side compute what one alone does
    done, calls = run_script(tmp_path, RESULTS / "staleness" / "command.sh", "cells", "2", "hydra.launcher.n_jobs=2")
    assert done.returncode == 0 and outputs(calls) == ["docs/results/staleness/n2", "docs/results/staleness"]
    done, calls = run_script(tmp_path, RESULTS / "real_routers" / "command.sh", "trainer.lr=3e-4")
    assert done.returncode == 0 and len(outputs(calls)) == 3  # a report per start
    assert all(re.fullmatch(r"reports/real_routers-[0-9_-]+/\w+", out) for out in outputs(calls))


def test_other_seeds_of_the_dose_response_run_without_the_pilot_and_are_reported_elsewhere(tmp_path, results_untouched):
    script = RESULTS / "router_noise_dose" / "command.sh"
    done, calls = run_script(tmp_path, script, "--", "seed=10,11")
    assert done.returncode == 0, done.stderr
    assert not any("search=router_noise_pilot" in call for call in calls)
    assert [call for call in calls if "seed=10,11" in call][0][3] == "experiment=router_noise_dose"
    assert len(outputs(calls)) == 1 and outputs(calls)[0].startswith("reports/router_noise_dose-")
    done, calls = run_script(tmp_path, script)
    assert done.returncode == 0 and outputs(calls) == [
        "docs/results/router_noise_dose/pilot",
        "docs/results/router_noise_dose",
    ]


def apply_the_staleness_rule(tmp_path, areas: dict[str, dict[tuple[str, int], float]]) -> subprocess.CompletedProcess:
    """docs/results/async/command.sh rule, run in a copy of its tree whose maps hold one run of gain_area `areas[rung]
    [arm, lag]` per arm and lag (the other columns as a report writes them), with this interpreter as `python`."""
    results = tmp_path / "docs" / "results"
    (results / "async").mkdir(parents=True)
    for name in ("args.sh", "async/command.sh"):
        (results / name).write_text((RESULTS / name).read_text())
    for rung, area in areas.items():
        table = results / "async" / "map" / rung / "per_seed.csv"
        table.parent.mkdir(parents=True)
        rows = [f"{arm}_{lag},{arm},100,{lag},{value},finished,yes" for (arm, lag), value in area.items()]
        table.write_text("run,arm,seed,rollout.lag,gain_area,status,counted\n" + "\n".join(rows) + "\n")
    python = tmp_path / "bin" / "python"
    python.parent.mkdir()
    python.symlink_to(sys.executable)
    return subprocess.run(
        ["bash", str(results / "async" / "command.sh"), "rule"],
        capture_output=True,
        text=True,
        env={**os.environ, "PATH": f"{python.parent}:{os.environ['PATH']}"},
    )


def map_of(falls: dict[str, dict[int, float]]) -> dict[tuple[str, int], float]:
    """A map whose arms gain 0.10 at lag 0 and fall by `falls[arm][k]` at lag k (0 where unnamed)."""
    arms = ("grpo (π_old = μ_old)", "grpo + tis", "minirl", "minirl + r3", "gspo")
    return {(arm, k): 0.10 - falls.get(arm, {}).get(k, 0.0) for arm in arms for k in (0, 1, 2, 4, 8)}


def test_the_staleness_rule_picks_the_pre_registered_rung_and_lag(tmp_path):
    """The rule of docs/results/async/preregistration.md: k* is the smallest lag where MiniRL or the naive arm falls by
    0.05 on the sigmoid rung (another arm's fall does not count); the softmax rung only when it alone has a fall."""
    sigmoid = map_of({"minirl": {1: 0.02, 2: 0.06, 4: 0.2}, "gspo": {1: 0.3}})
    done = apply_the_staleness_rule(tmp_path / "a", {"glm4_moe_l16": sigmoid, "qwen30b_l16": map_of({})})
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1] == "rung: glm4_moe_l16; k*: 2"
    softmax = map_of({"grpo (π_old = μ_old)": {4: 0.08}})
    done = apply_the_staleness_rule(tmp_path / "b", {"glm4_moe_l16": map_of({}), "qwen30b_l16": softmax})
    assert done.stdout.splitlines()[-1] == "rung: qwen30b_l16; k*: 4"
    done = apply_the_staleness_rule(tmp_path / "c", {"glm4_moe_l16": map_of({}), "qwen30b_l16": map_of({})})
    assert done.stdout.splitlines()[-1].startswith("rung: glm4_moe_l16; k*: 8 (no fall of 0.05")


def test_the_staleness_rule_refuses_a_map_without_every_lag_it_reads(tmp_path):
    partial = {key: value for key, value in map_of({}).items() if key != ("minirl", 4)}
    done = apply_the_staleness_rule(tmp_path, {"glm4_moe_l16": partial, "qwen30b_l16": map_of({})})
    assert done.returncode == 1 and "missing [('minirl', 4)]" in done.stderr


def test_the_staleness_cells_run_every_start_on_seed_0_first_and_the_family_last(tmp_path):
    """`command.sh cells RUNG K` (a recording `python`, so no start or run is made): the rung's six arms at K and three
    at lag 0, the dense control's MiniRL at 0 and K, on starts 0-7 of seed 0 before any of seed 1; then a report per
    model and the declared family at K from those two reports."""
    env, log = recording_python(tmp_path)
    done = subprocess.run(
        ["bash", str(RESULTS / "async" / "command.sh"), "cells", "glm4_moe_l16", "4"],
        env={**env, "COLD_STARTS": str(tmp_path / "starts")},
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    calls = calls_in(log)
    trains = [call for call in calls if call[:2] == ["-m", "experiments.train"]]
    assert len(trains) == 2 * 8 * 3

    def setting(call: list[str], key: str) -> str:
        return next(arg.split("=", 1)[1] for arg in call if arg.startswith(key + "="))

    seeds = [setting(call, "seed") for call in trains]
    assert seeds == ["0"] * 24 + ["1"] * 24
    assert all(setting(call, "resume") == "auto" for call in trains)  # run again, the cells go on where they stopped
    assert [setting(call, "model.path").rsplit("/", 1)[1] for call in trains[:6:3]] == [
        "glm4_moe_l16-addition-balanced-target",
        "glm4_moe_l16-addition-balanced-target-start1",
    ]
    lagged, synchronous, dense = trains[:3]
    assert setting(lagged, "rollout.lag") == "4" and setting(lagged, "arm") == (
        "grpo_naive_async,grpo_decoupled,minirl,minirl_r3,minirl_pr2,gspo"
    )
    assert setting(synchronous, "rollout.lag") == "0"
    assert setting(dense, "hydra.sweeper.params.model") == "qwen30b_l16_dense"
    assert setting(dense, "rollout.lag") == "0,4" and setting(dense, "arm") == "minirl"
    reports = [call for call in calls if call[:2] == ["-m", "analysis.report"]]
    assert [call[call.index("--out") + 1] for call in reports] == [
        "docs/results/async/cells/glm4_moe_l16",
        "docs/results/async/cells/qwen30b_l16_dense",
    ]
    assert len(reports[0]) == 2 + 2 * 16 + 4 and calls[-1][:2] == ["-m", "analysis.family"]
    assert calls[-1][-4:] == ["--lag", "4", "--out", "docs/results/async/contrasts"]


def test_the_exploratory_n4_runs_minirl_at_two_lags_and_r3_at_2_from_eight_starts_then_its_own_family(tmp_path):
    """`command.sh n4` (a recording `python`): on the cells' rung, each of starts 0-7 on seed 0 at N = 4 mini-batches
    of the cells' size, minirl and minirl_r3 at lag 2 and minirl at 0, resumed if begun; then one report and the
    exploratory family (never the declared one) from it."""
    env, log = recording_python(tmp_path)
    done = subprocess.run(
        ["bash", str(RESULTS / "async" / "command.sh"), "n4"],
        env={**env, "COLD_STARTS": str(tmp_path / "starts")},
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    calls = calls_in(log)
    trains = [
        dict(arg.split("=", 1) for arg in call[2:] if "=" in arg)
        for call in calls
        if call[:2] == ["-m", "experiments.train"]
    ]
    assert [(train["rollout.lag"], train["arm"]) for train in trains[:2]] == [
        ("2", "minirl,minirl_r3"),
        ("0", "minirl"),
    ]
    assert len(trains) == 16 and all(
        (
            train["seed"],
            train["trainer.minibatches"],
            train["trainer.prompts_per_step"],
            train["resume"],
            train["hydra.sweeper.params.model"],
        )
        == ("0", "4", "16", "auto", "glm4_moe_l16")
        for train in trains
    )
    recipe = "glm4_moe_l16-addition-balanced-target"
    assert [train["model.path"].rsplit("/", 1)[1] for train in trains[::2]] == [recipe] + [
        f"{recipe}-start{k}" for k in range(1, 8)
    ]
    report, contrast = calls[-2:]
    assert report[:2] == ["-m", "analysis.report"] and len(report) == 2 + 16 + 4
    assert contrast[:4] == ["-m", "analysis.family", "--family", "docs/results/async/exploratory_n4_family.yaml"]
    assert contrast[-4:] == ["--lag", "2", "--out", "docs/results/async/exploratory_n4/contrasts"]


def test_one_start_alone_is_made_without_those_below_it(tmp_path):
    """`router_starts.sh --only K` makes start K of each named recipe and none below it (a family's starts 3-12 need
    no starts 0-2); with `--starts` too it is refused, as is a K that is not a start's number."""
    env, log = recording_python(tmp_path)
    env["COLD_STARTS"] = str(tmp_path / "starts")
    script = SCRIPT.parent / "router_starts.sh"
    done = subprocess.run(["bash", str(script), "--only", "4", "tiny_moe-addition"], env=env, capture_output=True)
    assert done.returncode == 0, done.stderr
    assert calls_in(log) == [
        [
            "-m",
            "experiments.sft",
            "model=tiny_moe",
            "model.init_seed=4",
            "seed=4",
            f"sft.output_dir={tmp_path}/starts/tiny_moe-addition-start4",
        ]
    ]
    for args, named in (
        (["--starts", "3", "--only", "4"], "--starts 3 and --only 4: give one"),
        (["--only", "x"], "'x'"),
    ):
        refused = subprocess.run(
            ["bash", str(script), *args, "tiny_moe-addition"], env=env, capture_output=True, text=True
        )
        assert refused.returncode == 2 and named in refused.stderr and refused.stderr.count("\n") == 1
    assert len(calls_in(log)) == 1


def test_the_learning_family_s_starts_are_made_a_recipe_on_each_core_from_start_3_on(tmp_path):
    """`docs/results/learning/command.sh starts hydra.launcher.n_jobs=2` (a `python` that records each call and makes
    the start an SFT call names, start 5 of the sigmoid recipe missing its target, and whose sigmoid start 3 waits for
    the softmax recipe's start 3): both recipes' starts at once, each
    from start 3 (the map's starts 0-2 are not made), the missed one replaced by the next and named."""
    log, fake = tmp_path / "calls", tmp_path / "bin" / "python"
    fake.parent.mkdir()
    fake.write_text(
        "#!/usr/bin/env bash\n"
        f'[[ $1 == -c ]] && exec {sys.executable} "$@"\n'
        f'line=$(printf "%s\\t" "$@"); echo "$line" >> {log}\n'  # one write: two recipes append side by side
        "for arg; do [[ $arg == sft.output_dir=* ]] && dir=${arg#sft.output_dir=}; done\n"
        # The sigmoid recipe's first start waits for the softmax recipe's: made one recipe after the other, it never is
        f"other={tmp_path}/starts/qwen30b_l16-addition-balanced-t1000-start3\n"
        "if [[ $dir == *target-t1000-start3 ]]; then\n"
        "  for _ in $(seq 200); do [[ -d $other ]] && break; sleep 0.05; done\n"
        "  [[ -d $other ]] || exit 1\n"
        "fi\n"
        'mkdir -p "$dir" && echo "{}" > "$dir/config.json"\n'
        "reached=true; [[ $dir == *target-t1000-start5 ]] && reached=false\n"
        'echo "{\\"reached_target\\": $reached}" > "$dir/cold_start.json"\n'
    )
    fake.chmod(0o755)
    env = {**os.environ, "PATH": f"{fake.parent}:{os.environ['PATH']}", "COLD_STARTS": str(tmp_path / "starts")}
    script = RESULTS / "learning" / "command.sh"
    done = subprocess.run(
        ["bash", str(script), "starts", "hydra.launcher.n_jobs=2"], env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    assert "glm4_moe_l16-addition-balanced-target-t1000: start 5 missed its SFT's target" in done.stderr
    made = [call[-1].rsplit("/", 1)[1] for call in calls_in(log)]
    sigmoid, softmax = "glm4_moe_l16-addition-balanced-target-t1000", "qwen30b_l16-addition-balanced-t1000"
    assert sorted(name for name in made if name.startswith(sigmoid)) == sorted(
        f"{sigmoid}-start{k}" for k in range(3, 14)
    )
    assert sorted(name for name in made if name.startswith(softmax)) == sorted(
        f"{softmax}-start{k}" for k in range(3, 13)
    )


def kept_figures(report: list[str]) -> list[str]:
    """The figures a recorded `analysis.report` call draws (`--figures`, its last flag), each one the report knows:
    an unknown number would be refused only after the sweeps it reports on."""
    kept = report[report.index("--figures") + 1 :]
    assert set(kept) <= set(report_order()), kept
    return kept


def test_the_learning_family_runs_in_the_maps_regime_from_ten_starts_that_meet_their_target(tmp_path):
    """`docs/results/learning/command.sh sync` (a `python` that records every call but `python -c`, which it runs):
    starts 3 on of each recipe, a start that missed its SFT's target (start 5) replaced by the next (13); the regime
    regime.json names in every sweep; seed 0 on every start before seed 1; a report per rung. Without regime.json the
    runs are refused in one line before any start is looked at."""
    env, log = recording_python(tmp_path)
    fake = Path(env["PATH"].split(":")[0]) / "python"
    fake.write_text(
        f'#!/usr/bin/env bash\n[[ $1 == -c ]] && exec {sys.executable} "$@"\n' + fake.read_text().split("\n", 1)[1]
    )
    starts = tmp_path / "starts"
    sigmoid, softmax = "glm4_moe_l16-addition-balanced-target-t1000", "qwen30b_l16-addition-balanced-t1000"
    for recipe in (sigmoid, softmax):
        for k in range(3, 14):
            (starts / f"{recipe}-start{k}").mkdir(parents=True)
            reached = not (recipe == sigmoid and k == 5)
            (starts / f"{recipe}-start{k}" / "cold_start.json").write_text(json.dumps({"reached_target": reached}))
    script = RESULTS / "learning" / "command.sh"
    env = {**env, "COLD_STARTS": str(starts), "REGIME": str(tmp_path / "regime.json")}
    refused = subprocess.run(["bash", str(script), "sync"], env=env, capture_output=True, text=True)
    assert (
        refused.returncode == 2
        and refused.stderr.startswith("error: ")
        and "regime.json does not exist" in refused.stderr
    )
    assert not calls_in(log)
    regime = ["trainer.prompts_per_step=32", "trainer.lr=3e-05", "trainer.steps=400"]
    (tmp_path / "regime.json").write_text(json.dumps({"lever": "extension", "overrides": regime}))
    done = subprocess.run(["bash", str(script), "sync"], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert f"{sigmoid}: start 5 missed its SFT's target, replaced by the next start" in done.stderr
    calls = calls_in(log)
    assert not [call for call in calls if call[:2] == ["-m", "experiments.sft"]], "every start was there already"
    trains = [call for call in calls if call[:2] == ["-m", "experiments.train"]]

    def setting(call: list[str], key: str) -> str:
        return next(arg.split("=", 1)[1] for arg in call if arg.startswith(key + "="))

    assert [setting(call, "hydra.sweeper.params.seed") for call in trains] == ["0"] * 3 + ["1"] * 3
    assert all(set(regime) <= set(call) and setting(call, "resume") == "auto" for call in trains)
    used = [path.rsplit("-start", 1)[1] for path in setting(trains[0], "model.path").split(",")]
    assert used == ["3", "4", *map(str, range(6, 14))]
    assert setting(trains[2], "model.path").split(",")[-1].endswith(f"{softmax}-start12")
    assert setting(trains[0], "hydra.sweeper.params.arm") == "grpo,gspo,grpo_r2,grpo_r3"
    assert setting(trains[1], "routing_variant.lr_scale") == "1,10000"
    reports = [call for call in calls if call[:2] == ["-m", "analysis.report"]]
    assert [call[call.index("--out") + 1] for call in reports] == [
        "docs/results/learning/sync/glm4_moe_l16",
        "docs/results/learning/sync/qwen30b_l16",
    ]
    assert all(kept_figures(call) == ["0", "1", "2", "3", "4b", "5"] for call in reports)  # the part-5 figures


def test_the_collapse_search_pushes_the_mini_batches_in_the_maps_regime_from_its_three_starts(tmp_path):
    """`docs/results/collapse/command.sh minibatches` (a recording `python`, which runs `python -c`): refused in one
    line before any start or run while regime.json is missing; then the regime's overrides in each sweep with N = 8,
    then N = 16 after them (N is the push, whatever the regime's), from the sigmoid rung's map starts 0-2, a report
    per N."""
    env, log = recording_python(tmp_path)
    fake = Path(env["PATH"].split(":")[0]) / "python"
    fake.write_text(
        f'#!/usr/bin/env bash\n[[ $1 == -c ]] && exec {sys.executable} "$@"\n' + fake.read_text().split("\n", 1)[1]
    )
    recipe = "glm4_moe_l16-addition-balanced-target-t1000"
    starts = tmp_path / "starts"
    for suffix in ("", "-start1", "-start2"):
        (starts / f"{recipe}{suffix}").mkdir(parents=True)
        (starts / f"{recipe}{suffix}" / "config.json").write_text("{}")
    script = RESULTS / "collapse" / "command.sh"
    env = {**env, "COLD_STARTS": str(starts), "REGIME": str(tmp_path / "regime.json")}
    refused = subprocess.run(["bash", str(script), "minibatches"], env=env, capture_output=True, text=True)
    assert refused.returncode == 2 and refused.stderr.startswith("error: ") and "regime.json" in refused.stderr
    assert not calls_in(log)
    regime = ["trainer.lr=3e-05", "trainer.prompts_per_step=32", "trainer.steps=400", "trainer.minibatches=2"]
    (tmp_path / "regime.json").write_text(json.dumps({"lever": "extension", "overrides": regime}))
    done = subprocess.run(["bash", str(script), "minibatches"], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    calls = calls_in(log)
    trains = [call for call in calls if call[:2] == ["-m", "experiments.train"]]
    pushed = [[arg for arg in call if arg.startswith("trainer.minibatches=")] for call in trains]
    assert pushed == [
        ["trainer.minibatches=2", "trainer.minibatches=8"],
        ["trainer.minibatches=2", "trainer.minibatches=16"],
    ]
    assert all(set(regime) <= set(call) and "experiment=collapse_search" in call for call in trains)
    paths = next(arg for arg in trains[0] if arg.startswith("model.path=")).split("=", 1)[1].split(",")
    assert [Path(path).name for path in paths] == [recipe, f"{recipe}-start1", f"{recipe}-start2"]
    reports = [call for call in calls if call[:2] == ["-m", "analysis.report"]]
    assert [call[call.index("--out") + 1] for call in reports] == [
        "docs/results/collapse/minibatches/n8",
        "docs/results/collapse/minibatches/n16",
    ]
    assert all(kept_figures(call) == ["1", "3", "4b", "7"] for call in reports)


def test_the_learning_staleness_cells_run_at_the_k_star_their_lag_map_picked(tmp_path):
    """`docs/results/learning/command.sh lagmap` then `staleness` (a recording `python`, which runs `python -c`): the
    lag map sweeps the naive arm and MiniRL at k = 0, 1, 2, 4 from the sigmoid rung's map starts in the regime, then
    its report and k*; the cells are refused in one line before any start or run until k_star.json exists, then run at
    k* and at 0 from the family's starts, seed 0 before seed 1, with the async study's arms."""
    env, log = recording_python(tmp_path)
    fake = Path(env["PATH"].split(":")[0]) / "python"
    fake.write_text(
        f'#!/usr/bin/env bash\n[[ $1 == -c ]] && exec {sys.executable} "$@"\n' + fake.read_text().split("\n", 1)[1]
    )
    sigmoid, softmax = "glm4_moe_l16-addition-balanced-target-t1000", "qwen30b_l16-addition-balanced-t1000"
    starts = tmp_path / "starts"
    for recipe in (sigmoid, softmax):
        for k in range(13):
            folder = starts / (recipe if k == 0 else f"{recipe}-start{k}")
            folder.mkdir(parents=True)
            (folder / "config.json").write_text("{}")
            (folder / "cold_start.json").write_text(json.dumps({"reached_target": True}))
    regime = ["trainer.lr=3e-05", "trainer.prompts_per_step=32", "trainer.steps=400"]
    (tmp_path / "regime.json").write_text(json.dumps({"lever": "extension", "overrides": regime}))
    script = RESULTS / "learning" / "command.sh"
    k_star = tmp_path / "k_star.json"
    env = {**env, "COLD_STARTS": str(starts), "REGIME": str(tmp_path / "regime.json"), "K_STAR": str(k_star)}
    refused = subprocess.run(["bash", str(script), "staleness"], env=env, capture_output=True, text=True)
    assert refused.returncode == 2 and refused.stderr.startswith("error: ") and "k_star.json" in refused.stderr
    assert not calls_in(log)
    mapped = subprocess.run(["bash", str(script), "lagmap"], env=env, capture_output=True, text=True)
    assert mapped.returncode == 0, mapped.stderr
    calls = calls_in(log)
    assert [call[:2] for call in calls] == [["-m", "experiments.train"], ["-m", "analysis.report"]] + [
        ["-m", "analysis.staleness_lag"]
    ]
    lag_map, report = calls[0], calls[1]
    assert {"experiment=learning_staleness", "rollout.lag=0,1,2,4", *regime} <= set(lag_map)
    assert kept_figures(report) == ["0", "9", "11"]
    paths = next(arg for arg in lag_map if arg.startswith("model.path=")).split("=", 1)[1].split(",")
    assert [Path(path).name for path in paths] == [sigmoid, f"{sigmoid}-start1", f"{sigmoid}-start2"]
    log.unlink()
    k_star.write_text(json.dumps({"k_star": 2}))
    done = subprocess.run(["bash", str(script), "staleness"], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    trains = [call for call in calls_in(log) if call[:2] == ["-m", "experiments.train"]]

    def setting(call: list[str], key: str) -> str:
        return next(arg.split("=", 1)[1] for arg in call if arg.startswith(key + "="))

    assert [(setting(call, "hydra.sweeper.params.seed"), setting(call, "rollout.lag")) for call in trains] == [
        ("0", "2"),
        ("0", "0"),
        ("1", "2"),
        ("1", "0"),
    ]
    assert setting(trains[0], "hydra.sweeper.params.arm") == "grpo_naive_async,grpo_decoupled,minirl,minirl_r3,gspo"
    assert setting(trains[1], "hydra.sweeper.params.arm") == "grpo_decoupled,minirl,gspo"
    (report,) = [call for call in calls_in(log) if call[:2] == ["-m", "analysis.report"]]
    assert kept_figures(report) == ["0", "9", "10", "11"]
    used = [Path(path).name for path in setting(trains[0], "model.path").split(",")]
    assert used == [f"{sigmoid}-start{k}" for k in range(3, 13)]
