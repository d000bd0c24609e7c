"""Scale out: 2 ranks (gloo, torchrun) against 1 process on the same batch; kill -9 and resume, exactly; refusals."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from algos.routing_variants.predictive import LOSS as PREDICTIVE_LOSS
from algos.routing_variants.soft_replay import KEPT as SOFT_REPLAY_KEPT
from experiments.config import PROJECT_ROOT
from experiments.step.metrics import STEP
from experiments.train import train
from tests.conftest import MICRO_RUN
from tests.test_reliability import fault_in_the_checkpoint_writer
from tests.test_train import compose_train

pytestmark = pytest.mark.slow  # torchrun and subprocesses: not in the fast lane

TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone"]  # a free port of its own
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(PROJECT_ROOT)}


def torchrun(ranks: int, *args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*TORCHRUN, f"--nproc_per_node={ranks}", *args],
        capture_output=True,
        text=True,
        cwd=PROJECT_ROOT,
        env=ENV,
        timeout=timeout,
    )


@pytest.fixture(scope="module")
def one_and_two_ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("dp")
    for ranks in (1, 2):
        done = torchrun(ranks, "tests/dp_step.py", str(out / f"w{ranks}.pt"))
        assert done.returncode == 0, done.stderr[-3000:]
    return (torch.load(out / "w1.pt", weights_only=False), torch.load(out / "w2.pt", weights_only=False))


@pytest.mark.parametrize(
    "case",
    [
        "grpo seq-mean-token-mean",
        "grpo token-mean",
        "dr_grpo seq-mean-token-sum-norm",
        "gspo",
        "grpo + r2",
        "gspo + r2",
        "grpo + load-balancing loss",
        "grpo + r2 full replay",
        "gspo + r2 soft replay",
        "grpo + router shift",
        "grpo + decomposition",
        "grpo + r2 + decomposition",
        "grpo + pr2",
    ],
)
def test_two_ranks_make_the_update_one_process_makes(one_and_two_ranks, case):
    one, two = (result[case] for result in one_and_two_ranks)
    assert max(float(g.abs().max()) for g in one["grads"].values()) > 1e-3, "the batch must carry a gradient"
    if case == "gspo + r2 soft replay":
        assert 0.0 < one["metrics"][1][SOFT_REPLAY_KEPT] < 1.0, "the ranks must keep and drop experts"
    if case == "grpo + pr2":
        assert one["metrics"][1][PREDICTIVE_LOSS] > 0, "the second update trains the predictors"
        assert any(grad.any() for name, grad in one["grads"].items() if "predictor" in name)
    for name, grad in one["grads"].items():
        torch.testing.assert_close(two["grads"][name], grad, rtol=1e-5, atol=1e-7, msg=name)
    for name, param in one["params"].items():
        torch.testing.assert_close(two["params"][name], param, rtol=0, atol=1e-5, msg=name)
    for a, b in zip(one["metrics"], two["metrics"]):
        assert set(a) == set(b), "the same metrics, whatever the number of ranks"
        for key, value in a.items():
            assert b[key] == pytest.approx(value, rel=1e-5, abs=1e-6), key


def kill_tree(pid: int) -> None:
    """SIGKILL `pid` and every process below it (torchrun starts its workers in sessions of their own)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    doomed, todo = [], [pid]
    while todo:
        current = todo.pop()
        doomed.append(current)
        todo += children.get(current, [])
    for victim in doomed:
        try:
            os.kill(victim, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _children(pid: int) -> list[int]:
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(stat.parent.name))
        except (OSError, ValueError):
            continue
    return found


def test_ranks_die_with_their_killed_launcher(tmp_path):
    """kill -9 of torchrun alone (its workers live in sessions of their own) must not leave ranks behind."""
    proc = subprocess.Popen(
        _command(2, tmp_path / "run", "trainer.steps=400"),
        stdout=subprocess.DEVNULL,
        stderr=open(tmp_path / "err.txt", "w"),
        cwd=PROJECT_ROOT,
        env=ENV,
        start_new_session=True,
    )
    ranks: list[int] = []
    try:
        deadline = time.monotonic() + 120
        while not (tmp_path / "run" / "metrics.jsonl").exists():  # both ranks are in the loop
            assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "err.txt").read_text()[-3000:]
            time.sleep(0.2)
        ranks = _children(proc.pid)
        assert len(ranks) == 2, ranks
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        deadline = time.monotonic() + 10
        while any(
            Path(f"/proc/{pid}").exists() and "Z" not in Path(f"/proc/{pid}/stat").read_text().split()[2]
            for pid in ranks
        ):
            assert time.monotonic() < deadline, "a rank outlived its launcher"
            time.sleep(0.1)
    finally:
        for pid in [proc.pid, *ranks]:  # a rank that outlived its launcher is no longer below it
            kill_tree(pid)


