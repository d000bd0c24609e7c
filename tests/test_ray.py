"""The concurrent source on Ray (`rollout.transport=ray`, experiments/step/sources/ray_transport.py) on the micro MoE,
against a local Ray cluster this module starts (`ray start --head`, 2 CPUs) and stops: the bound held and each overflow
policy with one and two actors, every row stamped with the version the trainer published; two actors serving
disjoint batches; a killed actor, an actor that raises and a version that goes backwards ending the run in one line
with its log whole and no actor left; SIGTERM to the trainer stopping every actor; bad settings refused before any
work. Skipped, with the reason, where Ray is not installed (`pip install -e '.[ray]'`; `make test` installs it)."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import NamedTuple

import pytest
import torch

from experiments.config import PROJECT_ROOT
from experiments.step.batch import draw_examples, step_seed
from experiments.step.checks import check_run
from experiments.step.metrics import DROPPED_BATCHES, PAST_BOUND_ROWS, STALENESS_MAX, STALENESS_MEAN, STEP
from experiments.tasks import build_task
from experiments.train import train
from models.registry import ConfigError, node_settings
from tests import test_concurrent as concurrent_tests
from tests.conftest import MICRO_RUN
from tests.test_concurrent import ends_failed
from tests.test_reliability import one_line, wait_for_lines
from tests.test_train import compose_train, read_metrics

RAY = ["rollout.source=concurrent", "rollout.transport=ray"]
ACTOR = "ray::RolloutActor"  # the process title Ray gives an actor of `RolloutActor`
HAS_RAY = importlib.util.find_spec("ray") is not None
needs_ray = pytest.mark.skipif(not HAS_RAY, reason="Ray is not installed: pip install -e '.[ray]' (make test does)")


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class Cluster(NamedTuple):
    address: str  # host:port of its head
    session: int  # the session id of its processes (the head's pid): its actors' too, and no other test's


def actors_alive(cluster: Cluster) -> list[int]:
    """The pids of the cluster's processes that are Ray actors of the Ray transport (another test process's cluster,
    under pytest-xdist, is another session)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            session = int(stat.read_text().rsplit(")", 1)[1].split()[3])
            if session == cluster.session and (stat.parent / "cmdline").read_bytes().startswith(ACTOR.encode()):
                found.append(int(stat.parent.name))
        except (OSError, IndexError, ValueError):
            continue
    return found


def no_actor_left(cluster: Cluster, within: float = 30.0) -> bool:
    """Whether every actor process of the cluster has exited, waiting up to `within` seconds for the ones Ray is still
    stopping."""
    deadline = time.time() + within
    while actors_alive(cluster):
        if time.time() > deadline:
            return False
        time.sleep(0.2)
    return True


@pytest.fixture(scope="module")
def cluster():
    """A Ray head on this machine with 2 CPUs, in a session of its own, stopped (with every process it started) when
    the module's tests are done."""
    if not HAS_RAY:
        pytest.skip("Ray is not installed: pip install -e '.[ray]' (make test does)")
    port = free_port()
    head = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "from ray.scripts.scripts import main; main()",
            "start",
            "--head",
            "--block",
            f"--port={port}",
            "--num-cpus=2",
            "--include-dashboard=false",
            "--disable-usage-stats",
            "--node-ip-address=127.0.0.1",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        start_new_session=True,
        # On loopback, without token authentication (whose token a connecting process would need: docs/async.md).
        env={**os.environ, "RAY_AUTH_MODE": "disabled"},
        cwd=PROJECT_ROOT,
    )
    address = f"127.0.0.1:{port}"
    deadline = time.time() + 60
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            if head.poll() is not None or time.time() > deadline:
                raise AssertionError(f"the Ray head did not start: {head.stderr.read().decode()[-2000:]}") from None
            time.sleep(0.2)
    yield Cluster(address, head.pid)
    head.send_signal(signal.SIGTERM)  # `ray start --block` stops its node's processes on SIGTERM
    try:
        head.wait(30)
    finally:
        try:
            os.killpg(head.pid, signal.SIGKILL)  # what the head's session still holds
        except ProcessLookupError:
            pass


