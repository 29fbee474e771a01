"""The broker's view of its workers: who is up, what each can take, how loaded it is.

Liveness is Majordomo-style: every message from a worker (READY, heartbeat, anything)
pushes its expiry ``liveness x interval`` into the future on the monotonic clock; a
worker past its expiry is marked down and skipped, and the broker re-dispatches what
it held. A down worker is kept (not forgotten) so that a re-probe can bring it back.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, field

ROLES = ("prefill", "decode", "hybrid")
UP, DOWN, DRAINING = "up", "down", "draining"
PREFIX_MEMORY = 1024  # routing prefix hashes remembered per worker (LRU)


@dataclass
class Load:
    running: int = 0
    waiting: int = 0
    free_blocks: int = 0
    total_blocks: int = 0
    block_size: int = 16
    prefix_queries: int = 0
    prefix_hits: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    kv_store_bytes: int = 0
    heap_free_bytes: int = 0
    kv_mirror_bytes: int = 0


@dataclass
class KVTraffic:
    """KV handoffs a worker reports in its heartbeats (totals since it started)."""

    handoffs: int = 0
    sent_bytes: int = 0
    sent_s: float = 0.0
    received_bytes: int = 0
    recent_gb_s: float | None = None  # moving average over the heartbeats that saw handoffs

    EWMA = 0.3  # weight of the newest heartbeat interval's bandwidth

    def update(self, handoffs: int, sent_bytes: int, sent_s: float, received_bytes: int) -> None:
        d_bytes, d_s = sent_bytes - self.sent_bytes, sent_s - self.sent_s
        if sent_bytes < self.sent_bytes or handoffs < self.handoffs:
            d_bytes, d_s = sent_bytes, sent_s  # the worker restarted: its totals began again
        if d_bytes > 0 and d_s > 0:
            gb_s = d_bytes / d_s / 1e9
            self.recent_gb_s = gb_s if self.recent_gb_s is None else self.EWMA * gb_s + (1 - self.EWMA) * self.recent_gb_s
        self.handoffs, self.sent_bytes, self.sent_s, self.received_bytes = handoffs, sent_bytes, sent_s, received_bytes

    @property
    def gb_s(self) -> float | None:
        return self.sent_bytes / self.sent_s / 1e9 if self.sent_s > 0 else None


@dataclass
class Worker:
    identity: bytes  # ROUTER routing id
    name: str  # the worker's own name (host:pid or --name)
    role: str
    model_id: str
    capacity: int  # requests it may hold at once
    kv_addr: str  # where a decode/hybrid worker accepts KV handoffs ('' for prefill)
    node_id: str  # stable redacted id, e.g. decode-1
    device: str = ""  # where its engine runs, as it says ("cpu", "gpu 1")
    incarnation: int | None = None  # its process's READY nonce: another one means it restarted
    expiry: float = 0.0
    state: str = UP
    stream_ok: bool = False  # its PUB reaches our XSUB (proved by a stream ping)
    load: Load = field(default_factory=Load)
    inflight: set = field(default_factory=set)  # request ids this worker holds
    inflight_tokens: int = 0  # prompt tokens of requests dispatched for prefill and not done
    dispatched: int = 0
    decode_targeted: int = 0
    refusals: int = 0
    failures: int = 0
    tokens: int = 0  # tokens of its requests' streams the broker forwarded (prefill: first tokens)
    prefixes: OrderedDict = field(default_factory=OrderedDict)
    saturated: bool = False  # it refused work; no more until its next heartbeat says otherwise
    kv: KVTraffic = field(default_factory=KVTraffic)

    @property
    def prefills(self) -> bool:
        return self.role in ("prefill", "hybrid")

    @property
    def decodes(self) -> bool:
        return self.role in ("decode", "hybrid")

    @property
    def usable(self) -> bool:
        return self.state == UP and self.stream_ok

    def has_room(self) -> bool:
        return self.usable and not self.saturated and len(self.inflight) < self.capacity

    def remember_prefixes(self, hashes) -> None:
        for h in hashes:
            self.prefixes[h] = None
            self.prefixes.move_to_end(h)
        while len(self.prefixes) > PREFIX_MEMORY:
            self.prefixes.popitem(last=False)


class Registry:
    """All workers the broker has seen, keyed by routing identity."""

    def __init__(self, heartbeat_s: float, liveness: int, clock=time.monotonic):
        self.heartbeat_s = heartbeat_s
        self.liveness = liveness
        self.clock = clock
        self.workers: dict[bytes, Worker] = {}
        # The pools dispatch scans on every request, rebuilt only when membership or a
        # role changes: prefill-capable workers, and decode workers that take KV.
        self.entry_pool: list[Worker] = []
        self.decode_pool: list[Worker] = []
        self._counters = {role: 0 for role in ROLES}
        self._node_ids: dict[str, str] = {}

    def _repool(self) -> None:
        ws = list(self.workers.values())
        self.entry_pool = [w for w in ws if w.prefills]
        self.decode_pool = [w for w in ws if w.role == "decode" and w.kv_addr]

    def register(self, identity: bytes, *, name: str, role: str, model_id: str, capacity: int, kv_addr: str,
                 incarnation: int | None = None) -> Worker:
        old = self.workers.get(identity)
        if old is not None:
            # A worker re-announcing itself (restart of the broker or of the worker under
            # the same identity): keep its counters, refresh everything it told us. Another
            # process under the same name (its supervisor restarted it faster than its
            # heartbeats could expire) counts as a failure, as an expiry would have.
            if incarnation is not None and old.incarnation is not None and incarnation != old.incarnation:
                old.failures += 1
            old.incarnation = incarnation
            old.role, old.model_id, old.capacity, old.kv_addr = role, model_id, capacity, kv_addr
            old.state = UP
            old.stream_ok = False
            self.touch(old)
            self._repool()
            return old
        key = f"{role}:{name}:{kv_addr}"
        node_id = self._node_ids.get(key)
        if node_id is None:
            node_id = f"{role}-{self._counters[role]}"
            self._counters[role] += 1
            self._node_ids[key] = node_id
        w = Worker(identity=identity, name=name, role=role, model_id=model_id, capacity=capacity, kv_addr=kv_addr, node_id=node_id,
                   incarnation=incarnation)
        self.workers[identity] = w
        self.touch(w)
        self._repool()
        return w

    def get(self, identity: bytes) -> Worker | None:
        return self.workers.get(identity)

    def touch(self, w: Worker) -> None:
        w.expiry = self.clock() + self.heartbeat_s * self.liveness

    def expired(self) -> list[Worker]:
        """Workers that just missed their deadline; they are marked down here."""
        now = self.clock()
        dead = [w for w in self.workers.values() if w.state != DOWN and w.expiry < now]
        for w in dead:
            w.state = DOWN
            w.stream_ok = False
            w.failures += 1
        return dead

    def forget(self, identity: bytes) -> Worker | None:
        w = self.workers.pop(identity, None)
        self._repool()
        return w

    def by_role(self, *, prefill: bool) -> list[Worker]:
        """Workers in stable registration order that can do the given half of a request."""
        return [w for w in self.workers.values() if (w.prefills if prefill else w.decodes)]

    def counts(self) -> dict[str, int]:
        out = {role: 0 for role in ROLES}
        for w in self.workers.values():
            if w.usable:
                out[w.role] += 1
        return out

    def down(self) -> list[Worker]:
        return [w for w in self.workers.values() if w.state == DOWN]
