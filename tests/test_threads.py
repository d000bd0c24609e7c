"""experiments/run/threads.py: the thread budget follows the cores other processes leave free, measured over a step.

Its logic is tested on load injected into the clocks it reads (/proc/stat's busy time, this process's own, the
monotonic clock). Two tests measure the machine's real load, opt-in (`make test-load`, or `MOE_LAB_REAL_LOAD=1`):
another test process beside them moves what they read. They compare load against a baseline measured just before,
never against zero, in several adjacent pairs of windows whose median difference is read: a load elsewhere that
changes between two moments moves one pair, not the median."""

from __future__ import annotations

import os
import signal
import statistics
import subprocess
import sys
import time

import pytest
import torch

from experiments.run.threads import ThreadBudget

pytestmark = pytest.mark.skipif(not os.path.exists("/proc/stat"), reason="the budget reads Linux's /proc/stat")
real_load = pytest.mark.skipif(
    not os.environ.get("MOE_LAB_REAL_LOAD"),
    reason=("measures the machine's real load, which other test processes move: run alone with `make test-load`"),
)
CORES = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


@pytest.fixture
def all_cores():
    torch.set_num_threads(CORES)  # the ceiling: torch's default on this machine (conftest sets 1 for every test)
    yield


def burn(seconds: float) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        pass


def load_over(budget: ThreadBudget, seconds: float, work=time.sleep) -> float:
    budget.begin()
    work(seconds)
    return budget.other_load()


def paired_loads(
    budget: ThreadBudget, work_on, start=lambda: None, stop=lambda: None, rounds: int = 5, seconds: float = 0.3
) -> list[tuple[float, float]]:
    """(load without, load with) for `rounds` adjacent pairs of windows: idle, then `start()`, `work_on` for the
    window, `stop()`."""
    pairs = []
    for _ in range(rounds):
        without = load_over(budget, seconds)
        start()
        time.sleep(0.05)  # whatever was started is running
        pairs.append((without, load_over(budget, seconds, work_on)))
        stop()
    return pairs


class Clocks:
    """The three clocks the budget reads, advanced by hand: seconds of wall time, the machine's busy CPU seconds and
    this process's own."""

    def __init__(self) -> None:
        self.wall, self.machine, self.own = 100.0, 5000.0, 10.0

    def advance(self, seconds: float, elsewhere: float, own: float) -> None:
        """`seconds` pass while other processes keep `elsewhere` cores busy and this one `own`."""
        self.wall += seconds
        self.own += own * seconds
        self.machine += (elsewhere + own) * seconds


@pytest.fixture
def clocks(monkeypatch):
    import experiments.run.threads as threads

    fake = Clocks()
    monkeypatch.setattr(threads, "_machine_busy_s", lambda: fake.machine)
    monkeypatch.setattr(threads, "_own_busy_s", lambda: fake.own)
    monkeypatch.setattr(threads.time, "monotonic", lambda: fake.wall)
    monkeypatch.setattr(threads.time, "sleep", lambda seconds: fake.advance(seconds, 0.0, 0.0))
    return fake


@pytest.mark.parametrize("elsewhere, own", [(1.0, 0.0), (1.0, 1.0), (0.0, 1.0), (0.5, 0.5), (2.0, 0.0)])
def test_the_load_is_the_machines_busy_time_less_its_own(all_cores, clocks, elsewhere, own):
    """A core kept busy elsewhere is one core of load whatever this process does; its own work is none."""
    budget = ThreadBudget(None)
    budget.begin()
    clocks.advance(2.0, elsewhere, own)
    assert budget.other_load() == pytest.approx(elsewhere)


def test_a_step_beside_a_busy_core_leaves_the_next_step_the_cores_that_are_left(all_cores, clocks):
    budget = ThreadBudget(None)
    budget.begin()
    clocks.advance(3.0, 1.0, 1.0)  # a step on the free core, beside one kept busy elsewhere
    assert budget.end() == max(1, CORES - 1) and torch.get_num_threads() == max(1, CORES - 1)
    budget.begin()
    clocks.advance(3.0, 0.0, CORES)  # the other process has ended: the step may take every core again
    assert budget.end() == CORES


@real_load
def test_a_busy_core_elsewhere_is_measured_as_one_core(all_cores):
    budget = ThreadBudget(None)
    competitor = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    competitor.send_signal(signal.SIGSTOP)
    try:
        # Nine pairs, not five: beside a test process whose load swings, five pairs' median once read 1.36 cores.
        pairs = paired_loads(
            budget,
            time.sleep,
            lambda: competitor.send_signal(signal.SIGCONT),
            lambda: competitor.send_signal(signal.SIGSTOP),
            rounds=9,
        )
    finally:
        competitor.kill()
        competitor.wait()
    added = statistics.median(with_ - without for without, with_ in pairs)
    room = statistics.median(min(1.0, CORES - without) for without, _ in pairs)  # a core it can take
    assert added == pytest.approx(room, abs=0.35)


@real_load
def test_its_own_work_is_not_load(all_cores):
    budget = ThreadBudget(None)
    pairs = paired_loads(budget, burn)
    assert statistics.median(with_ - without for without, with_ in pairs) < 0.35


@pytest.mark.parametrize(
    "others, expected", [(0.0, CORES), (0.3, CORES), (0.5, CORES - 1), (1.0, CORES - 1), (CORES + 3.0, 1)]
)
def test_the_next_step_gets_the_cores_left_and_at_least_one(all_cores, monkeypatch, others, expected):
    budget = ThreadBudget(None)
    monkeypatch.setattr(budget, "other_load", lambda: others)
    budget.begin()
    assert budget.end() == max(1, expected) and torch.get_num_threads() == max(1, expected)


def test_a_fixed_count_is_kept_whatever_the_load(all_cores):
    budget = ThreadBudget(1)
    assert torch.get_num_threads() == 1
    budget.begin()
    burn(0.2)
    assert budget.end() == 1 and budget.other_load() is None
