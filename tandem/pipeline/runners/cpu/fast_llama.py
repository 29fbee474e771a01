"""A CPU forward for llama-family mlx-lm models (llama, qwen2, qwen3), over the paged caches.

It computes what the mlx-lm model computes, from the model's own weights and modules
(norms, RoPE), arranged for a 2-core CPU where mlx's per-op costs and MKL's small-M
matmuls dominate (docs/cpu-performance.md has the measurements):

* **Fused projections.** Q, K and V are one weight and gate/up are one weight, so a
  layer runs 4 matmuls instead of 7. The fused arrays are built once per model and the
  model's own ``q_proj.weight`` (and the others) become row slices of them, so memory
  does not grow and mlx-lm's forward keeps working on the same values.
* **Weights on the left.** Every projection is ``W @ x.T``: MKL multiplies a small
  right-hand side (the activations) much faster than it packs a large one (the weights),
  1.2-2x per matmul at 16-512 rows. Activations then come out transposed, which is
  what the next op wants anyway (Q/K/V are split along rows, gate and up are
  contiguous row blocks for the SiLU).
* **Cheap exponentials.** SiLU and the attention softmax use :mod:`cpu_math`; attention
  takes an additive mask and skips keys past a query block's causal limit.
* **Compiled decode layers.** A decode step (one token per row) runs each layer as two
  ``mx.compile``d pieces around the attention: norm, QKV and RoPE before it; output
  projection, norm and MLP after it. Their shapes depend only on the batch size, so
  they are traced once per size. This takes most of the graph building off the step
  (about 30 ops per layer become 2 calls): mlx runs only about ten ops ahead of the
  Python thread, so building the next graph cannot hide behind the current one. RoPE
  becomes a multiply by cos/sin tables made once per step from the model's own RoPE
  module (so any RoPE variant it applies the same way gives the same numbers).

* **Packed models.** A model the loader kept as its 4-bit codes (``auto`` on the CPU,
  :func:`supports_packed`) has no dense weights at all: its decode steps are the C step
  of :mod:`native_decode` at any batch size, and everything else (prefills, verified
  drafts beyond the C step's rows, decode without a mirror) runs on the host layers,
  whose products read the codes (few columns) or expand a cache-sized block of rows at
  a time for OpenBLAS (``q4_kernels.blas_rows``), the values identical to the dense ones.

The model object is otherwise untouched; :func:`supports` says why a model cannot take
this path, and then the runner uses mlx-lm's own forward.
"""

from __future__ import annotations

from functools import partial

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from tandem import _blas
from tandem.kernels.cpu import cpu_kernels
from tandem.kernels.cpu import cpu_math
from tandem.pipeline.runners.cpu import native_decode
from tandem.kernels.cpu import q4_kernels

# Rows (batch x tokens) below which a projection runs as W @ x.T rather than x @ W.T
# (at 2,048 rows MKL packs the weights better than the activations again).
LEFT_BELOW = 1024

# From this many rows (batch x tokens) a prefill runs on the host in token columns
# (FastLlama._layers_blas), its products through numpy's OpenBLAS on the kernels' pool
# (q4_kernels.blas_rows) rather than mlx's MKL, at any size (LEFT_BELOW is then moot):
# 4 x 154 tokens 0.76-0.80x the time of the mlx path, 8 x 154 0.77x, 4 x 496 0.66x
# (bench/prefill.py).
BLAS_ROWS_FROM = 64

# From 16 (padded) columns the vocabulary projection runs as row blocks of about this
# many rows, with the same results bit for bit: MKL does the default model's
# (49152 x 576) @ (576 x 16) in 15.6 ms whole and 12.3 ms as 16 blocks of 3,072 rows
# (32 columns 18.2 -> 16.8, 64 columns 32.6 -> 26.9); below 16 columns blocks are
# slower (1, 2, 4 columns: 5.5 -> 6.4, 5.2 -> 5.6, 7.7 -> 8.7 ms).
HEAD_CHUNK_ROWS = 3072
HEAD_CHUNK_FROM = 16  # padded columns

_FAMILIES = ("mlx_lm.models.llama", "mlx_lm.models.qwen2", "mlx_lm.models.qwen3")


