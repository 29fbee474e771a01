"""The systemd notify protocol: a few datagrams to ``$NOTIFY_SOCKET``.

Services run as ``Type=notify``: a worker says READY=1 only once its model is
loaded and warmed, STATUS= lines as it goes, STOPPING=1 when it drains, and
WATCHDOG=1 only while its engine loop makes progress, so systemd restarts a
process whose loop is stuck even though the process is alive.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from typing import Callable


class Notifier:
    """Sends notify messages; every method is a no-op outside systemd."""

    def __init__(self, env: dict[str, str] | None = None):
        env = os.environ if env is None else env
        self.address = env.get("NOTIFY_SOCKET") or None
        usec = env.get("WATCHDOG_USEC")
        pid = env.get("WATCHDOG_PID")
        self.watchdog_usec = int(usec) if usec and usec.isdigit() and (not pid or pid == str(os.getpid())) else 0
        self._sock: socket.socket | None = None

    @property
    def enabled(self) -> bool:
        return self.address is not None

    def send(self, *fields: str) -> bool:
        if not self.address:
            return False
        addr = self.address
        if addr.startswith("@"):
            addr = "\0" + addr[1:]  # abstract namespace
        if self._sock is None:
            self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
        try:
            self._sock.sendto("\n".join(fields).encode(), addr)
            return True
        except OSError:
            return False  # systemd gone or socket unusable: never crash the service for it

    def ready(self, status: str | None = None) -> bool:
        return self.send("READY=1", *([f"STATUS={status}"] if status else []), f"MAINPID={os.getpid()}")

    def status(self, text: str) -> bool:
        return self.send(f"STATUS={text}")

    def stopping(self, status: str | None = None) -> bool:
        return self.send("STOPPING=1", *([f"STATUS={status}"] if status else []))

    def watchdog(self) -> bool:
        return self.send("WATCHDOG=1")

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None


class Watchdog:
    """Pings WATCHDOG=1 at half the configured interval while ``is_alive()`` holds.

    ``is_alive`` is the engine loop's own progress check (for example "the step
    counter moved, or the loop is idle-waiting, within the last N seconds"); when it
    turns false the pings stop and systemd's ``WatchdogSec`` restarts the service.
    """

    def __init__(self, notifier: Notifier, is_alive: Callable[[], bool], interval_s: float | None = None):
        self.notifier = notifier
        self.is_alive = is_alive
        usec = notifier.watchdog_usec
        self.interval_s = interval_s if interval_s is not None else (usec / 2e6 if usec else 0.0)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if not self.notifier.enabled or self.interval_s <= 0:
            return
        self._thread = threading.Thread(target=self._run, name="sd-watchdog", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            if self.is_alive():
                self.notifier.watchdog()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2)


class LoopMonitor:
    """Progress tracking for a step loop: call :meth:`beat` every iteration."""

    def __init__(self, stall_after_s: float = 30.0, clock: Callable[[], float] = time.monotonic):
        self.stall_after_s = stall_after_s
        self._clock = clock
        self._last = clock()

    def beat(self) -> None:
        self._last = self._clock()

    def alive(self) -> bool:
        return self._clock() - self._last < self.stall_after_s
