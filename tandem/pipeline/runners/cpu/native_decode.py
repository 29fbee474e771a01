"""A llama-family model's decode step as one C call over its 4-bit weights.

:class:`NativeDecode` gathers, for a model the loader dequantized from 4-bit affine
weights (it keeps the packed codes as ``model._tandem_packed``), the packed form of
every projection in :class:`~tandem.pipeline.runners.cpu.fast_llama.FastLlama`'s fused layout (Q/K/V
and gate/up stacked by rows) and of the vocabulary projection. Before anything runs on
them it expands each packed matrix with the kernel's own code and requires it to equal
the dense fp32 weight the model holds, bit for bit; a model that fails this (other
quantization, a bf16 scale, weights changed after loading) keeps the mlx/MKL path.

A step then costs one C call (:func:`q4_kernels.decode_step`) and the copy of the
logits into mlx; the embedding rows (of a tied vocabulary matrix, expanded from its codes)
and the RoPE tables (``_Decode.host_tables``) come from the host, so a step evaluates no
mlx graph: each evaluation hands work to mlx's stream thread, and on two cores that the
step's own threads, the worker's IO thread, the broker and the edge share, the hand-over
waited for a core.
"""

from __future__ import annotations

import logging

import mlx.core as mx
import numpy as np

from tandem.kernels.cpu import q4_kernels

log = logging.getLogger("tandem.engine")

# Decode batches of at most this many rows take the 4-bit step. Up to 32 rows it was
# measured faster than MKL on the dense weights (docs/cpu-performance.md).
MAX_ROWS = 64

# Rows of each matrix of a packed-only model checked against mlx's dequantization.
CHECK_ROWS = 256

# The fp16 value table (Q4Matrix's lut) doubles a 4-bit matrix's resident bytes (1 more
# byte a weight) for a faster expansion; models with more layer weights than this go
# without it, so a 4-bit 8B model stays resident at ~0.75 bytes a weight.
TABLE_MAX_WEIGHTS = 1 << 30


