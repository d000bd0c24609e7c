"""No run's data is ever lost or mixed up, and bad input is refused before any work: each case as a user meets it,
through the CLI where that is where it happens, with the one-line message and the data checked afterwards."""

from __future__ import annotations

import dataclasses
import importlib.util
import io
import json
import os
import pickle
import re
import resource
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

from experiments.config import PROJECT_ROOT, SFTConfig, TrainConfig, TrainerConfig, refuse_mistyped_overrides
from experiments.run.checkpoint import find as find_checkpoint
from experiments.run.logger import RunLogger
from experiments.run.resume import SAFE_TO_CHANGE
from experiments.step.metrics import STEP, THREADS
from experiments.train import RLTrainer, train
from models.policy import ModelConfig, build_policy
from models.registry import ConfigError
from models.routing.hooks import record_routing, replay_routing
from tests.conftest import MICRO_MODEL, MICRO_RUN
from tests.test_train import compose_train, read_metrics

pytestmark = pytest.mark.slow  # each test runs the CLI in a subprocess: not in the fast lane

CLI = [sys.executable, "-m", "experiments.train"]


def run_cli(*args: str, cwd: Path = PROJECT_ROOT, timeout: int = 300, module: str = "experiments.train"):
    return subprocess.run(
        [sys.executable, "-m", module, *args], capture_output=True, text=True, cwd=cwd, timeout=timeout
    )


def one_line(stderr: str) -> str:
    """The refusal: the last non-empty line, and no traceback anywhere."""
    assert "Traceback" not in stderr, stderr[-3000:]
    return [line for line in stderr.splitlines() if line.strip()][-1]


def run_patched(tmp_path: Path, fault: str, *args: str) -> subprocess.CompletedProcess:
    """`python -m experiments.train *args`, with `fault` (Python source) run first: the fault it plants."""
    (tmp_path / "fault.py").write_text(fault)
    code = "import fault, runpy; runpy.run_module('experiments.train', run_name='__main__', alter_sys=True)"
    return subprocess.run(
        [sys.executable, "-c", code, *args],
        capture_output=True,
        text=True,
        cwd=PROJECT_ROOT,
        timeout=600,
        env={**os.environ, "PYTHONPATH": f"{tmp_path}:{PROJECT_ROOT}"},
    )


def fault_in_the_checkpoint_writer(fault: str) -> str:
    """Python source that runs `fault` (statements of a function of `self`, torch's checkpoint writer, indented by
    four spaces) each time the writer is about to write a checkpoint's state, then lets it write."""
    return (
        "import errno, os, signal\n"
        "from torch.distributed.checkpoint import filesystem\n"
        "write = filesystem._FileSystemWriter.write_data\n"
        "def faulty_write(self, plan, planner):\n"
        f"{fault}"
        "    return write(self, plan, planner)\n"
        "filesystem._FileSystemWriter.write_data = faulty_write\n"
    )


