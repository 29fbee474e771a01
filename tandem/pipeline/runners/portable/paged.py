"""Runs an mlx-lm model on a batch of rows against the paged KV store (any device MLX runs on).

mlx-lm models talk to their cache through a small protocol: ``cache.offset`` (RoPE
position of the first new token), ``cache.update_and_fetch(k, v)`` (store the new
entries, return everything the queries may see) and ``cache.make_mask(N, ...)`` (called
once per forward through ``create_attention_mask``). :class:`PagedLayerCache` implements it
over :class:`~tandem.pipeline.kv_store.KVStore` for a whole batch of variable-length rows:
``offset`` is a per-row ``mx.array`` (RoPE accepts one), new keys go to each row's slots,
the gathered keys cover each row's block table, and the mask hides other rows' padding.

A model whose layers want anything but a plain ``KVCache`` (sliding windows, recurrent
state) runs on :class:`~tandem.pipeline.runners.portable.dense.DenseRunner` instead. The CPU
runner (``runners/cpu/runner.py``) and the CUDA runner (``runners/cuda/runner.py``) build on
this one.
"""

from __future__ import annotations

import logging
import mlx.core as mx
import mlx.nn as nn
import numpy as np

from tandem.kernels import paged_attention as pa
from tandem.pipeline.kv_store import KVStore
from tandem.pipeline.runner import RunnerBase
from tandem.pipeline.sequence import Row

