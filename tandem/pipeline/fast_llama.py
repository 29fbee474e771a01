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

The model object is otherwise untouched; :func:`supports` says why a model cannot take
this path, and then the runner uses mlx-lm's own forward.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from tandem.pipeline import cpu_math

# Rows (batch x tokens) below which a projection runs as W @ x.T rather than x @ W.T
# (at 2,048 rows MKL packs the weights better than the activations again).
LEFT_BELOW = 1024

_FAMILIES = ("mlx_lm.models.llama", "mlx_lm.models.qwen2", "mlx_lm.models.qwen3")


def supports(model) -> str | None:
    """None if :class:`FastLlama` can run ``model``, else why not."""
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


class FastLlama:
    def __init__(self, model):
        why = supports(model)
        if why is not None:
            raise ValueError(f"FastLlama cannot run this model: {why}")
        self.model = model
        self.inner = model.model
        self.fused = fused_weights(model)
        self.head = self.inner.embed_tokens.weight if _tied(model) else model.lm_head.weight
        self.left_below = LEFT_BELOW

    def __call__(self, inputs: mx.array, caches, mask: mx.array | None, max_q_start: int,
                 last: mx.array | None) -> mx.array:
        """inputs: (B, L) token ids; caches: one per layer (offset, update_and_fetch);
        mask: additive (B, 1, L, K) or None; last: (B,) index of each row's position to
        project onto the vocabulary (None: position 0, a decode) -> logits (B, V)."""
        B, L = inputs.shape
        x = self.inner.embed_tokens(inputs).reshape(B * L, -1)
        for layer, cache, (qkv_w, qkv_b, gu_w) in zip(self.inner.layers, caches, self.fused.layers):
            x = self._layer(layer, cache, x, B, L, qkv_w, qkv_b, gu_w, mask, max_q_start)
        x = x.reshape(B, L, -1)
        x = x[:, 0] if last is None else x[mx.arange(B), last]
        h = self.inner.norm(x)
        return _left(self.head, h.T).T if B < self.left_below else h @ self.head.T

    def _layer(self, layer, cache, x, B, L, qkv_w, qkv_b, gu_w, mask, max_q_start):
        attn, mlp = layer.self_attn, layer.mlp
        Hq, Hkv = attn.n_heads, attn.n_kv_heads
        D = qkv_w.shape[0] // (Hq + 2 * Hkv)
        left = B * L < self.left_below
        h = layer.input_layernorm(x)
        if left:
            qkv = _left(qkv_w, h.T)  # (features, B*L)
            if qkv_b is not None:
                qkv = qkv + qkv_b
            q = qkv[: Hq * D].reshape(Hq, D, B, L).transpose(2, 0, 3, 1)  # (B, Hq, L, D)
            k = qkv[Hq * D : (Hq + Hkv) * D].reshape(Hkv, D, B, L).transpose(2, 0, 3, 1)
            v = qkv[(Hq + Hkv) * D :].reshape(Hkv, D, B, L).transpose(2, 0, 3, 1)
        else:
            qkv = h @ qkv_w.T  # (B*L, features)
            if qkv_b is not None:
                qkv = qkv + qkv_b[:, 0]
            q = qkv[:, : Hq * D].reshape(B, L, Hq, D).transpose(0, 2, 1, 3)
            k = qkv[:, Hq * D : (Hq + Hkv) * D].reshape(B, L, Hkv, D).transpose(0, 2, 1, 3)
            v = qkv[:, (Hq + Hkv) * D :].reshape(B, L, Hkv, D).transpose(0, 2, 1, 3)
        if hasattr(attn, "q_norm"):  # qwen3 normalizes each head before RoPE
            q = attn.q_norm(q)
            k = attn.k_norm(k)
        q = attn.rope(q, offset=cache.offset)
        k = attn.rope(k, offset=cache.offset)
        k, v = cache.update_and_fetch(mx.contiguous(k), mx.contiguous(v))
        o = cpu_math.attention(q, k, v, attn.scale, mask, max_q_start)  # (B, Hq, L, D)
        o = o.transpose(0, 2, 1, 3).reshape(B * L, Hq * D)
        h = layer.post_attention_layernorm
        if left:
            x = x + _left(attn.o_proj.weight, o.T).T
            gu = _left(gu_w, h(x).T)  # (2 * hidden, B*L): gate rows then up rows
            inter = gu.shape[0] // 2
            a = cpu_math.silu_mul(gu[:inter], gu[inter:])
            return x + _left(mlp.down_proj.weight, a).T
        x = x + o @ attn.o_proj.weight.T
        gu = h(x) @ gu_w.T
        inter = gu.shape[1] // 2
        a = cpu_math.silu_mul(gu[:, :inter], gu[:, inter:])
        return x + a @ mlp.down_proj.weight.T
