"""A concurrent sampler's worker that kills itself in one chosen window: the target the kill tests of
tests/test_concurrent.py start in place of `experiments.step.sources.concurrent.serve`. The worker is a fresh
interpreter, so the trainer's monkeypatches never reach it: this module patches the worker's own `Sampler` there, then
serves as the real worker does until the window of its batch DIES_AT (step DIES_AT's, under the wait policy), where it
writes the time to `stamp` and sends itself the signal: at the window's start, or, waiting at the bound, from a thread
of its own while it sleeps in the wait (where a condition variable's waiter, killed, once hung the trainer forever). A
signal the worker sends itself lands in the window; one sent from outside would land wherever the worker happened to
be."""

from __future__ import annotations

import functools
import os
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from experiments.step.sources import concurrent

DIES_AT = 3  # the batch (and step) the worker dies on: two steps are logged before it
INSIDE_S = 0.05  # how long into a wait the worker dies while it sleeps there (the wait itself lasts up to POLL_S)
WINDOWS = ("sampling", "waiting at the bound", "loading a version", "between batches")


def serve_and_die(window: str, signum: int, stamp: Path, settings: Any, shared: Any, connection: Any) -> None:
    """`concurrent.serve`, with the worker sending itself `signum` in `window` (one of WINDOWS) of its batch DIES_AT
    (the first batch is step 1's)."""
    sampler = concurrent.Sampler
    oldest = DIES_AT - 1 - settings.bound  # the version batch DIES_AT waits for under the wait policy
    asked = {"batch": -1}  # the batch the worker waits to start now
    dying = threading.Event()  # the worker dies once: a second wait that starts before the first's signal lands
    # (the trainer's news wakes the wait at once) would start a second timer, which could truncate the stamp as the
    # first one's signal ends the process

    def die() -> None:
        stamp.write_text(repr(time.time()))
        os.kill(os.getpid(), signum)

    def die_when(method: Callable, now: Callable[..., bool], inside: bool = False) -> Callable:
        """`method`, dying as it starts when `now(*args)`; `inside`: once it runs (a thread of the worker's sends
        the signal while the method blocks)."""

        @functools.wraps(method)
        def wrapped(self, *args):
            if now(*args) and inside:
                if not dying.is_set():
                    dying.set()
                    threading.Timer(INSIDE_S, die).start()
            elif now(*args):
                die()
                time.sleep(60)  # a worker that blocked or handled the signal stays here: the test fails on time
            return method(self, *args)

        return wrapped

    def remember(method: Callable) -> Callable:
        @functools.wraps(method)
        def wrapped(self, batch):
            asked["batch"] = batch
            return method(self, batch)

        return wrapped

    if window == "sampling":
        sampler.sample = die_when(sampler.sample, lambda batch, waited: batch == DIES_AT)
    elif window == "waiting at the bound":
        sampler.take_weights = remember(sampler.take_weights)
        sampler.wait_for_trainer = die_when(sampler.wait_for_trainer, lambda: asked["batch"] == DIES_AT, inside=True)
    elif window == "loading a version":  # under the weights' lock
        sampler.load = die_when(sampler.load, lambda weights: shared.version.value >= oldest)
    elif window == "between batches":  # its last batch sent, the next not yet begun
        sampler.take_weights = die_when(sampler.take_weights, lambda batch: batch == DIES_AT)
    else:
        raise ValueError(f"window={window!r}: one of {WINDOWS}")
    concurrent.serve(settings, shared, connection)


def dying_worker(window: str, signum: signal.Signals, stamp: Path) -> functools.partial:
    """The target to start in place of `concurrent.serve` (picklable into the spawned interpreter)."""
    return functools.partial(serve_and_die, window, int(signum), stamp)
