"""The Ray transport's weights by broadcast (`rollout.ray.weights=broadcast`): a `torch.distributed` group of the
trainer (rank 0) and its actors (ranks 1..n), through which the trainer sends each version to every actor as it
publishes it, instead of putting it into Ray's object store. The group is gloo's, on the CPU tensors the trainer
publishes; its rendezvous is a `TCPStore` the trainer hosts on its node's address, so it spans hosts as the actors do.

    trainer  WeightSender.send(version, weights, floor)   header [version, floor], then each tensor in name order
    actor    WeightReceiver (a thread)                     receives every version into tensors of its own
    actor    WeightReceiver.weights(version)               the version a call was handed, once it has arrived

Which versions an actor keeps. A call is handed the newest version when it is handed out, and the actor may receive
newer ones before the call reads it, so the actor must keep the version its call names, not merely the newest. The
trainer's header says the oldest version a call in flight, or a call to come, may still read (`floor`: the version of
the oldest call in flight, else the one just sent), and the actor drops every version below it: it holds the versions
from that floor on, about the bound's worth.

How it fails. A receiver whose group fails (the trainer gone) records why, and a call waiting for a version raises it
as one line; a call whose version has not arrived within `ARRIVAL_S` raises as well. The trainer's send to an actor
that died fails in the group (gloo reports the closed connection), or after `GROUP_TIMEOUT_S`, and ends the run in one
line (`SamplerFailed`). The trainer's rendezvous blocks in C++ until every actor has joined, so it waits in a thread of
its own while the trainer polls, every `POLL_S`, whether an actor died while starting and the run's signals: a stop or
a dead actor ends the wait at once, not at the group's timeout.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from datetime import timedelta

import torch
import torch.distributed as dist

from experiments.step.sources.workers import POLL_S, SamplerFailed, one_line
from experiments.step.versions import Weights

GROUP_TIMEOUT_S = 60.0  # how long a rendezvous or a send may wait for a peer before the group fails
ARRIVAL_S = 120.0  # how long a call waits for the version it was handed to arrive

Layout = list[tuple[str, tuple[int, ...], torch.dtype]]  # every published tensor's name, shape and dtype


def layout_of(weights: Mapping[str, torch.Tensor]) -> Layout:
    """The names, shapes and dtypes of `weights`, in the order they are sent."""
    return [(name, tuple(weights[name].shape), weights[name].dtype) for name in sorted(weights)]


def broadcast(group: dist.ProcessGroupGloo, tensor: torch.Tensor) -> None:
    """`tensor` from rank 0 to every rank of `group`, in place."""
    options = dist.BroadcastOptions()
    options.rootRank = 0
    group.broadcast([tensor], options).wait()  # type: ignore[attr-defined]  # a Backend's, which torch's stubs omit


def join(host: str, port: int, rank: int, size: int) -> tuple[dist.TCPStore, dist.ProcessGroupGloo]:
    """This process's rank `rank` of the `size`-rank gloo group whose rendezvous is the trainer's store at
    `host:port`: the store (which must outlive the group) and the group. Blocks until every rank has joined,
    `GROUP_TIMEOUT_S` at most."""
    timeout = timedelta(seconds=GROUP_TIMEOUT_S)
    store = dist.TCPStore(host, port, size, is_master=False, timeout=timeout, wait_for_workers=False)
    return store, dist.ProcessGroupGloo(store, rank, size, timeout)


class WeightSender:
    """The trainer's end: it hosts the group's store, joins once the actors are started (`connect`), and sends each
    version to every actor (`send`)."""

    def __init__(self, host: str, receivers: int) -> None:
        self.host, self.size = host, receivers + 1
        self.store: dist.TCPStore = dist.TCPStore(
            host, 0, self.size, is_master=True, timeout=timedelta(seconds=GROUP_TIMEOUT_S), wait_for_workers=False
        )
        self.group: dist.ProcessGroupGloo | None = None

    @property
    def address(self) -> tuple[str, int]:
        """Where the actors find the group's store."""
        return self.host, self.store.port

    def connect(self, died: Callable[[], str | None]) -> None:
        """Join the group, once every actor is joining it too. The rendezvous blocks in C++, where no signal is
        handled, so it runs in a thread while this one polls `died` (why an actor died while starting, or None) every
        `POLL_S`: a dead actor, or a rendezvous that fails, raises `SamplerFailed` then, and the run's stop is raised
        here as it arrives."""
        joined: list[dist.ProcessGroupGloo | RuntimeError] = []  # the group, or why the rendezvous failed

        def rendezvous() -> None:
            try:
                joined.append(dist.ProcessGroupGloo(self.store, 0, self.size, timedelta(seconds=GROUP_TIMEOUT_S)))
            except RuntimeError as error:
                joined.append(error)

        waiting = threading.Thread(target=rendezvous, name="weights-rendezvous", daemon=True)
        waiting.start()
        while waiting.is_alive():
            waiting.join(POLL_S)
            why = None if joined else died()
            if why is not None:
                raise SamplerFailed(f"the weights' broadcast group at {self.host}:{self.store.port} never met: {why}")
        if isinstance(joined[0], RuntimeError):
            raise SamplerFailed(
                f"the Ray workers did not join the weights' broadcast group at {self.host}:{self.store.port} within "
                f"{GROUP_TIMEOUT_S:g} s: {one_line(joined[0])}"
            )
        self.group = joined[0]

    def send(self, version: int, weights: Weights, floor: int) -> None:
        """Send `weights` as `version` to every actor, telling them to keep no version below `floor`; a group that
        fails (an actor gone) raises `SamplerFailed`."""
        assert self.group is not None  # joined in `connect`
        try:
            broadcast(self.group, torch.tensor([version, floor], dtype=torch.int64))
            for name in sorted(weights):
                broadcast(self.group, weights[name].detach().to("cpu").contiguous())
        except RuntimeError as error:
            raise SamplerFailed(
                f"the broadcast of weight version {version} to the Ray workers failed: {one_line(error)}"
            ) from None


