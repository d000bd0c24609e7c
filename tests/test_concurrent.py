"""The concurrent source (`rollout.source=concurrent`, experiments/step/sources/concurrent.py) on the micro MoE: a
worker process that stamps every sample with the version that sampled it and, past its bound, waits (never samples
past it), drops (never trains past it, counting what it dropped) or counts (trains it, logging every row's staleness),
as `rollout.overflow` says; a worker that dies or fails, or a batch that slips past the bound, ends the run in one line
with its log whole; SIGTERM and Ctrl-C stop both processes; bad settings are refused before any work. The tests that
start a worker are slow: each spawns an interpreter that imports torch and transformers."""

from __future__ import annotations

import copy
import json
import multiprocessing
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from algos.routing_variants import build_routing_variant
from algos.routing_variants.predictive import topk_agreement
from experiments.config import PROJECT_ROOT
from experiments.step.batch import Rollout, draw_examples, split_minibatches, step_seed
from experiments.step.checks import check_run
from experiments.step.engines import EngineFactory, EngineNumerics, HFEngine, Sampling, full_weights
from experiments.step.metrics import (
    DROPPED_BATCHES,
    PAST_BOUND_ROWS,
    SAMPLER_WAIT_TIME,
    STALENESS_MAX,
    STALENESS_MEAN,
    STEP,
)
from experiments.step.old_policy import Recompute
from experiments.step.sources import SamplingRun, concurrent
from experiments.step.sources.concurrent import Batch, ConcurrentSource, Sampler, SamplerFailed, Shared, WorkerSettings
from experiments.step.sources.overflow import OVERFLOW_POLICIES, Verdict
from experiments.step.sources.workers import check_batch
from experiments.step.trainer import RLTrainer
from experiments.tasks import build_task
from experiments.train import train
from models.policy import ModelConfig, build_policy
from models.registry import ConfigError, node_settings
from models.routing.families import selection_scores
from models.routing.trace import find_routers
from tests.conftest import MICRO_RUN
from tests.dying_worker import DIES_AT, WINDOWS, dying_worker
from tests.test_predictive_routing import PR2
from tests.test_reliability import one_line, wait_for_lines
from tests.test_train import compose_train, read_metrics, train_stopped_after

CONCURRENT = ["rollout.source=concurrent"]
SLOW_UPDATE_S = 0.25  # a trainer slower than the worker, so that the worker runs ahead to its bound


class Watched:
    """A concurrent run's trainer, the rollouts each step was served, and a CPU copy of the trainer's weights of every
    version (version t after step t; version 0 the start)."""

    def __init__(
        self, monkeypatch, slow_update: bool = True, update_s: float = SLOW_UPDATE_S, source: type = ConcurrentSource
    ) -> None:
        """`source`: the transport's class whose `take` is watched (tests/test_ray.py watches Ray's)."""
        self.served: dict[int, object] = {}
        self.versions: dict[int, dict[str, torch.Tensor]] = {}
        watched = self
        real_init, real_publish, real_take = RLTrainer.__init__, RLTrainer.publish, source.take
        real_update = RLTrainer.update

        def init(trainer, *args, **kwargs):
            real_init(trainer, *args, **kwargs)
            watched.trainer = trainer
            watched.versions[0] = copy.deepcopy(full_weights(trainer.model))

        def publish(trainer):
            watched.versions[trainer.step_index] = copy.deepcopy(full_weights(trainer.model))
            real_publish(trainer)

        def take(source, step, seed):
            watched.served[step] = served = real_take(source, step, seed)
            return served

        def update(trainer, mb, old):
            time.sleep(update_s)
            return real_update(trainer, mb, old)

        monkeypatch.setattr(RLTrainer, "__init__", init)
        monkeypatch.setattr(RLTrainer, "publish", publish)
        monkeypatch.setattr(source, "take", take)
        if slow_update:
            monkeypatch.setattr(RLTrainer, "update", update)

    @property
    def worker(self):
        return self.trainer.rollouts.process


