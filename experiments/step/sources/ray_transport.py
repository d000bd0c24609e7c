"""The concurrent source on Ray (`rollout.source=concurrent rollout.transport=ray`): its workers are Ray actors, on
this machine or a cluster's, each holding the run's engine on a model of its own (`WorkerEngine`, as the local
transport's worker process), and the trainer publishes its weights by version into Ray's object store.

Versions. After step t the trainer puts its weights into the object store once, as version t (`ray.put`), and keeps
the reference to the newest alone, so that an older version's object is freed once no batch in flight reads it. Each
call to an actor carries the newest version and its reference; the actor reads the object (`ray.get`) only when it
holds another version, loads it, and stamps every row of the batch with it. A version published below the newest is
refused by the trainer in one line (the actor refuses one as well: `WorkerEngine.hold`).

The bound and the overflow policy across workers. The trainer is the one gate: it hands batch b to an idle actor only
once the policy lets b start (`OverflowPolicy.may_start`, on the versions it published and the batches it took, as
the local worker reads them from shared memory), and hands the batches out in order, one in flight per actor, so the
versions of successive batches never go backwards whichever actor samples them. The checks a batch meets when a step
takes it, and what the policy says past the bound, are the local transport's (`ConcurrentSource.take`). It hands
batches out whenever it runs: while a step waits for its batch, at each take and at each publication, so an actor
whose next batch the gate holds starts it when the trainer publishes or takes one, as the local worker wakes then.

Disjoint rows. Batch b is seeded from (seed, b), whichever actor samples it (`WorkerEngine.sample`): its prompts are
the synchronous step b's, and no two batches, on one actor or two, share a seed.

How it ends. A worker that raises, an actor that dies (killed, its node lost) and a version that goes backwards end
the run in one line naming it (`SamplerFailed`: status failed, the log whole). `close` kills every actor, however the
run ends (SIGTERM and Ctrl-C included), and disconnects; a Ray instance the run started itself (`rollout.ray.address`
null) stops with it. Ray's `init` would replace the trainer's SIGTERM handler with its own, which exits without the
run's summary: the trainer's is put back (`connect`).
"""

from __future__ import annotations

import logging
import signal
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import ray
import torch
from ray.exceptions import RayActorError, RayTaskError

from experiments.ranks import Ranks
from experiments.step.sources.base import SamplingRun, SourceInputs
from experiments.step.sources.broadcast import Layout, WeightReceiver, WeightSender, layout_of
from experiments.step.sources.overflow import OVERFLOW_POLICIES, OverflowPolicy
from experiments.step.sources.workers import POLL_S, Batch, Concurrent, SamplerFailed, WorkerEngine, one_line
from experiments.step.versions import Weights
from models.registry import ConfigError

CONNECT_S = 10.0  # how long an address may take to answer before the run is refused


class Call(NamedTuple):
    """A batch in flight: the actor sampling it, the batch's index and the version it was handed."""

    actor: int
    batch: int
    version: int


@dataclass(frozen=True)
class GroupSeat:
    """An actor's seat in the weights' broadcast group (`rollout.ray.weights=broadcast`): where its store is, the
    actor's rank and the group's size, and what each version holds."""

    address: tuple[str, int]
    rank: int
    size: int
    layout: Layout


class RolloutActor:
    """One Ray worker: the run's engine on a model of its own (`WorkerEngine`), built when the actor starts, and under
    `rollout.ray.weights=broadcast` its end of the weights' group (`seat`)."""

    def __init__(self, run: SamplingRun, seat: GroupSeat | None) -> None:
        torch.set_num_threads(1)  # as the local worker: Ray reserves `rollout.ray.worker_cpus` for it, one by default
        self.worker = WorkerEngine(run)
        self.receiver = None if seat is None else WeightReceiver(seat.address, seat.rank, seat.size, seat.layout)
        self.idle_since = time.perf_counter()

    def sample(self, batch: int, version: int, weights: list[ray.ObjectRef[Weights]]) -> Batch:
        """Batch `batch` with version `version`: from the object store (its object's reference in a list, so that
        Ray hands the reference, not the weights: the actor reads them only when it holds another version), or as
        its receiver got it by broadcast (`weights` empty). An error is raised as one line."""
        waited = time.perf_counter() - self.idle_since
        receiver = self.receiver
        try:
            self.worker.hold(version, lambda: ray.get(weights[0]) if receiver is None else receiver.weights(version))
            return self.worker.sample(batch, waited)
        except Exception as error:
            raise SamplerFailed(one_line(error)) from None
        finally:
            self.idle_since = time.perf_counter()


