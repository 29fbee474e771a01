"""Small-M quantized matrix product: 1-16 rows against 4-bit or 8-bit MLX-affine weights.

MLX's CUDA ``quantized_matmul`` reads the packed weights at 90-370 GB/s on an H200
for one row (the card does ~4.3 TB/s), and decode is nothing but such products.
The kernel here streams each weight row once for all M input rows ("multirow"):
one warp owns R output rows, each lane pulls 16-byte chunks of packed weights, and
the M rows of ``x`` come through L1 (they are a few KB and every warp reads them).

Layout (MLX affine mode, ``transpose=True``): ``w`` is ``(N, K*bits/32)`` uint32
with element ``i`` of a word at bits ``[bits*i, bits*(i+1))``; ``scales`` and
``biases`` are ``(N, K/group_size)``; ``w_real = scale * q + bias``; ``y = x @ w_real.T``.

The 4-bit fp16 path turns nibbles into half2 pairs with the ``0x6400`` exponent
trick and multiplies in half2, flushing to fp32 every 8 products so activations
up to ~2000 in magnitude cannot overflow; other dtypes and 8-bit use fp32 math.
``quantized_matmul`` dispatches to the kernel on CUDA for shapes it covers and
falls back to ``mx.quantized_matmul`` everywhere else (CPU included).
"""

from __future__ import annotations

import functools

import mlx.core as mx

from tandem.kernels.cuda import constants
from tandem.kernels.cuda import kernel_files

MAX_KERNEL_ROWS = 16
"""Largest row count the multirow kernel takes; larger products go to GEMM paths."""

PREFERRED_MAX_ROWS = 4
"""Rows up to which the multirow kernel beats the alternatives on the H200 (2026-11-30,
lm_head 128256x4096, per-op times in a queue of 50): 1 row 108-116 us vs fp16 GEMM
244-261 us and MLX 4-bit 300 us; 4 rows 235-265 us vs 263-266 / 1,142 us; 8 rows 487 us
vs 300 / 246 us; 16 rows 980-1,400 us vs 271 / 234 us. From 8 rows on the CUDA-core FMAs
are the limit and tensor-core GEMMs win."""

_ROW_BUCKETS = (1, 2, 4, 8, 16)
_THREADS = 128

_HEADER = r"""
__device__ __forceinline__ float tq_warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ __forceinline__ float tq_f(__half v) { return __half2float(v); }
__device__ __forceinline__ float tq_f(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float tq_f(float v) { return v; }
__device__ __forceinline__ void tq_st(__half* p, float v) { *p = __float2half(v); }
__device__ __forceinline__ void tq_st(__nv_bfloat16* p, float v) { *p = __float2bfloat16(v); }
__device__ __forceinline__ void tq_st(float* p, float v) { *p = v; }
// n consecutive values of x as floats (n = 4 or 8; p 8- or 16-byte aligned).
template <typename T, int NV>
__device__ __forceinline__ void tq_load_f(const T* p, float* f) {
  if constexpr (sizeof(T) == 2 && NV == 8) {
    uint4 u = *reinterpret_cast<const uint4*>(p);
    const T* h = reinterpret_cast<const T*>(&u);
#pragma unroll
    for (int i = 0; i < 8; ++i) f[i] = tq_f(h[i]);
  } else if constexpr (sizeof(T) == 2 && NV == 4) {
    uint2 u = *reinterpret_cast<const uint2*>(p);
    const T* h = reinterpret_cast<const T*>(&u);
#pragma unroll
    for (int i = 0; i < 4; ++i) f[i] = tq_f(h[i]);
  } else {
#pragma unroll
    for (int i = 0; i < NV; ++i) f[i] = tq_f(p[i]);
  }
}
// NV product inputs starting at column k0 of one x row, as floats: silu(gate) * up when
// SWIGLU (gate at [0, K), up at [K, 2K)), times norm_w * rs when NORM.
template <typename T, int NV, bool NORM, bool SWIGLU>
__device__ __forceinline__ void tq_load_x(const T* xrow, const T* norm_w, int k0, int K,
                                          float rs, float* f) {
#pragma unroll
  for (int e = 0; e < NV / 8; ++e) {
    tq_load_f<T, 8>(xrow + k0 + 8 * e, f + 8 * e);
    if constexpr (SWIGLU) {
      float u[8];
      tq_load_f<T, 8>(xrow + K + k0 + 8 * e, u);
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        const float gt = f[8 * e + i];
        f[8 * e + i] = gt / (1.f + __expf(-gt)) * u[i];
      }
    }
    if constexpr (NORM) {
      float gw[8];
      tq_load_f<T, 8>(norm_w + k0 + 8 * e, gw);
#pragma unroll
      for (int i = 0; i < 8; ++i) f[8 * e + i] *= gw[i] * rs;
    }
  }
}
// One packed word -> its 8 (4-bit) or 4 (8-bit) integers as floats, natural order.
template <int BITS>
__device__ __forceinline__ void tq_decode_f(uint32_t w, float* q) {
  if constexpr (BITS == 4) {
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      uint32_t t = ((w >> (4 * j)) & 0x000F000Fu) | 0x64006400u;
      float2 f = __half22float2(*reinterpret_cast<__half2*>(&t));
      q[j] = f.x - 1024.f;
      q[j + 4] = f.y - 1024.f;
    }
  } else {
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      uint32_t t = ((w >> (8 * j)) & 0x00FF00FFu) | 0x64006400u;
      float2 f = __half22float2(*reinterpret_cast<__half2*>(&t));
      q[j] = f.x - 1024.f;
      q[j + 2] = f.y - 1024.f;
    }
  }
}
"""

