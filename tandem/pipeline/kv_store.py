"""The KV tensors behind the block pool: one key and one value array per layer.

Layout per layer: a flat ``((capacity + 1) * block_size, n_kv_heads, head_dim)`` array,
token-major inside a block, so writing a step's new tokens is one row scatter (kept flat:
see :func:`tandem.kernels.paged_attention.write_slots` on why never through a reshape). Store block 0 is scratch: padded query rows write
there and padded block-table entries read from there. Pool block ``b`` is store block
``b + 1``.

Capacity grows on demand (doubling, up to the pool size) so a large byte budget costs
memory only once the working set reaches it.
"""

from __future__ import annotations

import logging
import time

import mlx.core as mx
import numpy as np

from tandem.kernels import paged_attention as pa

SCRATCH = 0

log = logging.getLogger("tandem.kv_store")


class KVStore:
    def __init__(self, num_layers: int, n_kv_heads: int, head_dim: int, dtype: mx.Dtype, block_size: int, num_blocks: int,
                 v_head_dim: int | None = None, initial_blocks: int = 64):
        self.num_layers = num_layers
        self.n_kv_heads = n_kv_heads
        self.head_dim = head_dim
        self.v_head_dim = v_head_dim or head_dim
        self.dtype = dtype
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.capacity = 0
        self.keys: list[mx.array] = []
        self.values: list[mx.array] = []
        self.ensure_capacity(max(1, min(num_blocks, initial_blocks)))

    @staticmethod
    def bytes_per_block(num_layers: int, n_kv_heads: int, head_dim: int, v_head_dim: int, dtype: mx.Dtype, block_size: int) -> int:
        return num_layers * n_kv_heads * block_size * (head_dim + v_head_dim) * dtype.size

    @property
    def nbytes(self) -> int:
        """The arrays' bytes, from the capacity (the engine's stats read it every step):
        ``capacity + 1`` blocks a layer, the scratch block included."""
        return (self.capacity + 1) * self.bytes_per_block(self.num_layers, self.n_kv_heads, self.head_dim,
                                                          self.v_head_dim, self.dtype, self.block_size)

    def ensure_capacity(self, blocks: int) -> None:
        """Make pool blocks ``0 .. blocks-1`` addressable."""
        if blocks <= self.capacity:
            return
        new_cap = min(self.num_blocks, max(blocks, 2 * self.capacity))
        grow = new_cap - self.capacity + (0 if self.capacity else 1)
        shape_k = (grow * self.block_size, self.n_kv_heads, self.head_dim)
        shape_v = (grow * self.block_size, self.n_kv_heads, self.v_head_dim)
        t = time.perf_counter()
        if not self.keys:
            self.keys = [mx.zeros(shape_k, self.dtype) for _ in range(self.num_layers)]
            self.values = [mx.zeros(shape_v, self.dtype) for _ in range(self.num_layers)]
            mx.eval(self.keys, self.values)
        else:
            # One array at a time, each old one released before the next grows: the peak
            # is the old store plus one layer's new array instead of both stores whole,
            # and the freed buffers are reused (1024 -> 2048 blocks of the default model:
            # about 0.5 s against 1.06 s as one evaluation, timed alone).
            for arrays, shape in ((self.keys, shape_k), (self.values, shape_v)):
                for i, a in enumerate(arrays):
                    arrays[i] = mx.concatenate([a, mx.zeros(shape, self.dtype)])
                    del a
                    mx.eval(arrays[i])
        old_cap, self.capacity = self.capacity, new_cap
        if old_cap:
            log.info("KV store grown from %d to %d blocks (%.0f MB) in %.0f ms", old_cap, new_cap,
                     self.nbytes / 1e6, (time.perf_counter() - t) * 1e3)

    # ---- per step (called from inside the model's forward) --------------------------
    def write(self, layer: int, keys: mx.array, values: mx.array, slots: mx.array) -> None:
        """keys: (B, H, L, D) new entries; slots: (B*L,) flat store slots (scratch for padding)."""
        self.keys[layer] = pa.write_slots(self.keys[layer], keys, slots)
        self.values[layer] = pa.write_slots(self.values[layer], values, slots)

    def write_rows(self, layer: int, keys: mx.array, values: mx.array, slots: mx.array) -> None:
        """keys, values: (n, H, D) entries already in the store's row layout; slots: (n,)."""
        self.keys[layer][slots] = keys
        self.values[layer][slots] = values

    def gather(self, layer: int, table: mx.array) -> tuple[mx.array, mx.array]:
        """table: (B, nb) store block ids -> keys, values (B, H, nb * block_size, D)."""
        bs = self.block_size
        return pa.gather_blocks(self.keys[layer], table, bs), pa.gather_blocks(self.values[layer], table, bs)

    # ---- whole blocks (copy-on-write, export, import) -------------------------------
    def copy_block(self, src: int, dst: int) -> None:
        bs = self.block_size
        s, d = (src + 1) * bs, (dst + 1) * bs
        for i in range(self.num_layers):
            self.keys[i][d : d + bs] = self.keys[i][s : s + bs]
            self.values[i][d : d + bs] = self.values[i][s : s + bs]

    def export_blocks(self, blocks: list[int]) -> tuple[list[np.ndarray], list[np.ndarray]]:
        """Per-layer numpy arrays of shape (len(blocks), n_kv_heads, block_size, D)."""
        n, bs = len(blocks), self.block_size
        take = self._reader(blocks)
        ks = [take(k).reshape(n, bs, *k.shape[1:]).transpose(0, 2, 1, 3) for k in self.keys]
        vs = [take(v).reshape(n, bs, *v.shape[1:]).transpose(0, 2, 1, 3) for v in self.values]
        mx.eval(ks, vs)
        return [_to_numpy(a) for a in ks], [_to_numpy(a) for a in vs]

    def import_blocks(self, blocks: list[int], keys: list[np.ndarray], values: list[np.ndarray]) -> None:
        spans = self._spans(blocks)
        idx = self._slots(blocks) if spans is None else None
        for i in range(self.num_layers):
            for dst, src in ((self.keys, keys[i]), (self.values, values[i])):
                rows = _from_numpy(src, self.dtype).transpose(0, 2, 1, 3)  # (n, bs, H, D)
                rows = rows.reshape(-1, *rows.shape[2:])
                if idx is not None:
                    dst[i][idx] = rows
                    continue
                for s, e, at in spans:
                    dst[i][s:e] = rows[at : at + e - s]
        mx.eval(self.keys, self.values)

    def _reader(self, blocks: list[int]):
        """A function from a layer's array to the rows of ``blocks`` in order (see
        :meth:`_spans`)."""
        spans = self._spans(blocks)
        if spans is None:
            idx = self._slots(blocks)
            return lambda a: a[idx]
        if len(spans) == 1:
            return lambda a: a[spans[0][0] : spans[0][1]]
        return lambda a: mx.concatenate([a[s:e] for s, e, _ in spans])

    def _spans(self, blocks: list[int]) -> list[tuple[int, int, int]] | None:
        """(store row start, end, row in ``blocks``' order) of each run of consecutive
        blocks, or None past _MAX_RUNS runs (then a gather / scatter). The usual case is a
        few runs (a sequence's blocks are allocated together); slices copy at memory speed,
        where mlx's CPU gather and scatter go row by row (an 11.8 MB import: 19 ms by
        scatter, 4.5 ms by slices)."""
        runs = _runs(blocks)
        if len(runs) > _MAX_RUNS:
            return None
        bs = self.block_size
        return [((first + 1) * bs, (first + 1 + count) * bs, at * bs) for first, count, at in runs]

    def _slots(self, blocks: list[int]) -> mx.array:
        bs = self.block_size
        starts = (np.asarray(blocks, dtype=np.int64) + 1) * bs
        return mx.array((starts[:, None] + np.arange(bs)[None, :]).reshape(-1).astype(np.int32))


_MAX_RUNS = 8  # more runs of consecutive blocks than this: one gather / scatter instead


def _runs(blocks: list[int]) -> list[tuple[int, int, int]]:
    """(first block, count, position in ``blocks``) of each run of consecutive ids."""
    runs: list[tuple[int, int, int]] = []
    for at, b in enumerate(blocks):
        if runs and runs[-1][0] + runs[-1][1] == b:
            first, count, start = runs[-1]
            runs[-1] = (first, count + 1, start)
        else:
            runs.append((b, 1, at))
    return runs


def _to_numpy(a: mx.array) -> np.ndarray:
    if a.dtype == mx.bfloat16:
        return np.array(a.view(mx.uint16))
    return np.array(a)


def _from_numpy(a: np.ndarray, dtype: mx.Dtype) -> mx.array:
    if dtype == mx.bfloat16:
        return mx.array(a.astype(np.uint16, copy=False)).view(mx.bfloat16)
    return mx.array(a).astype(dtype)


def dtype_name(dtype: mx.Dtype) -> str:
    return str(dtype).removeprefix("mlx.core.")
