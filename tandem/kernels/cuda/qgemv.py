"""One-row 4-bit products for single-stream decode: two kernels, ``stream`` the default.

Single-stream decode is one ``(1, K) x (N, K)^T`` product per linear layer, and on the
H200 the multirow kernel (``quantized_matmul``) moved only 0.75-1.1 TB/s of weights at
one row (kernel trace, bench/gpu_probe.py): every warp recomputed the input's rms norm
over all of K, swiglu inputs were recomputed per warp (exponentials over 2 x 14,336
values), and each lane had only a few 16-byte loads in flight.

``staged`` (``_SOURCE``): a block of 8 warps first stages the (normalized) input row in
shared memory, once, as fp16 pairs in the order the nibble unpacking wants, with
per-chunk sums for the affine bias term. Each warp then issues every 16-byte weight load
of its ``R`` rows before it uses any, and reads the input from shared memory with a lane
rotation that keeps the banks conflict-free.

``stream`` (``_STREAM_SOURCE``): a block's lanes cover one row's K, each lane a fixed
16-byte chunk whose input values it holds in registers, and the block streams P passes of
H rows past them; the only barrier is the cross-warp sum at the end. No block waits on a
staging phase, so more of the card's warps are loading at any moment (gate/up 31.2 ->
26.6 us, down 23.4 -> 16.3 us, H200 run 38).

Both write ``silu(gate) * up`` directly for a gate/up product (``pair``), so the down
product's input needs no swiglu pass.

Layout is MLX's affine 4-bit (see ``quantized_matmul``). fp16 activations only;
``K % 1024 == 0`` (whole 16-byte chunks per lane) and ``K <= MAX_K`` (the staged row must
fit 48 KB of static shared memory). ``qgemv_reference`` is the pure-ops definition.
"""

from __future__ import annotations

import functools
import os

import mlx.core as mx

from tandem.kernels.cuda import constants
from tandem.kernels.cuda import kernel_files
from tandem.kernels.cuda import quantized_matmul as qmm

MAX_K = 16384  # 32 KB of fp16 input + 2 KB of chunk sums
MAX_N = 65536
"""Larger products (the 128k-vocabulary head) stay on the multirow kernel: with one
staging of the input per block of 16 rows, the head measured 148 us against 131 us
(H200 run 14)."""
_WARPS = 8

_HEADER = r"""
// rms_norm's scale 1 / sqrt(mean(x^2) + eps) from each thread's partial sum of squares:
// one warp reduction, one barrier, every thread gets the result.
template <int NW>
__device__ __forceinline__ float qgemv_block_rs(float ss, float* sred, int lane, int warp, int k, float eps) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
  if (lane == 0) sred[warp] = ss;
  __syncthreads();
  float t = 0.f;
#pragma unroll
  for (int i = 0; i < NW; ++i) t += sred[i];
  return rsqrtf(t / k + eps);
}

// One 32-bit word of 4-bit weights (8 nibbles, byte pairs as MLX packs them) against its
// 8 inputs xp4[0..3] (as the unpacking pairs them): low nibbles of each byte pair masked in
// place (1024 + n), high nibbles too (1024 + 16 n, scaled back by an fma), one shift a
// word instead of three. k1032 is fp16 1032 twice (a caller may tie it to its loads).
__device__ __forceinline__ __half2 qgemv_word_dot(uint32_t wd, const __half2* xp4, __half2 k1032) {
  const __half2 k16th = __floats2half2_rn(1.f / 16.f, 1.f / 16.f), k72 = __floats2half2_rn(-72.f, -72.f);
  const uint32_t wd8 = wd >> 8;
  uint32_t t0 = (wd & 0x000F000Fu) | 0x64006400u, t1 = (wd & 0x00F000F0u) | 0x64006400u;
  uint32_t t2 = (wd8 & 0x000F000Fu) | 0x64006400u, t3 = (wd8 & 0x00F000F0u) | 0x64006400u;
  const __half2 q0 = __hsub2(*reinterpret_cast<__half2*>(&t0), k1032);
  const __half2 q1 = __hfma2(*reinterpret_cast<__half2*>(&t1), k16th, k72);
  const __half2 q2 = __hsub2(*reinterpret_cast<__half2*>(&t2), k1032);
  const __half2 q3 = __hfma2(*reinterpret_cast<__half2*>(&t3), k16th, k72);
  __half2 a = __hmul2(xp4[0], q0);
  a = __hfma2(xp4[1], q1, a);
  a = __hfma2(xp4[2], q2, a);
  return __hfma2(xp4[3], q3, a);
}

// Transposed butterfly: after log2(H) exchanges each lane holds one row's sum over H
// lanes (H - 1 shuffles instead of 5 H); the rest is a plain reduction. Returns the sum
// of row ``row_ix``, complete in lanes with (lane & (32 / H - 1)) == 0.
template <int H>
__device__ __forceinline__ float qgemv_row_sums(float (&acc)[H], int lane, int& row_ix) {
  row_ix = 0;
#pragma unroll
  for (int wdt = H / 2, off = 16; wdt >= 1; wdt /= 2, off /= 2) {
    const bool upper = (lane & off) != 0;
#pragma unroll
    for (int i = 0; i < wdt; ++i) {
      const float send = upper ? acc[i] : acc[i + wdt];
      const float keep = upper ? acc[i + wdt] : acc[i];
      acc[i] = keep + __shfl_xor_sync(0xffffffffu, send, off);
    }
    if (upper) row_ix += wdt;
  }
#pragma unroll
  for (int off = 16 / H; off >= 1; off /= 2) acc[0] += __shfl_xor_sync(0xffffffffu, acc[0], off);
  return acc[0];
}
"""

