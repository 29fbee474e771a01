"""Whole-block import/export of the KV store: slices for runs of consecutive blocks, a
gather/scatter for scattered ones; both must move exactly the same rows."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from tandem.pipeline import kv_store
from tandem.pipeline.kv_store import KVStore

L, H, D, BS = 3, 2, 8, 4


def _store():
    st = KVStore(L, H, D, mx.float32, BS, 64)
    st.ensure_capacity(64)
    rng = np.random.default_rng(1)
    for i in range(L):  # a recognisable background, to see that nothing else moved
        st.keys[i] = mx.array(rng.standard_normal(st.keys[i].shape, dtype=np.float32))
        st.values[i] = mx.array(rng.standard_normal(st.values[i].shape, dtype=np.float32))
    return st


def test_runs_group_consecutive_blocks():
    assert kv_store._runs([5, 6, 7, 2, 3, 9]) == [(5, 3, 0), (2, 2, 3), (9, 1, 5)]
    assert kv_store._runs([]) == []


@pytest.mark.parametrize("blocks", [
    list(range(10, 18)),                        # one run: slices
    [3, 4, 5, 20, 21, 40],                      # a few runs, out of order
    [60, 1, 33, 7, 12, 50, 2, 44, 9, 27, 15],   # more runs than _MAX_RUNS: gather/scatter
])
def test_import_then_export_moves_exactly_those_blocks(blocks):
    st = _store()
    before_k = [np.array(k) for k in st.keys]
    rng = np.random.default_rng(len(blocks))
    ks = [rng.standard_normal((len(blocks), H, BS, D), dtype=np.float32) for _ in range(L)]
    vs = [rng.standard_normal((len(blocks), H, BS, D), dtype=np.float32) for _ in range(L)]
    st.import_blocks(blocks, ks, vs)
    got_k, got_v = st.export_blocks(blocks)
    for i in range(L):
        assert np.array_equal(got_k[i], ks[i]) and np.array_equal(got_v[i], vs[i])
        # every other row is as it was
        touched = np.zeros(st.keys[i].shape[0], bool)
        for b in blocks:
            touched[(b + 1) * BS:(b + 2) * BS] = True
        assert np.array_equal(np.array(st.keys[i])[~touched], before_k[i][~touched])
        # the rows landed where the gather of the scattered path would put them
        slots = np.concatenate([np.arange((b + 1) * BS, (b + 2) * BS) for b in blocks])
        want = ks[i].transpose(0, 2, 1, 3).reshape(-1, H, D)
        assert np.array_equal(np.array(st.keys[i])[slots], want)


def test_growing_keeps_every_row_and_adds_zeroed_blocks():
    st = KVStore(L, H, D, mx.float32, BS, 256)
    assert st.capacity == 64
    rng = np.random.default_rng(7)
    for i in range(L):
        st.keys[i] = mx.array(rng.standard_normal(st.keys[i].shape, dtype=np.float32))
        st.values[i] = mx.array(rng.standard_normal(st.values[i].shape, dtype=np.float32))
    old_k, old_v = [np.array(k) for k in st.keys], [np.array(v) for v in st.values]
    st.ensure_capacity(100)  # doubles (to 128), within the pool
    assert st.capacity == 128
    st.ensure_capacity(300)  # never beyond the pool
    assert st.capacity == 256
    assert st.nbytes == sum(a.nbytes for a in st.keys + st.values)
    for i in range(L):
        k, v = np.array(st.keys[i]), np.array(st.values[i])
        assert k.shape == ((256 + 1) * BS, H, D) and v.shape == k.shape
        n = old_k[i].shape[0]
        assert np.array_equal(k[:n], old_k[i]) and np.array_equal(v[:n], old_v[i])
        assert not k[n:].any() and not v[n:].any()