def supports(model) -> str | None:
    """None if :class:`FastLlama` can run ``model``, else why not."""
    if packed_only(model):
        return supports_packed(model)
    if type(model).__module__ not in _FAMILIES:
        return f"model class {type(model).__module__}.{type(model).__name__}"
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if not layers or not isinstance(getattr(inner, "embed_tokens", None), nn.Embedding):
        return "no plain embedding / layers"
    for layer in layers:
        if getattr(layer, "use_sliding", False):
            return "sliding-window layers"
        attn, mlp = layer.self_attn, layer.mlp
        for lin in (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj):
            if type(lin) is not nn.Linear or lin.weight.dtype != mx.float32:
                return "weights are not dense float32 Linear layers"
        if "bias" in attn.o_proj or any("bias" in m for m in (mlp.gate_proj, mlp.up_proj, mlp.down_proj)):
            return "biased output or MLP projections"
    if not _tied(model) and type(getattr(model, "lm_head", None)) is not nn.Linear:
        return "no plain vocabulary projection"
    return None


def kernel_layout(m) -> bool:
    """Whether a quantized module's layout is one tandem's 4-bit kernels read: 4- or 8-bit
    affine codes with fp16 or fp32 scales and offsets."""
    return (isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding)) and m.bits in (4, 8)
            and getattr(m, "mode", "affine") == "affine" and m.get("biases") is not None
            and m.scales.dtype in (mx.float16, mx.float32))


def packed_only(model) -> bool:
    """Whether the loader kept ``model`` as packed codes only (loader.PackedModules)."""
    return getattr(getattr(model, "_tandem_packed", None), "packed_only", False) is True