_SOURCE = r"""
  constexpr int CH = K / 32;            // 16-byte (32-value) weight chunks per row
  constexpr int IT = CH / 32;           // chunks per lane per row
  constexpr int NW = 8;
  __shared__ __align__(16) __half2 sx[K / 2];   // per 8 values: (x0,x4) (x1,x5) (x2,x6) (x3,x7)
  __shared__ float sxs[CH];
  __shared__ float sred[NW];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int N = w_shape[0];
  const int NG = scales_shape[1];
  const int GS = K / NG;

  // The weight loads go out first: they do not depend on the input, so they are in
  // flight while the block stages it (issued after, each block's staging latency
  // left the memory system idle: 1.44 TB/s for gate/up on the H200).
  // This warp's rows: R consecutive rows, or with PAIR R/2 gate rows j and their up rows
  // j + N/2 (interleaved: gate, up, gate, up, ...).
  const int wg = blockIdx.x * NW + warp;
  int rows[R];
#pragma unroll
  for (int r = 0; r < R; ++r)
    rows[r] = PAIR ? (wg * (R / 2) + r / 2) + (r % 2) * (N / 2) : wg * R + r;
  const bool live = (PAIR ? wg * (R / 2) : wg * R) < (PAIR ? N / 2 : N);

  const uint4* wv = reinterpret_cast<const uint4*>(w);
  uint4 wr[R][IT];
  __half sc[R][IT], bi[R][IT];
#pragma unroll
  for (int i = 0; i < IT; ++i) {
    const int c = lane + 32 * i;
#pragma unroll
    for (int r = 0; r < R; ++r) wr[r][i] = live ? __ldcs(wv + (size_t)rows[r] * CH + c) : make_uint4(0, 0, 0, 0);
  }
#pragma unroll
  for (int i = 0; i < IT; ++i) {
    const int g = (lane + 32 * i) * 32 / GS;
#pragma unroll
    for (int r = 0; r < R; ++r) {
      sc[r][i] = live ? scales[(size_t)rows[r] * NG + g] : __float2half(0.f);
      bi[r][i] = live ? biases[(size_t)rows[r] * NG + g] : __float2half(0.f);
    }
  }

  float rs = 1.f;
  if constexpr (NORM) {
    float ss = 0.f;
    for (int e = tid * 8; e < K; e += NW * 32 * 8) {
      const uint4 u = *reinterpret_cast<const uint4*>(x + e);
      const __half2* h = reinterpret_cast<const __half2*>(&u);
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const float2 f = __half22float2(h[i]);
        ss = fmaf(f.x, f.x, fmaf(f.y, f.y, ss));
      }
    }
    rs = qgemv_block_rs<NW>(ss, sred, lane, warp, K, (CONSTS ? __int_as_float(EPS_BITS) : fparams[0]));
  }
  for (int e = tid * 8; e < K; e += NW * 32 * 8) {
    const uint4 u = *reinterpret_cast<const uint4*>(x + e);
    const __half* h = reinterpret_cast<const __half*>(&u);
    float f[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) f[i] = __half2float(h[i]);
    if constexpr (NORM) {
      const uint4 v = *reinterpret_cast<const uint4*>(norm_w + e);
      const __half* g = reinterpret_cast<const __half*>(&v);
#pragma unroll
      for (int i = 0; i < 8; ++i) f[i] = __half2float(__float2half(f[i] * rs)) * __half2float(g[i]);
    }
    __half2 p[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) p[i] = __floats2half2_rn(f[i], f[i + 4]);
    *reinterpret_cast<uint4*>(&sx[e / 2]) = *reinterpret_cast<const uint4*>(p);
  }
  __syncthreads();
  for (int c = tid; c < CH; c += NW * 32) {
    float s = 0.f;
#pragma unroll
    for (int i = 0; i < 16; ++i) {
      const float2 f = __half22float2(sx[c * 16 + i]);
      s += f.x + f.y;
    }
    sxs[c] = s;
  }
  __syncthreads();
  if (!live) return;

  const uint4* sxv = reinterpret_cast<const uint4*>(sx);
  const int rot = lane >> 1;   // conflict-free: lanes of a quarter warp hit 8 distinct 16-byte bank groups
  const __half2 k1032 = __floats2half2_rn(1032.f, 1032.f);
  float acc[R];
#pragma unroll
  for (int r = 0; r < R; ++r) acc[r] = 0.f;
#pragma unroll
  for (int i = 0; i < IT; ++i) {
    const int c = lane + 32 * i;
    float dots[R];
#pragma unroll
    for (int r = 0; r < R; ++r) dots[r] = 0.f;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int seg = (j + rot) & 3;
      const uint4 xu = sxv[c * 4 + seg];
      const __half2* xp = reinterpret_cast<const __half2*>(&xu);
#pragma unroll
      for (int r = 0; r < R; ++r) {
        const uint4 u = wr[r][i];
        const uint32_t wd = seg == 0 ? u.x : seg == 1 ? u.y : seg == 2 ? u.z : u.w;
        __half2 a;
#pragma unroll
        for (int q = 0; q < 4; ++q) {
          uint32_t t = ((wd >> (4 * q)) & 0x000F000Fu) | 0x64006400u;
          const __half2 qq = __hsub2(*reinterpret_cast<__half2*>(&t), k1032);  // (n_q - 8, n_{q+4} - 8)
          a = q == 0 ? __hmul2(xp[0], qq) : __hfma2(xp[q], qq, a);
        }
        const float2 f = __half22float2(a);
        dots[r] += f.x + f.y;
      }
    }
#pragma unroll
    for (int r = 0; r < R; ++r) {
      const float s = __half2float(sc[r][i]);
      acc[r] += s * dots[r] + fmaf(8.f, s, __half2float(bi[r][i])) * sxs[c];
    }
  }
#pragma unroll
  for (int r = 0; r < R; ++r)
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) acc[r] += __shfl_xor_sync(0xffffffffu, acc[r], o);
  if (lane == 0) {
#pragma unroll
    for (int r = 0; r < R; r += (PAIR ? 2 : 1)) {
      if constexpr (PAIR) {
        // The same roundings as the unfused path: gate and up in fp16, then swiglu.
        const float g = __half2float(__float2half(acc[r]));
        const float u = __half2float(__float2half(acc[r + 1]));
        const int o = rows[r];
        float v = g / (1.f + __expf(-g)) * u;
        if (RES) v += __half2float(res[o]);
        y[o] = __float2half(v);
      } else {
        const int o = rows[r];
        float v = acc[r];
        if (RES) v += __half2float(res[o]);
        y[o] = __float2half(v);
      }
    }
  }
"""


