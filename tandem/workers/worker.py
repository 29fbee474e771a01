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

import json
import logging
import os
import queue
import secrets
import signal
import socket
import threading
import time
from collections import OrderedDict

import zmq

from tandem import knobs
from tandem.pipeline.api import EngineRefused, EngineRequest, TokenEvent
from tandem.wire import codec
from tandem.wire import messages as M
from tandem.wire import protocol as P
from tandem.wire.errors import WireError
from tandem.wire.prefixes import prefix_hashes
from tandem.wire.sockets import bound_endpoint, make_socket
from tandem.wire.settings import TransferSettings
from tandem.workers.advertise import AdvertiseError, advertised
from tandem.workers import gate as G
from tandem.workers import openmp, priority
from tandem.workers.handoff import KVIngest
from tandem.workers.health import Health
from tandem.workers.local import Local
from tandem.workers.sender import HandoffSender
from tandem.workers.settings import WorkerSettings
from tandem.workers.transfers import KVHandoffs

log = logging.getLogger("tandem.worker")

TOMBSTONE_S = 60.0  # remember aborted request ids this long (a late KV transfer is refused)

def device_name() -> str:
    """Where this process's engine runs, for the broker's stats: "cpu", "gpu", or "gpu N" with
    the GPU that ``tandem serve`` (or a unit) gave it in CUDA_VISIBLE_DEVICES."""
    import mlx.core as mx

    if mx.default_device() != mx.gpu:
        return "cpu"
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").strip()
    return f"gpu {visible}" if visible else "gpu"


def default_name(role: str) -> str:
    return f"{role}-{socket.gethostname()}-{os.getpid()}"

