"""What the concurrent source's transports share (`rollout.transport`: `experiments.step.sources.concurrent`, a worker
process and shared memory; `experiments.step.sources.ray_transport`, Ray actors): its settings and their checks, what
samples in a worker (`WorkerEngine`), a batch as a worker sends it, and the trainer's side of a step (`Concurrent.take`:
every batch checked, then trained or dropped as the overflow policy says). A transport says how a worker starts, gets
the weights of each version and sends its batches, and how it is stopped.
"""

from __future__ import annotations

import importlib.util
import time
import traceback
from abc import abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from experiments.ranks import Ranks, scatter_objects
from experiments.step import metrics as m
from experiments.step.batch import Rollout, Served, collect_rollout, draw_examples, rank_share, step_seed
from experiments.step.engines import HFEngine, RolloutEngine
from experiments.step.sources.base import RolloutSource, SamplingRun, as_written, off_default
from experiments.step.sources.overflow import OVERFLOW_POLICIES, OverflowPolicy, Verdict
from experiments.step.versions import Weights
from experiments.tasks import build_task
from models.policy import build_policy
from models.registry import ConfigError, RunFailed

TRANSPORTS = ("local", "ray")  # `rollout.transport`: a worker process and shared memory, or Ray actors
RAY_SETTINGS = ("address", "workers", "worker_cpus", "weights")  # `rollout.ray`'s, read under the Ray transport alone
RAY_WEIGHTS = ("object_store", "broadcast")  # `rollout.ray.weights`: how each version reaches the actors
POLL_S = 0.5  # how often a process blocked on the other checks that the other still lives


def check_ray(settings: Any) -> None:
    """Refuse, in one line and before anything is built, `rollout.ray` settings the Ray transport cannot serve, and
    the transport where Ray is not installed."""
    if importlib.util.find_spec("ray") is None:
        raise ConfigError(
            "rollout.transport=ray needs Ray, which is not installed here: pip install -e '.[ray]' (the version "
            "constraints.txt locks)"
        )
    if settings.workers < 1:
        raise ConfigError(f"rollout.ray.workers={settings.workers} must be >= 1: the Ray actors that sample")
    if not settings.worker_cpus > 0:
        raise ConfigError(
            f"rollout.ray.worker_cpus={settings.worker_cpus} must be > 0: the CPUs Ray reserves per actor"
        )
    if settings.weights not in RAY_WEIGHTS:
        raise ConfigError(
            f"rollout.ray.weights={settings.weights} is not one of {', '.join(RAY_WEIGHTS)}: how each weight version "
            "reaches the Ray actors (docs/async.md)"
        )
    address = settings.address
    if address is not None:
        host, _, port = str(address).rpartition(":")
        if not host or not port.isdigit() or "/" in address:
            raise ConfigError(
                f"rollout.ray.address={address} is not host:port (a Ray head's address, as `ray start --head` prints "
                "it), or null to start Ray on this machine"
            )


class SamplerFailed(RunFailed):
    """The concurrent sampler cannot serve the run: its worker raised or died, or a batch failed the trainer's checks.
    The run ends in one line, with status failed (`experiments.run.life`)."""


@dataclass(frozen=True)
class Batch:
    """One batch of rollouts as the worker sends them, every row stamped with the version that sampled it."""

    index: int  # the worker's count: under wait and count the step it is for
    rollout: Rollout
    versions: torch.Tensor  # [N]
    sample_s: float  # the seconds the worker spent sampling it
    wait_s: float  # and waiting for its policy's gate before it