class Watched(concurrent_tests.Watched):
    """A Ray run watched as a local one is (its served batches by step, a slow trainer, so that the actors run ahead
    as far as the policy lets them), and the batches handed to each actor."""

    def __init__(self, monkeypatch, update_s: float = 0.2) -> None:
        from experiments.step.sources.ray_transport import RaySource

        super().__init__(monkeypatch, update_s=update_s, source=RaySource)
        self.handed: list[tuple[int, int]] = []  # (actor, batch)
        self.sources: list[RaySource] = []
        watched = self
        real_hand_out, real_start = RaySource._hand_out, RaySource._start

        def start(source, step, weights):
            watched.sources.append(source)
            real_start(source, step, weights)

        def hand_out(source):
            before = dict(source.calls)
            real_hand_out(source)
            watched.handed += [
                (call.actor, call.batch) for reference, call in source.calls.items() if reference not in before
            ]

        monkeypatch.setattr(RaySource, "_start", start)
        monkeypatch.setattr(RaySource, "_hand_out", hand_out)


# -- before any work -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            ["rollout.source=concurrent", "rollout.transport=grpc"],
            "rollout.transport=grpc is not one of local, ray: how the concurrent source's workers get their weights",
        ),
        (
            ["rollout.source=concurrent", "rollout.ray.workers=2"],
            "rollout.ray.workers=2 is a setting of rollout.transport=ray, and this run's transport is local: use "
            "rollout.transport=ray, or leave rollout.ray.workers at 1",
        ),
        (
            ["rollout.transport=ray"],
            "rollout.transport=ray is a setting of rollout.source=concurrent, and this run's source is synchronous: "
            "use rollout.source=concurrent, or leave rollout.transport at local",
        ),
        (
            ["rollout.source=lagged", "rollout.lag=1", "rollout.ray.address=10.0.0.1:6379"],
            "rollout.ray.address=10.0.0.1:6379 is a setting of rollout.source=concurrent, and this run's source is "
            "lagged: use rollout.source=concurrent, or leave rollout.ray.address at null",
        ),
    ],
)
def test_ray_settings_another_source_or_transport_would_ignore_are_refused_before_any_work(
    tmp_path, overrides, message
):
    with pytest.raises(SystemExit, match=message):
        train(compose_train(*overrides), tmp_path / "run")
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


@needs_ray
@pytest.mark.parametrize(
    "overrides, message",
    [
        (["rollout.ray.workers=0"], r"rollout.ray.workers=0 must be >= 1"),
        (["rollout.ray.worker_cpus=0"], r"rollout.ray.worker_cpus=0.0 must be > 0"),
        (["rollout.ray.address=ray://head"], r"rollout.ray.address=ray://head is not host:port"),
        (["rollout.ray.weights=nccl"], r"rollout.ray.weights=nccl is not one of object_store, broadcast: how each"),
        (
            [f"rollout.ray.address=127.0.0.1:{free_port()}"],
            r"rollout.ray.address=127.0.0.1:\d+ does not answer \(.*refused.*\): start a Ray head there",
        ),
    ],
)
def test_bad_ray_settings_and_an_address_that_does_not_answer_are_refused_in_one_line(tmp_path, overrides, message):
    start = time.time()
    with pytest.raises(SystemExit, match=message) as ended:
        train(compose_train(*RAY, *overrides), tmp_path / "run")
    assert "\n" not in str(ended.value) and time.time() - start < 30
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_the_ray_transport_without_ray_names_the_extra_to_install(tmp_path, monkeypatch):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *args: None if name == "ray" else real_find_spec(name, *args)
    )
    with pytest.raises(SystemExit, match=r"rollout.transport=ray needs Ray, which is not installed here: pip install "):
        train(compose_train(*RAY), tmp_path / "run")
    with pytest.raises(ConfigError, match=r"pip install -e '\.\[ray\]'"):
        check_run(compose_train(*RAY), memory=False)


def test_a_cluster_too_small_for_the_actors_is_refused_before_the_first_step(tmp_path, cluster):
    with pytest.raises(SystemExit, match=r"rollout.ray.workers=3 x rollout.ray.worker_cpus=1.0 needs 3 CPUs, and the "):
        train(compose_train(*RAY, f"rollout.ray.address={cluster.address}", "rollout.ray.workers=3"), tmp_path / "run")
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


