"""Tensor-core product of 5-64 rows against MLX-affine 4-bit weights (fp16).

Between single-row decode (``qgemv``) and prefill (dense fp16 GEMM) lie the decode
batches of 8-128 rows. There the multirow kernel (``quantized_matmul``) is bound by its
CUDA-core FMAs, MLX's own 4-bit GEMM is slow, and the dense fp16 GEMM reads four times
the bytes of the 4-bit weights: at batch 64 the fp16 products took 4.0 of a 7.3 ms step
on the H200 (docs/benchmarks/gpu_decode.md). This kernel reads the 4-bit weights once,
turns them into fp16 in registers and multiplies on the tensor cores
(``mma.sync.m16n8k16``, fp32 accumulation): the weights are the A operand (16 rows per
tile), the input rows the B operand (8 per tile).

Layout per 128-wide chunk of K: lane ``(g, t)`` (``g = lane / 4``, ``t = lane % 4``) loads
one 16-byte piece of each of its weight rows, the 32 values ``[32t, 32t + 32)``. A dot
product does not care in which order K is summed, so each k-step pairs the fragment's K
positions with whichever values a lane holds, and the input is read with the same
pairing: nibbles ``j`` and ``j + 4`` of a packed word become one fp16 pair
(``0x6400`` exponent trick), and the input's pairs are shuffled to match with one
``prmt`` each. The input chunk, the weight pieces and their scales go through shared memory
by ``cp.async``, several chunks ahead (the input XOR-swizzled so that a quarter-warp's
16-byte reads hit 8 distinct bank groups); each warp owns ``RT`` tiles of 16 weight rows
and every input row.

Products with few weight rows (o_proj, down_proj: 4,096) split K over ``gridDim.y`` blocks
that add into an fp32 result (``atomicAdd``), cast to fp16 afterwards; the others write
fp16 directly. ``w4_matmul_reference`` is the pure-ops definition (the multirow kernel's).
"""

from __future__ import annotations

import functools

import mlx.core as mx

from tandem.kernels.cuda import kernel_files
from tandem.kernels.cuda import quantized_matmul as qmm

MAX_ROWS = 64
"""Input rows one call takes: at 128 the accumulators of two row tiles alone would take 128
registers a thread, and from 32 rows on the dense GEMM is faster anyway."""
_WARPS = 4
TARGET_BLOCKS = 528
"""Blocks a product should spread over (4 per SM of an H200); fewer row blocks than this
split K. H200, CUPTI, 8 rows: down 4096x14336 23 us at 8 splits against 28 at 4; o
4096x4096 12 us at 8 against 13 at 4."""

MIN_WEIGHTS = 1 << 25
"""Smallest product (N x K) the kernel takes: below it the dense fp16 GEMM was faster at
every row count measured (o 4096x4096 and qkv 6144x4096: 12-19 us against 8.7-14), above
it the kernel wins up to 16 rows (gate/up 28672x4096: 40-48 us against 55-58; down
4096x14336: 23-28 against 32-35). From 32 rows on the dense GEMM wins everywhere."""

CP_ASYNC_HEADER = r"""
// cp.async of 16 bytes (L2 only) or 4/8 bytes; a false ``valid`` zero-fills the destination.
template <int BYTES>
__device__ __forceinline__ void w4_cp(void* smem, const void* gmem, bool valid) {
  const unsigned s = (unsigned)__cvta_generic_to_shared(smem);
  if constexpr (BYTES == 16)
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" :: "r"(s), "l"(gmem), "r"(valid ? 16 : 0));
  else
    asm volatile("cp.async.ca.shared.global [%0], [%1], %2, %3;\n" :: "r"(s), "l"(gmem), "n"(BYTES), "r"(valid ? BYTES : 0));
}
__device__ __forceinline__ void w4_cp_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int LEFT>
__device__ __forceinline__ void w4_cp_wait() { asm volatile("cp.async.wait_group %0;\n" :: "n"(LEFT)); }
"""