_STREAM_SOURCE = r"""
  // Each lane owns CPL fixed 16-byte chunks of K (32 weights each) and keeps the matching
  // input values in registers, so rows stream past it with no staging and no block-wide
  // barrier until the end: a block is P passes of H rows, every pass issuing all H rows'
  // loads before it computes any.
  constexpr int CH = K / 32;            // chunks per row
  constexpr int NT = CH / CPL;          // threads per block; a block covers one row's K
  constexpr int NW = NT / 32;
  constexpr int ROWS = P * H;           // rows (PAIR: gate and up rows) per block
  __shared__ float red[ROWS][NW];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int N = w_shape[0];
  const int NG = scales_shape[1];
  const int GS = K / NG;
  const int half_n = N / 2;
  const int rows_out = PAIR ? half_n : N;
  const int out0 = blockIdx.x * (PAIR ? ROWS / 2 : ROWS);
  // Zero at run time, unknown to the compiler (N < 2^30): see the dependency below.
  const uint32_t zero = (uint32_t)N >> 30;
#ifdef TANDEM_PDL
  // Captured with programmatic dependent launch (pipeline/runners/cuda/graph_step.py), this block may
  // start while the kernel before it finishes. Its weights do not depend on that kernel:
  // the first pass's rows go to L2 now, and everything after the wait reads its outputs.
  tandem_pdl_launch();
#pragma unroll
  for (int r = 0; r < H; ++r) {
    const int o = PAIR ? out0 + r / 2 : out0 + r;
    if (o < rows_out) {
      const size_t row = PAIR ? o + (r % 2) * half_n : o;
#pragma unroll
      for (int j = 0; j < CPL; ++j)
        asm volatile("prefetch.global.L2 [%0];" :: "l"(reinterpret_cast<const uint4*>(w) + row * CH + tid + j * NT));
    }
  }
  tandem_pdl_wait();
#endif

  // The input (normalized first when NORM) goes into registers before any weight load.
  // Deferring it until the first pass's weights were in flight, so that the norm's
  // barrier overlapped their latency, made the fused-norm kernel slower (H200 run 41,
  // CUPTI: qkv 17.4 against 12.1 us; 125 registers against 91) and the engine lost its
  // gain.
  uint4 xr[CPL][4];
#pragma unroll
  for (int j = 0; j < CPL; ++j)
#pragma unroll
    for (int w4 = 0; w4 < 4; ++w4)
      xr[j][w4] = *reinterpret_cast<const uint4*>(x + (tid + j * NT) * 32 + w4 * 8);
  __half2 xp[CPL][16];
  float xs[CPL];
  __shared__ float sred[NW];
  auto prep_x = [&]() {
    float rs = 1.f;
    if constexpr (NORM) {
      // rms_norm fused: the block already reads all of x (one chunk per lane), so its
      // sum of squares costs one block reduction, not a launch of its own.
      float ss = 0.f;
#pragma unroll
      for (int j = 0; j < CPL; ++j)
#pragma unroll
        for (int w4 = 0; w4 < 4; ++w4) {
          const __half2* h = reinterpret_cast<const __half2*>(&xr[j][w4]);
#pragma unroll
          for (int i = 0; i < 4; ++i) {
            const float2 f = __half22float2(h[i]);
            ss = fmaf(f.x, f.x, fmaf(f.y, f.y, ss));
          }
        }
      rs = qgemv_block_rs<NW>(ss, sred, lane, warp, K, (CONSTS ? __int_as_float(EPS_BITS) : fparams[0]));
    }
#pragma unroll
    for (int j = 0; j < CPL; ++j) {
      const int c = tid + j * NT;
      float s = 0.f;
#pragma unroll
      for (int w4 = 0; w4 < 4; ++w4) {
        __half h[8];
        *reinterpret_cast<uint4*>(h) = xr[j][w4];
        if constexpr (NORM) {
          // The reference's roundings: x * rs to fp16, times the weight, to fp16.
          const uint4 v = *reinterpret_cast<const uint4*>(norm_w + c * 32 + w4 * 8);
          const __half* g = reinterpret_cast<const __half*>(&v);
#pragma unroll
          for (int i = 0; i < 8; ++i)
            h[i] = __float2half(__half2float(__float2half(__half2float(h[i]) * rs)) * __half2float(g[i]));
        }
#pragma unroll
        for (int q = 0; q < 4; ++q) {
          xp[j][w4 * 4 + q] = __halves2half2(h[q], h[q + 4]);
          s += __half2float(h[q]) + __half2float(h[q + 4]);
        }
      }
      xs[j] = s;
    }
  };
  prep_x();

  const uint4* wv = reinterpret_cast<const uint4*>(w);
#pragma unroll 1
  for (int p = 0; p < P; ++p) {
    // Row r of this pass: plain rows out0 + p*H + r; PAIR: gate row out0 + p*H/2 + r/2
    // for even r, its up row (+ N/2) for odd r. Rows past the end load row 0 and get zero
    // scale and bias, so every load is unconditional.
    uint4 wb[H][CPL];
    __half sb[H][CPL], bb[H][CPL];
    bool live[H];
#pragma unroll
    for (int r = 0; r < H; ++r) {
      live[r] = PAIR ? out0 + p * (H / 2) + r / 2 < half_n : out0 + p * H + r < N;
      const size_t row = !live[r] ? 0 : PAIR ? out0 + p * (H / 2) + r / 2 + (r % 2) * half_n : out0 + p * H + r;
#pragma unroll
      for (int j = 0; j < CPL; ++j) {
        const int c = tid + j * NT;
        wb[r][j] = __ldcs(wv + row * CH + c);
        const int g = c * 32 / GS;
        sb[r][j] = scales[row * NG + g];
        bb[r][j] = biases[row * NG + g];
      }
    }
    // ptxas sinks each load to its first use to save registers (it did: one or two
    // 16-byte loads in flight per warp). Making every multiply of the pass depend on all
    // of its loads keeps them in flight together.
    uint32_t dep = 0;
#pragma unroll
    for (int r = 0; r < H; ++r)
#pragma unroll
      for (int j = 0; j < CPL; ++j)
        dep |= wb[r][j].x ^ (uint32_t)__half_as_ushort(sb[r][j]) ^ ((uint32_t)__half_as_ushort(bb[r][j]) << 16)
               ^ (LOADS_ONLY ? wb[r][j].y ^ wb[r][j].z ^ wb[r][j].w : 0u);
    uint32_t kbits = 0x64086408u ^ (dep & zero);   // fp16 1032 twice
    const __half2 k1032 = *reinterpret_cast<const __half2*>(&kbits);

    float acc[H];
#pragma unroll
    for (int r = 0; r < H; ++r) {
      float a_r = LOADS_ONLY ? __uint_as_float(dep & 0x3u) : 0.f;
#pragma unroll
      for (int j = 0; j < CPL; ++j) {
        const uint4 u = wb[r][j];
        const uint32_t wd4[4] = {u.x, u.y, u.z, u.w};
        float dot = 0.f;
#pragma unroll
        for (int w4 = 0; w4 < 4; ++w4) {
          __half2 a;
          if constexpr (UNPACK == 1) {
            a = qgemv_word_dot(wd4[w4], &xp[j][w4 * 4], k1032);
          } else {
#pragma unroll
            for (int q = 0; q < 4; ++q) {
              uint32_t t = ((wd4[w4] >> (4 * q)) & 0x000F000Fu) | 0x64006400u;
              const __half2 qq = __hsub2(*reinterpret_cast<__half2*>(&t), k1032);  // (n_q - 8, n_{q+4} - 8)
              a = q == 0 ? __hmul2(xp[j][w4 * 4], qq) : __hfma2(xp[j][w4 * 4 + q], qq, a);
            }
          }
          const float2 f = __half22float2(a);
          dot += f.x + f.y;
        }
        if constexpr (LOADS_ONLY) dot = 0.f;
        const float s = live[r] ? __half2float(sb[r][j]) : 0.f;
        const float b = live[r] ? __half2float(bb[r][j]) : 0.f;
        a_r += s * dot + fmaf(8.f, s, b) * xs[j];
      }
      acc[r] = a_r;
    }
    int row_ix;
    const float sum = qgemv_row_sums<H>(acc, lane, row_ix);
    if ((lane & (32 / H - 1)) == 0) red[p * H + row_ix][warp] = sum;
  }
  __syncthreads();
  if (tid < (PAIR ? ROWS / 2 : ROWS)) {
    if constexpr (PAIR) {
      const int p = tid / (H / 2), i = tid % (H / 2);
      const int o = out0 + p * (H / 2) + i;
      if (o < rows_out) {
        float g = 0.f, u = 0.f;
#pragma unroll
        for (int wi = 0; wi < NW; ++wi) { g += red[p * H + 2 * i][wi]; u += red[p * H + 2 * i + 1][wi]; }
        // The same roundings as the unfused path: gate and up in fp16, then swiglu.
        g = __half2float(__float2half(g));
        u = __half2float(__float2half(u));
        float v = g / (1.f + __expf(-g)) * u;
        if (RES) v += __half2float(res[o]);
        y[o] = __float2half(v);
      }
    } else {
      const int o = out0 + tid;
      if (o < rows_out) {
        float v = 0.f;
#pragma unroll
        for (int wi = 0; wi < NW; ++wi) v += red[tid][wi];
        if (RES) v += __half2float(res[o]);
        y[o] = __float2half(v);
      }
    }
  }
"""


