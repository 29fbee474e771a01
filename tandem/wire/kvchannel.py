"""How sealed KV records go onto a connection: grouped AES-GCM records, one ZeroMQ message
each, sealed into a reused send arena and sent zero-copy.

KV connections are plain ZeroMQ (no CURVE): the cluster handshake and the sealed records
protect them, so the bulk path pays for one cipher, not two. The connections themselves
are the workers' (:mod:`tandem.workers.handoff`).
"""

from __future__ import annotations

from collections import deque

import numpy as np
import zmq

from tandem.wire import codec
from tandem.wire.sealed import SealedChannel

# Records of a large message grow to about this size (frames smaller than it share one;
# sealed.record_target keeps the first and last records small). Per record both sides
# pay fixed costs - a ZeroMQ message, a zero-copy release through pyzmq's garbage-collector
# thread, wake-ups of the threads on each side, Python per record - so larger records
# cost less CPU per GB (16 MiB: ~10% less than 2 MiB, sender and receiver together); but
# the four threads of a transfer (sealing, the two libzmq I/O threads, opening) hand work
# to each other per record, and on two cores coarser records left more of them idle:
# 16 MiB records moved a 1k-token 8B-shaped cache ~8% slower than 2-4 MiB ones
# (bench/kv_transfer.py, interleaved runs). A sender's arena holds four or more records.
RECORD_GROUP_BYTES = 4 << 20
ARENA_MIN_GROUP = 64 << 10


class SendArena:
    """A ring of reusable memory for sealed records in flight.

    Each record's ciphertext is written into the next free region and sent zero-copy
    with a tracker; a region is reused only after libzmq has released it. The arena is
    touched once, on first use, so steady-state sealing never page-faults. (Over inproc
    the receiver shares the bytes, so a region frees only when the receiver drops them:
    KV connections use tcp.)"""

    def __init__(self, size: int):
        self._array: np.ndarray | None = None  # allocated on first use
        self._view: memoryview | None = None
        self._size = size
        self._pos = 0
        self._inflight: deque = deque()  # [start, end, tracker] of regions libzmq may still read

    def alloc(self, nbytes: int, wait: bool = True) -> memoryview | None:
        """A region of ``nbytes``, or None (the caller allocates) when it is over half the
        arena or, with ``wait=False``, when libzmq still holds the memory it would reuse."""
        if nbytes > self._size // 2:
            return None
        if self._view is None:
            self._array = np.ones(self._size, dtype=np.uint8)
            self._view = memoryview(self._array)
        start = self._pos if self._pos + nbytes <= self._size else 0
        end = start + nbytes
        # Regions are handed out in ring order and _inflight holds them oldest first: the
        # last lap's regions from _pos to the end of the ring, then this lap's from 0. The
        # new region may reuse only memory libzmq has released. Without a wrap it can
        # overlap only the oldest; with one it skips the tail [_pos, size), whose regions
        # are older than those at 0 it overlaps, so those go first (else the check would
        # stop at one of them, clear of [0, end), while newer ones there are still in
        # flight). So: from the oldest, release (wait for) each live region that overlaps
        # the new one or lies in a skipped tail, and stop at the first that does neither.
        tail = self._pos if start == 0 else self._size
        inflight = self._inflight
        while inflight:
            r_start, r_end, tracker = inflight[0]
            if tracker is not None and not tracker.done:  # None: its send failed, nothing holds it
                if (r_end <= start or end <= r_start) and r_end <= tail:
                    break
                if not wait:
                    return None
                tracker.wait()  # libzmq still owns bytes we are about to overwrite
            inflight.popleft()
        inflight.append([start, end, None])
        self._pos = end
        return self._view[start:end]

    def owns(self, buf) -> bool:
        """Whether ``buf`` is a region this arena handed out (its send must be tracked)."""
        return isinstance(buf, memoryview) and self._array is not None and buf.obj is self._array

    def track(self, tracker) -> None:
        self._inflight[-1][2] = tracker

    def group_bytes(self) -> int:
        """The record size for messages sealed into this arena (several fit in flight)."""
        return max(ARENA_MIN_GROUP, min(RECORD_GROUP_BYTES, self._size // 4))


def send_records(sock: zmq.Socket, channel: SealedChannel, frames: list, arena: SendArena, *, flags: int = 0) -> None:
    """Seal already-encoded frames (``codec.encode(msg)``) and send them one record per
    ZeroMQ message, so libzmq transmits record ``j`` while record ``j + 1`` is sealed and
    the receiver opens each record as it arrives; small frames share records (a small
    message is one record, one ZeroMQ message). Records go zero-copy from ``arena``;
    ``flags=zmq.NOBLOCK`` never waits (neither for the arena nor at the high-water mark:
    zmq.Again then, and the channel's counter has moved on, so the connection is spent)."""
    wait = not flags & zmq.NOBLOCK
    alloc = arena.alloc if wait else (lambda n: arena.alloc(n, False))
    for head, body in channel.seal_records(frames, alloc=alloc, group_bytes=arena.group_bytes()):
        if arena.owns(body):  # in the arena: track until libzmq lets go
            sock.send(head, flags | zmq.SNDMORE)  # zmq.Again comes here if at all (the HWM counts whole messages)
            arena.track(sock.send(body, flags, copy=False, track=True))
        else:
            codec.send(sock, [head, body], flags=flags)