# Template constants (one NVRTC compile each, ~5 s on the H200 machine, so shapes stay
# runtime): T (dtype), BITS, MMAX (row bucket), R (output rows per warp), HALF (half2
# products; fp16 4-bit only), NORM (x <- rms_norm(x) * norm_w), SWIGLU (x holds [gate, up]
# and the product input is silu(gate) * up), RES (y += res).
_SOURCE = r"""
  constexpr int EPW = 32 / BITS;            // elements per packed word
  constexpr int EPC = 4 * EPW;              // elements per 16-byte chunk
  const int N = w_shape[0];
  const int WPR = w_shape[1];               // packed words per weight row
  const int CHUNKS = WPR / 4;
  const int K = WPR * EPW;
  const int GS = K / scales_shape[1];
  const int XS = x_shape[1];                // x row stride (2K with SWIGLU)
  const int M = x_shape[0];
  const int lane = threadIdx.x & 31;
  const int warp = (blockIdx.x * blockDim.x + threadIdx.x) >> 5;
  const int row0 = warp * R;
  if (row0 >= N) return;

  // RMS of each input row: every warp reads whole x rows anyway (a few KB, from L2).
  float rs[MMAX];
#pragma unroll
  for (int m = 0; m < MMAX; ++m) {
    rs[m] = 1.f;
    if (NORM && m < M) {
      float ss = 0.f;
      for (int c = lane; c < K / 8; c += 32) {
        float f[8];
        tq_load_f<T, 8>(x + (size_t)m * XS + c * 8, f);
#pragma unroll
        for (int i = 0; i < 8; ++i) ss = fmaf(f[i], f[i], ss);
      }
      rs[m] = rsqrtf(tq_warp_sum(ss) / K + (CONSTS ? __int_as_float(EPS_BITS) : fparams[0]));
    }
  }

  float acc[MMAX][R];
#pragma unroll
  for (int m = 0; m < MMAX; ++m)
#pragma unroll
    for (int r = 0; r < R; ++r) acc[m][r] = 0.f;

  const uint4* wv = reinterpret_cast<const uint4*>(w);
  const int ITERS = (CHUNKS + 31) / 32;

#pragma unroll 2
  for (int it = 0; it < ITERS; ++it) {
    const int c = lane + 32 * it;
    if (c < CHUNKS) {
      const int k0 = c * EPC;
      const int g = k0 / GS;
      uint4 wr[R];
      float sc[R], bi[R];
#pragma unroll
      for (int r = 0; r < R; ++r) {
        wr[r] = wv[(size_t)(row0 + r) * CHUNKS + c];
        sc[r] = tq_f(scales[(size_t)(row0 + r) * scales_shape[1] + g]);
        bi[r] = tq_f(biases[(size_t)(row0 + r) * scales_shape[1] + g]);
      }
      if constexpr (HALF) {
        // 4-bit, fp16: q - 8 as half2 pairs (n_j, n_{j+4}); the bias absorbs the +8.
        __half2 qp[R][16];
#pragma unroll
        for (int r = 0; r < R; ++r) {
          const uint32_t* ws = reinterpret_cast<const uint32_t*>(&wr[r]);
#pragma unroll
          for (int wi = 0; wi < 4; ++wi)
#pragma unroll
            for (int j = 0; j < 4; ++j) {
              uint32_t t = ((ws[wi] >> (4 * j)) & 0x000F000Fu) | 0x64006400u;
              qp[r][wi * 4 + j] =
                  __hsub2(*reinterpret_cast<__half2*>(&t), __floats2half2_rn(1032.f, 1032.f));
            }
          bi[r] = fmaf(8.f, sc[r], bi[r]);
        }
#pragma unroll
        for (int m = 0; m < MMAX; ++m) {
          if (m < M) {
            __half2 xp[16];
            float xs = 0.f;
            if constexpr (!NORM && !SWIGLU) {
              const uint4* xv = reinterpret_cast<const uint4*>(x + (size_t)m * XS + k0);
#pragma unroll
              for (int wi = 0; wi < 4; ++wi) {
                uint4 u = xv[wi];
                const __half2* h2 = reinterpret_cast<const __half2*>(&u);
                xp[wi * 4 + 0] = __lows2half2(h2[0], h2[2]);
                xp[wi * 4 + 1] = __highs2half2(h2[0], h2[2]);
                xp[wi * 4 + 2] = __lows2half2(h2[1], h2[3]);
                xp[wi * 4 + 3] = __highs2half2(h2[1], h2[3]);
                float2 s0 = __half22float2(__hadd2(__hadd2(h2[0], h2[1]), __hadd2(h2[2], h2[3])));
                xs += s0.x + s0.y;
              }
            } else {
              float xf[32];
              tq_load_x<T, 32, NORM, SWIGLU>(x + (size_t)m * XS, norm_w, k0, K, rs[m], xf);
#pragma unroll
              for (int wi = 0; wi < 4; ++wi)
#pragma unroll
                for (int j = 0; j < 4; ++j) {
                  xp[wi * 4 + j] = __floats2half2_rn(xf[wi * 8 + j], xf[wi * 8 + j + 4]);
                  xs += xf[wi * 8 + j] + xf[wi * 8 + j + 4];
                }
            }
            float dots[R];
#pragma unroll
            for (int r = 0; r < R; ++r) dots[r] = 0.f;
#pragma unroll
            for (int wi = 0; wi < 4; ++wi) {
#pragma unroll
              for (int r = 0; r < R; ++r) {
                __half2 a = __hmul2(xp[wi * 4 + 0], qp[r][wi * 4 + 0]);
                a = __hfma2(xp[wi * 4 + 1], qp[r][wi * 4 + 1], a);
                a = __hfma2(xp[wi * 4 + 2], qp[r][wi * 4 + 2], a);
                a = __hfma2(xp[wi * 4 + 3], qp[r][wi * 4 + 3], a);
                float2 f = __half22float2(a);
                dots[r] += f.x + f.y;
              }
            }
#pragma unroll
            for (int r = 0; r < R; ++r) acc[m][r] += sc[r] * dots[r] + bi[r] * xs;
          }
        }
      } else {
#pragma unroll
        for (int m = 0; m < MMAX; ++m) {
          if (m < M) {
            float xf[EPC];
            tq_load_x<T, EPC, NORM, SWIGLU>(x + (size_t)m * XS, norm_w, k0, K, rs[m], xf);
            float xs = 0.f;
#pragma unroll
            for (int e = 0; e < EPC; ++e) xs += xf[e];
            float dots[R];
#pragma unroll
            for (int r = 0; r < R; ++r) dots[r] = 0.f;
#pragma unroll
            for (int wi = 0; wi < 4; ++wi) {
#pragma unroll
              for (int r = 0; r < R; ++r) {
                float q[EPW];
                tq_decode_f<BITS>(reinterpret_cast<const uint32_t*>(&wr[r])[wi], q);
#pragma unroll
                for (int e = 0; e < EPW; ++e) dots[r] = fmaf(xf[wi * EPW + e], q[e], dots[r]);
              }
            }
#pragma unroll
            for (int r = 0; r < R; ++r) acc[m][r] += sc[r] * dots[r] + bi[r] * xs;
          }
        }
      }
    }
  }

#pragma unroll
  for (int m = 0; m < MMAX; ++m)
#pragma unroll
    for (int r = 0; r < R; ++r) acc[m][r] = tq_warp_sum(acc[m][r]);
  if (lane == 0) {
#pragma unroll
    for (int m = 0; m < MMAX; ++m)
      if (m < M)
#pragma unroll
        for (int r = 0; r < R; ++r) {
          const size_t o = (size_t)m * N + row0 + r;
          float v = acc[m][r];
          if (RES) v += tq_f(res[o]);
          tq_st(&y[o], v);
        }
  }
"""


