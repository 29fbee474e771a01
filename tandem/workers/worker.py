"""A worker process: an engine plus one IO thread that owns every socket.

The engine's thread owns MLX and calls ``on_event`` for each step's tokens; the callback
only queues the event and pokes a pipe, so the IO loop below (broker DEALER, token PUB,
KV ingest ROUTER, KV DEALERs to decode peers, the wake pipe) sees decoded objects and
never blocks the step loop. Roles: ``hybrid`` runs requests to the end; ``prefill`` runs
the prompt, publishes the first token and hands the KV to the decode worker the broker
chose; ``decode`` ingests KV and decodes. Any worker runs a request to the end when the
broker says so (``mode`` hybrid/decode, or RESUME after another worker died).
"""

from __future__ import annotations

import logging
import os
import queue
import signal
import socket
import time
from collections import OrderedDict
from dataclasses import dataclass

import zmq

from tandem.broker.jobs import STREAM_PING_TOPIC
from tandem.broker.strategies import prefix_hashes
from tandem.pipeline.api import EngineRefused, EngineRequest, TokenEvent
from tandem.wire import codec
from tandem.wire import messages as M
from tandem.wire import protocol as P
from tandem.wire.errors import WireError
from tandem.wire.sockets import bound_endpoint, make_socket
from tandem.wire.settings import TransferSettings
from tandem.workers.handoff import KVIngest
from tandem.workers.sender import HandoffSender
from tandem.workers.settings import WorkerSettings

log = logging.getLogger("tandem.worker")

TOMBSTONE_S = 60.0  # remember aborted request ids this long (a late KV transfer is refused)


@dataclass
class Local:
    request_id: bytes
    attempt: int
    seq: int  # next stream sequence number this worker publishes
    mode: str  # prefill | run (to the end here)
    prompt_len: int
    priority: int = 0
    decode_node: str | None = None
    decode_address: str | None = None
    handing_off: bool = False


def default_name(role: str) -> str:
    return f"{role}-{socket.gethostname()}-{os.getpid()}"