log = logging.getLogger("tandem.engine")


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
        # Bumped whenever mlx writes or replaces a layer's arrays (an append through mlx, a
        # rebuild): a host view of them (the CPU runner's) is stale from then on.
        self.changes = 0


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

    def _mirror_update(self, keys, values):
        runner, layer, batch, store = self._runner, self._layer, self._runner.batch, self._runner.store
        m = runner.mirror
        B, H, _, D = keys.shape
        m.changes += 1
        if batch.mirror == "rebuild":
            runner.rebuild_mirror_layer(layer)
        else:
            m.keys[layer][batch.mirror_idx] = keys.reshape(B * H, D)
            m.values[layer][batch.mirror_idx] = values.reshape(B * H, values.shape[-1])
        return m.keys[layer].reshape(B, H, m.cap, D), m.values[layer].reshape(B, H, m.cap, -1)

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
    runs on the positions whose logits are wanted only (each row's last real one, or a
    verified draft's), not on every prompt position. ``index`` (B, m)."""

    def __init__(self, norm, index: mx.array):
        super().__init__()
        self.norm = norm
        self.index = index

    def __call__(self, h):
        h = h[mx.arange(h.shape[0])[:, None], self.index]
        return self.norm(h)


def logit_positions(rows: list[Row]) -> tuple[np.ndarray, np.ndarray | None]:
    """Where a forward's logits come from: ``index`` (B, m), the positions of each row
    whose logits are wanted (its last ``row.logits`` real ones, the last repeated to fill
    m), and ``keep``: which of the B * m results to return, in row order (None: all, m = 1)."""
    want = np.fromiter((r.logits for r in rows), np.int32, len(rows))
    ns = np.fromiter((r.n for r in rows), np.int32, len(rows))
    m = int(want.max())
    j = np.arange(m, dtype=np.int32)[None, :]
    index = ns[:, None] - want[:, None] + np.minimum(j, want[:, None] - 1)
    if m == 1:
        return index, None
    return index, np.flatnonzero((j < want[:, None]).reshape(-1))


class PagedRunner(RunnerBase):
    """Batched forward over the paged store, through mlx-lm's own model code."""

    cache_class = PagedLayerCache

    def __init__(self, model, store: KVStore, mirror: bool = True):
        self.model = model
        self.store = store
        self.caches = [self.cache_class(self, i) for i in range(store.num_layers)]
        self.batch = _Batch()
        self.use_mirror = mirror
        self.mirror = _Mirror()
        self.mirror.keys = [None] * store.num_layers
        self.mirror.values = [None] * store.num_layers
        self._mirror_size = (-1, 0)  # (mirror.changes, its bytes) for mirror_bytes
        inner = getattr(model, "model", None)
        self._norm_owner = inner if isinstance(getattr(inner, "norm", None), nn.Module) else None

    def _layout(self, rows: list[Row], L: int):
        """Each row's first position, length and context, the block table (0 = the store's
        scratch block, ids + 1) and the pool slot of every (row, position) (B, L)."""
        bs = self.store.block_size
        B = len(rows)
        starts = np.fromiter((r.start for r in rows), np.int32, B)
        ns = np.fromiter((r.n for r in rows), np.int32, B)
        ctx = starts + ns
        nb = int((ctx.max() + bs - 1) // bs)
        table = np.zeros((B, nb), np.int32)
        for i, r in enumerate(rows):
            ids = r.seq.block_ids[: (ctx[i] + bs - 1) // bs]
            table[i, : len(ids)] = ids
            table[i, : len(ids)] += 1
        pos = starts[:, None] + np.arange(L, dtype=np.int32)[None, :]  # (B, L)
        valid = np.arange(L)[None, :] < ns[:, None]
        blk = np.take_along_axis(table, np.minimum(pos // bs, nb - 1), axis=1)
        slots = np.where(valid, blk * bs + pos % bs, 0)
        return starts, ns, ctx, table, slots

    def forward(self, rows: list[Row], inputs: mx.array) -> mx.array:
        """inputs: (B, L) token ids, row b's real tokens first -> logits (sum of rows'
        ``logits``, V): each row's last ``row.logits`` real positions, in row order ((B, V)
        at each row's last real token when no row verifies a draft)."""
        bs = self.store.block_size
        B, L = inputs.shape
        starts, ns, ctx, table, slots = self._layout(rows, L)
        nb = table.shape[1]
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
        return self._run_model(inputs, starts, ns, ctx, rows)

    def _run_model(self, inputs: mx.array, starts: np.ndarray, ns: np.ndarray, ctx: np.ndarray,
                   rows: list[Row]) -> mx.array:
        """The model over ``self.batch`` (set by :meth:`forward`): logits at the rows' wanted positions."""
        B, L = inputs.shape
        index, keep = logit_positions(rows)
        if L == 1:
            return self.model(inputs, cache=self.caches)[:, -1, :]
        if self._norm_owner is None:
            logits = self.model(inputs, cache=self.caches)
            logits = logits[mx.arange(B)[:, None], mx.array(index)]
        else:
            owner = self._norm_owner
            norm = owner.norm
            owner.norm = _LastRows(norm, mx.array(index))
            try:
                logits = self.model(inputs, cache=self.caches)
            finally:
                owner.norm = norm
        logits = logits.reshape(-1, logits.shape[-1])
        return logits if keep is None else logits[mx.array(keep)]

    def _plan_mirror(self, rows: list[Row], starts: np.ndarray, ctx: np.ndarray) -> None:
        m, b = self.mirror, self.batch
        H = self.store.n_kv_heads
        key = [(r.seq.serial, r.seq.num_preemptions) for r in rows]
        # A row may start before the mirror's end: a verified draft's rejected positions
        # are past its new start, and this step overwrites them.
        if key == m.rows and len(starts) == len(m.lens) and (starts <= m.lens).all() and int(ctx.max()) <= m.cap:
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

    def mirror_bytes(self) -> int:
        m = self.mirror
        if self._mirror_size[0] != m.changes:
            self._mirror_size = (m.changes, sum(a.nbytes for a in m.keys + m.values if a is not None))
        return self._mirror_size[1]

    def rebuild_mirror_layer(self, layer: int) -> None:
        """Fill one layer's mirror from the pool: every row's blocks, padded to the cap."""
        m, b = self.mirror, self.batch
        m.changes += 1
        kv = []
        for new in self.store.gather(layer, b.table):
            B, H, have, D = new.shape
            if have < m.cap:
                new = mx.pad(new, [(0, 0), (0, 0), (0, m.cap - have), (0, 0)])
            kv.append(mx.contiguous(new[:, :, : m.cap]).reshape(B * H * m.cap, D))
        m.keys[layer], m.values[layer] = kv

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
        # A slot written twice (a rejected draft position, then its real token): the last
        # entry is the one that counts.
        _, first_from_end = np.unique(slots[::-1], return_index=True)
        if len(first_from_end) < len(slots):
            keep = np.sort(len(slots) - 1 - first_from_end)
            slots, src = slots[keep], src[keep]
        self._flush_entries(slots, src)

    def _flush_entries(self, slots: np.ndarray, src: np.ndarray) -> None:
        """Copy mirror rows ``src`` (n, H) into pool ``slots`` (n,), every layer."""
        slots, src = mx.array(slots), mx.array(src)
        for layer in range(self.store.num_layers):
            self.store.write_rows(layer, self.mirror.keys[layer][src], self.mirror.values[layer][src], slots)

    def quiesce(self) -> None:
        """Evaluate every array that outlives a step and drop the mirror: the engine thread
        is about to end, and arrays still pending on its stream could not run elsewhere."""
        self.flush()
        mx.eval(self.store.keys, self.store.values)
        self.mirror = _Mirror()
        self.mirror.keys = [None] * self.store.num_layers
        self.mirror.values = [None] * self.store.num_layers