def mu_old_under(trainer: RLTrainer, rollout: Rollout, weights: dict[str, torch.Tensor]) -> torch.Tensor:
    """|μ_old − log-probs of `weights`| of the rollout's response tokens: the trainer's scoring of its rows with those
    weights, against the engine's own."""
    model = copy.deepcopy(trainer.model)
    model.load_state_dict(weights)
    (mb,) = split_minibatches(rollout, torch.zeros(rollout.size), torch.arange(rollout.size), 1, trainer.device)
    with torch.no_grad():
        logp = trainer.score(model, mb).logp
    return (logp - mb.mu_logp).abs()[mb.response_mask]


# -- before any work -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "overrides, world, message",
    [
        ([*CONCURRENT, "rollout.max_staleness=-1"], 1, "rollout.max_staleness=-1 must be >= 0"),
        (
            [*CONCURRENT, "rollout.overflow=skip"],
            1,
            r"rollout.overflow=skip is not one of wait, drop, count: what the concurrent source does with a batch "
            "past rollout.max_staleness",
        ),
        (
            [*CONCURRENT, "rollout.lag=1"],
            1,
            "rollout.lag=1 is a setting of rollout.source=lagged, and this run's source is concurrent: use "
            "rollout.source=lagged, or leave rollout.lag at 0",
        ),
    ],
)
def test_settings_the_concurrent_sampler_cannot_serve_are_refused_before_any_work(tmp_path, overrides, world, message):
    with pytest.raises(ConfigError, match=message):
        check_run(compose_train(*overrides), world, memory=False)
    if world == 1:
        with pytest.raises(SystemExit, match=message):
            train(compose_train(*overrides), tmp_path / "run")
        assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_the_plan_recomputes_pi_old_because_the_engine_is_the_workers():
    plan = check_run(compose_train(*CONCURRENT), memory=False).plan
    assert plan.pi_old == "decoupled" and not plan.engine_is_trainer
    assert "worker process's own copy of the weights, up to 1 version(s) behind θ_old" in plan.why


# -- the checks, the gate and the stamps, in this process -----------------------------------------------------------


def batch_of(index: int, versions: list[int]) -> Batch:
    return Batch(index, rollout=None, versions=torch.tensor(versions), sample_s=0.0, wait_s=0.0)


@pytest.mark.parametrize(
    "batch, previous, message",
    [
        (batch_of(4, [2, 2]), 2, None),
        (batch_of(5, [3, 3]), 2, "the concurrent sampler sent batch 5 when step 4 needed batch 4"),
        (
            batch_of(4, [4, 4]),
            2,
            "step 4's rollouts are stamped with weight version 4, which the trainer has not "
            "published: θ_old is version 3",
        ),
        (
            batch_of(4, [1, 1]),
            2,
            "the weight version went backwards: step 4's rollouts were sampled with version 1, after "
            "the batch before's with version 2",
        ),
    ],
)
def test_a_batch_the_step_must_not_take_is_refused_naming_why(batch, previous, message):
    if message is None:
        check_batch(batch, 4, 4, previous)
        return
    with pytest.raises(SamplerFailed, match=message):
        check_batch(batch, 4, 4, previous)


@pytest.mark.parametrize(
    "policy, starts, past_bound",
    [
        # (batch 5, bound 1): published versions and batches taken, whether it may start; a batch 1 row past the bound
        ("wait", {(2, 0): False, (3, 0): True, (2, 4): False}, Verdict.refuse),
        ("drop", {(2, 0): False, (0, 3): True, (3, 2): False}, Verdict.drop),
        ("count", {(2, 0): False, (0, 3): True, (3, 2): False}, Verdict.train),
    ],
)
def test_each_policy_gates_the_worker_on_its_own_counter_and_says_what_a_batch_past_the_bound_becomes(
    policy, starts, past_bound
):
    """Wait gates batch b on version b − 1 − bound published; drop and count on batch b − 1 − bound taken (a queue of
    bound + 1), so that a batch may come to its step past the bound, which drop drops and count trains."""
    overflow = OVERFLOW_POLICIES[policy]()
    for (published, taken), allowed in starts.items():
        assert overflow.may_start(5, 1, published, taken) is allowed, (published, taken)
    assert overflow.verdict(0) == Verdict.train and overflow.verdict(1) == past_bound