# -- actors beside the trainer ---------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("workers", [1, 2])
@pytest.mark.parametrize("policy", ["wait", "drop", "count"])
def test_the_bound_and_each_policy_hold_across_the_actors(tmp_path, monkeypatch, cluster, policy, workers):
    """A trainer slower than the actors, at bound 1: every step's logged staleness is its rows' stamps'; wait and drop
    never train a row past the bound, count one version past it at most (the queue). Each batch index is handed out
    once, in order, and with two actors both sample: disjoint rows, as whichever actor samples batch b draws the
    prompts seeded from (seed, b), the synchronous step b's, so no two batches share a seed."""
    watched = Watched(monkeypatch)
    overrides = [
        *RAY,
        f"rollout.ray.address={cluster.address}",
        f"rollout.ray.workers={workers}",
        f"rollout.overflow={policy}",
    ]
    cfg = compose_train(*overrides, "rollout.max_staleness=1", "trainer.steps=4")
    summary = train(cfg, tmp_path / "run")
    logged = read_metrics(tmp_path / "run")
    assert [row[STEP] for row in logged] == [1, 2, 3, 4]
    for step, served in watched.served.items():
        staleness = step - 1 - served.versions
        row = logged[step - 1]
        assert served.rollout.size == 16 and len(set(served.versions.tolist())) == 1, "every row stamped, one version"
        assert row[STALENESS_MEAN] == float(staleness.float().mean()) and row[STALENESS_MAX] == int(staleness.max())
        assert row[PAST_BOUND_ROWS] == int((staleness > 1).sum())
    most = max(row[STALENESS_MAX] for row in logged)
    past = sum(row[PAST_BOUND_ROWS] for row in logged)
    assert summary["past_bound_rows"] == past and summary["dropped_batches"] == sum(r[DROPPED_BATCHES] for r in logged)
    if policy == "count":
        assert most <= 2
    else:
        assert most <= 1 and past == 0, "no row trained past the bound"
    batches = [batch for _, batch in watched.handed]
    assert batches == list(range(1, len(batches) + 1)), "each batch handed out once, in order"
    if workers == 2:
        assert {actor for actor, _ in watched.handed} == {0, 1}, "both actors sampled"
    examples = build_task(**node_settings(cfg.dataset)).examples("train")
    for step, served in watched.served.items():  # under drop a step may train a later batch: its own index's draw
        batch = step + sum(row[DROPPED_BATCHES] for row in logged[:step])
        drawn = draw_examples(examples, 4, torch.Generator().manual_seed(step_seed(cfg.seed, batch, 0)))
        assert [e.prompt for e in served.rollout.examples] == [e.prompt for e in drawn for _ in range(4)], step
    assert f"{workers} Ray actor(s) on the Ray cluster at {cluster.address}" in summary["rollouts"]
    assert no_actor_left(cluster), "the run's end stopped its actors"


@pytest.mark.slow
def test_pr2_s_actors_route_by_the_predictors_of_the_version_that_sampled(tmp_path, monkeypatch, cluster):
    watched = Watched(monkeypatch)
    overrides = ["rollout.transport=ray", f"rollout.ray.address={cluster.address}", "rollout.ray.workers=2"]
    concurrent_tests.routes_by_its_versions_predictors(tmp_path, watched, *overrides, "rollout.max_staleness=1")
    assert {actor for actor, _ in watched.handed} == {0, 1}, "both actors sampled"
    assert no_actor_left(cluster)


@pytest.mark.slow
def test_a_killed_ray_run_resumes_with_its_actors_at_the_checkpoints_weights(tmp_path, monkeypatch, cluster):
    from experiments.step.sources.ray_transport import RaySource

    overrides = ["rollout.transport=ray", f"rollout.ray.address={cluster.address}", "rollout.ray.workers=2"]
    concurrent_tests.resumes_with_its_worker_at_the_checkpoints_weights(tmp_path, monkeypatch, RaySource, *overrides)
    assert no_actor_left(cluster)


@pytest.mark.slow
def test_two_trainer_ranks_under_torchrun_each_train_their_share_of_one_actor_s_batches(tmp_path, cluster):
    overrides = ["rollout.transport=ray", f"rollout.ray.address={cluster.address}"]
    concurrent_tests.trains_a_share_of_each_batch_on_each_of_two_ranks(tmp_path, *overrides)
    assert no_actor_left(cluster)


