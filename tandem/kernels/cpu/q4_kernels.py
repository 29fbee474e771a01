"""4-bit weights multiplied straight from their packed form, and a whole decode step in C.

With dense fp32 weights a decode step of the default model (SmolLM2-135M) reads
~430 MB of layer weights plus ~113 MB of vocabulary per step, and between the
projections mlx runs some 30 small ops per layer whose dispatch costs more than their
arithmetic. Here the weights stay as the checkpoint stored them, 4-bit codes ``q`` with
a scale ``d`` and offset ``m`` per 32 weights (GGUF's Q4_1, mlx's affine 4-bit), and
each block is expanded in registers: the 16 values ``d*q + m`` can take form a table,
and one AVX-512 permute per 16 weights looks the codes up in it. The table is computed
the way mlx dequantizes (for fp16 scales: ``d*q`` rounded to fp16, ``+ m`` rounded to
fp16), so every weight the kernel multiplies is bit for bit the dense weight the rest
of tandem (and mlx-lm) uses; :class:`Q4Matrix` checks that against the dense array
before it is used. Only the order of the sums differs from a BLAS product.

:func:`decode_step` runs all layers of one decode step (RMSNorm, QKV, RoPE from
tables, the KV append to the runner's decode mirror, attention as in
:mod:`cpu_kernels`, output projection, SwiGLU MLP) and the vocabulary projection in
one call, on a small persistent thread pool (one thread per core).

The C code is ``q4_kernels.c`` next to this module, built (after
:mod:`cpu_kernels`' source, whose ``exp_poly`` and attention it uses) with
:func:`cpu_kernels.build_library`; needs AVX-512F (otherwise
:func:`available` is False and the mlx/MKL path runs). ``engine.native_kernels = false``
keeps them out of the engine.
"""

from __future__ import annotations

import ctypes
import logging
import subprocess
from pathlib import Path

import numpy as np

from tandem.kernels.cpu import cpu_kernels

log = logging.getLogger("tandem.engine")

# The C source ships next to this module (package data); it is compiled after
# cpu_kernels' source, whose exp_poly and attend_pair it uses.
_SOURCE_FILE = Path(__file__).with_name("q4_kernels.c")


class _Mat(ctypes.Structure):
    _fields_ = [("nib", ctypes.c_void_p), ("dm", ctypes.c_void_p), ("lut", ctypes.c_void_p), ("n", ctypes.c_long),
                ("k", ctypes.c_long),
                ("round16", ctypes.c_long), ("bits", ctypes.c_long)]


class _Layer(ctypes.Structure):
    _fields_ = [("qkv", _Mat), ("o", _Mat), ("gu", _Mat), ("down", _Mat), ("qkv_bias", ctypes.c_void_p),
                ("ln1", ctypes.c_void_p), ("ln2", ctypes.c_void_p)]


_lib = None
_why: str | None = None


def _build() -> ctypes.CDLL:
    lib = cpu_kernels.build_library("q4_kernels", cpu_kernels._SOURCE + _SOURCE_FILE.read_text())
    if not lib.q4_supported():
        raise OSError("the CPU or compiler has no AVX-512F")
    P, L, F = ctypes.c_void_p, ctypes.c_long, ctypes.c_float
    lib.q4_matmul.argtypes = [P, P, L, P, L]
    lib.q4_expand.argtypes = [P, P, L]
    lib.q4_rows.argtypes = [P, P, L, P]
    lib.q4_decode_step.argtypes = [P, L, P, P, P, L, L, L, L, L, L, P, P, P, P, P, P, L, F, F, P, L]
    lib.rope_cols.argtypes = [P, L, L, L, P, P, L]
    lib.silu_rows.argtypes = [P, L, L, P, L]
    lib.rope_rows.argtypes = [P, L, L, L, L, P, P, L]
    lib.silu_cols.argtypes = [P, L, L, P, L]
    lib.prefill_attention.argtypes = [P, P, P, P, P, L, L, L, L, L, L, F, L, L, L, L, L]
    lib.blas_rows.argtypes = [P, L, P, L, L, P, L, L, P, F, L, L]
    lib.q4_blas_rows.argtypes = [P, L, P, P, L, L, P, F, L, L]
    lib.rms_norm_cols.argtypes = [P, P, P, L, L, F, L]
    lib.mirror_flush.argtypes = [P, P, P, P, L, P, P, L, L, L, L]
    lib.mirror_fill.argtypes = [P, P, P, P, L, P, L, L, L, L, L, L, L]
    lib.prefill_kv.argtypes = [P, P, L, P, P, P, P, L, L, P, L, L, L, L, L, P, P, L]
    for fn in (lib.q4_matmul, lib.q4_expand, lib.q4_rows, lib.q4_decode_step, lib.rope_cols, lib.silu_rows, lib.rope_rows,
               lib.silu_cols, lib.prefill_attention, lib.blas_rows, lib.q4_blas_rows, lib.rms_norm_cols, lib.prefill_kv, lib.mirror_fill, lib.mirror_flush):
        fn.restype = ctypes.c_int
    return lib


