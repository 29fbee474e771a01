"""The notify protocol against a real unix datagram socket."""

from __future__ import annotations

import os
import socket
import time

import pytest

from tandem.sdnotify import LoopMonitor, Notifier, Watchdog


@pytest.fixture
def notify_socket(tmp_path):
    path = str(tmp_path / "notify.sock")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(path)
    sock.settimeout(2.0)
    yield path, sock
    sock.close()


def recv_all(sock, wait=0.3):
    out = []
    sock.settimeout(wait)
    try:
        while True:
            out.append(sock.recv(4096).decode())
    except socket.timeout:
        return out


def test_outside_systemd_everything_is_a_no_op():
    n = Notifier(env={})
    assert not n.enabled and n.ready() is False and n.watchdog() is False


def test_ready_status_stopping(notify_socket):
    path, sock = notify_socket
    n = Notifier(env={"NOTIFY_SOCKET": path})
    assert n.status("loading model")
    assert n.ready("serving")
    assert n.stopping("draining 3 requests")
    msgs = recv_all(sock)
    assert msgs[0] == "STATUS=loading model"
    assert msgs[1].split("\n")[:2] == ["READY=1", "STATUS=serving"]
    assert f"MAINPID={os.getpid()}" in msgs[1].split("\n")
    assert msgs[2] == "STOPPING=1\nSTATUS=draining 3 requests"


def test_abstract_namespace_socket():
    name = f"tandem-test-{os.getpid()}"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind("\0" + name)
    try:
        assert Notifier(env={"NOTIFY_SOCKET": "@" + name}).watchdog()
        sock.settimeout(2)
        assert sock.recv(100) == b"WATCHDOG=1"
    finally:
        sock.close()


def test_watchdog_interval_from_environment():
    assert Notifier(env={"NOTIFY_SOCKET": "/x", "WATCHDOG_USEC": "4000000"}).watchdog_usec == 4_000_000
    # WATCHDOG_PID names another process: the watchdog is not ours.
    assert Notifier(env={"NOTIFY_SOCKET": "/x", "WATCHDOG_USEC": "4000000", "WATCHDOG_PID": "1"}).watchdog_usec == 0


def test_watchdog_pings_while_loop_runs_and_stops_when_it_stalls(notify_socket):
    path, sock = notify_socket
    monitor = LoopMonitor(stall_after_s=0.25)
    dog = Watchdog(Notifier(env={"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "100000"}), monitor.alive)
    assert dog.interval_s == pytest.approx(0.05)
    dog.start()
    try:
        deadline = time.monotonic() + 0.6
        while time.monotonic() < deadline:  # the loop is running
            monitor.beat()
            time.sleep(0.02)
        running = recv_all(sock, wait=0.05)
        assert len(running) >= 5 and set(running) == {"WATCHDOG=1"}
        time.sleep(0.4)  # loop stalled: beats stop
        recv_all(sock, wait=0.05)  # drain pings sent before the stall was detected
        assert recv_all(sock, wait=0.4) == []
    finally:
        dog.stop()
