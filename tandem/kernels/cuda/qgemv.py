"""One-row 4-bit products for single-stream decode (``qgemv``).

Single-stream decode is one ``(1, K) x (N, K)^T`` product per linear layer, and the
multirow kernel (``quantized_matmul``) moved only 0.75-1.1 TB/s of weights at one row on
the H200: every warp recomputed the input's rms norm over all of K, swiglu inputs were
recomputed per warp, and each lane had only a few 16-byte loads in flight.

Here a block's lanes cover one row's K, each lane a fixed 16-byte chunk whose input values
it holds in registers, and the block streams P passes of H rows past them; the only
barrier is the cross-warp sum at the end. No block waits on a staging phase, so more of
the card's warps are loading at any moment; a kernel that first staged the input in
shared memory per block lost to it at every 8B product and is gone.

It writes ``silu(gate) * up`` directly for a gate/up product (``pair``), so the down
product's input needs no swiglu pass.

Layout is MLX's affine 4-bit (see ``quantized_matmul``). fp16 activations only;
``K % 1024 == 0`` (whole 16-byte chunks per lane) and ``K <= MAX_K``. ``qgemv_reference``
is the pure-ops definition.
"""

from __future__ import annotations

import functools

import mlx.core as mx

from tandem.kernels.cuda import constants
from tandem.kernels.cuda import kernel_files
from tandem.kernels.cuda import quantized_matmul as qmm

MAX_K = 16384
MAX_N = 65536
"""Larger products (the 128k-vocabulary head) stay on the multirow kernel, which was the
faster of the two there."""

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

  // The input (normalized first when NORM) goes into registers before any weight load.
  // Deferring it until the first pass's weights were in flight, so that the norm's
  // barrier overlapped their latency, made the fused-norm kernel slower (qkv 17.4
  // against 12.1 us; 125 registers against 91) and the engine lost its
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


# The kernel takes only the inputs a call reads (no stand-in norm weight or residual, no
# eps array when the eps is in the template): MLX spends ~0.4 us of the engine thread on
# each input of each kernel it encodes, and a one-row step runs this kernel 128 times.

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


SHAPE_NARROW = (1, 8, 1)
SHAPE_SMALL = SHAPE_NARROW
SHAPE_WIDE = (1, 4, 4)
"""(chunks per lane, rows per pass, passes per block) for rows under 8,192 weights:
``SMALL`` for products of at most ``SMALL_ROWS`` rows (QKV and o at the 8B shape: 768 and
512 blocks at (1, 8, 1), about one wave of a card that holds 660), ``NARROW`` for more
(gate/up: 3,584 blocks); ``WIDE`` for wider rows (down). The fastest of the shapes
measured kernel by kernel on the H200. Module constants, so a measurement can patch them."""
SMALL_ROWS = 8192


def stream_shape(k: int, n: int | None = None) -> tuple[int, int, int]:
    """(chunks per lane, rows per pass, passes per block) for the kernel over n rows of k
    weights (see ``SHAPE_NARROW``)."""
    if k >= 8192:
        return SHAPE_WIDE
    return SHAPE_SMALL if n is not None and n <= SMALL_ROWS else SHAPE_NARROW


STREAM_UNPACK = 1
"""Nibble unpacking: 1 masks the high nibbles in place and rescales them with an fma (one
shift a word), faster at every 8B product than 0, which shifts each word three times.
The kernel applies a preceding rms_norm itself (one block reduction per block), two
launches fewer a layer at one row, where the engine thread's encoding sets the step; with
the eps read from an array instead of the template that lost (``constants``)."""


def qgemv_stream(x: mx.array, w: mx.array, scales: mx.array, biases: mx.array, *,
                 norm_weight: mx.array | None = None, eps: float = 1e-5,
                 residual: mx.array | None = None, pair: bool = False,
                 shape: tuple[int, int, int] | None = None, unpack: int | None = None,
                 loads_only: bool = False) -> mx.array:
    """The kernel. shape overrides ``stream_shape``, unpack ``STREAM_UNPACK`` (measurements);
    loads_only skips the arithmetic (a bandwidth probe, wrong results)."""
    n, words = w.shape
    k = words * 8
    cpl, h, p = shape or stream_shape(k, n)
    threads = k // 32 // cpl
    rows_per_block = p * h
    n_out = n // 2 if pair else n
    blocks = -(-n_out // (rows_per_block // 2 if pair else rows_per_block))
    params = not constants.IN_TEMPLATE
    kernel = _lean_kernel(norm_weight is not None, residual is not None, params)
    inputs = [x, w, scales, biases] + [a for a in (norm_weight, residual) if a is not None] \
        + ([qmm._fparams(float(eps))] if params else [])
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
            and n % (4 if pair else 2) == 0 and _stream_fits(k, pair, n))


def _stream_fits(k: int, pair: bool, n: int | None = None) -> bool:
    cpl, h, _ = stream_shape(k, n)
    threads = k // 32 // cpl
    return threads % 32 == 0 and threads <= 1024 and (not pair or h % 2 == 0)


def stream_fuses_norm(k: int, pair: bool, n: int | None = None) -> bool:
    """Whether ``qgemv`` given a norm weight runs it inside the kernel (for a product of n
    rows of k weights)."""
    return _stream_fits(k, pair, n)


def qgemv(x: mx.array, w: mx.array, scales: mx.array, biases: mx.array, group_size: int = 64, *,
          norm_weight: mx.array | None = None, eps: float = 1e-5,
          residual: mx.array | None = None, pair: bool = False) -> mx.array:
    """``x @ dequantize(w).T`` for one fp16 row, 4-bit weights, on CUDA (``supports``).

    norm_weight: the input is ``rms_norm(x, norm_weight, eps)`` first. pair: ``w`` holds
    [gate; up] stacked (N = 2F rows) and the result is ``swiglu(gate, up)`` (1, F).
    residual (1, N or F): added last. See ``qgemv_reference``.
    """
    return qgemv_stream(x, w, scales, biases, norm_weight=norm_weight, eps=eps,
                        residual=residual, pair=pair)


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
