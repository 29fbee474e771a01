"""KV handoff between a prefill worker and a decode worker, over the cluster handshake
and AES-256-GCM sealed frames, without ever blocking the worker's IO thread.

The prefill side keeps one or more DEALERs per decode peer (:class:`KVPeer`; LayerParallel
uses several); the decode side has one ROUTER (:class:`KVIngest`) with a handshake
responder per connecting peer. The KV itself is framed by :mod:`tandem.wire.kvframes`
(Full / Streamed / LayerParallel, LZ4, int8/int4) and travels sealed; the header carries
the dispatch attempt the decode side publishes under.

Both sides bound what a handoff may hold and for how long: a prefill worker drops a
snapshot that is not acknowledged within the transfer timeout of its last part, and a
decode worker drops a partial transfer that heard nothing for the same time (a streamed
transfer's sender keeps it alive while its prefill computes), so no KV stays pinned by a
peer that died. Nothing here blocks: a dead decode peer must
not stop a prefill worker's heartbeats. This is the one KV-handoff implementation: the
worker, the tests and bench/kv_transfer.py all move KV through it.
"""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass, field

import zmq

from tandem.kvtypes import KVSnapshot
from tandem.wire import codec
from tandem.wire import messages as M
from tandem.wire.errors import WireError
from tandem.wire.handshake import Initiator, PeerAtCapacity, Responder, error_frames
from tandem.wire.kvchannel import SendArena, send_records
from tandem.wire.kvframes import KVAssembler
from tandem.wire.sockets import make_socket

log = logging.getLogger("tandem.workers.handoff")

KV_HWM = 64
REPLY_HWM = 10_000
# A KV message travels as one ZeroMQ message per sealed record (wire.kvchannel.send_records),
# and the IO thread queues a whole transfer at once without blocking: the prefill side's
# queue must hold every record of the largest transfer (a 1 GB cache is ~260 records).
SEND_HWM = 4096
ARENA_BYTES = 64 << 20


# ---- prefill side ----------------------------------------------------------------------

@dataclass
class Outgoing:
    request_id: bytes
    attempt: int
    decode_node: str
    messages: object  # the messages for one connection, in order (kvframes.iter_snapshot_messages)
    deadline: float
    sent: bool = False
    nbytes: int = 0
    started: float = 0.0
    wire_bytes: int = 0