class Worker(KVHandoffs, Health):
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
        self._ready_at = float("-inf")  # when READY last went out
        self.incarnation = secrets.randbits(63)  # this process's, in every READY
        self.allowlist = set(decode_allowlist)
        self.capacity = settings.capacity or capacity
        self.block_size, self.total_blocks = block_size, total_blocks
        self.ctx = ctx or zmq.Context.instance()
        ident = self.node_id.encode()
        self.backend = make_socket(self.ctx, zmq.DEALER, connect=backend, identity=ident, security=secret)
        # A prefill worker's engine thread publishes first tokens itself (see _callback),
        # through a context of their own whose I/O thread keeps its priority when the
        # worker's socket threads are lowered (priority.py).
        self._pub_ctx = priority.context_keeping_priority() if self.role == "prefill" else self.ctx
        self.pub = make_socket(self._pub_ctx, zmq.PUB, connect=stream_in, security=secret, hwm=100_000)
        self._pub_lock = threading.Lock()  # the IO thread and (first tokens) the engine thread
        self._batch: list[bytes] = []  # stream entries to send (codec.stream_entry), under _pub_lock
        self.kv_in: KVIngest | None = None
        self.kv_address: str | None = None
        if self.role == "decode":
            if secret is None:
                raise ValueError("a decode worker needs the cluster secret to authenticate KV handoffs")
            bind = settings.kv_bind
            if bind.endswith(":0"):
                bind = bind[:-2] + ":*"
            self.kv_in = KVIngest(self.ctx, bind, secret=secret, node_id=self.node_id, timeout_s=settings.transfer_timeout_s)
            try:
                self.kv_address = advertised(bound_endpoint(self.kv_in.sock), settings.kv_advertise, backend)
            except AdvertiseError:
                self.kv_in.close()
                raise
        self.transfer = transfer or TransferSettings()
        self.sender: HandoffSender | None = None
        self.local: dict[bytes, Local] = {}
        self.tombstones: OrderedDict[bytes, float] = OrderedDict()
        self.recent_prefixes: OrderedDict[int, None] = OrderedDict()
        self._events: queue.SimpleQueue = queue.SimpleQueue()
        self._wake_r, self._wake_w = os.pipe()
        self._wake_pending = False  # a wake-up byte is in the pipe, unread
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
        # ``TANDEM_TIMELINE`` (``tandem.knobs``) set to a file path: the worker appends a JSON
        # line per request event and engine tick (monotonic clock, comparable across
        # processes); bench/disagg.py --timeline reads them.
        timeline = knobs.TIMELINE
        self._timeline = open(timeline, "a", buffering=1) if timeline else None
        self.gate = (G.CpuGate(settings.cpu_gate, settings.cpu_gate_max_wait_ms / 1000)
                     if settings.cpu_gate and self.role != "hybrid" else None)

    def mark(self, event: str, rid: bytes = b"", **kw) -> None:
        """One timeline line (only with TANDEM_TIMELINE set); any thread may call it."""
        if self._timeline is not None:
            self._timeline.write(json.dumps({"t": time.monotonic(), "node": self.node_id, "ev": event,
                                             "rid": rid.hex(), **kw}) + "\n")

    def _trace_ticks(self) -> None:
        """Timeline: mark each scheduled tick's kind and rows (engine schedule hook)."""
        add_hooks = getattr(self.engine, "add_schedule_hooks", None)
        if add_hooks is None:
            return

        started = [0.0]

        def before():
            started[0] = time.monotonic()

        def traced(plan):
            if plan is not None and plan.rows:
                store, pool = getattr(self.engine, "store", None), getattr(self.engine, "pool", None)
                # wait_ms: from the decision's start (before the CPU gate) to the plan;
                # cap / hw: the KV store's allocated blocks and the pool's high-water mark.
                self.mark("tick", kind=plan.kind, rows=[r.seq.request_id.hex() for r in plan.rows],
                          tokens=sum(r.n for r in plan.rows), wait_ms=(time.monotonic() - started[0]) * 1e3,
                          cap=getattr(store, "capacity", None), hw=getattr(pool, "high_water", None))
        add_hooks(before=before, after=traced)

    # ---- engine side: runs on the engine thread ------------------------------------------
    def _callback(self, attempt: int, export: bool = False):
        def on_event(ev: TokenEvent) -> None:
            final = ev.finish_reason is not None or ev.error is not None
            # A prompt whose KV is handed off is done once it is handed off (the first token
            # comes in an event of its own before the one with the KV).
            if self.gate is not None and not (export and not final):
                self.gate.prompt_done(ev.request_id)
            if self._timeline is not None:
                self.mark("event", ev.request_id, tokens=len(ev.tokens), snapshot=ev.snapshot is not None,
                          finish=ev.finish_reason)
            if export and ev.tokens and ev.snapshot is None and not final and self._first_token_here(attempt, ev):
                return
            self._events.put((attempt, ev))
            # One wake-up for however many events land before the IO thread reads it: a
            # write per event was a system call per token (44% of the stub engine thread's
            # samples at 256 streams, bench/token_path.py). The IO thread clears the flag
            # before it drains, so an event put after its drain always writes.
            if not self._wake_pending:
                self._wake_pending = True
                try:
                    os.write(self._wake_w, b"!")
                except BlockingIOError:
                    pass  # the pipe is already full of wake-ups
        return on_event

    def _first_token_here(self, attempt: int, ev: TokenEvent) -> bool:
        """Engine thread: publish a handed-off request's first token now. The IO thread
        of a co-located prefill worker runs at a low priority (priority.py), and waking it
        to publish cost 4.7-6.3 ms p50 under load (bench/disagg.py timeline, event ->
        publish; 1.4 ms once the first token no longer waited for the export); from here
        it is 0.0 ms, and the engine thread is running anyway. All of a
        request's messages from this worker still go through the one PUB socket, in
        order: after this event comes only the one with its KV (the IO thread publishes
        nothing for it). False when the request is no longer ours (the IO thread then
        sees the event and drops it)."""
        if self.role != "prefill":
            return False  # the IO thread publishes everything
        local = self.local.get(ev.request_id)
        if local is None or local.attempt != attempt or local.handing_off:
            return False
        self._publish(local, ev.tokens, ev.logprobs, usage=ev.usage)
        self._flush_batch()
        return True

    # ---- lifecycle -----------------------------------------------------------------------

    def stop(self):
        self._stop = True

    def install_signals(self) -> None:
        signal.signal(signal.SIGTERM, self.drain)
        signal.signal(signal.SIGINT, self.drain)

    def _ready(self) -> None:
        self._ready_at = time.monotonic()
        self._send(M.Ready(self.node_id, self.role, self.model_id, self.capacity, self.kv_address,
                           self.block_size, self.total_blocks, device_name(), self.incarnation))

    def run(self) -> None:
        if self._timeline is not None:
            self._trace_ticks()  # first: its before-hook runs ahead of the gate's wait
        sched = getattr(self.engine, "scheduler", None)
        waiting = (lambda: bool(sched.waiting)) if hasattr(sched, "waiting") else None
        if self.gate is not None and not G.install(self.gate, self.engine, self.role, waiting):
            self.gate.close()
            self.gate = None
        blocktime = openmp.blocktime_for(self.role, self.gate is not None, self.s.omp_blocktime_ms)
        if blocktime is not None and hasattr(self.engine, "scheduler"):  # not for the stub engine
            openmp.set_blocktime(blocktime)
        self.engine.start()
        # After the engine thread started: threads inherit their creator's nice value.
        nice = priority.nice_for(self.role, self.gate is not None, self.s.io_nice)
        if nice is not None:
            priority.lower_socket_threads(nice)
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
                        self._wake_pending = False  # before the drain (see _callback)
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
        """Number a request's stream message and add it to the batch that
        :meth:`_flush_batch` sends: every request's tokens of an engine step travel in one
        message (per-message costs in this thread, the broker and the clients were most
        of the token path's CPU)."""
        # Numbered and queued under one lock: with a prefill worker's engine thread publishing
        # first tokens too, a request's numbers must go out once each and in order.
        with self._pub_lock:
            msg = M.TokenMessage(local.request_id, local.seq, list(tokens), logprobs, finish, usage, error)
            local.seq += 1
            self._batch.append(codec.stream_entry(local.attempt, msg))
        if self._timeline is not None:
            self.mark("publish", local.request_id, seq=msg.seq, tokens=len(msg.tokens))

    def _flush_batch(self) -> None:
        """Send what :meth:`_publish` queued, in order, as TOKEN_BATCH messages."""
        with self._pub_lock:
            if self._batch:
                for head in codec.batch_headers(self._batch):
                    self.pub.send_multipart([P.STREAM_BATCH_TOPIC, head])
                self._batch = []

    def _pub_send(self, frames) -> None:
        with self._pub_lock:
            self.pub.send_multipart(frames)

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
            # A broker that does not know us answers each of our messages with this (after
            # its restart, a backlog of them): announce once per heartbeat interval, not
            # once per answer. A worker whose READY the broker could not take (another
            # schema) answered every refusal with two more messages, thousands a second.
            now = time.monotonic()
            if now - self._ready_at >= self.heartbeat_s:
                log.info("broker asked for registration (%s)", msg.reason)
                self._ready()
                self._heartbeat(now)

    def _dispatch(self, msg: M.Dispatch) -> None:
        rid = msg.request_id
        self.mark("dispatch", rid, mode=msg.mode)
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
            self.engine.submit(EngineRequest(rid, list(prompt), sampling, self._callback(local.attempt, export),
                                             local.priority, export_after_prefill=export,
                                             stream_kv=export and self._plan_handoff(local)))
        except EngineRefused as exc:
            del self.local[rid]
            self.counters["refused"] += 1
            self._send(M.Refused(rid, "at_capacity", str(exc)[:500], exc.retry_after_s))
            return
        except ValueError as exc:  # a request this model cannot run (token ids past its vocabulary, ...)
            del self.local[rid]
            self._send(M.Failed(rid, str(exc)[:1000], retryable=False))
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
        if self.gate is not None:
            self.gate.prompt_done(rid)
        if self.kv_in is not None:
            self.kv_in.discard(rid)
        if self.sender is not None:
            self.sender.cancel(rid, "request was aborted")

    # ---- engine events ------------------------------------------------------------------------
    def _drain_events(self) -> None:
        # Handoffs start after every first token of this batch is out: starting one queues
        # and seals megabytes of KV on this thread, which delayed the next prompt's first
        # token by milliseconds per handoff (timeline: event -> publish 8 ms vs 1 ms hybrid).
        handoffs, outcomes = [], []
        while True:
            try:
                attempt, ev = self._events.get_nowait()
            except queue.Empty:
                break
            self._last_progress = time.monotonic()
            local = self.local.get(ev.request_id)
            if local is None or local.attempt != attempt:
                if self.gate is not None:
                    self.gate.prompt_done(ev.request_id)  # no handoff will follow
                continue  # aborted here, or an older attempt's leftovers
            if ev.kv_part is not None:
                self._stream_part(local, ev.kv_part)
                continue
            if self.kv_in is not None and self._import_event(local, ev):
                continue
            if ev.snapshot is not None and ev.finish_reason is None and ev.error is None:
                if ev.tokens:  # the engine sends the first token in an event before this one
                    self._publish(local, ev.tokens, ev.logprobs, usage=ev.usage)
                local.handing_off = True  # (aborts in between are seen below)
                handoffs.append((local, ev.snapshot))
                continue
            if len(self._batch) >= P.MAX_STREAM_ENTRIES:
                self._flush_batch()  # (a long drain: its first tokens need not wait for the rest)
            done = ev.finish_reason is not None or ev.error is not None
            if ev.tokens or done:
                finish = ev.finish_reason if ev.finish_reason else ("error" if ev.error else None)
                self._publish(local, ev.tokens, ev.logprobs, finish, ev.usage, ev.error)
            if done:
                del self.local[ev.request_id]
                if local.stream_kv:  # ended at its first token (or failed) with its KV half sent
                    self.sender.cancel(ev.request_id, "request ended on the prefill worker")
                if ev.error and ev.finish_reason in (None, "error"):
                    outcomes.append(M.Failed(ev.request_id, ev.error[:1000], retryable=False))
                else:
                    outcomes.append(M.Done(ev.request_id, finish, ev.usage, None))
        # The final stream messages first: a DONE ahead of its request's last tokens makes
        # the broker wait for them (it cannot tell a lost message from a late one).
        self._flush_batch()
        for msg in outcomes:
            self._send(msg)
        for local, snap in handoffs:
            if self.local.get(local.request_id) is local:
                self._hand_off(local, snap)
                self.mark("handoff_started", local.request_id)
            elif self.gate is not None:
                self.gate.prompt_done(local.request_id)

    # ---- timers ----------------------------------------------------------------------------------
    def _timers(self, poller) -> None:
        now = time.monotonic()
        self._expire_transfers(now)
        while self.tombstones and next(iter(self.tombstones.values())) < now:
            self.tombstones.popitem(last=False)
        if now >= self._next_heartbeat:
            self._heartbeat(now)
        if self._draining and (not self.local or now >= self._drain_deadline):
            self._finish_drain()

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
        if self._pub_ctx is not self.ctx:
            self._pub_ctx.term()
        os.close(self._wake_r)
        os.close(self._wake_w)
        if self.gate is not None:
            self.gate.close()
