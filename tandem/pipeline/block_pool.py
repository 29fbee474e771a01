"""The KV block pool: which block holds what, who holds it, and which blocks can be reused.

Pure bookkeeping (no mlx): the tensors live in :mod:`tandem.pipeline.kv_store`, addressed
by the block ids handed out here. Every block is in exactly one of three states:

* **in use**: reference count > 0 (one per sequence whose block table lists it);
* **free, cached**: count 0 but it holds a full block of computed tokens whose chained hash
  is registered, so a later prompt with the same prefix can take it back instead of
  recomputing it; evicted least-recently-freed first when a fresh block is needed;
* **free, empty**: count 0, no hash.

A fresh block is, in this order: the lowest empty block the KV store already holds
(``addressable``: the store's capacity, which the engine keeps current), the oldest
cached block (evicted), then the lowest empty block past the store. So the store, which
grows by doubling and copies itself to do so (a 1024 -> 2048-block growth of the default
model took 0.5-2.7 s inside an engine step), grows only when every block it holds is in
use. (vLLM's free queue hands out the least recently freed block, cached or not, with
the never-used ones at its head, which costs it nothing: its KV memory is allocated up
front. Here a block past the store costs a growth, so those come last.) Handing out
never-used blocks before evicting cached ones, as this pool did, let a long-lived
worker's high-water mark creep up by a request's blocks per request until the store had
doubled up to the whole budget (docs/benchmarks/LOG.md, disaggregated serving). The prefix cache holds what
the store has room for beyond the blocks in use.

A full block's hash chains its parent's hash with its own tokens, so equal hashes mean equal
prefixes up to a hash collision, which the stored tokens rule out on every hit.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from dataclasses import dataclass
from typing import Sequence

ROOT_HASH = 0x5EED


def chain_hash(parent: int, tokens: Sequence[int]) -> int:
    """The hash of a full block whose predecessor's hash is ``parent`` (ROOT_HASH for the first)."""
    return hash((parent, tuple(tokens)))


