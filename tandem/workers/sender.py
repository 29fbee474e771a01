"""The prefill side of KV handoffs: connections per decode peer, strategy choice, acks,
timeouts. Owned by the worker's IO thread; nothing here blocks.

:meth:`HandoffSender.start` queues one snapshot (over one connection, or several for
LayerParallel); the worker feeds every message from a peer socket to :meth:`on_message`
and calls :meth:`expired` from its timers. Each returns outcomes: ``(request_id, None)``
for a transfer the decode worker fully ingested, ``(request_id, reason)`` for one that
failed (refused, broken channel, no acknowledgement in time).
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass

import zmq

from tandem.kvtypes import KVSnapshot
from tandem.wire import messages as M
from tandem.wire.kvchannel import SendArena
from tandem.wire.kvframes import KVOptions, iter_snapshot_messages, make_header, part_messages
from tandem.wire.settings import TransferSettings
from tandem.workers.handoff import ARENA_BYTES, KVPeer, Outgoing

log = logging.getLogger("tandem.workers.sender")


class AdaptiveSelector:
    """Picks a strategy per decode peer from measured throughput.

    Small transfers go Full (one round trip beats any overlap). For larger ones every
    candidate (Streamed too, for a prompt of several prefill chunks) is tried once per
    peer, then the best EWMA of bytes over the time from the prefill's end to the decode
    side's acknowledgement wins (what the handoff adds to the request), with one
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
        """The best measured GB/s to ``peer`` (for stats), or None before any large transfer.
        Streamed's rate is not one: its bytes over the time left after the prefill."""
        rates = [v for (p, s), v in self._gbps.items() if p == peer and s != "streamed"]
        return max(rates) if rates else None


@dataclass
class _Transfer:
    started: float  # when what is left to send after the prefill was queued
    nbytes: int
    strategy: str
    address: str
    decode_node: str
    next_index: int = 0  # streamed: the next chunk's number
    parts: int = 1  # streamed: parts sent (more than one: sent during the prefill)
    header: M.KVHeader | None = None  # streamed, until the final part: the opening header
    last_sent: float = 0.0  # streamed: when the decode side last heard of this transfer


