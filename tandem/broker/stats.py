"""The broker's stats view: load spread, health, queue, migrations, refusals.

Worker names and addresses reveal the cluster's topology, so by default each worker
appears only under its stable broker-assigned id (``prefill-0``, ``decode-1``);
``[broker] stats_verbose`` (a trusted network) adds names and addresses.
"""

from __future__ import annotations

import statistics

from tandem.broker import jobs as J


def _ms_percentiles(seconds: list[float]) -> dict:
    xs = sorted(seconds)
    if not xs:
        return {"rounds": 0}
    at = lambda q: round(xs[min(len(xs) - 1, int(q * len(xs)))] * 1000, 3)  # noqa: E731
    return {"rounds": len(xs), "p50_ms": at(0.5), "p99_ms": at(0.99), "max_ms": round(xs[-1] * 1000, 3)}


def snapshot(dispatcher, *, verbose: bool = False, rounds_s: list[float] | None = None, busy_rounds: int = 0) -> dict:
    """``rounds_s``: durations of the broker loop's recent busy rounds (seconds);
    ``busy_rounds``: how many rounds had work since start."""
    d = dispatcher
    workers = []
    for w in d.registry.workers.values():
        row = {
            "node": w.node_id,
            "role": w.role,
            "device": w.device,
            "state": w.state if (w.stream_ok or w.state != "up") else "joining",
            "model": w.model_id,
            "capacity": w.capacity,
            "inflight": len(w.inflight),
            "dispatched": w.dispatched,
            "decode_targeted": w.decode_targeted,
            "refusals": w.refusals,
            "failures": w.failures,
            "running": w.load.running,
            "waiting": w.load.waiting,
            "free_blocks": w.load.free_blocks,
            "total_blocks": w.load.total_blocks,
            "used_blocks": max(0, w.load.total_blocks - w.load.free_blocks),
            "tokens": w.tokens,
            "prefix_queries": w.load.prefix_queries,
            "prefix_hits": w.load.prefix_hits,
            "spec_draft_tokens": w.load.spec_draft_tokens,
            "spec_accepted_tokens": w.load.spec_accepted_tokens,
            "kv_store_bytes": w.load.kv_store_bytes,
            "heap_free_bytes": w.load.heap_free_bytes,
            "kv_mirror_bytes": w.load.kv_mirror_bytes,
            # KV transfer: handoffs this worker sent, their bytes, bandwidth over all of
            # them and a moving average of recent heartbeat intervals (GB/s, 1e9 bytes).
            "kv_handoffs": w.kv.handoffs,
            "kv_sent_bytes": w.kv.sent_bytes,
            "kv_gb_s": None if w.kv.gb_s is None else round(w.kv.gb_s, 4),
            "kv_gb_s_recent": None if w.kv.recent_gb_s is None else round(w.kv.recent_gb_s, 4),
            "kv_received_bytes": w.kv.received_bytes,
        }
        if verbose:
            row["name"] = w.name
            row["kv_address"] = w.kv_addr
        workers.append(row)
    states = {}
    for j in d.jobs.values():
        states[j.state] = states.get(j.state, 0) + 1
    handoff = sorted(d.handoff_ms)
    return {
        "strategy": d.s.strategy,
        "queue_depth": len(d.queued()),
        "max_queue": d.s.max_queue,
        "requests": {"running": states.get(J.RUNNING, 0), "queued": states.get(J.QUEUED, 0),
                     "waiting_subscription": states.get(J.WAITING_SUB, 0)},
        "counters": dict(d.counters),
        "prefix_routed": d.entry.prefix_hits,
        "handoff_ms_p50": statistics.median(handoff) if handoff else None,
        "workers": workers,
        "ready": d.registry.counts(),
        "loop_rounds": {**_ms_percentiles(rounds_s or []), "busy_total": busy_rounds},
    }