_HEADER = r"""
__device__ __forceinline__ void w4_mma(float* c, const uint32_t* a, const uint32_t* b) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
      "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
// Nibbles j and j + 4 of a packed word as the fp16 pair (scale * q + bias).
template <int J>
__device__ __forceinline__ uint32_t w4_deq(uint32_t w, __half2 s, __half2 b) {
  uint32_t t = ((w >> (4 * J)) & 0x000F000Fu) | 0x64006400u;
  __half2 q = __hsub2(*reinterpret_cast<__half2*>(&t), __float2half2_rn(1024.f));
  __half2 r = __hfma2(q, s, b);
  return *reinterpret_cast<uint32_t*>(&r);
}
""" + CP_ASYNC_HEADER

# Templates: MT (tiles of 8 input rows), RT (tiles of 16 weight rows per warp), NW (warps),
# ST (pipeline stages), GS (group size, 32 or 64), ATOMIC (fp32 result added into by every
# K split), RES (+ residual), LOADS_ONLY (bench/gpu_probe.py: the loads without the math).
#
# Every 128-wide chunk of K goes through shared memory by cp.async: the input rows, the
# block's weight pieces and its scales and biases, ST - 1 chunks ahead of the one the warps
# multiply. With loads only one chunk ahead (registers, first version) each chunk waited out
# a memory latency and the kernel moved 1.2-1.4 TB/s.
_SOURCE = r"""
  constexpr int ROWS = NW * RT * 16;
  constexpr int XP = MT * 8 * 16;            // 16-byte input pieces per chunk
  constexpr int WP = ROWS * 4;               // 16-byte weight pieces per chunk
  constexpr int SB = 256 / GS;               // bytes of scales (and of biases) per row per chunk
  const int N = w_shape[0];
  const int WV = w_shape[1] / 4;             // 16-byte pieces per weight row
  const int K = w_shape[1] * 8;
  const int G = scales_shape[1];
  const int M = x_shape[0];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int brow = blockIdx.x * ROWS;
  const int chunks = K / 128;
  const int c_lo = (int)((long long)blockIdx.y * chunks / gridDim.y);
  const int c_hi = (int)((long long)(blockIdx.y + 1) * chunks / gridDim.y);

  extern __shared__ __align__(16) unsigned char w4_dyn[];
  uint4 (*xs)[MT * 8][16] = reinterpret_cast<uint4 (*)[MT * 8][16]>(w4_dyn);
  uint4 (*ws)[ROWS][4] = reinterpret_cast<uint4 (*)[ROWS][4]>(w4_dyn + ST * XP * 16);
  uint2 (*ss)[ROWS] = reinterpret_cast<uint2 (*)[ROWS]>(w4_dyn + ST * (XP + WP) * 16);
  uint2 (*bs)[ROWS] = reinterpret_cast<uint2 (*)[ROWS]>(w4_dyn + ST * (XP + WP) * 16 + ST * ROWS * 8);

  auto issue = [&](int c, int st) {
    for (int i = threadIdx.x; i < XP; i += NW * 32) {
      const int r = i >> 4, ch = i & 15;
      const bool ok = r < M;
      w4_cp<16>(&xs[st][r][ch ^ (((ch >> 3) & 1) << 1) ^ (r & 1)],
                x + (ok ? (size_t)r * K + (size_t)c * 128 + ch * 8 : 0), ok);
    }
    for (int i = threadIdx.x; i < WP; i += NW * 32) {
      const int r = i >> 2, pc = i & 3;
      w4_cp<16>(&ws[st][r][pc], reinterpret_cast<const uint4*>(w) + (size_t)(brow + r) * WV + c * 4 + pc, true);
    }
    for (int i = threadIdx.x; i < 2 * ROWS; i += NW * 32) {
      const int r = i % ROWS;
      const __half* src = (i < ROWS ? scales : biases) + (size_t)(brow + r) * G + c * (128 / GS);
      w4_cp<SB>(i < ROWS ? (void*)&ss[st][r] : (void*)&bs[st][r], src, true);
    }
  };

  float acc[RT][MT][4];
#pragma unroll
  for (int i = 0; i < RT; ++i)
#pragma unroll
    for (int j = 0; j < MT; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[i][j][e] = 0.f;

#pragma unroll
  for (int p = 0; p < ST - 1; ++p) {
    if (c_lo + p < c_hi) issue(c_lo + p, p);
    w4_cp_commit();
  }
  for (int c = c_lo; c < c_hi; ++c) {
    const int st = (c - c_lo) % ST;
    w4_cp_wait<ST - 2>();
    __syncthreads();
    // The stage refilled here was read in the previous iteration, which every warp has
    // finished (the barrier above).
    if (c + ST - 1 < c_hi) issue(c + ST - 1, (c - c_lo + ST - 1) % ST);
    w4_cp_commit();

    uint4 wc[RT][2];
    __half2 sc[RT][2], bc[RT][2];
#pragma unroll
    for (int i = 0; i < RT; ++i)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int r = warp * RT * 16 + 16 * i + 8 * h + g;
        wc[i][h] = ws[st][r][t];
        sc[i][h] = __half2half2(reinterpret_cast<const __half*>(&ss[st][r])[32 * t / GS]);
        bc[i][h] = __half2half2(reinterpret_cast<const __half*>(&bs[st][r])[32 * t / GS]);
      }
#pragma unroll
    for (int s = 0; s < 4; ++s) {
      if (LOADS_ONLY) {  // probe: the memory pipeline alone (result is garbage)
        acc[0][0][0] += __half2float(sc[0][0].x) + (float)(wc[0][0].x & 1u) + (float)(xs[st][g][t].x & 1u);
        continue;
      }
      uint32_t ae[RT][4], ao[RT][4];
#pragma unroll
      for (int i = 0; i < RT; ++i) {
        const uint32_t w0 = reinterpret_cast<const uint32_t*>(&wc[i][0])[s];
        const uint32_t w1 = reinterpret_cast<const uint32_t*>(&wc[i][1])[s];
        ae[i][0] = w4_deq<0>(w0, sc[i][0], bc[i][0]);
        ae[i][1] = w4_deq<0>(w1, sc[i][1], bc[i][1]);
        ae[i][2] = w4_deq<1>(w0, sc[i][0], bc[i][0]);
        ae[i][3] = w4_deq<1>(w1, sc[i][1], bc[i][1]);
        ao[i][0] = w4_deq<2>(w0, sc[i][0], bc[i][0]);
        ao[i][1] = w4_deq<2>(w1, sc[i][1], bc[i][1]);
        ao[i][2] = w4_deq<3>(w0, sc[i][0], bc[i][0]);
        ao[i][3] = w4_deq<3>(w1, sc[i][1], bc[i][1]);
      }
      const int ch = 4 * t + s;
      const int slot = ch ^ ((t >> 1) << 1) ^ (g & 1);
#pragma unroll
      for (int j = 0; j < MT; ++j) {
        const uint4 xv = xs[st][8 * j + g][slot];
        const uint32_t be[2] = {__byte_perm(xv.x, xv.z, 0x5410), __byte_perm(xv.x, xv.z, 0x7632)};
        const uint32_t bo[2] = {__byte_perm(xv.y, xv.w, 0x5410), __byte_perm(xv.y, xv.w, 0x7632)};
#pragma unroll
        for (int i = 0; i < RT; ++i) {
          w4_mma(acc[i][j], ae[i], be);
          w4_mma(acc[i][j], ao[i], bo);
        }
      }
    }
  }
  w4_cp_wait<0>();

  const int row0 = brow + warp * RT * 16;
  const bool add_res = RES && blockIdx.y == 0;
#pragma unroll
  for (int i = 0; i < RT; ++i)
#pragma unroll
    for (int j = 0; j < MT; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int row = row0 + 16 * i + g + 8 * (e >> 1);
        const int tok = 8 * j + 2 * t + (e & 1);
        if (tok < M) {
          const size_t o = (size_t)tok * N + row;
          float v = acc[i][j][e];
          if (add_res) v += __half2float(res[o]);
          if constexpr (ATOMIC) atomicAdd(&y[o], v);
          else y[o] = __float2half(v);
        }
      }
"""