def check_batch(batch: Batch, expected: int, step: int, previous: int | None) -> None:
    """Refuse, naming what is wrong, a batch that step `step` must not take: another than batch `expected`, the one
    that comes next, or stamped with a version the trainer has not published or with one older than the batch before
    it (`previous`: its version)."""
    oldest, newest = int(batch.versions.min()), int(batch.versions.max())
    if batch.index != expected:
        raise SamplerFailed(f"the concurrent sampler sent batch {batch.index} when step {step} needed batch {expected}")
    if newest > step - 1:
        raise SamplerFailed(
            f"step {step}'s rollouts are stamped with weight version {newest}, which the trainer has "
            f"not published: θ_old is version {step - 1}"
        )
    if previous is not None and oldest < previous:
        raise SamplerFailed(
            f"the weight version went backwards: step {step}'s rollouts were sampled with version "
            f"{oldest}, after the batch before's with version {previous}"
        )


def slipped_through(batch: Batch, step: int, bound: int) -> str:
    """Why a batch past a bound that the worker's gate should have held ends the run."""
    oldest = int(batch.versions.min())
    stale = int((step - 1 - batch.versions > bound).sum())
    return (
        f"{stale} sample(s) older than rollout.max_staleness={bound} slipped through: step {step} "
        f"trains from version {step - 1}, and they were sampled with version {oldest}, "
        f"{step - 1 - oldest} versions behind"
    )


class WorkerEngine:
    """What samples in a worker, whichever transport carries its weights and batches: the run's engine on a model of
    its own, the task, and the version it holds. The local worker process (`Sampler`) and each Ray actor
    (`experiments.step.sources.ray_transport`) sample with one."""

    def __init__(self, run: SamplingRun) -> None:
        self.run = run
        model, tokenizer = build_policy(run.model)
        # functools.wraps hides from mypy that PreTrainedModel.to is a method (typeshed's _Wrapped binds no self).
        model.to(run.device).eval()  # type: ignore[arg-type]
        run.start_model(model)  # what the routing variant adds (PR2's predictors), as the trainer's model has it
        # Without numbers of its own the engine samples with the worker's module (its "trainer's weights"), into
        # which each version loads; with them it keeps its own copy, cast and quantized again at each load.
        self.engine: RolloutEngine = run.engines(model, tokenizer, Ranks(), on_model=run.engines.can_sample_on())
        self.task = build_task(**run.dataset)
        self.examples = self.task.examples("train")
        self.generator = torch.Generator()
        self.held: int | None = None  # the version the engine holds

    def refuse_backwards(self, newest: int) -> None:
        """Refuse `newest` as the newest version published when the engine holds a later one: versions only grow."""
        if self.held is not None and newest < self.held:
            raise SamplerFailed(f"weight version {newest} was published after version {self.held}: versions only grow")

    def hold(self, version: int, weights: Callable[[], Mapping[str, torch.Tensor]]) -> None:
        """Sample the next batches with `version`, whose weights `weights` reads: loaded only when the engine holds
        another (a worker reads a version once, however many batches it samples with it)."""
        self.refuse_backwards(version)
        if version != self.held:
            self.load(weights())
            self.held = version

    def load(self, weights: Mapping[str, torch.Tensor]) -> None:
        """The engine takes `weights` (a full state dict of the run's model)."""
        if self.engine.shares_trainer_weights:
            assert isinstance(self.engine, HFEngine)  # the one engine that samples on a module (vLLM holds a copy)
            self.engine.model.load_state_dict(weights)
        else:
            self.engine.sync_weights(weights)

    def sample(self, batch: int, waited: float) -> Batch:
        """Batch `batch`, with the version held: the prompts and the sampling seeded from (seed, batch) as the
        synchronous loop seeds step `batch` (one rank), so that two batches, whichever worker samples them, never
        share a seed."""
        run = self.run
        seed = step_seed(run.seed, batch, 0)
        torch.manual_seed(seed)
        self.generator.manual_seed(seed)
        self.engine.reseed(seed)
        examples = draw_examples(self.examples, run.prompts, self.generator)
        start = time.perf_counter()
        rollout = collect_rollout(self.engine, self.task, examples, run.sampling)
        assert self.held is not None  # a version is held before any batch is sampled
        return Batch(batch, rollout, torch.full((rollout.size,), self.held), time.perf_counter() - start, waited)


