"""The concurrent sampler (`rollout.concurrent=true`, the throughput mode): a worker process samples the next steps'
rollouts while the trainer updates, with weights at most `rollout.max_staleness` versions behind θ_old.

Versions. A version is the weights after one RL step (`experiments.step.versions`): step t trains from θ_old =
version t − 1. After each step the trainer publishes its weights as version t, into tensors in shared memory beside a
counter of the newest version (`ConcurrentRollouts.publish`); one lock guards both, so the worker never reads half a
version, and a semaphore released at each publication wakes a worker waiting for one. No wait of either process
depends on the other's answer: with a condition variable it would (multiprocessing's `notify_all` blocks until each
sleeping waiter acknowledges, and a killed one never does), while releasing a semaphore blocks on nothing. Before each
batch the worker takes the newest version published and samples the whole batch with it, so
every token of a row comes from one version, and stamps every row with it (`Served.versions`). A row's staleness is
θ_old's version minus its own, (t − 1) − v, logged per step as the mean and max over the step's rows
(`async/staleness_mean`, `async/staleness_max`; the rows of one batch share their version).

Past the bound the worker waits. Batch t is step t's, which trains from version t − 1, so the worker starts it only
once version t − 1 − max_staleness is published: AReaL's gate at submission (`max_head_offpolicyness`), and NeMo-RL
waits too. The field does all three things past a bound: TRL and prime-rl drop what is too old, SkyRL and PipelineRL
train it and count. Why wait here: each batch goes to one step, in order, so whether it would be too old is known
before it is sampled; waiting then never samples a row that no step trains (dropping spends the worker's core on
them) and never trains a row past the bound the run declares (training and counting turns the bound into a report).
The price is a worker idling at the bound until the trainer publishes: its seconds waiting are logged per step
(`async/sampler_wait_s`), and the trainer's own wait for its batch is the step's `perf/rollout_s`. At max_staleness 0
the worker waits for every step's weights and the two processes take turns; at 1 it samples step t + 1's batch while
step t trains (one step of overlap, verl's one-step-off); the batches of at most max_staleness + 1 steps are held at
once.

Checks. The trainer checks every batch it takes (`check_batch`): the step it is for, a version it has published,
versions that never go backwards, a staleness within the bound; the worker refuses published versions that go
backwards. A batch that fails a check, or a worker that raises or dies, ends the run with one line naming it
(`SamplerFailed`; `experiments.run.life` writes the summary with status failed). Every wait of either process on
the other (for the lock, for a publication, for a batch) wakes every `POLL_S` to check that the other still lives, so
a worker killed in any window (sampling, waiting at the bound, loading a version under the lock, between batches)
ends the run within a second or so, its signal named. The trainer stops the worker when the run ends, however it
ends (`close`); a worker whose trainer is gone (killed) exits at its next wait or batch.

The three policies. μ_old is the worker's engine: the hf engine with its own copy of the weights and the run's engine
numerics (`rollout.precision`, ...). π_old is recomputed by the trainer at θ_old (the plan says decoupled:
`plan.plan_step`), so the ratio's denominator is never the stale engine's unless `trainer.pi_old=bypass` asks for
it; R3 replays the routes the worker recorded, which travel with the batch. The prompts come from the worker's own
generator, seeded per batch from (seed, step) as the synchronous loop seeds each step's, so batch t asks the
synchronous step t's prompts. Which version samples a batch depends on the two processes' timing, so a run is not
bit-reproducible: the exact lag (`rollout.lag`) is what experiments use.

The worker is a fresh interpreter (multiprocessing's spawn: no thread, lock or signal handler of the trainer's comes
with it) that builds the run's model and loads the published weights into it. Its torch ops run on one thread; the
trainer's thread budget (`experiments.run.threads`) counts the worker's load as another process's, so on two cores
each side has one.
"""

from __future__ import annotations

import itertools
import multiprocessing
import pickle
import queue
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any, cast

