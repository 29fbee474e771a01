"""What the broker does when a worker fails, refuses, or goes silent: move each request
it held to another worker (continuing a started stream from its last token), up to the
migration limit, and probe unreachable workers before refusing for lack of them. Part
of :class:`tandem.broker.dispatcher.Dispatcher` (its state lives there).
"""

from __future__ import annotations

import logging

from tandem.broker import jobs as J
from tandem.broker.jobs import Job
from tandem.broker.registry import Worker
from tandem.wire import messages as M
from tandem.wire.protocol import MAX_HELD_REQUESTS

log = logging.getLogger("tandem.broker")


class Failover:
    def _let_go(self, job: Job, w: Worker) -> None:
        """A worker gave up a request whose stream already ended (say, a prefill worker
        whose handoff acknowledgement was lost after the decode worker finished it): it
        holds nothing more, so neither does the broker on its behalf."""
        self._unhold(job, w)
        self._maybe_forget(job)

    def _expire_workers(self) -> None:
        for w in self.registry.expired():
            log.warning("worker %s missed its heartbeats; marked down", w.node_id)
            self._worker_lost(w, "missed heartbeats")

    def _reconcile(self, w: Worker, held: list[bytes]) -> None:
        """A request the broker believes this worker alone holds, which the worker's
        heartbeats stop listing, was lost on the way (a dispatch dropped across a
        reconnect, say): move it on instead of letting its client wait forever."""
        if len(held) >= MAX_HELD_REQUESTS:
            return  # the list is truncated: absence proves nothing
        listed = set(held)
        grace = 2 * self.registry.heartbeat_s
        now = self.clock()
        for rid in list(w.inflight):
            job = self.jobs.get(rid)
            if (job is None or job.state != J.RUNNING or rid in listed or job.holders != {w.identity}
                    or now - job.dispatched_at < grace):
                continue
            self.counters["lost_requests"] += 1
            job.excluded.add(w.identity)
            self._reschedule(job, f"{w.node_id} no longer holds it", count=True)

    def _worker_refused(self, w: Worker, msg: M.Refused) -> None:
        self.counters["worker_refusals"] += 1
        job = self.jobs.get(msg.request_id)
        if job is None or w.identity not in job.holders:
            return
        if job.state == J.FINISHED:
            self._let_go(job, w)
            return
        target = self.registry.get(job.decode_worker) if job.decode_worker else None
        if job.next_seq > 0 and target is not None and target is not w:
            # A prefill worker whose decode target refused the KV (full, timed out): the
            # first token is out, so the request continues elsewhere from it.
            target.refusals += 1
            target.saturated = True
            job.excluded.add(target.identity)
        else:
            w.refusals += 1
            w.saturated = True
            job.excluded.add(w.identity)
        self._reschedule(job, f"{w.node_id}: {msg.message or msg.reason}", count=False)

    def _failed(self, w: Worker, rid: bytes, error: str, retryable: bool, migration: bool = True) -> None:
        job = self.jobs.get(rid)
        if job is None or w.identity not in job.holders:
            return
        if job.state == J.FINISHED:
            self._let_go(job, w)
            return
        job.excluded.add(w.identity)
        if retryable:
            self._reschedule(job, f"{w.node_id}: {error}", count=migration)
        else:
            self._release(job, notify=True)
            self._end_stream(job, error=f"request failed on {w.node_id}: {error}")

    def _worker_lost(self, w: Worker, why: str) -> None:
        for rid in list(w.inflight):
            job = self.jobs.get(rid)
            if job is None or job.state == J.FINISHED:
                w.inflight.discard(rid)
                if job is not None:
                    self._unhold(job, w)
                    self._maybe_forget(job)
                continue
            job.excluded.add(w.identity)
            self._reschedule(job, f"{w.node_id}: {why}", count=True)
        w.inflight.clear()
        w.inflight_tokens = 0

    def _reschedule(self, job: Job, why: str, *, count: bool) -> None:
        self._release(job, notify=True)
        if count:
            job.migrations += 1
            self.counters["migrations"] += 1
            if job.migrations > self.s.max_migrations:
                self.counters["migrations_exhausted"] += 1
                self._end_stream(job, error=f"worker failed and no migration is left ({why})")
                return
        log.info("request %s moves to another worker (%s)", job.request_id.hex(), why)
        # Anything already streamed must not be produced again: continue from it.
        job.resume = job.next_seq > 0
        self._set_state(job, J.QUEUED)
        # With no other worker of its role up (a single hybrid worker, say), the request
        # waits for one to come back rather than ending a stream that could continue.
        job.failed_over = True
        job.deadline = self.clock() + max(self.s.queue_timeout_s, self.s.failover_wait_s)
        if not self._try_dispatch(job) and not any(w.usable for w in self.registry.workers.values()):
            log.info("request %s waits up to %.0fs for a worker to come back", job.request_id.hex(), self.s.failover_wait_s)

    def _reprobe(self, now: float) -> None:
        down = self.registry.down()
        if not down or now < self._probe_deadline or now - self._last_probe < self.s.reprobe_interval_ms / 1000:
            return
        # Single flight: one probe round at a time, answers within the timeout count.
        self._last_probe = now
        self._probe_deadline = now + self.s.reprobe_timeout_ms / 1000
        self.counters["reprobes"] += 1
        for w in down:
            self.to_worker(w.identity, M.Heartbeat("broker"))
