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
import mlx.nn as nn
import numpy as np
from mlx_lm.models.cache import KVCache, make_prompt_cache

from tandem.kernels import paged_attention as pa
from tandem.kernels.cpu import cpu_math
from tandem.pipeline.runners.cpu import fast_llama
from tandem.kernels.cpu import q4_kernels
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
    mirror: str | None = None  # decode only: "append" to or "rebuild" the decode mirror
    mirror_idx: mx.array | None = None
    mirror_rows: np.ndarray | None = None  # append: mirror_idx on the host, (B, H)
    kv_len: int = 0
    lens: np.ndarray | None = None  # (B,) int32: keys each row sees this step
    slots_host: np.ndarray | None = None  # (B * L,) pool slots of the new entries
    table_host: np.ndarray | None = None  # (B, nb) the block table on the host


MIRROR_AHEAD = 512
"""Most tokens past the longest row a decode mirror is sized for (its memory and a
rebuild's copy grow with it)."""


class _Mirror:
    """The decode batch's KV, contiguous ``(B, H, cap, D)`` per layer (stored flat).

    Attention over keys gathered from scattered blocks costs a copy per layer per step,
    and on the CPU that copy costs as much as the attention itself. While the decode
    batch keeps the same rows, each step appends its one new entry here and attends over
    this view instead; any change of rows rebuilds it from the pool with one gather.

    The pool stays the record (prefix cache, export, the next rebuild), but appended
    entries reach it late: each step's new entries are only noted (``pending``: pool
    slots and mirror rows), and :meth:`PagedRunner.flush` copies all of them at once
    before anything reads the pool or writes blocks that could have changed owner.
    Writing them every step cost 4 scatters per layer (120 ops per step here, ~3 ms).
    """

    def __init__(self):
        self.rows: list[tuple[int, int]] = []
        self.lens = np.zeros(0, np.int32)
        self.cap = 0
        self.keys: list[mx.array | None] = []
        self.values: list[mx.array | None] = []
        self.pending: list[tuple[np.ndarray, np.ndarray]] = []  # (slots (B,), mirror rows (B, H))


class PagedLayerCache:
    def __init__(self, runner: "PagedRunner", layer: int):
        self._runner = runner
        self._layer = layer

    @property
    def offset(self):
        return self._runner.batch.offsets

    def update_and_fetch(self, keys, values):
        runner, layer = self._runner, self._layer
        batch, store = runner.batch, runner.store
        if batch.mirror != "append":  # appended entries reach the pool at the next flush
            store.write(layer, keys, values, batch.slots)
        if batch.mirror is None:
            k, v = store.gather(layer, batch.table)
            n = batch.exact_len if batch.exact_len is not None else batch.kv_len
            return mx.contiguous(k[:, :, :n]), mx.contiguous(v[:, :, :n])
        k, v = self._mirror_update(keys, values)
        n = batch.kv_len
        return k[:, :, :n], v[:, :, :n]

    def prefill_kv_host(self, kc: np.ndarray, vc: np.ndarray, starts: np.ndarray, L: int):
        """For a prefill whose attention runs in C (fast_llama's host layers): write the
        new keys and values, kc and vc (H * D, B * L) in token columns, into this layer's
        pool arrays in place, and return every row's keys and values ``(B, H, K, D)`` as
        host arrays (what :meth:`update_and_fetch` returns, up to each row's last query);
        None, storing nothing, for any other step or a pool that is not float32.

        In place is safe here: the slots written belong to these rows' own new blocks
        (prefix-cache hits end at a block boundary; the engine copies a shared block
        before a row writes into it) or to the scratch block, and the pool is evaluated
        first, so no pending mlx op can read the entries before or after this write. The
        mlx scatter of :meth:`KVStore.write` cost ~1.4 ms per layer for 4 x 165 tokens
        (mlx's generic scatter, element by element), the gather and the copies into and
        out of mlx another ~0.8."""
        runner, layer = self._runner, self._layer
        batch, store = runner.batch, runner.store
        if batch.mirror is not None or store.dtype != mx.float32 or batch.table_host is None:
            return None
        mx.eval(store.keys[layer], store.values[layer])
        kp, vp = np.asarray(store.keys[layer]), np.asarray(store.values[layer])
        if not (kp.flags.writeable and vp.flags.writeable and kp.flags.c_contiguous and vp.flags.c_contiguous):
            return None
        K = batch.exact_len if batch.exact_len is not None else batch.kv_len
        return q4_kernels.prefill_kv(kc, vc, kp, vp, batch.slots_host, batch.table_host, store.block_size, starts, L, K)

    def mirror_kv(self, keys, values):
        """For a decode step over the mirror: store the new entries and return this
        layer's whole mirror, keys and values ``(B, H, cap, D)``, with ``(B,)`` host
        lengths (the keys each row sees); None, storing nothing, for any other step."""
        batch = self._runner.batch
        if batch.mirror is None:
            return None
        if batch.mirror != "append":
            self._runner.store.write(self._layer, keys, values, batch.slots)
        k, v = self._mirror_update(keys, values)
        return k, v, batch.lens

    def _mirror_update(self, keys, values):
        runner, layer, batch, store = self._runner, self._layer, self._runner.batch, self._runner.store
        m = runner.mirror
        B, H, _, D = keys.shape
        if batch.mirror == "rebuild":
            runner.rebuild_mirror_layer(layer)
        else:
            m.keys[layer][batch.mirror_idx] = keys.reshape(B * H, D)
            m.values[layer][batch.mirror_idx] = values.reshape(B * H, values.shape[-1])
        return m.keys[layer].reshape(B, H, m.cap, D), m.values[layer].reshape(B, H, m.cap, -1)

    def native_mirror(self):
        """For a decode step that writes its new entries itself (q4_kernels.decode_step):
        see :meth:`PagedRunner.native_mirror`."""
        return self._runner.native_mirror()

    def make_mask(self, N: int, return_array: bool = False, window_size=None, **_):
        if window_size is not None:
            raise NotImplementedError("sliding-window layers run on the dense path")
        mask = self._runner.batch.mask
        if isinstance(mask, str) or (mask is None and return_array):
            q0 = self._runner.batch.offsets
            kv = self._runner.batch.exact_len or self._runner.batch.kv_len
            return pa.causal_mask(q0, N, kv)
        return mask

    def empty(self):
        return False


