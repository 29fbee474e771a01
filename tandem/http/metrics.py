"""Prometheus metrics of the edge (``tandem_`` prefix), correct across gunicorn workers.

Under gunicorn every worker is a separate process, so counters and histograms live
in prometheus-client's multiprocess mode: ``PROMETHEUS_MULTIPROC_DIR`` is set by
``tandem edge`` before anything imports prometheus_client, each process writes its
own mmap files, and a scrape merges them. Cluster-wide values (KV usage, prefix
cache hit ratio, the broker's queue) are not per-process: they are read from the
broker's stats at scrape time into a throwaway registry.
"""

from __future__ import annotations

import os

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_LATENCY = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_ITL = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5)
_E2E = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0)


def multiprocess() -> bool:
    return bool(os.environ.get("PROMETHEUS_MULTIPROC_DIR"))


class EdgeMetrics:
    """The edge's own series; one instance per app."""

    def __init__(self):
        # In multiprocess mode values go to files, whatever registry a metric names;
        # outside it, a private registry keeps two apps in one test process apart.
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.running = Gauge("tandem_requests_running", "Requests streaming tokens through this edge", registry=r, multiprocess_mode="livesum")
        self.waiting = Gauge("tandem_requests_waiting", "Requests submitted and waiting for their first token", registry=r, multiprocess_mode="livesum")
        self.requests = Counter("tandem_requests", "Finished requests by endpoint and finish reason", ["endpoint", "finish_reason"], registry=r)
        self.refused = Counter("tandem_requests_refused", "Requests refused by reason (busy reasons, unavailable, auth, invalid)", ["reason"], registry=r)
        self.ttft = Histogram("tandem_time_to_first_token_seconds", "Submit to first token", buckets=_LATENCY, registry=r)
        self.itl = Histogram("tandem_inter_token_latency_seconds", "Time between consecutive tokens of one request", buckets=_ITL, registry=r)
        self.e2e = Histogram("tandem_request_duration_seconds", "Submit to last token", buckets=_E2E, registry=r)
        self.prompt_tokens = Counter("tandem_prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.cached_tokens = Counter("tandem_prompt_tokens_cached", "Prompt tokens served from the prefix cache", registry=r)
        self.generation_tokens = Counter("tandem_generation_tokens", "Generated tokens", registry=r)

    def refuse(self, reason: str) -> None:
        self.refused.labels(reason=reason or "unknown").inc()

    def observe_gap(self, gap_s: float, tokens: int) -> None:
        # One event may carry several tokens (one engine step's worth): spread the gap.
        if tokens > 0:
            per = gap_s / tokens
            for _ in range(tokens):
                self.itl.observe(per)

    def render(self, cluster: dict | None) -> bytes:
        if multiprocess():
            from prometheus_client import multiprocess as mp

            merged = CollectorRegistry()
            mp.MultiProcessCollector(merged)
        else:
            merged = self.registry
        text = generate_latest(merged)
        extra = CollectorRegistry()
        extra.register(_ClusterCollector(cluster, _sample_sums(merged)))
        return text + generate_latest(extra)


def _sample_sums(registry: CollectorRegistry) -> dict[str, float]:
    sums: dict[str, float] = {}
    for family in registry.collect():
        for sample in family.samples:
            sums[sample.name] = sums.get(sample.name, 0.0) + sample.value
    return sums


def _num(d: dict, *keys: str) -> float | None:
    for key in keys:
        value = d.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    return None


class _ClusterCollector:
    """Gauges derived from the broker's stats (and the edge's counters) at scrape time."""

    def __init__(self, cluster: dict | None, sums: dict[str, float]):
        self.cluster = cluster
        self.sums = sums

    def collect(self):
        up = GaugeMetricFamily("tandem_broker_up", "1 when the broker answered the stats query")
        up.add_metric([], 1.0 if self.cluster is not None else 0.0)
        yield up
        prompt = self.sums.get("tandem_prompt_tokens_total", 0.0)
        cached = self.sums.get("tandem_prompt_tokens_cached_total", 0.0)
        workers = _workers(self.cluster)
        queries = sum(_num(w, "prefix_queries") or 0.0 for w in workers)
        hits = sum(_num(w, "prefix_hits") or 0.0 for w in workers)
        ratio = GaugeMetricFamily(
            "tandem_prefix_cache_hit_ratio",
            "Share of prefix-cache lookups that hit (workers' view; the edge's cached/prompt tokens if workers report none)",
        )
        ratio.add_metric([], hits / queries if queries else (cached / prompt if prompt else 0.0))
        yield ratio
        if not workers:
            return
        total = sum(_num(w, "total_blocks") or 0.0 for w in workers)
        free = sum(_num(w, "free_blocks") or 0.0 for w in workers)
        usage = GaugeMetricFamily("tandem_kv_cache_usage_ratio", "Used share of all workers' KV blocks")
        usage.add_metric([], (total - free) / total if total else 0.0)
        yield usage
        for key, help_text in (("running", "Sequences running on workers"), ("waiting", "Requests queued on workers")):
            fam = GaugeMetricFamily(f"tandem_worker_requests_{key}", help_text)
            fam.add_metric([], sum(_num(w, key) or 0.0 for w in workers))
            yield fam
        for key, help_text in (("spec_draft_tokens", "Tokens drafted for verification by speculative decoding, all workers"),
                               ("spec_accepted_tokens", "Drafted tokens the target model accepted, all workers")):
            fam = CounterMetricFamily(f"tandem_{key}", help_text)
            fam.add_metric([], sum(_num(w, key) or 0.0 for w in workers))
            yield fam
        queued = _num(self.cluster, "queued", "queue_depth", "waiting")
        if queued is not None:
            fam = GaugeMetricFamily("tandem_broker_requests_queued", "Requests queued in the broker")
            fam.add_metric([], queued)
            yield fam
        yield from _per_worker(workers)
        yield from _broker_counters(self.cluster.get("counters"))


def _per_worker(workers: list[dict]):
    """One series per worker under its redacted id (``decode-0``): the spread of load."""
    by_state = GaugeMetricFamily("tandem_workers", "Workers known to the broker by role and state", labels=["role", "state"])
    counts: dict[tuple[str, str], int] = {}
    for w in workers:
        key = (str(w.get("role", "")), str(w.get("state", "")))
        counts[key] = counts.get(key, 0) + 1
    for key, n in sorted(counts.items()):
        by_state.add_metric(list(key), n)
    yield by_state
    families = (
        (GaugeMetricFamily, "tandem_worker_kv_blocks_used", "KV blocks in use on a worker", "used_blocks"),
        (GaugeMetricFamily, "tandem_worker_kv_blocks_total", "KV blocks a worker's pool holds", "total_blocks"),
        (GaugeMetricFamily, "tandem_worker_kv_store_bytes", "Bytes a worker's KV store holds (grows to its block budget)",
         "kv_store_bytes"),
        (GaugeMetricFamily, "tandem_worker_kv_mirror_bytes",
         "Bytes of the decode batch's contiguous KV copy a worker keeps (grows to its largest batch x context)", "kv_mirror_bytes"),
        (GaugeMetricFamily, "tandem_worker_heap_free_bytes",
         "Freed memory a worker keeps for reuse: glibc's free heap and MLX's buffer cache (resident, not in use)", "heap_free_bytes"),
        (CounterMetricFamily, "tandem_worker_generated_tokens", "Tokens of a worker's streams the broker forwarded", "tokens"),
    )
    for family, name, help_text, key in families:
        fam = family(name, help_text, labels=["node", "role"])
        for w in workers:
            value = _num(w, key)
            if value is not None and "node" in w:
                fam.add_metric([str(w["node"]), str(w.get("role", ""))], value)
        yield fam


# Broker counters worth a Prometheus series: (name, help, key in the broker's counters).
_BROKER_COUNTERS = (
    ("tandem_broker_requests_submitted", "Requests the broker accepted", "submitted"),
    ("tandem_broker_generated_tokens", "Tokens the broker proxied from workers to clients", "tokens"),
    ("tandem_broker_kv_handoffs", "Prefill-to-decode KV handoffs completed", "handoffs"),
    ("tandem_broker_migrations", "Requests moved to another worker after a failure", "migrations"),
    ("tandem_broker_migrations_exhausted", "Requests that failed because no migration was left", "migrations_exhausted"),
    ("tandem_broker_worker_refusals", "Dispatches a worker refused (full, draining)", "worker_refusals"),
)
_BROKER_REFUSALS = {"refused_busy": "busy", "refused_no_worker": "no_worker", "refused_timeout": "timeout"}


def _broker_counters(counters):
    if not isinstance(counters, dict):
        return
    for name, help_text, key in _BROKER_COUNTERS:
        fam = CounterMetricFamily(name, help_text)
        fam.add_metric([], _num(counters, key) or 0.0)
        yield fam
    refused = CounterMetricFamily("tandem_broker_requests_refused", "Requests the broker refused, by reason", labels=["reason"])
    for key, reason in _BROKER_REFUSALS.items():
        refused.add_metric([reason], _num(counters, key) or 0.0)
    yield refused


def _workers(cluster: dict | None) -> list[dict]:
    if not isinstance(cluster, dict):
        return []
    workers = cluster.get("workers")
    if isinstance(workers, dict):
        workers = list(workers.values())
    if not isinstance(workers, list):
        return []
    out = []
    for w in workers:
        if isinstance(w, dict):
            load = w.get("load")
            out.append({**w, **load} if isinstance(load, dict) else w)
    return out
