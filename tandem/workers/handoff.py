"""KV handoff between a prefill worker and a decode worker, over the cluster handshake
and AES-256-GCM sealed frames.

The prefill side keeps one DEALER per decode peer (:class:`KVPeer`); the decode side has
one ROUTER (:class:`KVIngest`) with a handshake responder per connecting peer. After the
handshake every message is sealed; inside, a message is ``[meta, header, *payload]``
where ``meta`` is one byte: the dispatch attempt the decode side must publish under.
# TODO(wire): KVHeader has no attempt field; the meta frame carries it until it does.

Both sides bound what a handoff may hold and for how long: a prefill worker drops a
snapshot that is not acknowledged within the transfer timeout, and a decode worker
drops a partial transfer after the same time, so no KV stays pinned by a peer that died.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import numpy as np
import zmq

from tandem.kvtypes import KVSnapshot
from tandem.wire import codec
from tandem.wire import messages as M
from tandem.wire.errors import AuthError, WireError
from tandem.wire.handshake import Initiator, PeerAtCapacity, Responder, error_frames
from tandem.wire.sockets import make_socket

log = logging.getLogger("tandem.workers.handoff")

_NP_DTYPES = {"float16": np.float16, "bfloat16": np.uint16, "float32": np.float32}


# ---- snapshot <-> messages (Full strategy: one header, one chunk with every layer) ----------
# TODO(wire): switch to the wire layer's KV framing (Streamed / LayerParallel, lz4, int8/int4)
# once it lands; this is the uncompressed Full layout of the same messages.

def snapshot_messages(snap: KVSnapshot, *, stream_seq: int, priority: int) -> list:
    num_blocks = snap.keys[0].shape[0] if snap.keys else 0
    header = M.KVHeader(
        snap.request_id, snap.model_id, snap.block_size, snap.num_layers, snap.num_kv_heads, snap.head_dim,
        snap.dtype, list(snap.tokens), snap.num_computed, snap.prompt_len, snap.sampling, snap.num_generated,
        snap.num_cached_prompt_tokens, num_blocks, "none", "none", "full", stream_seq, priority)
    frames = []
    for k, v in zip(snap.keys, snap.values):
        frames.append(np.ascontiguousarray(k).data)
        frames.append(np.ascontiguousarray(v).data)
    chunk = M.KVChunk(snap.request_id, 0, 0, snap.num_layers, 0, num_blocks, True, frames)
    return [header, chunk]


def assemble(header: M.KVHeader, chunks: list[M.KVChunk]) -> KVSnapshot:
    """Rebuild a snapshot; raises WireError if the chunks do not match the header."""
    dtype = np.dtype(_NP_DTYPES[header.dtype])
    shape = (header.num_blocks, header.num_kv_heads, header.block_size, header.head_dim)
    need = int(np.prod(shape)) * dtype.itemsize
    keys: list = [None] * header.num_layers
    values: list = [None] * header.num_layers
    for c in chunks:
        if c.layer_end > header.num_layers or c.layer_start >= c.layer_end or (c.block_start, c.block_end) != (0, header.num_blocks):
            raise WireError("KV chunk outside the header's geometry", "kv_geometry")
        if len(c.frames) != 2 * (c.layer_end - c.layer_start):
            raise WireError("KV chunk frame count does not match its layers", "kv_geometry")
        for i, layer in enumerate(range(c.layer_start, c.layer_end)):
            kf, vf = c.frames[2 * i], c.frames[2 * i + 1]
            if len(kf) != need or len(vf) != need:
                raise WireError(f"KV layer {layer}: {len(kf)}/{len(vf)} bytes, expected {need}", "kv_size")
            keys[layer] = np.frombuffer(kf, dtype=dtype).reshape(shape)
            values[layer] = np.frombuffer(vf, dtype=dtype).reshape(shape)
    if any(k is None for k in keys):
        raise WireError("KV transfer is missing layers", "kv_incomplete")
    if header.num_computed > header.num_blocks * header.block_size or header.num_computed > len(header.tokens):
        raise WireError("KV header counts are inconsistent", "kv_geometry")
    return KVSnapshot(header.request_id, header.model, header.block_size, header.num_layers, header.num_kv_heads,
                      header.head_dim, header.dtype, list(header.tokens), header.num_computed, header.prompt_len,
                      keys, values, header.sampling, header.num_generated, header.num_cached_prompt_tokens)


def seal(channel, attempt: int, msg) -> list:
    return channel.seal([bytes((attempt,)), *codec.encode(msg)])


def unseal(channel, frames) -> tuple[int, object]:
    inner = channel.open(frames)
    if len(inner) < 2 or len(inner[0]) != 1:
        raise WireError("KV message without its attempt frame", "frames")
    return inner[0][0], codec.decode(inner[1:])


# ---- prefill side ----------------------------------------------------------------------

@dataclass
class Outgoing:
    request_id: bytes
    attempt: int
    decode_node: str
    messages: list
    deadline: float
    sent: bool = False
    nbytes: int = 0
    started: float = 0.0


class KVPeer:
    """One decode worker as seen from a prefill worker: a DEALER, its handshake, its channel."""

    def __init__(self, ctx: zmq.Context, address: str, *, secret: bytes, node_id: str):
        self.address = address
        self.sock = make_socket(ctx, zmq.DEALER, connect=address, hwm=1000)
        self._initiator = Initiator(secret, node_id)
        self.channel = None
        self.peer_id = ""
        self.pending: dict[bytes, Outgoing] = {}
        self.failed: str | None = None
        self.retry_at = 0.0
        codec.send(self.sock, self._initiator.hello())

    def queue(self, out: Outgoing) -> None:
        self.pending[out.request_id] = out
        self.flush()

    def flush(self) -> None:
        if self.channel is None:
            return
        for out in self.pending.values():
            if not out.sent:
                for msg in out.messages:
                    codec.send(self.sock, seal(self.channel, out.attempt, msg))
                out.sent = True
                out.messages = []  # the snapshot's memory can go as soon as libzmq has it

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
            _, msg = unseal(self.channel, frames)
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
    attempt: int
    peer: bytes
    deadline: float
    chunks: list = field(default_factory=list)


class KVIngest:
    """The decode worker's ROUTER: handshakes, sealed channels, partial transfers."""

    MAX_PENDING_HANDSHAKES = 256

    def __init__(self, ctx: zmq.Context, bind: str, *, secret: bytes, node_id: str, timeout_s: float):
        self.sock = make_socket(ctx, zmq.ROUTER, bind=bind, hwm=1000)
        self.secret, self.node_id, self.timeout_s = secret, node_id, timeout_s
        self._handshakes: dict[bytes, Responder] = {}
        self._channels: dict[bytes, object] = {}
        self._partial: dict[bytes, Incoming] = {}
        self.rejected = 0
        self.bytes_in = 0

    def on_message(self, frames, *, at_capacity) -> list[tuple[bytes, int, M.KVHeader, KVSnapshot | None]]:
        """Returns completed transfers [(peer, attempt, header, snapshot)]; headers also
        come back alone (snapshot None) so the worker can decide to refuse early."""
        peer, rest = codec.split_route(frames)
        channel = self._channels.get(peer)
        if channel is None:
            return self._handshake(peer, rest, at_capacity)
        try:
            attempt, msg = unseal(channel, rest)
        except WireError as exc:
            self._drop_peer(peer, f"sealed channel rejected a message: {exc}")
            return []
        now = time.monotonic()
        if isinstance(msg, M.KVHeader):
            self._partial[msg.request_id] = Incoming(msg, attempt, peer, now + self.timeout_s)
            return [(peer, attempt, msg, None)]
        if isinstance(msg, M.KVChunk):
            inc = self._partial.get(msg.request_id)
            if inc is None or inc.peer != peer:
                return []  # refused or expired earlier: drop the data
            self.bytes_in += sum(len(f) for f in msg.frames)
            inc.chunks.append(msg)
            if msg.last:
                del self._partial[msg.request_id]
                try:
                    snap = assemble(inc.header, inc.chunks)
                except WireError as exc:
                    self.reply(peer, inc.attempt, M.KVRefuse(msg.request_id, "invalid", str(exc)[:1000]))
                    return []
                return [(peer, inc.attempt, inc.header, snap)]
        return []

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
        except (WireError, AuthError) as exc:
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
        for rid in [r for r, inc in self._partial.items() if inc.peer == peer]:
            del self._partial[rid]

    def discard(self, request_id: bytes) -> None:
        self._partial.pop(request_id, None)

    def reply(self, peer: bytes, attempt: int, msg) -> None:
        channel = self._channels.get(peer)
        if channel is None:
            return
        try:
            codec.send(self.sock, [peer, *seal(channel, attempt, msg)], flags=zmq.NOBLOCK)
        except zmq.ZMQError:
            pass

    def expire(self, now: float) -> list[Incoming]:
        gone = [inc for inc in self._partial.values() if inc.deadline < now]
        for inc in gone:
            del self._partial[inc.header.request_id]
        return gone

    @property
    def partial(self) -> int:
        return len(self._partial)

    def close(self) -> None:
        self.sock.close(0)