def supports_packed(model) -> str | None:
    """None if :class:`FastLlama` can run ``model`` from its 4-bit (or 8-bit) packed weights
    alone, with no dense copy (every product through tandem's kernels), else why not."""

    if type(model).__module__ not in _FAMILIES:
        return f"model class {type(model).__module__}.{type(model).__name__}"
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if not layers or not isinstance(getattr(inner, "embed_tokens", None), (nn.Embedding, nn.QuantizedEmbedding)):
        return "no plain embedding / layers"
    for layer in layers:
        if getattr(layer, "use_sliding", False):
            return "sliding-window layers"
        if hasattr(layer.self_attn, "q_norm"):
            return "per-head q/k norms"
        attn, mlp = layer.self_attn, layer.mlp
        for lin in (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj):
            if type(lin) is not nn.QuantizedLinear or not kernel_layout(lin):
                return "projections that are not 4- or 8-bit affine layers"
        if "bias" in attn.o_proj or any("bias" in m for m in (mlp.gate_proj, mlp.up_proj, mlp.down_proj)):
            return "biased output or MLP projections"
    head = inner.embed_tokens if _tied(model) else getattr(model, "lm_head", None)
    if head is None or not kernel_layout(head):
        return "a vocabulary projection that is not 4- or 8-bit affine"
    attn = layers[0].self_attn
    why = _Decode(model, attn.n_heads, attn.n_kv_heads, attn.q_proj.weight.shape[0] // attn.n_heads).why
    return why


def _tied(model) -> bool:
    args = getattr(model, "args", None)
    return bool(getattr(args, "tie_word_embeddings", False)) and not hasattr(model, "lm_head")


class _Fused:
    """The fused weights of one model, shared by every runner built on it."""

    def __init__(self, model):
        self.layers = []
        for layer in model.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            qkv = _share_rows(attn, ("q_proj", "k_proj", "v_proj"))
            gate_up = _share_rows(mlp, ("gate_proj", "up_proj"))
            bias = None
            if "bias" in attn.q_proj:
                bias = mx.concatenate([attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias])[:, None]
            self.layers.append((qkv, bias, gate_up))
        mx.eval([(q, b, g) for q, b, g in self.layers])


def _share_rows(parent: nn.Module, names: tuple[str, ...]) -> mx.array:
    """Concatenate the named Linear weights; make each module's weight a row slice of the
    result (a view, so the old arrays are freed and memory does not grow)."""
    fused = mx.concatenate([parent[n].weight for n in names])
    mx.eval(fused)
    start = 0
    for n in names:
        rows = parent[n].weight.shape[0]
        parent[n].weight = fused[start : start + rows]
        start += rows
    return fused


def fused_weights(model) -> _Fused:
    fused = getattr(model, "_tandem_fused", None)
    if fused is None:
        fused = _Fused(model)
        # A plain object attribute, not a parameter: nn.Module only registers arrays,
        # dicts and lists as parameters.
        model._tandem_fused = fused
        mx.eval(model.parameters())
    return fused


def _padded(m: int) -> int:
    """Columns to give MKL for an m-column product with these weights. Measured on the
    2-core EPYC for all 30 layers' projections plus the vocabulary (ms, by columns):
    1: 39, 2: 29, 4: 41, 6: 62, 8: 80, 11: 101, 15: 115, 16: 59, 17: 79, 20: 80,
    28: 102, 32: 78, 48: 113. One column takes the slow matrix-vector kernel, and MKL's
    16-column kernel makes 7-15 columns slower than 16 (and 23-31 than 32)."""
    if m == 1:
        return 2
    if m <= 32 and m % 16 >= 7:
        return -(-m // 16) * 16
    return m


def _left(w: mx.array, xt: mx.array) -> mx.array:
    """``w @ xt`` for xt (in, M), with M padded by zero columns as :func:`_padded` says.
    The activations must reach MKL as a transposed operand, as in that measurement (a
    row-major copy of them was slower: 81 instead of 47 ms for a batch-1 step)."""
    m = xt.shape[1]
    p = _padded(m)
    if p == m:
        return w @ xt
    x = mx.concatenate([xt.T, mx.zeros((p - m, xt.shape[0]), xt.dtype)])  # (p, in)
    return (w @ x.T)[:, :m]


def _rotate(x: mx.array, cos: mx.array, sin: mx.array, axis: int) -> mx.array:
    """What mlx's RoPE computes for non-traditional rotation: the two halves of ``axis``
    rotated by the given cos/sin tables (which broadcast against a half)."""
    x1, x2 = mx.split(x, 2, axis=axis)
    return mx.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=axis)


def _decode_pre(x, ln_w, qkv_w, qkv_b, cos, sin, *, eps, Hq, Hkv, D):
    """x (B, hidden); cos, sin (D/2, B, 1) -> q, k, v (B, H, 1, D) with RoPE applied."""
    half, B, L = cos.shape
    h = mx.fast.rms_norm(x, ln_w, eps)
    qkv = _left(qkv_w, h.T)  # (features, B)
    if qkv_b is not None:
        qkv = qkv + qkv_b
    qk = qkv[: (Hq + Hkv) * D].reshape(Hq + Hkv, D, B)
    rot = _rotate(qk, cos.reshape(1, half, B), sin.reshape(1, half, B), axis=1)
    q = rot[:Hq].reshape(Hq, D, B, L).transpose(2, 0, 3, 1)
    k = rot[Hq:].reshape(Hkv, D, B, L).transpose(2, 0, 3, 1)
    v = qkv[(Hq + Hkv) * D :].reshape(Hkv, D, B, L).transpose(2, 0, 3, 1)
    return q, mx.contiguous(k), mx.contiguous(v)


def _decode_post(x, o, o_w, ln_w, gu_w, down_w, *, eps):
    """x (B, hidden) residual; o (B, Hq, 1, D) attention output -> the layer's output."""
    B, H, L, D = o.shape
    x = x + _left(o_w, o.transpose(0, 2, 1, 3).reshape(B * L, H * D).T).T
    gu = _left(gu_w, mx.fast.rms_norm(x, ln_w, eps).T)
    inter = gu.shape[0] // 2
    g = gu[:inter]
    # Inside a compiled graph the polynomial exp fuses with its neighbours at any size.
    a = cpu_math._silu_tail(g, cpu_math.exp(-g), gu[inter:])
    return x + _left(down_w, a).T


class _Decode:
    """The compiled decode layer pieces for one model, or why it cannot have them."""

    def __init__(self, model, Hq: int, Hkv: int, D: int):
        layers = model.model.layers
        norms = [n for layer in layers for n in (layer.input_layernorm, layer.post_attention_layernorm)]
        eps = {getattr(n, "eps", None) for n in norms}
        self.why = None
        if any(type(n) is not nn.RMSNorm for n in norms) or len(eps) != 1:
            self.why = "norms other than one RMSNorm"
        elif any(hasattr(layer.self_attn, "q_norm") for layer in layers):
            self.why = "per-head q/k norms"
        elif D % 2 or not all(self._rope_matches(layer.self_attn.rope, D) for layer in layers):
            self.why = "a RoPE that is not a plain half-split rotation"
        if self.why is not None:
            return
        (eps,) = eps
        self.eps = eps
        self.rope = layers[0].self_attn.rope
        self.D = D
        self._cos = self._sin = None  # see host_tables
        self.pre = mx.compile(partial(_decode_pre, eps=eps, Hq=Hq, Hkv=Hkv, D=D))
        self.post = mx.compile(partial(_decode_post, eps=eps))

    @staticmethod
    def _rope_matches(rope, D: int) -> bool:
        """Whether ``rope`` rotates the halves of every head by its own cos/sin tables."""
        x = mx.random.normal((2, 3, 1, D), key=mx.random.key(7))
        off = mx.array([3, 1000])
        cos, sin = _tables(rope, off, D)
        want = _rotate(x, cos.T[:, None, None], sin.T[:, None, None], axis=-1)
        try:
            got = rope(x, offset=off)
        except Exception:  # a RoPE without per-row offsets
            return False
        return bool(mx.allclose(got, want, rtol=1e-5, atol=1e-5).item())

    def tables(self, offset, B: int):
        if isinstance(offset, int):
            offset = mx.full((B,), offset, mx.int32)
        cos, sin = _tables(self.rope, offset, self.D)
        return cos[:, :, None], sin[:, :, None]


    def host_tables(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """cos, sin (B, D/2) float32 of each position (B,), rows of host tables of every
        position up to the largest asked for so far, which the model's own RoPE module
        computed in one call (the same values as :meth:`tables`, row by row: RoPE is
        elementwise in the position). A decode step then evaluates no mlx graph for them,
        and each mlx evaluation is a hand-over to mlx's stream thread, which on two busy
        cores waits for one."""
        top = int(positions.max()) + 1
        if self._cos is None or top > self._cos.shape[0]:
            n = max(1024, 1 << (top - 1).bit_length())
            cos, sin = _tables(self.rope, mx.arange(n, dtype=mx.int32), self.D)
            self._cos, self._sin = np.ascontiguousarray(np.array(cos).T), np.ascontiguousarray(np.array(sin).T)
        return self._cos[positions], self._sin[positions]


def _tables(rope, offset: mx.array, D: int):
    """(D/2, B) cos and sin of each row's position, as ``rope`` itself computes them:
    rotating (1, ..., 1, 0, ..., 0) gives cos in the first half and sin in the second."""
    B = offset.shape[0]
    probe = mx.concatenate([mx.ones((D // 2,)), mx.zeros((D // 2,))])
    t = rope(mx.broadcast_to(probe, (B, 1, 1, D)), offset=offset).reshape(B, D)
    return t[:, : D // 2].T, t[:, D // 2 :].T


def _kernel_attention(q: mx.array, k: mx.array, v: mx.array, lens: np.ndarray, scale: float) -> mx.array:
    """q (B, Hq, 1, D); k, v: a layer's whole decode mirror (B, Hkv, cap, D); lens (B,)
    -> (B, Hq, 1, D). Waits for q and the mirror, so the layers before it must have
    run: the kernel reads their memory directly."""
    mx.eval(q, k, v)
    B, Hq, _, D = q.shape
    qh = np.ascontiguousarray(np.asarray(q)).reshape(B, Hq, D)
    # np.asarray shares the mlx buffers (no copy); the views die with this call, so the
    # next step's append can still update the mirror in place.
    o = cpu_kernels.decode_attention(qh, np.asarray(k), np.asarray(v), lens, scale)
    return mx.array(o).reshape(B, Hq, 1, D)


class FastLlama:
    def __init__(self, model, native: bool = True):
        why = supports(model)
        if why is not None:
            raise ValueError(f"FastLlama cannot run this model: {why}")
        self.model = model
        self.inner = model.model
        self.left_below = LEFT_BELOW
        # A packed-only model (the loader made no dense copy): every product goes through
        # the 4-bit kernels, decode as one C step and everything else through the host
        # layers (_layers_blas), blocks of rows expanded into cache-sized buffers for BLAS.
        self.packed = packed_only(model)
        self.fused = self.head = None
        self.head_chunks = []
        if not self.packed:
            self.fused = fused_weights(model)
            self.head = self.inner.embed_tokens.weight if _tied(model) else model.lm_head.weight
            # Row blocks of the vocabulary projection, views of the weight (rows are contiguous).
            n = max(1, -(-self.head.shape[0] // HEAD_CHUNK_ROWS))
            step = -(-self.head.shape[0] // n)
            self.head_chunks = [self.head[i : i + step] for i in range(0, self.head.shape[0], step)]
            # Evaluated here: a lazy slice belongs to this thread's stream, and the engine
            # runs forwards on its own thread.
            mx.eval(self.head_chunks)
        attn = self.inner.layers[0].self_attn
        D = attn.q_proj.weight.shape[0] // attn.n_heads
        self.decode = _Decode(model, attn.n_heads, attn.n_kv_heads, D)
        # Decode attention over the runner's contiguous mirror in one C call per layer
        # (cpu_kernels); otherwise, or where the runner has no mirror, the mlx ops.
        self.decode_kernel = cpu_kernels.available()
        if self.decode_kernel:
            cpu_kernels.threads()  # a bad TANDEM_ATTENTION_THREADS fails here, not mid-step
        # A whole decode step in one C call over the 4-bit weights, where the model was
        # loaded from them (native_decode); None: the compiled mlx pieces below.
        # RoPE and SiLU of prefills (below left_below rows) in C, where the kernels build.
        self.prefill_kernels = q4_kernels.available()
        # The attention of those prefills in C too, on every core (q4_kernels.prefill_attention).
        self.prefill_attention = True
        self._cols = self._starts = None
        # Prefill products (left_below > rows >= BLAS_ROWS_FROM) through numpy's OpenBLAS
        # on the kernels' pool, with the RoPE, attention and SiLU in C between them.
        self.prefill_sgemm = _blas.openblas_sgemm() if self.prefill_kernels else None
        self._np_weights = self._np_head = None
        self.native = None
        self.native_why = "off"
        if native:
            self.native, self.native_why = native_decode.build(model, self.fused, self.head, _tied(model), self.decode)
        if self.packed and (self.native is None or not self.prefill_kernels):
            raise ValueError(f"FastLlama cannot run this packed model: {self.native_why}")

    def disable_native_kernels(self) -> None:
        """Decode and prefill through mlx/MKL only (``engine.native_kernels = false``)."""
        self.native, self.native_why = None, "off (engine.native_kernels)"
        self.decode_kernel = False
        self.prefill_kernels = False
        self.prefill_sgemm = None

    def __call__(self, inputs: mx.array, caches, mask: mx.array | None, max_q_start: int,
                 last: np.ndarray | None) -> mx.array:
        """inputs: (B, L) token ids; caches: one per layer (offset, update_and_fetch);
        mask: additive (B, 1, L, K) or None; last: (B, m) the positions of each row to
        project onto the vocabulary (None: position 0, a decode) -> logits (B * m, V),
        row by row."""
        B, L = inputs.shape
        if last is not None:
            last = np.asarray(last).reshape(B, -1)  # (B,): one position a row
        blas = False
        if (L == 1 and self.native is not None and (B <= native_decode.MAX_ROWS or self.packed)
                and hasattr(caches[0], "native_mirror")):
            mirror = caches[0].native_mirror()
            if mirror is not None:
                return self.native.step(inputs, mirror)
        x = self.inner.embed_tokens(inputs).reshape(B * L, -1)
        if L == 1 and B < self.left_below and self.decode.why is None and not self.packed:
            x = self._decode_layers(x, caches, mask, max_q_start)
        else:
            self._cols = self._starts = None
            if self.prefill_kernels and self.decode.why is None:
                # Position tables of every token column, once per forward, for the C RoPE.
                off = caches[0].offset
                off = mx.full((B,), off, mx.int32) if isinstance(off, int) else off
                # Each row's first position, for the C attention (the mask is the causal
                # one from these offsets: additive_mask(offsets, L, K)).
                self._starts = np.array(off, np.int32).reshape(B) if self.prefill_attention else None
                # Host layers (token columns at any size) from BLAS_ROWS_FROM rows
                blas = self.packed or (self._starts is not None and self.prefill_sgemm is not None
                                       and B * L >= BLAS_ROWS_FROM
                                       and not hasattr(self.inner.layers[0].self_attn, "q_norm"))
                pos = (off[:, None] + mx.arange(L)[None, :]).reshape(-1)
                cos, sin = _tables(self.decode.rope, pos, self.decode.D)
                if B * L >= self.left_below and not blas:  # token rows: tables (tokens, D/2)
                    cos, sin = cos.T, sin.T
                self._cols = (np.ascontiguousarray(np.array(cos)), np.ascontiguousarray(np.array(sin)))
            if blas:
                x = self._layers_blas(x, caches, B, L, last)
            else:
                for layer, cache, (qkv_w, qkv_b, gu_w) in zip(self.inner.layers, caches, self.fused.layers):
                    x = self._layer(layer, cache, x, B, L, qkv_w, qkv_b, gu_w, mask, max_q_start)
        if x.shape[0] != B and not blas:  # every token's hidden state: keep the wanted ones
            x = x.reshape(B, L, -1)
            x = x[:, 0] if last is None else x[mx.arange(B)[:, None], mx.array(last)].reshape(-1, x.shape[-1])
        h = self.inner.norm(x)
        if blas:
            return mx.array(self._head_host(np.asarray(h)))
        B = h.shape[0]
        if B >= self.left_below:
            return h @ self.head.T
        if _padded(B) < HEAD_CHUNK_FROM:
            return _left(self.head, h.T).T
        return mx.concatenate([_left(w, h.T) for w in self.head_chunks]).T

    def _decode_layers(self, x, caches, mask, max_q_start) -> mx.array:
        """Every layer of a decode step, through the compiled pieces -> hidden (B, hidden)."""
        dec = self.decode
        cos, sin = dec.tables(caches[0].offset, x.shape[0])
        kernel = self.decode_kernel and hasattr(caches[0], "mirror_kv")
        for layer, cache, (qkv_w, qkv_b, gu_w) in zip(self.inner.layers, caches, self.fused.layers):
            attn = layer.self_attn
            q, k, v = dec.pre(x, layer.input_layernorm.weight, qkv_w, qkv_b, cos, sin)
            mirror = cache.mirror_kv(k, v) if kernel else None
            if mirror is not None:
                o = _kernel_attention(q, *mirror, attn.scale)
            else:
                k, v = cache.update_and_fetch(k, v)
                o = cpu_math.attention(q, k, v, attn.scale, mask, max_q_start)
            x = dec.post(x, o, attn.o_proj.weight, layer.post_attention_layernorm.weight, gu_w,
                         layer.mlp.down_proj.weight)
        return x

    def _head_host(self, h: np.ndarray) -> np.ndarray:
        """The vocabulary projection of a host prefill's last rows h (B, hidden) -> (B, V),
        on the kernels' pool: through the decode step's packed vocabulary matrix (the same
        values, half the bytes) where there is one, else OpenBLAS. Not MKL: its OpenMP
        threads spin for 200 ms after a call (KMP_BLOCKTIME) and took a core from the
        next prefill's pool threads (a 4 x 154-token prefill right after another: min
        758-776 ms with KMP_BLOCKTIME=0 against 777-827 without)."""
        if self.native is not None:
            return self.native.head.matmul(h)
        if self._np_head is None:
            self._np_head = np.asarray(self.head)
        return np.ascontiguousarray(q4_kernels.blas_rows(self.prefill_sgemm, self._np_head,
                                                         np.ascontiguousarray(h, np.float32), True).T)

    def _host_weights(self, i: int) -> tuple[np.ndarray, ...]:
        """Layer i's QKV, output, gate/up and down weights, QKV bias (or None) and norm
        weights as numpy views of the mlx arrays (no copies; made on first use)."""
        if self._np_weights is None and self.packed:
            nat = self.native
            self._np_weights = [
                (*nat.mats[4 * j : 4 * j + 4], None if nat._norms[3 * j] is None else nat._norms[3 * j][:, None],
                 nat._norms[3 * j + 1], nat._norms[3 * j + 2]) for j in range(len(self.inner.layers))]
        if self._np_weights is None:
            self._np_weights = [
                tuple(None if w is None else np.asarray(w) for w in (
                    qkv_w, layer.self_attn.o_proj.weight, gu_w, layer.mlp.down_proj.weight, qkv_b,
                    layer.input_layernorm.weight, layer.post_attention_layernorm.weight))
                for layer, (qkv_w, qkv_b, gu_w) in zip(self.inner.layers, self.fused.layers)]
            assert all(w is None or w.flags.c_contiguous for ws in self._np_weights for w in ws)
        return self._np_weights[i]

    def _layers_blas(self, x: mx.array, caches, B: int, L: int, last: np.ndarray | None) -> mx.array:
        """Every layer of a prefill on the host, token columns, the products through
        OpenBLAS on the kernels' pool and everything else in C; only the KV cache is
        mlx's. x (B*L, hidden) embedded tokens -> (B * m, hidden) hidden states of each
        row's ``last`` (B, m) tokens (position 0 without it)."""
        xc = np.ascontiguousarray(np.asarray(x.astype(mx.float32)).T)  # the residual stream, (hidden, B*L)
        for i, (layer, cache) in enumerate(zip(self.inner.layers, caches)):
            self._layer_blas(layer, cache, xc, B, L, self._host_weights(i))
        pick = np.arange(B)[:, None] * L + (np.zeros((B, 1), np.int64) if last is None else np.asarray(last, np.int64))
        return mx.array(np.ascontiguousarray(xc[:, pick.reshape(-1)].T))

    def _layer_blas(self, layer, cache, xc: np.ndarray, B: int, L: int, weights) -> None:
        """One layer over the residual stream xc (hidden, B*L), updated in place: the
        products add straight into it (sgemm's beta = 1)."""
        attn = layer.self_attn
        Hq, Hkv = attn.n_heads, attn.n_kv_heads
        qkv_w, o_w, gu_w, down_w, qkv_b, ln1, ln2 = weights
        D = qkv_w.shape[0] // (Hq + 2 * Hkv)
        eps, mul = self.decode.eps, self._product
        qkv = mul(qkv_w, q4_kernels.rms_norm_cols(xc, ln1, eps))  # (features, B*L)
        if qkv_b is not None:
            qkv += qkv_b
        q4_kernels.rope_cols(qkv, Hq + Hkv, D, *self._cols)
        host = getattr(cache, "prefill_kv_host", None)
        kv = host(qkv[Hq * D : (Hq + Hkv) * D], qkv[(Hq + Hkv) * D :], self._starts, L) if host else None
        if kv is None:  # through mlx: another cache (mlx-lm's), or a pool the C code cannot write
            kv = mx.array(qkv[Hq * D :])
            k = kv[: Hkv * D].reshape(Hkv, D, B, L).transpose(2, 0, 3, 1)  # (B, Hkv, L, D)
            v = kv[Hkv * D :].reshape(Hkv, D, B, L).transpose(2, 0, 3, 1)
            k, v = cache.update_and_fetch(mx.contiguous(k), mx.contiguous(v))
            kv = np.ascontiguousarray(np.asarray(k)), np.ascontiguousarray(np.asarray(v))
        o = q4_kernels.prefill_attention(qkv[: Hq * D], *kv, self._starts, L, float(attn.scale),
                                         columns=True)  # (Hq*D, B*L)
        mul(o_w, o, add_to=xc)
        gu = mul(gu_w, q4_kernels.rms_norm_cols(xc, ln2, eps))
        mul(down_w, q4_kernels.silu_rows(gu), add_to=xc)

    def _product(self, w, x: np.ndarray, add_to: np.ndarray | None = None) -> np.ndarray:
        """w @ x for x (k, m) token columns -> (n, m), added into ``add_to`` where given.
        A dense w goes to OpenBLAS as is. A packed w (Q4Matrix) is multiplied from its codes
        below BLAS_ROWS_FROM columns (what the decode step does for that many rows), and
        from there by OpenBLAS a block of rows at a time, each expanded into a cache-sized
        buffer of the thread just before (q4_kernels.blas_rows): the same values as the
        dense weights, so the same products, without a dense copy of the model resident."""
        if isinstance(w, np.ndarray) or (x.shape[1] >= BLAS_ROWS_FROM and self.prefill_sgemm is not None):
            return q4_kernels.blas_rows(self.prefill_sgemm, w, x, False, add_to)
        y = w.matmul(np.ascontiguousarray(x.T)).T  # (n, m)
        if add_to is None:
            return np.ascontiguousarray(y)
        add_to += y
        return add_to

    def _layer(self, layer, cache, x, B, L, qkv_w, qkv_b, gu_w, mask, max_q_start):
        attn, mlp = layer.self_attn, layer.mlp
        Hq, Hkv = attn.n_heads, attn.n_kv_heads
        D = qkv_w.shape[0] // (Hq + 2 * Hkv)
        left = B * L < self.left_below
        h = layer.input_layernorm(x)
        cols = self._cols
        qkv_np = None  # the features on the host after the C RoPE, for the C attention
        if left:
            qkv = _left(qkv_w, h.T)  # (features, B*L)
            if qkv_b is not None:
                qkv = qkv + qkv_b
            if cols is not None:  # RoPE in C over the token columns (mlx's costs ~4.5 ns per value)
                qkv_np = q4_kernels.rope_cols(np.array(qkv), Hq + Hkv, D, *cols)
                qkv = mx.array(qkv_np)
            q = qkv[: Hq * D].reshape(Hq, D, B, L).transpose(2, 0, 3, 1)  # (B, Hq, L, D)
            k = qkv[Hq * D : (Hq + Hkv) * D].reshape(Hkv, D, B, L).transpose(2, 0, 3, 1)
            v = qkv[(Hq + Hkv) * D :].reshape(Hkv, D, B, L).transpose(2, 0, 3, 1)
        else:
            qkv = h @ qkv_w.T  # (B*L, features)
            if qkv_b is not None:
                qkv = qkv + qkv_b[:, 0]
            if cols is not None:
                qkv_np = q4_kernels.rope_rows(np.array(qkv), Hq + Hkv, D, *cols)
                qkv = mx.array(qkv_np)
            q = qkv[:, : Hq * D].reshape(B, L, Hq, D).transpose(0, 2, 1, 3)
            k = qkv[:, Hq * D : (Hq + Hkv) * D].reshape(B, L, Hkv, D).transpose(0, 2, 1, 3)
            v = qkv[:, (Hq + Hkv) * D :].reshape(B, L, Hkv, D).transpose(0, 2, 1, 3)
        if hasattr(attn, "q_norm"):  # qwen3 normalizes each head before RoPE
            q = attn.q_norm(q)
            k = attn.k_norm(k)
        if cols is None:
            q = attn.rope(q, offset=cache.offset)
            k = attn.rope(k, offset=cache.offset)
        k, v = cache.update_and_fetch(mx.contiguous(k), mx.contiguous(v))
        if qkv_np is not None and self._starts is not None:
            # In C on both cores, in the features' own layout (mlx's ran on one: ~200 of
            # a 1,300 ms 4 x 170-token prefill)
            qf = qkv_np[: Hq * D] if left else np.ascontiguousarray(qkv_np[:, : Hq * D])
            o = mx.array(q4_kernels.prefill_attention(qf, np.ascontiguousarray(np.asarray(k)),
                                                      np.ascontiguousarray(np.asarray(v)), self._starts, L,
                                                      float(attn.scale), columns=left))
            ot = o if left else None  # (Hq*D, B*L) in token columns, else (B*L, Hq*D)
        else:
            o = cpu_math.attention(q, k, v, attn.scale, mask, max_q_start)  # (B, Hq, L, D)
            o = o.transpose(0, 2, 1, 3).reshape(B * L, Hq * D)
            ot = o.T
        h = layer.post_attention_layernorm
        if left:
            x = x + _left(attn.o_proj.weight, ot).T
            gu = _left(gu_w, h(x).T)  # (2 * hidden, B*L): gate rows then up rows
            inter = gu.shape[0] // 2
            if cols is not None:  # in C: mlx's exp, even the cheap one, costs ~3 ns per value
                a = mx.array(q4_kernels.silu_rows(np.array(gu)))
            else:
                a = cpu_math.silu_mul(gu[:inter], gu[inter:])
            return x + _left(mlp.down_proj.weight, a).T
        x = x + o @ attn.o_proj.weight.T
        gu = h(x) @ gu_w.T
        inter = gu.shape[1] // 2
        if cols is not None:
            a = mx.array(q4_kernels.silu_cols(np.array(gu)))
        else:
            a = cpu_math.silu_mul(gu[:, :inter], gu[:, inter:])
        return x + a @ mlp.down_proj.weight.T
