"""RoPE and the in-place KV write of a decode or prefill step's new tokens, on CUDA.

``write_kv_rope`` splits a fused QKV projection, applies RoPE to queries and keys, writes
keys and values into their pool slots in place (the pool layout of
``tandem.kernels.cuda.paged_attention_cuda``), and returns the rotated queries (and keys, for
prefill attention). It mutates its pool inputs, which MLX does not know about: call it
only on pool arrays that nothing else holds a lazy reference to, and read the pools only
through ops that depend on its outputs (the attention kernel takes its rotated queries,
which orders the two).
"""

from __future__ import annotations

import functools

import mlx.core as mx

from tandem.kernels.cuda import kernel_files
from tandem.kernels.cuda.paged_attention_cuda import HEADER, i32

# Template: T, H, KVH, D, ROPE, TRAD, HPT (heads per thread).
# Inputs: qkv (N, (H + 2*KVH) * D), pos (N,) int32, slots (N,) int32 (<0: skip),
# inv_freq (D/2,) float32, k_pool, v_pool (S, KVH, D). Outputs: q (N, H, D), k (N, KVH, D).
# One thread per (token, rotation pair, group of HPT heads): the angle's sincos, which
# must be the exact one (angles reach 1e5 rad), is computed once for HPT heads. One
# thread per head (before) made the batch-64 write 41 us on the H200, sincos-bound.
_WRITE_SOURCE = r"""
  constexpr int HALF_D = D / 2;
  constexpr int HEADS = H + 2 * KVH;
  constexpr int NGRP = (HEADS + HPT - 1) / HPT;
  const size_t gid = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
  const int n_tok = qkv_shape[0];
  if (gid >= (size_t)n_tok * NGRP * HALF_D) return;
  const int i = gid % HALF_D;
  const int grp = (gid / HALF_D) % NGRP;
  const int n = gid / ((size_t)HALF_D * NGRP);
  const int i0 = TRAD ? 2 * i : i;
  const int i1 = TRAD ? 2 * i + 1 : i + HALF_D;
  const int h0 = grp * HPT;
  float sn = 0.f, cs = 1.f;
  if (ROPE && h0 < H + KVH) sincosf((float)pos[n] * inv_freq[i], &sn, &cs);
  const int s = slots[n];
#pragma unroll
  for (int j = 0; j < HPT; ++j) {
    const int hd = h0 + j;
    if (hd >= HEADS) break;
    const T* src = qkv + ((size_t)n * HEADS + hd) * D;
    float a = pa_f(src[i0]), c = pa_f(src[i1]);
    if (ROPE && hd < H + KVH) {
      const float ra = a * cs - c * sn;
      const float rc = a * sn + c * cs;
      a = ra; c = rc;
    }
    if (hd < H) {
      T* dst = q_out + ((size_t)n * H + hd) * D;
      pa_st(dst + i0, a); pa_st(dst + i1, c);
    } else if (hd < H + KVH) {
      const int kh = hd - H;
      T* kd = k_out + ((size_t)n * KVH + kh) * D;
      pa_st(kd + i0, a); pa_st(kd + i1, c);
      if (s >= 0) {
        T* dst = const_cast<T*>(k_pool) + ((size_t)s * KVH + kh) * D;
        pa_st(dst + i0, a); pa_st(dst + i1, c);
      }
    } else if (s >= 0) {
      const int vh = hd - H - KVH;
      T* dst = const_cast<T*>(v_pool) + ((size_t)s * KVH + vh) * D;
      pa_st(dst + i0, a); pa_st(dst + i1, c);
    }
  }
"""

WRITE_HEADS_PER_THREAD = 8
"""Heads per thread of the RoPE + write kernel: 8 beat 1 by 8% in the engine at batch 64."""


@functools.cache
def _write_kernel():
    # Not ensure_row_contiguous: a contiguity copy of a pool would swallow the writes.
    return kernel_files.cuda_kernel(
        name="tandem_write_kv_rope",
        input_names=["qkv", "pos", "slots", "inv_freq", "k_pool", "v_pool"],
        output_names=["q_out", "k_out"],
        source=_WRITE_SOURCE,
        header=HEADER,
        ensure_row_contiguous=False,
    )