@pytest.fixture
def sampler():
    """A worker's sampler in this process, on the micro MoE, and the weights it shares with a trainer."""
    cfg = compose_train()
    context = multiprocessing.get_context("spawn")
    model_cfg = ModelConfig(**OmegaConf.to_container(cfg.model, resolve=True))
    model, _ = build_policy(model_cfg)
    weights = {name: tensor.clone().share_memory_() for name, tensor in full_weights(model).items()}
    shared = Shared(
        weights,
        context.Value("q", 0, lock=False),
        context.Value("q", 0, lock=False),
        context.Lock(),
        context.Semaphore(0),
    )
    run = SamplingRun(
        model=model_cfg,
        dataset=OmegaConf.to_container(cfg.dataset, resolve=True),
        device="cpu",
        seed=cfg.seed,
        prompts=4,
        sampling=Sampling(4, 4, 1.0),
        engines=EngineFactory(HFEngine, cfg, EngineNumerics(), records_routing=False),
        start_model=build_routing_variant("none").start,
    )
    alive = {"trainer": True}

    def sampler_for(policy: str) -> Sampler:
        settings = WorkerSettings(run, bound=1, overflow=OVERFLOW_POLICIES[policy](), first=1)
        return Sampler(settings, shared, lambda: alive["trainer"])

    return sampler_for, shared, alive


def publish(shared: Shared, version: int, scale: float) -> None:
    assert shared.announce(version, {name: tensor * scale for name, tensor in shared.weights.items()}, lambda: True)


def test_the_worker_waits_at_its_bound_takes_the_newest_version_and_stamps_every_row(sampler):
    sampler_for, shared, alive = sampler
    sampler = sampler_for("wait")
    assert sampler.take_weights(2) < 0.1 and sampler.held == 0  # batch 2 at bound 1 needs version 0
    later = threading.Timer(0.5, publish, (shared, 2, 0.5))
    later.start()
    waited = sampler.take_weights(3)  # batch 3 needs version 1: it waits, then takes version 2, the newest
    later.join()
    assert waited >= 0.4 and sampler.held == 2
    for name, tensor in sampler.engine.model.state_dict().items():
        assert torch.equal(tensor, shared.weights[name]), name
    batch = sampler.sample(7, waited)
    assert batch.index == 7 and batch.wait_s == waited and batch.versions.tolist() == [2] * 16
    # the prompts are those the synchronous loop draws for step 7 of this seed
    generator = torch.Generator().manual_seed(step_seed(0, 7, 0))
    picks = torch.randint(len(sampler.examples), (4,), generator=generator).tolist()
    assert [e.prompt for e in batch.rollout.examples] == [sampler.examples[i].prompt for i in picks for _ in range(4)]
    alive["trainer"] = False
    assert sampler.take_weights(5) is None, "a worker whose trainer is gone stops waiting"


@pytest.mark.parametrize("policy", ["drop", "count"])
def test_under_a_queue_the_worker_waits_for_the_trainer_to_take_a_batch_not_for_a_version(sampler, policy):
    """Batch 3 at bound 1 waits for batch 1 to be taken; the take wakes it, and it samples with the version it
    holds, however far behind."""
    sampler_for, shared, _ = sampler
    sampler = sampler_for(policy)
    assert sampler.take_weights(2) < 0.1 and sampler.held == 0  # batch 2 needs batch 0 taken: the count's start
    later = threading.Timer(0.5, shared.took, (1, lambda: True))
    later.start()
    waited = sampler.take_weights(3)
    later.join()
    assert waited >= 0.4 and sampler.held == 0, "no version was published: it samples with version 0"


