"""How many CPU threads a run's torch ops use: `trainer.threads`, one by default; with `trainer.threads=null`, the
cores other processes leave free, measured again after every step.

A run's numbers depend on its thread count: a floating-point reduction split over another number of threads adds in
another order and may round differently (torch's `parallel_reduce` keeps one partial sum per thread; a BLAS library
may split a product's sums by thread too), and over a run's steps the last bits grow into other numbers. So the
default is one fixed count, the same on every machine: two runs of one seed, and a run killed and resumed, compute
the same bits whatever the machine's load and however many cores it has, given the same CPU, libraries and kernels
(`experiments.run.provenance`). Bitwise repeatable by default, because a run whose numbers follow the machine's load
can be neither repeated nor resumed exactly: each of its steps depends on the load while it ran. One thread, not all
the cores: it is the one count every machine has, the fastest beside another busy process (docs/scaling.md: a step
of 1.51 s, against 1.57 s following the load and 3.65 s on torch's default of two threads), 1.55x torch's default on
two quiet cores, and what the lab's committed results ran with.

`trainer.threads=null` trades that for speed on a machine whose load changes: an OpenMP op splits its work over every
thread and waits for the slowest, so on 2 cores with one of them kept busy by another process every op waits for the
thread that shares a core (measured here: a step 3.4x slower, 10-18x under heavier load), while one thread on the
free core costs about 1.1-1.4x. `OMP_WAIT_POLICY=PASSIVE` stops the spinning but makes a quiet step 2.4x slower. So
the budget follows the load: over each step, the CPU time the machine spent outside this process (busy time in
/proc/stat minus this process's own), in cores, is taken from the cores this process may run on (its affinity mask),
and the next step uses what is left, at least one thread and never more than torch's default. Only the steps are
watched: what runs while this process waits (another benchmark worker, say) is not load that competed with it. Such
a run is not bitwise repeatable, uninterrupted or resumed; each step logs its count (`perf/threads`) and every
checkpoint and summary records that the count followed the load (`computed_under`). A fixed count changed on resume
(`trainer.threads` may change, as the CPU kernels may) is recorded there too, with a warning: the steps after the
resume are not the bits an uninterrupted run would give. Outside Linux there is no /proc to read, and torch's
default is kept.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch

# What is left of a core counts as one from this share on: a thread on a core that another process keeps busy half
# the time makes every op as slow as one thread alone would (the work splits in two, that half runs at half speed).
_SHARE_THAT_COUNTS = 0.6
_FIRST_LOOK_S = 0.2  # how long the first measurement watches the machine, before any step has run


def _machine_busy_s() -> float | None:
    """CPU seconds the machine has spent busy (all but idle and iowait) since boot, or None without /proc."""
    try:
        fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
    except OSError:
        return None
    ticks = [int(value) for value in fields]
    idle = ticks[3] + (ticks[4] if len(ticks) > 4 else 0)
    return (sum(ticks[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def _own_busy_s() -> float:
    times = os.times()
    return times.user + times.system


class ThreadBudget:
    """`begin()` before every step and `end()` after it: `end` sets torch's intra-op threads for the next step."""

    def __init__(self, fixed: int | None) -> None:
        self.fixed = fixed
        self.ceiling = torch.get_num_threads()  # torch's default, OMP_NUM_THREADS included
        self.cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        self.threads = fixed or self.ceiling
        self._start: tuple[float, float, float] | None = None
        if fixed:
            torch.set_num_threads(fixed)
        elif _machine_busy_s() is not None:  # the first step also starts from what the machine does now
            self.begin()
            time.sleep(_FIRST_LOOK_S)
            self.end()

    @staticmethod
    def _sample() -> tuple[float, float, float] | None:
        machine = _machine_busy_s()
        return None if machine is None else (time.monotonic(), machine, _own_busy_s())

    def begin(self) -> None:
        self._start = None if self.fixed else self._sample()

    def other_load(self) -> float | None:
        """Cores the rest of the machine kept busy since `begin()` (None without /proc, or when nothing was timed)."""
        now, start = self._sample(), self._start
        if now is None or start is None or now[0] <= start[0]:
            return None
        (t0, machine0, own0), (t1, machine1, own1) = start, now
        return max(0.0, (machine1 - machine0) - (own1 - own0)) / (t1 - t0)

    def end(self) -> int:
        """Choose the next step's thread count from the load measured since `begin()`; returns it."""
        others = None if self.fixed else self.other_load()
        self._start = None
        if others is None:
            return self.threads
        free = int(self.cores - others + (1 - _SHARE_THAT_COUNTS))
        threads = max(1, min(self.ceiling, free))
        if threads != self.threads:
            torch.set_num_threads(threads)
            self.threads = threads
        return threads