class KVPeer:
    """One connection to a decode worker: a DEALER, its handshake, its sealed channel."""

    def __init__(self, ctx: zmq.Context, address: str, *, secret: bytes, node_id: str, arena: SendArena | None = None):
        self.address = address
        self.sock = make_socket(ctx, zmq.DEALER, connect=address, hwm=SEND_HWM)
        # Records are sealed into this (shared by a worker's connections; the memory is
        # touched on the first large transfer) and sent zero-copy.
        self._arena = arena if arena is not None else SendArena(ARENA_BYTES)
        self._initiator = Initiator(secret, node_id)
        self.channel = None
        self.peer_id = ""
        self.pending: dict[bytes, Outgoing] = {}
        self.failed: str | None = None
        codec.send(self.sock, self._initiator.hello())

    def queue(self, out: Outgoing) -> None:
        self.pending[out.request_id] = out
        self.flush()

    def extend(self, request_id: bytes, messages, deadline: float) -> bool:
        """More messages for a transfer already queued (a streamed export's next part), with
        a new deadline: the transfer is alive while its parts keep coming. False when it is
        gone (failed, refused or expired: that outcome was reported)."""
        out = self.pending.get(request_id)
        if out is None:
            return False
        out.messages = messages if out.sent else itertools.chain(out.messages, messages)
        out.sent = False
        out.deadline = deadline
        self.flush()
        return True

    def flush(self) -> None:
        if self.channel is None:
            return
        for out in self.pending.values():
            if not out.sent and self.failed:
                out.deadline = 0.0
                out.sent = True
            elif not out.sent:
                try:
                    for msg in out.messages:
                        frames = codec.encode(msg)
                        if isinstance(msg, M.KVChunk):
                            out.wire_bytes += sum(len(codec.as_buffer(f)) for f in msg.frames)
                        # Grouped records, one ZeroMQ message each (wire.kvchannel.send_records): the
                        # decode side opens each record while the rest is in flight.
                        send_records(self.sock, self.channel, frames, self._arena, flags=zmq.NOBLOCK)
                except zmq.Again:
                    # The decode worker is not draining its socket: give up on this transfer
                    # now (the next timer pass reports it) rather than block the IO thread. The
                    # sealed counter has moved past what was sent, so this connection is spent.
                    out.deadline = 0.0
                    self.failed = "KV connection congested"
                out.sent = True
                out.messages = iter(())  # the snapshot can go as soon as libzmq has the frames

    def cancel(self, request_id: bytes, why: str) -> None:
        """Abandon a transfer: a streamed one already open on the decode side is told so
        (KVRefuse from this side), which frees its place there at once, not at its timeout."""
        out = self.pending.pop(request_id, None)
        if out is None or self.channel is None or self.failed:
            return
        try:
            send_records(self.sock, self.channel, codec.encode(M.KVRefuse(request_id, "invalid", why[:1000])),
                         self._arena, flags=zmq.NOBLOCK)
        except zmq.Again:
            self.failed = "KV connection congested"  # the sealed counter moved: this connection is spent

    def on_message(self, frames) -> list[tuple[bytes, object]]:
        """Handle one message from the decode worker; returns [(request_id, KVAck|KVRefuse)]."""
        if self.channel is None:
            try:
                proof, self.channel, self.peer_id = self._initiator.on_challenge(frames)
            except PeerAtCapacity as exc:
                return self._fail_all("at_capacity", str(exc), exc.retry_after_s)
            except WireError as exc:
                return self._fail_all("unauthorized", f"KV handshake with {self.address} failed: {exc}")
            codec.send(self.sock, proof)
            self.flush()
            return []
        try:
            opened = self.channel.open(frames)
            if opened is None:
                return []  # a record of a message still arriving
            msg = codec.decode(opened)
        except WireError as exc:
            return self._fail_all("unauthorized", f"KV channel to {self.address} broke: {exc}")
        if isinstance(msg, (M.KVAck, M.KVRefuse)):
            if isinstance(msg, M.KVRefuse) or msg.complete:
                self.pending.pop(msg.request_id, None)
            return [(msg.request_id, msg)]
        return []

    def _fail_all(self, reason: str, text: str, retry_after: float = 1.0) -> list:
        self.failed = text
        out = [(rid, M.KVRefuse(rid, reason, text[:1000], retry_after)) for rid in self.pending]
        self.pending.clear()
        return out

    def expired(self, now: float) -> list[Outgoing]:
        gone = [o for o in self.pending.values() if o.deadline < now]
        for o in gone:
            del self.pending[o.request_id]
        return gone

    def close(self) -> None:
        self.sock.close(0)


# ---- decode side -----------------------------------------------------------------------

@dataclass
class Incoming:
    header: M.KVHeader
    assembler: KVAssembler
    deadline: float
    peers: set = field(default_factory=set)
    progressive: bool = False  # the receiver imports its blocks as they come (take_parts)

    @property
    def attempt(self) -> int:
        return self.header.attempt


