"""Runs an mlx-lm model on a batch of rows, against the paged KV store or dense caches.

mlx-lm models talk to their cache through a small protocol: ``cache.offset`` (RoPE
position of the first new token), ``cache.update_and_fetch(k, v)`` (store the new
entries, return everything the queries may see) and ``cache.make_mask(N, ...)`` (called
once per forward through ``create_attention_mask``). :class:`PagedLayerCache` implements it
over :class:`~tandem.pipeline.kv_store.KVStore` for a whole batch of variable-length rows:
``offset`` is a per-row ``mx.array`` (RoPE accepts one), new keys go to each row's slots,
the gathered keys cover each row's block table, and the mask hides other rows' padding.

A model whose layers want anything but a plain ``KVCache`` (sliding windows, recurrent
state) runs on :class:`DenseRunner`: one mlx-lm cache per sequence, one forward per row.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import KVCache, make_prompt_cache

from tandem.kernels import paged_attention as pa
from tandem.pipeline.kv_store import KVStore
from tandem.pipeline.sequence import Row

log = logging.getLogger("tandem.engine")


@dataclass
class ModelShape:
    num_layers: int
    n_kv_heads: int
    head_dim: int
    v_head_dim: int
    dtype: mx.Dtype
    pageable: bool
    why_not: str = ""


def probe(model) -> ModelShape:
    """Run one token through a fresh mlx-lm cache to learn the KV shapes and cache kinds."""
    cache = make_prompt_cache(model)
    kinds = {type(c).__name__ for c in cache}
    model(mx.array([[0]]), cache=cache)
    first = next((c for c in cache if isinstance(c, KVCache) and c.keys is not None), None)
    if first is None:
        return ModelShape(len(cache), 0, 0, 0, mx.float32, False, f"cache kinds {sorted(kinds)}")
    _, h, _, d = first.keys.shape
    vd = first.values.shape[-1]
    pageable = all(type(c) is KVCache for c in cache)
    why = "" if pageable else f"its layers use {sorted(kinds)}, not only KVCache"
    return ModelShape(len(cache), h, d, vd, first.keys.dtype, pageable, why)


class _Batch:
    """Per-forward metadata every layer's cache reads."""

    offsets: mx.array
    slots: mx.array
    table: mx.array
    mask: object
    exact_len: int | None  # single row: slice the gathered keys to exactly this many


class PagedLayerCache:
    def __init__(self, runner: "PagedRunner", layer: int):
        self._runner = runner
        self._layer = layer

    @property
    def offset(self):
        return self._runner.batch.offsets

    def update_and_fetch(self, keys, values):
        batch = self._runner.batch
        store = self._runner.store
        store.write(self._layer, keys, values, batch.slots)
        k, v = store.gather(self._layer, batch.table)
        if batch.exact_len is not None:
            k, v = k[:, :, : batch.exact_len], v[:, :, : batch.exact_len]
        return k, v

    def make_mask(self, N: int, return_array: bool = False, window_size=None, **_):
        if window_size is not None:
            raise NotImplementedError("sliding-window layers run on the dense path")
        mask = self._runner.batch.mask
        if isinstance(mask, str) or (mask is None and return_array):
            q0 = self._runner.batch.offsets
            kv = self._runner.batch.exact_len
            return pa.causal_mask(q0, N, kv)
        return mask

    def empty(self):
        return False


class PagedRunner:
    """Batched forward over the paged store."""

    def __init__(self, model, store: KVStore):
        self.model = model
        self.store = store
        self.caches = [PagedLayerCache(self, i) for i in range(store.num_layers)]
        self.batch = _Batch()

    def forward(self, rows: list[Row], inputs: mx.array) -> mx.array:
        """inputs: (B, L) token ids, row b's real tokens first -> logits (B, V) at each row's last real token."""
        bs = self.store.block_size
        B, L = inputs.shape
        starts = np.fromiter((r.start for r in rows), np.int32, B)
        ns = np.fromiter((r.n for r in rows), np.int32, B)
        ctx = starts + ns
        nb = int((ctx.max() + bs - 1) // bs)
        table = np.zeros((B, nb), np.int32)  # 0 = the store's scratch block
        for i, r in enumerate(rows):
            ids = r.seq.block_ids[: (ctx[i] + bs - 1) // bs]
            table[i, : len(ids)] = ids
            table[i, : len(ids)] += 1
        pos = starts[:, None] + np.arange(L, dtype=np.int32)[None, :]  # (B, L)
        valid = np.arange(L)[None, :] < ns[:, None]
        blk = np.take_along_axis(table, np.minimum(pos // bs, nb - 1), axis=1)
        slots = np.where(valid, blk * bs + pos % bs, 0)
        b = self.batch
        b.offsets = mx.array(starts)
        b.slots = mx.array(slots.reshape(-1))
        b.table = mx.array(table)
        if B == 1:
            # Alone, a row sees exactly its own context, as mlx-lm's own cache would give it.
            b.exact_len = int(ctx[0])
            b.mask = None if L == 1 else "causal"
        else:
            b.exact_len = None
            b.mask = pa.causal_mask(b.offsets, L, nb * bs)
        logits = self.model(inputs, cache=self.caches)
        if L == 1:
            return logits[:, 0, :]
        return logits[mx.arange(B), mx.array(ns - 1)]


class DenseRunner:
    """One mlx-lm cache per sequence, one forward per row (models the pool cannot hold)."""

    def __init__(self, model):
        self.model = model

    def forward(self, rows: list[Row], inputs: mx.array) -> mx.array:
        out = []
        for i, r in enumerate(rows):
            if r.seq.dense_cache is None or r.start == 0:
                r.seq.dense_cache = make_prompt_cache(self.model)
            logits = self.model(inputs[i : i + 1, : r.n], cache=r.seq.dense_cache)
            out.append(logits[:, -1, :])
        return mx.concatenate(out, axis=0)