class _LastRows(nn.Module):
    """Stands in for the model's final norm during a prefill so the vocabulary projection
    runs on each row's last real position only, not on every prompt position."""

    def __init__(self, norm, index: mx.array):
        super().__init__()
        self.norm = norm
        self.index = index

    def __call__(self, h):
        h = h[mx.arange(h.shape[0]), self.index][:, None, :]
        return self.norm(h)


class PagedRunner:
    """Batched forward over the paged store."""

    # Whether the last forward wrote its KV into the pools in place (so the engine may
    # queue it before reading the step before it back). Functional writes here: never.
    last_step_in_place = False

    def __init__(self, model, store: KVStore, mirror: bool = True, fast: bool = True):
        self.model = model
        self.store = store
        self.caches = [PagedLayerCache(self, i) for i in range(store.num_layers)]
        self.batch = _Batch()
        self.use_mirror = mirror
        self.mirror = _Mirror()
        self.mirror.keys = [None] * store.num_layers
        self.mirror.values = [None] * store.num_layers
        self._mirror_bufs: list[mx.array] | None = None  # see _fill_mirror_host
        inner = getattr(model, "model", None)
        self._norm_owner = inner if isinstance(getattr(inner, "norm", None), nn.Module) else None
        # The CPU forward (fast_llama) is measured on the CPU only; other backends keep
        # mlx-lm's forward (and their own runner, see cuda_runner.py).
        self.fast = None
        if fast and mx.default_device() == mx.cpu:
            why = fast_llama.supports(model)
            if why is None:
                self.fast = fast_llama.FastLlama(model)
            else:
                log.info("mlx-lm forward for this model (the fast CPU forward does not support %s)", why)

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
        b.slots_host = slots.reshape(-1)
        b.table = mx.array(table)
        b.table_host = table
        b.mirror = None
        kv_len = int(ctx.max())
        b.kv_len = kv_len
        b.lens = ctx
        if L == 1 and self.use_mirror:
            self._plan_mirror(rows, starts, ctx)
        if b.mirror == "append":
            self.mirror.pending.append((slots.reshape(-1), b.mirror_rows))
        else:
            self.flush()  # before this step writes the pool or rebuilds the mirror from it
        if B == 1:
            # Alone, a row sees exactly its own context, as mlx-lm's own cache would give it.
            b.exact_len = int(ctx[0])
            b.mask = None if L == 1 else "causal"
        elif L == 1:
            b.exact_len = None
            b.mask = None if (ctx == kv_len).all() else (mx.arange(kv_len)[None, :] < mx.array(ctx)[:, None])[:, None, None, :]
        else:
            b.exact_len = None
            b.kv_len = nb * bs
            b.mask = pa.causal_mask(b.offsets, L, nb * bs)
        if self.fast is not None:
            return self._fast_forward(inputs, starts, ns, ctx)
        if L == 1 or self._norm_owner is None:
            logits = self.model(inputs, cache=self.caches)
            return logits[:, -1, :] if L == 1 else logits[mx.arange(B), mx.array(ns - 1)]
        owner = self._norm_owner
        norm = owner.norm
        owner.norm = _LastRows(norm, mx.array(ns - 1))
        try:
            logits = self.model(inputs, cache=self.caches)
        finally:
            owner.norm = norm
        return logits[:, 0, :]

    def _fast_forward(self, inputs: mx.array, starts: np.ndarray, ns: np.ndarray, ctx: np.ndarray) -> mx.array:
        b = self.batch
        B, L = inputs.shape
        K = b.exact_len if b.exact_len is not None else b.kv_len  # keys update_and_fetch returns
        if L == 1:
            mask = None if (ctx == K).all() else cpu_math.additive_mask(ctx - 1, 1, K)
            last = None
        else:
            mask = cpu_math.additive_mask(starts, L, K)
            last = mx.array(ns - 1)
        return self.fast(inputs, self.caches, mask, int(starts.max()), last)

    def _plan_mirror(self, rows: list[Row], starts: np.ndarray, ctx: np.ndarray) -> None:
        m, b = self.mirror, self.batch
        H = self.store.n_kv_heads
        key = [(r.seq.serial, r.seq.num_preemptions) for r in rows]
        if key == m.rows and np.array_equal(starts, m.lens) and int(ctx.max()) <= m.cap:
            b.mirror = "append"
            B = len(rows)
            b.mirror_rows = ((np.arange(B)[:, None] * H + np.arange(H)[None, :]) * m.cap + starts[:, None]).astype(np.int32)
            b.mirror_idx = mx.array(b.mirror_rows.reshape(-1))
        else:
            b.mirror = "rebuild"
            # Room for the tokens these rows may still generate (up to MIRROR_AHEAD more
            # than now): a rebuild is a gather of every row's blocks (150-350 ms for 16
            # rows of the default model on 2 cores), and +64 had cost a second one within
            # a 128-token request. The mirror is read only up to each row's length.
            now = int(ctx.max())
            reach = max(int(c) + r.seq.sampling.max_tokens - r.seq.num_generated - r.seq.pending
                        for c, r in zip(ctx, rows))
            m.cap = -(-min(max(reach, now + 1), now + MIRROR_AHEAD) // 128) * 128
            m.rows = key
        m.lens = ctx.copy()

    def rebuild_mirror_layer(self, layer: int) -> None:
        """Fill one layer's mirror from the pool: every row's blocks, padded to the cap."""
        m, b = self.mirror, self.batch
        kv = []
        for new in self.store.gather(layer, b.table):
            B, H, have, D = new.shape
            if have < m.cap:
                new = mx.pad(new, [(0, 0), (0, 0), (0, m.cap - have), (0, 0)])
            kv.append(mx.contiguous(new[:, :, : m.cap]).reshape(B * H * m.cap, D))
        m.keys[layer], m.values[layer] = kv

    def _fill_mirror_host(self) -> bool:
        """Rebuild every layer's mirror from the pool in one C call on the kernels' pool
        (q4_kernels.mirror_fill) instead of mlx's gather, pad and copy per layer (150-350
        ms for 16 rows of the default model); False where it cannot (no kernels, a pool
        that is not float32, keys and values of different widths)."""
        m, b, store = self.mirror, self.batch, self.store
        if not q4_kernels.available() or store.v_head_dim != store.head_dim or b.table_host is None:
            return False
        B, H, D, n = len(b.lens), store.n_kv_heads, store.head_dim, store.num_layers
        mx.eval(store.keys, store.values)  # the pool's pending writes (a flush) land first
        # Each layer's mirror is the front of a buffer kept from one rebuild to the next:
        # allocating ~280 MB afresh (16 rows, cap 384) cost 90-110 ms of page faults and
        # zeroing, more than the copy. Entries past the pool's are never read before the
        # decode step writes them, so the buffers are not cleared.
        need = B * H * m.cap
        if self._mirror_bufs is None or self._mirror_bufs[0].shape[0] < need or self._mirror_bufs[0].shape[1] != D:
            self._mirror_bufs = None
            m.keys, m.values = [None] * n, [None] * n  # the old mirror's memory goes first
            size = -(-need * 5 // 4 // 1024) * 1024
            self._mirror_bufs = [mx.zeros((size, D), mx.float32) for _ in range(2 * n)]
            mx.eval(self._mirror_bufs)
        m.keys = [a[:need] for a in self._mirror_bufs[:n]]
        m.values = [a[:need] for a in self._mirror_bufs[n:]]
        mx.eval(m.keys, m.values)
        kmir, vmir = [np.asarray(a) for a in m.keys], [np.asarray(a) for a in m.values]
        q4_kernels.mirror_fill([np.asarray(a) for a in store.keys], [np.asarray(a) for a in store.values], kmir, vmir,
                               b.table_host, store.block_size, m.cap)
        return True

    def native_mirror(self):
        """For a decode step whose kernel appends each row's new key and value itself:
        every layer's mirror as writable host arrays ``(B * H * cap, D)`` sharing the mlx
        buffers, complete up to each row's new position, with the (B,) key counts and the
        cap; None for any other step. The new entries are noted for the next flush, as
        appended entries are."""
        b, m = self.batch, self.mirror
        if b.mirror is None or self.store.dtype != mx.float32:
            return None
        if b.mirror == "rebuild":
            # The pool does not have this step's entries yet: the kernel writes them into
            # the mirror, and the next flush copies them to the pool as for an append.
            if not self._fill_mirror_host():
                for layer in range(self.store.num_layers):
                    self.rebuild_mirror_layer(layer)
            H, B = self.store.n_kv_heads, len(b.lens)
            starts = b.lens - 1
            b.mirror_rows = ((np.arange(B)[:, None] * H + np.arange(H)[None, :]) * m.cap + starts[:, None]).astype(np.int32)
            m.pending.append((b.slots_host, b.mirror_rows))
            b.mirror = "append"
        mx.eval(m.keys, m.values)
        return [np.asarray(k) for k in m.keys], [np.asarray(v) for v in m.values], b.lens, m.cap

    def flush(self) -> None:
        """Copy the decode steps' appended KV entries from the mirror into the pool. The
        engine calls it before it reads or writes pool blocks itself (export, import,
        copy-on-write); forwards call it unless they only append to the mirror again."""
        m = self.mirror
        if not m.pending:
            return
        slots = np.concatenate([s for s, _ in m.pending])
        src = np.concatenate([r for _, r in m.pending])  # (n, H) mirror rows
        m.pending = []
        store = self.store
        if q4_kernels.available() and store.dtype == mx.float32 and store.v_head_dim == store.head_dim:
            # In C, in place (the slots are the decode rows' own blocks, and the pool is
            # evaluated first): mlx's element-wise scatter took 68-85 ms for 1,008 entries
            # of the default model (16 rows x 63 steps).
            mx.eval(store.keys, store.values, m.keys, m.values)
            q4_kernels.mirror_flush([np.asarray(a) for a in store.keys], [np.asarray(a) for a in store.values],
                                    [np.asarray(a) for a in m.keys], [np.asarray(a) for a in m.values], slots, src)
            return
        slots, src = mx.array(slots), mx.array(src)
        for layer in range(self.store.num_layers):
            self.store.write_rows(layer, m.keys[layer][src], m.values[layer][src], slots)

    def quiesce(self) -> None:
        """Evaluate every array that outlives a step and drop the mirror: the engine thread
        is about to end, and arrays still pending on its stream could not run elsewhere."""
        self.flush()
        mx.eval(self.store.keys, self.store.values)
        self.mirror = _Mirror()
        self.mirror.keys = [None] * self.store.num_layers
        self.mirror.values = [None] * self.store.num_layers
        self._mirror_bufs = None


class DenseRunner:
    """One mlx-lm cache per sequence, one forward per row (models the pool cannot hold)."""

    last_step_in_place = False

    def __init__(self, model):
        self.model = model

    def flush(self) -> None:
        pass

    def quiesce(self) -> None:
        pass

    def forward(self, rows: list[Row], inputs: mx.array) -> mx.array:
        out = []
        for i, r in enumerate(rows):
            if r.seq.dense_cache is None or r.start == 0:
                r.seq.dense_cache = make_prompt_cache(self.model)
            logits = self.model(inputs[i : i + 1, : r.n], cache=r.seq.dense_cache)
            out.append(logits[:, -1, :])
        return mx.concatenate(out, axis=0)