def test_a_published_version_that_goes_backwards_is_refused_by_the_worker(sampler):
    sampler_for, shared, _ = sampler
    sampler = sampler_for("wait")
    publish(shared, 3, 1.0)
    assert sampler.take_weights(4) is not None and sampler.held == 3
    later = threading.Timer(0.3, publish, (shared, 1, 1.0))
    later.start()
    with pytest.raises(SamplerFailed, match="weight version 1 was published after version 3: versions only grow"):
        sampler.take_weights(6)  # batch 6 waits for version 4, and wakes at version 1
    later.join()


# -- a worker beside the trainer -------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("bound", [0, 1])
def test_the_sampler_never_trains_a_sample_above_its_bound_and_stamps_each_with_the_version_that_sampled_it(
    tmp_path, monkeypatch, bound
):
    """The trainer is slower than the worker, so the worker runs ahead to its bound and waits there. Every sample's
    μ_old is the log-probs of the weights of the version it is stamped with, and not of the next version's."""
    watched = Watched(monkeypatch)
    summary = train(compose_train(*CONCURRENT, f"rollout.max_staleness={bound}", "trainer.steps=5"), tmp_path / "run")
    logged = read_metrics(tmp_path / "run")
    assert [row[STEP] for row in logged] == [1, 2, 3, 4, 5]
    assert all(row[STALENESS_MAX] <= bound for row in logged)
    assert max(row[STALENESS_MAX] for row in logged) == bound, "the worker ran ahead to its bound: the gate held it"
    assert summary["staleness_max"] == bound and "not bit-reproducible" in summary["rollouts"]
    if bound == 0:
        assert sum(row[SAMPLER_WAIT_TIME] for row in logged) > SLOW_UPDATE_S, "at bound 0 the worker waits every step"
    for step, served in watched.served.items():
        stamps = served.versions.tolist()
        assert len(stamps) == served.rollout.size == 16 and len(set(stamps)) == 1, "every row stamped, one version"
        (version,) = set(stamps)
        assert logged[step - 1][STALENESS_MEAN] == step - 1 - version
        gap = mu_old_under(watched.trainer, served.rollout, watched.versions[version])
        assert float(gap.max()) < 1e-4, f"step {step}: μ_old is version {version}'s"
        newer = mu_old_under(watched.trainer, served.rollout, watched.versions[version + 1])
        assert float(newer.max()) > 1e-3, f"step {step}: the versions are told apart"
    assert not watched.worker, "the run's end stopped the worker"


@pytest.mark.slow
@pytest.mark.parametrize("bound", [0, 1, 2])
@pytest.mark.parametrize("policy", ["wait", "drop", "count"])
def test_past_its_bound_the_worker_waits_drops_or_counts_behind_a_slow_trainer(tmp_path, monkeypatch, policy, bound):
    """A trainer much slower than the worker (a second a step), so that the worker runs ahead as far as its policy
    lets it. Wait: no batch past the bound, the worker held at it. Drop: batches past it dropped and counted, no row
    trained past it. Count: batches past it trained, one version past at most (the queue), and every step logs its
    rows' staleness as their stamps say."""
    watched = Watched(monkeypatch, update_s=0.5)
    overrides = [*CONCURRENT, f"rollout.max_staleness={bound}", f"rollout.overflow={policy}", "trainer.steps=6"]
    summary = train(compose_train(*overrides), tmp_path / "run")
    logged = read_metrics(tmp_path / "run")
    assert [row[STEP] for row in logged] == [1, 2, 3, 4, 5, 6]
    trained = {step: step - 1 - served.versions for step, served in watched.served.items()}  # from each row's stamp
    for step, staleness in trained.items():
        row = logged[step - 1]
        assert row[STALENESS_MEAN] == float(staleness.float().mean()) and row[STALENESS_MAX] == int(staleness.max())
        assert row[PAST_BOUND_ROWS] == int((staleness > bound).sum()), f"step {step}"
    dropped = sum(row[DROPPED_BATCHES] for row in logged)
    past = sum(row[PAST_BOUND_ROWS] for row in logged)
    most = max(int(staleness.max()) for staleness in trained.values())
    assert summary["dropped_batches"] == dropped and summary["past_bound_rows"] == past
    if policy == "wait":
        assert dropped == past == 0 and most == bound, "the worker ran ahead to its bound, and no further"
    elif policy == "drop":
        assert dropped > 0 and past == 0 and most <= bound, "batches past the bound were dropped, never trained"
    else:
        assert dropped == 0 and past > 0 and most == bound + 1, "batches past the bound were trained and counted"
    assert not watched.worker, "the run's end stopped the worker"