def answers(address: str) -> str | None:
    """Why the Ray head at `address` (host:port) does not answer, or None when it takes a connection."""
    host, _, port = address.rpartition(":")
    try:
        socket.create_connection((host, int(port)), timeout=CONNECT_S).close()
    except OSError as error:
        return str(error) or type(error).__name__
    return None


def death(error: RayActorError) -> str:
    """Why Ray says an actor died: the first sentence of its report, on one line."""
    return " ".join(str(error).split()).split(". ")[0]


def died_while_starting(started: list[ray.ObjectRef[None]]) -> str | None:
    """Why an actor died before it was ready, from `started` (each actor's `__ray_ready__`, in the actors' order), or
    None while every one lives."""
    finished, _ = ray.wait(started, num_returns=len(started), timeout=0)
    for reference in finished:
        try:
            ray.get(reference)
        except RayActorError as error:
            return f"Ray worker {started.index(reference)} died while starting: {death(error)}"
    return None


def connect(address: str | None) -> None:
    """Connect this process to the Ray cluster at `address`, or start a Ray instance of its own on this machine (None),
    keeping the trainer's SIGTERM handler; refuse, in one line, an address that does not answer."""
    if ray.is_initialized():
        raise ConfigError(
            "this process is already connected to Ray (ray.init was called before the run): rollout.transport=ray "
            "connects to rollout.ray.address itself"
        )
    if address is not None and (why := answers(address)) is not None:
        raise ConfigError(
            f"rollout.ray.address={address} does not answer ({why}): start a Ray head there (`ray start --head`), "
            "or leave rollout.ray.address null to start Ray on this machine"
        )
    handler = signal.getsignal(signal.SIGTERM)
    try:
        # "local": a new instance even where RAY_ADDRESS names another (which a null address would silently follow).
        # The actors' output stays in the Ray session's logs: their errors reach the trainer as exceptions.
        ray.init(
            address=address or "local", include_dashboard=False, log_to_driver=False, logging_level=logging.WARNING
        )
    except (ConnectionError, RuntimeError) as error:  # Ray's, multi-line: its last line says why
        if address is None:
            raise
        why = [line.strip() for line in str(error).splitlines() if line.strip()][-1]
        raise ConfigError(
            f"rollout.ray.address={address} answers, and Ray could not connect to it: {why} (a cluster with token "
            "authentication: RAY_AUTH_MODE=token and its token here, docs/async.md)"
        ) from None
    finally:
        signal.signal(signal.SIGTERM, handler)


