"""Exponentials, SiLU and attention built from cheap mlx ops, for the CPU backend.

The ``mlx[cpu]`` wheel computes ``exp`` (and so ``sigmoid``, ``softmax`` and SiLU) one
element at a time, calling libm's ``fmaf`` for each step of its polynomial: about 12 ns
per element on the development machines, against 0.3 ns for a multiply. At a 512-token
prefill that made the softmax of attention and the SiLU of the MLP cost more than all
the matmuls together (docs/cpu-performance.md). :func:`exp` here is the same range
reduction (``2**n * 2**f``) written as multiplies and adds that ``mx.compile`` fuses into
one loop, with ``2**n`` assembled in the exponent bits: about 3x faster, relative error
below 1e-6 on the range softmax and SiLU use.

:func:`attention` is what ``mx.fast.scaled_dot_product_attention`` falls back to on the
CPU, with three differences: the softmax uses :func:`exp`, the mask is additive (a
boolean mask costs a ``where`` at about 5 ns per score), and a long block of queries
is split so that each part multiplies only the keys its causal mask can let through
(about 40% fewer scores at 512 tokens).
"""

from __future__ import annotations

import math
from functools import partial

import mlx.core as mx

_LOG2E = 1.4426950408889634
# Adding 1.5 * 2**23 rounds a float of magnitude < 2**22 to an integer, which then sits
# in the low mantissa bits of the sum; subtracting it again gives the rounded value.
_ROUND = 12582912.0
_ROUND_BITS = 0x4B400000  # the bit pattern of _ROUND
# Taylor coefficients of 2**f = e**(f ln 2); on |f| <= 1/2 degree 7 is within 1e-7.
_COEFFS = [math.log(2) ** k / math.factorial(k) for k in range(8)]


def _mantissa(x: mx.array) -> tuple[mx.array, mx.array]:
    y = mx.clip(x * _LOG2E, -126.0, 127.0)  # 2**n stays a normal float
    t = y + _ROUND
    f = y - (t - _ROUND)  # in [-1/2, 1/2]
    p = _COEFFS[-1]
    for c in reversed(_COEFFS[:-1]):
        p = p * f + c
    return p, t


# Below this many elements the few dispatches of the compiled pieces (about 25 us)
# cost more than mlx's slow exp saves.
SMALL = 16384

_mantissa_c = mx.compile(_mantissa, shapeless=True)


@partial(mx.compile, shapeless=True)
def _scale_bits(t: mx.array) -> mx.array:
    return mx.left_shift(t - (_ROUND_BITS - 127), 23)


def exp(x: mx.array) -> mx.array:
    """float32 ``e**x``; inputs below -87 give about 1e-38 instead of denormals or 0."""
    p, t = _mantissa_c(x)
    return p * _scale_bits(t.view(mx.int32)).view(mx.float32)


@partial(mx.compile, shapeless=True)
def _silu_tail(g: mx.array, e: mx.array, u: mx.array) -> mx.array:
    return g * mx.reciprocal(1.0 + e) * u


def silu_mul(gate: mx.array, up: mx.array) -> mx.array:
    """``silu(gate) * up`` (the SwiGLU of llama-family MLPs)."""
    if gate.size < SMALL:
        return gate * mx.sigmoid(gate) * up
    return _silu_tail(gate, exp(-gate), up)


def softmax(s: mx.array) -> mx.array:
    """Softmax over the last axis (float32)."""
    if s.size < SMALL:
        return mx.softmax(s, axis=-1)
    e = exp(s - mx.max(s, axis=-1, keepdims=True))
    return e * mx.reciprocal(mx.sum(e, axis=-1, keepdims=True))


def additive_mask(q_start, num_queries: int, num_keys: int, context_lens=None):
    """Host-side ``(B, 1, L, K)`` float32 mask, 0 where visible and -inf elsewhere: query
    ``i`` of row ``b`` (position ``q_start[b] + i``) sees keys at positions up to its own,
    and below ``context_lens[b]`` when given."""
    import numpy as np

    q_start = np.asarray(q_start, np.int64)
    k = np.arange(num_keys)[None, None, :]
    visible = k <= (q_start[:, None] + np.arange(num_queries)[None, :])[:, :, None]
    if context_lens is not None:
        visible &= k < np.asarray(context_lens)[:, None, None]
    return mx.array(np.where(visible, np.float32(0), np.float32(-np.inf))[:, None])


def attention(q: mx.array, k: mx.array, v: mx.array, scale: float, mask: mx.array | None = None,
              max_q_start: int = 0, block: int = 128) -> mx.array:
    """q: (B, Hq, L, D); k, v: (B, Hkv, K, D) with Hq a multiple of Hkv (query head ``h``
    reads kv head ``h // (Hq // Hkv)``); mask: additive (B, 1, L, K) or None. Query ``i``
    of every row sits at most at key position ``max_q_start + i`` (what lets a block of
    queries skip the keys after it) -> (B, Hq, L, D)."""
    L, K = q.shape[2], k.shape[2]
    if L <= block:
        return _attend(q, k, v, scale, mask)
    parts = []
    for i in range(0, L, block):
        e = min(L, i + block)
        lim = min(K, max_q_start + e)
        m = None if mask is None else mask[:, :, i:e, :lim]
        parts.append(_attend(q[:, :, i:e], k[:, :, :lim], v[:, :, :lim], scale, m))
    return mx.concatenate(parts, axis=2)


def _attend(q, k, v, scale, mask):
    B, Hq, L, D = q.shape
    Hkv, K = k.shape[1], k.shape[2]
    rep = Hq // Hkv
    if L == 1:
        # One query: a matrix-vector product per (row, query head) is faster than a
        # 3-row matrix product per (row, kv head) in MKL (25% less time for attention).
        qh = (q * scale).reshape(B, Hkv, rep, 1, D)
        s = qh @ k[:, :, None].swapaxes(-1, -2)  # (B, Hkv, rep, 1, K)
        if mask is not None:
            s = s + mask[:, :, None]
        return (softmax(s) @ v[:, :, None]).reshape(B, Hq, 1, v.shape[-1])
    # The query heads of one kv head become one matrix: one matmul per (row, kv head).
    qg = (q * scale).reshape(B, Hkv, rep * L, D)
    s = qg @ k.swapaxes(-1, -2)
    if mask is not None:
        s = (s.reshape(B, Hkv, rep, L, K) + mask[:, :, None]).reshape(B, Hkv, rep * L, K)
    return (softmax(s) @ v).reshape(B, Hq, L, v.shape[-1])