class WeightReceiver:
    """An actor's end: it joins the group as rank `rank`, then a thread of its own receives every version the
    trainer sends into tensors of its own (module docstring: which it keeps)."""

    def __init__(self, address: tuple[str, int], rank: int, size: int, layout: Layout) -> None:
        self.store, self.group = join(*address, rank, size)
        self.layout = layout
        self.received: dict[int, dict[str, torch.Tensor]] = {}
        self.failed: str | None = None  # why the group failed, once it has
        self.arrived = threading.Condition()
        threading.Thread(target=self._receive, name="weights", daemon=True).start()

    def _receive(self) -> None:
        try:
            while True:
                header = torch.zeros(2, dtype=torch.int64)
                broadcast(self.group, header)
                version, floor = header.tolist()
                weights = {name: torch.empty(shape, dtype=dtype) for name, shape, dtype in self.layout}
                for tensor in weights.values():
                    broadcast(self.group, tensor)
                with self.arrived:
                    self.received = {v: held for v, held in self.received.items() if v >= floor}
                    self.received[version] = weights
                    self.arrived.notify_all()
        except RuntimeError as error:  # the trainer closed the group, or is gone
            with self.arrived:
                self.failed = one_line(error)
                self.arrived.notify_all()

    def weights(self, version: int) -> dict[str, torch.Tensor]:
        """Version `version`, once it has arrived; `SamplerFailed` where it cannot."""
        with self.arrived:
            self.arrived.wait_for(lambda: version in self.received or self.failed is not None, ARRIVAL_S)
            if version in self.received:
                return self.received[version]
            why = f"the group failed: {self.failed}" if self.failed else f"it did not arrive within {ARRIVAL_S:g} s"
            raise SamplerFailed(f"weight version {version} never reached this Ray worker by broadcast: {why}")
