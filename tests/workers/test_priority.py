"""Co-located workers: the IO thread and ZeroMQ's threads get a high nice value, nothing else."""

from __future__ import annotations

import subprocess
import sys

from tandem.workers import priority

_CHILD = r"""
import os, threading
import zmq
from tandem.workers import priority
ctx = zmq.Context()
s = ctx.socket(zmq.PAIR)
s.bind("tcp://127.0.0.1:*")
engine = threading.Thread(target=threading.Event().wait, daemon=True)
engine.start()  # started first, as the worker's engine thread is
done = priority.lower_socket_threads(7)
def nice(tid):
    return os.getpriority(os.PRIO_PROCESS, tid)
zmq_tids = [int(t) for t in os.listdir("/proc/self/task")
            if open(f"/proc/self/task/{t}/comm").read().startswith("ZMQbg/")]
assert zmq_tids and all(nice(t) == 7 for t in zmq_tids), [(t, nice(t)) for t in zmq_tids]
assert nice(threading.get_native_id()) == 7
assert nice(engine.native_id) == 0  # the compute side keeps its priority
assert sorted(done) == sorted([threading.get_native_id()] + zmq_tids)
later = []
t = threading.Thread(target=lambda: later.append(nice(threading.get_native_id())))
t.start(); t.join()
assert later == [7]  # why the worker lowers itself only after the engine thread started
print("ok")
"""


def test_the_io_thread_and_zmq_threads_are_lowered_and_the_engine_thread_is_not():
    out = subprocess.run([sys.executable, "-c", _CHILD], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


def test_auto_lowers_only_gated_prefill_and_decode_workers():
    assert priority.nice_for("prefill", True, -1) == 19
    assert priority.nice_for("decode", True, -1) == 19
    assert priority.nice_for("prefill", False, -1) is None
    assert priority.nice_for("hybrid", True, -1) is None
    assert priority.nice_for("hybrid", False, 3) == 3
    assert priority.nice_for("decode", True, 0) == 0  # explicit 0: leave it at the default


def test_socket_threads_are_waited_for_until_their_names_settle(monkeypatch):
    """libzmq names its threads from inside them: a read right after the first socket
    may find none, or the IO thread without the reaper. The wait takes the settled set."""
    from tandem.workers import priority

    reads = iter([[], [11], [11, 12], [11, 12]])
    monkeypatch.setattr(priority, "_zmq_threads", lambda: next(reads))
    assert priority._named_zmq_threads() == [11, 12]
    monkeypatch.setattr(priority, "_zmq_threads", lambda: [])
    monkeypatch.setattr(priority, "NAMING_WAIT_S", 0.03)
    assert priority._named_zmq_threads() == []  # none at all: gives up after the wait