@functools.cache
def _kernel(stream: bool = False):
    return kernel_files.cuda_kernel(
        name="tandem_qgemv_stream" if stream else "tandem_qgemv",
        input_names=lean_inputs(True, True, True),  # every input, stand-ins for the absent
        output_names=["y"],
        source=_STREAM_SOURCE if stream else _SOURCE,
        header=_HEADER,
    )


LEAN = os.environ.get("TANDEM_QGEMV_LEAN", "1") == "1"
"""Whether the streaming kernel takes only the inputs a call reads (``0``: every input, with
stand-ins for an absent norm weight or residual and an eps array even when the eps is in
the template). MLX spends ~0.4 us of the engine thread on each input of each kernel it
encodes (H200 run 91, ``bench/encode_probe.py``: 3.15 / 3.81 / 5.32 us an op at 1 / 4 / 8
inputs, compiled), and a one-row step runs this kernel 128 times with two such inputs
each. Bit-equal to the full kernel (its GPU test, run 93). With ``argmax_cuda.ENABLED``:
388 / 375 / 392 / 390 tok/s against 373 / 370 / 377 / 391 without the two (H200 runs 100
and 102, alternating processes), within the spread, but never more work."""

_ABSENT_TYPES = {"norm_w": "const __half*", "res": "const __half*", "fparams": "const float*"}


