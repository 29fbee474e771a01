"""Each request's token stream as the broker sees it pass: sequence numbers, the tokens
(kept, so a migrated request can resume from them), the final message, and what to do
when a final message never comes. Part of :class:`tandem.broker.dispatcher.Dispatcher`
(its state lives there: ``jobs``, ``awaiting_final``, ``reordering``, ``counters``).
"""

from __future__ import annotations

from tandem.broker import jobs as J
from tandem.broker.jobs import Job
from tandem.wire import messages as M

FINISHED_LINGER_S = 10.0  # keep a finished job this long for late DONEs, then forget it
FINAL_GRACE_S = 2.0  # after a worker's DONE, wait this long for its final stream message
LINGER_SCAN_S = 1.0  # how often tick() looks for finished jobs past their linger time
# A message that arrives ahead of a missing one waits this long for it (the prefill
# worker's first token racing the decode worker's second over another connection), and at
# most this many wait per request; then the gap ends the stream with an error.
REORDER_WINDOW_S = 2.0
MAX_AHEAD = 16


class StreamTracking:
    def stream(self, job: Job | None, attempt: int, msg: M.TokenMessage, raw=None) -> str:
        """Judge one worker token message (an entry of a worker's TOKEN_BATCH; ``raw``: the
        entry as received, kept with a held one). Returns 'forward', 'patched', 'held' (it
        came ahead of a missing one: :meth:`take_ready` hands it back once that one
        arrives) or 'drop'. Each entry is judged on its own: a gap in one request's
        stream holds or ends that stream only."""
        if job is None:
            return "forward"  # not ours (a broker restart lost the record): pass it through
        if job.state == J.FINISHED or attempt != job.attempt:
            self.counters["stale_stream_messages"] += 1
            return "drop"
        if msg.seq < job.next_seq or (job.ahead and msg.seq in job.ahead):
            self.counters["duplicate_stream_messages"] += 1
            return "drop"
        if msg.seq > job.next_seq:
            if job.ahead is None:
                job.ahead = {}
                job.ahead_since = self.clock()
                self.reordering[job.request_id] = job
            if len(job.ahead) >= MAX_AHEAD:
                self._gap(job)
                return "drop"
            job.ahead[msg.seq] = (attempt, msg, raw)
            self.counters["reordered_stream_messages"] += 1
            return "held"
        job.next_seq += 1
        if job.first_token_at is None and msg.tokens:
            job.first_token_at = self.clock()
            self.counters["prompt_tokens"] += len(job.prompt)  # prefilled: the throughput line's prompt tokens
        job.generated.extend(msg.tokens)
        self.counters["tokens"] += len(msg.tokens)
        # The first token is the prefill worker's, the rest the decode worker's: the
        # console's per-worker tokens/s is the change of these totals.
        source = self.registry.get(job.prefill_worker if msg.seq == 0 else job.decode_worker)
        if source is not None:
            source.tokens += len(msg.tokens)
        if msg.finish_reason is None and msg.error is None:
            return "forward"
        self._set_state(job, J.FINISHED)
        job.finished_at = self.clock()
        self.counters["completed" if msg.error is None else "errored"] += 1
        if job.migrations or job.resume or (msg.usage and msg.usage.prompt_tokens != len(job.prompt)):
            # A resumed worker counted prompt + earlier tokens as its prompt: report the
            # client's view instead.
            cached = msg.usage.cached_prompt_tokens if msg.usage else 0
            msg.usage = M.Usage(len(job.prompt), len(job.generated), min(cached, len(job.prompt)))
            self._maybe_forget(job)
            return "patched"
        # Forget it now if its worker's DONE came first; otherwise that DONE forgets it.
        # (Left to the linger purge, finished jobs pile up by the tens of thousands at
        # high rates and every tick and garbage collection walks them.)
        self._maybe_forget(job)
        return "forward"

    def take_ready(self, job: Job | None) -> list[tuple[int, M.TokenMessage, object]]:
        """Held messages that are next in line now, in order (to pass to :meth:`stream`)."""
        if job is None or not job.ahead or job.next_seq not in job.ahead:
            return []
        ready, seq = [], job.next_seq
        while seq in job.ahead:
            ready.append(job.ahead.pop(seq))
            seq += 1
        if not job.ahead:
            job.ahead = None
            self.reordering.pop(job.request_id, None)
        return ready

    def _gap(self, job: Job) -> None:
        first = min(job.ahead) if job.ahead else job.next_seq + 1
        job.ahead = None
        self.reordering.pop(job.request_id, None)
        self.counters["stream_gaps"] += 1
        self._release(job, notify=True)
        self._end_stream(job, error=f"token stream gap: expected message {job.next_seq}, got {first}")

    def _close_gaps(self, now: float) -> None:
        """End the streams whose missing message did not come within the reorder window."""
        for rid, job in list(self.reordering.items()):
            if job.state == J.FINISHED or self.jobs.get(rid) is not job or not job.ahead:
                del self.reordering[rid]
                job.ahead = None
            elif job.ahead_since + REORDER_WINDOW_S < now:
                self._gap(job)

    def _end_stream(self, job: Job, *, finish_reason: str | None = None, error: str | None = None) -> None:
        """The broker writes the last stream message itself (failure or lost final)."""
        if job.state == J.FINISHED:
            return
        self.publish(M.TokenMessage(job.request_id, job.next_seq, [], None,
                                    finish_reason or "error", job.usage(), error))
        job.next_seq += 1
        if job.state in (J.WAITING_SUB, J.QUEUED) and error:
            self.counters["errored"] += 1
        self._finish(job)

    def _finish(self, job: Job) -> None:
        self._set_state(job, J.FINISHED)
        job.finished_at = self.clock()
        self._maybe_forget(job)

    def _maybe_forget(self, job: Job) -> None:
        if job.state == J.FINISHED and not job.holders:
            self.jobs.pop(job.request_id, None)
            # (Left for tick() to find, these piled up by the hundreds between ticks.)
            self.awaiting_final.pop(job.request_id, None)
            self.reordering.pop(job.request_id, None)

    def _close_lost_finals(self, now: float) -> None:
        """End the streams whose worker said DONE but whose final message never came."""
        for rid, job in list(self.awaiting_final.items()):
            if job.state == J.FINISHED or self.jobs.get(rid) is not job:
                del self.awaiting_final[rid]
            elif job.worker_done_at + FINAL_GRACE_S < now:
                del self.awaiting_final[rid]
                self.counters["lost_finals"] += 1
                done = job.worker_done
                expected = done.usage.completion_tokens if done.usage else None
                # A resumed worker counts the tokens it generated, not those before the
                # Resume. (Migrated requests used to skip this check: one whose last
                # messages were lost ended "length" with tokens missing; bench/chaos.py.)
                if expected is None or job.resumed_from + expected == len(job.generated):
                    self._end_stream(job, finish_reason=done.finish_reason)
                else:
                    self._end_stream(job, error="the worker finished but some of its tokens were lost in transit")

    def _purge_finished(self, now: float) -> None:
        """Forget finished jobs past their linger time (once a second, not every tick)."""
        if now < self._next_linger_scan:
            return
        self._next_linger_scan = now + LINGER_SCAN_S
        for job in [j for j in self.jobs.values() if j.state == J.FINISHED and j.finished_at + FINISHED_LINGER_S < now]:
            self._release(job, notify=False)
            self.jobs.pop(job.request_id, None)
