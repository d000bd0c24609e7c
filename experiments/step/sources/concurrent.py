"""The concurrent source (`rollout.source=concurrent`, the throughput mode): a worker process samples the next steps'
rollouts while the trainer updates, with weights `rollout.max_staleness` = B versions behind θ_old at most, past which
`rollout.overflow` says what happens (`experiments.step.sources.overflow`: wait, drop or count). This module is its
local transport (`rollout.transport=local`, the default): one worker process and shared memory. What the transports
share (the settings' checks, the trainer's side of a step, the worker's engine) is `experiments.step.sources.workers`;
Ray actors as the workers are `experiments.step.sources.ray_transport`.

Versions. A version is the weights after one RL step (`experiments.step.versions`): step t trains from θ_old =
version t − 1. After each step the trainer publishes its weights as version t, into tensors in shared memory beside a
counter of the newest version (`ConcurrentSource.publish`); one lock guards both, so the worker never reads half a
version, and a semaphore released at each publication wakes a worker waiting for one. No wait of either process
depends on the other's answer: with a condition variable it would (multiprocessing's `notify_all` blocks until each
sleeping waiter acknowledges, and a killed one never does), while releasing a semaphore blocks on nothing. Before each
batch the worker takes the newest version published and samples the whole batch with it, so every token of a row
comes from one version, and stamps every row with it (`Served.versions`). A row's staleness is θ_old's version minus
its own, (t − 1) − v, logged per step as the mean and max over the step's rows (`async/staleness_mean`,
`async/staleness_max`; the rows of one batch share their version).

The bound. Before batch b the worker waits for what the overflow policy says (`OverflowPolicy.may_start`): under
`wait` (the default) for version b − 1 − B to be published, AReaL's gate at submission (`max_head_offpolicyness`), so
that no row is ever sampled past the bound; under `drop` and `count` for the trainer to have taken batch b − 1 − B (a
queue of B + 1 batches; the trainer counts the batches it takes in shared memory beside the version, and each take
wakes the worker as a publication does). Why wait is the default: each batch goes to one step, in order, so whether it
would be too old is known before it is sampled; waiting then never samples a row that no step trains (dropping spends
the worker's core on them) and never trains a row past the bound the run declares (counting turns the bound into a
report). Its price is a worker idling at the bound until the trainer publishes. At B = 0 under wait the worker waits
for every step's weights and the two processes take turns; at 1 it samples step t + 1's batch while step t trains
(one step of overlap, verl's one-step-off); the batches of at most B + 1 steps are held at once. Logged per step:
the worker's seconds waiting before the step's batches (`async/sampler_wait_s`), the batches dropped before it
(`async/dropped_batches`) and its rows trained past the bound (`async/past_bound_rows`); the trainer's own wait for
its batch is the step's `perf/rollout_s`.

Checks. The trainer checks every batch it takes (`check_batch`): the batch that comes next, a version it has
published, versions that never go backwards; then what the policy says of a batch past the bound (`verdict`: under
wait one is refused, as the gate should have held it). The worker refuses published versions that go backwards. A
batch that fails a check, or a worker that raises or dies, ends the run with one line naming it (`SamplerFailed`;
`experiments.run.life` writes the summary with status failed). Every wait of either process on the other (for the
lock, for the trainer, for a batch) wakes every `POLL_S` to check that the other still lives, so a worker killed in
any window (sampling, waiting at the bound, loading a version under the lock, between batches) ends the run within a
second or so, its signal named. The trainer stops the worker when the run ends, however it ends (`close`); a worker
whose trainer is gone (killed) exits at its next wait or batch.

The three policies. μ_old is the worker's engine: the run's engine (`EngineFactory`; the hf engine, checked) on the
worker's own model, with the run's engine numerics (`rollout.precision`, ...). π_old is recomputed by the trainer at
θ_old (the plan says decoupled: `engine_is_trainer` is False), so the ratio's denominator is never the stale engine's
unless `trainer.pi_old=bypass` asks for it; R3 replays the routes the worker recorded, which travel with the batch.
The prompts come from the worker's own generator, seeded per batch from (seed, b) as the synchronous loop seeds step
b's, so batch b asks the synchronous step b's prompts (under drop a later step may train it). Which version samples a
batch depends on the two processes' timing, so a run is not bit-reproducible: the exact lag (`rollout.source=lagged`)
is what experiments use.

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
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from experiments.ranks import Ranks
from experiments.step.sources.base import ROLLOUT_SOURCES, SamplingRun, SourceInputs
from experiments.step.sources.overflow import OVERFLOW_POLICIES, OverflowPolicy
from experiments.step.sources.workers import POLL_S, Batch, Concurrent, SamplerFailed, WorkerEngine, one_line
from experiments.step.versions import Weights

CLOSE_S = 10.0  # how long a stopped worker may take to exit before it is killed


@dataclass(frozen=True)
class WorkerSettings:
    """What the worker samples with (pickled into the new interpreter): the run, the bound and the policy past it."""

    run: SamplingRun
    bound: int  # rollout.max_staleness
    overflow: OverflowPolicy  # rollout.overflow
    first: int  # the index of the worker's first batch: the step the trainer takes it for


@dataclass(frozen=True)
class Shared:
    """What the trainer and the worker share: the newest published weights, in shared memory, and their version; the
    batches the trainer has taken; the lock that guards them, and the semaphore the trainer releases at each
    publication and take to wake a waiting worker."""

    weights: dict[str, torch.Tensor]
    version: Any  # multiprocessing.Value("q")
    taken: Any  # multiprocessing.Value("q"): the index of the last batch the trainer took
    lock: Any  # multiprocessing.Lock
    news: Any  # multiprocessing.Semaphore: released once per publication or take; the trainer never waits on it

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
        self.news.release()
        return True

    def took(self, batch: int, alive: Callable[[], bool]) -> bool:
        """Count batch `batch` taken under the lock, then wake the worker (a queue's room); False when the worker died
        holding the lock."""
        if not acquire(self.lock, alive):
            return False
        try:
            self.taken.value = batch
        finally:
            self.lock.release()
        self.news.release()
        return True


def acquire(lock: Any, alive: Callable[[], bool]) -> bool:
    """Acquire `lock`, checking every `POLL_S` that the other process still lives (one killed while it held the lock
    never releases it); False when it does not."""
    while not lock.acquire(timeout=POLL_S):
        if not alive():
            return False
    return True


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


class Sampler(WorkerEngine):
    """The local worker process's side: its engine (`WorkerEngine`), and the gate its policy sets on the versions and
    takes in shared memory. `alive` says whether the trainer still lives."""

    def __init__(self, settings: WorkerSettings, shared: Shared, alive: Callable[[], bool]) -> None:
        super().__init__(settings.run)
        self.settings, self.shared, self.alive = settings, shared, alive

    def take_weights(self, batch: int) -> float | None:
        """Wait until the policy lets batch `batch` start (`OverflowPolicy.may_start`), then hold the newest version
        published; the seconds waited, or None when the trainer is gone."""
        start = time.perf_counter()
        shared, settings = self.shared, self.settings
        while True:
            if not acquire(shared.lock, self.alive):
                return None
            try:
                newest = shared.version.value
                self.refuse_backwards(newest)
                if settings.overflow.may_start(batch, settings.bound, newest, shared.taken.value):
                    waited = time.perf_counter() - start
                    self.hold(newest, lambda: shared.weights)
                    return waited
            finally:
                shared.lock.release()
            if not self.wait_for_trainer():
                return None

    def wait_for_trainer(self) -> bool:
        """Sleep until the trainer publishes or takes a batch, or `POLL_S` passes (news since the last look left the
        semaphore released, so none is missed; older news only wakes the worker to look again); False when the trainer
        is gone."""
        self.shared.news.acquire(timeout=POLL_S)
        return self.alive()


def parent_alive() -> bool:
    """Whether the trainer that started this worker process still lives."""
    parent = multiprocessing.parent_process()
    assert parent is not None  # asked in the worker, which the trainer started
    return parent.is_alive()


def serve(settings: WorkerSettings, shared: Shared, connection: Any) -> None:
    """The worker process: sample one batch after the other, each once the policy allows, until the trainer stops it
    or is gone. An error is sent to the trainer as one line, and ends the worker."""
    torch.set_num_threads(1)
    outbox = Outbox(connection)
    batch = settings.first
    try:
        sampler = Sampler(settings, shared, parent_alive)
        for batch in itertools.count(settings.first):
            waited = sampler.take_weights(batch)
            if waited is None:
                return
            sampled = sampler.sample(batch, waited)
            if not parent_alive():
                return
            outbox.put("batch", sampled)
    except Exception as error:
        outbox.put("failed", f"while sampling batch {batch}: {one_line(error)}")
        outbox.flush()
        sys.exit(1)


# -- the trainer's side --------------------------------------------------------------------------------------------


@ROLLOUT_SOURCES.register("concurrent")
class ConcurrentSource(Concurrent):
    """The worker process samples each step's rollouts (module docstring). It starts at the first `take`, holding
    the trainer's weights then (a resumed run's: its checkpoint's), and `close` stops it; a `take` after that starts
    another."""

    @classmethod
    def build(cls, rollout: Any, given: SourceInputs) -> Concurrent:
        if rollout.transport == "ray":
            # local import: it imports Ray, which only a run on that transport needs installed (`check_ray`)
            from experiments.step.sources.ray_transport import RaySource

            return RaySource.build(rollout, given)
        overflow = OVERFLOW_POLICIES[rollout.overflow]()
        return cls(given.run, rollout.max_staleness, overflow, given.weights, given.ranks)

    def __init__(
        self, run: SamplingRun, bound: int, overflow: OverflowPolicy, weights: Callable[[], Weights], ranks: Ranks
    ) -> None:
        super().__init__(run, bound, overflow, weights, ranks)
        self.process: Any = None
        self.shared: Shared | None = None
        self.inbox: Any = None  # the trainer's end of the worker's pipe

    def _took(self, batch: int, step: int) -> None:
        """Count batch `batch` taken by step `step`: under drop and count a room in the worker's queue."""
        assert self.shared is not None  # made with the process, in `_start`
        if not self.shared.took(batch, self.process.is_alive):
            raise SamplerFailed(self._death(f"while step {step} took its rollouts"))

    def _publish(self, version: int, weights: Weights) -> None:
        """Write `weights` into shared memory as version `version`, and wake the worker."""
        assert self.shared is not None  # made with the process, in `_start`
        if not self.shared.announce(version, weights, self.process.is_alive):
            raise SamplerFailed(self._death(f"while step {version} published its weights"))

    def _close(self) -> None:
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

    def sampler(self) -> str:
        """What samples, as `describe`'s sentence says it."""
        return "a worker process samples"

    def _start(self, step: int, weights: Weights) -> None:
        """Start the worker for the batches of `step` on, holding `weights` (version step − 1) in shared memory."""
        context = multiprocessing.get_context("spawn")
        self.shared = Shared(
            {name: tensor.detach().to("cpu", copy=True).share_memory_() for name, tensor in weights.items()},
            context.Value("q", step - 1, lock=False),
            context.Value("q", step - 1, lock=False),  # the batches before the first count as taken
            context.Lock(),
            context.Semaphore(0),
        )
        settings = WorkerSettings(self.run, self.bound, self.overflow, first=step)
        self.next_batch = step
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
