"""Routing prefix hashes: what the broker and the workers must agree on."""

from __future__ import annotations

from tandem.wire.prefixes import MAX_ROUTING_BLOCKS, ROUTING_BLOCK, prefix_hashes


def test_a_shared_prefix_shares_exactly_its_full_blocks_hashes():
    a = list(range(100, 100 + 5 * ROUTING_BLOCK + 3))
    b = a[: 3 * ROUTING_BLOCK] + [7] + a[3 * ROUTING_BLOCK + 1:]
    ha, hb = prefix_hashes(a), prefix_hashes(b)
    assert len(ha) == len(hb) == 5  # full blocks only
    assert ha[:3] == hb[:3] and all(x != y for x, y in zip(ha[3:], hb[3:]))  # chained: one change, every later hash
    assert prefix_hashes(a[: ROUTING_BLOCK - 1]) == []
    assert all(0 <= h < 1 << 64 for h in ha)


def test_the_hashing_work_is_bounded():
    assert len(prefix_hashes([1] * (ROUTING_BLOCK * (MAX_ROUTING_BLOCKS + 10)))) == MAX_ROUTING_BLOCKS


def test_the_hashes_are_a_fixed_function_of_the_tokens():
    # A broker and its workers compute these independently (and may run different
    # releases of one protocol version): blake2b-64 over little-endian uint32 tokens,
    # chained through the parent digest. The value pins that definition.
    assert prefix_hashes(list(range(ROUTING_BLOCK))) == [3502644936733289510]
