"""Admission: whether a request may enter the broker's queue, and when one that is
waiting must be refused instead (its client never subscribed, no worker took it in
time, or no worker is left and a probe round went unanswered). Part of
:class:`tandem.broker.dispatcher.Dispatcher` (its state lives there).
"""

from __future__ import annotations

from tandem.broker import jobs as J
from tandem.broker.jobs import Job
from tandem.broker.registry import UP
from tandem.wire import messages as M


class Admission:
    def _admit(self, client: bytes, msg: M.Submit) -> bool:
        """Checks before a SUBMIT is queued; a refusal is sent from here."""
        rid = msg.request_id
        if rid in self.jobs:
            self._refuse(client, rid, "invalid", "request id already in use; use a fresh random 16-byte id")
            return False
        if len(msg.prompt) > self.s.max_prompt_tokens:
            self._refuse(client, rid, "invalid", f"prompt of {len(msg.prompt)} tokens exceeds the broker's limit of {self.s.max_prompt_tokens}")
            return False
        if len(self.pending) >= self.s.max_queue:
            self.counters["refused_busy"] += 1
            self._refuse(client, rid, "busy", "broker queue is full", self.s.retry_after_s)
            return False
        if not self.registry.workers:
            self.counters["refused_no_worker"] += 1
            self._refuse(client, rid, "no_worker", "no worker has registered with the broker", self.s.retry_after_s)
            return False
        return True

    def _expire_queue(self, now: float) -> None:
        """Refuse the queued requests that can no longer be placed; re-probe when no
        worker is usable."""
        usable = any(w.state == UP for w in self.registry.workers.values())
        can_probe = bool(self.registry.down())
        probe_done = now >= self._probe_deadline
        for job in self.queued():
            if job.deadline < now:
                if job.state == J.WAITING_SUB:
                    reason, text = "invalid", "the client never subscribed to the request's stream"
                elif job.failed_over and not usable:
                    reason, text = "no_worker", (f"its worker failed and no worker came back to continue it within "
                                                 f"{max(self.s.queue_timeout_s, self.s.failover_wait_s):.0f}s")
                else:
                    reason, text = "busy", "no worker could take the request in time"
                self.counters["refused_timeout"] += 1
                self._refuse_job(job, reason, text)
            elif (job.state == J.QUEUED and not usable and not job.failed_over
                  and (not can_probe or (probe_done and job.arrived <= self._last_probe))):
                # Refuse for lack of workers only after a probe round that started after
                # the request arrived went unanswered (one whose worker failed waits on,
                # until its deadline, for a worker to return).
                self.counters["refused_no_worker"] += 1
                self._refuse_job(job, "no_worker", "no worker is available")
        if not usable and any(j.state == J.QUEUED for j in self.pending.values()):
            self._reprobe(now)

    def _refuse(self, client, rid, reason, message, retry_after=0.0):
        self.to_client(client, M.Refused(rid, reason, message, retry_after))

    def _refuse_job(self, job: Job, reason: str, text: str) -> None:
        if job.next_seq == 0 and not job.migrations:
            self._refuse(job.client, job.request_id, reason, text, self.s.retry_after_s)
            self._finish(job)
        else:
            self._end_stream(job, error=text)