import torch

from experiments.step import metrics as m
from experiments.step.batch import Rollout, Served, collect_rollout, draw_examples, step_seed
from experiments.step.engines import EngineNumerics, HFEngine, KVCache, Sampling, full_weights
from experiments.tasks import build_task
from models.policy import ModelConfig, build_policy
from models.registry import RunFailed, node_settings

POLL_S = 0.5  # how often a process blocked on the other checks that the other still lives
CLOSE_S = 10.0  # how long a stopped worker may take to exit before it is killed


class SamplerFailed(RunFailed):
    """The concurrent sampler cannot serve the run: its worker raised or died, or a batch failed the trainer's checks.
    The run ends in one line, with status failed (`experiments.run.life`)."""


@dataclass(frozen=True)
class WorkerSettings:
    """What the worker builds its sampler from (pickled into the new interpreter)."""

    model: ModelConfig
    dataset: dict[str, Any]  # the task's settings (`build_task`)
    device: str
    seed: int
    prompts: int  # per batch: trainer.prompts_per_step
    sampling: Sampling
    numerics: EngineNumerics
    kv_cache: KVCache
    min_new_tokens: int  # the engine's ban of eos before this many tokens (the benchmarks' fixed-length steps)
    max_staleness: int
    first: int  # the step of the worker's first batch


@dataclass(frozen=True)
class Shared:
    """What the trainer and the worker share: the newest published weights, in shared memory, and their version; the
    lock that guards both, and the semaphore the trainer releases at each publication to wake a waiting worker."""

    weights: dict[str, torch.Tensor]
    version: Any  # multiprocessing.Value("q")
    lock: Any  # multiprocessing.Lock
    published: Any  # multiprocessing.Semaphore: released once per publication; the trainer never waits on it

    def announce(self, version: int, weights: Mapping[str, torch.Tensor], alive: Callable[[], bool]) -> bool:
        """Write `weights` as `version` under the lock, then wake the worker; False, writing nothing, when the worker
        died holding the lock (`alive`: whether it lives)."""
        if not acquire(self.lock, alive):
            return False
        try:
            for name, tensor in weights.items():
                self.weights[name].copy_(tensor)
            self.version.value = version
        finally:
            self.lock.release()
        self.published.release()
        return True


@dataclass(frozen=True)
class Batch:
    """One step's rollouts as the worker sends them, every row stamped with the version that sampled it."""

    step: int
    rollout: Rollout
    versions: torch.Tensor  # [N]
    sample_s: float  # the seconds the worker spent sampling it
    wait_s: float  # and waiting at the bound before it


def acquire(lock: Any, alive: Callable[[], bool]) -> bool:
    """Acquire `lock`, checking every `POLL_S` that the other process still lives (one killed while it held the lock
    never releases it); False when it does not."""
    while not lock.acquire(timeout=POLL_S):
        if not alive():
            return False
    return True


def check_batch(batch: Batch, step: int, previous: int | None, bound: int) -> None:
    """Refuse, naming what is wrong, a batch that `step` must not train on: another step's, stamped with a version the
    trainer has not published or with one older than the batch before it (`previous`: its version), or holding a row
    more than `bound` versions behind θ_old (version step − 1)."""
    oldest, newest = int(batch.versions.min()), int(batch.versions.max())
    if batch.step != step:
        raise SamplerFailed(f"the concurrent sampler sent step {batch.step}'s rollouts when step {step} needed its own")
    if newest > step - 1:
        raise SamplerFailed(
            f"step {step}'s rollouts are stamped with weight version {newest}, which the trainer has "
            f"not published: θ_old is version {step - 1}"
        )
    if previous is not None and oldest < previous:
        raise SamplerFailed(
            f"the weight version went backwards: step {step}'s rollouts were sampled with version "
            f"{oldest}, after the step before's with version {previous}"
        )
    if step - 1 - oldest > bound:
        stale = int((step - 1 - batch.versions > bound).sum())
        raise SamplerFailed(
            f"{stale} sample(s) older than rollout.max_staleness={bound} slipped through: step {step} "
            f"trains from version {step - 1}, and they were sampled with version {oldest}, "
            f"{step - 1 - oldest} versions behind"
        )


