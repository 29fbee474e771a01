"""A real `tandem worker` speaking the notify protocol to a real datagram socket:
STATUS while loading, READY only after the warm-up request, WATCHDOG while its loops
run, STOPPING on SIGTERM."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from tests.ops.procs import is_live


@pytest.mark.timeout(120)
def test_worker_notifies_ready_after_warm_up_then_watchdog_then_stopping(tiny_model_dir, tmp_path):
    path = str(tmp_path / "notify.sock")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(path)
    secret = tmp_path / "secret"
    secret.write_text(os.urandom(32).hex())
    env = {**os.environ, "NOTIFY_SOCKET": path, "WATCHDOG_USEC": "400000", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "tandem.cli", "worker", "--role", "hybrid", "--model", str(tiny_model_dir),
         "--broker-backend", "tcp://127.0.0.1:1", "--broker-stream", "tcp://127.0.0.1:2",
         "--cluster-secret-file", str(secret)],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )
    messages: list[str] = []
    try:
        sock.settimeout(60)
        while not any("READY=1" in m for m in messages):
            messages.append(sock.recv(4096).decode())
        ready_at = len(messages) - 1
        assert messages[0].startswith("STATUS=loading"), messages
        ready = messages[ready_at].split("\n")
        assert ready[0] == "READY=1"
        assert any(f.startswith("STATUS=hybrid worker") and "warmed up in" in f for f in ready), ready
        assert f"MAINPID={proc.pid}" in ready

        sock.settimeout(0.5)
        pings, deadline = 0, time.monotonic() + 2.0
        while time.monotonic() < deadline:
            try:
                pings += sock.recv(4096) == b"WATCHDOG=1"
            except socket.timeout:
                pass
        assert pings >= 5, "the watchdog should ping every 0.2 s while the loops run"

        proc.send_signal(signal.SIGTERM)
        sock.settimeout(10)
        rest = []
        while not any("STOPPING=1" in m for m in rest):
            rest.append(sock.recv(4096).decode())
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        sock.close()


def start_edge(model_dir, **popen_kwargs) -> tuple[subprocess.Popen, int]:
    """`tandem edge` on a free loopback port, pointed at a broker that is not there."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [sys.executable, "-m", "tandem.cli", "edge", "--dev", "--model", str(model_dir),
         "--bind", f"127.0.0.1:{port}", "--broker", "tcp://127.0.0.1:1", "--broker-stream", "tcp://127.0.0.1:2"],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, **popen_kwargs,
    )
    return proc, port


@pytest.mark.timeout(120)
def test_edge_notifies_ready_once_it_answers_and_stopping_on_sigterm(tiny_model_dir, tmp_path):
    path = str(tmp_path / "notify.sock")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(path)
    proc, port = start_edge(tiny_model_dir, env={**os.environ, "NOTIFY_SOCKET": path})
    try:
        sock.settimeout(60)
        ready = sock.recv(4096).decode().split("\n")
        assert ready[0] == "READY=1" and f"STATUS=edge serving http://127.0.0.1:{port}" in ready
        assert '"event": "ready"' in proc.stdout.readline()  # READY came after the edge answered /health
        proc.send_signal(signal.SIGTERM)
        assert sock.recv(4096).decode().startswith("STOPPING=1")
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
        sock.close()


@pytest.mark.timeout(120)
def test_a_killed_edge_takes_gunicorn_with_it(tiny_model_dir, tmp_path):
    proc, port = start_edge(tiny_model_dir, start_new_session=True)
    try:
        assert '"event": "ready"' in proc.stdout.readline()
        children = [int(p) for p in open(f"/proc/{proc.pid}/task/{proc.pid}/children").read().split()]
        assert children, "gunicorn should be running under tandem edge"
        proc.kill()
        proc.wait()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and any(map(is_live, children)):
            time.sleep(0.2)
        assert [c for c in children if is_live(c)] == [], "gunicorn outlived a SIGKILLed tandem edge"
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
