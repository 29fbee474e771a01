"""Routing prefix hashes: the chained block hashes workers report in heartbeats and the
broker computes over a new prompt to find a worker that already holds its prefix.

Both ends must compute the same function, so it belongs to the protocol, not to either
end. ``ROUTING_BLOCK`` is independent of any engine's KV block size.
"""

from __future__ import annotations

import hashlib
import struct

ROUTING_BLOCK = 16  # tokens per routing prefix hash
MAX_ROUTING_BLOCKS = 64  # bound the broker's hashing work per request


def prefix_hashes(tokens: list[int], block: int = ROUTING_BLOCK) -> list[int]:
    """Chained hashes of the prompt's full leading blocks (parent hash + block tokens):
    a match of the first k hashes means the first k*block tokens are identical."""
    out, parent = [], b""
    n = min(len(tokens) // block, MAX_ROUTING_BLOCKS)
    for i in range(n):
        chunk = struct.pack(f"<{block}I", *(t & 0xFFFFFFFF for t in tokens[i * block:(i + 1) * block]))
        digest = hashlib.blake2b(parent + chunk, digest_size=8).digest()
        out.append(int.from_bytes(digest, "little"))
        parent = digest
    return out