# -- the worker process --------------------------------------------------------------------------------------------


class Outbox:
    """The worker's end of its pipe to the trainer. A thread of its own writes each message, so that the worker samples
    on while a batch waits for the trainer to read it (a pipe holds 64 KiB; a batch is more). The trainer holds no
    write end, so a worker killed in the middle of a message leaves the pipe at its end, not a read that never ends."""

    def __init__(self, connection: Any) -> None:
        self.connection = connection
        self.messages: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._send, name="outbox", daemon=True)
        self.thread.start()

    def put(self, kind: str, payload: Any) -> None:
        """Queue ("batch", `Batch`) or ("failed", one line)."""
        self.messages.put(pickle.dumps((kind, payload)))

    def flush(self) -> None:
        """Send what is queued, then stop."""
        self.messages.put(None)
        self.thread.join()

    def _send(self) -> None:
        while (message := self.messages.get()) is not None:
            try:
                self.connection.send_bytes(message)
            except OSError:  # the trainer is gone: nobody reads
                return


class Sampler:
    """The worker's side: the engine with its own weights, the task, and the gate of the bound. `alive` says whether
    the trainer still lives."""

    def __init__(self, settings: WorkerSettings, shared: Shared, alive: Callable[[], bool]) -> None:
        self.settings, self.shared, self.alive = settings, shared, alive
        model, tokenizer = build_policy(settings.model)
        # functools.wraps hides from mypy that PreTrainedModel.to is a method (typeshed's _Wrapped binds no self).
        model.to(settings.device).eval()  # type: ignore[arg-type]
        # Without numbers of its own the engine samples with the worker's module (its "trainer's weights"), into
        # which each version loads; with them it keeps its own copy, cast and quantized again at each load.
        self.engine = HFEngine(
            model,
            tokenizer,
            settings.min_new_tokens,
            seed=settings.seed,
            kv_cache=settings.kv_cache,
            numerics=settings.numerics if settings.numerics.differs else None,
        )
        self.task = build_task(**settings.dataset)
        self.examples = self.task.examples("train")
        self.generator = torch.Generator()
        self.held: int | None = None  # the version the engine holds

    def take_weights(self, oldest: int) -> float | None:
        """Wait until version `oldest` is published (the bound), then hold the newest version published; the seconds
        waited, or None when the trainer is gone."""
        start = time.perf_counter()
        shared = self.shared
        while True:
            if not acquire(shared.lock, self.alive):
                return None
            try:
                newest = shared.version.value
                if self.held is not None and newest < self.held:
                    raise SamplerFailed(
                        f"weight version {newest} was published after version {self.held}: versions only grow"
                    )
                if newest >= oldest:
                    waited = time.perf_counter() - start
                    if newest != self.held:
                        self.load(shared.weights)
                        self.held = newest
                    return waited
            finally:
                shared.lock.release()
            if not self.wait_for_publication():
                return None

    def wait_for_publication(self) -> bool:
        """Sleep until the trainer publishes or `POLL_S` passes (a publication since the last look left the semaphore
        released, so none is missed; an older one only wakes the worker to look again); False when the trainer is
        gone."""
        self.shared.published.acquire(timeout=POLL_S)
        return self.alive()

    def load(self, weights: Mapping[str, torch.Tensor]) -> None:
        """The engine takes `weights` (a full state dict of the run's model)."""
        if self.engine.shares_trainer_weights:
            self.engine.model.load_state_dict(weights)
        else:
            self.engine.sync_weights(weights)

    def sample(self, step: int, waited: float) -> Batch:
        """Step `step`'s rollouts, with the version held: the prompts and the sampling seeded from (seed, step) as the
        synchronous loop seeds step `step` (one rank)."""
        seed = step_seed(self.settings.seed, step, 0)
        torch.manual_seed(seed)
        self.generator.manual_seed(seed)
        self.engine.reseed(seed)
        examples = draw_examples(self.examples, self.settings.prompts, self.generator)
        start = time.perf_counter()
        rollout = collect_rollout(self.engine, self.task, examples, self.settings.sampling)
        held = cast(int, self.held)  # `take_weights` held a version before any batch is sampled
        return Batch(step, rollout, torch.full((rollout.size,), held), time.perf_counter() - start, waited)


