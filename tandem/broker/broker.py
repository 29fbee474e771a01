"""The broker process: poll -> route -> purge expired -> heartbeat, on five sockets.

``frontend`` (ROUTER) takes clients and the edge; ``backend`` (ROUTER) takes workers;
``stream_in`` (XSUB) receives every worker's token messages and ``stream_out`` (XPUB)
fans them out to subscribed clients: proxying by hand instead of ``zmq.proxy`` is what
lets the broker see each request's progress (for migration) and each subscription
(XPUB_VERBOSE, so it dispatches only after the client's SUB is in place and the first
token cannot be dropped). ``stats`` (ROUTER) answers StatsRequest.
"""

from __future__ import annotations

import gc
import logging
from collections import deque
import threading
import time

import zmq

from tandem.broker import frames as F
from tandem.broker import jobs as J
from tandem.broker.dispatcher import Dispatcher
from tandem.broker.settings import BrokerSettings
from tandem.broker.stats import snapshot
from tandem.wire import messages as M
from tandem.wire.errors import WireError
from tandem.wire.protocol import MAX_FRAMES, REQUEST_ID_BYTES
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


def _recv(sock: zmq.Socket) -> list[bytes]:
    """One multipart message as bytes (zmq.Again if none), refusing one with more frames
    than any message has (:func:`tandem.wire.codec.recv_frames`'s bound)."""
    frame = _recv_frame(sock, _NOBLOCK, False)
    frames = [frame.bytes]
    while frame.more:
        if len(frames) > MAX_FRAMES:
            while frame.more:
                frame = _recv_frame(sock, 0, False)
            raise WireError(f"message with more than {MAX_FRAMES + 1} frames", "frames")
        frame = _recv_frame(sock, 0, False)
        frames.append(frame.bytes)
    return frames


class Broker:
    def __init__(self, settings: BrokerSettings, *, secret: bytes | None, ctx: zmq.Context | None = None):
        self.s = settings
        self.secret = secret
        self.ctx = ctx or zmq.Context.instance()
        self._stop = threading.Event()
        self._outbox: list = []
        self.last_loop = time.monotonic()  # the loop's liveness (systemd watchdog)
        # How long each poll round that had work took, from poll's return to the last send:
        # the latency the broker itself adds to any message in that round.
        self.round_s: deque[float] = deque(maxlen=10_000)
        self.dispatcher = Dispatcher(settings, to_worker=self._to_worker, to_client=self._to_client, publish=self._publish)
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
        self._send(self.backend, identity, msg)

    def _to_client(self, identity: bytes, msg) -> None:
        self._send(self.frontend, identity, msg)

    def _publish(self, msg: M.TokenMessage) -> None:
        self._outbox.append((self.stream_out, (msg.request_id, F.encode(msg))))

    def _flush(self) -> None:
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
        try:
            while not self._stop.is_set():
                timeout = max(0.0, next_tick - self.last_loop)
                events = poller.poll(timeout * 1000)
                started = time.monotonic()
                for sock, _ in events:
                    handler = handlers[sock]
                    for _ in range(BATCH):
                        try:
                            frames = _recv(sock)
                        except zmq.Again:
                            break
                        except WireError as exc:
                            self.dispatcher.counters["bad_messages"] += 1
                            log.debug("dropped a message: %s", exc)
                            continue
                        handler(frames)
                now = time.monotonic()
                if now >= next_tick:
                    self.dispatcher.tick()
                    next_tick = now + TICK_S
                self._flush()
                self.last_loop = time.monotonic()
                if events:
                    self.round_s.append(self.last_loop - started)
        finally:
            self.close()

    def close(self) -> None:
        for sock in (self.frontend, self.backend, self.stream_in, self.stream_out, self.stats_sock):
            sock.close(0)

    # ---- handlers ---------------------------------------------------------------------------
    def _decode_routed(self, frames):
        try:
            if len(frames) != 2:
                raise WireError(f"expected [identity, header] from a DEALER peer, got {len(frames)} frames", "frames")
            return frames[0], F.decode(frames[1])
        except WireError as exc:
            self.dispatcher.counters["bad_messages"] += 1
            log.debug("dropped a malformed message: %s", exc)
            return None, None

    def _on_frontend(self, frames) -> None:
        identity, msg = self._decode_routed(frames)
        if msg is None:
            return
        if isinstance(msg, M.Submit):
            self.dispatcher.submit(identity, msg)
        elif isinstance(msg, M.Abort):
            self.dispatcher.abort(msg.request_id)
        elif isinstance(msg, M.StatsRequest):
            self._to_client(identity, M.StatsReply(self._snapshot(msg)))
        else:
            self.dispatcher.counters["unexpected_client_messages"] += 1

    def _snapshot(self, msg: M.StatsRequest) -> dict:
        return snapshot(self.dispatcher, verbose=self.s.stats_verbose and msg.verbose, rounds_s=list(self.round_s))

    def _on_backend(self, frames) -> None:
        identity, msg = self._decode_routed(frames)
        if msg is not None:
            self.dispatcher.worker_message(identity, msg)

    def _on_stats(self, frames) -> None:
        identity, msg = self._decode_routed(frames)
        if isinstance(msg, M.StatsRequest):
            reply = M.StatsReply(self._snapshot(msg))
            self._send(self.stats_sock, identity, reply)

    def _on_stream_out(self, frames) -> None:
        # XPUB_VERBOSE: b"\x01" + topic on every subscribe, b"\x00" + topic on the last unsubscribe.
        event = frames[0]
        if len(event) != 1 + REQUEST_ID_BYTES:
            return
        if event[0] == 1:
            self.dispatcher.subscribe(event[1:])
        elif event[0] == 0:
            self.dispatcher.unsubscribe(event[1:])

    def _on_stream_in(self, frames) -> None:
        d = self.dispatcher
        if len(frames) != 2 or len(frames[0]) != J.ATTEMPT_TOPIC_BYTES:
            d.counters["bad_stream_messages"] += 1
            return
        topic = frames[0]
        if topic == J.STREAM_PING_TOPIC:
            d.stream_ping(frames[1])
            return
        rid, attempt = topic[:16], topic[16]
        try:
            msg = F.decode_tokens(rid, frames[1])
        except WireError:
            d.counters["bad_stream_messages"] += 1
            return
        verdict = d.stream(d.jobs.get(rid), attempt, msg)
        if verdict == "forward":
            self._outbox.append((self.stream_out, [rid, frames[1]]))
        elif verdict == "patched":
            self._publish(msg)
