"""KV handoff connections over ZeroMQ: prefill DEALER (``KVSender``) -> decode ROUTER
(``KVReceiver``), each beginning with the cluster handshake and sealing every message.

The socket is plain ZeroMQ (no CURVE): the handshake and AES-GCM frames protect it,
so the bulk path pays for one cipher, not two. Both classes own their socket but do no
threading; the worker's IO thread polls ``.socket`` and calls ``recv`` / ``handle``.
"""

from __future__ import annotations

import logging
import time
from collections import Counter, deque

import numpy as np
import zmq

from tandem.wire import codec
from tandem.wire import protocol as P
from tandem.wire.errors import WireError
from tandem.wire.handshake import Initiator, Responder, error_frames
from tandem.wire.messages import Message
from tandem.wire.sealed import SealedChannel
from tandem.wire.sockets import make_socket

log = logging.getLogger(__name__)

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
# KVSender's send arena: 8 MiB (records of 2 MiB, sealed.py splits larger frames into
# pieces) stays in the last-level cache between the sealing thread writing a record and
# libzmq's I/O thread copying it into the socket; a 64 MiB ring is evicted before it is
# reused. On the development box (32 MiB L3, sender and receiver on two cores) its median
# sealed/raw ZeroMQ ratio was 2-11 points above a 64 MiB arena's in 10 of 12 interleaved A/B
# runs (docs/benchmarks/kv_transfer.md); a blocking sender needs only a few records in flight.
SENDER_ARENA_BYTES = 8 << 20
KV_HWM = 64  # messages; KV chunks are large, so keep the queue short and let send block
REPLY_HWM = 10_000  # the decode side's replies
MAX_PENDING_HANDSHAKES = 256


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


ARENA_MIN_GROUP = 64 << 10


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