class KVIngest:
    """The decode worker's ROUTER: handshakes, sealed channels, partial transfers."""

    MAX_PENDING_HANDSHAKES = 256
    REFUSED_MEMORY_S = 60.0

    def __init__(self, ctx: zmq.Context, bind: str, *, secret: bytes, node_id: str, timeout_s: float):
        self.sock = make_socket(ctx, zmq.ROUTER, bind=bind, hwm=KV_HWM)
        # Replies (acks, refusals) are small but a busy prefill peer may not read them for
        # a while; a reply dropped at the HWM leaves a gap in the sealed counter and breaks
        # the channel with every transfer on it. (Set before any peer connects: libzmq
        # sizes each pipe when it is created.)
        self.sock.sndhwm = REPLY_HWM
        self.secret, self.node_id, self.timeout_s = secret, node_id, timeout_s
        self._handshakes: dict[bytes, Responder] = {}
        self._channels: dict[bytes, object] = {}
        self._partial: dict[bytes, Incoming] = {}
        self._refused: dict[bytes, float] = {}  # so the other connections of a refused transfer are ignored
        self._cancelled: list[Incoming] = []  # abandoned, refused or cut off; expire() reports them
        self._parts: list[tuple[int, KVSnapshot]] = []  # (attempt, part) of progressive transfers
        self.rejected = 0
        self.bytes_in = 0

    def on_message(self, frames, *, at_capacity) -> list[tuple[bytes, int, M.KVHeader, KVSnapshot | None]]:
        """Returns [(peer, attempt, header, snapshot)]: snapshot None for a new transfer's
        header (the worker accepts or refuses it), set when a transfer completed."""
        peer, rest = codec.split_route(frames)
        channel = self._channels.get(peer)
        if channel is None:
            return self._handshake(peer, rest, at_capacity)
        try:
            opened = channel.open(rest)  # one record of a message; decrypted as it arrives
            if opened is None:
                return []
            msg = codec.decode(opened)
        except WireError as exc:
            self._drop_peer(peer, f"sealed channel rejected a message: {exc}")
            return []
        return self.on_decoded(peer, msg)

    def on_decoded(self, peer: bytes, msg) -> list[tuple[bytes, int, M.KVHeader, KVSnapshot | None]]:
        """:meth:`on_message` for a message already authenticated and decoded (the fuzzer
        feeds this directly): anything a peer sends ends in a result or a refusal."""
        rid = getattr(msg, "request_id", None)
        if rid in self._refused:
            return []
        if isinstance(msg, M.KVHeader):
            inc = self._partial.get(rid)
            if inc is not None and msg.attempt > inc.attempt:
                # The request moved on (its prefill worker died, the broker dispatched it
                # again): the newer attempt's transfer replaces what the old one left.
                del self._partial[rid]
                self._cancelled.append(inc)
                inc = None
            if inc is not None and msg.attempt < inc.attempt:
                # A late header of an attempt already replaced: refused, the newer one goes on.
                self.reply(peer, M.KVRefuse(rid, "invalid", "a newer attempt of this request is arriving"))
                return []
            if inc is not None:
                # Another connection's copy (LayerParallel), or a progressive transfer's
                # later header: same geometry and attempt; the newest token state wins,
                # and only a final header completes the transfer.
                try:
                    inc.assembler.update(msg)
                except WireError as exc:
                    self.refuse(peer, rid, "invalid", str(exc))
                    return []
                inc.header = inc.assembler.header
                inc.peers.add(peer)
                inc.deadline = time.monotonic() + self.timeout_s  # a streamed transfer's keep-alive, or its end
                return self._maybe_complete(peer, inc)
            try:
                assembler = KVAssembler(msg)
            except WireError as exc:
                self.refuse(peer, rid, "invalid", str(exc))
                return []
            self._partial[rid] = Incoming(msg, assembler, time.monotonic() + self.timeout_s, {peer})
            return [(peer, msg.attempt, msg, None)] + self._maybe_complete(peer, self._partial[rid])
        if isinstance(msg, M.KVRefuse):  # the sender abandons the transfer (its request ended or went)
            inc = self._partial.get(rid)
            if inc is not None and peer in inc.peers:
                del self._partial[rid]
                self._cancelled.append(inc)
            return []
        if isinstance(msg, M.KVChunk):
            inc = self._partial.get(rid)
            if inc is None or peer not in inc.peers:
                return []  # refused or expired earlier: drop the data
            try:
                inc.assembler.add(msg)
            except WireError as exc:
                self.refuse(peer, rid, "invalid", str(exc))
                return []
            self.bytes_in += sum(len(codec.as_buffer(f)) for f in msg.frames)
            # A transfer that makes progress lives on: a streamed one lasts as long as its
            # prompt's prefill, and each chunk can only bring cells not seen before.
            inc.deadline = time.monotonic() + self.timeout_s
            if inc.progressive and not inc.assembler.complete:
                part = inc.assembler.take_ready()
                if part is not None:
                    self._parts.append((inc.attempt, part))
            return self._maybe_complete(peer, inc)
        return []

    def _maybe_complete(self, peer: bytes, inc: Incoming) -> list:
        if not inc.assembler.complete:
            return []
        rid = inc.header.request_id
        del self._partial[rid]
        try:
            snap = inc.assembler.snapshot()
        except WireError as exc:
            self.refuse(peer, rid, "invalid", str(exc))
            return []
        return [(peer, inc.attempt, inc.header, snap)]

    def _handshake(self, peer: bytes, frames, at_capacity) -> list:
        responder = self._handshakes.get(peer)
        try:
            if responder is None:
                if len(self._handshakes) >= self.MAX_PENDING_HANDSHAKES:
                    return []
                responder = Responder(self.secret, self.node_id)
                self._handshakes[peer] = responder
                codec.send(self.sock, [peer, *responder.on_hello(frames, at_capacity=at_capacity())])
                if not responder.accepted:
                    del self._handshakes[peer]
            else:
                del self._handshakes[peer]
                self._channels[peer] = responder.on_proof(frames)
        except WireError as exc:
            self._handshakes.pop(peer, None)
            self.rejected += 1
            log.warning("refused a KV peer: %s", exc)
            try:
                codec.send(self.sock, [peer, *error_frames()], flags=zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
        return []

    def _drop_peer(self, peer: bytes, why: str) -> None:
        log.warning("dropping KV peer: %s", why)
        self.rejected += 1
        self._channels.pop(peer, None)
        for rid in [r for r, inc in self._partial.items() if peer in inc.peers]:
            self._cancelled.append(self._partial.pop(rid))

    def refuse(self, peer: bytes, rid: bytes, reason: str, text: str, retry_after: float = 0.0) -> None:
        inc = self._partial.pop(rid, None)
        if inc is not None:
            self._cancelled.append(inc)
        self._refused[rid] = time.monotonic() + self.REFUSED_MEMORY_S
        self.reply(peer, M.KVRefuse(rid, reason, text[:1000], retry_after))

    def discard(self, request_id: bytes) -> None:
        """Forget a transfer (its request was aborted here): nothing is reported."""
        self._partial.pop(request_id, None)

    def import_progressively(self, request_id: bytes) -> None:
        """Hand out the blocks of this open transfer as they complete (:meth:`take_parts`),
        so its receiver copies them while the rest is on its way (the completed transfer's
        snapshot still holds them all)."""
        inc = self._partial.get(request_id)
        if inc is not None:
            inc.progressive = True

    def take_parts(self) -> list[tuple[int, KVSnapshot]]:
        """(attempt, part) of the progressive transfers' blocks completed since the last call."""
        parts, self._parts = self._parts, []
        return parts

    def reply(self, peer: bytes, msg) -> None:
        channel = self._channels.get(peer)
        if channel is None:
            return
        try:
            codec.send(self.sock, [peer, *channel.seal(codec.encode(msg))], flags=zmq.NOBLOCK)
        except zmq.ZMQError:
            pass

    def expire(self, now: float) -> list[Incoming]:
        """Partial transfers dropped: past their deadline, abandoned by their sender,
        refused, cut off with their connection, or replaced by a newer attempt's."""
        gone = [inc for inc in self._partial.values() if inc.deadline < now]
        for inc in gone:
            del self._partial[inc.header.request_id]
        gone += self._cancelled
        self._cancelled = []
        for rid in [r for r, t in self._refused.items() if t < now]:
            del self._refused[rid]
        return gone

    @property
    def partial(self) -> int:
        return len(self._partial)

    def close(self) -> None:
        self.sock.close(0)