def rope_inv_freq(rope, head_dim: int) -> mx.array:
    """Per-pair inverse frequencies (D/2,) float32 equal to what an mlx-lm RoPE module uses.

    Llama-3 style modules carry ``_freqs`` (wavelength-like periods: angle = pos / f);
    ``nn.RoPE`` carries ``base`` and ``scale`` (angle = pos * scale * base^(-2i/dims)).
    """
    dims = getattr(rope, "dims", head_dim)
    if dims != head_dim:
        raise ValueError(f"partial RoPE ({dims} of {head_dim} dims) is not supported")
    freqs = getattr(rope, "_freqs", None)
    if freqs is not None:
        return (1.0 / freqs.astype(mx.float32)).astype(mx.float32)
    base = getattr(rope, "base", None)
    if base is None:
        raise ValueError(f"cannot read RoPE frequencies from {type(rope).__name__}")
    scale = float(getattr(rope, "scale", 1.0))
    i = mx.arange(0, dims, 2, dtype=mx.float32) / dims
    return (scale * mx.power(float(base), -i)).astype(mx.float32)


def rope_reference(x: mx.array, positions: mx.array, inv_freq: mx.array,
                   traditional: bool = False) -> mx.array:
    """x: (N, heads, D) token-major; positions (N,) -> x rotated, in fp32 math."""
    N, _, D = x.shape
    ang = positions.astype(mx.float32)[:, None, None] * inv_freq[None, None, :]  # (N,1,D/2)
    cos, sin = mx.cos(ang), mx.sin(ang)
    xf = x.astype(mx.float32)
    if traditional:
        a, c = xf[..., 0::2], xf[..., 1::2]
        ra, rc = a * cos - c * sin, a * sin + c * cos
        out = mx.stack([ra, rc], axis=-1).reshape(N, -1, D)
    else:
        a, c = xf[..., : D // 2], xf[..., D // 2:]
        out = mx.concatenate([a * cos - c * sin, a * sin + c * cos], axis=-1)
    return out.astype(x.dtype)


def write_kv_rope(qkv: mx.array, positions: mx.array, slots: mx.array, inv_freq: mx.array,
                  k_pool: mx.array, v_pool: mx.array, n_heads: int, n_kv_heads: int,
                  rope: bool = True, traditional: bool = False) -> tuple[mx.array, mx.array]:
    """Split a fused QKV row per token, rotate q and k, write k and v into ``slots`` in place.

    qkv: (N, (H + 2*KVH) * D) row-contiguous (the caller's product output; not checked,
    since this kernel skips MLX's contiguity copies for the pools' sake); positions, slots: (N,) int32 (slot < 0 skips
    the write). Returns (q (N, H, D), k (N, KVH, D)) rotated. The pools are modified
    in place when the returned arrays are evaluated.
    """
    N = qkv.shape[0]
    D = k_pool.shape[-1]
    heads = n_heads + 2 * n_kv_heads
    if qkv.shape[1] != heads * D:
        raise ValueError(f"qkv width {qkv.shape[1]} != ({n_heads} + 2*{n_kv_heads}) * {D}")
    hpt = WRITE_HEADS_PER_THREAD
    total = N * -(-heads // hpt) * (D // 2)
    q, k = _write_kernel()(
        inputs=[qkv, i32(positions), i32(slots), inv_freq, k_pool, v_pool],
        template=[("T", qkv.dtype), ("H", n_heads), ("KVH", n_kv_heads), ("D", D),
                  ("ROPE", bool(rope)), ("TRAD", bool(traditional)), ("HPT", hpt)],
        grid=(total, 1, 1),
        threadgroup=(256, 1, 1),
        output_shapes=[(N, n_heads, D), (N, n_kv_heads, D)],
        output_dtypes=[qkv.dtype, qkv.dtype],
    )
    return q, k


def write_kv_rope_reference(qkv, positions, slots, inv_freq, k_pool, v_pool, n_heads, n_kv_heads,
                            rope=True, traditional=False):
    """Pure-ops version: returns (q, k, new_k_pool, new_v_pool) without touching the inputs."""
    N = qkv.shape[0]
    D = k_pool.shape[-1]
    x = qkv.reshape(N, n_heads + 2 * n_kv_heads, D)
    q, k, v = x[:, :n_heads], x[:, n_heads:n_heads + n_kv_heads], x[:, n_heads + n_kv_heads:]
    if rope:
        q = rope_reference(q, positions, inv_freq, traditional)
        k = rope_reference(k, positions, inv_freq, traditional)
    keep = [i for i, s in enumerate(slots.tolist()) if s >= 0]
    kp, vp = mx.array(k_pool), mx.array(v_pool)
    if keep:
        idx = mx.array(keep)
        kp[slots[idx]] = k[idx]
        vp[slots[idx]] = v[idx]
    return q, k, kp, vp