@pytest.mark.slow
def test_r3_replays_the_routes_the_worker_recorded(tmp_path, monkeypatch):
    replayed = []
    real_call = Recompute.__call__

    def recompute(source, mb):
        old = real_call(source, mb)
        replayed.append((mb.engine_routes, old.replay))
        return old

    monkeypatch.setattr(Recompute, "__call__", recompute)
    train(compose_train(*CONCURRENT, "routing.replay=r3"), tmp_path / "run")
    assert replayed and all(routes is not None and replay is routes for routes, replay in replayed)
    assert max(row["mismatch/expert_frac"] for row in read_metrics(tmp_path / "run")) > 0, (
        "the stale worker's routes differ from θ_old's"
    )


def routes_by_its_versions_predictors(tmp_path: Path, watched: Watched, *overrides: str) -> None:
    """A PR2 run (`routing_variant=predictive`) of the concurrent source, its predictors trained fast: every row a
    worker sampled was routed by the predictors of the version it is stamped with (the worker's model has them, and
    every version carries them), and a trained prediction moved some tokens off the routers' own experts."""
    settings = [*CONCURRENT, *PR2, "trainer.minibatches=2", "trainer.lr=3e-2", "trainer.steps=4", *overrides]
    train(compose_train(*settings), tmp_path / "run")
    moved = False
    for step, served in watched.served.items():
        (version,) = set(served.versions.tolist())
        model = copy.deepcopy(watched.trainer.model)
        model.load_state_dict(watched.versions[version])
        routes, routed = served.rollout.routes, served.rollout.routes.recorded()
        with torch.no_grad():
            for layer, router in enumerate(find_routers(model).values()):
                inputs, logits = routes.inputs[layer][routed[layer]], routes.logits[layer][routed[layer]]
                predicted = selection_scores(router, logits + router.predictor(inputs)).topk(router.top_k, -1).indices
                own = selection_scores(router, logits).topk(router.top_k, -1).indices
                recorded = routes.experts[layer][routed[layer]]
                assert (topk_agreement(recorded, predicted) == 1).all(), f"step {step}: version {version}'s route"
                moved |= bool((topk_agreement(recorded, own) < 1).any())
    assert moved, "a trained predictor moved some tokens' experts: the check above tells the predictors apart"


@pytest.mark.slow
def test_pr2_s_worker_routes_by_the_predictors_of_the_version_that_sampled(tmp_path, monkeypatch):
    watched = Watched(monkeypatch)
    routes_by_its_versions_predictors(tmp_path, watched, "rollout.max_staleness=1")
    assert not watched.worker, "the run's end stopped the worker"