def start(*args: str, cwd: Path = PROJECT_ROOT) -> subprocess.Popen:
    return subprocess.Popen([*CLI, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=cwd)


def wait_for_lines(path: Path, count: int, proc: subprocess.Popen, timeout: float = 120) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if path.exists() and len(path.read_text().splitlines()) >= count:
            return
        if proc.poll() is not None:
            raise AssertionError(f"the run ended before logging {count} steps: {proc.stderr.read()[-2000:]}")
        time.sleep(0.1)
    raise AssertionError(f"{path} did not reach {count} lines in {timeout} s")


# -- data lost or mixed up ----------------------------------------------------------------------------------------


def test_a_rerun_into_a_run_directory_is_refused_and_the_first_log_stays(tmp_path):
    first = run_cli(*MICRO_RUN, f"hydra.run.dir={tmp_path}")
    assert first.returncode == 0, first.stderr[-2000:]
    log = (tmp_path / "metrics.jsonl").read_text()
    config = (tmp_path / ".hydra" / "config.yaml").read_text()
    again = run_cli(*MICRO_RUN, "trainer.lr=1e-3", f"hydra.run.dir={tmp_path}")
    assert again.returncode != 0
    assert "already holds a run (3 logged steps, status 'finished')" in one_line(again.stderr)
    assert (tmp_path / "metrics.jsonl").read_text() == log
    assert (tmp_path / ".hydra" / "config.yaml").read_text() == config, "the first run's config was overwritten"


def test_two_runs_started_together_get_their_own_directories_and_one_directory_one_run(tmp_path):
    # Default directories: two runs started in the same second. The owner runs until it is stopped (200 steps ended
    # before a third process had imported torch on a loaded machine), so that a run given its directory meets it.
    owner = start(*MICRO_RUN, "trainer.lr=1e-2", "trainer.steps=100000", cwd=tmp_path)
    other = start(*MICRO_RUN, "trainer.lr=2e-2", cwd=tmp_path)
    assert other.wait(timeout=300) == 0, other.stderr.read()[-2000:]
    deadline = time.time() + 120  # the owner, on a loaded machine, may still be importing
    while len(runs := sorted(tmp_path.glob("outputs/train/*/*/"))) < 2 and owner.poll() is None:
        assert time.time() < deadline, runs
        time.sleep(0.1)
    assert len(runs) == 2, runs
    (finished,) = [run for run in runs if (run / "summary.json").exists()]
    (shared,) = [run for run in runs if run != finished]
    assert json.loads((finished / "summary.json").read_text())["steps"] == 3
    # One directory given to two runs at once: the second is refused while the first runs, whose log is whole.
    wait_for_lines(shared / "metrics.jsonl", 1, owner)
    intruder = run_cli(*MICRO_RUN, f"hydra.run.dir={shared}")
    assert intruder.returncode != 0 and "is in use by another run" in one_line(intruder.stderr)
    owner.send_signal(signal.SIGTERM)
    owner.wait(timeout=120)
    for run in runs:
        lines = read_metrics(run)
        assert [line[STEP] for line in lines] == list(range(1, len(lines) + 1))
    assert json.loads((shared / "summary.json").read_text())["status"] == "interrupted"


@pytest.mark.parametrize("signum, code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_sigterm_and_ctrl_c_end_the_run_cleanly(tmp_path, signum, code):
    proc = start(*MICRO_RUN, "trainer.steps=500", "logger.wandb.mode=offline", f"hydra.run.dir={tmp_path}")
    wait_for_lines(tmp_path / "metrics.jsonl", 2, proc)
    proc.send_signal(signum)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == code
    assert f"interrupted by {signal.Signals(signum).name} after" in one_line(stderr)
    summary = json.loads((tmp_path / "summary.json").read_text())
    lines = read_metrics(tmp_path)
    assert summary["status"] == "interrupted" and summary["steps"] == len(lines) >= 2
    assert [line[STEP] for line in lines] == list(range(1, len(lines) + 1)), "no partial step is logged"
    wandb_run = next((tmp_path / "wandb").glob("offline-run-*"))
    assert any(wandb_run.glob("*.wandb")), "W&B was closed with the run"


def test_one_bad_cell_of_a_sweep_is_reported_before_the_start_and_the_others_run(tmp_path):
    sweep = tmp_path / "sweep"
    result = run_cli(
        "-m",
        "routing.replay=r2,none",
        "model=tiny_moe,tiny_dense",
        *MICRO_RUN,
        "trainer.steps=1",
        f"hydra.sweep.dir={sweep}",
        timeout=600,
    )
    assert result.returncode != 0
    head = result.stderr.split("\n")[0]
    assert head == "moe-rl-lab: 1 of 4 jobs of this sweep will be refused; the other 3 run:", result.stderr[-3000:]
    assert "routing.replay=r2 model=tiny_dense" in result.stderr and "needs an MoE model" in result.stderr
    tail = result.stderr.split("moe-rl-lab: 1 job(s) of the sweep did not finish")[1]
    assert (
        "1_grpo_r2_micro_moe_s0 (refused by the sweep's start-up check: routing.replay=r2 needs an MoE model" in tail
    ), "the sweep says which job it refused itself"
    assert len(list(sweep.glob("*/summary.json"))) == 3


def test_a_sweep_whose_every_job_lacks_its_cold_start_names_the_command_and_launches_nothing(tmp_path):
    """The line named the path, not the command that makes it; the sweep said "2 of 2 jobs will be refused" and then
    launched both."""
    sweep, missing = tmp_path / "sweep", tmp_path / "cold_start"
    result = run_cli("-m", "seed=0,1", *MICRO_RUN, f"model.path={missing}", f"hydra.sweep.dir={sweep}")
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert result.stderr.startswith(
        "moe-rl-lab: every one of the 2 jobs of this sweep would be refused, so none is launched:"
    ), result.stderr[-2000:]
    assert (
        f"make this cold start with `python -m experiments.sft model=micro_moe dataset=addition "
        f"sft.output_dir={missing}`"
    ) in result.stderr
    assert not sweep.exists(), "no job was launched, and the sweep's directory it made is not left empty"


def test_a_crashing_job_keeps_its_traceback_and_the_sweep_goes_on(tmp_path, monkeypatch):
    """A bug is not a refusal: its traceback is printed, the next job runs, the sweep exits non-zero."""
    sweep = tmp_path / "sweep"
    crash = (
        "import experiments.step.trainer as trainer\n"
        "step = trainer.RLTrainer.step\n"
        "def crashing(self):\n"
        "    if self.cfg.seed == 0:\n"
        "        raise ZeroDivisionError('a bug in the step')\n"
        "    return step(self)\n"
        "trainer.RLTrainer.step = crashing\n"
    )
    result = run_patched(tmp_path, crash, "-m", "seed=0,1", *MICRO_RUN, "trainer.steps=1", f"hydra.sweep.dir={sweep}")
    assert result.returncode != 0
    assert "Traceback" in result.stderr and "ZeroDivisionError: a bug in the step" in result.stderr
    assert len(list(sweep.glob("*/summary.json"))) == 1, "the second job ran"


def test_a_stop_during_a_step_commit_lands_after_it_even_when_another_thread_takes_the_signal():
    """The kernel may hand SIGTERM to any thread that does not block it; Python then runs the handler on the main
    thread at once, which must not cut a commit (log line written, step not yet counted) in two."""
    import threading

    from experiments.run.stops import StopRequested, stop_deferred, stop_signals

    other = threading.Thread(target=time.sleep, args=(2,), daemon=True)  # a thread that does not block signals
    other.start()
    committed = []
    with pytest.raises(StopRequested), stop_signals():
        with stop_deferred():
            os.kill(os.getpid(), signal.SIGTERM)
            for _ in range(10):  # the GIL released and taken back, as a log write does: where a handler would run
                time.sleep(0.02)
            committed.append("step")
    assert committed == ["step"]


def test_killing_a_joblib_sweep_ends_its_running_jobs_as_interrupted(tmp_path):
    """SIGKILL of the Hydra process leaves no orphaned worker training on: each running job ends as interrupted."""
    sweep = tmp_path / "sweep"
    proc = start(
        "-m",
        "seed=0,1",
        *MICRO_RUN,
        "trainer.steps=500",
        "trainer.threads=1",
        "hydra/launcher=joblib",
        "hydra.launcher.n_jobs=2",
        f"hydra.sweep.dir={sweep}",
    )
    deadline = time.time() + 180
    while len([p for p in sweep.glob("*/metrics.jsonl") if p.read_text().count("\n") >= 2]) < 2:
        assert proc.poll() is None and time.time() < deadline, "both jobs should be training"
        time.sleep(0.2)
    proc.kill()
    proc.communicate(timeout=30)
    while len(list(sweep.glob("*/summary.json"))) < 2:
        assert time.time() < deadline + 60, "a worker kept training after its sweep was killed"
        time.sleep(0.2)
    for summary in sweep.glob("*/summary.json"):
        assert json.loads(summary.read_text())["status"] == "interrupted"


def test_resuming_a_run_whose_directory_is_in_use_is_told_to_wait_not_to_move(tmp_path):
    """resume=auto into a directory another process holds was told to give the run its own hydra.run.dir: a resume
    cannot continue a run anywhere but in its own directory."""
    import fcntl

    tmp_path.joinpath(".lock").touch()
    with open(tmp_path / ".lock") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # the other run
        with pytest.raises(SystemExit) as raised:
            train(compose_train("resume=auto"), tmp_path)
    line = str(raised.value)
    assert "is in use by another run right now: resume it once that run has ended (or stop it first)" in line
    assert "hydra.run.dir" not in line


def test_an_unwritable_run_directory_is_one_line(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    result = run_cli(*MICRO_RUN, f"hydra.run.dir={blocker / 'run'}")
    assert result.returncode != 0 and "cannot be created: Not a directory" in one_line(result.stderr)


def test_a_disk_that_fills_in_the_middle_of_a_line_leaves_only_whole_lines(tmp_path):
    """A file-size limit plays the full disk: the kernel writes a step's line up to it, then refuses the rest (the
    way a 5.8 kB piece of a line was once left behind). The limit is put halfway into step 2's line, measured by the
    same run without a limit (a line's size follows the metrics logged, ~7 kB today; the runs are the same bits)."""
    free, full = tmp_path / "a", tmp_path / "b"  # paths of one length: the lines differ in nothing else
    subprocess.run(
        [*CLI, *MICRO_RUN, f"hydra.run.dir={free}"], capture_output=True, cwd=PROJECT_ROOT, timeout=300, check=True
    )
    first, second = ((free / "metrics.jsonl").read_text().splitlines(keepends=True))[:2]
    limit = len(first.encode()) + len(second.encode()) // 2

    def limited() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))  # Python ignores SIGXFSZ: the write fails instead

    done = subprocess.run(
        [*CLI, *MICRO_RUN, f"hydra.run.dir={full}"],
        capture_output=True,
        text=True,
        cwd=PROJECT_ROOT,
        timeout=300,
        preexec_fn=limited,
    )
    assert done.returncode == 1
    line = one_line(done.stderr)
    assert f"cannot write metrics.jsonl in {full}: File too large" in line
    kept = re.search(r"it holds steps up to (\d+) \(the partial line of step (\d+) was cut off\)", line)
    assert kept and int(kept[2]) == int(kept[1]) + 1, line
    text = (full / "metrics.jsonl").read_text()
    assert text.endswith("\n"), "a partial line was left"
    assert [json.loads(row)[STEP] for row in text.splitlines()] == list(range(1, int(kept[1]) + 1))


def remove_after_step(monkeypatch, step: int, remove) -> None:
    """`remove(run_dir)` right after the run logs `step`: a user's `rm` between two steps."""
    real_log = RunLogger.log

    def log(logger, record):
        real_log(logger, record)
        if record[STEP] == step:
            remove(logger.run_dir)

    monkeypatch.setattr(RunLogger, "log", log)


def test_a_run_directory_removed_mid_run_stops_the_run_at_the_next_step_in_one_line(tmp_path, monkeypatch):
    run_dir = tmp_path / "run"
    remove_after_step(monkeypatch, 2, shutil.rmtree)
    with pytest.raises(SystemExit) as ended:
        train(compose_train("trainer.steps=6"), run_dir)
    line = str(ended.value)
    assert "\n" not in line and line.startswith(
        f"moe-rl-lab: the run directory {run_dir} was removed after step 2 (noticed as step 3 was to be logged)"
    ), line
    assert f"cannot write summary.json in {run_dir}: No such file or directory; the log is gone with it" in line
    assert "holds" not in line, "the line claims a log that no longer exists"
    assert not run_dir.exists(), "nothing was written into a new directory of the old name"


@pytest.mark.parametrize("how", ["removed", "replaced by another file"])
def test_a_log_removed_or_replaced_mid_run_stops_the_run_and_the_summary_says_failed(tmp_path, monkeypatch, how):
    run_dir = tmp_path / "run"

    def remove(directory: Path) -> None:
        (directory / "metrics.jsonl").unlink()
        if how != "removed":
            (directory / "metrics.jsonl").write_text("")

    remove_after_step(monkeypatch, 2, remove)
    with pytest.raises(SystemExit) as ended:
        train(compose_train("trainer.steps=6"), run_dir)
    line = str(ended.value)
    why = f"{run_dir / 'metrics.jsonl'} was {how} after step 2 (noticed as step 3 was to be logged)"
    assert "\n" not in line and why in line and "says status 'failed'" in line and "holds" not in line, line
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "failed" and why in summary["failed"] and summary["steps"] == 2
    replacement = run_dir / "metrics.jsonl"
    assert (not replacement.exists()) if how == "removed" else replacement.read_text() == "", "the run wrote on"


# -- runs that end early: divergence, signals during a checkpoint -------------------------------------------------


@pytest.mark.parametrize(
    "lr, why",
    [
        ("1e39", "update 0 of the step left the weights non-finite"),  # AdamW's first step moves each weight by ~lr
        ("1e30", "the trainer's model produced logits that are NaN or inf"),  # finite weights, overflowing forward
    ],
)
def test_a_run_that_diverges_ends_in_one_line_with_its_log_whole_and_status_diverged(tmp_path, lr, why):
    done = run_cli(*MICRO_RUN, f"trainer.lr={lr}", f"hydra.run.dir={tmp_path}")
    assert done.returncode == 1
    line = one_line(done.stderr)
    assert "moe-rl-lab: the run diverged in step" in line and why in line and "says status 'diverged'" in line
    summary = json.loads((tmp_path / "summary.json").read_text())
    lines = read_metrics(tmp_path)
    assert summary["status"] == "diverged" and why in summary["diverged"]
    assert summary["steps"] == len(lines) and [row[STEP] for row in lines] == list(range(1, len(lines) + 1))


def test_sigterm_while_a_checkpoint_is_written_lands_after_the_write(tmp_path):
    """torch's checkpoint writer catches whatever is raised inside it and raises CheckpointException instead: a stop
    that landed there ended the run with exit code 1, a traceback and no summary."""
    stop_in_checkpoint = fault_in_the_checkpoint_writer(
        "    os.kill(os.getpid(), signal.SIGTERM)  # handled at the next instruction: inside the writer\n"
    )
    run_dir = tmp_path / "run"
    done = run_patched(
        tmp_path, stop_in_checkpoint, *MICRO_RUN, "trainer.checkpoint_every=1", f"hydra.run.dir={run_dir}"
    )
    assert done.returncode == 143
    assert "interrupted by SIGTERM after 1 of 3 steps" in one_line(done.stderr)
    assert json.loads((run_dir / "summary.json").read_text())["status"] == "interrupted"
    assert [p.name for p in (run_dir / "checkpoints").iterdir()] == ["step_000001"], "the checkpoint was finished"


def test_a_full_disk_during_a_checkpoint_write_is_one_line_removes_the_partial_checkpoint_and_keeps_the_last(tmp_path):
    """The write failed in a 28-frame traceback, with no summary and the partial checkpoint left to keep the disk
    full."""
    disk_full_at_the_second_checkpoint = fault_in_the_checkpoint_writer(
        "    faulty_write.calls = getattr(faulty_write, 'calls', 0) + 1\n"
        "    if faulty_write.calls == 2:\n"
        "        (filesystem.Path(self.path) / '__0_0.distcp').write_bytes(b'part of a checkpoint')\n"
        "        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))\n"
    )
    run_dir = tmp_path / "run"
    done = run_patched(
        tmp_path,
        disk_full_at_the_second_checkpoint,
        *MICRO_RUN,
        "trainer.checkpoint_every=1",
        f"hydra.run.dir={run_dir}",
    )
    assert done.returncode == 1
    line = one_line(done.stderr)
    assert (
        f"cannot write checkpoint step_000002 in {run_dir / 'checkpoints'}: No space left on device; the partial "
        "one was removed, and step_000001 is the newest checkpoint"
    ) in line
    assert "holds 2 step(s), and" in line and "says status 'failed'" in line
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "failed" and "No space left on device" in summary["failed"]
    assert [row[STEP] for row in read_metrics(run_dir)] == [1, 2]
    assert [p.name for p in (run_dir / "checkpoints").iterdir()] == ["step_000001"], "no partial checkpoint is left"
    assert find_checkpoint(run_dir, "auto") == (run_dir / "checkpoints" / "step_000001", [])


def test_wandb_online_without_its_server_waits_a_bounded_time_and_the_summary_says_it_never_started(
    tmp_path, monkeypatch
):
    """logger.wandb.mode=online on a machine that cannot reach W&B waited ~100 s per job in silence (W&B's own
    90 s init timeout), then fell back to metrics.jsonl with nothing in the summary saying W&B never started. A server
    that accepts connections and never answers plays the unreachable one."""
    import socket

    server = socket.create_server(("127.0.0.1", 0))
    monkeypatch.setenv("WANDB_BASE_URL", f"http://127.0.0.1:{server.getsockname()[1]}")
    monkeypatch.setenv("WANDB_API_KEY", "0" * 40)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    with (
        server,
        pytest.warns(
            UserWarning,
            match=r"W&B did not start in online mode within "
            r"logger.wandb.init_timeout=2 s \(.*\); logging to metrics.jsonl",
        ),
    ):
        summary = train(compose_train("logger.wandb.mode=online", "logger.wandb.init_timeout=2"), tmp_path)
    assert summary["status"] == "finished"
    recorded = json.loads((tmp_path / "summary.json").read_text())["wandb"]
    assert recorded["mode"] == "online" and recorded["started"] is False
    assert recorded["problem"].startswith("did not start (")


def test_ctrl_c_while_wandb_starts_ends_the_run_as_interrupted_with_its_summary(tmp_path):
    """W&B's start sat outside the block that handles stops: a 45-frame traceback, exit code 1, no summary."""
    interrupted_start = (
        "import os, signal, time, wandb\n"
        "def interrupted_init(*args, **kwargs):\n"
        "    os.kill(os.getpid(), signal.SIGINT)\n"
        "    time.sleep(60)\n"
        "wandb.init = interrupted_init\n"
    )
    run_dir = tmp_path / "run"
    done = run_patched(tmp_path, interrupted_start, *MICRO_RUN, "logger.wandb.mode=offline", f"hydra.run.dir={run_dir}")
    assert done.returncode == 130
    assert "interrupted by SIGINT after 0 of 3 steps" in one_line(done.stderr)
    assert json.loads((run_dir / "summary.json").read_text())["status"] == "interrupted"
    # the same run again into its directory is refused, and told how to continue the interrupted one
    with pytest.raises(SystemExit) as raised:
        train(compose_train(), run_dir)
    assert (
        "already holds a run (0 logged steps, status 'interrupted'); it is never overwritten: resume=auto "
        "continues it (from its newest checkpoint, or from its start when it has none)"
    ) in str(raised.value)
    assert train(compose_train("resume=auto"), run_dir)["status"] == "finished"


def test_ctrl_c_during_the_imports_ends_the_process_without_a_traceback(tmp_path):
    """The seconds the imports take ended in a 40-line traceback of whichever import Ctrl-C cut."""
    interrupt_at_the_first_import_of_torch = (
        "import os, signal, sys\n"
        "class Interrupt:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'torch':\n"
        "            os.kill(os.getpid(), signal.SIGINT)\n"
        "        return None\n"
        "sys.meta_path.insert(0, Interrupt())\n"
    )
    done = run_patched(
        tmp_path, interrupt_at_the_first_import_of_torch, *MICRO_RUN, f"hydra.run.dir={tmp_path / 'run'}"
    )
    assert done.returncode == -signal.SIGINT, done.stderr[-2000:]
    assert "Traceback" not in done.stderr and not (tmp_path / "run").exists()


# -- launchers: SLURM, torchrun -----------------------------------------------------------------------------------


def test_cluster_slurm_without_a_sweep_or_without_slurm_is_one_line(tmp_path):
    single = run_cli(*MICRO_RUN, "cluster=slurm", f"hydra.run.dir={tmp_path / 'run'}")
    assert single.returncode == 1
    line = one_line(single.stderr)
    assert "cluster=slurm submits the jobs of a sweep to SLURM, and without -m this is one run" in line
    assert not (tmp_path / "run").exists(), "no rank started here"
    no_slurm_path = {**os.environ, "PATH": str(Path(sys.executable).parent)}  # no sbatch, no srun on it
    sweep = subprocess.run(
        [*CLI, "-m", *MICRO_RUN, "cluster=slurm", f"hydra.sweep.dir={tmp_path / 'sweep'}"],
        capture_output=True,
        text=True,
        cwd=PROJECT_ROOT,
        timeout=300,
        env=no_slurm_path,
    )
    assert sweep.returncode == 1
    line = one_line(sweep.stderr)
    assert "with sbatch and srun, and this machine has no sbatch or srun: run the sweep on a SLURM login node" in line
    assert not (tmp_path / "sweep").exists()


def test_a_job_of_several_ranks_is_refused_once_before_torchrun_starts(tmp_path):
    done = run_cli(*MICRO_RUN, "launch.nproc_per_node=2", "trainer.prompts_per_step=3", f"hydra.run.dir={tmp_path}")
    assert done.returncode == 1
    assert "trainer.prompts_per_step=3 does not split over the 2 ranks" in one_line(done.stderr)
    assert done.stderr.count("moe-rl-lab:") == 1 and "ChildFailedError" not in done.stderr


def test_a_job_of_several_ranks_refuses_its_run_directory_and_checkpoint_before_torchrun_starts(tmp_path):
    """Rank 0 alone checked the run directory and the checkpoint to resume, once torchrun had started the ranks: the
    one line was followed by torchrun's own 40-line report of the failed ranks (ChildFailedError), which no rank can
    silence (docs/reliability.md)."""
    run_dir = tmp_path / "run"
    train(compose_train("trainer.checkpoint_every=3"), run_dir)
    again = run_cli(*MICRO_RUN, "launch.nproc_per_node=2", f"hydra.run.dir={run_dir}")
    assert again.returncode == 1 and "already holds a run (3 logged steps, status 'finished')" in one_line(again.stderr)
    assert again.stderr.count("moe-rl-lab:") == 1 and "ChildFailedError" not in again.stderr
    (run_dir / "summary.json").unlink()  # as a kill after the last checkpoint leaves it
    resumed = run_cli(
        *MICRO_RUN, "trainer.checkpoint_every=3", "launch.nproc_per_node=2", "resume=auto", f"hydra.run.dir={run_dir}"
    )
    assert resumed.returncode == 1
    assert "step_000003 was written by 1 ranks, this run has 2" in one_line(resumed.stderr)
    assert resumed.stderr.count("moe-rl-lab:") == 1 and "ChildFailedError" not in resumed.stderr
    assert not (run_dir / "checkpoints" / "step_000003.superseded").exists(), "the check changed nothing"
    # That the check passes a run of the job's own ranks, which then resumes: test_distributed's killed run of two.


@pytest.mark.parametrize(
    "schema, arguments, refusal",
    [
        (
            TrainConfig,
            ["rollout.lag=1.5"],
            "rollout.lag=1.5 is refused: Value '1.5' of type 'float' could not be converted to Integer",
        ),
        (
            TrainConfig,
            ["rollout.lag=abc"],
            "rollout.lag=abc is refused: Value 'abc' of type 'str' could not be converted",
        ),
        (TrainConfig, ["rollout.max_staleness=0.5"], "rollout.max_staleness=0.5 is refused"),
        (TrainConfig, ["-m", "algo=grpo,gspo", "rollout.lag=0,2.5"], "rollout.lag=2.5 is refused"),
        (TrainConfig, ["trainer.steps=true"], "trainer.steps=true is refused: Value 'True' of type 'bool'"),
        (
            TrainConfig,
            ["cpu_kernels=fast"],
            "cpu_kernels=fast is refused: Invalid value 'fast', expected one of [portable, native]",
        ),
        (SFTConfig, ["sft.max_steps=ten"], "sft.max_steps=ten is refused"),
        (
            TrainConfig,
            [
                "rollout.lag=0,2",
                "algo=gspo",
                "algo.clip_eps=0.1",
                "seed=range(0,3)",
                "model.path=null",
                "rollout.max_staleness=${rollout.lag}",
                "+extra=1",
            ],
            None,
        ),
    ],
)
def test_a_value_its_key_cannot_hold_is_refused_in_one_line_before_hydra(schema, arguments, refusal):
    """A sweep's every value is checked; keys the root schema does not type (a group's choice, an objective's field, an
    added key) and interpolations pass on to Hydra."""
    if refusal is None:
        refuse_mistyped_overrides(arguments, schema)
        return
    with pytest.raises(SystemExit) as refused:
        refuse_mistyped_overrides(arguments, schema)
    assert str(refused.value).startswith(f"moe-rl-lab: {refusal}") and "\n" not in str(refused.value)


def test_a_non_integer_lag_on_the_command_line_is_one_line(tmp_path):
    done = run_cli(*MICRO_RUN, "rollout.lag=1.5", f"hydra.run.dir={tmp_path}")
    assert done.returncode == 1 and done.stderr.strip() == (
        "moe-rl-lab: rollout.lag=1.5 is refused: Value '1.5' of type 'float' could not be converted to Integer"
    )


# -- crashes late that a start-up check catches -------------------------------------------------------------------


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["device=meta"], "device='meta' is not one of cpu, cuda, cuda:<index>"),
        (["device=mps"], "device='mps' is not one of cpu, cuda, cuda:<index>"),
        (["device=cuda:x"], "device='cuda:x' is not one of cpu, cuda, cuda:<index>"),
        (["trainer.lr=inf"], "trainer.lr=inf must be a finite number > 0"),
        (["trainer.lr=nan"], "trainer.lr=nan must be a finite number > 0"),
        (["trainer.lr=1e-45"], "trainer.lr=1e-45 is below 1e-10: an AdamW update moves each weight by about lr"),
        (["trainer.adam_beta1=1.5"], "trainer.adam_beta1=1.5 must be in [0, 1)"),
        (["trainer.eval_prompts=100"], "trainer.eval_prompts=100 is more than the 20 held-out examples"),
        (["trainer.prompts_per_step=100000", "trainer.group_size=64"], "GiB available: lower the batch"),
        (["+trainer.lr_typo=1"], "unknown config key(s) trainer.lr_typo"),
        (["model.num_key_value_heads=3"], "model.num_key_value_heads=3 must divide model.num_attention_heads=4"),
    ],
)
def test_values_that_would_crash_later_are_refused_at_start_up(tmp_path, overrides, message):
    with pytest.raises(SystemExit) as raised:
        train(compose_train(*overrides), tmp_path)
    assert message in str(raised.value) and "\n" not in str(raised.value)
    assert not (tmp_path / "metrics.jsonl").exists()


