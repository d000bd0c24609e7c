"""How a process stops on SIGTERM or SIGINT: the one stop type (`StopRequested`) and the one way to let a block that a
stop must not cut run whole (`stop_deferred`), shared by the runs' life cycle (`experiments.run.life`, which adds the
ranks' joint stop) and the analysis commands that put their output in place (`analysis.cli.staged`).
"""

from __future__ import annotations

import signal
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, NoReturn


class StopRequested(BaseException):
    """The process was asked to stop (SIGTERM, or SIGINT / Ctrl-C). A BaseException, as KeyboardInterrupt: the
    `except Exception` of a library the signal lands in (W&B's logging, say) must not swallow it. `deferred`: it
    arrived while a block a stop must not cut ran, and is raised after that block ended whole (`stop_deferred`)."""

    def __init__(self, signum: int, deferred: bool = False) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum
        self.signal_name = signal.Signals(signum).name
        self.exit_code = 128 + signum
        self.deferred = deferred

    def later(self) -> StopRequested:
        """The same stop, raised after the block it waited for."""
        return StopRequested(self.signum, deferred=True)


class Deferral:
    """Whether a block a stop must not cut is running (see `stop_deferred`), whether the run's ranks stop together
    (see `stop_together`), the stop that arrived meanwhile, and whether the run is already stopping."""

    active = False
    joint = False
    pending: StopRequested | None = None
    stopping = False


def raise_stop(interrupted: StopRequested) -> NoReturn:
    """Raise the stop. Later signals change nothing while the run ends: a launcher that sees one rank end signals the
    others, which must still finish their summary."""
    Deferral.pending, Deferral.stopping = None, True
    raise interrupted


@contextmanager
def stop_signals() -> Iterator[None]:
    """Turn SIGTERM and SIGINT into `StopRequested` for the run inside; the previous handlers come back after."""

    def stop(signum: int, frame: Any) -> None:
        if Deferral.stopping:
            return
        if Deferral.active or Deferral.joint:  # raised after the block, or where the ranks decide together
            Deferral.pending = Deferral.pending or StopRequested(signum)
            return
        raise_stop(StopRequested(signum))

    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        Deferral.joint, Deferral.pending, Deferral.stopping = False, None, False


@contextmanager
def stop_deferred() -> Iterator[None]:
    """Run the block whole: a stop that arrives meanwhile is raised after it. A record's commit needs this (its log
    line written, then counted: never a line the summary does not count; then a checkpoint, whose writer,
    `torch.distributed.checkpoint`, catches whatever is raised inside it, `StopRequested` included, and raises its own
    `CheckpointException` instead), and so does the log's cut on resume. Blocking the signals on this thread is not
    enough: the kernel hands a process's signal to any thread that does not block it (W&B's, torch's), and Python
    then runs the handler on this thread at its next instruction, so the handler itself defers while a block is
    active. With several ranks the stop is left for `stop_together`."""
    Deferral.active = True
    try:
        yield
    finally:
        Deferral.active = False
    if Deferral.pending is not None and not Deferral.joint:
        raise_stop(Deferral.pending.later())