def lean_inputs(norm: bool, res: bool, params: bool) -> list[str]:
    """The streaming kernel's input names for a call with (norm weight, residual, eps array)."""
    return ["x", "w", "scales", "biases"] + [n for n, keep in (("norm_w", norm), ("res", res),
                                                               ("fparams", params)) if keep]


def lean_source(names: list[str]) -> str:
    """The streaming source for these inputs: each dropped input's name, which the source
    reads only under a template flag that is false for such a call, becomes a null pointer
    of its type for the kernel body alone."""
    absent = [n for n in _ABSENT_TYPES if n not in names]
    return ("".join(f"#define {n} (({_ABSENT_TYPES[n]})nullptr)\n" for n in absent) + _STREAM_SOURCE
            + "".join(f"\n#undef {n}" for n in absent) + "\n")


@functools.cache
def _lean_kernel(norm: bool, res: bool, params: bool):
    names = lean_inputs(norm, res, params)
    return kernel_files.cuda_kernel(
        name=f"tandem_qgemv_stream_n{int(norm)}r{int(res)}p{int(params)}",
        input_names=names, output_names=["y"], source=lean_source(names), header=_HEADER)


KERNEL = os.environ.get("TANDEM_QGEMV_KERNEL", "stream")
"""Which one-row kernel runs: ``stream`` (the default: lane-fixed K chunks, the input in
registers, rows streamed past) or ``staged`` (the input staged in shared memory per block).
H200 run 39, engine, 8B shape, batch 1, alternating processes: stream 279 / 277 decode
tok/s, staged 234 / 245."""


