"""The CPU runner: the portable paged runner with tandem's fused forward and C kernels.

On the CPU a llama-family model runs through :class:`~tandem.pipeline.runners.cpu.fast_llama.FastLlama`
(fused projections, attention and the decode step of a 4-bit model in C) instead of mlx-lm's
model code, and the decode mirror is filled and flushed by C loops over the pools in place
(``kernels/cpu/q4_kernels``). Where a piece cannot run (no compiler, no AVX-512, a pool
that is not float32, a model the fused forward does not support) the portable path runs
that piece, with the same values.
"""

from __future__ import annotations

import logging

import mlx.core as mx
import numpy as np

from tandem.kernels.cpu import cpu_math, q4_kernels
from tandem.pipeline import loader
from tandem.pipeline.kv_store import KVStore
from tandem.pipeline.runners.cpu import fast_llama, native_decode
from tandem.pipeline.runners.portable.paged import PagedLayerCache, PagedRunner, logit_positions
from tandem.pipeline.sequence import Row

log = logging.getLogger("tandem.engine")

# Most positions (rows x drafted tokens) one verification runs through the C step; past it
# the mlx prefill path runs them, several decode steps' time per position. Plain decode
# stops at native_decode.MAX_ROWS, where MKL on the dense weights catches up; here the
# alternative is far slower, so a wide batch of drafted rows stays in C.
VERIFY_MAX_POSITIONS = 4 * native_decode.MAX_ROWS


class CpuLayerCache(PagedLayerCache):
    """A layer's paged cache with the host-side entry points the fused forward calls."""

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

    def native_mirror(self):
        """For a decode step that writes its new entries itself (q4_kernels.decode_step):
        see :meth:`PagedRunner.native_mirror`."""
        return self._runner.native_mirror()