class KVSender:
    """One authenticated connection to a decode worker's KV ingest address.

    ``KVSender(ctx, "tcp://10.0.0.2:5600", secret, "prefill-1")`` connects and runs the
    handshake (raises AuthError on a wrong secret, PeerAtCapacity if the decode worker
    refused, TimeoutError if it did not answer within ``timeout_s``)."""

    def __init__(
        self, ctx: zmq.Context, address: str, secret: bytes, node_id: str, *, timeout_s: float = 5.0, arena_bytes: int = SENDER_ARENA_BYTES
    ):
        self.address = address
        self._arena = SendArena(arena_bytes)
        self.socket = make_socket(ctx, zmq.DEALER, connect=address, hwm=KV_HWM)
        try:
            initiator = Initiator(secret, node_id)
            self.socket.send_multipart(initiator.hello())
            proof, self.channel, self.peer_id = initiator.on_challenge(self._recv_raw(timeout_s))
            self.socket.send_multipart(proof)
        except BaseException:
            self.socket.close(0)
            raise

    def _recv_raw(self, timeout_s: float | None) -> list:
        if timeout_s is not None and not self.socket.poll(int(timeout_s * 1000)):
            raise TimeoutError(f"KV peer {self.address} did not answer in time")
        return codec.recv_frames(self.socket, copy=False, max_frames=2 * P.MAX_FRAMES)

    def send(self, msg: Message) -> None:
        self.send_frames(codec.encode(msg))

    def send_frames(self, frames: list) -> None:
        """Seal and send already-encoded frames (``codec.encode(msg)``): :func:`send_records`."""
        send_records(self.socket, self.channel, frames, self._arena)

    def recv(self, timeout_s: float | None = None) -> Message:
        """The next message from the decode worker (KVAck / KVRefuse)."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            frames = self.channel.open(self._recv_raw(remaining))
            if frames is not None:
                return codec.decode(frames)

    def close(self) -> None:
        self.socket.close(0)


class KVReceiver:
    """The decode worker's KV ingest: a bound ROUTER, one session per connected peer.

    Feed every incoming multipart message to :meth:`handle`; it runs handshakes itself
    and returns ``(peer, message)`` for each authenticated, opened and decoded message.
    ``at_capacity()`` decides the (authenticated) verdict for new connections. Any
    failure drops that peer's session; counts are in ``stats``."""

    def __init__(self, ctx: zmq.Context, bind: str, secret: bytes, node_id: str, *, at_capacity=None):
        self.socket = make_socket(ctx, zmq.ROUTER, bind=bind, hwm=KV_HWM)
        # Replies (acks, refusals) are small, but a reply dropped at the HWM would leave a
        # gap in the sealed counter and break the channel. libzmq sizes each peer's pipe
        # when it connects, so this applies to every peer.
        self.socket.sndhwm = REPLY_HWM
        self._secret = secret
        self._node_id = node_id
        self._at_capacity = at_capacity or (lambda: False)
        self._pending: dict[bytes, Responder] = {}
        self._channels: dict[bytes, SealedChannel] = {}
        self.peer_ids: dict[bytes, str] = {}
        self.stats: Counter = Counter()

    @property
    def endpoint(self) -> str:
        return self.socket.getsockopt_string(zmq.LAST_ENDPOINT)

    def recv(self, timeout_s: float | None = None) -> tuple[bytes, Message] | None:
        """Receive and handle messages until one decodes or ``timeout_s`` passes."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            try:  # poll only when nothing is queued: a KV message is many records back to back
                frames = codec.recv_frames(self.socket, copy=False, flags=zmq.NOBLOCK, max_frames=1 + 2 * P.MAX_FRAMES)
            except zmq.Again:
                wait = -1 if deadline is None else max(0, int((deadline - time.monotonic()) * 1000))
                if not self.socket.poll(wait):
                    return None
                continue
            except WireError as exc:
                self.stats["rejected_" + exc.reason] += 1
                continue
            result = self.handle(frames)
            del frames  # the record's buffer goes now, not after the next receive: libzmq reuses it hot
            if result is not None:
                return result

    def handle(self, frames: list) -> tuple[bytes, Message] | None:
        peer, body = codec.split_route(frames)
        channel = self._channels.get(peer)
        try:
            if channel is not None:
                frames = channel.open(body)
                return None if frames is None else (peer, codec.decode(frames))
            responder = self._pending.pop(peer, None)
            if responder is not None:
                self._channels[peer] = responder.on_proof(body)
                self.peer_ids[peer] = responder.peer_id
                self.stats["handshakes_ok"] += 1
                return None
            responder = Responder(self._secret, self._node_id)
            at_capacity = bool(self._at_capacity())
            reply = responder.on_hello(body, at_capacity=at_capacity)
            if at_capacity:
                self.stats["refused_at_capacity"] += 1
            else:
                if len(self._pending) >= MAX_PENDING_HANDSHAKES:
                    self._pending.pop(next(iter(self._pending)))
                self._pending[peer] = responder
            self._send_raw(peer, reply)
        except WireError as exc:
            self.stats["rejected_" + exc.reason] += 1
            log.warning("KV peer %s dropped: %s", self.peer_ids.get(peer, peer.hex()), exc)
            self.drop(peer)
            self._send_raw(peer, error_frames())
        return None

    def send(self, peer: bytes, msg: Message) -> None:
        channel = self._channels.get(peer)
        if channel is None:
            raise WireError(f"no authenticated session with peer {peer.hex()}", "no_session")
        self._send_raw(peer, channel.seal(codec.encode(msg)))

    def _send_raw(self, peer: bytes, frames: list) -> None:
        try:
            codec.send(self.socket, codec.route(peer, frames), flags=zmq.NOBLOCK)
        except zmq.ZMQError as exc:  # peer gone (ROUTER_MANDATORY) or its queue is full
            self.stats["send_failed"] += 1
            log.info("KV reply to %s not delivered: %s", peer.hex(), exc)

    def drop(self, peer: bytes) -> bool:
        self._pending.pop(peer, None)
        self.peer_ids.pop(peer, None)
        return self._channels.pop(peer, None) is not None

    def close(self) -> None:
        self.socket.close(0)