def _shape_env(name: str) -> tuple[int, int, int] | None:
    spec = os.environ.get(name)
    if not spec:
        return None
    try:
        cpl, h, p = (int(v) for v in spec.split("x"))
    except ValueError:
        raise ValueError(f"{name}={spec!r}: write CPLxHxP, for example 1x8x1") from None
    if cpl < 1 or p < 1 or h not in (1, 2, 4, 8, 16, 32):
        raise ValueError(f"{name}={spec!r}: chunks a lane and passes a block are at least 1, "
                         "rows a pass one of 1, 2, 4, 8, 16, 32")
    return cpl, h, p


STREAM_SHAPE = _shape_env("TANDEM_QGEMV_SHAPE")
"""``CPLxHxP`` for every product (measurements)."""
SHAPE_NARROW = _shape_env("TANDEM_QGEMV_SHAPE_NARROW") or (1, 8, 1)
SHAPE_SMALL = _shape_env("TANDEM_QGEMV_SHAPE_SMALL") or SHAPE_NARROW
SHAPE_WIDE = _shape_env("TANDEM_QGEMV_SHAPE_WIDE") or (1, 4, 4)
"""The shapes for rows under 8,192 weights: ``SMALL`` for products of at most
``SMALL_ROWS`` rows (QKV and o at the 8B shape: 768 and 512 blocks at (1, 8, 1), about one
wave of a card that holds 660), ``NARROW`` for more (gate/up: 3,584 blocks); ``WIDE`` for
wider rows (down). Each overridable for measurements (``gpu_probe.py --sections
qgemv-chain``)."""
SMALL_ROWS = 8192


