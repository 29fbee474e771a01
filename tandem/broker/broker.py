"""The broker process: poll -> route -> purge expired -> heartbeat, on five sockets.

``frontend`` (ROUTER) takes clients and the edge; ``backend`` (ROUTER) takes workers;
``stream_in`` (XSUB) receives every worker's token batches (one per engine step) and
``stream_out`` (XPUB) sends each client its entries of a poll round in one batch on the
client's stream topic (per request on the request's topic for a SUBMIT without one):
proxying by hand instead of ``zmq.proxy`` is what lets the broker see each request's
progress (for migration) and each subscription (XPUB_VERBOSE, so it dispatches only
after the client's SUB is in place and the first token cannot be dropped). ``stats``
(ROUTER) answers StatsRequest.
"""

from __future__ import annotations

import gc
import logging
import math
from collections import deque
import threading
import time

import zmq

from tandem.broker import frames as F
from tandem.broker.dispatcher import Dispatcher
from tandem.broker.settings import BrokerSettings
from tandem.broker.stats import snapshot
from tandem.broker.throughput import ThroughputLog
from tandem.wire import messages as M
from tandem.wire.errors import WireError
from tandem.wire.codec import batch_headers, stream_entry
from tandem.wire.protocol import CLIENT_STREAM_BYTES, REQUEST_ID_BYTES, STREAM_BATCH_TOPIC, STREAM_PING_TOPIC
from tandem.wire.sockets import bound_endpoint, make_socket

log = logging.getLogger("tandem.broker")

BATCH = 256  # messages taken from one socket before looking at the others (fairness)
TICK_S = 0.05
# Plain ints: pyzmq's flag enums cost an Enum.__or__/__call__ per use on the hot path.
_NOBLOCK = int(zmq.NOBLOCK)
_MORE_NOBLOCK = int(zmq.NOBLOCK | zmq.SNDMORE)
# The Cython socket methods: the sugar layer's send/recv add Python-level argument
# handling to every frame, and its get() builds a SocketOption enum per RCVMORE check.
_send_frame = zmq.backend.Socket.send
_recv_frame = zmq.backend.Socket.recv
# Generation-0 collections every 700 allocations walk every young Job, message and
# frame; a long-running broker allocates a few objects per message and frees them at
# once (reference counting), so collect far less often.
GC_THRESHOLD0 = 50_000
_EMPTY_BATCH = F.encode(M.TokenBatch([]))


def _discard_rest(sock: zmq.Socket, frame) -> None:
    """Throw away the remaining frames of a message of the wrong shape (one at a time:
    nothing accumulates however many frames a peer sends)."""
    while frame.more:
        frame = _recv_frame(sock, 0, False)


