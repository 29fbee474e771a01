"""Attention over a paged KV pool (CPU / any backend, pure mx).

A layer's pool is a flat array ``(num_slots, n_kv_heads, head_dim)`` where slot
``block * block_size + i`` holds token ``i`` of ``block``. A batch addresses it through a
block table ``(B, nb)`` of block ids; row ``b`` sees ``context_lens[b]`` tokens.

Pieces:

* :func:`write_slots` scatters a step's new keys or values into the pool. The pool must
  stay flat: a scatter into a reshaped view defeats buffer donation and copies the whole
  pool every step (measured: 42 ms instead of 0.1 ms at 80k blocks).
* :func:`gather_blocks` turns a block table into a dense ``(B, H, nb * block_size, D)``
  tensor; :func:`gather_blocks_reference` is the same by plain indexing, one row at a time.
* :func:`paged_attention` is gather + ``mx.fast.scaled_dot_product_attention`` with a
  per-row causal/length mask; :func:`paged_attention_reference` computes the same thing
  row by row with explicit softmax, the definition the fast path is tested against.

Other backends (``mx.fast.metal_kernel`` / ``cuda_kernel``) can provide a fused variant
reading the pool in place; this module is the fallback they dispatch to when absent.
"""

from __future__ import annotations

import mlx.core as mx


def write_slots(pool: mx.array, new: mx.array, slots: mx.array) -> mx.array:
    """pool: (S, H, D); new: (B, H, L, D); slots: (B*L,) int32 -> the updated pool.

    Slots of padded positions should all point at one scratch slot: duplicate indices
    there are harmless because nothing reads them as real context.
    """
    B, H, L, D = new.shape
    rows = new.transpose(0, 2, 1, 3).reshape(B * L, H, D)
    pool[slots] = rows
    return pool


def _gather(pool: mx.array, table: mx.array, block_size: int) -> mx.array:
    S, H, D = pool.shape
    blocks = pool.reshape(S // block_size, block_size, H, D)[table]  # (B, nb, bs, H, D)
    B, nb = table.shape
    return blocks.reshape(B, nb * block_size, H, D).transpose(0, 2, 1, 3)


_gather_compiled = mx.compile(_gather, shapeless=False)


def gather_blocks(pool: mx.array, table: mx.array, block_size: int) -> mx.array:
    """pool: (S, H, D); table: (B, nb) int32 -> (B, H, nb * block_size, D)."""
    return _gather(pool, table, block_size)


def gather_blocks_reference(pool: mx.array, table: mx.array, block_size: int) -> mx.array:
    """Row by row, block by block: the definition :func:`gather_blocks` must match."""
    rows = []
    for b in range(table.shape[0]):
        parts = [pool[int(blk) * block_size : (int(blk) + 1) * block_size] for blk in table[b].tolist()]
        rows.append(mx.concatenate(parts, axis=0).transpose(1, 0, 2))
    return mx.stack(rows)


def causal_mask(q_start: mx.array, num_queries: int, num_keys: int) -> mx.array:
    """(B, 1, L, K) bool: query ``i`` of row ``b`` sits at position ``q_start[b] + i`` and
    sees keys at positions ``<=`` its own. Keys past a row's context are excluded because
    every valid query's position is below the row's context length."""
    q_pos = q_start[:, None] + mx.arange(num_queries)[None, :]  # (B, L)
    k_pos = mx.arange(num_keys)
    return (k_pos[None, None, :] <= q_pos[:, :, None])[:, None]


def paged_attention(
    queries: mx.array,
    k_pool: mx.array,
    v_pool: mx.array,
    table: mx.array,
    q_start: mx.array,
    block_size: int,
    scale: float,
) -> mx.array:
    """queries: (B, n_heads, L, D) for positions ``q_start[b] .. q_start[b] + L - 1``;
    pools: (S, n_kv_heads, D); table: (B, nb) -> (B, n_heads, L, D)."""
    keys = _gather_compiled(k_pool, table, block_size)
    values = _gather_compiled(v_pool, table, block_size)
    mask = causal_mask(q_start, queries.shape[2], keys.shape[2])
    return mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale, mask=mask)


def paged_attention_reference(
    queries: mx.array,
    k_pool: mx.array,
    v_pool: mx.array,
    table: mx.array,
    q_start: mx.array,
    block_size: int,
    scale: float,
) -> mx.array:
    """Same contract as :func:`paged_attention`, computed per row with explicit softmax
    over exactly the visible keys (no padding, no mask tensor)."""
    B, n_heads, L, D = queries.shape
    n_kv = k_pool.shape[1]
    rep = n_heads // n_kv
    keys = gather_blocks_reference(k_pool, table, block_size)
    values = gather_blocks_reference(v_pool, table, block_size)
    out = []
    for b in range(B):
        start = int(q_start[b].item())
        rows = []
        for i in range(L):
            n = start + i + 1
            k = mx.repeat(keys[b, :, :n], rep, axis=0)  # (n_heads, n, D)
            v = mx.repeat(values[b, :, :n], rep, axis=0)
            s = (queries[b, :, i : i + 1] * scale) @ k.transpose(0, 2, 1)  # (n_heads, 1, n)
            p = mx.softmax(s.astype(mx.float32), axis=-1).astype(v.dtype)
            rows.append(p @ v)  # (n_heads, 1, D)
        out.append(mx.concatenate(rows, axis=1))
    return mx.stack(out)