def parent_alive() -> bool:
    """Whether the trainer that started this worker process still lives."""
    parent = cast(BaseProcess, multiprocessing.parent_process())  # asked in the worker, which the trainer started
    return parent.is_alive()


def one_line(error: BaseException) -> str:
    """An error of the worker in one line: a `SamplerFailed`'s message; else its type, message and where it was
    raised."""
    if isinstance(error, SamplerFailed):
        return str(error)
    where = traceback.extract_tb(error.__traceback__)[-1]
    return f"{type(error).__name__}: {' '.join(str(error).split())} ({Path(where.filename).name}:{where.lineno})"


def serve(settings: WorkerSettings, shared: Shared, connection: Any) -> None:
    """The worker process: sample one batch after the other, each once the bound allows, until the trainer stops it or
    is gone. An error is sent to the trainer as one line, and ends the worker."""
    torch.set_num_threads(1)
    outbox = Outbox(connection)
    step = settings.first
    try:
        sampler = Sampler(settings, shared, parent_alive)
        for step in itertools.count(settings.first):
            waited = sampler.take_weights(step - 1 - settings.max_staleness)
            if waited is None:
                return
            batch = sampler.sample(step, waited)
            if not parent_alive():
                return
            outbox.put("batch", batch)
    except Exception as error:
        outbox.put("failed", f"while sampling step {step}'s rollouts: {one_line(error)}")
        outbox.flush()
        sys.exit(1)


# -- the trainer's side --------------------------------------------------------------------------------------------