class CpuRunner(PagedRunner):
    """``fast``: run the fused forward where the model allows it; ``native``: tandem's C
    kernels (decode attention, the mirror's fill and flush, and for a model loaded from
    4-bit weights the whole decode step and the prefill's RoPE/SiLU); False: mlx/MKL only."""

    cache_class = CpuLayerCache

    def __init__(self, model, store: KVStore, mirror: bool = True, fast: bool = True, native: bool = True):
        super().__init__(model, store, mirror=mirror)
        self.native = native
        self._mirror_bufs: list[mx.array] | None = None  # see _fill_mirror_host
        self._host = None  # see _host_mirror
        self.fast = None
        if loader.packed_only(model) and not (fast and native):
            # Only tandem's kernels run the packed codes fast (mlx's quantized products run
            # at a few GFLOP/s here): without them the model goes dense, as it used to load.
            log.info("dequantizing the model to fp32: the fused forward or the C kernels are off")
            loader.dequantize_in_place(model)
        if fast:
            why = fast_llama.supports(model)
            if why is None:
                try:
                    self.fast = fast_llama.FastLlama(model)
                except ValueError as exc:  # a packed model whose codes the kernels turned down
                    log.info("dequantizing the model to fp32: %s", exc)
                    loader.dequantize_in_place(model)
                    why = fast_llama.supports(model)
                    self.fast = fast_llama.FastLlama(model) if why is None else None
            if self.fast is not None and not native:
                self.fast.disable_native_kernels()
            if why is not None:
                log.info("mlx-lm forward for this model (the fast CPU forward does not support %s)", why)

    def forward(self, rows: list[Row], inputs) -> mx.array:
        if inputs.shape[1] > 1 and self._verifies_natively(rows):
            return self._verify_native(rows, inputs)
        return super().forward(rows, inputs)

    def _verifies_natively(self, rows: list[Row]) -> bool:
        """Whether a step whose rows each verify a draft (every position's logits, after
        context already computed) can run as one 4-bit decode step of all their positions."""
        fast = self.fast
        return (fast is not None and fast.native is not None and self.use_mirror and self.store.dtype == mx.float32
                and all(r.start > 0 and r.n == r.logits for r in rows)
                and sum(r.n for r in rows) <= VERIFY_MAX_POSITIONS)

    def _verify_native(self, rows: list[Row], inputs) -> mx.array:
        """Every position of every row as a row of the C decode step, each writing its key
        and value into its sequence's region of the decode mirror and attending over the
        positions up to its own (the kernel appends all of a step's entries before any
        row attends). A draft of k tokens then costs what a decode step of k + 1 rows
        costs, where the mlx prefill path cost several decode steps per position (4-bit
        weights read once for all rows; docs/benchmarks/speculative.md). Rejected
        positions leave entries past the accepted length in the mirror and in its pending
        flush; the next step overwrites them (a flush keeps the last entry of a slot)."""
        B, L = inputs.shape
        starts, ns, ctx, table, slots = self._layout(rows, L)
        b, m, store = self.batch, self.mirror, self.store
        b.offsets = mx.array(starts)
        b.table, b.table_host = mx.array(table), table
        b.kv_len, b.lens = int(ctx.max()), ctx
        b.exact_len, b.mask = None, None
        self._plan_mirror(rows, starts, ctx)
        if b.mirror == "rebuild":
            self.flush()
            if not self._fill_mirror_host():
                for layer in range(store.num_layers):
                    self.rebuild_mirror_layer(layer)
        b.mirror = "append"
        valid = np.arange(L)[None, :] < ns[:, None]
        q_row, q_j = np.nonzero(valid)
        q_pos = (starts[q_row] + q_j).astype(np.int32)
        H = store.n_kv_heads
        m.pending.append((slots[valid].astype(slots.dtype), ((q_row[:, None] * H + np.arange(H)[None, :]) * m.cap
                                                              + q_pos[:, None]).astype(np.int32)))
        mirror = self._host_mirror(), q_pos + 1, m.cap
        ids = np.asarray(inputs)[valid].reshape(-1, 1)
        return self.fast.native.step(ids, mirror, q_pos, kvrow=q_row)

    def _run_model(self, inputs: mx.array, starts: np.ndarray, ns: np.ndarray, ctx: np.ndarray,
                   rows: list[Row]) -> mx.array:
        if self.fast is None:
            return super()._run_model(inputs, starts, ns, ctx, rows)
        b = self.batch
        B, L = inputs.shape
        K = b.exact_len if b.exact_len is not None else b.kv_len  # keys update_and_fetch returns
        keep = None
        if L == 1:
            mask = None if (ctx == K).all() else cpu_math.additive_mask(ctx - 1, 1, K)
            last = None
        else:
            mask = cpu_math.additive_mask(starts, L, K)
            index, keep = logit_positions(rows)
            last = index
        logits = self.fast(inputs, self.caches, mask, int(starts.max()), last)
        return logits if keep is None else logits[mx.array(keep)]


    def _fill_mirror_host(self) -> bool:
        """Rebuild every layer's mirror from the pool in one C call on the kernels' pool
        (q4_kernels.mirror_fill) instead of mlx's gather, pad and copy per layer (150-350
        ms for 16 rows of the default model); False where it cannot (no kernels, a pool
        that is not float32, keys and values of different widths)."""
        m, b, store = self.mirror, self.batch, self.store
        if not (self.native and q4_kernels.available()) or store.v_head_dim != store.head_dim or b.table_host is None:
            return False
        B, H, D, n = len(b.lens), store.n_kv_heads, store.head_dim, store.num_layers
        mx.eval(store.keys, store.values)  # the pool's pending writes (a flush) land first
        # Each layer's mirror is the front of a buffer kept from one rebuild to the next:
        # allocating ~280 MB afresh (16 rows, cap 384) cost 90-110 ms of page faults and
        # zeroing, more than the copy. Entries past the pool's are never read before the
        # decode step writes them, so the buffers are not cleared.
        need = B * H * m.cap
        m.changes += 1
        if self._mirror_bufs is None or self._mirror_bufs[0].shape[0] < need or self._mirror_bufs[0].shape[1] != D:
            self._mirror_bufs = self._host = None
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

    def mirror_bytes(self) -> int:
        # The mirror is the front of buffers kept from one rebuild to the next (their size).
        bufs = self._mirror_bufs
        return len(bufs) * bufs[0].nbytes if bufs else super().mirror_bytes()

    def _host_mirror(self) -> q4_kernels.HostMirror:
        """Every layer's mirror as writable host arrays ``(B * H * cap, D)`` sharing the
        mlx buffers, evaluated; the same object from step to step while mlx has not
        written or replaced the arrays (``_Mirror.changes``): the C step writes its
        entries in place, which mlx never sees."""
        m = self.mirror
        if self._host is None or self._host[0] is not m or self._host[1] != m.changes:
            self._host = None
            mx.eval(m.keys, m.values)
            host = q4_kernels.HostMirror([np.asarray(k) for k in m.keys], [np.asarray(v) for v in m.values])
            self._host = (m, m.changes, host)
        return self._host[2]

    def native_mirror(self):
        """For a decode step whose kernel appends each row's new key and value itself:
        every layer's mirror (:meth:`_host_mirror`), complete up to each row's new
        position, with the (B,) key counts and the cap; None for any other step. The new
        entries are noted for the next flush, as appended entries are."""
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
        return self._host_mirror(), b.lens, m.cap

    def _flush_entries(self, slots: np.ndarray, src: np.ndarray) -> None:
        m, store = self.mirror, self.store
        if not (self.native and q4_kernels.available() and store.dtype == mx.float32
                and store.v_head_dim == store.head_dim):
            return super()._flush_entries(slots, src)
        # In C, in place (the slots are the decode rows' own blocks, and the pool is
        # evaluated first): mlx's element-wise scatter costs tens of ms for a thousand
        # entries of the default model.
        mx.eval(store.keys, store.values, m.keys, m.values)
        q4_kernels.mirror_flush([np.asarray(a) for a in store.keys], [np.asarray(a) for a in store.values],
                                [np.asarray(a) for a in m.keys], [np.asarray(a) for a in m.values], slots, src)

    def quiesce(self) -> None:
        super().quiesce()
        self._mirror_bufs = self._host = None
