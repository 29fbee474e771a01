"""Run a set of child processes as one service: start in order, prefix their logs,
restart the ones that die, and stop them all (in reverse order) on request.

Children run in their own sessions so a terminal's Ctrl-C reaches only the
supervisor, which then stops them in a controlled order; each child also gets
``PR_SET_PDEATHSIG`` so a supervisor killed with SIGKILL leaves no orphans.
"""

from __future__ import annotations

import collections
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

from tandem._parent_death import parent_death_signal


@dataclass
class ChildSpec:
    name: str
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    stop_grace_s: float = 10.0


class ChildFailed(Exception):
    """A child that could not be started or kept running; the message names it and why."""


def die_with_parent() -> None:
    """preexec_fn: the child gets SIGTERM when its parent dies."""
    parent_death_signal(signal.SIGTERM)


class Child:
    def __init__(self, spec: ChildSpec, out: Callable[[str], None]):
        self.spec = spec
        self._out = out
        self.proc: subprocess.Popen | None = None
        self.tail: collections.deque[str] = collections.deque(maxlen=20)
        self.ready_line = threading.Event()
        self.restarts: list[float] = []

    def start(self) -> None:
        self.ready_line.clear()
        self.proc = subprocess.Popen(
            self.spec.argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            env={**os.environ, **self.spec.env, "PYTHONUNBUFFERED": "1"}, start_new_session=True,
            preexec_fn=die_with_parent if sys.platform == "linux" else None, text=True, bufsize=1,
        )
        threading.Thread(target=self._pump, args=(self.proc,), name=f"log-{self.spec.name}", daemon=True).start()

    def _pump(self, proc: subprocess.Popen) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            line = line.rstrip("\n")
            self.tail.append(line)
            if line.startswith('{"event": "ready"'):
                self.ready_line.set()
            self._out(f"{self.spec.name:>10} | {line}")

    def poll(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def describe_exit(self) -> str:
        code = self.poll()
        how = f"was killed by signal {-code}" if code is not None and code < 0 else f"exited with status {code}"
        last = next((l for l in reversed(self.tail) if l.strip()), "")
        return f"{self.spec.name} {how}" + (f"; last output: {last.strip()}" if last else "")

    def kill_group(self) -> None:
        """SIGKILL what is left of a dead child's process group. Its own children outlive it
        (an edge's gunicorn workers, one of them perhaps stopped): left alone, they kept the
        listening port and accepted connections the replacement never saw, resetting them
        when they finally exited (found by bench/chaos.py)."""
        if self.proc is not None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            return
        try:
            self.proc.wait(timeout=self.spec.stop_grace_s)
        except subprocess.TimeoutExpired:
            self._out(f"{'serve':>10} | {self.spec.name} did not stop within {self.spec.stop_grace_s:.0f}s; killing it")
        # The group may hold grandchildren (gunicorn workers) even after the leader exits.
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()


class Supervisor:
    def __init__(self, specs: list[ChildSpec], *, max_restarts: int = 5, restart_window_s: float = 60.0,
                 out: Callable[[str], None] | None = None):
        self._lock = threading.Lock()
        self._print = out or (lambda line: print(line, flush=True))
        self.children = [Child(s, self._emit) for s in specs]
        self.max_restarts = max_restarts
        self.restart_window_s = restart_window_s
        self.stopping = threading.Event()

    def _emit(self, line: str) -> None:
        with self._lock:
            self._print(line)

    def say(self, text: str) -> None:
        self._emit(f"{'serve':>10} | {text}")

    def start(self, child: Child, ready_timeout_s: float) -> None:
        """Start one child and wait for its ``{"event": "ready"}`` line."""
        child.start()
        deadline = time.monotonic() + ready_timeout_s
        while not child.ready_line.wait(0.1):
            if child.poll() is not None:
                raise ChildFailed(child.describe_exit())
            if self.stopping.is_set():
                raise ChildFailed("interrupted during start-up")
            if time.monotonic() > deadline:
                raise ChildFailed(f"{child.spec.name} did not become ready within {ready_timeout_s:.0f}s")

    def check(self) -> None:
        """Restart children that died; raise ChildFailed when one keeps dying."""
        for child in self.children:
            if child.poll() is None or self.stopping.is_set():
                continue
            now = time.monotonic()
            child.restarts = [t for t in child.restarts if now - t < self.restart_window_s] + [now]
            reason = child.describe_exit()
            if len(child.restarts) > self.max_restarts:
                raise ChildFailed(f"{reason}; it failed {len(child.restarts)} times in "
                                  f"{self.restart_window_s:.0f}s, giving up")
            self.say(f"{reason}; restarting it ({len(child.restarts)}/{self.max_restarts})")
            child.kill_group()
            child.start()

    def stop_all(self) -> None:
        self.stopping.set()
        for child in reversed(self.children):
            if child.poll() is None:
                self.say(f"stopping {child.spec.name}")
            child.stop()