def _weights(model) -> int:
    """The number of weights in the model's layer projections."""
    n = 0
    for layer in model.model.layers:
        for lin in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj, layer.self_attn.o_proj,
                    layer.mlp.gate_proj, layer.mlp.up_proj, layer.mlp.down_proj):
            n += lin.weight.size * (32 // lin.bits if hasattr(lin, "bits") else 1)
    return n


class NativeDecode:
    def __init__(self, model, fused, head: mx.array, tied: bool, decode, Hq: int, Hkv: int, D: int):
        packed = getattr(model, "_tandem_packed", None)
        if not packed:
            raise ValueError("the model was not loaded from 4-bit weights")
        inner = model.model

        table = _weights(model) <= TABLE_MAX_WEIGHTS
        # A packed-only model (loader.PackedModules) has no dense weights: each matrix is
        # checked against mlx's dequantization of its own module, on CHECK_ROWS rows spread
        # over it (a layout or rounding mismatch shows in every row; all rows of an 8B model
        # cost minutes of startup and a dense matrix's memory each).
        only = packed if fused is None else None

        def mat(name: str) -> q4_kernels.Q4Matrix:
            if name not in packed:
                raise ValueError(f"no 4-bit weights for {name}")
            w, s, b, gs, fp16 = packed[name]
            m = q4_kernels.Q4Matrix.from_mlx(w, s, b, gs, fp16, table=table)
            if only is not None:
                rows = np.unique(np.linspace(0, m.n - 1, min(m.n, CHECK_ROWS)).astype(np.int64))
                part = q4_kernels.Q4Matrix(m.nib[rows], m.dm[rows], m.round16, m.bits, table=m.lut is not None)
                if not np.array_equal(part.expand(), np.asarray(only.dense(name, rows))):
                    raise ValueError(f"the 4-bit weights of {name} do not expand to mlx's dequantized values")
            return m

        def checked(m: q4_kernels.Q4Matrix, dense, name: str, parts: tuple[str, ...]) -> q4_kernels.Q4Matrix:
            if only is not None:  # checked in mat()
                return m
            mx.eval(dense)
            if dense.shape != (m.n, m.k) or not np.array_equal(m.expand(), np.asarray(dense)):
                raise ValueError(f"the 4-bit weights of {name} do not expand to its dense weights")
            return m

        def stacked(names: list[str], dense, name: str) -> q4_kernels.Q4Matrix:
            return checked(q4_kernels.Q4Matrix.stack([mat(n) for n in names], table=table), dense, name, tuple(names))

        self.mats: list[q4_kernels.Q4Matrix] = []  # kept alive: the C structs point into them
        layers = []
        self._norms = []
        for i, layer in enumerate(inner.layers):
            attn, mlp = layer.self_attn, layer.mlp
            qkv_w, qkv_b, gu_w = fused.layers[i] if fused is not None else (None, None, None)
            if fused is None and "bias" in attn.q_proj:
                qkv_b = mx.concatenate([attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias])
            p = f"model.layers.{i}."
            qkv = stacked([p + f"self_attn.{n}_proj" for n in "qkv"], qkv_w, p + "qkv")
            o = stacked([p + "self_attn.o_proj"], None if fused is None else attn.o_proj.weight, p + "o_proj")
            gu = stacked([p + "mlp.gate_proj", p + "mlp.up_proj"], gu_w, p + "gate_up")
            down = stacked([p + "mlp.down_proj"], None if fused is None else mlp.down_proj.weight, p + "down_proj")
            bias = None if qkv_b is None else np.ascontiguousarray(np.array(qkv_b.astype(mx.float32)).reshape(-1))
            ln1 = np.ascontiguousarray(np.array(layer.input_layernorm.weight), np.float32)
            ln2 = np.ascontiguousarray(np.array(layer.post_attention_layernorm.weight), np.float32)
            self.mats += [qkv, o, gu, down]
            self._norms += [bias, ln1, ln2]
            layers.append(q4_kernels.layer_struct(qkv, o, gu, down, bias, ln1, ln2))
        self.layers = q4_kernels.layers_array(layers)
        head_name = "model.embed_tokens" if tied else "lm_head"
        self.head = stacked([head_name], head, "the vocabulary projection")
        self.norm_w = np.ascontiguousarray(np.array(inner.norm.weight), np.float32)
        self.embed = inner.embed_tokens
        self.tables = decode.host_tables
        self.packed_only = fused is None
        self.eps = float(decode.eps)
        self.scale = float(inner.layers[0].self_attn.scale)
        self.dims = (int(self.norm_w.shape[0]), Hq, Hkv, D, gu.n // 2)
        # A tied vocabulary matrix holds the embedding's values too (checked above against
        # the dense or dequantized head): its rows are the step's inputs, expanded on the
        # host, where they equal mlx's embedding (checked here on a spread of ids).
        self.embed_host = False
        if tied:
            ids = np.unique(np.linspace(0, self.head.n - 1, 64).astype(np.int32))
            want = np.array(self.embed(mx.array(ids)).astype(mx.float32))
            self.embed_host = bool(np.array_equal(self.head.rows(ids), want))
        mx.clear_cache()  # the checks' transient mlx arrays
        if qkv.n != (Hq + 2 * Hkv) * D:
            raise ValueError("value heads of another size than the query and key heads")

    def step(self, inputs, mirror, positions: np.ndarray | None = None, kvrow: np.ndarray | None = None) -> mx.array:
        """inputs (B, 1) token ids (mlx or numpy); mirror: what ``native_mirror()``
        returned, (``q4_kernels.HostMirror``, lens (B,), cap); positions (B,): each row's
        position (None: lens - 1) -> logits (B, vocab). ``kvrow``: see
        ``q4_kernels.decode_step``."""
        host, lens, cap = mirror
        B = inputs.shape[0]
        if self.embed_host:
            x = self.head.rows(np.asarray(inputs).reshape(B))
        else:
            ids = mx.array(inputs) if isinstance(inputs, np.ndarray) else inputs  # mlx cannot index by numpy
            x = np.array(self.embed(ids).reshape(B, -1).astype(mx.float32))
        c, s = self.tables(lens - 1 if positions is None else positions)
        logits = q4_kernels.decode_step(self.layers, self.head, self.norm_w, x, self.dims, c, s, host,
                                        lens, cap, self.eps, self.scale, kvrow)
        return mx.array(logits)


def build(model, fused, head, tied: bool, decode) -> tuple[NativeDecode | None, str | None]:
    """The model's native decode (shared by every runner on it), or None and why not."""
    if decode.why is not None:
        return None, decode.why
    if not getattr(model, "_tandem_packed", None):
        return None, "the model was not loaded from 4-bit weights"
    if not q4_kernels.available():
        return None, f"no 4-bit kernels: {q4_kernels.why_not()}"
    cached = getattr(model, "_tandem_native", None)
    if cached is not None:
        return cached
    attn = model.model.layers[0].self_attn
    try:
        native = NativeDecode(model, fused, head, tied, decode, attn.n_heads, attn.n_kv_heads, decode.D)
        result = (native, None)
    except ValueError as e:
        result = (None, str(e))
    model._tandem_native = result
    if result[1]:
        log.info("decode stays on the mlx/MKL path: %s", result[1])
    return result
