"""A worker's health towards the broker: heartbeats with its load (and its KV transfer
totals), silence when the engine loop stalls so the broker moves its requests, and the
SIGTERM drain. Part of :class:`tandem.workers.worker.Worker` (its state lives there).
"""

from __future__ import annotations

import faulthandler
import logging
import time

from tandem import _malloc
from tandem.wire import messages as M
from tandem.wire import protocol as P

log = logging.getLogger("tandem.worker")


class Health:
    def drain(self, *_):
        """SIGTERM: stop taking work, finish what we hold within the grace period."""
        if not self._draining:
            log.info("draining (grace %.0fs)", self.s.drain_grace_s)
            self._draining = True
            self._drain_deadline = time.monotonic() + self.s.drain_grace_s
            self._next_heartbeat = 0.0
            if self.on_drain is not None:
                self.on_drain()

    def alive(self) -> bool:
        """For a watchdog: the IO loop turns and the engine is not stalled."""
        return not self.stalled and time.monotonic() - self.last_loop < max(5.0, 5 * self.heartbeat_s)

    def _engine_progressing(self, now: float, stats) -> bool:
        busy = stats.running + stats.waiting > 0 or any(not x.receiving for x in self.local.values())
        # The stall clock runs only while there is work: an idle engine takes no steps, so
        # without the reset the first request after an idle spell longer than the timeout
        # was flagged at the next heartbeat, before its first step could finish. A place
        # held for KV still arriving is no work for the engine: a transfer streamed while
        # its prompt is prefilled lasts as long as that prefill (a 4,096-token prompt on a
        # loaded CPU took over 30 s, and the idle decode worker declared itself stalled).
        if stats.steps != self._last_steps or not busy:
            self._last_steps = stats.steps
            self._last_progress = now
        return now - self._last_progress < self.s.stall_timeout_s

    def _heartbeat(self, now: float) -> None:
        self._next_heartbeat = now + self.heartbeat_s
        stats = self.engine.stats()
        if not self._engine_progressing(now, stats):
            if not self.stalled:
                log.error("engine made no progress for %.0fs with work queued: heartbeats stop so the broker moves our requests", self.s.stall_timeout_s)
                # Where every thread is (the engine's above all), once per stall: a hang in
                # native code leaves nothing else to go on.
                faulthandler.dump_traceback(all_threads=True)
            self.stalled = True
            return
        self.stalled = False
        sent = self.sender.counters if self.sender is not None else {}
        self._send(M.Heartbeat(self.node_id, stats.running, stats.waiting, stats.free_blocks, stats.total_blocks,
                               list(reversed(self.recent_prefixes))[: P.MAX_PREFIX_HASHES],
                               list(self.local)[: P.MAX_HELD_REQUESTS], float(stats.tokens_per_s), self._draining,
                               kv_handoffs=sent.get("handoffs", 0), kv_sent_bytes=sent.get("handoff_bytes", 0),
                               kv_sent_s=sent.get("handoff_ms", 0.0) / 1000,
                               kv_received_bytes=self.kv_in.bytes_in if self.kv_in is not None else 0,
                               prefix_queries=stats.prefix_queries, prefix_hits=stats.prefix_hits,
                               spec_draft_tokens=stats.spec_draft_tokens, spec_accepted_tokens=stats.spec_accepted_tokens,
                               kv_store_bytes=stats.kv_store_bytes, kv_mirror_bytes=stats.kv_mirror_bytes,
                               heap_free_bytes=_malloc.heap_free_bytes() + getattr(stats, "mlx_cache_bytes", 0)))
        # Proves to the broker that this PUB's connection to its XSUB is up: it only
        # dispatches to workers whose tokens it can actually receive.
        self._pub_send([P.STREAM_PING_TOPIC, self.node_id.encode()])

    def _finish_drain(self) -> None:
        for rid, local in list(self.local.items()):
            self.engine.abort(rid)
            self._send(M.Failed(rid, "worker shut down before the request finished", retryable=True))
        self.local.clear()
        self._send(M.Disconnect(self.node_id, "drained"))
        log.info("drained; leaving")
        self._stop = True