class RaySource(Concurrent):
    """The concurrent source with Ray actors as its workers (module docstring). It connects when built, so that an
    address that does not answer or a cluster too small is refused before the first step; the actors start at the
    first `take`, holding the trainer's weights then, and `close` kills them."""

    @classmethod
    def build(cls, rollout: Any, given: SourceInputs) -> RaySource:
        overflow = OVERFLOW_POLICIES[rollout.overflow]()
        return cls(given.run, rollout.max_staleness, overflow, given.weights, given.ranks, rollout.ray)

    def __init__(
        self,
        run: SamplingRun,
        bound: int,
        overflow: OverflowPolicy,
        weights: Callable[[], Weights],
        ranks: Ranks,
        settings: Any,  # rollout.ray
    ) -> None:
        super().__init__(run, bound, overflow, weights, ranks)
        self.address: str | None = settings.address
        self.workers, self.worker_cpus = int(settings.workers), float(settings.worker_cpus)
        self.by_broadcast = settings.weights == "broadcast"  # each version sent to every actor, not put in the store
        self.sender: WeightSender | None = None  # under broadcast, the trainer's end of the group, from `_start`
        self.actors: list[Any] = []
        self.idle: list[int] = []  # the actors with no batch in flight
        self.calls: dict[ray.ObjectRef[Batch], Call] = {}  # the batches in flight, by the reference to their rows
        self.done: dict[int, Batch] = {}  # batches sampled and not yet taken, by index
        self.newest: tuple[int, list[ray.ObjectRef[Weights]]] | None = (
            None  # the newest version published, and its object
        )
        self.handed = 0  # the index of the next batch to hand out
        self.taken = 0  # the index of the last batch a step took
        self.version_bytes = 0  # what one version puts into the object store: the weights' bytes
        self.on_main(self._connect)  # rank 0 alone drives the actors; every rank is refused with it

    def _connect(self) -> None:
        connect(self.address)
        cpus = ray.cluster_resources().get("CPU", 0.0)
        if self.workers * self.worker_cpus > cpus:
            where = f"at {self.address}" if self.address else "this run started on this machine"
            self._close()
            raise ConfigError(
                f"rollout.ray.workers={self.workers} x rollout.ray.worker_cpus={self.worker_cpus} needs "
                f"{self.workers * self.worker_cpus:g} CPUs, and the Ray cluster {where} has {cpus:g}"
            )

    def _start(self, step: int, weights: Weights) -> None:
        """Start the actors for the batches of `step` on, with `weights`, the trainer's now (version step − 1)."""
        if not ray.is_initialized():  # a `take` after `close`
            self._connect()
        actor = ray.remote(RolloutActor).options(num_cpus=self.worker_cpus, max_restarts=0)
        if self.by_broadcast:
            self.sender = WeightSender(ray.util.get_node_ip_address(), self.workers)
            seats = [
                GroupSeat(self.sender.address, rank, self.workers + 1, layout_of(weights))
                for rank in range(1, self.workers + 1)
            ]
            self.actors = [actor.remote(self.run, seat) for seat in seats]
            started = [each.__ray_ready__.remote() for each in self.actors]  # resolved once each has joined
            self.sender.connect(lambda: died_while_starting(started))
        else:
            self.actors = [actor.remote(self.run, None) for _ in range(self.workers)]
        self.idle = list(range(self.workers))
        self.calls, self.done = {}, {}
        self._put(step - 1, weights)
        self.next_batch = self.handed = step
        self.taken = step - 1  # the batches before the first count as taken

    def _put(self, version: int, weights: Weights) -> None:
        """Hand `weights` on as `version`, the newest: put once into the object store, or sent to every actor (which
        keep the versions from the oldest a call in flight reads on: `experiments.step.sources.broadcast`)."""
        held = {name: tensor.detach().to("cpu") for name, tensor in weights.items()}
        self.version_bytes = sum(tensor.numel() * tensor.element_size() for tensor in held.values())
        if self.sender is None:
            self.newest = (version, [ray.put(held)])
            return
        self.sender.send(version, held, floor=min((call.version for call in self.calls.values()), default=version))
        self.newest = (version, [])

    def _hand_out(self) -> None:
        """Hand the next batches, in order, to idle actors, each once the policy lets it start."""
        assert self.newest is not None  # put in `_start`
        version, reference = self.newest
        while self.idle and self.overflow.may_start(self.handed, self.bound, version, self.taken):
            actor = self.idle.pop(0)
            call = self.actors[actor].sample.remote(self.handed, version, reference)
            self.calls[call] = Call(actor, self.handed, version)
            self.handed += 1

    def _receive(self, step: int) -> Batch:
        """Batch `next_batch`, as step `step` waits for it, handing out the next batches as actors come free."""
        while self.next_batch not in self.done:
            self._hand_out()
            ready, _ = ray.wait(list(self.calls), num_returns=1, timeout=POLL_S)  # awake for the run's signals
            for reference in ready:
                actor, index, _ = self.calls.pop(reference)
                try:
                    self.done[index] = ray.get(reference)
                except RayTaskError as error:
                    raise SamplerFailed(
                        f"the concurrent sampler's Ray worker {actor} failed while sampling batch {index}: "
                        f"{error.cause}"
                    ) from None
                except RayActorError as error:
                    raise SamplerFailed(
                        f"the concurrent sampler's Ray worker {actor} died while step {step} waited for its "
                        f"rollouts (batch {index}): {death(error)}"
                    ) from None
                self.idle.append(actor)
        return self.done.pop(self.next_batch)

    def _took(self, batch: int, step: int) -> None:
        self.taken = batch
        self._hand_out()  # under drop and count a take frees a room in the queue

    def _publish(self, version: int, weights: Weights) -> None:
        """Hand `weights` on as version `version` (`_put`), and hand out what the gate now lets start."""
        assert self.newest is not None  # put in `_start`
        if version <= self.newest[0]:
            raise SamplerFailed(
                f"weight version {version} was published after version {self.newest[0]}: versions only grow"
            )
        self._put(version, weights)
        self._hand_out()

    def _close(self) -> None:
        """Kill every actor (the batches in flight are dropped) and disconnect; a Ray instance the run started
        itself stops."""
        actors, self.actors = self.actors, []
        if ray.is_initialized():
            for actor in actors:
                ray.kill(actor, no_restart=True)
            ray.shutdown()
        self.sender = None  # the group's end, once no actor is left in it
        self.idle, self.calls, self.done, self.newest = [], {}, {}, None

    def sampler(self) -> str:
        where = f"the Ray cluster at {self.address}" if self.address else "a Ray instance on this machine"
        how = (
            "each version sent to every actor by a torch.distributed broadcast (rollout.ray.weights=broadcast)"
            if self.by_broadcast
            else "each version put once into Ray's object store"
        )
        return (
            f"{self.workers} Ray actor(s) on {where} sample (rollout.transport=ray; {how}: {self.version_bytes} bytes "
            "of weights)"
        )