@pytest.mark.slow
def test_by_broadcast_each_actor_samples_with_the_version_its_batch_was_handed(tmp_path, monkeypatch, cluster):
    """`rollout.ray.weights=broadcast`, two actors ahead of a slow trainer: every version reaches both actors through
    the group, each batch's μ_old is the log-probs of the version it is stamped with (an actor keeps the version its
    call was handed, though newer ones arrive) and not of the next version's, and both actors sample."""
    watched = Watched(monkeypatch)
    settings = [
        *RAY,
        f"rollout.ray.address={cluster.address}",
        "rollout.ray.workers=2",
        "rollout.ray.weights=broadcast",
    ]
    summary = train(compose_train(*settings, "rollout.max_staleness=1", "trainer.steps=5"), tmp_path / "run")
    for step, served in watched.served.items():
        (version,) = set(served.versions.tolist())
        own = concurrent_tests.mu_old_under(watched.trainer, served.rollout, watched.versions[version])
        assert float(own.max()) < 1e-4, f"step {step}: version {version}'s"
        later = concurrent_tests.mu_old_under(watched.trainer, served.rollout, watched.versions[version + 1])
        assert float(later.max()) > 1e-3, f"step {step}: the versions are told apart"
    assert max(step - 1 - int(served.versions[0]) for step, served in watched.served.items()) == 1
    assert {actor for actor, _ in watched.handed} == {0, 1}, "both actors sampled"
    assert "by a torch.distributed broadcast" in summary["rollouts"]
    assert no_actor_left(cluster)


# -- how a run with actors ends --------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("weights", ["object_store", "broadcast"])
def test_a_killed_actor_ends_the_run_in_one_line_with_its_log_whole_and_no_actor_left(
    tmp_path, monkeypatch, cluster, weights
):
    import ray

    from experiments.step.sources.ray_transport import RaySource

    watched = Watched(monkeypatch)
    real_publish = RaySource.publish

    def publish_then_kill(source, version):
        real_publish(source, version)
        if version == 2:
            ray.kill(source.actors[0])

    monkeypatch.setattr(RaySource, "publish", publish_then_kill)
    settings = [*RAY, f"rollout.ray.address={cluster.address}", f"rollout.ray.weights={weights}", "trainer.steps=6"]
    start = time.time()
    with pytest.raises(SystemExit) as ended:
        train(compose_train(*settings), tmp_path / "run")
    # Under broadcast the next version's send to the dead actor may fail first.
    logged = ends_failed(
        tmp_path,
        ended,
        r"(the concurrent sampler's Ray worker 0 died while step \d waited for its rollouts|the broadcast of weight "
        r"version \d to the Ray workers failed)",
    )
    assert len(logged) >= 2 and not watched.sources[0].actors
    assert time.time() - start < 45, "the death was seen at once, not after the group's timeout"
    assert no_actor_left(cluster)


def test_the_broadcast_rendezvous_ends_at_a_dead_actor_or_a_signal_not_at_the_groups_timeout():
    """The trainer's rendezvous with actors that never join: an actor dead while starting ends it within a poll, and
    so does a signal whose handler raises (the run's stop), where the wait in C++ held both for the group's 60 s."""
    from experiments.step.sources.broadcast import WeightSender
    from experiments.step.sources.workers import SamplerFailed

    began = time.monotonic()
    with pytest.raises(SamplerFailed, match=r"broadcast group at 127.0.0.1:\d+ never met: Ray worker 0 died"):
        WeightSender("127.0.0.1", receivers=1).connect(
            lambda: "Ray worker 0 died while starting" if time.monotonic() - began > 1 else None
        )
    assert time.monotonic() - began < 10

    class Stopped(Exception):
        pass

    def stop(signum, frame):
        raise Stopped

    previous = signal.signal(signal.SIGALRM, stop)
    try:
        signal.setitimer(signal.ITIMER_REAL, 1.0)
        began = time.monotonic()
        with pytest.raises(Stopped):
            WeightSender("127.0.0.1", receivers=1).connect(lambda: None)
        assert time.monotonic() - began < 10
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


