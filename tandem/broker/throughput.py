"""The cluster's throughput as one log line every ``broker.log_stats_interval_s``, the
line operators watch in vLLM ("Avg prompt throughput ... generation throughput ..."):
prompt and generated tokens per second over the interval, requests running and queued,
KV cache use and workers up. Quiet while the cluster is idle: one line after the last
activity, then nothing until work arrives again.
"""

from __future__ import annotations

import time

from tandem.broker import jobs as J


class ThroughputLog:
    def __init__(self, interval_s: float, clock=time.monotonic):
        self.interval_s = interval_s
        self.clock = clock
        self._at = clock()
        self._prompt = self._generated = 0
        self._quiet = True  # the last line (or the start) showed no activity

    def line(self, dispatcher) -> str | None:
        """The line due now, or None (not yet due, switched off, or idle and said so)."""
        now = self.clock()
        if self.interval_s <= 0 or now - self._at < self.interval_s:
            return None
        d = dispatcher
        prompt, generated = d.counters["prompt_tokens"], d.counters["tokens"]
        dt = now - self._at
        p_rate, g_rate = (prompt - self._prompt) / dt, (generated - self._generated) / dt
        self._at, self._prompt, self._generated = now, prompt, generated
        running = sum(1 for j in d.jobs.values() if j.state == J.RUNNING)
        queued = len(d.pending)
        idle = p_rate == 0 and g_rate == 0 and running == 0 and queued == 0
        if idle and self._quiet:
            return None
        self._quiet = idle
        workers = [w for w in d.registry.workers.values() if w.usable]
        total = sum(w.load.total_blocks for w in workers)
        used = sum(max(0, w.load.total_blocks - w.load.free_blocks) for w in workers)
        kv = f"{100 * used / total:.1f}%" if total else "-"
        return (f"avg prompt throughput: {p_rate:.1f} tokens/s, avg generation throughput: {g_rate:.1f} tokens/s, "
                f"running: {running} reqs, queued: {queued} reqs, KV cache usage: {kv}, workers up: {len(workers)}")
