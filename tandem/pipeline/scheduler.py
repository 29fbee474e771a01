"""Which sequences run in the next forward, and with which blocks.

Pure bookkeeping over :class:`~tandem.pipeline.block_pool.BlockPool` (no mlx), so every
policy here is testable without a model.

A tick is either a **prefill** (newly admitted prompts, batched, each up to one chunk;
or one more chunk of the parked long prompt) or a **decode** (every running sequence with
one uncomputed token). Policy, in order:

1. A parked chunked prefill (a prompt longer than one chunk, admitted, partly computed)
   yields to decode, but after ``prefill_grant_interval`` consecutive decode ticks it is
   granted the next tick; so a C-chunk prompt has its first token within C x (N + 1)
   ticks. While it is parked nothing else is admitted (one parked prompt at most).
2. Otherwise waiting requests are admitted (highest priority first, then arrival) while
   ``parallel`` and the KV pool allow, up to ``max_batch_prefill`` prompts and
   ``max_batch_prefill_tokens`` padded tokens, and prefilled together.
3. Otherwise the running sequences decode, ``max_batch_size`` at a time, least recently
   run first.

KV pressure: with preemption on, admission only needs the blocks of the first chunk and
a decode that needs a block the pool does not have recomputes the lowest-priority
(latest-arrived) sequence: its blocks are released (full ones stay in the prefix cache),
it goes back to the queue with every token it has, and resumes where it was. With
preemption off, admission reserves blocks for the whole prompt plus ``max_tokens`` so
that a running sequence never runs out.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from tandem.pipeline.block_pool import ROOT_HASH, BlockPool
from tandem.pipeline.sequence import Row, Sequence, Status
from tandem.pipeline.settings import EngineSettings


@dataclass
class Plan:
    kind: str  # "prefill" | "decode"
    rows: list[Row]
    copies: list[tuple[int, int]] = field(default_factory=list)  # (src, dst) blocks to copy first
    preempted: list[Sequence] = field(default_factory=list)
    failed: list[tuple[Sequence, str]] = field(default_factory=list)


class Scheduler:
    def __init__(self, settings: EngineSettings, pool: BlockPool, prefix_caching: bool = True):
        self.s = settings
        self.pool = pool
        self.prefix_caching = prefix_caching
        self.max_batch_size = settings.max_batch_size or settings.parallel
        tokens_cap = settings.max_batch_prefill_tokens
        if tokens_cap is None:
            tokens_cap = 2 * settings.max_batch_prefill * settings.prefill_chunk_size
        self.max_batch_prefill_tokens = tokens_cap
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self.parked: Sequence | None = None
        self.decode_ticks_since_grant = 0
        self.tick = 0
        self.grants = 0
        self.preemptions = 0
        self._arrivals = 0

    # ---- queue --------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        seq.arrival = self._arrivals
        self._arrivals += 1
        self._enqueue(seq)

    def _enqueue(self, seq: Sequence) -> None:
        seq.status = Status.WAITING
        keys = [s.sort_key for s in self.waiting]
        self.waiting.insert(bisect.bisect_right(keys, seq.sort_key), seq)

    def remove(self, seq: Sequence) -> None:
        """Take a sequence out of the scheduler (finished or aborted) and free its blocks."""
        if seq.status is Status.WAITING:
            self.waiting.remove(seq)
        elif seq.status is Status.RUNNING:
            self.running.remove(seq)
        if self.parked is seq:
            self.parked = None
        self._release(seq)
        seq.status = Status.FINISHED

    def _release(self, seq: Sequence) -> None:
        self.pool.release_all(seq.block_ids)
        seq.block_ids = []
        seq.num_hashed = 0
        seq.last_hash = ROOT_HASH
        seq.num_computed = 0
        seq.dense_cache = None

    def blocks_reserved(self) -> int:
        """Blocks promised to running sequences but not allocated yet (preemption off)."""
        if self.s.enable_preemption:
            return 0
        return sum(max(0, self._lifetime_blocks(s) - len(s.block_ids)) for s in self.running)

    def _lifetime_blocks(self, seq: Sequence) -> int:
        remaining = seq.sampling.max_tokens - seq.num_generated - seq.pending
        return self.pool.blocks_for(seq.num_tokens + max(remaining, 0))

    # ---- the tick -----------------------------------------------------------------
    def schedule(self) -> Plan | None:
        self.tick += 1
        plan = Plan("decode", [])
        parked = self.parked
        if parked is not None:
            decodable = self._decodable()
            n = self.s.prefill_grant_interval
            if decodable and (n == 0 or self.decode_ticks_since_grant < n):
                self.decode_ticks_since_grant += 1
                return self._decode(plan, decodable)
            if decodable:
                self.grants += 1
            self.decode_ticks_since_grant = 0
            return self._prefill_parked(plan, parked)
        cohort = self._admit(plan)
        if cohort:
            plan.kind = "prefill"
            plan.rows = cohort
            return plan
        decodable = self._decodable()
        if decodable:
            return self._decode(plan, decodable)
        return plan if (plan.preempted or plan.failed) else None

    def _decodable(self) -> list[Sequence]:
        return [s for s in self.running if s is not self.parked and not s.hold and s.num_uncomputed == 1 and s.can_generate]

    def _decode(self, plan: Plan, decodable: list[Sequence]) -> Plan | None:
        decodable.sort(key=lambda s: (s.last_tick, s.sort_key))
        chosen = decodable[: self.max_batch_size]
        rows, planned = [], []
        for seq in chosen:
            if seq.status is not Status.RUNNING:
                continue  # preempted to make room for an earlier row
            if not self._make_room(seq, seq.num_computed + 1, plan, protect=planned):
                continue
            rows.append(Row(seq, seq.num_computed, 1, True))
            planned.append(seq)
        plan.rows = [r for r in rows if r.seq.status is Status.RUNNING]
        for r in plan.rows:
            r.seq.last_tick = self.tick
        if not plan.rows:
            return plan if (plan.preempted or plan.failed) else None
        return plan

    def _prefill_parked(self, plan: Plan, seq: Sequence) -> Plan | None:
        n = min(seq.num_uncomputed, self.s.prefill_chunk_size)
        if not self._make_room(seq, seq.num_computed + n, plan, protect=[seq]):
            return plan if (plan.preempted or plan.failed) else None
        if seq.status is not Status.RUNNING:
            return plan
        done = n == seq.num_uncomputed
        if done:
            self.parked = None
        plan.kind = "prefill"
        plan.rows = [Row(seq, seq.num_computed, n, done)]
        seq.last_tick = self.tick
        return plan

    def _make_room(self, seq: Sequence, upto: int, plan: Plan, protect: list[Sequence]) -> bool:
        """Give ``seq`` writable blocks for positions < ``upto``, preempting if allowed."""
        bs = self.pool.block_size
        need = self.pool.blocks_for(upto) - len(seq.block_ids)
        first_write = seq.num_computed // bs
        cow = first_write < len(seq.block_ids) and not self._owns(seq, first_write)
        if need <= 0 and not cow:
            return True  # a decode step inside its block: 15 of every 16 tokens
        while not self.pool.can_allocate(max(need, 0) + int(cow)):
            victim = self._victim(exclude=protect, below=None)
            if victim is None or not self.s.enable_preemption:
                why = "preemption is disabled" if not self.s.enable_preemption else "nothing else can be preempted"
                plan.failed.append((seq, f"the KV cache is full and {why}; raise engine.kv_cache_budget"))
                self.remove(seq)
                return False
            self._preempt(victim, plan)
            if victim is seq:
                return False
        if cow:
            fresh, copied = self.pool.writable(seq.block_ids[first_write])
            if copied:
                # The copy holds the same tokens, so the hash chain (num_hashed, last_hash)
                # stays as it is; the original remains the cached one.
                plan.copies.append((seq.block_ids[first_write], fresh))
                seq.block_ids[first_write] = fresh
        for _ in range(max(need, 0)):
            seq.block_ids.append(self.pool.allocate())
        return True

    def grow(self, seq: Sequence, upto: int) -> bool:
        """Give ``seq`` blocks for positions below ``upto`` if the pool has them free, preempting
        no one (a draft's extra positions). The blocks stay the sequence's after a rejection:
        its next tokens fill them."""
        need = self.pool.blocks_for(upto) - len(seq.block_ids)
        if need <= 0:
            return True
        if not self.pool.can_allocate(need + self.blocks_reserved()):
            return False
        for _ in range(need):
            seq.block_ids.append(self.pool.allocate())
        return True

    def _owns(self, seq: Sequence, k: int) -> bool:
        b = seq.block_ids[k]
        return self.pool.ref_count[b] == 1 and self.pool.block_hash[b] is None

    def _victim(self, exclude: list[Sequence], below: int | None) -> Sequence | None:
        # A prefill-role sequence whose first token is out must export the KV it has: never a victim.
        candidates = [s for s in self.running if s not in exclude and not s.hold and (below is None or s.priority < below)]
        if not candidates:
            return None
        return min(candidates, key=lambda s: (s.priority, -s.arrival))

    def _preempt(self, seq: Sequence, plan: Plan) -> None:
        """Recompute later: drop the blocks (full ones stay cached), requeue with all tokens."""
        self.running.remove(seq)
        if self.parked is seq:
            self.parked = None
        self._release(seq)
        seq.num_preemptions += 1
        self.preemptions += 1
        plan.preempted.append(seq)
        self._enqueue(seq)

    # ---- admission ----------------------------------------------------------------
    def _admit(self, plan: Plan) -> list[Row]:
        cohort: list[Row] = []
        longest = 0
        chunk = self.s.prefill_chunk_size
        while self.waiting and len(cohort) < self.s.max_batch_prefill:
            seq = self.waiting[0]
            if seq.pending:
                break  # its last token is still on the device; next tick
            if len(self.running) >= self.s.parallel:
                victim = self._victim(exclude=[r.seq for r in cohort], below=seq.priority)
                if victim is None or not self.s.enable_preemption:
                    break
                self._preempt(victim, plan)
                continue
            reused, hashes = [], []
            if seq.imported is None and self.prefix_caching:
                reused, hashes = self.pool.match_prefix(seq.tokens)
            computed = len(reused) * self.pool.block_size
            if seq.imported is not None:
                computed = seq.imported.num_computed
            cow = 0
            if computed >= len(seq.tokens):
                computed = len(seq.tokens) - 1  # recompute the last token for its logits
                cow = 1
            remaining = len(seq.tokens) - computed
            n = min(remaining, chunk)
            # A streamed import waits holding the blocks its KV arrived in (reserved as its
            # first part came); every other waiting sequence holds none.
            held = len(seq.block_ids)
            is_long = remaining > chunk
            if is_long and (self.parked is not None or any(not r.samples for r in cohort)):
                break
            if cohort and self.max_batch_prefill_tokens and (len(cohort) + 1) * max(longest, n) > self.max_batch_prefill_tokens:
                break
            need = self.pool.blocks_for(computed + n) - len(reused) - held + cow
            if not self.s.enable_preemption:
                need = self._lifetime_blocks(seq) - len(reused) - held + cow
                need += self.blocks_reserved()
            if not self.pool.can_allocate(need, reused):
                if self.s.enable_preemption:
                    victim = self._victim(exclude=[r.seq for r in cohort], below=seq.priority)
                    if victim is not None:
                        self._preempt(victim, plan)
                        continue
                break
            self.waiting.pop(0)
            for b in reused:
                self.pool.acquire(b)
            if not held:
                seq.block_ids = list(reused)
            seq.num_hashed = len(reused)
            seq.last_hash = hashes[-1] if hashes else ROOT_HASH
            if seq.imported is None and self.prefix_caching:
                saved = min(len(reused) * self.pool.block_size, len(seq.tokens) - 1)
                if seq.num_preemptions == 0:
                    self.pool.record_lookup(saved)
                    seq.num_cached_prompt = min(saved, seq.prompt_len)
            seq.num_computed = computed
            seq.status = Status.RUNNING
            self.running.append(seq)
            if seq.imported is not None:
                seq.block_ids += self.pool.reserve(self.pool.blocks_for(seq.imported.num_computed) - held)
            if not self._make_room(seq, computed + n, plan, protect=[r.seq for r in cohort] + [seq]):
                break
            seq.last_tick = self.tick
            cohort.append(Row(seq, computed, n, not is_long))
            longest = max(longest, n)
            if is_long:
                self.parked = seq
                self.decode_ticks_since_grant = 0
        return cohort

    # ---- after a forward ----------------------------------------------------------
    def advance(self, plan: Plan) -> None:
        """Account for a launched forward: its tokens are computed, sampling rows owe a token."""
        for r in plan.rows:
            r.seq.num_computed = r.start + r.n
            if r.samples:
                r.seq.pending += 1
                if r.seq.export_after_prefill:
                    r.seq.hold = True

    def register_full_blocks(self, seq: Sequence) -> None:
        """Offer the sequence's newly completed blocks to the prefix cache."""
        if not self.prefix_caching or seq.status is not Status.RUNNING:
            return
        bs = self.pool.block_size
        full = min(seq.num_computed, len(seq.tokens)) // bs
        while seq.num_hashed < full:
            k = seq.num_hashed
            seq.last_hash = self.pool.register(seq.block_ids[k], seq.last_hash, seq.tokens[k * bs : (k + 1) * bs])
            seq.num_hashed += 1