class ConcurrentRollouts:
    """Where each step's rollout comes from under `rollout.concurrent`: the worker process (module docstring). The
    worker starts at the first `take`, holding the trainer's weights then (a resumed run's: its checkpoint's), and
    `close` stops it; a `take` after that starts another."""

    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer
        self.bound = trainer.cfg.rollout.max_staleness
        self.process: Any = None
        self.shared: Shared | None = None
        self.inbox: Any = None  # the trainer's end of the worker's pipe
        self.previous: int | None = None  # the version the last batch taken was sampled with

    def take(self, step: int) -> Served:
        """Step `step`'s rollouts from the worker, once it has sent them; checked (`check_batch`) and measured."""
        if self.process is None:
            self._start(step)
        batch = self._receive(step)
        check_batch(batch, step, self.previous, self.bound)
        self.previous = int(batch.versions.max())
        staleness = (step - 1 - batch.versions).float()
        return Served(
            batch.rollout,
            batch.versions,
            batch.sample_s,
            {
                m.ENGINE_VERSION: int(batch.versions.min()),
                m.STALENESS_MEAN: float(staleness.mean()),
                m.STALENESS_MAX: int(staleness.max()),
                m.SAMPLER_WAIT_TIME: batch.wait_s,
                m.SAMPLE_TIME: batch.sample_s,
            },
        )

    def publish(self, step: int) -> None:
        """Publish the trainer's weights after `step` as version `step`, and wake the worker (nothing without one: the
        next `take` starts one with the weights then)."""
        if self.process is None:
            return
        shared = cast(Shared, self.shared)  # made with the process, in `_start`
        if not shared.announce(step, full_weights(self.trainer.model), self.process.is_alive):
            raise SamplerFailed(self._death(f"while step {step} published its weights"))

    def close(self) -> None:
        """Stop the worker; the batches it sampled and no step took are dropped."""
        process, self.process = self.process, None
        if process is not None and process.pid is not None:
            process.terminate()  # SIGTERM: the worker holds nothing that must outlive it
            process.join(CLOSE_S)
            if process.is_alive():
                process.kill()
                process.join()
        if self.inbox is not None:
            self.inbox.close()
        self.shared = self.inbox = None

    def describe(self) -> dict[str, Any]:
        """What `summary.json` says of the rollouts and their engine."""
        return {
            "rollouts": "concurrent: a worker process samples while the trainer updates, at most rollout.max_staleness="
            f"{self.bound} version(s) behind θ_old, and waits at that bound; not bit-reproducible (which "
            "version samples a batch depends on the two processes' timing): experiments use rollout.lag",
            "engine": HFEngine.name,
            "engine_numerics": f"the worker's own copy: {EngineNumerics.of(self.trainer.cfg.rollout)}",
            "engine_details": {},
        }

    def _start(self, step: int) -> None:
        """Start the worker for the batches of `step` on, holding the trainer's weights now (version step − 1)."""
        trainer, cfg = self.trainer, self.trainer.cfg
        context = multiprocessing.get_context("spawn")
        weights = {
            name: tensor.detach().to("cpu", copy=True).share_memory_()
            for name, tensor in full_weights(trainer.model).items()
        }
        self.shared = Shared(weights, context.Value("q", step - 1, lock=False), context.Lock(), context.Semaphore(0))
        settings = WorkerSettings(
            model=ModelConfig(**node_settings(cfg.model)),
            dataset=node_settings(cfg.dataset),
            device=cfg.device,
            seed=cfg.seed,
            prompts=cfg.trainer.prompts_per_step,
            sampling=trainer.sampling(),
            numerics=EngineNumerics.of(cfg.rollout),
            kv_cache=KVCache(cfg.rollout.kv_cache),
            min_new_tokens=trainer.engine.min_new_tokens,  # the trainer's engine says how the run samples
            max_staleness=self.bound,
            first=step,
        )
        self.inbox, writer = context.Pipe(duplex=False)
        self.process = context.Process(
            target=serve, args=(settings, self.shared, writer), name="concurrent-sampler", daemon=True
        )
        # Ctrl-C in a terminal reaches the whole process group: the worker starts with SIGINT blocked (a new process
        # inherits the mask), from its first instruction on, so that the trainer alone handles it and stops the worker.
        unblocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
        try:
            self.process.start()
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, unblocked)
        writer.close()  # the worker holds the only write end: its death ends the pipe

    def _receive(self, step: int) -> Batch:
        """The worker's next batch, as step `step` waits for it, checking every `POLL_S` that the worker lives: its
        death ends the pipe it alone writes, and the liveness check does not rest on that alone."""
        died = f"while step {step} waited for its rollouts"
        while not self.inbox.poll(POLL_S):  # a dead worker's pipe polls ready: at its end
            if not self.process.is_alive():
                raise SamplerFailed(self._death(died))
        try:
            kind, payload = pickle.loads(self.inbox.recv_bytes())  # this run's own worker's bytes
        except (EOFError, OSError):  # the pipe ended, or ended inside a message: the worker died
            raise SamplerFailed(self._death(died)) from None
        if kind == "failed":
            raise SamplerFailed(f"the concurrent sampler's worker failed {payload}")
        return payload

    def _death(self, when: str) -> str:
        """How the worker ended, in a clause."""
        self.process.join(CLOSE_S)
        code = self.process.exitcode
        how = (
            f"was killed by {signal.Signals(-code).name}"
            if code is not None and code < 0
            else f"exited with code {code}"
            if code is not None
            else "stopped answering"
        )
        return f"the concurrent sampler's worker (pid {self.process.pid}) {how} {when}"