def _without_timings(lines: list[dict]) -> list[dict]:
    return [{k: v for k, v in line.items() if not k.startswith("perf/")} for line in lines]


def _metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


RESUMABLE = [
    *MICRO_RUN,
    "trainer.steps=16",
    "trainer.checkpoint_every=4",
    "trainer.eval_every=6",  # an evaluation before the kill and one after the resume
    "trainer.save_checkpoint=true",
]


def _command(ranks: int, run_dir: Path, *extra: str, launched: bool = False) -> list[str]:
    """The resumable run on `ranks` ranks: under torchrun, or (`launched`) by `launch.nproc_per_node`, whose job
    checks the run directory and the checkpoint before torchrun starts the ranks."""
    if ranks == 1 or launched:
        ranks_setting = [f"launch.nproc_per_node={ranks}"] if ranks > 1 else []
        return [
            sys.executable,
            "-m",
            "experiments.train",
            *RESUMABLE,
            *ranks_setting,
            f"hydra.run.dir={run_dir}",
            *extra,
        ]
    return [
        *TORCHRUN,
        f"--nproc_per_node={ranks}",
        "-m",
        "experiments.train",
        *RESUMABLE,
        f"hydra.run.dir={run_dir}",
        *extra,
    ]


@pytest.mark.parametrize("ranks, lag", [(1, 0), (2, 3)])
def test_a_run_killed_after_a_checkpoint_resumes_exactly(tmp_path, ranks, lag):
    """One process, and two ranks under a lag (the engine's weight versions are in the checkpoint): the resumed run
    samples what the whole one sampled, on each rank. The two ranks resume by `launch.nproc_per_node=2`: the job's
    checks before torchrun starts (a directory that holds a run, a checkpoint of other ranks) pass a run of its own
    ranks."""
    lagged = ("rollout.source=lagged", f"rollout.lag={lag}") if lag else ()
    whole = subprocess.run(
        _command(ranks, tmp_path / "whole", *lagged),
        capture_output=True,
        text=True,
        cwd=PROJECT_ROOT,
        env=ENV,
        timeout=600,
    )
    assert whole.returncode == 0, whole.stderr[-3000:]
    killed = tmp_path / "killed"
    proc = subprocess.Popen(
        _command(ranks, killed, *lagged),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        cwd=PROJECT_ROOT,
        env=ENV,
        start_new_session=True,
    )
    deadline = time.time() + 300
    while not (killed / "checkpoints" / "step_000008").exists():
        assert proc.poll() is None and time.time() < deadline, "the run ended before its second checkpoint"
        time.sleep(0.02)
    kill_tree(proc.pid)
    proc.wait()
    time.sleep(0.5)
    assert not (killed / "summary.json").exists(), "the kill came after the end: nothing was tested"
    resumed = subprocess.run(
        _command(ranks, killed, *lagged, "resume=auto", launched=True),
        capture_output=True,
        text=True,
        cwd=PROJECT_ROOT,
        env=ENV,
        timeout=600,
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resuming from" in resumed.stderr and "step_000008" in resumed.stderr
    assert _without_timings(_metrics(killed)) == _without_timings(_metrics(tmp_path / "whole"))
    a, b = (
        load_file(killed / "checkpoint" / "model.safetensors"),
        load_file(tmp_path / "whole" / "checkpoint" / "model.safetensors"),
    )
    for name in a:
        assert torch.equal(a[name], b[name]), name
    assert sorted(p.name for p in (killed / "checkpoints").iterdir()) == ["step_000012", "step_000016"], "keep=2"


def test_a_killed_sweep_relaunched_finishes_what_is_missing(tmp_path):
    sweep = tmp_path / "sweep"
    command = [sys.executable, "-m", "experiments.train", "-m", "seed=0,1", *RESUMABLE, f"hydra.sweep.dir={sweep}"]
    proc = subprocess.Popen(
        command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=PROJECT_ROOT, env=ENV, start_new_session=True
    )
    deadline = time.time() + 300
    while not list(sweep.glob("1_*/checkpoints/step_000004")):
        assert proc.poll() is None and time.time() < deadline, "the sweep ended before job 1's first checkpoint"
        time.sleep(0.02)
    kill_tree(proc.pid)
    proc.wait()
    relaunched = subprocess.run(
        [*command, "resume=auto"], capture_output=True, text=True, cwd=PROJECT_ROOT, env=ENV, timeout=600
    )
    assert relaunched.returncode == 0, relaunched.stderr[-3000:]
    assert "already holds this run, finished after 16 steps" in relaunched.stderr
    for job in sorted(sweep.glob("[01]_*")):
        steps = [line[STEP] for line in _metrics(job)]
        assert steps == list(range(1, 17)), f"{job.name}: lost or duplicated steps"
        assert json.loads((job / "summary.json").read_text())["status"] == "finished"


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["resume=/nonexistent/step_000010"], "holds no checkpoint"),
        (["trainer.keep_checkpoints=0"], "trainer.keep_checkpoints=0 must be >= 1"),
        (["trainer.checkpoint_every=-1"], "trainer.checkpoint_every=-1 must be >= 0"),
    ],
)
def test_bad_resume_settings_are_refused(tmp_path, overrides, message):
    with pytest.raises(SystemExit) as raised:
        train(compose_train(*overrides), tmp_path)
    assert message in str(raised.value) and "\n" not in str(raised.value)


