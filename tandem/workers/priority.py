"""Co-located workers: a worker's socket threads yield the cores to compute.

Under the CPU gate a prefill worker's next prefill batch runs while its IO thread seals
and sends the previous batch's KV (about 12 ms of CPU per 11.8 MB request) and the decode
worker's IO thread opens and assembles it, with ZeroMQ's I/O threads copying it through
loopback TCP on both sides. The prefill's matrix products use both cores, and a third
runnable thread takes a core from one of MKL's two threads in the middle of a product,
which stalls the other at the next barrier. Measured (bench/disagg.py timeline, 4-prompt
batches): a burst's second prefill batch, the one with handoffs alongside, took 145 ms
more than its first on the gated prefill worker and 44 ms more on hybrid.

With a high nice value the socket threads yield to MKL's threads while those run and
take the cores when they are idle (the one-core parts of a step, the moments between
steps, OpenMP's threads asleep again a few ms after a step: :mod:`openmp`); with nothing
else runnable (a handoff after the last batch, an unloaded request) they run at full
speed, so first tokens and handoffs are not delayed there. The engine thread and the
math library's threads keep their priority, and so do the threads of a context from
:func:`context_keeping_priority` (a prefill worker's token stream, whose first tokens the
engine thread publishes: worker.py).
"""

from __future__ import annotations

import logging
import os
import threading
import time

import zmq

log = logging.getLogger("tandem.workers.priority")

# libzmq names its background threads so ("ZMQbg/IO/0", "ZMQbg/Reaper"), or with a
# context's thread name prefix (an integer in libzmq 4.3) before it: "1/ZMQbg/IO/0".
_ZMQ_THREAD_PREFIX = "ZMQbg/"
_KEEP_PRIORITY_PREFIX = 1


def context_keeping_priority() -> zmq.Context:
    """A ZeroMQ context whose threads :func:`lower_socket_threads` leaves alone (their
    names carry a prefix): for the sockets on a latency path, such as a prefill worker's
    token stream, whose first tokens would otherwise leave through an I/O thread at nice
    19 competing with the math library's threads for the cores."""
    ctx = zmq.Context(io_threads=1)
    ctx.set(zmq.THREAD_NAME_PREFIX, _KEEP_PRIORITY_PREFIX)
    return ctx


def nice_for(role: str, gated: bool, setting: int) -> int | None:
    """The nice value for this worker's socket threads (None: leave them). ``setting`` is
    ``worker.io_nice``: -1 = auto (19 for a prefill or decode worker under the CPU gate)."""
    if setting >= 0:
        return setting
    if role in ("prefill", "decode") and gated:
        return 19
    return None


NAMING_WAIT_S = 0.2
"""How long :func:`lower_socket_threads` waits for ZeroMQ's threads to take their names."""


def _zmq_threads() -> list[int]:
    tids = []
    try:
        for tid in os.listdir("/proc/self/task"):
            try:
                with open(f"/proc/self/task/{tid}/comm") as f:
                    if f.read().startswith(_ZMQ_THREAD_PREFIX):
                        tids.append(int(tid))
            except OSError:
                continue  # a thread that just ended
    except OSError:
        pass
    return sorted(tids)


def _named_zmq_threads() -> list[int]:
    """ZeroMQ's background threads once their names have settled. libzmq names each
    thread from inside it, so right after a context's first socket the threads may exist
    unnamed for as long as they wait for a core (seen on a loaded 2-core CI machine):
    wait, up to NAMING_WAIT_S, until two reads 5 ms apart agree and find some."""
    deadline = time.monotonic() + NAMING_WAIT_S
    seen = _zmq_threads()
    while time.monotonic() < deadline:
        time.sleep(0.005)
        now = _zmq_threads()
        if now and now == seen:
            break
        seen = now
    return seen


def lower_socket_threads(nice: int) -> list[int]:
    """Give the calling thread (the worker's IO thread) and ZeroMQ's background threads of
    this process ``nice`` (Linux: a nice value belongs to a thread). Returns the thread ids
    changed; raising a nice value needs no privilege."""
    tids = [threading.get_native_id()] + _named_zmq_threads()
    done = []
    for tid in tids:
        try:
            os.setpriority(os.PRIO_PROCESS, tid, nice)
            done.append(tid)
        except OSError as exc:
            log.warning("could not set nice %d on thread %d: %s", nice, tid, exc)
    return done