class Worker:
    def __init__(self, engine, *, settings: WorkerSettings, backend: str, stream_in: str, secret: bytes | None,
                 model_id: str, heartbeat_s: float = 1.0, decode_allowlist=(), block_size: int = 16,
                 total_blocks: int = 0, capacity: int = 64, ctx: zmq.Context | None = None,
                 transfer: TransferSettings | None = None):
        self.engine = engine
        self.s = settings
        self.role = settings.role
        self.node_id = (settings.name or default_name(self.role))[: P.NODE_ID_MAX_CHARS]
        self.secret = secret
        self.model_id = model_id
        self.heartbeat_s = heartbeat_s
        self.allowlist = set(decode_allowlist)
        self.capacity = settings.capacity or capacity
        self.block_size, self.total_blocks = block_size, total_blocks
        self.ctx = ctx or zmq.Context.instance()
        ident = self.node_id.encode()
        self.backend = make_socket(self.ctx, zmq.DEALER, connect=backend, identity=ident, security=secret)
        self.pub = make_socket(self.ctx, zmq.PUB, connect=stream_in, security=secret, hwm=100_000)
        self.kv_in: KVIngest | None = None
        self.kv_address: str | None = None
        if self.role == "decode":
            if secret is None:
                raise ValueError("a decode worker needs the cluster secret to authenticate KV handoffs")
            bind = settings.kv_bind
            if bind.endswith(":0"):
                bind = bind[:-2] + ":*"
            self.kv_in = KVIngest(self.ctx, bind, secret=secret, node_id=self.node_id, timeout_s=settings.transfer_timeout_s)
            self.kv_address = bound_endpoint(self.kv_in.sock)
        self.transfer = transfer or TransferSettings()
        self.sender: HandoffSender | None = None
        self.local: dict[bytes, Local] = {}
        self.tombstones: OrderedDict[bytes, float] = OrderedDict()
        self.recent_prefixes: OrderedDict[int, None] = OrderedDict()
        self._events: queue.SimpleQueue = queue.SimpleQueue()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._draining = False
        self._drain_deadline = 0.0
        self._stop = False
        self._last_steps = -1
        self._last_progress = time.monotonic()
        self.stalled = False
        self.last_loop = time.monotonic()  # the IO loop's own liveness (systemd watchdog)
        self.on_drain = None  # called once when draining starts (systemd STOPPING=1)
        self.counters = {"refused": 0}

    # ---- engine side: runs on the engine thread ------------------------------------------
    def _callback(self, attempt: int):
        def on_event(ev: TokenEvent) -> None:
            self._events.put((attempt, ev))
            try:
                os.write(self._wake_w, b"!")
            except BlockingIOError:
                pass  # the pipe is already full of wake-ups
        return on_event

    # ---- lifecycle -----------------------------------------------------------------------
    def drain(self, *_):
        """SIGTERM: stop taking work, finish what we hold within the grace period."""
        if not self._draining:
            log.info("draining (grace %.0fs)", self.s.drain_grace_s)
            self._draining = True
            self._drain_deadline = time.monotonic() + self.s.drain_grace_s
            self._next_heartbeat = 0.0
            if self.on_drain is not None:
                self.on_drain()

    def stop(self):
        self._stop = True

    def install_signals(self) -> None:
        signal.signal(signal.SIGTERM, self.drain)
        signal.signal(signal.SIGINT, self.drain)

    def _ready(self) -> None:
        self._send(M.Ready(self.node_id, self.role, self.model_id, self.capacity, self.kv_address,
                           self.block_size, self.total_blocks))

    def run(self) -> None:
        self.engine.start()
        poller = zmq.Poller()
        self.sender = HandoffSender(self.ctx, secret=self.secret, node_id=self.node_id, transfer=self.transfer,
                                    timeout_s=self.s.transfer_timeout_s, poller=poller)
        poller.register(self.backend, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        if self.kv_in:
            poller.register(self.kv_in.sock, zmq.POLLIN)
        self._ready()
        self._next_heartbeat = 0.0
        log.info("worker %s (%s) up%s", self.node_id, self.role, f", KV ingest at {self.kv_address}" if self.kv_address else "")
        try:
            while not self._stop:
                now = self.last_loop = time.monotonic()
                timeout = max(0.0, min(self._next_heartbeat - now, 0.1))
                for sock, _ in poller.poll(timeout * 1000):
                    if sock == self._wake_r:
                        try:
                            os.read(self._wake_r, 65536)
                        except BlockingIOError:
                            pass
                        self._drain_events()
                    elif sock is self.backend:
                        self._recv_all(self.backend, self._on_broker)
                    elif self.kv_in is not None and sock is self.kv_in.sock:
                        self._recv_all(self.kv_in.sock, self._on_kv_in)
                    else:
                        peer = self.sender.peer_for(sock)
                        if peer is not None:
                            self._recv_all(sock, lambda f, p=peer: self._handoff_outcomes(self.sender.on_message(p, f)))
                self._drain_events()
                self._timers(poller)
        finally:
            self._shutdown()

    def _recv_all(self, sock, handler) -> None:
        for _ in range(256):
            try:
                frames = codec.recv_frames(sock, flags=zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            except WireError:
                continue
            handler(frames)

    def _send(self, msg) -> None:
        try:
            codec.send(self.backend, codec.encode(msg), flags=zmq.NOBLOCK)
        except zmq.Again:
            log.warning("broker pipe full; dropped %s", type(msg).__name__)

    def _publish(self, local: Local, tokens, logprobs=None, finish=None, usage=None, error=None) -> None:
        msg = M.TokenMessage(local.request_id, local.seq, list(tokens), logprobs, finish, usage, error)
        local.seq += 1
        head = codec.pack_header(msg)
        self.pub.send_multipart([local.request_id + bytes((local.attempt,)), head])

    # ---- broker messages ------------------------------------------------------------------
    def _on_broker(self, frames) -> None:
        try:
            msg = codec.decode(frames)
        except WireError as exc:
            log.warning("bad message from broker: %s", exc)
            return
        if isinstance(msg, M.Dispatch):
            self._dispatch(msg)
        elif isinstance(msg, M.Resume):
            self._resume(msg)
        elif isinstance(msg, M.Abort):
            self._abort(msg.request_id)
        elif isinstance(msg, M.Heartbeat):
            self._heartbeat(time.monotonic())  # a re-probe: answer at once
        elif isinstance(msg, M.Disconnect):
            log.info("broker asked for registration (%s)", msg.reason)
            self._ready()
            self._heartbeat(time.monotonic())

    def _dispatch(self, msg: M.Dispatch) -> None:
        rid = msg.request_id
        if self._draining:
            self._send(M.Refused(rid, "draining", "worker is draining", 1.0))
            return
        mode = "prefill" if msg.mode == "prefill" else "run"
        if mode == "prefill":
            if not msg.decode_address:
                self._send(M.Failed(rid, "prefill dispatch without a decode target", retryable=False))
                return
            if self.allowlist and msg.decode_node not in self.allowlist and msg.decode_address not in self.allowlist:
                log.warning("decode target %s (%s) is not in the allowlist; refusing", msg.decode_node, msg.decode_address)
                self._send(M.Failed(rid, "decode target not in this worker's decode allowlist", retryable=False))
                return
        local = Local(rid, msg.attempt, 0, mode, len(msg.prompt), msg.priority, msg.decode_node, msg.decode_address)
        self._submit(local, msg.prompt, msg.sampling, export=mode == "prefill")

    def _resume(self, msg: M.Resume) -> None:
        if self._draining:
            self._send(M.Refused(msg.request_id, "draining", "worker is draining", 1.0))
            return
        local = Local(msg.request_id, msg.attempt, msg.next_seq, "run", len(msg.prompt) + len(msg.generated), msg.priority)
        self._submit(local, list(msg.prompt) + list(msg.generated), msg.sampling, export=False)

    def _submit(self, local: Local, prompt, sampling, *, export: bool) -> None:
        rid = local.request_id
        old = self.local.get(rid)
        if old is not None:
            self.engine.abort(rid)  # a newer attempt replaces whatever we still had
        self.tombstones.pop(rid, None)
        self.local[rid] = local
        try:
            self.engine.submit(EngineRequest(rid, list(prompt), sampling, self._callback(local.attempt),
                                             local.priority, export_after_prefill=export))
        except EngineRefused as exc:
            del self.local[rid]
            self.counters["refused"] += 1
            self._send(M.Refused(rid, "at_capacity", str(exc)[:500], exc.retry_after_s))
            return
        for h in prefix_hashes(list(prompt))[:32]:
            self.recent_prefixes[h] = None
            self.recent_prefixes.move_to_end(h)
        while len(self.recent_prefixes) > P.MAX_PREFIX_HASHES:
            self.recent_prefixes.popitem(last=False)

    def _abort(self, rid: bytes) -> None:
        self.tombstones[rid] = time.monotonic() + TOMBSTONE_S
        local = self.local.pop(rid, None)
        if local is not None:
            self.engine.abort(rid)
        if self.kv_in is not None:
            self.kv_in.discard(rid)
        if self.sender is not None:
            self.sender.forget(rid)

    # ---- engine events ------------------------------------------------------------------------
    def _drain_events(self) -> None:
        while True:
            try:
                attempt, ev = self._events.get_nowait()
            except queue.Empty:
                return
            self._last_progress = time.monotonic()
            local = self.local.get(ev.request_id)
            if local is None or local.attempt != attempt:
                continue  # aborted here, or an older attempt's leftovers
            if ev.snapshot is not None and ev.finish_reason is None and ev.error is None:
                self._publish(local, ev.tokens, ev.logprobs)
                self._hand_off(local, ev.snapshot)
                continue
            done = ev.finish_reason is not None or ev.error is not None
            if ev.tokens or done:
                finish = ev.finish_reason if ev.finish_reason else ("error" if ev.error else None)
                self._publish(local, ev.tokens, ev.logprobs, finish, ev.usage, ev.error)
            if done:
                del self.local[ev.request_id]
                if ev.error and ev.finish_reason in (None, "error"):
                    self._send(M.Failed(ev.request_id, ev.error[:1000], retryable=False))
                else:
                    self._send(M.Done(ev.request_id, finish, ev.usage, None))

    # ---- KV handoff: prefill side -------------------------------------------------------------
    def _hand_off(self, local: Local, snap) -> None:
        local.handing_off = True
        self.sender.start(snap, attempt=local.attempt, decode_node=local.decode_node or "",
                          address=local.decode_address, stream_seq=local.seq, priority=local.priority)

    def _handoff_outcomes(self, outcomes) -> None:
        for rid, failure in outcomes:
            local = self.local.get(rid)
            if local is None or not local.handing_off:
                continue
            del self.local[rid]
            if failure is None:
                self._send(M.Done(rid, None, None, handed_to=local.decode_node or "decode"))
            else:
                log.info("handoff of %s failed: %s", rid.hex(), failure)
                # The broker moves the request on (excluding that decode worker); the first
                # token is already out, so it continues from it.
                self._send(M.Refused(rid, "at_capacity", failure[:1000], 0.0))

    # ---- KV handoff: decode side --------------------------------------------------------------
    def _at_capacity(self) -> bool:
        return self._draining or len(self.local) >= self.capacity

    def _on_kv_in(self, frames) -> None:
        for peer, attempt, header, snap in self.kv_in.on_message(list(frames), at_capacity=self._at_capacity):
            rid = header.request_id
            if snap is None:
                refuse = None
                if rid in self.tombstones:
                    refuse = ("invalid", "request was aborted")
                elif self._draining:
                    refuse = ("draining", "decode worker is draining")
                elif header.model != self.model_id:
                    refuse = ("invalid", f"decode worker serves {self.model_id!r}, KV is for {header.model!r}")
                elif len(self.local) >= self.capacity or not self.engine.can_accept(len(header.tokens)):
                    refuse = ("at_capacity", "decode worker is full")
                if refuse:
                    self.kv_in.refuse(peer, rid, refuse[0], refuse[1], 0.5)
                    continue
                self.kv_in.reply(peer, M.KVAck(rid, complete=False))
                # Hold the place now so capacity counts the transfer in flight.
                self.local[rid] = Local(rid, attempt, header.stream_seq, "run", header.prompt_len, header.priority)
                continue
            local = self.local.get(rid)
            if local is None or local.attempt != attempt:
                self.kv_in.refuse(peer, rid, "invalid", "request was aborted")
                continue
            try:
                self.engine.import_kv(snap, self._callback(attempt), priority=header.priority)
            except (EngineRefused, ValueError) as exc:
                del self.local[rid]
                self.kv_in.refuse(peer, rid, "at_capacity" if isinstance(exc, EngineRefused) else "invalid",
                                  str(exc)[:500], getattr(exc, "retry_after_s", 0.0))
                continue
            self.kv_in.reply(peer, M.KVAck(rid, complete=True))

    # ---- timers ----------------------------------------------------------------------------------
    def _timers(self, poller) -> None:
        now = time.monotonic()
        self._handoff_outcomes(self.sender.expired(now))
        if self.kv_in is not None:
            for inc in self.kv_in.expire(now):
                # Header arrived, data never completed: give the place back.
                local = self.local.get(inc.header.request_id)
                if local is not None and local.attempt == inc.attempt:
                    del self.local[inc.header.request_id]
        while self.tombstones and next(iter(self.tombstones.values())) < now:
            self.tombstones.popitem(last=False)
        if now >= self._next_heartbeat:
            self._heartbeat(now)
        if self._draining and (not self.local or now >= self._drain_deadline):
            self._finish_drain()

    def alive(self) -> bool:
        """For a watchdog: the IO loop turns and the engine is not stalled."""
        return not self.stalled and time.monotonic() - self.last_loop < max(5.0, 5 * self.heartbeat_s)

    def _engine_progressing(self, now: float, stats) -> bool:
        if stats.steps != self._last_steps:
            self._last_steps = stats.steps
            self._last_progress = now
        busy = stats.running + stats.waiting > 0 or bool(self.local)
        return not busy or now - self._last_progress < self.s.stall_timeout_s

    def _heartbeat(self, now: float) -> None:
        self._next_heartbeat = now + self.heartbeat_s
        stats = self.engine.stats()
        if not self._engine_progressing(now, stats):
            if not self.stalled:
                log.error("engine made no progress for %.0fs with work queued: heartbeats stop so the broker moves our requests", self.s.stall_timeout_s)
            self.stalled = True
            return
        self.stalled = False
        sent = self.sender.counters if self.sender is not None else {}
        self._send(M.Heartbeat(self.node_id, stats.running, stats.waiting, stats.free_blocks, stats.total_blocks,
                               list(reversed(self.recent_prefixes))[: P.MAX_PREFIX_HASHES],
                               list(self.local)[: P.MAX_HELD_REQUESTS], float(stats.tokens_per_s), self._draining,
                               kv_handoffs=sent.get("handoffs", 0), kv_sent_bytes=sent.get("handoff_bytes", 0),
                               kv_sent_s=sent.get("handoff_ms", 0.0) / 1000,
                               kv_received_bytes=self.kv_in.bytes_in if self.kv_in is not None else 0))
        # Proves to the broker that this PUB's connection to its XSUB is up: it only
        # dispatches to workers whose tokens it can actually receive.
        self.pub.send_multipart([STREAM_PING_TOPIC, self.node_id.encode()])

    def _finish_drain(self) -> None:
        for rid, local in list(self.local.items()):
            self.engine.abort(rid)
            self._send(M.Failed(rid, "worker shut down before the request finished", retryable=True))
        self.local.clear()
        self._send(M.Disconnect(self.node_id, "drained"))
        log.info("drained; leaving")
        self._stop = True

    def _shutdown(self) -> None:
        try:
            self.engine.stop()
        except Exception:  # the engine's own problem; we are leaving anyway
            log.exception("engine stop failed")
        # Let the last DONE / DISCONNECT leave before the sockets close.
        self.backend.setsockopt(zmq.LINGER, 1000)
        if self.sender is not None:
            self.sender.close()
        if self.kv_in:
            self.kv_in.close()
        self.backend.close()
        self.pub.close(0)
        os.close(self._wake_r)
        os.close(self._wake_w)
