"""Moving one KVSnapshot from a prefill worker to a decode worker: strategies, acks,
timeouts, and the adaptive choice of strategy from measured bandwidth.

Sender: :func:`send_snapshot` over one or more :class:`KVSender` connections to the same
decode worker (LayerParallel spreads layers over them, one thread per connection).
Receiver: :class:`KVIngest` wraps a :class:`KVReceiver`, assembles transfers from any
number of connections, acknowledges complete ones, refuses ones ``can_accept`` rejects,
and forgets partial ones after ``timeout_s`` so no KV stays pinned by a dead peer.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from dataclasses import dataclass, field

import zmq

from tandem.kvtypes import KVSnapshot
from tandem.wire import codec
from tandem.wire.errors import WireError
from tandem.wire.kvchannel import KVReceiver, KVSender
from tandem.wire.kvframes import KVAssembler, KVOptions, encode_blocks, iter_snapshot_messages
from tandem.wire.messages import KVAck, KVChunk, KVHeader, KVRefuse

log = logging.getLogger(__name__)


class KVRefused(WireError):
    """The decode worker authenticated and refused this request (at capacity, ...)."""

    def __init__(self, refuse: KVRefuse):
        super().__init__(f"decode worker refused KV: {refuse.reason} {refuse.message}".strip(), refuse.reason)
        self.retry_after_s = refuse.retry_after_s


@dataclass
class TransferResult:
    strategy: str
    nbytes: int  # bytes of KV moved (the snapshot's, before compression/quantization)
    wire_bytes: int  # payload bytes actually sent
    seconds: float

    @property
    def gbps(self) -> float:
        return self.nbytes / self.seconds / 1e9 if self.seconds > 0 else 0.0


def send_snapshot(
    senders: list[KVSender],
    snap: KVSnapshot,
    options: KVOptions,
    *,
    stream_seq: int = 0,
    priority: int = 0,
    attempt: int = 0,
    timeout_s: float = 30.0,
) -> TransferResult:
    """Send and wait for the decode worker's KVAck(complete). Raises KVRefused, AuthError,
    WireError or TimeoutError; after any of these the connections should be closed."""
    if options.strategy == "layer_parallel":
        options = KVOptions(**{**options.__dict__, "connections": min(options.connections, len(senders))})
    t0 = time.perf_counter()
    per_conn = iter_snapshot_messages(snap, options, stream_seq=stream_seq, priority=priority, attempt=attempt)
    wire_bytes = [0] * len(per_conn)
    errors: list[BaseException] = []

    def push(i: int, sender: KVSender, msgs) -> None:
        try:
            for msg in msgs:
                if isinstance(msg, KVChunk):
                    wire_bytes[i] += sum(len(codec.as_buffer(f)) for f in msg.frames)
                sender.send(msg)
        except BaseException as exc:  # re-raised below in the caller's thread
            errors.append(exc)

    if len(per_conn) == 1:
        push(0, senders[0], per_conn[0])
    else:
        threads = [threading.Thread(target=push, args=(i, s, m)) for i, (s, m) in enumerate(zip(senders, per_conn))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    if errors:
        raise errors[0]
    _await_ack(senders[: len(per_conn)], snap.request_id, timeout_s)
    return TransferResult(options.strategy, snap.nbytes, sum(wire_bytes), time.perf_counter() - t0)


class KVStream:
    """Streams one request's KV while it is being computed (Streamed strategy, overlapping
    prefill): send a non-final header with the final geometry as soon as the prompt
    length is known, blocks as the engine finishes them, then the final header (with
    the sampled token) and wait for the ack.

    ``KVStream(sender, header, options)`` sends ``header`` (``final`` forced False);
    ``send_blocks(keys, values, block_start)`` takes per-layer arrays ``(n, heads,
    block_size, head_dim)`` for blocks ``[block_start, block_start + n)`` of every layer;
    ``finish(final_header)`` sends it and returns the TransferResult."""

    def __init__(self, sender: KVSender, header: KVHeader, options: KVOptions):
        self._sender, self._options = sender, options
        self._encoding = dict(strategy="streamed", compression=options.compression, quantization=options.quantization)
        self._header = dataclasses.replace(header, final=False, **self._encoding)
        self._index = 0
        self._nbytes = self._wire_bytes = 0
        self._t0 = time.perf_counter()
        sender.send(self._header)

    def send_blocks(self, keys: list, values: list, block_start: int) -> None:
        chunk = encode_blocks(self._header.request_id, self._header.dtype, keys, values, 0, block_start,
                              self._options, self._index, last=False)
        self._index += 1
        self._nbytes += sum(a.nbytes for a in keys) + sum(a.nbytes for a in values)
        self._wire_bytes += sum(len(codec.as_buffer(f)) for f in chunk.frames)
        self._sender.send(chunk)

    def finish(self, final_header: KVHeader, *, timeout_s: float = 30.0) -> TransferResult:
        self._sender.send(dataclasses.replace(final_header, final=True, **self._encoding))
        _await_ack([self._sender], self._header.request_id, timeout_s)
        return TransferResult("streamed", self._nbytes, self._wire_bytes, time.perf_counter() - self._t0)


def _await_ack(senders: list[KVSender], request_id: bytes, timeout_s: float) -> None:
    poller = zmq.Poller()
    for s in senders:
        poller.register(s.socket, zmq.POLLIN)
    deadline = time.monotonic() + timeout_s
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError(f"decode worker did not acknowledge KV within {timeout_s:.1f}s")
        for sock, _ in poller.poll(int(remaining * 1000)):
            sender = next(s for s in senders if s.socket is sock)
            msg = sender.recv()
            if isinstance(msg, KVRefuse) and msg.request_id == request_id:
                raise KVRefused(msg)
            if isinstance(msg, KVAck) and msg.request_id == request_id and msg.complete:
                return


@dataclass
class _Pending:
    assembler: KVAssembler
    peer: bytes
    started: float
    peers: set = field(default_factory=set)


class KVIngest:
    """The decode side of KV transfers. Call :meth:`handle` with each message from
    ``.socket`` (or :meth:`poll`); it returns the transfers that just completed as
    ``(header, snapshot, peer_node_id)``. ``can_accept(header)`` may return a refusal
    reason string (``"at_capacity"``) to refuse a transfer, or None to take it. Call
    :meth:`expire` periodically (every heartbeat) to drop transfers whose sender died."""

    def __init__(self, ctx: zmq.Context, bind: str, secret: bytes, node_id: str, *, can_accept=None, at_capacity=None, timeout_s: float = 30.0):
        self.receiver = KVReceiver(ctx, bind, secret, node_id, at_capacity=at_capacity)
        self.socket = self.receiver.socket
        self._can_accept = can_accept or (lambda header: None)
        self._timeout_s = timeout_s
        self._pending: dict[bytes, _Pending] = {}
        self._refused: dict[bytes, float] = {}
        self.completed = 0
        self.bytes_received = 0

    @property
    def endpoint(self) -> str:
        return self.receiver.endpoint

    def poll(self, timeout_s: float) -> list[tuple[KVHeader, KVSnapshot, str]]:
        got = self.receiver.recv(timeout_s)
        return [] if got is None else self._on_message(*got)

    def handle(self, frames: list) -> list[tuple[KVHeader, KVSnapshot, str]]:
        got = self.receiver.handle(frames)
        return [] if got is None else self._on_message(*got)

    def _on_message(self, peer: bytes, msg) -> list:
        rid = getattr(msg, "request_id", None)
        if rid in self._refused:
            return []
        try:
            if isinstance(msg, KVHeader):
                return self._on_header(peer, msg)
            if isinstance(msg, KVChunk):
                pending = self._pending.get(rid)
                if pending is None:
                    raise WireError("KV chunk before its header")
                pending.assembler.add(msg)
                pending.peer = peer
                return self._maybe_complete(rid)
            raise WireError(f"unexpected {type(msg).__name__} on the KV ingest socket")
        except WireError as exc:
            log.warning("KV transfer %s from %s failed: %s", rid.hex() if rid else "?", self.receiver.peer_ids.get(peer), exc)
            self._pending.pop(rid, None)
            if rid is not None:
                self._refuse(peer, KVRefuse(rid, "invalid", str(exc)[:200]))
            return []

    def _on_header(self, peer: bytes, header: KVHeader) -> list:
        pending = self._pending.get(header.request_id)
        if pending is not None:
            pending.assembler.update(header)
            pending.peer = peer
            return self._maybe_complete(header.request_id)
        reason = self._can_accept(header)
        if reason:
            self._refuse(peer, KVRefuse(header.request_id, reason, "", 0.05))
            return []
        self._pending[header.request_id] = _Pending(KVAssembler(header), peer, time.monotonic())
        return self._maybe_complete(header.request_id)

    def _maybe_complete(self, rid: bytes) -> list:
        pending = self._pending[rid]
        if not pending.assembler.complete:
            return []
        del self._pending[rid]
        self.completed += 1
        self.bytes_received += pending.assembler.bytes_received
        self.receiver.send(pending.peer, KVAck(rid, True))
        return [(pending.assembler.header, pending.assembler.snapshot(), self.receiver.peer_ids.get(pending.peer, ""))]

    def _refuse(self, peer: bytes, refuse: KVRefuse) -> None:
        self._refused[refuse.request_id] = time.monotonic()
        try:
            self.receiver.send(peer, refuse)
        except WireError:
            pass  # the peer's session is gone; its sender times out

    def expire(self, now: float | None = None) -> list[bytes]:
        """Forget transfers older than the timeout; returns their request ids."""
        now = time.monotonic() if now is None else now
        dead = [rid for rid, p in self._pending.items() if now - p.started > self._timeout_s]
        for rid in dead:
            del self._pending[rid]
        for rid, t in list(self._refused.items()):
            if now - t > self._timeout_s:
                del self._refused[rid]
        return dead

    def close(self) -> None:
        self.receiver.close()


def retain_freed_memory() -> bool:
    """Ask glibc to keep freed memory in the heap instead of returning it to the kernel.

    A KV receiver gets tens to hundreds of MB per transfer in fresh buffers; when glibc
    unmaps them after each transfer, the next one page-faults every 4 KiB again (on the
    development machine ~32,800 faults and ~60 ms of CPU per 134 MB transfer; with this
    call, none after the first). Costs resident memory up to the largest transfer seen.
    The trim threshold is glibc's largest (2 GiB): at 1 GiB, freeing one 1 GB transfer
    (an 8k-token 8B-shaped cache) still handed it back, and the next one faulted again.
    Call once in a decode worker. Returns False where mallopt is unavailable (not glibc)."""
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    m_trim_threshold, m_top_pad, m_mmap_threshold = -1, -2, -3
    ok = mallopt(m_trim_threshold, (1 << 31) - 1) and mallopt(m_top_pad, 256 << 20)
    # 32 MiB is glibc's largest mmap threshold: frames (one layer's K or V) above it stay mmapped.
    return bool(ok and mallopt(m_mmap_threshold, 32 << 20))


class AdaptiveSelector:
    """Picks a strategy per decode peer from measured throughput.

    Small transfers go Full (one round trip beats any overlap). For larger ones every
    candidate is tried once per peer, then the best EWMA of achieved GB/s wins, with one
    exploratory pick of the least recently tried candidate every ``explore_every``
    transfers so a changed link or load is noticed."""

    def __init__(self, *, small_bytes: int = 4 << 20, explore_every: int = 16, alpha: float = 0.3):
        self.small_bytes = small_bytes
        self.explore_every = explore_every
        self.alpha = alpha
        self._gbps: dict[tuple[str, str], float] = {}
        self._last_used: dict[tuple[str, str], int] = {}
        self._count: dict[str, int] = {}

    def choose(self, peer: str, nbytes: int, *, streaming: bool = False) -> str:
        if nbytes < self.small_bytes:
            return "full"
        candidates = ["full", "layer_parallel"] + (["streamed"] if streaming else [])
        n = self._count[peer] = self._count.get(peer, 0) + 1
        untried = [c for c in candidates if (peer, c) not in self._gbps]
        if untried:
            pick = min(untried, key=lambda c: self._last_used.get((peer, c), -1))
        elif n % self.explore_every == 0:
            pick = min(candidates, key=lambda c: self._last_used.get((peer, c), -1))
        else:
            pick = max(candidates, key=lambda c: self._gbps[(peer, c)])
        self._last_used[(peer, pick)] = n
        return pick

    def record(self, peer: str, strategy: str, nbytes: int, seconds: float) -> None:
        if seconds <= 0 or nbytes < self.small_bytes:
            return
        gbps = nbytes / seconds / 1e9
        old = self._gbps.get((peer, strategy))
        self._gbps[(peer, strategy)] = gbps if old is None else old + self.alpha * (gbps - old)

    def bandwidth(self, peer: str) -> float | None:
        """The best measured GB/s to ``peer`` (for stats), or None before any large transfer."""
        rates = [v for (p, _), v in self._gbps.items() if p == peer]
        return max(rates) if rates else None