def resumes_with_its_worker_at_the_checkpoints_weights(tmp_path: Path, monkeypatch, source: type, *overrides: str):
    """A concurrent run killed after step 3 and resumed (`resume=auto`) does what docs/async.md says: the steps before
    the kill stay logged, its samplers start again from the checkpoint's weights (the first step after the resume
    trains rows of version 3, at staleness 0), and the batch in flight at the kill is sampled again (batch 4's
    prompts, the synchronous step 4's, with version 3: not the killed run's version)."""
    settings = [*CONCURRENT, "rollout.max_staleness=1", "trainer.steps=5", "trainer.checkpoint_every=1", *overrides]
    killed = Watched(monkeypatch, slow_update=False, source=source)
    train_stopped_after(3, compose_train(*settings), tmp_path / "run", monkeypatch)
    resumed = Watched(monkeypatch, slow_update=False, source=source)
    cfg = compose_train(*settings, "resume=auto")
    train(cfg, tmp_path / "run")
    logged = read_metrics(tmp_path / "run")
    assert [row[STEP] for row in logged] == [1, 2, 3, 4, 5]
    assert min(resumed.served) == 4, "the resumed run's first step is step 4"
    served = resumed.served[4]
    assert set(served.versions.tolist()) == {3} and logged[3][STALENESS_MAX] == 0
    assert float(mu_old_under(resumed.trainer, served.rollout, killed.versions[3]).max()) < 1e-4, "version 3's"
    assert float(mu_old_under(resumed.trainer, served.rollout, killed.versions[2]).max()) > 1e-3
    examples = build_task(**node_settings(cfg.dataset)).examples("train")
    drawn = draw_examples(examples, 4, torch.Generator().manual_seed(step_seed(cfg.seed, 4, 0)))
    assert [e.prompt for e in served.rollout.examples] == [e.prompt for e in drawn for _ in range(4)]


@pytest.mark.slow
def test_a_killed_concurrent_run_resumes_with_its_worker_at_the_checkpoints_weights(tmp_path, monkeypatch):
    resumes_with_its_worker_at_the_checkpoints_weights(tmp_path, monkeypatch, ConcurrentSource)


def trains_a_share_of_each_batch_on_each_of_two_ranks(tmp_path: Path, *overrides: str) -> list[list[dict]]:
    """A concurrent run on two FSDP2 ranks under torchrun (`tests/concurrent_ranks.py`), rank 0 driving the workers:
    at every step both ranks train rows of one version, within the bound; rank 0 the first half of the batch the
    workers sampled (the synchronous step's prompts, seeded from (seed, batch)) and rank 1 the second; each row's
    μ_old is the log-probs of the full weights of its version, gathered from both ranks' shards when it was
    published, and not of the next version's. Each rank's steps, for the caller's own checks."""
    settings = [*CONCURRENT, "rollout.max_staleness=1", "trainer.steps=4", *overrides]
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
        + ["tests/concurrent_ranks.py", str(tmp_path), *settings],
        capture_output=True,
        text=True,
        cwd=PROJECT_ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(PROJECT_ROOT)},
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    ranks = [torch.load(tmp_path / f"rank{rank}.pt", weights_only=False) for rank in (0, 1)]
    cfg = compose_train(*settings)
    examples = build_task(**node_settings(cfg.dataset)).examples("train")
    for mine, theirs in zip(ranks[0]["steps"], ranks[1]["steps"], strict=True):
        step = mine["step"]
        assert theirs["step"] == step and len(set(mine["versions"] + theirs["versions"])) == 1, "one version a step"
        assert 0 <= step - 1 - mine["versions"][0] <= 1, f"step {step}: within the bound"
        drawn = draw_examples(examples, 4, torch.Generator().manual_seed(step_seed(cfg.seed, step, 0)))
        assert mine["prompts"] + theirs["prompts"] == [e.prompt for e in drawn for _ in range(4)], f"step {step}"
        for rank in (mine, theirs):
            assert rank["gap_own"] < 1e-4 and rank["gap_next"] > 1e-3, f"step {step}: {rank}"
    assert [row["step"] for row in ranks[0]["steps"]] == [1, 2, 3, 4]
    return [rank["steps"] for rank in ranks]


@pytest.mark.slow
def test_two_trainer_ranks_each_train_their_share_of_the_workers_batches(tmp_path):
    trains_a_share_of_each_batch_on_each_of_two_ranks(tmp_path)


# -- how a run with a worker ends ------------------------------------------------------------------------------------


