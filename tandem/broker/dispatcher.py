"""The broker's decisions, free of sockets: admit, queue, choose workers, dispatch.

The socket loop (:mod:`tandem.broker.broker`) decodes messages and calls in here; every
decision goes out through the three callables it passes (``to_worker``, ``to_client``,
``publish``), which keeps this class testable with plain lists. All deadlines use the
monotonic clock. Three concerns live in their own modules as parts of this class: what
may enter and stay in the queue (:mod:`tandem.broker.admission`), each request's token
stream (:mod:`tandem.broker.streams`) and what happens when a worker fails or refuses
(:mod:`tandem.broker.failover`).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections import Counter

from tandem.broker import frames as F
from tandem.broker import jobs as J
from tandem.broker.admission import Admission
from tandem.broker.failover import Failover
from tandem.broker.jobs import Job
from tandem.broker.registry import DOWN, DRAINING, UP, Load, Registry, Worker
from tandem.broker.settings import BrokerSettings
from tandem.broker.strategies import Selector
from tandem.broker.streams import StreamTracking
from tandem.wire import messages as M
from tandem.wire.prefixes import prefix_hashes
from tandem.wire.protocol import CLIENT_STREAM_BYTES, MAX_ATTEMPTS

log = logging.getLogger("tandem.broker")
UNKNOWN_STREAM = "the broker does not know this request (it restarted and lost it); retry"

class Dispatcher(Admission, StreamTracking, Failover):
    def __init__(self, settings: BrokerSettings, *, to_worker, to_client, publish, clock=time.monotonic,
                 to_worker_raw=None):
        self.s = settings
        self.clock = clock
        self.to_worker, self.to_client, self.publish = to_worker, to_client, publish
        # (identity, encoded header): DISPATCH built from the SUBMIT's own bytes where the
        # socket loop passed them (submit(..., tail=)); without it, to_worker gets a Dispatch.
        self.to_worker_raw = to_worker_raw
        self.registry = Registry(settings.heartbeat_interval_ms / 1000, settings.heartbeat_liveness, clock)
        self._liveness_s = self.registry.heartbeat_s * self.registry.liveness
        kw = dict(long_prompt_tokens=settings.long_prompt_tokens, load_guard=settings.prefix_load_guard)
        self.entry = Selector(settings.strategy, **kw)
        # Decode targets: prefix and prompt-length signals say nothing about decoding.
        decode_strategy = settings.strategy if settings.strategy in ("round_robin", "memory_aware") else "least_loaded"
        self.decode = Selector(decode_strategy, **kw)
        self._prefix_routing = settings.strategy == "prefix_aware"
        self.jobs: dict[bytes, Job] = {}
        self.pending: dict[bytes, Job] = {}
        self.subscriptions: set[bytes] = set()
        # Topics subscribed with no request behind them yet, and since when (tick() ends
        # the ones no SUBMIT claims; see _end_unclaimed_streams).
        self.unclaimed: dict[bytes, float] = {}
        # Jobs accepted before their client's stream topic was seen subscribed, by topic.
        self.awaiting_stream: dict[bytes, list[Job]] = {}
        self._order = 0
        self._probe_deadline = 0.0
        self._last_probe = -1e9
        self._next_linger_scan = 0.0
        # Jobs whose worker sent DONE before the final stream message (tick() ends their
        # stream after a grace period): a dict, so tick() never scans every job in flight.
        self.awaiting_final: dict[bytes, Job] = {}
        self.reordering: dict[bytes, Job] = {}  # jobs holding stream messages that came early
        self.counters = Counter()
        self.handoff_ms: list[float] = []  # recent dispatch -> handoff-complete times

    # ---- clients -------------------------------------------------------------------------
    def queued(self) -> list[Job]:
        return list(self.pending.values())

    def _set_state(self, job: Job, state: str) -> None:
        # ``pending`` mirrors the jobs not yet dispatched, so admission and the dispatch
        # scan cost O(queue), not O(every request in flight).
        job.state = state
        if state in (J.WAITING_SUB, J.QUEUED):
            self.pending[job.request_id] = job
        else:
            self.pending.pop(job.request_id, None)

    def submit(self, client: bytes, msg: M.Submit, tail: bytes | None = None) -> None:
        rid = msg.request_id
        self.counters["submitted"] += 1
        if not self._admit(client, msg):
            return
        now = self.clock()
        self._order += 1
        job = Job(rid, client, msg.prompt, msg.sampling, msg.priority, msg.model, now,
                  now + self.s.subscribe_timeout_s, self._order)
        job.wire_tail = tail
        job.stream = msg.stream
        self.jobs[rid] = job
        self.unclaimed.pop(rid, None)
        self._set_state(job, J.WAITING_SUB)
        self.to_client(client, M.Accepted(rid, len(self.pending)))
        topic = msg.stream or rid
        if topic in self.subscriptions:
            self._subscribed(job)
        elif msg.stream is not None:
            self.awaiting_stream.setdefault(msg.stream, []).append(job)

    def subscribe(self, topic: bytes) -> None:
        self.subscriptions.add(topic)
        if len(topic) == CLIENT_STREAM_BYTES:
            # A client's stream: every request of that client waiting for it may go.
            for job in self.awaiting_stream.pop(topic, ()):
                if job.state == J.WAITING_SUB:
                    self._subscribed(job)
            return
        job = self.jobs.get(topic)
        if job is None:
            self.unclaimed.setdefault(topic, self.clock())
        elif job.state == J.WAITING_SUB:
            self._subscribed(job)

    def unsubscribe(self, topic: bytes) -> None:
        self.subscriptions.discard(topic)
        self.unclaimed.pop(topic, None)
        self.awaiting_stream.pop(topic, None)  # (its jobs' subscribe deadline refuses them)

    def _end_unclaimed_streams(self, now: float) -> None:
        """A client subscribes before it submits, so a subscription arrives a moment before
        its request; one that no request claims within subscribe_timeout_s belongs to a
        request this broker never saw: it restarted, and the client's SUB socket
        resubscribed on reconnecting. End that stream now with an error, instead of
        leaving the client to its idle timeout (the edge's request_timeout_s, minutes;
        found by bench/chaos.py's broker restarts)."""
        if not self.unclaimed:
            return
        for topic, since in list(self.unclaimed.items()):
            if since + self.s.subscribe_timeout_s < now:
                del self.unclaimed[topic]
                if topic in self.subscriptions and topic not in self.jobs:
                    self.counters["unknown_streams_ended"] += 1
                    self.publish(M.TokenMessage(topic, 0, [], None, "error", None, UNKNOWN_STREAM))

    def _subscribed(self, job: Job) -> None:
        self._set_state(job, J.QUEUED)
        job.deadline = self.clock() + self.s.queue_timeout_s
        # (No SUBSCRIBED to the client: it has subscribed before submitting, and the
        # dispatch itself is what the confirmation guards.)
        self._try_dispatch(job)

    def abort(self, rid: bytes) -> None:
        job = self.jobs.get(rid)
        if job is None or job.state == J.FINISHED:
            return
        self.counters["aborted"] += 1
        self._release(job, notify=True)
        self._finish(job)

    # ---- workers -------------------------------------------------------------------------
    def worker_message(self, identity: bytes, msg) -> None:
        w = self.registry.workers.get(identity)
        if type(msg) is M.Done and w is not None and w.state == UP:
            # The common case, once per request: skip the general checks below.
            w.expiry = self.clock() + self._liveness_s  # registry.touch(w), inlined
            self._done(w, msg)
            return
        if isinstance(msg, M.Ready):
            if w is not None and w.inflight:
                # The same identity announcing itself again lost whatever it held.
                self._worker_lost(w, "worker re-registered")
            w = self.registry.register(identity, name=msg.node_id, role=msg.role, model_id=msg.model,
                                       capacity=msg.capacity, kv_addr=msg.kv_address or "", incarnation=msg.incarnation)
            w.device = msg.device or ""
            w.load = Load(0, 0, msg.total_blocks, msg.total_blocks, msg.block_size)
            log.info("worker %s registered as %s (capacity %d)", msg.node_id, w.node_id, msg.capacity)
            self.dispatch_pending()
            return
        if w is None:
            # Unknown (typically: the broker restarted). Ask it to announce itself again.
            self.to_worker(identity, M.Disconnect("broker", "unknown worker: send READY"))
            return
        if w.state == DOWN and not isinstance(msg, M.Disconnect):
            log.info("worker %s is back", w.node_id)
            w.state = UP
        self.registry.touch(w)
        if isinstance(msg, M.Heartbeat):
            w.saturated = False
            w.load.running, w.load.waiting = msg.running, msg.waiting
            w.load.free_blocks, w.load.total_blocks = msg.free_blocks, msg.total_blocks
            w.load.prefix_queries, w.load.prefix_hits = msg.prefix_queries, msg.prefix_hits
            w.load.spec_draft_tokens, w.load.spec_accepted_tokens = msg.spec_draft_tokens, msg.spec_accepted_tokens
            w.load.kv_store_bytes, w.load.heap_free_bytes = msg.kv_store_bytes, msg.heap_free_bytes
            w.load.kv_mirror_bytes = msg.kv_mirror_bytes
            w.remember_prefixes(reversed(msg.prefix_hashes))
            w.kv.update(msg.kv_handoffs, msg.kv_sent_bytes, msg.kv_sent_s, msg.kv_received_bytes)
            if msg.draining and w.state == UP:
                w.state = DRAINING
            self._reconcile(w, msg.requests)
            self.dispatch_pending()
        elif isinstance(msg, M.Done):
            self._done(w, msg)
        elif isinstance(msg, M.Failed):
            self._failed(w, msg.request_id, msg.error, msg.retryable)
        elif isinstance(msg, M.Refused):
            self._worker_refused(w, msg)
        elif isinstance(msg, M.Disconnect):
            log.info("worker %s left: %s", w.node_id, msg.reason)
            self._worker_lost(w, f"worker left ({msg.reason})")
            w.state = DOWN
            self.registry.forget(identity)
        else:
            self.counters["unexpected_worker_messages"] += 1

    def stream_ping(self, identity: bytes) -> None:
        w = self.registry.get(identity)
        if w is not None and not w.stream_ok and w.state != DOWN:
            w.stream_ok = True
            self.dispatch_pending()

    def _done(self, w: Worker, msg: M.Done) -> None:
        job = self.jobs.get(msg.request_id)
        if job is None:
            return
        if w.identity not in job.holders:
            return  # a late DONE from an attempt we gave up on
        self._unhold(job, w)
        if w.saturated:
            # It refused work, and has now finished some: it has room again. (Left for its
            # next heartbeat, a worker refusing a burst stood idle for up to a heartbeat
            # interval: one-token requests through one worker ran at a few hundred a second.)
            w.saturated = False
            self.dispatch_pending()
        if msg.handed_to is not None:
            job.dispatched_at = self.clock()  # the decode worker's heartbeats get their grace too
            self.counters["handoffs"] += 1
            self.handoff_ms.append((self.clock() - job.arrived) * 1000)
            del self.handoff_ms[:-1000]
            self._maybe_forget(job)
            return
        if msg.usage is not None:
            job.cached_prompt_tokens = max(job.cached_prompt_tokens, msg.usage.cached_prompt_tokens)
        if job.state != J.FINISHED and msg.finish_reason is not None and not job.holders:
            # DONE and the stream travel on different connections, so DONE may arrive
            # first; give the final stream message a grace period before ending the
            # stream ourselves (tick()).
            job.worker_done = msg
            job.worker_done_at = self.clock()
            self.awaiting_final[job.request_id] = job
        self._maybe_forget(job)

    # ---- dispatch ------------------------------------------------------------------------
    def dispatch_pending(self) -> None:
        if not self.pending:
            return
        pending = sorted((j for j in self.pending.values() if j.state == J.QUEUED), key=lambda j: (-j.priority, j.order))
        for job in pending:
            if not self._try_dispatch(job):
                # Later jobs of the same priority would find the same full workers; stop
                # scanning unless nothing at all is usable (then tick() handles refusals).
                break

    def _candidates(self, ws: list[Worker], job: Job) -> list[Worker]:
        # Worker.has_room() and the model check, inlined: this runs for every dispatch.
        model = job.model
        room = [w for w in ws if w.state == UP and w.stream_ok and not w.saturated and len(w.inflight) < w.capacity
                and (not model or model == w.model_id)]
        if not job.excluded:
            return room
        preferred = [w for w in room if w.identity not in job.excluded]
        return preferred or room

    def _decode_targets(self, job: Job) -> list[Worker]:
        ws = self.registry.decode_pool
        if not ws:
            return ws
        if self.s.decode_allowlist:
            allowed = set(self.s.decode_allowlist)
            ws = [w for w in ws if w.name in allowed or w.kv_addr in allowed]
        return self._candidates(ws, job)

    def _try_dispatch(self, job: Job) -> bool:
        if job.state != J.QUEUED:
            return True
        if job.attempt >= MAX_ATTEMPTS:
            self.counters["attempts_exhausted"] += 1
            self._refuse_job(job, "busy", f"no worker took the request in {MAX_ATTEMPTS} attempts")
            return True
        if job.resume:
            return self._try_resume(job)
        hashes = prefix_hashes(job.prompt) if self._prefix_routing else []
        entries = self._candidates(self.registry.entry_pool, job)
        targets = self._decode_targets(job)
        if not targets and self.registry.decode_pool and any(w.usable for w in self.registry.decode_pool):
            # Decode workers exist but are full: wait for one rather than decode on a
            # prefill worker; hybrids can still take the whole request.
            entries = [w for w in entries if w.role == "hybrid"]
        entry = self.entry.choose(entries, prompt_len=len(job.prompt), prefixes=hashes)
        if entry is None:
            # No prefill-capable worker: a decode worker can still run the whole request.
            entry = self.decode.choose(targets)
            if entry is None:
                return False
            mode, target = "decode", None
        elif entry.role == "prefill" and targets:
            mode, target = "prefill", self.decode.choose(targets)
        else:
            mode, target = "hybrid", None
        job.attempt += 1
        self._hold(job, entry, prefill=True)
        if target is not None:
            self._hold(job, target, prefill=False)
            target.decode_targeted += 1
        if hashes:
            entry.remember_prefixes(hashes)
        node, address = (target.name, target.kv_addr) if target else (None, None)
        if job.wire_tail is not None and self.to_worker_raw is not None:
            self.to_worker_raw(entry.identity, F.encode_dispatch(job.request_id, mode, job.wire_tail, node, address,
                                                                 job.attempt))
        else:
            self.to_worker(entry.identity, M.Dispatch(job.request_id, mode, job.prompt, job.sampling, job.priority,
                                                      job.model, node, address, job.attempt))
        self._dispatched(job, entry, target)
        return True

    def _try_resume(self, job: Job) -> bool:
        """Continue where the stream stopped on whichever worker can run it to the end,
        preferring those built for decoding."""
        workers = list(self.registry.workers.values())
        dec = self._candidates([w for w in workers if w.decodes], job)
        w = self.decode.choose(dec) or self.decode.choose(self._candidates(workers, job))
        if w is None:
            return False
        job.attempt += 1
        job.resumed_from = len(job.generated)
        self._hold(job, w, prefill=True)
        self.to_worker(w.identity, M.Resume(job.request_id, job.prompt, list(job.generated), job.next_seq,
                                            self._remaining(job), job.priority, job.model, job.attempt))
        self._dispatched(job, w, None)
        return True

    def _remaining(self, job: Job):
        """The sampling of a resumed request: what is left of its token budget, and its
        place in the seeded random stream (token i of the resumed run is token
        len(generated) + i of the request, so a sampled stream continues exactly)."""
        return dataclasses.replace(job.sampling, max_tokens=max(1, job.remaining_tokens),
                                   seed_offset=job.sampling.seed_offset + len(job.generated))

    def _dispatched(self, job: Job, entry: Worker, target: Worker | None) -> None:
        self._set_state(job, J.RUNNING)
        job.dispatched_at = self.clock()
        job.prefill_worker = entry.identity
        job.decode_worker = target.identity if target else entry.identity
        entry.dispatched += 1
        self.counters["dispatched"] += 1

    def _hold(self, job: Job, w: Worker, *, prefill: bool) -> None:
        job.holders.add(w.identity)
        w.inflight.add(job.request_id)
        if prefill:
            w.inflight_tokens += len(job.prompt)

    def _unhold(self, job: Job, w: Worker) -> None:
        job.holders.discard(w.identity)
        if job.request_id in w.inflight:
            w.inflight.discard(job.request_id)
            if job.prefill_worker == w.identity:
                w.inflight_tokens = max(0, w.inflight_tokens - len(job.prompt))

    def _release(self, job: Job, *, notify: bool) -> None:
        """Drop every holder's claim; tell the live ones to abort and free the KV."""
        for identity in list(job.holders):
            w = self.registry.get(identity)
            if w is None:
                job.holders.discard(identity)
                continue
            if notify and w.state != DOWN:
                self.to_worker(identity, M.Abort(job.request_id))
            self._unhold(job, w)

    # ---- periodic ------------------------------------------------------------------------
    def tick(self) -> None:
        """Purge expired workers and jobs, re-probe, refuse what cannot be placed."""
        now = self.clock()
        self._expire_workers()
        self._expire_queue(now)
        self._close_lost_finals(now)
        self._close_gaps(now)
        self._end_unclaimed_streams(now)
        if self.awaiting_stream:
            # Forget refused jobs of streams never subscribed (a client that named a topic
            # it did not subscribe to would otherwise grow its list for good).
            for topic, waiting in list(self.awaiting_stream.items()):
                waiting[:] = [j for j in waiting if j.state == J.WAITING_SUB]
                if not waiting:
                    del self.awaiting_stream[topic]
        self.dispatch_pending()
        self._purge_finished(now)
