"""gunicorn's asgi worker as the edge runs it (tandem/http/edge_worker.py), each check a
defect bench/chaos.py found: a connection whose first request never completes its headers
is closed (gunicorn held it for ever), and once an edge process is killed no connection is
accepted that nothing will answer (a client got ECONNRESET where it should have been
refused)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections import Counter

import pytest

from tests.ops.procs import is_live


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def edge(tiny_model_dir):
    port = _free_port()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    p = subprocess.Popen([sys.executable, "-m", "tandem.cli", "edge", "--dev", "--bind", f"127.0.0.1:{port}",
                          "--workers", "2", "--model", str(tiny_model_dir)], stdout=subprocess.PIPE,
                         stderr=subprocess.DEVNULL, env=env, start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        for line in p.stdout:
            if b'"ready"' in line or time.monotonic() > deadline:
                break
        assert p.poll() is None, "edge did not start"
        yield port, p
    finally:
        try:
            os.killpg(p.pid, signal.SIGKILL)  # gunicorn's processes are in the group too
        except ProcessLookupError:
            pass
        p.wait(10)


@pytest.mark.parametrize("junk", [b"\x00\xff" * 300, b"GET /health HTTP/1.1\r\nHost: x\r\n"])
def test_first_request_without_complete_headers_is_closed(edge, junk):
    edge, _ = edge
    with socket.create_connection(("127.0.0.1", edge)) as c:
        c.sendall(junk)
        c.settimeout(25)
        t0 = time.monotonic()
        assert c.recv(1000) == b""  # closed, not answered and not held
        # keepalive is 5 s in the packaged gunicorn config; before the fix it never closed.
        assert time.monotonic() - t0 < 20
    # A whole request on a fresh connection is still answered.
    with socket.create_connection(("127.0.0.1", edge), timeout=10) as c:
        c.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        assert c.recv(1000).startswith(b"HTTP/1.1 200")


def _children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(x) for x in f.read().split()]
    except OSError:
        return []


def _edge_processes(wrapper: int) -> tuple[int, list[int]]:
    """(gunicorn's arbiter, its workers) under a `tandem edge` process, once both workers run."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        arbiters = _children(wrapper)
        workers = _children(arbiters[0]) if arbiters else []
        if len(workers) == 2:
            return arbiters[0], workers
        time.sleep(0.1)
    raise AssertionError("the edge's two gunicorn workers did not start")


def _connect_for(port: int, seconds: float) -> Counter:
    """Connect and ask for /health over and over for ``seconds``: how each attempt ended."""
    seen: Counter = Counter()
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        try:
            c = socket.create_connection(("127.0.0.1", port), timeout=5)
        except ConnectionRefusedError:
            seen["refused"] += 1
            time.sleep(0.005)
            continue
        except TimeoutError:
            seen["connect timed out"] += 1
            continue
        with c:
            try:
                c.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
                seen["answered" if c.recv(100).startswith(b"HTTP/1.1") else "closed unanswered"] += 1
            except ConnectionResetError:
                seen["reset"] += 1
            except TimeoutError:
                seen["no answer"] += 1
    return seen


LINUX_ONLY = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="parent-death signal and /proc")


@LINUX_ONLY
def test_workers_die_with_their_arbiter_and_accept_nothing_after_it(edge):
    port, proc = edge
    arbiter, workers = _edge_processes(proc.pid)
    assert _connect_for(port, 0.2)["answered"] > 0
    # An idle keep-alive connection: an orphaned worker used to drain it before exiting.
    with socket.create_connection(("127.0.0.1", port), timeout=5) as held:
        held.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        assert held.recv(100).startswith(b"HTTP/1.1 200")
        os.kill(arbiter, signal.SIGKILL)
        # Before the fix the orphans served on until gunicorn's heartbeat (once a second)
        # noticed, closed the socket under whatever had queued, and drained the held connection.
        time.sleep(0.3)
        seen = _connect_for(port, 1.0)
        assert set(seen) == {"refused"}, seen
        assert not any(is_live(w) for w in workers), "a worker outlived its arbiter"


@LINUX_ONLY
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_a_stopped_edge_refuses_new_connections_at_once(edge, sig):
    """SIGKILL of `tandem edge` (gunicorn's arbiter gets SIGTERM from its parent's death, as
    in the chaos run) or SIGTERM (a graceful stop): the socket closes at once, not at the
    workers' next heartbeat, so nothing queues on it for a supervisor's kill to reset."""
    port, proc = edge
    _edge_processes(proc.pid)
    os.kill(proc.pid, sig)
    time.sleep(0.3)
    seen = _connect_for(port, 1.0)
    assert set(seen) == {"refused"}, seen
