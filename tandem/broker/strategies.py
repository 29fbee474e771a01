"""Worker selection: given the workers that can take a request now, pick one.

Every strategy sees only workers with room (admission already filtered them) and
returns ``None`` only when that list is empty. Load is the broker's own count of
requests a worker holds (current at every dispatch) plus what its last heartbeat said
is queued inside its engine; heartbeats alone lag by up to an interval.
"""

from __future__ import annotations

from tandem.broker.registry import Worker


def load_of(w: Worker) -> int:
    return len(w.inflight) + w.load.waiting


class Selector:
    """Holds the round-robin cursor; one per pool (prefill side, decode side)."""

    def __init__(self, strategy: str, *, long_prompt_tokens: int = 512, load_guard: float = 2.0):
        self.strategy = strategy
        self.long_prompt_tokens = long_prompt_tokens
        self.load_guard = load_guard
        self._rr = 0
        self.prefix_hits = 0
        self._pick = getattr(self, "_" + strategy)

    def choose(self, candidates: list[Worker], *, prompt_len: int = 0, prefixes: list[int] | None = None) -> Worker | None:
        if not candidates:
            return None
        return self._pick(candidates, prompt_len, prefixes or [])

    def _round_robin(self, ws, prompt_len, prefixes):
        # The cursor counts dispatches, so the order is stable as workers come and go.
        w = ws[self._rr % len(ws)]
        self._rr += 1
        return w

    def _min(self, ws, key):
        # Ties go round-robin so equal workers share the load instead of the first one
        # taking everything between two heartbeats.
        keys = [key(w) for w in ws]
        best = min(keys)
        tied = [w for w, k in zip(ws, keys) if k == best]
        return self._round_robin(tied, 0, None)

    def _least_loaded(self, ws, prompt_len, prefixes):
        keys = [len(w.inflight) + w.load.waiting for w in ws]  # load_of, inlined: once per dispatch
        best = min(keys)
        tied = [w for w, k in zip(ws, keys) if k == best]
        w = tied[self._rr % len(tied)]
        self._rr += 1
        return w

    def _memory_aware(self, ws, prompt_len, prefixes):
        def free(w: Worker) -> float:
            if w.load.total_blocks <= 0:
                return -float(load_of(w))
            # The heartbeat's free count does not yet know about requests dispatched since;
            # charge each in-flight request's prompt blocks against it.
            bs = max(1, w.load.block_size)
            pending = (w.inflight_tokens + bs - 1) // bs
            return (w.load.free_blocks - pending) / w.load.total_blocks
        return self._min(ws, lambda w: -free(w))

    def _prompt_length_aware(self, ws, prompt_len, prefixes):
        if prompt_len >= self.long_prompt_tokens:
            # Long prompt: the worker with the least prefill work queued (compute headroom).
            return self._min(ws, lambda w: w.inflight_tokens)
        # Short prompt: the worker holding the fewest requests finishes it soonest.
        return self._min(ws, load_of)

    def _prefix_aware(self, ws, prompt_len, prefixes):
        floor = min(load_of(w) for w in ws)
        limit = self.load_guard * (floor + 1)
        # Never send a request to a worker far busier than the rest just because it has the
        # prefix: that is how cache-aware routers pile everything on one hot node.
        eligible = [w for w in ws if load_of(w) <= limit]

        def matched(w: Worker) -> int:
            n = 0
            for h in prefixes:
                if h not in w.prefixes:
                    break
                n += 1
            return n

        best = max(matched(w) for w in eligible)
        if best == 0:
            return self._least_loaded(eligible, prompt_len, prefixes)
        self.prefix_hits += 1
        return self._min([w for w in eligible if matched(w) == best], load_of)