@functools.cache
def _kernel():
    return kernel_files.cuda_kernel(
        name="tandem_qmv",
        input_names=["x", "w", "scales", "biases", "norm_w", "res", "fparams"],
        output_names=["y"],
        source=_SOURCE,
        header=_HEADER,
    )


def cuda_available() -> bool:
    """True when MLX runs on an NVIDIA GPU (the custom kernels need it)."""
    try:
        return bool(mx.cuda.is_available()) and mx.default_device() == mx.gpu
    except AttributeError:
        return False


def kernel_supports(rows: int, w: mx.array, scales: mx.array, x_dtype, group_size: int,
                    bits: int, mode: str = "affine") -> bool:
    """Whether ``quantized_matmul_cuda`` covers this product (the dispatcher asks this)."""
    if mode != "affine" or bits not in (4, 8) or group_size not in (32, 64, 128):
        return False
    if not 1 <= rows <= MAX_KERNEL_ROWS:
        return False
    if x_dtype not in (mx.float16, mx.bfloat16, mx.float32):
        return False
    n, words = w.shape
    k = words * 32 // bits
    return k % 128 == 0 and n % 2 == 0 and scales.dtype == x_dtype


def rows_per_warp(n: int) -> int:
    """Output rows per warp: 4 amortizes the x loads; fall back when N is not a multiple."""
    return 4 if n % 4 == 0 else 2