class HandoffSender:
    def __init__(self, ctx: zmq.Context, *, secret: bytes | None, node_id: str, transfer: TransferSettings,
                 timeout_s: float, poller: zmq.Poller):
        self.ctx, self.secret, self.node_id = ctx, secret, node_id
        self.transfer, self.timeout_s, self.poller = transfer, timeout_s, poller
        self.selector = AdaptiveSelector()
        self.arena = SendArena(ARENA_BYTES)  # one for every connection: all are used from the IO thread
        self.peers: dict[tuple[str, int], KVPeer] = {}
        self._by_sock: dict[zmq.Socket, KVPeer] = {}
        self._transfers: dict[bytes, _Transfer] = {}
        self.counters = {"handoffs": 0, "handoff_failures": 0, "handoff_bytes": 0, "handoff_ms": 0.0}

    def peer_for(self, sock) -> KVPeer | None:
        return self._by_sock.get(sock)

    def _peer(self, address: str, index: int) -> KVPeer:
        key = (address, index)
        peer = self.peers.get(key)
        if peer is not None and peer.failed and not peer.pending:
            # A broken or refused connection: start over with a fresh handshake.
            self.poller.unregister(peer.sock)
            del self._by_sock[peer.sock]
            peer.close()
            peer = None
        if peer is None:
            if self.secret is None:
                raise ValueError("KV handoff needs the cluster secret")
            peer = self.peers[key] = KVPeer(self.ctx, address, secret=self.secret, node_id=self.node_id, arena=self.arena)
            self._by_sock[peer.sock] = peer
            self.poller.register(peer.sock, zmq.POLLIN)
        return peer

    def choose(self, address: str, nbytes: int, *, streaming: bool) -> str:
        """The strategy of one handoff, picked when its prefill is dispatched: ``streaming``
        when the prompt spans several prefill chunks, so its KV can be sent as they are
        written (the Streamed strategy then sends during the prefill)."""
        t = self.transfer
        return self.selector.choose(address, nbytes, streaming=streaming) if t.strategy == "adaptive" else t.strategy

    def _options(self, strategy: str) -> KVOptions:
        t = self.transfer
        return KVOptions(compression=t.compression, quantization=t.quantization, strategy=strategy,
                         blocks_per_chunk=t.blocks_per_chunk, connections=t.connections)

    def start(self, snap: KVSnapshot, *, attempt: int, decode_node: str, address: str, stream_seq: int, priority: int,
              strategy: str | None = None) -> None:
        """Send a whole snapshot (after the prefill), with ``strategy`` (None: choose now)."""
        options = self._options(strategy or self.choose(address, snap.nbytes, streaming=False))
        per_conn = iter_snapshot_messages(snap, options, stream_seq=stream_seq, priority=priority, attempt=attempt)
        now = time.monotonic()
        self._transfers[snap.request_id] = _Transfer(now, snap.nbytes, options.strategy, address, decode_node)
        for i, msgs in enumerate(per_conn):
            out = Outgoing(snap.request_id, attempt, decode_node, msgs, now + self.timeout_s, nbytes=snap.nbytes, started=now)
            self._peer(address, i).queue(out)

    def stream(self, part: KVSnapshot, *, final: bool, attempt: int, decode_node: str, address: str, stream_seq: int,
               priority: int) -> None:
        """Send one part of a streamed export (kvframes.part_messages) on the peer's first
        connection: the first opens the transfer, each further one extends it, the final
        one carries the sampled token and completes it. Until the final part the transfer
        has no deadline here (the prefill is computing; aborts and ended requests cancel
        it) and :meth:`expired` keeps it alive on the decode side; after the final part
        the decode side has the transfer timeout to acknowledge it, as for the others. A
        part for a transfer that failed meanwhile is dropped (its failure was reported)."""
        rid, now = part.request_id, time.monotonic()
        t = self._transfers.get(rid)
        opening = t is None
        if opening:
            if part.first_block:
                return  # its opening part failed and was forgotten
            t = self._transfers[rid] = _Transfer(now, 0, "streamed", address, decode_node)
        options = self._options("streamed")
        header = None
        if opening or final:
            header = make_header(part, options, stream_seq=stream_seq, priority=priority, attempt=attempt, final=final)
        msgs, n = part_messages(part, options, first_index=t.next_index, header=header)
        t.next_index += n
        t.parts += not opening
        t.nbytes += part.nbytes
        t.header = None if final else (header or t.header)
        t.last_sent = now
        if final:
            t.started = now  # the selector compares what each strategy leaves after the prefill
        deadline = now + self.timeout_s if final else math.inf
        if opening:
            self._peer(address, 0).queue(Outgoing(rid, attempt, decode_node, msgs, deadline, started=now))
        else:
            peer = self.peers.get((address, 0))
            if peer is not None:
                peer.extend(rid, msgs, deadline)

    def _keep_alive(self, now: float) -> None:
        """A streamed transfer whose prefill computes a chunk for longer than the decode
        side's timeout (a large model on the CPU) must not be dropped there: its opening
        header again, a quarter of the timeout after the last message, says it lives."""
        for rid, t in self._transfers.items():
            if t.header is not None and now - t.last_sent >= self.timeout_s / 4:
                peer = self.peers.get((t.address, 0))
                if peer is not None and peer.extend(rid, iter([t.header]), math.inf):
                    t.last_sent = now

    def cancel(self, rid: bytes, why: str) -> None:
        """Abandon a transfer and tell the decode side (a streamed one is open there
        before the prefill ends)."""
        t = self._transfers.pop(rid, None)
        if t is not None:
            for (address, _), peer in self.peers.items():
                if address == t.address:
                    peer.cancel(rid, why)
        self.forget(rid)

    def forget(self, rid: bytes) -> None:
        self._transfers.pop(rid, None)
        for peer in self.peers.values():
            peer.pending.pop(rid, None)

    def on_message(self, peer: KVPeer, frames) -> list[tuple[bytes, str | None]]:
        out = []
        for rid, verdict in peer.on_message(list(frames)):
            if rid not in self._transfers:
                continue
            if isinstance(verdict, M.KVAck):
                if verdict.complete:
                    self._completed(rid)
                    out.append((rid, None))
            else:
                t = self._transfers[rid]
                out.append((rid, self._failed(rid, f"decode worker {t.decode_node} refused the KV: {verdict.message or verdict.reason}")))
        return out

    def expired(self, now: float) -> list[tuple[bytes, str]]:
        self._keep_alive(now)
        out = []
        for peer in list(self.peers.values()):
            for o in peer.expired(now):
                if o.request_id in self._transfers:
                    out.append((o.request_id, self._failed(
                        o.request_id, f"KV handoff to {o.decode_node} not acknowledged in {self.timeout_s:.1f}s")))
        return out

    def _completed(self, rid: bytes) -> None:
        t = self._transfers.pop(rid)
        self.forget(rid)
        secs = time.monotonic() - t.started
        self.selector.record(t.address, t.strategy, t.nbytes, secs)
        self.counters["handoffs"] += 1
        self.counters["handoff_bytes"] += t.nbytes
        self.counters["handoff_ms"] += secs * 1000
        log.debug("handoff %s: %d KV bytes to %s in %.2f ms (%s, %d parts)", rid.hex(), t.nbytes, t.decode_node, secs * 1000,
                  t.strategy, t.parts)

    def _failed(self, rid: bytes, why: str) -> str:
        self.forget(rid)
        self.counters["handoff_failures"] += 1
        return why

    def close(self) -> None:
        for peer in self.peers.values():
            peer.close()