_MT_BUCKETS = (1, 2, 4, 8)


@functools.cache
def _kernel(shared_bytes: int):
    return kernel_files.cuda_kernel(
        name="tandem_w4mma",
        input_names=["x", "w", "scales", "biases", "res"],
        output_names=["y"],
        source=_SOURCE,
        header=_HEADER,
        shared_memory=shared_bytes,
    )


def shared_bytes(mt: int, rt: int, stages: int) -> int:
    """Dynamic shared memory of one block: per stage the input chunk, the weight pieces and
    8 bytes each of scales and biases per weight row."""
    rows = _WARPS * rt * 16
    return stages * (mt * 8 * 16 * 16 + rows * 4 * 16 + rows * 16)


def stages(mt: int) -> int:
    """Pipeline depth: 4 chunks, 3 at 64 input rows (104 KB a block would leave one block an SM)."""
    return 3 if mt >= 8 else 4


def row_tiles(mt: int) -> int:
    """Weight-row tiles per warp: 2 reuses each input read for 32 rows; up to 16 input rows
    1, for twice the warps and their loads in flight."""
    return 1 if mt <= 2 else 2


def supports(rows: int, w: mx.array, scales: mx.array, biases, x_dtype, group_size: int,
             bits: int, mode: str = "affine", *, against_dense: bool = True) -> bool:
    """Whether ``w4_matmul`` covers this product (the dispatcher asks this).
    ``against_dense``: a dense copy is the alternative, so small products stay on it
    (``MIN_WEIGHTS``); without one, MLX's 4-bit GEMM is the alternative, and this kernel
    beat it at every size measured."""
    if mode != "affine" or bits != 4 or biases is None or group_size not in (32, 64):
        return False
    if not 1 <= rows <= MAX_ROWS or x_dtype != mx.float16 or scales.dtype != mx.float16:
        return False
    n, words = w.shape
    k = words * 8
    return k % 128 == 0 and n % (_WARPS * 16) == 0 and (not against_dense or n * k >= MIN_WEIGHTS)


