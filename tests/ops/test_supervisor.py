"""The supervisor's restart path: a dead child is replaced whole, its leftovers gone."""

from __future__ import annotations

import os
import signal
import sys
import time

from tandem.supervisor import ChildSpec, Supervisor

# A child that starts a grandchild (in its own process group, as gunicorn's workers are in
# the arbiter's), prints the grandchild's pid and its ready line, then waits.
CHILD = (
    "import subprocess, sys, time\n"
    "g = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(300)'])\n"
    "print(g.pid, flush=True)\n"
    "print('{\"event\": \"ready\"}', flush=True)\n"
    "time.sleep(300)\n"
)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_a_restarted_child_leaves_no_grandchildren_behind():
    lines: list[str] = []
    sup = Supervisor([ChildSpec("parent", [sys.executable, "-c", CHILD], stop_grace_s=2)], out=lines.append)
    child = sup.children[0]
    try:
        sup.start(child, ready_timeout_s=30)
        first = int(child.tail[0])
        assert _alive(first)
        os.kill(first, signal.SIGSTOP)  # as a stopped gunicorn worker: it would linger
        os.kill(child.proc.pid, signal.SIGKILL)
        child.proc.wait(10)
        sup.check()
        deadline = time.monotonic() + 10
        while _alive(first) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(first), "the dead child's grandchild survived its restart"
        assert child.poll() is None and any("restarting it" in line for line in lines)
    finally:
        sup.stop_all()
        if "first" in locals() and _alive(first):
            os.kill(first, signal.SIGKILL)