# Cached constants are evaluated at once: a lazy array made on one thread's stream
# cannot be evaluated from another (the engine runs MLX on its own thread).
@functools.cache
def _dummy(dtype) -> mx.array:
    a = mx.zeros((1,), dtype=dtype)
    mx.eval(a)
    return a


_HALF = """
  const size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (i < (size_t)x_shape[0] * x_shape[1]) y[i] = __float2half_rn(x[i]);
"""


@functools.cache
def _half_kernel():
    return kernel_files.cuda_kernel(name="tandem_to_half", input_names=["x"], output_names=["y"],
                                    source=_HALF)


def to_half(y: mx.array) -> mx.array:
    """``y.astype(mx.float16)`` for the (M, N) fp32 sums of a K-split product, as a kernel of
    tandem's own: MLX's cast is not a launch the graph step records, so a step holding one
    could not be captured (the replay would hand the next kernel fp32 bytes). Rounds to
    nearest even, as MLX's cast does."""
    n = y.size
    (out,) = _half_kernel()(inputs=[y], grid=(-(-n // 256) * 256, 1, 1), threadgroup=(256, 1, 1),
                            output_shapes=[y.shape], output_dtypes=[mx.float16])
    return out


def _as(a: mx.array, dtype) -> mx.array:
    # No cast node when the dtype already matches (each op costs MLX dispatch time).
    return a if a.dtype == dtype else a.astype(dtype)


@functools.cache
def _fparams(eps: float) -> mx.array:
    a = mx.array([eps], dtype=mx.float32)
    mx.eval(a)
    return a


def quantized_matmul_cuda(x: mx.array, w: mx.array, scales: mx.array, biases: mx.array,
                          group_size: int = 64, bits: int = 4, *,
                          norm_weight: mx.array | None = None, eps: float = 1e-5,
                          residual: mx.array | None = None, swiglu: bool = False,
                          rows_per_warp_override: int | None = None,
                          half_math: bool | None = None) -> mx.array:
    """``x @ dequantize(w).T`` for 2-D ``x`` of 1-16 rows, on CUDA, with optional fusions.

    x: (M, K) fp16/bf16/fp32, or (M, 2K) holding [gate, up] when ``swiglu``;
    w: (N, K*bits/32) uint32; scales, biases: (N, K/group_size).
    norm_weight (K,): the input is ``rms_norm(x, norm_weight, eps)`` first.
    residual (M, N): added to the result. Returns (M, N) in x's dtype; see
    ``quantized_matmul_reference`` for the exact definition. The caller checks
    ``kernel_supports`` first.
    """
    m = x.shape[0]
    n = w.shape[0]
    bucket = next(b for b in _ROW_BUCKETS if b >= m)
    r = rows_per_warp_override or rows_per_warp(n)
    if half_math is None:
        half_math = bits == 4 and x.dtype == mx.float16
    (y,) = _kernel()(
        inputs=[x, w, scales, biases,
                _as(norm_weight, x.dtype) if norm_weight is not None else _dummy(x.dtype),
                _as(residual, x.dtype) if residual is not None else _dummy(x.dtype),
                _fparams(float(eps))],
        template=[("T", x.dtype), ("BITS", bits), ("MMAX", bucket), ("R", r),
                  ("HALF", bool(half_math)), ("NORM", norm_weight is not None),
                  ("SWIGLU", bool(swiglu)), ("RES", residual is not None)] + constants.eps_template(eps),
        grid=(n // r * 32, 1, 1),
        threadgroup=(_THREADS, 1, 1),
        output_shapes=[(m, n)],
        output_dtypes=[x.dtype],
    )
    return y


def quantized_matmul_reference(x: mx.array, w: mx.array, scales: mx.array, biases: mx.array,
                               group_size: int = 64, bits: int = 4, *,
                               norm_weight: mx.array | None = None, eps: float = 1e-5,
                               residual: mx.array | None = None, swiglu: bool = False) -> mx.array:
    """Pure-ops definition in fp32: [swiglu] -> [rms_norm] -> dequantized matmul -> [+ residual]."""
    xf = x.astype(mx.float32)
    if swiglu:
        k = xf.shape[-1] // 2
        xf = nn_silu(xf[..., :k]) * xf[..., k:]
    if norm_weight is not None:
        xf = xf * mx.rsqrt(mx.mean(xf * xf, axis=-1, keepdims=True) + eps)
        xf = xf * norm_weight.astype(mx.float32)
    wd = mx.dequantize(w, scales, biases, group_size=group_size, bits=bits).astype(mx.float32)
    y = xf @ wd.T
    if residual is not None:
        y = y + residual.astype(mx.float32)
    return y.astype(x.dtype)


def nn_silu(x: mx.array) -> mx.array:
    return x * mx.sigmoid(x)


def quantized_matmul(x: mx.array, w: mx.array, scales: mx.array, biases: mx.array,
                     group_size: int = 64, bits: int = 4, mode: str = "affine") -> mx.array:
    """``x @ dequantize(w).T`` for any leading shape: the multirow kernel where it applies.

    Leading dimensions are flattened into rows first, so a (B, 1, K) decode batch is one
    B-row product (MLX's own CUDA kernel would read the weights B times).
    """
    lead = x.shape[:-1]
    rows = 1
    for d in lead:
        rows *= d
    if cuda_available() and kernel_supports(rows, w, scales, x.dtype, group_size, bits, mode):
        y = quantized_matmul_cuda(x.reshape(rows, x.shape[-1]), w, scales, biases,
                                  group_size, bits)
    else:
        y = mx.quantized_matmul(x.reshape(rows, x.shape[-1]), w, scales, biases,
                                transpose=True, group_size=group_size, bits=bits, mode=mode)
    return y.reshape(*lead, y.shape[-1])