def stream_shape(k: int, n: int | None = None) -> tuple[int, int, int]:
    """(chunks per lane, rows per pass, passes per block) for the streaming kernel over n
    rows of k weights: the fastest in H200 run 38 (CUPTI, one call at a time; gpu_probe
    --sections qgemv-stream): gate/up 28672x4096 26.6 us at (1, 8, 1) against 28.3-30.5
    for the other shapes and 31.2 staged; down 4096x14336 16.3 us at (1, 4, 4) against
    18.5-23.0 and 23.4 staged."""
    if STREAM_SHAPE:
        return STREAM_SHAPE
    if k >= 8192:
        return SHAPE_WIDE
    return SHAPE_SMALL if n is not None and n <= SMALL_ROWS else SHAPE_NARROW


STREAM_NORM = os.environ.get("TANDEM_QGEMV_STREAM_NORM", "1") == "1"
"""Whether the streaming kernel applies a preceding rms_norm itself (one block reduction
per block; the default) instead of ``mx.fast.rms_norm`` running first as its own launch
(``0``): two launches fewer a layer, 64 a step, at one row, where the engine thread's
encoding sets the step. H200, engine at batch 1, alternating processes, with the eps in
the kernel's template (``constants.IN_TEMPLATE``): 368 / 300 / 342 / 323 tok/s against
296 / 269 / 273 / 282 with the norm first (runs 88 and 91), the thread's encoding 1.87-2.19
ms a step against 2.33-2.63. With the eps read from MLX's scalar pool the fused kernel lost
(runs 40-42, 49, 89: 214-231 against 274-282 tok/s; in run 89 the thread waited 1.14 ms a
step for the device against 0.05)."""

STREAM_UNPACK = int(os.environ.get("TANDEM_QGEMV_UNPACK", "1"))
"""Nibble unpacking in the streaming kernel: 0 shifts each word three times, 1 masks the
high nibbles in place and rescales them with an fma (one shift a word). Run 40, CUPTI:
gate/up 25.1 against 26.7 us, down 14.8 against 16.2, qkv 7.7 against 8.1."""