def ends_failed(tmp_path: Path, error: pytest.ExceptionInfo, why: str) -> list[dict]:
    """The run's one line says `why` (a regex) and where its log and summary are; both are whole and say failed."""
    line = str(error.value)
    assert "\n" not in line and "metrics.jsonl holds" in line and "says status 'failed'" in line, line
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    logged = read_metrics(tmp_path / "run")
    assert summary["status"] == "failed" and summary["steps"] == len(logged)
    assert [row[STEP] for row in logged] == list(range(1, len(logged) + 1))
    assert re.search(why, line) and re.search(why, summary["failed"]), line
    return logged


@pytest.mark.slow
def test_a_killed_worker_ends_the_run_in_one_line_with_its_log_whole(tmp_path, monkeypatch):
    watched = Watched(monkeypatch)
    real_publish = ConcurrentSource.publish

    def publish_then_kill(source, step):
        real_publish(source, step)
        if step == 2:
            os.kill(source.process.pid, signal.SIGKILL)

    monkeypatch.setattr(ConcurrentSource, "publish", publish_then_kill)
    with pytest.raises(SystemExit) as ended:
        train(compose_train(*CONCURRENT, "trainer.steps=6"), tmp_path / "run")
    # Killed while the trainer waits for a batch, publishes or counts a batch taken (the worker may die holding the
    # shared lock, as it loads the version just published: the trainer's next use of the lock sees it).
    logged = ends_failed(
        tmp_path,
        ended,
        r"the concurrent sampler's worker \(pid \d+\) was killed by SIGKILL while "
        r"step \d (waited for its rollouts|published its weights|took its rollouts)",
    )
    assert len(logged) >= 2 and f"while step {len(logged) + 1} " in str(ended.value)
    assert not watched.worker


def shared_memory_of(*pids: int) -> set[str]:
    """What /dev/shm holds under a name of these processes (torch's `torch_<pid>_...` segments)."""
    return {name for name in os.listdir("/dev/shm") for pid in pids if f"_{pid}_" in name}


@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGKILL, signal.SIGTERM], ids=["SIGKILL", "SIGTERM"])
@pytest.mark.parametrize("window", WINDOWS)
def test_a_worker_killed_in_any_window_ends_the_run_in_one_line_within_seconds(tmp_path, monkeypatch, window, signum):
    """At bound 0, where the worker waits for every step's weights (the window a condition variable once hung the
    trainer in, forever). The worker sends itself the signal in `window` of its batch for step DIES_AT."""
    watched = Watched(monkeypatch)
    stamp = tmp_path / "killed_at"
    monkeypatch.setattr(concurrent, "serve", dying_worker(window, signum, stamp))
    started = {}
    real_start = ConcurrentSource._start

    def start(source, step, weights):
        real_start(source, step, weights)
        started["pid"] = source.process.pid

    monkeypatch.setattr(ConcurrentSource, "_start", start)
    # A trainer that hangs fails the test instead of the suite: SIGTERM after a minute ends the run as interrupted.
    watchdog = threading.Timer(60, os.kill, (os.getpid(), signal.SIGTERM))
    watchdog.start()
    try:
        with pytest.raises(SystemExit) as ended:
            train(compose_train(*CONCURRENT, "rollout.max_staleness=0", "trainer.steps=4"), tmp_path / "run")
    finally:
        watchdog.cancel()
    took = time.time() - float(stamp.read_text())
    # Between batches the worker dies with step DIES_AT - 1's batch queued: its outbox's thread may or may not have
    # sent it (on a loaded machine, not yet), so the trainer meets the death in step DIES_AT - 1 or DIES_AT. In the
    # other windows the worker already holds version DIES_AT - 1, which the trainer publishes after training that step.
    steps = (DIES_AT - 1, DIES_AT) if window == "between batches" else (DIES_AT,)
    logged = ends_failed(
        tmp_path,
        ended,
        rf"the concurrent sampler's worker \(pid {started['pid']}\) was killed by "
        rf"{signum.name} while step ({'|'.join(map(str, steps))}) (waited for its "
        "rollouts|published its weights)",
    )
    assert len(logged) + 1 in steps and f"while step {len(logged) + 1} " in str(ended.value)
    assert took < 5, f"the run took {took:.1f} s to notice its worker's death"
    assert not watched.worker and not Path(f"/proc/{started['pid']}").exists(), "the worker is left"
    assert not [command for command in children(os.getpid()).values() if "spawn_main" in command]
    assert not shared_memory_of(os.getpid(), started["pid"]), "shared memory is left"