def test_float16_weights_are_refused_at_start_up_naming_what_trains(tmp_path):
    """float16 weights were accepted on CPU, and the run died in a later step with a traceback."""
    with pytest.raises(SystemExit) as refused:
        train(compose_train("model.dtype=float16"), tmp_path)
    line = str(refused.value)
    assert "\n" not in line and "model.dtype=float16 cannot be trained on cpu: AdamW keeps its moments" in line
    assert "on cpu train in model.dtype=float32 or bfloat16" in line
    assert not (tmp_path / "metrics.jsonl").exists()


def test_no_evaluation_and_greedy_only_evaluation_finish_with_a_summary(tmp_path, capsys):
    summary = train(compose_train("trainer.eval_prompts=0"), tmp_path / "none")
    assert summary["status"] == "finished" and summary["eval_greedy_accuracy"] is None
    assert not any(key.startswith("eval/") for key in read_metrics(tmp_path / "none")[-1])
    summary = train(compose_train("trainer.eval_samples=0"), tmp_path / "greedy")
    assert summary["eval_accuracy"] is None and summary["eval_greedy_accuracy"] is not None
    assert "held-out pass@1 n/a" in capsys.readouterr().out


def test_an_unknown_arm_is_refused(tmp_path):
    result = run_cli(*MICRO_RUN, "arm=grpo_r9", f"hydra.run.dir={tmp_path}")
    assert result.returncode != 0 and "Could not find 'arm/grpo_r9'" in result.stderr
    assert not (tmp_path / "metrics.jsonl").exists()


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed here (tests/test_vllm.py)")
def test_the_vllm_engine_without_vllm_is_refused_with_the_install_command(tmp_path):
    done = run_cli(*MICRO_RUN, "rollout.engine=vllm", f"hydra.run.dir={tmp_path}")
    line = one_line(done.stderr)
    assert done.returncode == 1 and "`make test-vllm` builds .venv-vllm" in line
    assert "then run with .venv-vllm/bin/python -m experiments.train" in line
    assert "pip install" not in line, "pyproject.toml says the vllm extra cannot be installed next to the project"
    assert not (tmp_path / "metrics.jsonl").exists()