@pytest.mark.slow
def test_an_actor_killed_while_it_joins_the_broadcast_group_ends_the_run_at_once(tmp_path, monkeypatch, cluster):
    import ray

    from experiments.step.sources.broadcast import WeightSender

    watched = Watched(monkeypatch)
    real_connect = WeightSender.connect

    def kill_then_connect(sender, died):
        ray.kill(watched.sources[0].actors[1])
        real_connect(sender, died)

    monkeypatch.setattr(WeightSender, "connect", kill_then_connect)
    settings = [
        *RAY,
        f"rollout.ray.address={cluster.address}",
        "rollout.ray.workers=2",
        "rollout.ray.weights=broadcast",
    ]
    began = time.time()
    with pytest.raises(SystemExit) as ended:
        train(compose_train(*settings, "trainer.steps=3"), tmp_path / "run")
    ends_failed(
        tmp_path, ended, r"the weights' broadcast group at [\d.]+:\d+ never met: Ray worker 1 died while starting"
    )
    assert time.time() - began < 40, "the death was seen within a poll, not at the group's 60 s timeout"
    assert no_actor_left(cluster)


@pytest.mark.slow
def test_an_actor_that_raises_ends_the_run_in_one_line_naming_its_error(tmp_path, monkeypatch, cluster):
    """Version 2 is published with a tensor of the wrong shape: the actor's load raises, and says so in one line."""
    from experiments.step.sources.ray_transport import RaySource

    Watched(monkeypatch)
    real_put = RaySource._put

    def put_a_broken_version(source, version, weights):
        real_put(source, version, weights if version != 2 else {name: tensor[:1] for name, tensor in weights.items()})

    monkeypatch.setattr(RaySource, "_put", put_a_broken_version)
    with pytest.raises(SystemExit) as ended:
        train(compose_train(*RAY, f"rollout.ray.address={cluster.address}", "trainer.steps=6"), tmp_path / "run")
    ends_failed(
        tmp_path,
        ended,
        r"the concurrent sampler's Ray worker 0 failed while sampling batch \d: RuntimeError: Error\(s\) in loading "
        r"state_dict for \w+: .* \(module.py:\d+\)",
    )
    assert no_actor_left(cluster)


@pytest.mark.slow
def test_a_version_that_goes_backwards_is_refused(tmp_path, monkeypatch, cluster):
    from experiments.step.sources.ray_transport import RaySource

    Watched(monkeypatch)
    real_publish = RaySource.publish
    monkeypatch.setattr(RaySource, "publish", lambda source, step: real_publish(source, 0 if step == 3 else step))
    with pytest.raises(SystemExit) as ended:
        train(compose_train(*RAY, f"rollout.ray.address={cluster.address}", "trainer.steps=6"), tmp_path / "run")
    logged = ends_failed(tmp_path, ended, "weight version 0 was published after version 2: versions only grow")
    assert len(logged) == 2, "step 3 publishes before its record is committed"
    assert no_actor_left(cluster)


def session_processes(session: int) -> list[str]:
    """The command lines of the processes in session `session`."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if int(stat.read_text().rsplit(")", 1)[1].split()[3]) == session:
                found.append((stat.parent / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace"))
        except (OSError, IndexError, ValueError):
            continue
    return found


@needs_ray
@pytest.mark.slow
@pytest.mark.parametrize("signum, code, group", [(signal.SIGTERM, 143, False), (signal.SIGINT, 130, True)])
def test_a_stop_to_the_trainer_stops_every_actor_and_the_ray_instance_it_started(tmp_path, signum, code, group):
    """`rollout.ray.address` null: the run starts a Ray instance of its own (whose SIGTERM handler would exit without
    the summary). SIGTERM to the trainer, and Ctrl-C in a terminal (SIGINT to the whole process group: the Ray
    instance's processes and its actors are in it too), end the run as interrupted and leave no process of its
    session: no actor, no Ray."""
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "experiments.train",
            *MICRO_RUN,
            *RAY,
            "rollout.ray.workers=2",
            "trainer.steps=500",
            f"hydra.run.dir={tmp_path}",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=PROJECT_ROOT,
        start_new_session=True,  # the trainer's session holds the Ray instance it starts, and its actors
    )
    wait_for_lines(tmp_path / "metrics.jsonl", 2, proc, timeout=300)
    assert len(actors_alive(Cluster("", proc.pid))) == 2
    if group:
        os.killpg(proc.pid, signum)
    else:
        proc.send_signal(signum)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == code, stderr[-2000:]
    assert f"interrupted by {signal.Signals(signum).name} after" in one_line(stderr)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["status"] == "interrupted" and summary["steps"] == len(read_metrics(tmp_path)) >= 2
    deadline = time.time() + 30
    while (left := session_processes(proc.pid)) and time.time() < deadline:
        time.sleep(0.2)
    assert not left, f"left behind: {left}"
