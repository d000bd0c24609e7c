"""Step-by-step benchmark workers: every timed loop runs in its own process and takes one RL step per "go".

Why processes: two loops timed in one process would share allocator state, thread pools and peak RSS, and a
library's global settings (TRL and accelerate set seeds and torch options) would leak into the other loop. Why
step by step: on a shared 2-core machine the load changes from second to second, so two loops are compared by
running their steps alternately (A, B, A, B, ...) and taking the ratio of neighbouring steps, which cancels
most of the drift that separate runs would not.

Protocol. The worker writes one JSON object per line, prefixed by `PREFIX`, on a private copy of its original
stdout (everything libraries print goes to stderr, which the parent sends to a log file):
    {"event": "ready", ...}   once built, before the first step
    {"event": "step", ...}    after each step: seconds and breakdown, completion tokens, peak RSS
It reads one line from stdin before every step: `go` runs one step, anything else (or EOF) ends the worker.
While it waits on stdin it sleeps, so the loop being timed has the cores to itself.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
from pathlib import Path
from typing import IO, Any, NoReturn, cast

PREFIX = "@@bench "


def peak_rss_mib() -> float:
    """Peak resident set size of this process so far (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


class Channel:
    """The worker's side: report messages to the parent, wait for its "go"."""

    def __init__(self) -> None:
        self._out = os.fdopen(os.dup(1), "w", buffering=1)
        os.dup2(2, 1)  # anything a library prints now lands in the log, never in the protocol stream

    def send(self, event: str, **fields: Any) -> None:
        self._out.write(PREFIX + json.dumps({"event": event, **fields}) + "\n")

    def wait(self) -> bool:
        """Block until the parent says what to do: True for another step, False to stop."""
        return sys.stdin.readline().strip() == "go"


class Worker:
    """The parent's side: start `python -m <module> <args>` and drive it one step at a time."""

    def __init__(
        self,
        label: str,
        module: str,
        args: list[str],
        log_path: Path,
        env: dict[str, str] | None = None,
        cwd: Path | None = None,
    ) -> None:
        """`env`: variables set for this worker only, on top of the parent's (OpenMP's, say). `cwd`: the directory
        it starts in, whose packages `python -m` imports first (another commit's checkout; default: ours)."""
        self.label = label
        self.log_path = log_path
        self._log = open(log_path, "w", encoding="utf-8")
        self._proc = subprocess.Popen(
            [
                os.path.abspath(sys.executable),
                "-m",
                module,
                *args,
            ],  # absolute: the worker may start in another checkout
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            text=True,
            bufsize=1,
            env={**os.environ, **(env or {})},
            cwd=cwd,
        )
        self.info = self._receive("ready")

    def step(self) -> dict[str, Any]:
        """Run one step in the worker and return its report."""
        self._send("go")
        return self._receive("step")

    def close(self) -> None:
        if self._proc.poll() is None:
            self._send("stop")
            try:
                self._proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        self._log.close()

    def __enter__(self) -> Worker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _send(self, line: str) -> None:
        try:
            stdin = cast(IO[str], self._proc.stdin)  # opened with stdin=PIPE
            stdin.write(line + "\n")
            stdin.flush()
        except BrokenPipeError:
            self._died()

    def _receive(self, event: str) -> dict[str, Any]:
        for line in cast(IO[str], self._proc.stdout):  # opened with stdout=PIPE
            if line.startswith(PREFIX):
                message = json.loads(line[len(PREFIX) :])
                if message.get("event") != event:
                    raise RuntimeError(f"{self.label} worker sent {message.get('event')!r}, expected {event!r}")
                return message
        self._died()

    def _died(self) -> NoReturn:
        self._proc.wait()
        self._log.flush()
        tail = self.log_path.read_text(encoding="utf-8", errors="replace")[-3000:]
        raise RuntimeError(
            f"{self.label} worker exited with code {self._proc.returncode}; last lines of {self.log_path}:\n{tail}"
        )