def test_replay_checks_every_forward_of_its_context(micro_policy):
    model, _ = micro_policy
    ids = torch.randint(4, 40, (2, 6))
    with torch.no_grad(), record_routing(model) as recording:
        model(input_ids=ids)
    with torch.no_grad(), replay_routing(model, recording.trace):
        model(input_ids=ids)
        with pytest.raises(ValueError, match=r"covers batch x positions \(2, 6\) but this forward .* feeds \(2, 5\)"):
            model(input_ids=ids[:, :5])


@pytest.mark.parametrize("recorded_on, replayed_on", [(4, 8), (8, 4)])
def test_a_routing_trace_replays_only_on_a_model_of_its_expert_count(recorded_on, replayed_on):
    """A trace of 4 experts on a model of 8 replayed silently: all its ids are in range."""
    ids = torch.randint(4, 40, (2, 6))
    recorder, _ = build_policy(ModelConfig(**{**MICRO_MODEL, "num_experts": recorded_on}))
    target, _ = build_policy(ModelConfig(**{**MICRO_MODEL, "num_experts": replayed_on}))
    with torch.no_grad(), record_routing(recorder) as recording:
        recorder(input_ids=ids)
    with torch.no_grad(), replay_routing(target, recording.trace), pytest.raises(ValueError) as raised:
        target(input_ids=ids)
    assert str(raised.value) == (
        f"routing trace was recorded with num_experts={recorded_on}, and this model routes "
        f"over num_experts={replayed_on}: a trace replays only on a model of its own expert "
        "count"
    )


# -- corrupted checkpoints and data files ------------------------------------------------------------------------


@pytest.fixture
def checkpoint(tmp_path) -> Path:
    model, tokenizer = build_policy(ModelConfig(**MICRO_MODEL))
    model.save_pretrained(tmp_path / "ckpt")
    tokenizer.save_pretrained(tmp_path / "ckpt")
    return tmp_path / "ckpt"


def _break(path: Path, how: str) -> None:
    config = path / "config.json"
    weights = path / "model.safetensors"
    if how == "config":
        config.write_text("{not json")
    elif how == "model_type":
        config.write_text(json.dumps({**json.loads(config.read_text()), "model_type": "mamba2"}))
    elif how == "no_weights":
        weights.unlink()
    elif how == "truncated":
        weights.write_bytes(weights.read_bytes()[:1000])
    elif how == "shape":
        config.write_text(json.dumps({**json.loads(config.read_text()), "hidden_size": 48}))
    elif how == "no_tokenizer":
        for name in ("tokenizer.json", "tokenizer_config.json"):
            (path / name).unlink(missing_ok=True)


@pytest.mark.parametrize(
    "how, message",
    [
        ("config", "config.json is not a JSON object"),
        ("model_type", "is a 'mamba2' model; supported: MoE families"),
        ("no_weights", "holds no weights"),
        ("truncated", "the weights do not load"),
        ("shape", "the weights do not load"),
        ("no_tokenizer", "holds no tokenizer"),
    ],
)
def test_a_broken_checkpoint_is_refused_in_one_line(tmp_path, checkpoint, how, message):
    _break(checkpoint, how)
    with pytest.raises(SystemExit) as raised:
        train(compose_train("model=checkpoint", f"model.path={checkpoint}"), tmp_path / "run")
    assert message in str(raised.value) and "\n" not in str(raised.value)


DAMAGEABLE = ["trainer.json", "rng_rank0.pt", "python_random_rank0.json", "state/.metadata", "state/__0_0.distcp"]


@pytest.fixture(scope="module")
def killed_after_three_checkpoints(tmp_path_factory) -> Path:
    """A run directory as a SIGKILL after step 3 leaves it: checkpoints of steps 1-3, no summary."""
    run_dir = tmp_path_factory.mktemp("killed") / "run"
    train(compose_train("trainer.checkpoint_every=1", "trainer.keep_checkpoints=3"), run_dir)
    (run_dir / "summary.json").unlink()
    return run_dir


def _damage(path: Path, how: str) -> None:
    if how == "deleted":
        path.unlink()
    else:
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


@pytest.mark.parametrize("how", ["truncated", "deleted"])
@pytest.mark.parametrize("name", DAMAGEABLE)
def test_a_damaged_checkpoint_is_named_by_its_file_before_anything_loads(
    killed_after_three_checkpoints, tmp_path, name, how
):
    """Each damaged file raised its own traceback (zip, EOFError, JSONDecodeError, FileNotFoundError,
    CheckpointException), some after the model had been loaded from it."""
    run_dir = tmp_path / "run"
    shutil.copytree(killed_after_three_checkpoints, run_dir)
    newest = run_dir / "checkpoints" / "step_000003"
    _damage(newest / name, how)
    with pytest.raises(ConfigError) as raised:
        find_checkpoint(run_dir, str(newest))
    assert str(newest / name) in str(raised.value) and "\n" not in str(raised.value)
    found, passed_over = find_checkpoint(run_dir, "auto")
    assert found == run_dir / "checkpoints" / "step_000002" and len(passed_over) == 1
    assert passed_over[0].startswith(str(newest / name))


def test_resume_refuses_a_damaged_checkpoint_and_auto_takes_the_newest_intact_one_saying_so(
    killed_after_three_checkpoints, tmp_path
):
    run_dir = tmp_path / "run"
    shutil.copytree(killed_after_three_checkpoints, run_dir)
    newest = run_dir / "checkpoints" / "step_000003"
    _damage(newest / "state" / "__0_0.distcp", "truncated")
    settings = [*MICRO_RUN, "trainer.checkpoint_every=1", "trainer.keep_checkpoints=3", f"hydra.run.dir={run_dir}"]
    explicit = run_cli(*settings, f"resume={newest}")
    assert explicit.returncode == 1
    line = one_line(explicit.stderr)
    assert f"is a damaged checkpoint: {newest / 'state' / '__0_0.distcp'} holds " in line
    assert "bytes its index needs; resume=auto takes the newest intact one" in line
    auto = run_cli(*settings, "resume=auto")
    assert auto.returncode == 0, auto.stderr[-3000:]
    assert (
        f"resuming from {run_dir / 'checkpoints' / 'step_000002'} (step 2), the newest intact checkpoint, passing "
        f"over 1 damaged: {newest / 'state' / '__0_0.distcp'} holds "
    ) in auto.stderr
    assert [row[STEP] for row in read_metrics(run_dir)] == [1, 2, 3]
    assert json.loads((run_dir / "summary.json").read_text())["status"] == "finished"


class _Code:
    """A pickle that runs a command when it is unpickled: what a hostile checkpoint holds."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def _overwrite_a_tensor(state: Path, how: str, marker: Path) -> Path:
    """Overwrite bytes of the first weight tensor of the state's shard in place, its length kept: with a pickle that
    would run a command (`payload`), or with one float's bits flipped in the middle of its data (`flipped`)."""
    from experiments.run.checkpoint import read_index

    index = read_index(state / ".metadata")
    stored = next(
        info for key, info in index.storage_data.items() if key.fqn.startswith("model.") and info.length > 1024
    )
    shard = state / stored.relative_path
    data = bytearray(shard.read_bytes())
    if how == "payload":
        payload = pickle.dumps(_Code(marker))
        data[stored.offset : stored.offset + len(payload)] = payload
    else:
        middle = stored.offset + stored.length // 2
        data[middle] ^= 0x40
    shard.write_bytes(bytes(data))
    return shard