class Broker:
    def __init__(self, settings: BrokerSettings, *, secret: bytes | None, ctx: zmq.Context | None = None):
        self.s = settings
        self.secret = secret
        self.ctx = ctx or zmq.Context.instance()
        self._stop = threading.Event()
        self._outbox: list = []
        self._batches: dict[bytes, list[bytes]] = {}  # client stream topic -> packed entries of this round
        self._version_warned = float("-inf")  # when a node of another version was last reported
        self.last_loop = time.monotonic()  # the loop's liveness (systemd watchdog)
        # How long each poll round that had work took, from poll's return to the last send:
        # the latency the broker itself adds to any message in that round.
        self.round_s: deque[float] = deque(maxlen=10_000)
        self.busy_rounds = 0  # poll rounds that had work: requests per round is the batching achieved
        self.dispatcher = Dispatcher(settings, to_worker=self._to_worker, to_client=self._to_client, publish=self._publish,
                                     to_worker_raw=self._to_worker_raw)
        self.throughput = ThroughputLog(settings.log_stats_interval_s)
        sec = secret
        self.frontend = make_socket(self.ctx, zmq.ROUTER, bind=settings.frontend, security=sec)
        self.backend = make_socket(self.ctx, zmq.ROUTER, bind=settings.backend, security=sec)
        self.stream_in = make_socket(self.ctx, zmq.XSUB, bind=settings.stream_in, security=sec, hwm=100_000)
        self.stream_out = make_socket(self.ctx, zmq.XPUB, bind=settings.stream_out, security=sec, xpub_verbose=True, hwm=100_000)
        self.stats_sock = make_socket(self.ctx, zmq.ROUTER, bind=settings.stats, security=sec)
        # Take every worker message: the broker itself is the subscriber that matters.
        self.stream_in.send(b"\x01")
        self.endpoints = {name: bound_endpoint(getattr(self, attr)) for name, attr in
                          (("frontend", "frontend"), ("backend", "backend"), ("stream_in", "stream_in"),
                           ("stream_out", "stream_out"), ("stats", "stats_sock"))}

    # ---- outputs the dispatcher uses ------------------------------------------------------
    # Replies are queued and sent together after each poll round: a send into an idle
    # pipe wakes libzmq's I/O thread (a syscall and, on a busy machine, a context switch),
    # a burst pays that once.
    def _send(self, sock, identity: bytes, msg) -> None:
        self._outbox.append((sock, (identity, F.encode(msg))))

    def _to_worker(self, identity: bytes, msg) -> None:
        self._outbox.append((self.backend, (identity, F.encode(msg))))

    def _to_worker_raw(self, identity: bytes, head: bytes) -> None:
        self._outbox.append((self.backend, (identity, head)))

    def _to_client(self, identity: bytes, msg) -> None:
        self._outbox.append((self.frontend, (identity, F.encode(msg))))

    def _publish(self, msg: M.TokenMessage, job=None) -> None:
        """A stream message the broker writes (a patched final, an error end): to its
        client's stream in that client's next batch, or on the request's own topic."""
        job = job or self.dispatcher.jobs.get(msg.request_id)
        if job is not None and job.stream is not None:
            self._batches.setdefault(job.stream, []).append(stream_entry(0, msg))
        else:
            self._outbox.append((self.stream_out, (msg.request_id, F.encode(msg))))

    def _flush(self) -> None:
        if self._batches:
            # One message per client stream per round, holding every entry for that client.
            batches, self._batches = self._batches, {}
            for topic, entries in batches.items():
                for head in batch_headers(entries) if entries else (_EMPTY_BATCH,):
                    self._outbox.append((self.stream_out, (topic, head)))
        out, self._outbox = self._outbox, []
        for sock, frames in out:
            # Every frame here is a small header or identity: copied sends (zero-copy
            # only pays above ~64 KB). A ROUTER fails (ROUTER_MANDATORY) or blocks on
            # the first frame or not at all, so a failure never leaves half a message.
            try:
                # Every message the broker sends is two frames: identity or topic, header.
                _send_frame(sock, frames[0], _MORE_NOBLOCK)
                _send_frame(sock, frames[1], _NOBLOCK)
            except zmq.ZMQError as exc:
                # ROUTER_MANDATORY: the peer is gone (or its pipe is full). The heartbeat
                # deadline deals with dead workers; a vanished client just loses its reply.
                self.dispatcher.counters["unroutable"] += 1
                log.debug("could not send to %r: %s", frames[0][:32], exc)

    # ---- the loop ------------------------------------------------------------------------------
    def stop(self) -> None:
        self._stop.set()

    def alive(self) -> bool:
        return time.monotonic() - self.last_loop < 5.0

    def run(self) -> None:
        poller = zmq.Poller()
        handlers = {
            self.frontend: self._on_frontend,
            self.backend: self._on_backend,
            self.stream_in: self._on_stream_in,
            self.stream_out: self._on_stream_out,
            self.stats_sock: self._on_stats,
        }
        for sock in handlers:
            poller.register(sock, zmq.POLLIN)
        log.info("broker up: %s", ", ".join(f"{k}={v}" for k, v in self.endpoints.items()))
        # Everything allocated so far (modules, sockets, settings) lives for the whole
        # run: move it out of the collector's view so no collection walks it again.
        gc.collect()
        gc.freeze()
        gc.set_threshold(GC_THRESHOLD0, *gc.get_threshold()[1:])
        self.last_loop = time.monotonic()
        next_tick = self.last_loop + TICK_S
        # Every message the broker takes has a fixed shape, so each socket is drained by a
        # reader of that shape: [identity, header] on the ROUTERs, [topic, header] on the
        # XSUB, one subscription frame on the XPUB. Anything else is counted and dropped.
        readers = {
            self.frontend: (self._read_routed, self._on_frontend),
            self.backend: (self._read_routed, self._on_backend),
            self.stats_sock: (self._read_routed, self._on_stats),
            self.stream_in: (self._read_pair, self._on_stream_in),
            self.stream_out: (self._read_single, self._on_stream_out),
        }
        try:
            while not self._stop.is_set():
                # Whole milliseconds, rounded up: a float timeout is truncated, and under
                # 1 ms that is 0, which spun the loop for the last millisecond before each
                # tick, taking a core from the processes the next message comes from.
                timeout = max(0.0, next_tick - self.last_loop)
                events = poller.poll(math.ceil(timeout * 1000))
                started = time.monotonic()
                for sock, _ in events:
                    read, handler = readers[sock]
                    read(sock, handler)
                now = time.monotonic()
                if now >= next_tick:
                    self.dispatcher.tick()
                    next_tick = now + TICK_S
                    line = self.throughput.line(self.dispatcher)
                    if line:
                        log.info("%s", line)
                self._flush()
                self.last_loop = time.monotonic()
                if events:
                    self.round_s.append(self.last_loop - started)
                    self.busy_rounds += 1
        finally:
            self.close()

    # Each reader takes up to BATCH messages from one socket (fairness), without blocking.
    def _bad_shape(self, sock, frame, counter: str = "bad_messages") -> None:
        _discard_rest(sock, frame)
        self.dispatcher.counters[counter] += 1

    def _read_routed(self, sock, handler) -> None:
        for _ in range(BATCH):
            try:
                # A ROUTER always delivers the routing identity and at least one more frame.
                identity = _recv_frame(sock, _NOBLOCK)
            except zmq.Again:
                return
            frame = _recv_frame(sock, 0, False)
            if frame.more:
                self._bad_shape(sock, frame)
                continue
            handler(identity, frame.bytes)

    def _read_pair(self, sock, handler) -> None:
        for _ in range(BATCH):
            try:
                first = _recv_frame(sock, _NOBLOCK, False)
            except zmq.Again:
                return
            if not first.more:
                self.dispatcher.counters["bad_stream_messages"] += 1
                continue
            frame = _recv_frame(sock, 0, False)
            if frame.more:
                self._bad_shape(sock, frame, "bad_stream_messages")
                continue
            handler(first.bytes, frame.bytes)

    def _read_single(self, sock, handler) -> None:
        for _ in range(BATCH):
            try:
                frame = _recv_frame(sock, _NOBLOCK, False)
            except zmq.Again:
                return
            if frame.more:
                self._bad_shape(sock, frame)
                continue
            handler(frame.bytes)

    def close(self) -> None:
        for sock in (self.frontend, self.backend, self.stream_in, self.stream_out, self.stats_sock):
            sock.close(0)

    # ---- handlers ---------------------------------------------------------------------------
    def _malformed(self, exc: WireError) -> None:
        self.dispatcher.counters["bad_messages"] += 1
        now = time.monotonic()
        if exc.reason == "version" and now - self._version_warned >= 60.0:
            # A node of another tandem version is never served: say so where operators look.
            self._version_warned = now
            log.warning("dropped a message from a node of another version (%s)", exc)
        else:
            log.debug("dropped a malformed message: %s", exc)

    def _decode(self, head: bytes):
        try:
            return F.decode(head)
        except WireError as exc:
            self._malformed(exc)
            return None

    def _on_frontend(self, identity: bytes, head: bytes) -> None:
        try:
            msg = F.decode(head)
        except WireError as exc:
            self._malformed(exc)
            return
        cls = type(msg)
        if cls is M.Submit:
            self.dispatcher.submit(identity, msg, F.submit_tail(head, msg.stream))
        elif cls is M.Abort:
            self.dispatcher.abort(msg.request_id)
        elif cls is M.StatsRequest:
            self._to_client(identity, M.StatsReply(self._snapshot(msg)))
        else:
            self.dispatcher.counters["unexpected_client_messages"] += 1

    def _snapshot(self, msg: M.StatsRequest) -> dict:
        return snapshot(self.dispatcher, verbose=self.s.stats_verbose and msg.verbose, rounds_s=list(self.round_s),
                        busy_rounds=self.busy_rounds)

    def _on_backend(self, identity: bytes, head: bytes) -> None:
        try:
            msg = F.decode(head)
        except WireError as exc:
            self._malformed(exc)
            return
        self.dispatcher.worker_message(identity, msg)

    def _on_stats(self, identity: bytes, head: bytes) -> None:
        msg = self._decode(head)
        if type(msg) is M.StatsRequest:
            self._send(self.stats_sock, identity, M.StatsReply(self._snapshot(msg)))

    def _on_stream_out(self, event: bytes) -> None:
        # XPUB_VERBOSE: b"\x01" + topic on every subscribe, b"\x00" + topic on the last unsubscribe.
        if len(event) not in (1 + REQUEST_ID_BYTES, 1 + CLIENT_STREAM_BYTES):
            return
        if event[0] == 1:
            self.dispatcher.subscribe(event[1:])
            if len(event) == 1 + CLIENT_STREAM_BYTES:
                # A client stream (re)subscribed: say so on it (an empty batch). After a
                # broker restart this is how a client learns that the requests it had in
                # flight may be unknown here (tandem.wire.client: it falls back to their
                # own topics, which the unclaimed-stream check ends if they are).
                self._batches.setdefault(event[1:], [])
        elif event[0] == 0:
            self.dispatcher.unsubscribe(event[1:])

    def _on_stream_in(self, topic: bytes, head: bytes) -> None:
        d = self.dispatcher
        if topic != STREAM_BATCH_TOPIC:
            if topic == STREAM_PING_TOPIC:
                d.stream_ping(head)
            else:
                d.counters["bad_stream_messages"] += 1
            return
        try:
            raws, entries = F.decode_batch(head)
        except WireError:
            d.counters["bad_stream_messages"] += 1
            return
        jobs = d.jobs
        for raw, (attempt, msg) in zip(raws, entries):
            job = jobs.get(msg.request_id)
            self._pass_on(job, d.stream(job, attempt, msg, raw), msg, raw)
            if job is not None and job.ahead:
                for held_attempt, held, held_raw in d.take_ready(job):
                    self._pass_on(job, d.stream(job, held_attempt, held, held_raw), held, held_raw)

    def _pass_on(self, job, verdict: str, msg: M.TokenMessage, raw) -> None:
        if verdict == "forward":
            stream = job.stream if job is not None else None
            if stream is not None:
                # The worker's entry goes out as it came: validated, not re-built.
                self._batches.setdefault(stream, []).append(F.pack_entry(raw))
            else:
                self._outbox.append((self.stream_out, (msg.request_id, F.encode(msg))))
        elif verdict == "patched":
            self._publish(msg, job)