def one_line(error: BaseException) -> str:
    """An error of the worker in one line: a `SamplerFailed`'s message; else its type, message and where it was
    raised."""
    if isinstance(error, SamplerFailed):
        return str(error)
    where = traceback.extract_tb(error.__traceback__)[-1]
    return f"{type(error).__name__}: {' '.join(str(error).split())} ({Path(where.filename).name}:{where.lineno})"


class Concurrent(RolloutSource):
    """The concurrent source, whichever its transport: the trainer's side of a step (`take`, `publish`, `close`), on
    one rank or several (rank 0 drives the workers: `on_main`), over a transport's hooks (`_start`, `_publish`,
    `_receive`, `_took`, `_close` and `sampler`)."""

    settings = ("max_staleness", "overflow", "transport", *(f"ray.{key}" for key in RAY_SETTINGS))

    @classmethod
    def check(cls, rollout: Any, world: int, steps: int) -> None:
        bound = rollout.max_staleness
        if bound < 0:
            raise ConfigError(
                f"rollout.max_staleness={bound} must be >= 0: the weight versions a sample of the concurrent "
                "source may be behind θ_old when it is trained (0: its worker waits for every step's weights)"
            )
        if rollout.overflow not in OVERFLOW_POLICIES:
            raise ConfigError(
                f"rollout.overflow={rollout.overflow} is not one of {', '.join(OVERFLOW_POLICIES)}: what the "
                "concurrent source does with a batch past rollout.max_staleness (docs/async.md)"
            )
        if rollout.transport not in TRANSPORTS:
            raise ConfigError(
                f"rollout.transport={rollout.transport} is not one of {', '.join(TRANSPORTS)}: how the concurrent "
                "source's workers get their weights and send their batches (docs/async.md)"
            )
        if rollout.transport == "ray":
            check_ray(rollout.ray)
        else:
            for key in RAY_SETTINGS:
                if (found := off_default(rollout, f"ray.{key}")) is not None:
                    value, default = map(as_written, found)
                    raise ConfigError(
                        f"rollout.ray.{key}={value} is a setting of rollout.transport=ray, and this run's transport "
                        f"is {rollout.transport}: use rollout.transport=ray, or leave rollout.ray.{key} at {default}"
                    )

    @classmethod
    def engine_is_trainer(cls, rollout: Any, engine: type[RolloutEngine]) -> bool:
        return False  # the worker's engine samples with a model of its own

    @classmethod
    def behind(cls, rollout: Any) -> str | None:
        return (
            "the concurrent sampler's engine is a worker process's own copy of the weights, up to "
            f"{rollout.max_staleness} version(s) behind θ_old"
        )

    def __init__(
        self, run: SamplingRun, bound: int, overflow: OverflowPolicy, weights: Callable[[], Weights], ranks: Ranks
    ) -> None:
        self.run, self.bound, self.overflow, self.weights, self.ranks = run, bound, overflow, weights, ranks
        self.started = False  # on every rank: whether rank 0's workers run, from the first `take` to `close`
        self.next_batch = 0  # the index of the batch the worker sends next (its first: the step it starts at)
        self.previous: int | None = None  # the version the last batch taken was sampled with

    def on_main(
        self, work: Callable[[], Any], share: Callable[[Any, Ranks], Any] = lambda result, ranks: result
    ) -> Any:
        """`work`'s result, computed on rank 0, each rank handed its `share` of it; a refusal or failure raised on
        every rank as one line, so that the ranks end together. On one rank, `work()`."""
        world = self.ranks.world
        outcomes: list[tuple[type[Exception] | None, Any]] | None = None
        if self.ranks.main:
            try:
                result = work()
                outcomes = [(None, share(result, Ranks(rank, world))) for rank in range(world)]
            except (SamplerFailed, ConfigError) as error:
                if not self.ranks.active:
                    raise
                outcomes = [(type(error), str(error))] * world
        failed, payload = scatter_objects(outcomes, self.ranks)
        if failed is not None:
            raise failed(payload)
        return payload

    def take(self, step: int, seed: int) -> Served:
        """Step `step`'s rollouts: rank 0 takes the next batch from its workers (`take_whole`) and hands each rank
        its share of the batch's rows alone (`rank_share`), as each rank of the synchronous loop samples its share of
        the step's prompts. The workers start at the first take, with the trainer's weights then (gathered on every
        rank: under FSDP2 a collective)."""
        if not self.started:
            weights = self.weights()
            self.on_main(lambda: self._start(step, weights))
            self.started = True
        return self.on_main(lambda: self.take_whole(step), rank_share)

    def publish(self, version: int) -> None:
        """The trainer's weights after step `version`, gathered on every rank, published by rank 0 as version
        `version` (nothing before the workers start: they start with the weights then)."""
        if not self.started:
            return
        weights = self.weights()
        self.on_main(lambda: self._publish(version, weights))

    def close(self) -> None:
        """Stop the workers (on rank 0, which started them), however the run ends."""
        self.started = False
        if self.ranks.main:
            self._close()

    def take_whole(self, step: int) -> Served:
        """Step `step`'s whole batch from the workers, once they have sent it: each batch checked (`check_batch`),
        counted taken, and trained or dropped as the policy says (`verdict`); the one trained is measured."""
        dropped, waited = 0, 0.0
        while True:
            batch = self._receive(step)
            check_batch(batch, self.next_batch, step, self.previous)
            self.next_batch, self.previous = batch.index + 1, int(batch.versions.max())
            self._took(batch.index, step)
            waited += batch.wait_s
            past = int((step - 1 - batch.versions > self.bound).sum())
            verdict = self.overflow.verdict(past)
            if verdict == Verdict.refuse:
                raise SamplerFailed(slipped_through(batch, step, self.bound))
            if verdict == Verdict.train:
                break
            dropped += 1
        staleness = (step - 1 - batch.versions).float()
        return Served(
            batch.rollout,
            batch.versions,
            batch.sample_s,
            {
                m.ENGINE_VERSION: int(batch.versions.min()),
                m.STALENESS_MEAN: float(staleness.mean()),
                m.STALENESS_MAX: int(staleness.max()),
                m.SAMPLER_WAIT_TIME: waited,
                m.SAMPLE_TIME: batch.sample_s,
                m.DROPPED_BATCHES: dropped,
                m.PAST_BOUND_ROWS: past,
            },
        )

    @abstractmethod
    def _start(self, step: int, weights: Weights) -> None:
        """Start the workers for the batches of `step` on, holding `weights`, the trainer's now (version step − 1)."""

    @abstractmethod
    def _publish(self, version: int, weights: Weights) -> None:
        """Hand `weights` to the workers as version `version`; a worker's death raises `SamplerFailed`."""

    @abstractmethod
    def _close(self) -> None:
        """Stop the workers; the batches they sampled and no step took are dropped."""

    @abstractmethod
    def _receive(self, step: int) -> Batch:
        """Batch `next_batch`, as step `step` waits for it; a worker's death or error raises `SamplerFailed`."""

    @abstractmethod
    def _took(self, batch: int, step: int) -> None:
        """Count batch `batch` taken by step `step`: under drop and count a room in the workers' queue."""

    @abstractmethod
    def sampler(self) -> str:
        """What samples, as `describe`'s sentence says it."""

    def describe(self) -> dict[str, Any]:
        """What `summary.json` says of the rollouts and their engine."""
        return {
            "rollouts": f"concurrent: {self.sampler()} while the trainer updates, with rollout.max_staleness="
            f"{self.bound}: past the bound it {self.overflow.what} (rollout.overflow={self.overflow.name}); not "
            "bit-reproducible (which version samples a batch depends on the two processes' timing): experiments "
            "use rollout.source=lagged",
            "engine": self.run.engines.engine.name,
            "engine_numerics": f"the worker's own copy: {self.run.engines.numerics}",
            "engine_details": {},
        }