@pytest.mark.parametrize("how", ["payload", "flipped"])
def test_a_tensor_whose_bytes_changed_in_place_is_damage_and_auto_falls_back(
    killed_after_three_checkpoints, tmp_path, how
):
    """The damage check measured the tensor files' lengths alone: a payload in a tensor's bytes passed it and failed
    inside the checkpoint's load in a 24-frame traceback, and resume=auto took that checkpoint every time instead of
    the intact one before it; a flipped bit in a weight resumed silently with another weight."""
    run_dir = tmp_path / "run"
    shutil.copytree(killed_after_three_checkpoints, run_dir)
    newest = run_dir / "checkpoints" / "step_000003"
    marker = tmp_path / "code_ran"
    shard = _overwrite_a_tensor(newest / "state", how, marker)
    with pytest.raises(ConfigError) as raised:
        find_checkpoint(run_dir, str(newest))
    line = str(raised.value)
    assert f"is a damaged checkpoint: {shard} is not the file the checkpoint was written with: its sha256 is" in line
    assert "\n" not in line
    settings = ["trainer.checkpoint_every=1", "trainer.keep_checkpoints=3"]
    summary = train(compose_train(*settings, "resume=auto"), run_dir)
    assert summary["status"] == "finished" and [row[STEP] for row in read_metrics(run_dir)] == [1, 2, 3]
    assert (run_dir / "checkpoints" / "step_000003.damaged").is_dir(), "set aside, for inspection"
    assert not marker.exists(), "the checkpoint's code ran"


def test_a_checkpoint_written_before_its_files_hashes_were_recorded_still_resumes(
    killed_after_three_checkpoints, tmp_path
):
    run_dir = tmp_path / "run"
    shutil.copytree(killed_after_three_checkpoints, run_dir)
    newest = run_dir / "checkpoints" / "step_000003"
    saved = json.loads((newest / "trainer.json").read_text())
    assert set(saved["files"]) == {
        "rng_rank0.pt",
        "python_random_rank0.json",
        "state/.metadata",
        "state/__0_0.distcp",
    }, "every file the load reads"
    del saved["files"]
    (newest / "trainer.json").write_text(json.dumps(saved))
    assert find_checkpoint(run_dir, str(newest)) == (newest, [])


@pytest.mark.parametrize(
    "key, value, message",
    [
        ("computed_under", {"first_step": 1}, 'computed_under={"first_step": 1}, not a list of environments'),
        ("computed_under", ["torch"], 'computed_under=["torch"], not a list of environments (each an object with'),
        ("computed_under", [{"first_step": 0, "versions": None, "kernels": None}], "computed_under=[{"),
        (
            "computed_under",
            [{"first_step": 1, "versions": {"torch": ["2.13.0"]}, "kernels": None}],
            'computed_under=[{"first_step": 1, "versions": {"torch": ["2.13.0"]}, "ke...',
        ),
        ("world", "1", 'world="1", not a number of ranks (an integer >= 1)'),
        ("step", -3, "step=-3, not a count (an integer >= 0)"),
        ("experiment", [], "experiment as a list, not an object"),
    ],
)
def test_a_malformed_value_in_trainer_json_is_damage_in_one_line(
    killed_after_three_checkpoints, tmp_path, key, value, message
):
    """A malformed computed_under passed the damage check (which looked for the keys alone) and crashed the resume
    with `KeyError: -1` in experiments.run.provenance."""
    run_dir = tmp_path / "run"
    shutil.copytree(killed_after_three_checkpoints, run_dir)
    newest = run_dir / "checkpoints" / "step_000003"
    saved = json.loads((newest / "trainer.json").read_text())
    (newest / "trainer.json").write_text(json.dumps({**saved, key: value}))
    with pytest.raises(SystemExit) as raised:
        train(compose_train("trainer.checkpoint_every=1", "trainer.keep_checkpoints=3", f"resume={newest}"), run_dir)
    line = str(raised.value)
    assert f"is a damaged checkpoint: {newest / 'trainer.json'} holds {message}" in line and "\n" not in line
    found, passed_over = find_checkpoint(run_dir, "auto")
    assert found == run_dir / "checkpoints" / "step_000002" and passed_over[0].startswith(str(newest / "trainer.json"))


def test_a_checkpoint_index_that_is_code_is_refused_unread_on_resume_and_passed_over_by_auto(
    killed_after_three_checkpoints, tmp_path
):
    """torch reads the state's .metadata with plain pickle.load: resume=<checkpoint>, and resume=auto's scan, ran the
    command of a .metadata replaced by a pickle with a __reduce__ (the file it creates was made)."""
    run_dir = tmp_path / "run"
    shutil.copytree(killed_after_three_checkpoints, run_dir)
    newest = run_dir / "checkpoints" / "step_000003"
    marker = tmp_path / "code_ran"
    (newest / "state" / ".metadata").write_bytes(pickle.dumps(_Code(marker)))
    with pytest.raises(SystemExit) as raised:
        train(
            compose_train("trainer.checkpoint_every=1", "trainer.keep_checkpoints=3", f"resume={newest}"),
            tmp_path / "elsewhere",
        )
    line = str(raised.value)
    assert (
        f"is a damaged checkpoint: {newest / 'state' / '.metadata'} is not a checkpoint index: it names "
        f"{os.system.__module__}.system, which Distributed Checkpoint's index never holds; refused unread"
    ) in line
    assert "\n" not in line
    found, passed_over = find_checkpoint(run_dir, "auto")
    assert found == run_dir / "checkpoints" / "step_000002" and "is not a checkpoint index" in passed_over[0]
    assert not marker.exists(), "the checkpoint's code ran"


def test_a_value_stored_as_bytes_that_is_code_is_refused_before_any_loads(killed_after_three_checkpoints, tmp_path):
    """The optimizer's hyperparameters are stored as pickled bytes, which torch's load planner unpickles with
    weights_only=False: a hyperparameter replaced by a pickle with a __reduce__ ran on resume."""
    from torch.distributed.checkpoint import CheckpointException
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    from experiments.run.checkpoint import load, read_index

    run_dir = tmp_path / "run"
    shutil.copytree(killed_after_three_checkpoints, run_dir)
    state = run_dir / "checkpoints" / "step_000003" / "state"
    marker = tmp_path / "code_ran"
    index = read_index(state / ".metadata")
    key = MetadataIndex("optimizer.param_groups.0.lr")
    code = io.BytesIO()
    torch.save(_Code(marker), code)
    stored = state / index.storage_data[key].relative_path
    index.storage_data[key] = _StorageInfo(stored.name, stored.stat().st_size, len(code.getvalue()))
    with open(stored, "ab") as handle:  # the index points at the code, appended to the tensor file
        handle.write(code.getvalue())
    (state / ".metadata").write_bytes(pickle.dumps(index))
    settings = ["trainer.checkpoint_every=1", "trainer.keep_checkpoints=3"]
    with pytest.raises(SystemExit) as raised:
        train(compose_train(*settings, f"resume={state.parent}"), tmp_path / "elsewhere")
    assert (
        f"{stored} stores optimizer.param_groups.0.lr as something other than data, refused unread" in str(raised.value)
    ) and "\n" not in str(raised.value)
    with pytest.raises(CheckpointException):  # torch's own planner would unpickle it; the project's only as data
        load(RLTrainer(compose_train(*settings)), state.parent)
    assert not marker.exists(), "the checkpoint's code ran"


def test_a_disk_that_fills_inside_torch_save_ends_the_run_in_one_line_and_removes_the_partial_checkpoint(tmp_path):
    """torch's zip writer turns the full disk's OSError into `RuntimeError: unexpected pos`: the run ended in a
    31-frame traceback, without a summary, the partial step_N.tmp left on the full disk. A file-size limit plays the
    full disk: the log's lines fit under it, and it falls in the middle of a tensor of the checkpoint's tensor file
    (measured on the same run's checkpoint, written in-process without a limit: the runs are the same bits)."""
    train(compose_train("trainer.steps=1", "trainer.checkpoint_every=1"), tmp_path / "free")
    index = FileSystemReader(str(tmp_path / "free" / "checkpoints" / "step_000001" / "state")).read_metadata()
    tensors = [
        stored
        for key, stored in index.storage_data.items()
        if not isinstance(index.state_dict_metadata[key.fqn], BytesStorageMetadata)
    ]
    tensor = max((stored for stored in tensors if stored.offset > 100_000), key=lambda stored: stored.length)
    limit = tensor.offset + tensor.length // 2
    run_dir = tmp_path / "run"

    def limited() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    done = subprocess.run(
        [*CLI, *MICRO_RUN, "trainer.checkpoint_every=1", f"hydra.run.dir={run_dir}"],
        capture_output=True,
        text=True,
        cwd=PROJECT_ROOT,
        timeout=300,
        preexec_fn=limited,
    )
    assert done.returncode == 1
    line = one_line(done.stderr)
    assert (
        f"cannot write checkpoint step_000001 in {run_dir / 'checkpoints'}: File too large; the partial one was "
        "removed, and there is no earlier checkpoint"
    ) in line and "says status 'failed'" in line
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "failed" and "File too large" in summary["failed"]
    assert [row[STEP] for row in read_metrics(run_dir)] == [1]
    assert not list((run_dir / "checkpoints").iterdir()), "no partial checkpoint is left"


class _Killed(BaseException):
    """A kill, as far as the code it cuts can tell."""


def test_a_kill_while_rotation_deletes_a_checkpoint_leaves_no_checkpoint_half_deleted(tmp_path, monkeypatch):
    """Rotation deleted an older checkpoint in place: a kill in the middle of shutil.rmtree left step_000001 without
    its trainer.json under its own name, a checkpoint that no longer loads."""
    run_dir = tmp_path / "run"
    delete = shutil.rmtree

    def killed_while_deleting(path, *args, **kwargs):
        if Path(path).name.endswith(".tmp"):  # a partial checkpoint emptied before it is written
            return delete(path, *args, **kwargs)
        (Path(path) / "trainer.json").unlink()  # the first file gone, then the kill
        raise _Killed

    settings = ["trainer.checkpoint_every=1", "trainer.keep_checkpoints=1"]
    monkeypatch.setattr(shutil, "rmtree", killed_while_deleting)
    with pytest.raises(_Killed):
        train(compose_train(*settings), run_dir)
    monkeypatch.setattr(shutil, "rmtree", delete)
    assert find_checkpoint(run_dir, "auto") == (run_dir / "checkpoints" / "step_000002", [])
    assert not (run_dir / "checkpoints" / "step_000001").exists(), "a half-deleted checkpoint under its own name"
    train(compose_train(*settings, "resume=auto"), run_dir)
    assert [p.name for p in (run_dir / "checkpoints").iterdir()] == ["step_000003"], "the resume removed the rest"
    assert [row[STEP] for row in read_metrics(run_dir)] == [1, 2, 3]


