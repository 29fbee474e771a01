"""Block pool bookkeeping: prefix matching, copy-on-write, LRU eviction, no leaks."""

from __future__ import annotations

import random

import pytest

from tandem.pipeline.block_pool import ROOT_HASH, BlockPool


def fill(pool: BlockPool, tokens: list[int]) -> list[int]:
    """Allocate and register blocks for ``tokens`` (full blocks only) like a finished prefill."""
    blocks, parent = [], ROOT_HASH
    bs = pool.block_size
    for start in range(0, len(tokens), bs):
        b = pool.allocate()
        blocks.append(b)
        chunk = tokens[start : start + bs]
        if len(chunk) == bs:
            parent = pool.register(b, parent, chunk)
    return blocks


def test_prefix_match_reuses_full_blocks_and_checks_tokens():
    pool = BlockPool(16, 4)
    prompt = list(range(10))  # two full blocks + a partial one
    blocks = fill(pool, prompt)
    assert len(blocks) == 3
    hit, hashes = pool.match_prefix(prompt + [99])
    assert hit == blocks[:2] and len(hashes) == 2
    # diverging inside the second block keeps only the first
    hit, _ = pool.match_prefix([0, 1, 2, 3, 4, 5, 77, 7])
    assert hit == blocks[:1]
    # a forged hash collision is caught by the token check
    other = pool.allocate()
    pool.block_tokens[blocks[0]] = (9, 9, 9, 9)
    assert pool.match_prefix(prompt)[0] == []
    pool.release(other)


def test_freed_cached_blocks_are_reused_then_evicted_lru():
    pool = BlockPool(4, 2)
    a = fill(pool, [1, 2, 3, 4])  # 2 registered blocks
    pool.release_all(a)
    assert pool.num_free == 4 and pool.num_cached == 2
    hit, _ = pool.match_prefix([1, 2, 3, 4, 5])
    assert hit == a
    for b in hit:
        pool.acquire(b)
    assert pool.num_cached == 0 and pool.num_free == 2
    pool.release_all(hit)
    # fresh allocations take empty blocks before evicting cached ones
    x, y = pool.allocate(), pool.allocate()
    assert {x, y}.isdisjoint(a) and pool.counters.evictions == 0
    z = pool.allocate()  # now one cached block must go: the tail one was freed first
    assert z == a[1] and pool.counters.evictions == 1
    assert pool.match_prefix([1, 2, 3, 4])[0] == [a[0]]
    with pytest.raises(MemoryError):
        pool.allocate(), pool.allocate()


def test_copy_on_write_for_shared_and_registered_blocks():
    pool = BlockPool(8, 2)
    (b,) = fill(pool, [5, 6])
    pool.acquire(b)  # a second holder
    fresh, copied = pool.writable(b)
    assert copied and fresh != b and pool.ref_count[b] == 1 and pool.ref_count[fresh] == 1
    # sole holder of a registered block still copies: the cached contents must stay intact
    fresh2, copied2 = pool.writable(b)
    assert copied2 and pool.ref_count[b] == 0 and b in pool._cached
    own = pool.allocate()
    assert pool.writable(own) == (own, False)
    assert pool.counters.cow_copies == 2


def test_duplicate_registration_keeps_one_cached_copy():
    pool = BlockPool(8, 2)
    a = fill(pool, [1, 2])
    b = fill(pool, [1, 2])
    assert pool.block_hash[a[0]] is not None and pool.block_hash[b[0]] is None
    pool.release_all(a + b)
    pool.check()
    assert pool.num_cached == 1


