"""Paged attention: the fast paths against the per-row reference, and paged == contiguous."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from tandem.kernels import paged_attention as pa


def setup(B=3, n_heads=4, n_kv=2, D=16, bs=4, L=5, seed=0):
    rng = np.random.default_rng(seed)
    starts = rng.integers(0, 13, size=B).astype(np.int32)
    ctx = starts + L
    nb = int((ctx.max() + bs - 1) // bs)
    n_blocks = B * nb + 3
    perm = rng.permutation(n_blocks)  # scattered, non-contiguous block ids
    table = perm[: B * nb].reshape(B, nb).astype(np.int32)
    k_pool = mx.array(rng.standard_normal((n_blocks * bs, n_kv, D)).astype(np.float32))
    v_pool = mx.array(rng.standard_normal((n_blocks * bs, n_kv, D)).astype(np.float32))
    q = mx.array(rng.standard_normal((B, n_heads, L, D)).astype(np.float32))
    return q, k_pool, v_pool, mx.array(table), mx.array(starts), bs


@pytest.mark.parametrize("L", [1, 5])
def test_paged_attention_matches_reference(L):
    q, k, v, table, starts, bs = setup(L=L)
    fast = pa.paged_attention(q, k, v, table, starts, bs, scale=0.25)
    ref = pa.paged_attention_reference(q, k, v, table, starts, bs, scale=0.25)
    assert fast.shape == ref.shape == q.shape
    assert mx.allclose(fast, ref, atol=1e-5, rtol=1e-5).item()


def test_gather_variants_agree():
    _, k, _, table, _, bs = setup()
    ref = pa.gather_blocks_reference(k, table, bs)
    assert mx.array_equal(pa.gather_blocks(k, table, bs), ref).item()
    assert mx.array_equal(pa._gather_compiled(k, table, bs), ref).item()


def test_paged_equals_contiguous_attention():
    """Scattering a sequence into random blocks and attending through the table gives
    what attention over the same keys laid out contiguously gives."""
    q, k, v, table, starts, bs = setup(B=1, L=7)
    ctx = int(starts[0].item()) + 7
    keys = pa.gather_blocks_reference(k, table, bs)[:, :, :ctx]
    values = pa.gather_blocks_reference(v, table, bs)[:, :, :ctx]
    dense = mx.fast.scaled_dot_product_attention(q, keys, values, scale=0.25, mask="causal")
    paged = pa.paged_attention(q, k, v, table, starts, bs, scale=0.25)
    assert mx.allclose(dense, paged, atol=1e-5).item()


def test_write_slots_scatters_rows():
    pool = mx.zeros((8, 2, 3))
    new = mx.arange(2 * 2 * 2 * 3, dtype=mx.float32).reshape(2, 2, 2, 3)  # (B, H, L, D)
    slots = mx.array([5, 1, 0, 0])  # second row's second token is padding -> scratch 0
    out = pa.write_slots(pool, new, slots)
    assert mx.array_equal(out[5], new[0, :, 0]).item()
    assert mx.array_equal(out[1], new[0, :, 1]).item()
    assert mx.array_equal(out[2], mx.zeros((2, 3))).item()