# -- real data: the whole split in batches, prompts within the model's positions ----------------------------------


def gsm8k_run(tmp_path: Path, questions: list[str], *overrides: str):
    """A micro run on GSM8K-format files: 8 training problems, and `questions` as the test split."""

    def write(path: Path, texts: list[str]) -> Path:
        path.write_text(
            "".join(json.dumps({"question": text, "answer": f"{text} = 2\n#### 2"}) + "\n" for text in texts)
        )
        return path

    train_file = write(tmp_path / "train.jsonl", [f"{i}+{2 - i}?" for i in range(3)] * 3)
    test_file = write(tmp_path / "test.jsonl", questions)
    micro = [o for o in MICRO_RUN if not o.startswith("dataset.")]
    with initialize_config_dir(config_dir=str(PROJECT_ROOT / "conf"), version_base="1.3"):
        return compose(
            "train",
            overrides=[
                *micro,
                "dataset=gsm8k",
                f"dataset.train_path={train_file}",
                f"dataset.test_path={test_file}",
                *overrides,
            ],
        )


def test_the_whole_split_is_evaluated_in_batches_that_the_memory_check_counts(tmp_path, monkeypatch, capsys):
    """The whole-split evaluation handed every test prompt to one rollout, which the memory check did not count:
    dataset=gsm8k's 1,319 test prompts took 22 GB and the kernel killed the run before its first step."""
    from experiments.step.engines import HFEngine

    cfg = gsm8k_run(tmp_path, [f"{i % 10}+{i % 7}-{i % 5}*{i % 3}?" for i in range(200)])
    trainer = RLTrainer(cfg)
    batch = trainer.eval_split_batch
    assert 1 < batch < 200, "the split is larger than one batch here"
    sampled = []
    sample = HFEngine.sample
    monkeypatch.setattr(
        HFEngine,
        "sample",
        lambda engine, prompts, *args, **kwargs: (
            sampled.append(len(prompts)) or sample(engine, prompts, *args, **kwargs)
        ),
    )
    trainer.evaluate(whole_split=True)
    assert sampled == [batch] * (200 // batch) + ([200 % batch] if 200 % batch else [])
    monkeypatch.setattr(HFEngine, "sample", sample)
    assert train(cfg, tmp_path / "run")["eval_split_greedy_accuracy"] is not None
    said = capsys.readouterr().err
    assert f"trainer.eval_split evaluates the 200 test prompts in batches of {batch} (per rank)" in said
    # ... and the memory check counts a batch of it: a machine without room for the step names it among the parts
    from experiments.step import checks

    monkeypatch.setattr(checks, "available_bytes", lambda device: 1.0)
    with pytest.raises(ConfigError) as raised:
        checks.check_run(cfg)
    assert f"the whole split's evaluation in batches of {batch}" in str(raised.value)


def test_a_prompt_longer_than_the_models_positions_is_refused_at_start_up(tmp_path):
    """transformers only warned ('Token indices sequence length is longer than ...'), and the run computed past the
    positions the model has."""
    cfg = gsm8k_run(tmp_path, ["1+1?", "2+0?", "How many are " + "one and " * 8 + "one?", "0+2?", "1+1?"])
    with pytest.raises(SystemExit) as raised:
        train(cfg, tmp_path / "run")
    line = str(raised.value)
    assert (
        "the longest prompt of dataset 'gsm8k' (test prompt 2, 99 tokens) and trainer.max_new_tokens=4 need 103 "
        "positions, and model 'micro_moe' has max_position_embeddings=64"
    ) in line and "\n" not in line
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


# -- what computed a result: versions, kernels, the start's ---------------------------------------------------------


def test_a_summary_names_its_versions_and_its_start_and_a_resume_under_other_versions_says_so(
    tmp_path, checkpoint, monkeypatch, capsys
):
    """summary.json recorded the start's sha256 and this process's kernels, but no library versions, nor the kernels
    its start was made with; a resume under another torch was recorded as if one process had run every step."""
    import transformers

    from experiments.run import provenance

    start = {"versions": {"python": "3.11.0", "torch": "2.13.0"}, "kernels": {"mode": "portable", "cpu": "a CPU"}}
    (checkpoint / "cold_start.json").write_text(json.dumps({"status": "finished", **start}))
    settings = ["model=checkpoint", f"model.path={checkpoint}", "trainer.checkpoint_every=3"]
    run_dir = tmp_path / "run"
    summary = train(compose_train(*settings), run_dir)
    assert summary["versions"]["torch"] == torch.__version__
    assert summary["versions"]["transformers"] == transformers.__version__
    assert summary["versions"]["python"] == ".".join(map(str, sys.version_info[:3]))
    assert summary["start_environment"] == start, "the start's own summary"
    assert [(part["first_step"], part["versions"]) for part in summary["computed_under"]] == [(1, summary["versions"])]
    here = provenance.versions()
    monkeypatch.setattr(provenance, "versions", lambda: {**here, "torch": "9.9.9"})
    extended = train(compose_train(*settings, "trainer.steps=4", "resume=auto"), run_dir)
    assert (
        f"warning: step_000003 was computed under other libraries, kernels or threads than this process (torch "
        f"{torch.__version__} there, 9.9.9 here)"
    ) in capsys.readouterr().err
    assert [(part["first_step"], part["versions"]["torch"]) for part in extended["computed_under"]] == [
        (1, torch.__version__),
        (4, "9.9.9"),
    ]
    assert json.loads((run_dir / "summary.json").read_text())["computed_under"] == extended["computed_under"]


@pytest.mark.skipif(
    torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512", "AVX512_VNNI"),
    reason="the portable kernels need an x86-64 CPU with AVX2",
)
def test_a_resume_under_other_kernels_is_recorded_as_such(tmp_path):
    """cpu_kernels may change on resume (it computes the same steps with other rounding): the summary then named the
    new kernels alone, as if the whole run had used them."""
    run_dir = tmp_path / "run"
    train(compose_train("trainer.checkpoint_every=3"), run_dir)  # this process: the machine's own kernels
    done = run_cli(
        *MICRO_RUN,
        "trainer.checkpoint_every=3",
        "trainer.steps=4",
        "resume=auto",
        "cpu_kernels=portable",
        f"hydra.run.dir={run_dir}",
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "kernels mode native there, portable here" in done.stderr
    summary = json.loads((run_dir / "summary.json").read_text())
    assert [(part["first_step"], part["kernels"]["mode"]) for part in summary["computed_under"]] == [
        (1, "native"),
        (4, "portable"),
    ]
    assert summary["kernels"]["mode"] == "portable", "the kernels of the process that wrote the summary"


def _but_timings(lines: list[dict]) -> list[dict]:
    """Each line's numbers but the times it took (`perf/threads` stays: it is how the step computed)."""
    return [
        {key: value for key, value in line.items() if not key.startswith("perf/") or key == THREADS} for line in lines
    ]


@pytest.mark.skipif(not os.path.exists("/proc/stat"), reason="the budget reads Linux's /proc/stat")
def test_a_run_killed_and_resumed_under_another_load_computes_what_the_uninterrupted_run_did(tmp_path, monkeypatch):
    """By default the thread budget followed the machine's load, and another thread count rounds reductions
    differently: a run killed after step 2 and resumed while another process kept a core busy went on with another
    count (`perf/threads` 1 where the uninterrupted run had 2), and with other bits wherever the count changes them.
    The load is injected into the budget's measurement, not made."""
    from experiments.run.threads import ThreadBudget

    torch.set_num_threads(2)  # torch's own default on 2 cores: the most a budget that follows the load would use
    busy_elsewhere = len(os.sched_getaffinity(0)) - 1.0  # every core but one
    run = ["trainer.steps=4", "trainer.checkpoint_every=2"]
    monkeypatch.setattr(ThreadBudget, "other_load", lambda self: 0.0)  # an idle machine
    train(compose_train(*run), tmp_path / "whole")
    step = RLTrainer.step

    def dies_after_step_2(self):
        if self.step_index == 2:
            raise RuntimeError("killed after step 2")
        return step(self)

    monkeypatch.setattr(RLTrainer, "step", dies_after_step_2)
    with pytest.raises(RuntimeError, match="killed after step 2"):
        train(compose_train(*run), tmp_path / "cut")
    monkeypatch.setattr(RLTrainer, "step", step)
    monkeypatch.setattr(ThreadBudget, "other_load", lambda self: busy_elsewhere)
    resumed = train(compose_train(*run, "resume=auto"), tmp_path / "cut")
    whole = read_metrics(tmp_path / "whole")
    assert [line[STEP] for line in read_metrics(tmp_path / "cut")] == [1, 2, 3, 4]
    assert _but_timings(read_metrics(tmp_path / "cut")) == _but_timings(whole)
    assert {line[THREADS] for line in whole} == {1}
    assert [(part["first_step"], part["threads"]) for part in resumed["computed_under"]] == [(1, 1)]


def test_a_resume_under_another_thread_count_is_recorded_as_such(tmp_path, capsys):
    """`trainer.threads` may change on resume (the same steps, other rounding), as the CPU kernels may: the summary
    named no thread count at all, as if the run's bits did not depend on it."""
    from experiments.run import provenance

    run_dir = tmp_path / "run"
    train(compose_train("trainer.checkpoint_every=3", "trainer.threads=2"), run_dir)
    extended = train(
        compose_train("trainer.checkpoint_every=3", "trainer.steps=4", "trainer.threads=null", "resume=auto"), run_dir
    )
    assert (
        "warning: step_000003 was computed under other libraries, kernels or threads than this process "
        "(trainer.threads 2 there, null (the free cores) here): the steps after 3 are not the bits an "
        "uninterrupted run would give"
    ) in capsys.readouterr().err
    assert [(part["first_step"], part["threads"]) for part in extended["computed_under"]] == [(1, 2), (4, None)]
    recorded_before_threads = {"versions": provenance.versions(), "kernels": extended["kernels"]}
    _, differs = provenance.resumed_under([{"first_step": 1, **recorded_before_threads}], 3, "native", 1)
    assert differs == ["trainer.threads unknown there, 1 here"]


def test_the_lock_pins_every_requirement_make_installs_within_its_range_and_make_installs_from_it():
    """The dependencies were floors only (transformers>=5.24,<6): two installs a week apart computed with other
    libraries, and installing the bench extra moved transformers in place. Then the lock covered the dependencies
    and the dev extra but not the bench extra that `make bench` installs: TRL, datasets and accelerate (and what
    they pull in) were whatever was newest on the day."""
    import tomllib

    from packaging.requirements import Requirement

    from experiments.run.provenance import LOCKED_EXTRAS

    project = tomllib.loads((PROJECT_ROOT / "pyproject.toml").read_text())["project"]
    lock = (PROJECT_ROOT / "constraints.txt").read_text()
    assert "make constraints" in lock, "the lock says how it is refreshed"
    pins = dict(line.split("==") for line in lock.splitlines() if line and not line.startswith("#"))
    installs = [
        line
        for line in subprocess.run(
            ["make", "-n", "-B", "install", "bench", "constraints"],
            cwd=PROJECT_ROOT,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.splitlines()
        if "pip install" in line
    ]
    assert installs and all("-c constraints.txt" in line for line in installs), installs
    installed_extras = {
        extra for line in installs for listed in re.findall(r"\.\[([^]]*)\]", line) for extra in listed.split(",")
    }
    assert installed_extras == set(LOCKED_EXTRAS), f"make installs {installed_extras}, the lock covers {LOCKED_EXTRAS}"
    extras = project["optional-dependencies"]
    for line in [*project["dependencies"], *(line for extra in LOCKED_EXTRAS for line in extras[extra])]:
        requirement = Requirement(line)
        name = requirement.name.lower()
        assert name in pins, f"{name} is not locked"
        assert requirement.specifier.contains(pins[name], prereleases=True), f"{name}=={pins[name]} outside {line}"


def test_the_lock_is_refused_from_an_environment_that_lacks_a_requirement(monkeypatch):
    """A lock written from a .venv without the bench extra left TRL out, silently."""
    from importlib import metadata

    from experiments.run import provenance

    requires = metadata.requires
    monkeypatch.setattr(
        metadata,
        "requires",
        lambda distribution: (
            ["a-distribution-not-installed>=1; extra == 'bench'", "another-one-not-installed; extra == 'megablocks'"]
            if distribution == provenance.PROJECT
            else requires(distribution)
        ),
    )
    with pytest.raises(SystemExit, match="the lock needs a-distribution-not-installed ") as refusal:
        provenance.locked()
    assert "\n" not in str(refusal.value) and "another-one" not in str(refusal.value)


# -- resume: what it compares, what it keeps, what it sets aside ---------------------------------------------------


def killed(run_dir: Path) -> Path:
    """The run directory as a kill after its last step leaves it: no summary."""
    (run_dir / "summary.json").unlink()
    return run_dir


def test_rotation_never_deletes_the_only_intact_checkpoint_and_sets_damaged_ones_aside(tmp_path):
    """keep_checkpoints=1, an intact step 2 and a damaged step 4, a run resumed from 2 that saved step 3: rotation
    deleted 2 and 3 (sorted by step, counting the damaged one) and kept the damaged 4, the only checkpoint left."""
    run_dir = tmp_path / "run"
    train(compose_train("trainer.steps=4", "trainer.checkpoint_every=2"), run_dir)
    damaged = killed(run_dir) / "checkpoints" / "step_000004"
    _damage(damaged / "state" / "__0_0.distcp", "truncated")
    (run_dir / "checkpoints" / "step_000009.tmp" / "state").mkdir(parents=True)  # a write a kill cut: not a checkpoint
    train(
        compose_train("trainer.steps=3", "trainer.checkpoint_every=1", "trainer.keep_checkpoints=1", "resume=auto"),
        run_dir,
    )
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step_000003", "step_000004.damaged"]
    assert find_checkpoint(run_dir, "auto") == (run_dir / "checkpoints" / "step_000003", [])
    assert [row[STEP] for row in read_metrics(run_dir)] == [1, 2, 3]


@pytest.mark.parametrize("signum", [signal.SIGKILL, signal.SIGTERM])
def test_a_kill_while_resume_cuts_the_log_leaves_the_log_whole(killed_after_three_checkpoints, tmp_path, signum):
    """The cut rewrote metrics.jsonl in place (emptied, then written): a kill there lost every logged step."""
    run_dir = tmp_path / "run"
    shutil.copytree(killed_after_three_checkpoints, run_dir)
    logged = (run_dir / "metrics.jsonl").read_text()
    kill_when_the_log_is_opened_for_writing = (
        "import builtins, io, os, signal\n"
        "real_open = io.open\n"
        "def opening(file, mode='r', *args, **kwargs):\n"
        "    handle = real_open(file, mode, *args, **kwargs)\n"
        "    if 'w' in mode and 'metrics.jsonl' in str(file):  # opened for writing: emptied, if it is the log\n"
        f"        os.kill(os.getpid(), {int(signum)})\n"
        "    return handle\n"
        "builtins.open = io.open = opening\n"
    )
    done = run_patched(
        tmp_path,
        kill_when_the_log_is_opened_for_writing,
        *MICRO_RUN,
        "trainer.checkpoint_every=1",
        "trainer.keep_checkpoints=3",
        "resume=auto",
        f"hydra.run.dir={run_dir}",
    )
    assert done.returncode == (-signum if signum == signal.SIGKILL else 128 + signum), done.stderr[-2000:]
    assert (run_dir / "metrics.jsonl").read_text() == logged


def test_resume_compares_every_setting_the_run_was_trained_with(tmp_path):
    """routing.flip_rate was not compared: a run trained with flips resumed without them, into a directory whose
    recorded config then said no flips."""
    run_dir = tmp_path / "run"
    train(compose_train("routing.flip_rate=0.2", "trainer.checkpoint_every=3"), run_dir)
    killed(run_dir)
    with pytest.raises(SystemExit) as raised:
        train(compose_train("trainer.checkpoint_every=3", "resume=auto"), run_dir)
    assert "holds another experiment: routing.flip_rate=0.2 there, 0.0 here" in str(raised.value)
    checkpoint = run_dir / "checkpoints" / "step_000003"
    with pytest.raises(SystemExit) as raised:
        train(compose_train(f"resume={checkpoint}"), tmp_path / "elsewhere")
    assert f"checkpoint {checkpoint} is of another experiment: routing.flip_rate=0.2 there, 0.0 here" in str(
        raised.value
    )


@dataclass
class TrainerWithANewField(TrainerConfig):
    perturb_rate: float = 0.0  # a setting added to the schema after the compared keys were written down


def with_perturb_rate(cfg, rate: float | None):
    """`cfg` under a schema that has the new field, set to `rate` (None: the schema without it)."""
    if rate is not None:
        cfg.trainer = OmegaConf.structured(
            TrainerWithANewField(**dataclasses.asdict(OmegaConf.to_object(cfg.trainer)), perturb_rate=rate)
        )
    return cfg


@pytest.mark.parametrize(
    "written, resumed, refused",
    [
        (0.1, 0.3, "trainer.perturb_rate=0.1 there, 0.3 here"),
        (None, 0.3, "trainer.perturb_rate absent there, 0.3 here"),  # written before the field existed
        (None, 0.0, None),  # ... and resumed at the field's default: what runs did before it existed
        (0.1, 0.1, None),
    ],
)
def test_a_new_setting_is_compared_on_resume_unless_declared_safe(tmp_path, monkeypatch, written, resumed, refused):
    run_dir = tmp_path / "run"
    train(with_perturb_rate(compose_train("trainer.checkpoint_every=3"), written), run_dir)
    resume = with_perturb_rate(compose_train("trainer.checkpoint_every=3", "trainer.steps=4", "resume=auto"), resumed)
    if refused is None:
        assert train(resume, run_dir)["steps"] == 4
        return
    with pytest.raises(SystemExit) as raised:
        train(resume, run_dir)
    assert refused in str(raised.value) and "\n" not in str(raised.value)
    monkeypatch.setattr("experiments.run.resume.SAFE_TO_CHANGE", (*SAFE_TO_CHANGE, "trainer.perturb_rate"))
    assert train(resume, run_dir)["steps"] == 4, "declared safe to change"


def test_a_resume_that_finds_nothing_to_do_leaves_the_run_as_it_was(tmp_path, capsys):
    """resume=auto on a finished run rewrote its recorded config with the new command's settings before saying
    "nothing to resume": a sweep relaunched with resume=auto relabelled its runs."""
    run_dir = tmp_path / "run"
    train(compose_train("trainer.checkpoint_every=3"), run_dir)
    recorded = (run_dir / ".hydra" / "config.yaml").read_text()
    summary = train(compose_train("trainer.checkpoint_every=3", "trainer.threads=1", "resume=auto"), run_dir)
    assert summary["status"] == "finished" and "finished after 3 steps; nothing to resume" in capsys.readouterr().err
    with pytest.raises(SystemExit) as raised:
        train(compose_train("trainer.checkpoint_every=3", "routing.flip_rate=0.2", "resume=auto"), run_dir)
    assert "holds another experiment: routing.flip_rate=0.0 there, 0.2 here" in str(raised.value)
    assert (run_dir / ".hydra" / "config.yaml").read_text() == recorded


def test_a_finished_run_is_extended_to_more_steps_under_a_constant_schedule(tmp_path, capsys):
    run_dir = tmp_path / "run"
    train(compose_train("trainer.checkpoint_every=2"), run_dir)  # checkpoints after steps 2 and 3, the last
    summary = train(compose_train("trainer.checkpoint_every=2", "trainer.steps=5", "resume=auto"), run_dir)
    err = capsys.readouterr().err
    assert "extending the run finished after 3 steps: resuming from" in err and "step_000003 (step 3)" in err
    assert summary["status"] == "finished" and summary["steps"] == 5
    assert [row[STEP] for row in read_metrics(run_dir)] == [1, 2, 3, 4, 5]
    assert OmegaConf.load(run_dir / ".hydra" / "config.yaml").trainer.steps == 5, "the record is the run that went on"
    no_checkpoints = tmp_path / "no_checkpoints"
    train(compose_train(), no_checkpoints)
    with pytest.raises(SystemExit) as raised:
        train(compose_train("trainer.steps=5", "resume=auto"), no_checkpoints)
    assert "holds this run, finished after 3 steps, and no checkpoint to extend it from" in str(raised.value)
    assert [row[STEP] for row in read_metrics(no_checkpoints)] == [1, 2, 3]


def test_another_length_under_a_schedule_that_decays_over_it_is_refused(tmp_path):
    """The learning rate went back up at the resume: the cosine's length is trainer.steps, which was not compared."""
    run_dir = tmp_path / "run"
    train(compose_train("trainer.lr_schedule=cosine", "trainer.checkpoint_every=1"), run_dir)
    killed(run_dir)
    with pytest.raises(SystemExit) as raised:
        train(compose_train("trainer.lr_schedule=cosine", "trainer.steps=5", "resume=auto"), run_dir)
    line = str(raised.value)
    assert "its run was planned for trainer.steps=3 under trainer.lr_schedule=cosine, whose learning rate" in line
    assert "trainer.steps=5 would join two schedules" in line and "\n" not in line


@pytest.mark.parametrize(
    "damage, problem",
    [
        (lambda text: b"", "which is empty"),
        (lambda text: text.replace(b"grpo", b"gr\xffo"), "which is not UTF-8 (byte 0xff at offset"),
        (lambda text: text.replace(b"trainer:", b"trainer: [", 1), "which is not valid YAML ("),
        (lambda text: b"\n".join(text.split(b"\n")[:20]), "and it lacks settings this run has (model."),
    ],
)
def test_a_damaged_recorded_config_is_named_on_resume(tmp_path, damage, problem):
    """A damaged .hydra/config.yaml ended resume in a YAML or Unicode traceback; an empty or cut one was "another
    experiment: X=None there"."""
    run_dir = tmp_path / "run"
    train(compose_train("trainer.checkpoint_every=3"), run_dir)
    recorded = killed(run_dir) / ".hydra" / "config.yaml"
    recorded.write_bytes(damage(recorded.read_bytes()))
    with pytest.raises(SystemExit) as raised:
        train(compose_train("trainer.checkpoint_every=3", "resume=auto"), run_dir)
    line = str(raised.value)
    assert f"resume into {str(run_dir)!r} compares this run with the settings {recorded} records, " in line
    assert problem in line and "\n" not in line


def test_a_checkpoint_cadence_beyond_the_run_writes_the_final_checkpoint_and_says_so(tmp_path, capsys):
    """trainer.checkpoint_every > trainer.steps wrote no checkpoint, and said nothing."""
    train(compose_train("trainer.checkpoint_every=10"), tmp_path / "run")
    assert [p.name for p in (tmp_path / "run" / "checkpoints").iterdir()] == ["step_000003"]
    assert (
        "trainer.checkpoint_every=10 is more than trainer.steps=3: the run's one checkpoint is its last step's"
        in capsys.readouterr().err
    )


def test_a_dataset_file_that_is_not_utf8_names_its_line(tmp_path):
    good = '{"question": "1+1?", "answer": "#### 2"}\n'
    (tmp_path / "train.jsonl").write_bytes(
        good.encode() + '{"question": "caf\xe9", "answer": "#### 1"}\n'.encode("latin-1")
    )
    (tmp_path / "test.jsonl").write_text(good)
    overrides = [o for o in MICRO_RUN if not o.startswith("dataset.")] + [
        "dataset=gsm8k",
        f"dataset.train_path={tmp_path / 'train.jsonl'}",
        f"dataset.test_path={tmp_path / 'test.jsonl'}",
        "trainer.eval_prompts=1",
    ]
    with initialize_config_dir(config_dir=str(PROJECT_ROOT / "conf"), version_base="1.3"):
        cfg = compose("train", overrides=overrides)
    with pytest.raises(SystemExit) as raised:
        train(cfg, tmp_path / "run")
    assert f"{tmp_path / 'train.jsonl'}:2: not UTF-8 (byte 0xe9" in str(raised.value)


# -- the other entry points -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "override, message",
    [
        ("sft.batch_size=0", "sft.batch_size=0 must be >= 1"),
        ("sft.target_accuracy=1.5", "must be in (0, 1]"),
        ("device=foo", "device='foo' is not one of cpu, cuda, cuda:<index>"),
        ("sft.eval_prompts=100000", "sft.eval_prompts=100000 is more than the 500 held-out examples"),
        ("+sft.epochs=3", "unknown config key(s) sft.epochs"),
    ],
)
def test_the_cold_start_refuses_bad_settings_in_one_line(tmp_path, override, message):
    from experiments.sft import cold_start

    with initialize_config_dir(config_dir=str(PROJECT_ROOT / "conf"), version_base="1.3"):
        # native kernels: this process has computed already, so it cannot pin the portable ones (models.cpu_kernels)
        settings = [f"sft.output_dir={tmp_path / 'ckpt'}", "logger.wandb.mode=disabled", "cpu_kernels=native"]
        cfg = compose("sft", overrides=[override, *settings])
    with pytest.raises(SystemExit) as refused:
        cold_start(cfg, tmp_path / "run")
    assert str(refused.value).startswith("moe-rl-lab: ") and message in str(refused.value)
    assert "\n" not in str(refused.value) and not (tmp_path / "ckpt" / "config.json").exists()


def test_the_cold_start_on_the_command_line_refuses_in_one_line(tmp_path):
    result = run_cli(
        "+sft.epochs=3",
        f"sft.output_dir={tmp_path / 'ckpt'}",
        f"hydra.run.dir={tmp_path / 'run'}",
        "logger.wandb.mode=disabled",
        module="experiments.sft",
    )
    assert result.returncode != 0 and "unknown config key(s) sft.epochs" in one_line(result.stderr)


@pytest.mark.parametrize(
    "module, overrides",
    [
        ("experiments.sft", ["sft.max_steps=100000", "sft.target_accuracy=1.0", "sft.eval_every=1000"]),
        (
            "experiments.probe",
            [
                "model.path=null",
                "probe.lrs=[1e-3,1e-3]",
                "probe.warm_steps=200",
                "trainer.prompts_per_step=4",
                "trainer.group_size=4",
                "trainer.max_new_tokens=4",
                "dataset.train_size=200",
                "dataset.test_size=20",
                "trainer.eval_prompts=4",
                "probe.precisions=[]",
            ],
        ),
    ],
)
def test_a_cold_start_and_a_probe_end_a_stop_as_a_run_does(tmp_path, module, overrides):
    """SIGTERM ends a cold start or a probe as it ends an RL run (`experiments.run.life`): exit code 143, one line,
    the log whole and `summary.json` saying `interrupted`; a cold start saves no checkpoint."""
    micro = [f"model.{key}={value}" for key, value in MICRO_MODEL.items()]
    out = [f"sft.output_dir={tmp_path / 'ckpt'}", "sft.batch_size=4"] if module == "experiments.sft" else []
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            module,
            *micro,
            *overrides,
            *out,
            f"hydra.run.dir={tmp_path}",
            "logger.wandb.mode=disabled",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=PROJECT_ROOT,
    )
    wait_for_lines(tmp_path / "metrics.jsonl", 2, proc)
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 143
    assert "interrupted by SIGTERM after" in one_line(stderr)
    summary = json.loads((tmp_path / "summary.json").read_text())
    lines = read_metrics(tmp_path)
    assert summary["status"] == "interrupted" and len(lines) >= 2
    assert [line[STEP] for line in lines] == list(range(1, len(lines) + 1)), "no partial step is logged"
    assert not (tmp_path / "ckpt" / "config.json").exists()


def test_a_cold_start_that_diverges_ends_in_one_line_and_saves_no_checkpoint(tmp_path):
    """Evaluating non-finite weights used to score a greedy argmax over NaN logits, and the checkpoint was saved."""
    micro = [f"model.{key}={value}" for key, value in MICRO_MODEL.items()]
    done = run_cli(
        *micro,
        "sft.lr=1e30",
        "sft.max_steps=3",
        "sft.eval_every=1",
        "sft.eval_prompts=4",
        "sft.batch_size=4",
        f"sft.output_dir={tmp_path / 'ckpt'}",
        f"hydra.run.dir={tmp_path / 'run'}",
        "logger.wandb.mode=disabled",
        module="experiments.sft",
    )
    assert done.returncode == 1
    line = one_line(done.stderr)
    assert "the cold start diverged in step" in line and "logits that are NaN or inf" in line
    assert not list((tmp_path / "ckpt").iterdir()), "no checkpoint of non-finite weights"


def test_the_report_refuses_an_unwritable_out_no_runs_and_wandb_without_a_key_leaving_no_empty_folder(tmp_path, capsys):
    from analysis import report
    from tests import synthetic_runs as syn

    def refusal(*argv: str) -> str:
        """The one line `python -m analysis.report *argv` ends with (its `main`, in this process), exit code 2."""
        with pytest.raises(SystemExit) as ended:
            report.main(list(argv))
        assert ended.value.code == 2
        return one_line(capsys.readouterr().err)

    run = syn.curve_run(tmp_path / "run", "grpo", 0, lambda t: 0.02 * t)
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    line = refusal(str(run), "--out", str(blocker / "out"))
    assert "--out" in line and "Not a directory" in line
    (tmp_path / "no_runs").mkdir()
    assert "no runs found" in refusal(str(tmp_path / "no_runs"), "--out", str(tmp_path / "reports" / "none"))
    assert not (tmp_path / "reports").exists(), "the failed report left the folders it created"
    # W&B's client reads its key from the environment when it starts: a process of its own, with none.
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB")} | {"HOME": str(tmp_path)}
    result = subprocess.run(
        [sys.executable, "-m", "analysis.report", "--wandb", "ent/proj", "--out", str(tmp_path / "wb")],
        capture_output=True,
        text=True,
        cwd=PROJECT_ROOT,
        env=env,
        timeout=300,
    )
    assert result.returncode == 2 and "--wandb needs an API key" in one_line(result.stderr)
    assert not (tmp_path / "wb").exists()