def test_random_operations_never_leak():
    """10,000 random submits / finishes / aborts / preemptions / forks; then everything drains."""
    rng = random.Random(1234)
    pool = BlockPool(64, 4)
    # A KV store that starts at 4 blocks and doubles as the engine grows it: a block past
    # it is handed out only while every block it holds is in use.
    pool.addressable = 4
    allocate = pool.allocate

    def checked_allocate():
        b = allocate()
        if b >= pool.addressable:
            assert all(pool.ref_count[x] > 0 for x in range(pool.addressable)), "the store grew with blocks to spare"
        return b
    pool.allocate = checked_allocate
    vocab = [0, 1, 2]  # tiny vocabulary: lots of shared prefixes
    live: dict[int, tuple[list[int], list[int], int]] = {}  # id -> (tokens, blocks, parent hash)
    next_id = 0
    for step in range(10_000):
        op = rng.random()
        if op < 0.35:  # submit: reuse a cached prefix, allocate the rest
            tokens = [rng.choice(vocab) for _ in range(rng.randint(1, 14))]
            hit, hashes = pool.match_prefix(tokens)
            need = pool.blocks_for(len(tokens)) - len(hit)
            if not pool.can_allocate(need, hit):
                continue
            for b in hit:
                pool.acquire(b)
            blocks = list(hit) + [pool.allocate() for _ in range(need)]
            parent = hashes[-1] if hashes else 0x5EED
            for k in range(len(hit), len(tokens) // 4):
                parent = pool.register(blocks[k], parent, tokens[k * 4 : k * 4 + 4])
            live[next_id] = (tokens, blocks, parent)
            next_id += 1
        elif op < 0.6 and live:  # decode a token into the tail (copy-on-write if shared)
            sid = rng.choice(list(live))
            tokens, blocks, parent = live[sid]
            if len(tokens) % 4 == 0:
                if not pool.can_allocate(1):
                    continue
                blocks.append(pool.allocate())
            else:
                blocks[-1], _ = pool.writable(blocks[-1]) if pool.num_free else (blocks[-1], False)
            tokens.append(rng.choice(vocab))
            if len(tokens) % 4 == 0 and pool.ref_count[blocks[-1]] == 1:
                parent = pool.register(blocks[-1], parent, tokens[-4:])
            live[sid] = (tokens, blocks, parent)
        elif op < 0.7 and live:  # fork: a second holder of every block
            sid = rng.choice(list(live))
            tokens, blocks, parent = live[sid]
            for b in blocks:
                pool.acquire(b)
            live[next_id] = (list(tokens), list(blocks), parent)
            next_id += 1
        elif live:  # finish, abort or preempt: all release every block
            sid = rng.choice(list(live))
            pool.release_all(live.pop(sid)[1])
        if pool.high_water > pool.addressable:
            pool.addressable = min(pool.num_blocks, max(pool.high_water, 2 * pool.addressable))
        if step % 500 == 0:
            pool.check()
    assert pool.counters.evictions > 0
    for _, blocks, _ in live.values():
        pool.release_all(blocks)
    pool.check()
    assert all(c == 0 for c in pool.ref_count)
    assert pool.num_free == pool.num_blocks


def test_cached_blocks_are_evicted_before_a_block_past_the_store():
    """Blocks past ``addressable`` (the KV store's capacity) would make the store grow:
    they come after the empty blocks it holds and after every cached block, oldest first."""
    pool = BlockPool(8, 2)
    pool.addressable = 6
    a = fill(pool, list(range(8)))  # blocks 0-3, all registered
    assert a == [0, 1, 2, 3]
    pool.release_all(a)  # tail first: 3 is the oldest cached block, 0 the newest
    assert pool.num_cached == 4
    assert [pool.allocate(), pool.allocate()] == [4, 5]  # empty and inside the store: no eviction
    assert pool.counters.evictions == 0
    assert [pool.allocate() for _ in range(3)] == [3, 2, 1]  # then the cached ones, oldest first
    assert pool.counters.evictions == 3 and pool.high_water == 6
    assert pool.match_prefix(list(range(8)))[0] == [0]  # the newest (the prefix's first block) is still cached
    assert pool.allocate() == 0  # the last cached block goes before the store would grow ...
    assert pool.allocate() == 6 and pool.high_water == 7  # ... and only then a block past it
    pool.check()
    # Once the store holds them, blocks past the old capacity are ordinary empty blocks.
    pool.addressable = 8
    for b in (6, 5, 4):
        pool.release(b)
    assert pool.allocate() == 4 and pool.counters.evictions == 4


def test_reserve_takes_all_the_blocks_asked_or_none():
    pool = BlockPool(8, 4)
    held = fill(pool, list(range(12)))  # 3 blocks in use
    with pytest.raises(MemoryError, match="5 free blocks, 6 asked"):
        pool.reserve(6)
    assert pool.num_free == 5  # nothing taken
    got = pool.reserve(5)
    assert sorted(got) == [3, 4, 5, 6, 7] and pool.num_free == 0 and not pool.can_allocate(1)
    pool.release_all(got + held)
    pool.check()
    assert pool.num_free == 8