def test_a_checkpoint_of_another_experiment_is_refused_naming_what_differs(tmp_path):
    train(compose_train("trainer.steps=2", "trainer.checkpoint_every=2"), tmp_path / "a")
    checkpoint = tmp_path / "a" / "checkpoints" / "step_000002"
    with pytest.raises(SystemExit) as raised:
        train(compose_train("trainer.steps=4", "algo=gspo", f"resume={checkpoint}"), tmp_path / "b")
    assert "is of another experiment: algo.name='grpo' there, 'gspo' here" in str(raised.value)
    with pytest.raises(SystemExit) as raised:
        train(compose_train("trainer.steps=4", "trainer.group_size=8", "resume=auto"), tmp_path / "a")
    assert "holds another experiment: trainer.group_size=4 there, 8 here" in str(raised.value)


def test_a_stop_that_reaches_one_rank_in_its_checkpoint_ends_every_rank_after_that_step(tmp_path):
    """Each rank decided to stop on its own: rank 1, signalled while it wrote its checkpoint, stopped after it, and
    rank 0 went on into the next step's collectives with a rank that had left (a gloo error, no summary)."""
    stop_rank_1_in_its_first_checkpoint = fault_in_the_checkpoint_writer(
        "    if os.environ['RANK'] == '1' and not hasattr(faulty_write, 'stopped'):\n"
        "        faulty_write.stopped = True\n"
        "        os.kill(os.getpid(), signal.SIGTERM)\n"
    )
    (tmp_path / "stop_rank_1.py").write_text(
        stop_rank_1_in_its_first_checkpoint
        + "import runpy; runpy.run_module('experiments.train', run_name='__main__', alter_sys=True)\n"
    )
    run_dir = tmp_path / "run"
    proc = subprocess.Popen(
        [
            *TORCHRUN,
            "--nproc_per_node=2",
            str(tmp_path / "stop_rank_1.py"),
            *MICRO_RUN,
            "trainer.steps=50",
            "trainer.checkpoint_every=1",
            f"hydra.run.dir={run_dir}",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        cwd=PROJECT_ROOT,
        env=ENV,
        start_new_session=True,
    )
    try:
        _, stderr = proc.communicate(timeout=300)
    finally:
        kill_tree(proc.pid)
    assert "interrupted by SIGTERM after 1 of 50 steps" in stderr, stderr[-3000:]
    assert json.loads((run_dir / "summary.json").read_text())["status"] == "interrupted"
    assert [line[STEP] for line in _metrics(run_dir)] == [1]
    assert [p.name for p in (run_dir / "checkpoints").iterdir()] == ["step_000001"], "the checkpoint was finished"


def test_a_checkpoint_of_one_rank_is_refused_on_every_rank_of_two_before_any_collective(tmp_path):
    """Rank 0 refused the checkpoint before the broadcast rank 1 waited in: the line, then rank 1 died in gloo."""
    run_dir = tmp_path / "run"
    train(compose_train("trainer.checkpoint_every=3"), run_dir)
    (run_dir / "summary.json").unlink()
    done = torchrun(
        2,
        "-m",
        "experiments.train",
        *MICRO_RUN,
        "trainer.checkpoint_every=3",
        "resume=auto",
        f"hydra.run.dir={run_dir}",
    )
    assert "step_000003 was written by 1 ranks, this run has 2" in done.stderr
    assert done.stderr.count("moe-rl-lab:") == 1 and "gloo" not in done.stderr, done.stderr[-3000:]


def test_torchrun_refuses_what_the_ranks_cannot_share(tmp_path):
    """Every rank meets the refusal; rank 0 alone prints it, and the refusal's exit code 1 is torchrun's. Its own
    report of the failed ranks follows: torchrun reports every exit code but 0, which a refusal must not use."""
    done = torchrun(2, "-m", "experiments.train", *MICRO_RUN, "trainer.prompts_per_step=3", f"hydra.run.dir={tmp_path}")
    assert done.returncode == 1 and "trainer.prompts_per_step=3 does not split over the 2 ranks" in done.stderr
    assert done.stderr.count("moe-rl-lab:") == 1, done.stderr[-3000:]
    done = torchrun(2, "-m", "experiments.train", *MICRO_RUN, "device=cuda", f"hydra.run.dir={tmp_path / 'c'}")
    assert done.returncode != 0 and "this machine has none: device=cpu" in done.stderr
    assert "Traceback" not in done.stderr.split("ChildFailedError")[0] or "moe-rl-lab:" in done.stderr


def test_the_slurm_cluster_config_composes_and_each_job_starts_torchrun_per_gpu():
    from types import SimpleNamespace

    from hydra import compose, initialize_config_dir
    from hydra.core.hydra_config import HydraConfig

    from experiments.run.relaunch import torchrun_command

    with initialize_config_dir(config_dir=str(PROJECT_ROOT / "conf"), version_base="1.3"):
        cfg = compose(
            "train", overrides=["cluster=slurm", "hydra.launcher.gpus_per_node=4", "seed=3"], return_hydra_config=True
        )
    HydraConfig.instance().set_config(cfg)
    assert cfg.hydra.launcher._target_.endswith("SlurmLauncher") and cfg.hydra.launcher.tasks_per_node == 1
    assert cfg.launch.nproc_per_node == 4, "one rank per GPU of the node"
    job = SimpleNamespace(
        overrides=SimpleNamespace(task=["cluster=slurm", "seed=3", "launch.nproc_per_node=4"]),
        runtime=SimpleNamespace(output_dir="/sweep/3_grpo_none_tiny_moe_s3"),
    )
    command = torchrun_command(cfg, job)
    assert command[1:6] == ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=4", "-m"]
    assert command[6:] == [
        "experiments.train",
        "cluster=slurm",
        "seed=3",
        "hydra.run.dir=/sweep/3_grpo_none_tiny_moe_s3",
    ]


def test_a_parallel_sweep_needs_its_threads_to_fit_and_then_runs_its_jobs_side_by_side(tmp_path):
    base = [sys.executable, "-m", "experiments.train", "-m", "hydra/launcher=joblib", "seed=0,1", *MICRO_RUN]
    refused = subprocess.run(
        [*base, "hydra.launcher.n_jobs=2", "trainer.threads=null", f"hydra.sweep.dir={tmp_path / 'a'}"],
        capture_output=True,
        text=True,
        cwd=PROJECT_ROOT,
        env=ENV,
        timeout=300,
    )
    assert refused.returncode != 0 and "x trainer.threads=None threads each is more than the" in refused.stderr
    cores = len(os.sched_getaffinity(0))
    done = subprocess.run(
        [*base, f"hydra.launcher.n_jobs={min(2, cores)}", f"hydra.sweep.dir={tmp_path / 'b'}"],
        capture_output=True,
        text=True,
        cwd=PROJECT_ROOT,
        env=ENV,
        timeout=600,
    )  # one thread each
    assert done.returncode == 0, done.stderr[-3000:]
    assert len(list((tmp_path / "b").glob("*/summary.json"))) == 2