def qgemv_stream(x: mx.array, w: mx.array, scales: mx.array, biases: mx.array, *,
                 norm_weight: mx.array | None = None, eps: float = 1e-5,
                 residual: mx.array | None = None, pair: bool = False,
                 shape: tuple[int, int, int] | None = None, unpack: int | None = None,
                 loads_only: bool = False) -> mx.array:
    """The streaming kernel. shape overrides ``stream_shape``, unpack ``STREAM_UNPACK``
    (measurements); loads_only skips the arithmetic (a bandwidth probe, wrong results)."""
    n, words = w.shape
    k = words * 8
    cpl, h, p = shape or stream_shape(k, n)
    threads = k // 32 // cpl
    rows_per_block = p * h
    n_out = n // 2 if pair else n
    blocks = -(-n_out // (rows_per_block // 2 if pair else rows_per_block))
    if LEAN:
        params = not constants.IN_TEMPLATE
        kernel = _lean_kernel(norm_weight is not None, residual is not None, params)
        inputs = [x, w, scales, biases] + [a for a in (norm_weight, residual) if a is not None] \
            + ([qmm._fparams(float(eps))] if params else [])
    else:
        kernel = _kernel(stream=True)
        inputs = [x, w, scales, biases,
                  norm_weight if norm_weight is not None else qmm._dummy(mx.float16),
                  residual if residual is not None else qmm._dummy(mx.float16),
                  qmm._fparams(float(eps))]
    (y,) = kernel(
        inputs=inputs,
        template=[("K", k), ("CPL", cpl), ("H", h), ("P", p), ("PAIR", bool(pair)),
                  ("RES", residual is not None), ("NORM", norm_weight is not None),
                  ("UNPACK", STREAM_UNPACK if unpack is None else unpack),
                  ("LOADS_ONLY", bool(loads_only))] + constants.eps_template(eps),
        grid=(blocks * threads, 1, 1),
        threadgroup=(threads, 1, 1),
        output_shapes=[(1, n_out)],
        output_dtypes=[mx.float16],
    )
    return y


def supports(x: mx.array, w: mx.array, scales: mx.array, bits: int, group_size: int,
             mode: str = "affine", pair: bool = False) -> bool:
    """Whether ``qgemv`` covers this product (the dispatcher asks first)."""
    if mode != "affine" or bits != 4 or group_size not in (32, 64, 128):
        return False
    if x.ndim != 2 or x.shape[0] != 1 or x.dtype != mx.float16 or scales.dtype != mx.float16:
        return False
    n, words = w.shape
    k = words * 8
    return (k % 1024 == 0 and k <= MAX_K and n <= MAX_N and x.shape[1] == k
            and n % (4 if pair else 2) == 0)


def _stream_fits(k: int, pair: bool, n: int | None = None) -> bool:
    cpl, h, _ = stream_shape(k, n)
    threads = k // 32 // cpl
    return threads % 32 == 0 and threads <= 1024 and (not pair or h % 2 == 0)


def stream_fuses_norm(k: int, pair: bool, n: int | None = None) -> bool:
    """Whether ``qgemv`` given a norm weight runs it inside the streaming kernel (for a
    product of n rows of k weights)."""
    return KERNEL == "stream" and STREAM_NORM and _stream_fits(k, pair, n)


def rows_per_warp(n: int, k: int, pair: bool) -> int:
    """Rows whose loads a warp issues together. Two measured best or tied for every 8B
    product on the H200 (run 14, CUPTI: gate/up 38.8 us at 2 vs 47.6 at 4; down 28.4 at 2
    vs 35.7 at 1 and 82.5 at 4; o 6.8-7.0 at any); one when N is odd."""
    return 2 if n % (4 if pair else 2) == 0 else 1


def qgemv(x: mx.array, w: mx.array, scales: mx.array, biases: mx.array, group_size: int = 64, *,
          norm_weight: mx.array | None = None, eps: float = 1e-5,
          residual: mx.array | None = None, pair: bool = False,
          rows_override: int | None = None) -> mx.array:
    """``x @ dequantize(w).T`` for one fp16 row, 4-bit weights, on CUDA.

    norm_weight: the input is ``rms_norm(x, norm_weight, eps)`` first. pair: ``w`` holds
    [gate; up] stacked (N = 2F rows) and the result is ``swiglu(gate, up)`` (1, F).
    residual (1, N or F): added last. See ``qgemv_reference``.
    """
    n, words = w.shape
    k = words * 8
    if KERNEL == "stream" and rows_override is None and _stream_fits(k, pair, n):
        if norm_weight is not None and not STREAM_NORM:
            x, norm_weight = mx.fast.rms_norm(x, norm_weight, eps), None
        return qgemv_stream(x, w, scales, biases, norm_weight=norm_weight, eps=eps,
                            residual=residual, pair=pair)
    r = rows_override or rows_per_warp(n, k, pair)
    n_out = n // 2 if pair else n
    warps = (n_out // (r // 2) if pair else n // r)
    blocks = -(-warps // _WARPS)
    (y,) = _kernel()(
        inputs=[x, w, scales, biases,
                norm_weight if norm_weight is not None else qmm._dummy(mx.float16),
                residual if residual is not None else qmm._dummy(mx.float16),
                qmm._fparams(float(eps))],
        template=[("K", k), ("R", r), ("NORM", norm_weight is not None), ("PAIR", bool(pair)),
                  ("RES", residual is not None)] + constants.eps_template(eps),
        grid=(blocks * _WARPS * 32, 1, 1),
        threadgroup=(_WARPS * 32, 1, 1),
        output_shapes=[(1, n_out)],
        output_dtypes=[mx.float16],
    )
    return y


def qgemv_reference(x: mx.array, w: mx.array, scales: mx.array, biases: mx.array,
                    group_size: int = 64, *, norm_weight: mx.array | None = None,
                    eps: float = 1e-5, residual: mx.array | None = None,
                    pair: bool = False) -> mx.array:
    """Pure ops: [rms_norm] -> dequantized product -> [swiglu of the two halves] -> [+ residual]."""
    xin = x
    if norm_weight is not None:
        xin = mx.fast.rms_norm(x, norm_weight, eps)
    y = qmm.quantized_matmul_reference(xin, w, scales, biases, group_size, 4)
    if pair:
        f = y.shape[-1] // 2
        y = (qmm.nn_silu(y[:, :f].astype(mx.float32)) * y[:, f:].astype(mx.float32)).astype(x.dtype)
    if residual is not None:
        y = (y.astype(mx.float32) + residual.astype(mx.float32)).astype(x.dtype)
    return y