@pytest.mark.slow
def test_a_failing_worker_ends_the_run_in_one_line_naming_its_error(tmp_path, monkeypatch):
    """The trainer publishes its step 3 as version 0: the worker, which held a later one, refuses it."""
    Watched(monkeypatch)
    real_publish = ConcurrentSource.publish
    monkeypatch.setattr(
        ConcurrentSource, "publish", lambda source, step: real_publish(source, 0 if step == 3 else step)
    )
    with pytest.raises(SystemExit) as ended:
        train(compose_train(*CONCURRENT, "trainer.steps=8"), tmp_path / "run")
    ends_failed(
        tmp_path,
        ended,
        r"the concurrent sampler's worker failed while sampling batch \d: weight "
        r"version 0 was published after version \d: versions only grow",
    )


@pytest.mark.slow
def test_a_sample_older_than_the_bound_that_slipped_through_stops_the_run(tmp_path, monkeypatch):
    """A worker gated at 1 behind a trainer that checks 0: its first batch of staleness 1 is refused."""
    Watched(monkeypatch)
    real_start = ConcurrentSource._start

    def start_with_a_tighter_check(source, step, weights):
        real_start(source, step, weights)
        source.bound = 0

    monkeypatch.setattr(ConcurrentSource, "_start", start_with_a_tighter_check)
    with pytest.raises(SystemExit) as ended:
        train(compose_train(*CONCURRENT, "rollout.max_staleness=1", "trainer.steps=4"), tmp_path / "run")
    logged = ends_failed(
        tmp_path,
        ended,
        r"16 sample\(s\) older than rollout.max_staleness=0 slipped through: step "
        r"\d trains from version \d, and they were sampled with version \d, 1 "
        "versions behind",
    )
    assert all(row[STALENESS_MAX] == 0 for row in logged)


def children(pid: int) -> dict[int, str]:
    """The processes whose parent is `pid`, with their command lines."""
    found = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if int(fields[1]) == pid:
                found[int(stat.parent.name)] = (stat.parent / "cmdline").read_text().replace("\0", " ")
        except (OSError, IndexError):
            continue
    return found


@pytest.mark.slow
@pytest.mark.parametrize("signum, code, group", [(signal.SIGTERM, 143, False), (signal.SIGINT, 130, True)])
def test_a_stop_to_the_trainer_stops_its_worker_too(tmp_path, signum, code, group):
    """SIGTERM to the trainer, and Ctrl-C in a terminal: SIGINT to the whole process group, the worker's too."""
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "experiments.train",
            *MICRO_RUN,
            *CONCURRENT,
            "trainer.steps=500",
            f"hydra.run.dir={tmp_path}",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=PROJECT_ROOT,
        start_new_session=group,
    )
    wait_for_lines(tmp_path / "metrics.jsonl", 2, proc, timeout=300)
    (worker,) = [pid for pid, command in children(proc.pid).items() if "spawn_main" in command]
    if group:
        os.killpg(proc.pid, signum)
    else:
        proc.send_signal(signum)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == code
    assert f"interrupted by {signal.Signals(signum).name} after" in one_line(stderr)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["status"] == "interrupted" and summary["steps"] == len(read_metrics(tmp_path)) >= 2
    assert not Path(f"/proc/{worker}").exists(), "the worker outlived its trainer"