def available() -> bool:
    """Whether the 4-bit kernels can be used (built on the first call)."""
    global _lib, _why
    if _lib is None and _why is None:
        if not cpu_kernels.available():
            _why = f"no C kernels ({cpu_kernels._why})"
        else:
            try:
                _lib = _build()
            except (OSError, subprocess.SubprocessError, AttributeError) as e:
                detail = getattr(e, "stderr", b"") or b""
                _why = f"{e} {detail.decode(errors='replace')[:500]}".strip()
                log.info("decode stays on the mlx/MKL path (no 4-bit kernels: %s)", _why)
    return _lib is not None


def why_not() -> str | None:
    return _why


class Q4Matrix:
    """One (n, k) weight matrix as 4-bit (or 8-bit) codes plus a scale and an offset per
    32 weights.

    Built from mlx's affine layout (``weight`` uint32 holding 8 (or 4) codes per word, low
    bits first; ``scales`` and ``biases`` per group of 32 or 64 along k): value =
    scale * code + bias, computed in the scales' precision (fp16 scales: rounded to fp16
    after the multiply and after the add, as ``mx.dequantize`` does). 4-bit codes are
    stored two per byte, block by block: byte j of a 32-weight block holds the codes of
    weights j (low nibble) and 16 + j (high nibble)."""

    def __init__(self, codes: np.ndarray, dm: np.ndarray, round16: bool, bits: int = 4, table: bool = True):
        self.nib = np.ascontiguousarray(codes, np.uint8)  # (n, k/2), or (n, k) for 8 bits
        self.dm = np.ascontiguousarray(dm, np.float32)  # (n, k/32, 2)
        self.bits = bits
        self.n, self.k = self.nib.shape[0], self.nib.shape[1] * 8 // bits
        assert bits in (4, 8) and self.dm.shape == (self.n, self.k // 32, 2)
        self.round16 = bool(round16)
        self.lut = self.values16 = None
        if self.round16 and bits == 4 and table:
            # Every value is an fp16 number: a table of the 16 a block can take costs one
            # conversion per 32 weights in the kernel instead of a multiply, an add and
            # four conversions (1.5 bytes per weight instead of 0.75).
            codes16 = np.arange(16, dtype=np.float32)
            t = (self.dm[:, :, :1] * codes16).astype(np.float16).astype(np.float32) + self.dm[:, :, 1:]
            self.lut = np.ascontiguousarray(t.astype(np.float16).view(np.uint16))  # (n, k/32, 16)
        elif self.round16 and bits == 8:
            # 8-bit codes take 256 values per block: the fp16 values themselves (2 bytes per weight).
            # (4-bit codes without the table are expanded from d and m block by block.)
            self.values16 = np.ascontiguousarray(self.reference().astype(np.float16).view(np.uint16))
        data = self.values16 if self.values16 is not None else self.nib
        self.c = _Mat(data.ctypes.data, self.dm.ctypes.data, None if self.lut is None else self.lut.ctypes.data,
                      self.n, self.k, int(round16), 16 if self.values16 is not None else bits)

    @property
    def nbytes(self) -> int:
        """Bytes the kernel reads for one product."""
        if self.values16 is not None:
            return self.values16.nbytes
        return self.nib.nbytes + (self.lut.nbytes if self.lut is not None else self.dm.nbytes)

    @property
    def shape(self) -> tuple[int, int]:
        return self.n, self.k

    @classmethod
    def from_mlx(cls, weight: np.ndarray, scales: np.ndarray, biases: np.ndarray, group_size: int,
                 round16: bool, table: bool = True) -> "Q4Matrix":
        n = weight.shape[0]
        k = scales.shape[1] * group_size
        bits = weight.shape[1] * 32 // k
        if bits not in (4, 8):
            raise ValueError(f"{bits}-bit weights: only 4 and 8 bits have kernels")
        if group_size % 32 or k % group_size:
            raise ValueError(f"group size {group_size} for {k} columns: need groups of a multiple of 32")
        raw = np.ascontiguousarray(weight).view(np.uint8).reshape(n, k * bits // 8)
        rep = group_size // 32
        d = np.repeat(np.asarray(scales, np.float32), rep, axis=1)
        m = np.repeat(np.asarray(biases, np.float32), rep, axis=1)
        if bits == 8:
            return cls(raw, np.stack([d, m], axis=-1), round16, 8)
        codes = np.empty((n, k), np.uint8)
        codes[:, 0::2] = raw & 15
        codes[:, 1::2] = raw >> 4
        blocks = codes.reshape(n, k // 32, 2, 16)
        nib = (blocks[:, :, 0] | (blocks[:, :, 1] << 4)).reshape(n, k // 2)
        return cls(nib, np.stack([d, m], axis=-1), round16, table=table)

    @classmethod
    def stack(cls, parts: list["Q4Matrix"], table: bool = True) -> "Q4Matrix":
        assert len({(p.round16, p.bits) for p in parts}) == 1
        if len(parts) == 1 and (parts[0].lut is not None) == (table and parts[0].round16 and parts[0].bits == 4):
            return parts[0]
        return cls(np.concatenate([p.nib for p in parts]), np.concatenate([p.dm for p in parts]), parts[0].round16,
                   parts[0].bits, table=table)

    def expand(self, out: np.ndarray | None = None) -> np.ndarray:
        """The (n, k) float32 values the kernel multiplies, on the kernels' threads; into
        ``out`` (C-contiguous float32 of at least n * k values, its front reshaped) where
        given, so a caller can reuse one buffer for many matrices."""
        if out is None:
            out = np.empty((self.n, self.k), np.float32)
        else:
            assert out.dtype == np.float32 and out.flags.c_contiguous and out.flags.writeable
            out = out.reshape(-1)[: self.n * self.k].reshape(self.n, self.k)
        _lib.q4_expand(ctypes.byref(self.c), out.ctypes.data, cpu_kernels.threads())
        return out

    def rows(self, ids: np.ndarray) -> np.ndarray:
        """Rows ``ids`` (int32, any shape) as the float32 values the kernel multiplies,
        ``ids.shape + (k,)``: an embedding lookup in a tied vocabulary matrix."""
        ids = np.ascontiguousarray(ids, np.int32)
        out = np.empty(ids.shape + (self.k,), np.float32)
        if _lib.q4_rows(ctypes.byref(self.c), ids.ctypes.data, ids.size, out.ctypes.data) != 0:
            raise IndexError(f"token id out of range 0..{self.n - 1}")
        return out

    def reference(self) -> np.ndarray:
        """The same values in numpy (what mx.dequantize computes)."""
        if self.bits == 8:
            codes = self.nib.reshape(self.n, self.k // 32, 32).astype(np.float32)
        else:
            nib = self.nib.reshape(self.n, self.k // 32, 16)
            codes = np.concatenate([nib & 15, nib >> 4], axis=2).astype(np.float32)  # (n, k/32, 32)
        w = codes * self.dm[:, :, :1]
        if self.round16:
            w = w.astype(np.float16).astype(np.float32)
        w = w + self.dm[:, :, 1:]
        if self.round16:
            w = w.astype(np.float16).astype(np.float32)
        return w.reshape(self.n, self.k)

    def matmul(self, x: np.ndarray, num_threads: int | None = None) -> np.ndarray:
        """x (m, k) float32 -> x @ W.T (m, n)."""
        x = np.ascontiguousarray(x, np.float32)
        assert x.ndim == 2 and x.shape[1] == self.k
        y = np.empty((x.shape[0], self.n), np.float32)
        _lib.q4_matmul(ctypes.byref(self.c), x.ctypes.data, x.shape[0], y.ctypes.data,
                       num_threads or cpu_kernels.threads())
        return y


def layer_struct(qkv: Q4Matrix, o: Q4Matrix, gu: Q4Matrix, down: Q4Matrix, qkv_bias: np.ndarray | None,
                 ln1: np.ndarray, ln2: np.ndarray) -> _Layer:
    return _Layer(qkv.c, o.c, gu.c, down.c, None if qkv_bias is None else qkv_bias.ctypes.data,
                  ln1.ctypes.data, ln2.ctypes.data)


def layers_array(layers: list[_Layer]):
    return (_Layer * len(layers))(*layers)


class HostMirror:
    """Every layer's decode mirror as host float32 arrays, with the pointer arrays the C
    step takes, checked once: a runner keeps one for as long as its mirror buffers stay
    the same (building and checking 60 of them cost tens of microseconds a step)."""

    def __init__(self, kmir: list[np.ndarray], vmir: list[np.ndarray]):
        assert len(kmir) == len(vmir)
        size = kmir[0].size if kmir else 0
        for m in (*kmir, *vmir):
            assert m.dtype == np.float32 and m.flags.c_contiguous and m.flags.writeable and m.size == size
        self.keys, self.values, self.size = kmir, vmir, size
        self.kp = (ctypes.c_void_p * len(kmir))(*[m.ctypes.data for m in kmir])
        self.vp = (ctypes.c_void_p * len(vmir))(*[m.ctypes.data for m in vmir])

    def __len__(self) -> int:
        return len(self.keys)


def decode_step(layers, head: Q4Matrix, norm_w: np.ndarray, x: np.ndarray, dims: tuple, cos: np.ndarray,
                sin: np.ndarray, mirror: HostMirror, lens: np.ndarray, cap: int,
                eps: float, scale: float, kvrow: np.ndarray | None = None) -> np.ndarray:
    """One decode step, every layer and the vocabulary projection -> logits (B, vocab).

    x (B, hidden) float32 (overwritten); dims = (hidden, Hq, Hkv, D, intermediate);
    cos, sin (B, D/2); mirror: per layer a C-contiguous float32 buffer of
    (R, Hkv, cap, D) for keys and for values, into which each row's new key and value are
    written at position lens[b] - 1 before the attention reads the first lens[b]
    positions. ``kvrow`` (B,):
    the region of R that row b writes and reads (None: its own, R = B); rows that share
    one (a sequence's positions verified together) all write before any attends, so each
    sees the keys of the positions before its own."""
    hidden, hq, hkv, d, inter = dims
    B = x.shape[0]
    assert x.dtype == np.float32 and x.flags.c_contiguous and x.shape == (B, hidden)
    assert cos.shape == sin.shape == (B, d // 2) and cos.flags.c_contiguous and sin.flags.c_contiguous
    lens = np.ascontiguousarray(lens, np.int32)
    assert lens.shape == (B,) and lens.min() >= 1 and lens.max() <= cap
    R = B
    if kvrow is not None:
        kvrow = np.ascontiguousarray(kvrow, np.int32)
        R = int(kvrow.max()) + 1
        assert kvrow.shape == (B,) and kvrow.min() >= 0
    assert mirror.size == R * hkv * cap * d
    nl = len(mirror)
    logits = np.empty((B, head.n), np.float32)
    rc = _lib.q4_decode_step(layers, nl, ctypes.byref(head.c), norm_w.ctypes.data, x.ctypes.data, B, hidden,
                             hq, hkv, d, inter, cos.ctypes.data, sin.ctypes.data, mirror.kp, mirror.vp, lens.ctypes.data,
                             None if kvrow is None else kvrow.ctypes.data, cap,
                             eps, scale, logits.ctypes.data, cpu_kernels.threads())
    if rc != 0:
        raise MemoryError("4-bit decode step: no memory for its buffers")
    return logits


def rope_cols(x: np.ndarray, heads: int, d: int, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """x (rows, t) float32, C-contiguous: rows h*d + i and h*d + i + d/2 (h < heads)
    rotated in place by cos, sin (d/2, t) -> x. What mlx's non-traditional RoPE computes
    for a head laid out along rows, with the position tables of each column."""
    assert x.dtype == np.float32 and x.flags.c_contiguous and x.flags.writeable and x.shape[0] >= heads * d
    t = x.shape[1]
    assert cos.shape == sin.shape == (d // 2, t) and cos.flags.c_contiguous and sin.flags.c_contiguous
    _lib.rope_cols(x.ctypes.data, heads, d, t, cos.ctypes.data, sin.ctypes.data, cpu_kernels.threads())
    return x


def silu_rows(gu: np.ndarray) -> np.ndarray:
    """gu (2 * inter, t) float32: gate rows then up rows -> silu(gate) * up (inter, t)."""
    assert gu.dtype == np.float32 and gu.flags.c_contiguous and gu.shape[0] % 2 == 0
    inter, t = gu.shape[0] // 2, gu.shape[1]
    a = np.empty((inter, t), np.float32)
    _lib.silu_rows(gu.ctypes.data, inter, t, a.ctypes.data, cpu_kernels.threads())
    return a


def rope_rows(x: np.ndarray, heads: int, d: int, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """:func:`rope_cols` for x (t, features) with a token per row; cos, sin (t, d/2)."""
    assert x.dtype == np.float32 and x.flags.c_contiguous and x.flags.writeable and x.shape[1] >= heads * d
    t = x.shape[0]
    assert cos.shape == sin.shape == (t, d // 2) and cos.flags.c_contiguous and sin.flags.c_contiguous
    _lib.rope_rows(x.ctypes.data, heads, d, t, x.shape[1], cos.ctypes.data, sin.ctypes.data, cpu_kernels.threads())
    return x


def silu_cols(gu: np.ndarray) -> np.ndarray:
    """gu (t, 2 * inter) float32: gate columns then up columns -> silu(gate) * up (t, inter)."""
    assert gu.dtype == np.float32 and gu.flags.c_contiguous and gu.shape[1] % 2 == 0
    t, inter = gu.shape[0], gu.shape[1] // 2
    a = np.empty((t, inter), np.float32)
    _lib.silu_cols(gu.ctypes.data, inter, t, a.ctypes.data, cpu_kernels.threads())
    return a


def prefill_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, starts: np.ndarray, L: int, scale: float,
                      columns: bool) -> np.ndarray:
    """Causal attention of a prefill batch, on the kernels' threads.

    q: the Hq*D query features of B*L tokens (row b's queries are tokens b*L .. b*L+L-1),
    float32, C-contiguous: (Hq*D, B*L) with ``columns`` (a token per column, head h's
    features in rows h*D .. h*D+D-1), else (B*L, Hq*D) (a token per row); k, v
    (B, Hkv, K, D) float32, C-contiguous; starts (B,): the position of each row's first
    query. Query i of row b attends to its row's keys 0 .. starts[b] + i (at most K),
    query head h to kv head h // (Hq / Hkv) -> o in q's layout: what
    :func:`cpu_math.attention` computes with ``additive_mask(starts, L, K)``."""
    B, Hkv, K, D = k.shape
    assert v.shape == k.shape and k.dtype == v.dtype == q.dtype == np.float32
    assert q.flags.c_contiguous and k.flags.c_contiguous and v.flags.c_contiguous and q.ndim == 2
    T = B * L
    feats = q.shape[0] if columns else q.shape[1]
    assert (q.shape[1] if columns else q.shape[0]) == T and feats % D == 0
    starts = np.ascontiguousarray(starts, np.int32)
    assert starts.shape == (B,) and starts.min() >= 0
    o = np.empty(q.shape, np.float32)
    qf, qt = (T, 1) if columns else (1, feats)
    _lib.prefill_attention(q.ctypes.data, k.ctypes.data, v.ctypes.data, o.ctypes.data, starts.ctypes.data,
                           B, L, feats // D, Hkv, D, K, scale, qf, qt, qf, qt, cpu_kernels.threads())
    return o


# Blocks of weight rows per pool thread in blas_rows: fewer calls pack x fewer times;
# more let a thread that lost its core to another process leave the rest to the others.
# The engine on 16 prompts of 165 uncached tokens (1 new token each, alternating in one
# process, both orders): 1 block 3201-3432 ms, 2 blocks 3295-3525 (-2.3% and -4.5% by
# median); 4 blocks were slower again in a forward alone.
BLAS_BLOCKS = 1


# A packed matrix's rows go to blas_rows in blocks of at most this many bytes expanded
# (each thread's buffer), multiplied while still in cache. Each call repacks the
# activations, so small blocks cost more than the expansion saves: 4 x 170-token prefills
# (bench/prefill.py, one alternating run) took 1.07x the dense path's median with 1 MiB
# blocks and 0.79-1.0x with 16 MiB (for the default model: the dense path's one block a thread).
PACKED_BLOCK_BYTES = 16 << 20


def blas_rows(sgemm: tuple[int, bool], w, x: np.ndarray, transposed: bool,
              add_to: np.ndarray | None = None) -> np.ndarray:
    """w (n, k) @ x.T for x (m, k) (``transposed``), else w @ x for x (k, m) -> (n, m),
    through ``sgemm`` (an address and whether it takes 64-bit sizes, from
    :func:`tandem._blas.openblas_sgemm`), one single-threaded call per pool thread on
    blocks of w's rows taken as threads get free. With ``add_to`` (n, m) the product is
    added to it in place (and it is returned). w is a float32 array, or a
    :class:`Q4Matrix`, whose blocks of rows are expanded into a buffer of each thread
    just before their call (the same values, so the same product, and no dense copy)."""
    packed = isinstance(w, Q4Matrix)
    assert x.dtype == np.float32 and x.flags.c_contiguous
    assert packed or (w.dtype == np.float32 and w.flags.c_contiguous)
    n, k = w.shape
    m = x.shape[0] if transposed else x.shape[1]
    assert (x.shape[1] if transposed else x.shape[0]) == k
    if add_to is None:
        y, beta = np.empty((n, m), np.float32), 0.0
    else:
        assert add_to.shape == (n, m) and add_to.dtype == np.float32 and add_to.flags.c_contiguous
        y, beta = add_to, 1.0
    threads = cpu_kernels.threads()
    chunk = max(16, -(-n // (BLAS_BLOCKS * threads) // 16) * 16)
    if packed:
        chunk = min(chunk, max(16, PACKED_BLOCK_BYTES // (4 * k) // 16 * 16))
        if _lib.q4_blas_rows(sgemm[0], int(sgemm[1]), ctypes.byref(w.c), x.ctypes.data, m, int(transposed),
                             y.ctypes.data, beta, chunk, threads):
            raise MemoryError("blas_rows: no memory for the expanded rows")
        return y
    _lib.blas_rows(sgemm[0], int(sgemm[1]), w.ctypes.data, n, k, x.ctypes.data, m, int(transposed), y.ctypes.data,
                   beta, chunk, threads)
    return y


def rms_norm_cols(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    """RMSNorm of each column (token) of x (n, t) with weight w (n,) -> (n, t)."""
    assert x.dtype == w.dtype == np.float32 and x.flags.c_contiguous and w.flags.c_contiguous
    assert w.shape == (x.shape[0],)
    out = np.empty_like(x)
    _lib.rms_norm_cols(x.ctypes.data, w.ctypes.data, out.ctypes.data, x.shape[0], x.shape[1], eps,
                       cpu_kernels.threads())
    return out


def prefill_kv(kc: np.ndarray, vc: np.ndarray, kpool: np.ndarray, vpool: np.ndarray, slots: np.ndarray,
               table: np.ndarray, block_size: int, starts: np.ndarray, L: int, K: int) -> tuple[np.ndarray, np.ndarray]:
    """A prefill's new keys and values, kc and vc (hkv * d, B * L) in token columns, written
    into the pool arrays (S, hkv, d) **in place** at ``slots`` (B * L,); then each row's
    keys and values 0 .. min(starts[b] + L, K) gathered from the pool through its block
    ``table`` (B, nb) -> (B, hkv, K, d) each (entries past that are left unset: the
    causal limit never reads them)."""
    S, hkv, d = kpool.shape
    B, nb = table.shape
    assert kc.shape == vc.shape == (hkv * d, B * L) and vpool.shape == kpool.shape
    for a in (kc, vc, kpool, vpool):
        assert a.dtype == np.float32 and a.flags.c_contiguous
    assert kpool.flags.writeable and vpool.flags.writeable
    slots = np.ascontiguousarray(slots, np.int32)
    table = np.ascontiguousarray(table, np.int32)
    starts = np.ascontiguousarray(starts, np.int32)
    assert slots.shape == (B * L,) and 0 <= slots.min() and slots.max() < S and (table.max() + 1) * block_size <= S
    assert starts.shape == (B,) and min(K, int(starts.max()) + L) <= nb * block_size  # the gather stays in the table
    ko = np.empty((B, hkv, K, d), np.float32)
    vo = np.empty((B, hkv, K, d), np.float32)
    _lib.prefill_kv(kc.ctypes.data, vc.ctypes.data, B * L, kpool.ctypes.data, vpool.ctypes.data, slots.ctypes.data,
                    table.ctypes.data, nb, block_size, starts.ctypes.data, B, L, hkv, d, K, ko.ctypes.data,
                    vo.ctypes.data, cpu_kernels.threads())
    return ko, vo


def mirror_fill(kpools: list[np.ndarray], vpools: list[np.ndarray], kmir: list[np.ndarray], vmir: list[np.ndarray],
                table: np.ndarray, block_size: int, cap: int) -> None:
    """Fill each layer's decode mirror (B * hkv * cap, d) from its pool (S, hkv, d): row
    b's entries at positions 0 .. min(nb * block_size, cap) through its block ``table``
    (B, nb), in place (positions past that are left as they are)."""
    table = np.ascontiguousarray(table, np.int32)
    B, nb = table.shape
    S, hkv, d = kpools[0].shape
    assert len(kpools) == len(vpools) == len(kmir) == len(vmir) and (table.max() + 1) * block_size <= S
    for a in kpools + vpools:
        assert a.shape == (S, hkv, d) and a.dtype == np.float32 and a.flags.c_contiguous
    for a in kmir + vmir:
        assert a.shape == (B * hkv * cap, d) and a.dtype == np.float32 and a.flags.c_contiguous and a.flags.writeable
    ptrs = [(ctypes.c_void_p * len(arrs))(*(a.ctypes.data for a in arrs)) for arrs in (kpools, vpools, kmir, vmir)]
    _lib.mirror_fill(*ptrs, len(kpools), table.ctypes.data, B, nb, block_size, hkv, d, cap, cpu_kernels.threads())


def mirror_flush(kpools: list[np.ndarray], vpools: list[np.ndarray], kmir: list[np.ndarray], vmir: list[np.ndarray],
                 slots: np.ndarray, rows: np.ndarray) -> None:
    """Copy mirror entries into the pools **in place**: for each layer, pool (S, hkv, d)
    slot ``slots[i]``, head h <- mirror row ``rows[i, h]`` (mirrors flat, (rows, d))."""
    slots = np.ascontiguousarray(slots, np.int32)
    rows = np.ascontiguousarray(rows, np.int32)
    S, hkv, d = kpools[0].shape
    assert rows.shape == (len(slots), hkv) and len(kpools) == len(vpools) == len(kmir) == len(vmir)
    assert 0 <= slots.min() and slots.max() < S
    for a in kpools + vpools:
        assert a.shape == (S, hkv, d) and a.dtype == np.float32 and a.flags.c_contiguous and a.flags.writeable
    for a in kmir + vmir:
        assert a.ndim == 2 and a.shape[1] == d and a.dtype == np.float32 and a.flags.c_contiguous
        assert 0 <= rows.min() and rows.max() < a.shape[0]
    ptrs = [(ctypes.c_void_p * len(arrs))(*(a.ctypes.data for a in arrs)) for arrs in (kpools, vpools, kmir, vmir)]
    _lib.mirror_flush(*ptrs, len(kpools), slots.ctypes.data, rows.ctypes.data, len(slots), hkv, d,
                      cpu_kernels.threads())