@dataclass
class PoolCounters:
    prefix_queries: int = 0  # prompts looked up
    prefix_hits: int = 0  # prompts that reused at least one block
    prefix_tokens_saved: int = 0  # prompt tokens not recomputed
    evictions: int = 0  # cached blocks dropped to make room
    cow_copies: int = 0  # shared blocks copied before a write


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"a block pool needs at least one block of at least one token, got {num_blocks} x {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.ref_count = [0] * num_blocks
        self.block_hash: list[int | None] = [None] * num_blocks
        self.block_tokens: list[tuple[int, ...] | None] = [None] * num_blocks
        self.hash_to_block: dict[int, int] = {}
        self._empty: list[int] = list(range(num_blocks))  # a heap: lowest id first
        self._cached: OrderedDict[int, None] = OrderedDict()  # LRU order, oldest first
        self.counters = PoolCounters()
        self.high_water = 0  # one past the highest block id ever handed out
        # Blocks 0 .. addressable-1 are backed by the KV store already (all of them for
        # a pool without one); past it a fresh block is taken only when no cached one is left.
        self.addressable = num_blocks

    # ---- queries -------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        """Blocks that can be handed out now (empty plus evictable cached ones)."""
        return len(self._empty) + len(self._cached)

    @property
    def num_cached(self) -> int:
        return len(self._cached)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def match_prefix(self, tokens: Sequence[int]) -> tuple[list[int], list[int]]:
        """The cached blocks holding the longest run of full blocks of ``tokens``.

        Returns (block ids, their chained hashes). Takes no references: call
        :meth:`acquire` on them before anything else can evict them.
        """
        bs = self.block_size
        blocks: list[int] = []
        hashes: list[int] = []
        parent = ROOT_HASH
        for start in range(0, len(tokens) - bs + 1, bs):
            chunk = tuple(tokens[start : start + bs])
            h = chain_hash(parent, chunk)
            b = self.hash_to_block.get(h)
            if b is None or self.block_tokens[b] != chunk:
                break
            blocks.append(b)
            hashes.append(h)
            parent = h
        return blocks, hashes

    def can_allocate(self, num_new: int, reused: Sequence[int] = ()) -> bool:
        """Whether ``num_new`` fresh blocks can be had after taking ``reused`` (which, if
        currently free and cached, stop counting as free once taken)."""
        taken_from_free = sum(1 for b in reused if self.ref_count[b] == 0)
        return self.num_free - taken_from_free >= num_new

    # ---- commands ------------------------------------------------------------------
    def record_lookup(self, saved_tokens: int) -> None:
        self.counters.prefix_queries += 1
        if saved_tokens:
            self.counters.prefix_hits += 1
            self.counters.prefix_tokens_saved += saved_tokens

    def acquire(self, block: int) -> None:
        """Take one more reference on a block found by :meth:`match_prefix` or shared by a fork."""
        if self.ref_count[block] == 0:
            if block not in self._cached:
                raise AssertionError(f"block {block} is free and uncached; allocate it instead")
            del self._cached[block]
        self.ref_count[block] += 1

    def allocate(self) -> int:
        """A block with one reference and no contents. Raises MemoryError when none is free."""
        if self._empty and (self._empty[0] < self.addressable or not self._cached):
            block = heapq.heappop(self._empty)
        elif self._cached:
            block, _ = self._cached.popitem(last=False)
            self._forget(block)
            self.counters.evictions += 1
        else:
            raise MemoryError("KV block pool exhausted")
        assert self.ref_count[block] == 0
        self.ref_count[block] = 1
        self.high_water = max(self.high_water, block + 1)
        return block

    def reserve(self, num: int) -> list[int]:
        """``num`` fresh blocks at once, for KV that arrives before its sequence runs (a
        streamed import holds its blocks from its first part on). All or nothing: when
        :meth:`can_allocate` says no, MemoryError and nothing taken."""
        if not self.can_allocate(num):
            raise MemoryError(f"KV block pool has {self.num_free} free blocks, {num} asked")
        return [self.allocate() for _ in range(num)]

    def release(self, block: int) -> None:
        count = self.ref_count[block]
        assert count > 0, f"block {block} released more often than acquired"
        self.ref_count[block] = count - 1
        if count == 1:
            if self.block_hash[block] is not None:
                self._cached[block] = None  # most recently freed goes last
            else:
                heapq.heappush(self._empty, block)

    def release_all(self, blocks: Sequence[int]) -> None:
        # Tail first: a sequence's later blocks are the least likely to be shared, so
        # they should be evicted before the prefix blocks other prompts may reuse.
        for block in reversed(blocks):
            self.release(block)

    def register(self, block: int, parent: int, tokens: Sequence[int]) -> int:
        """Mark a block as a full block of computed ``tokens`` following ``parent``; return its hash.

        When another block already holds the same hash (two sequences computed the same
        prefix side by side), the existing one stays the cached copy and this block stays
        anonymous, freed as empty when its holder lets go.
        """
        chunk = tuple(tokens)
        assert len(chunk) == self.block_size
        h = chain_hash(parent, chunk)
        if self.block_hash[block] is not None:
            return h
        if h not in self.hash_to_block:
            self.hash_to_block[h] = block
            self.block_hash[block] = h
            self.block_tokens[block] = chunk
        return h

    def writable(self, block: int) -> tuple[int, bool]:
        """Copy-on-write: the block a sequence may write into in place of ``block``.

        Returns (block, copied). When ``block`` is shared (or registered in the prefix
        cache, whose contents must stay as hashed) a fresh block is allocated and the
        reference on the old one dropped; the caller copies the tensor contents.
        """
        if self.ref_count[block] == 1 and self.block_hash[block] is None:
            return block, False
        fresh = self.allocate()
        self.release(block)
        self.counters.cow_copies += 1
        return fresh, True

    def _forget(self, block: int) -> None:
        h = self.block_hash[block]
        if h is not None:
            if self.hash_to_block.get(h) == block:
                del self.hash_to_block[h]
            self.block_hash[block] = None
            self.block_tokens[block] = None

    def reset_prefix_cache(self) -> int:
        """Drop every free cached block's hash (e.g. after the weights change). Returns how many."""
        n = len(self._cached)
        for block in list(self._cached):
            self._forget(block)
            heapq.heappush(self._empty, block)
        self._cached.clear()
        return n

    def check(self) -> None:
        """Internal consistency (used by the property tests)."""
        free = set(self._empty) | set(self._cached)
        assert len(free) == len(self._empty) + len(self._cached), "a block is free twice"
        for b in range(self.num_blocks):
            assert self.ref_count[b] >= 0
            assert (self.ref_count[b] == 0) == (b in free), f"block {b}: count {self.ref_count[b]} vs free list"
            if b in self._cached:
                assert self.block_hash[b] is not None
        for h, b in self.hash_to_block.items():
            assert self.block_hash[b] == h