def k_splits(n: int, k: int, mt: int) -> int:
    """Blocks along K: enough blocks in all for the card, at least two 128-chunks each."""
    blocks = n // (_WARPS * row_tiles(mt) * 16)
    return max(1, min(k // 256, round(TARGET_BLOCKS / max(blocks, 1))))


def w4_matmul(x: mx.array, w: mx.array, scales: mx.array, biases: mx.array,
              group_size: int = 64, *, residual: mx.array | None = None,
              splits: int | None = None, loads_only: bool = False) -> mx.array:
    """``x @ dequantize(w).T [+ residual]`` for fp16 ``x`` of 1-64 rows (see ``supports``).

    x: (M, K); w: (N, K/8) uint32; scales, biases: (N, K/group_size) fp16;
    residual: (M, N) or None. Returns (M, N) fp16.
    """
    m, k = x.shape
    n = w.shape[0]
    mt = next(b for b in _MT_BUCKETS if 8 * b >= m)
    rt = row_tiles(mt)
    if rt == 2 and n % (_WARPS * 32):
        rt = 1
    ks = splits or k_splits(n, k, mt)
    atomic = ks > 1
    kw = {}
    if atomic:
        kw["init_value"] = 0.0
    st = stages(mt)
    (y,) = _kernel(shared_bytes(mt, rt, st))(
        inputs=[x, w, scales, biases, residual if residual is not None else qmm._dummy(mx.float16)],
        template=[("MT", mt), ("RT", rt), ("NW", _WARPS), ("ST", st), ("GS", group_size), ("ATOMIC", atomic),
                  ("LOADS_ONLY", loads_only),
                  ("RES", residual is not None)],
        grid=(n // (_WARPS * rt * 16) * _WARPS * 32, ks, 1),
        threadgroup=(_WARPS * 32, 1, 1),
        output_shapes=[(m, n)],
        output_dtypes=[mx.float32 if atomic else mx.float16],
        **kw,
    )
    return qmm.to_half(y) if atomic else y


def w4_matmul_reference(x, w, scales, biases, group_size: int = 64, *, residual=None):
    """Pure-ops definition: dequantize, multiply in fp32, add the residual, round to fp16."""
    return qmm.quantized_matmul_reference(x, w, scales, biases, group_size, 4, residual=residual)
