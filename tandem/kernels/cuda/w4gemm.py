"""Tensor-core product of 9-256 rows against 4-bit weights repacked into fragment order.

At batch 64 the dense fp16 GEMMs read ~15 GB a decode step (4.3 of a 6.9 ms step on the
H200) and cuBLAS's graph capture is most of the engine thread's 4.7 ms of encoding
(docs/benchmarks/gpu_decode.md). The 4-bit weights are a quarter of the bytes.
``w4mma`` read them in MLX's layout and lost to cuBLAS 1.3x at 64 rows: a lane's 16-byte
piece of a row had to be shuffled into fragments, every block re-read the whole input
for 64 weight rows, and the loads came in 64-byte pieces a row apart.

This kernel reads a copy of the weights packed once, at load, in the order the tensor
cores want them (Marlin's idea, :func:`pack`):

- per 16 weight rows x 64 of K, each lane's 16 bytes are its A fragments of
  ``mma.sync.m16n8k16`` for the four k16 steps: a warp loads 512 contiguous bytes, and
  one 32-bit word becomes the four fp16 pairs of one fragment with two masks, a shift
  and the ``0x6400`` exponent trick (no shuffles);
- the scales and biases of rows ``g`` and ``g + 8`` sit together, 8 bytes a lane;
- a block covers ``NW * RT * 16`` weight rows (256 by default), so it reads the input
  once for four times the rows ``w4mma`` did; the input rows are the B operand, read from
  XOR-swizzled shared memory with ``ldmatrix``.

Everything goes through shared memory by ``cp.async``, ``ST - 1`` chunks of 64 ahead.
Products with few weight rows split K over ``gridDim.y`` blocks that add into an fp32
result. ``w4_gemm_reference`` is the pure-ops definition.

Measured on the H200 (cold): up to 32 rows it beats cuBLAS's fp16 product on
the large layers (gate/up at 16 rows 44 against 57-62 us, the head 131-134 against
250-261) and ``w4mma`` everywhere from 16 rows; at 64 rows its math alone (``mma.sync``
at ~210 TFLOPS) is slower than cuBLAS's whole product, which uses Hopper's ``wgmma``.
The engine gives it 9-16 rows (``linear.W4G_ROWS``): batch 16 +7.5% to +13%.
"""

from __future__ import annotations

import functools

import mlx.core as mx

from tandem.kernels.cuda import kernel_files
from tandem.kernels.cuda import quantized_matmul as qmm
from tandem.kernels.cuda import w4mma

MAX_ROWS = 256
"""Input rows one call takes. A block takes up to 64 (8 tiles of 8 rows: 64 fp32
accumulators a thread); more rows run more blocks along ``gridDim.z``, each reading the
weights again."""
KC = 64
"""K per pipeline chunk: four k16 steps, one 16-byte word of packed weights a lane."""
WARPS = 8
MIN_WEIGHTS = 1 << 25
"""Smallest product (N x K) a layer packs for: on the H200 (cold) the dense
fp16 GEMM faster for qkv 6144x4096 and o 4096x4096 at 16-64 rows (14-16 us against
16-36), the kernel faster for gate/up, down and the head at 16-32 rows."""
TARGET_BLOCKS = 264
"""Blocks a product should spread over (2 per SM of an H200 at 68 KB of shared memory);
fewer row blocks than this split K."""

HEADER = r"""
__device__ __forceinline__ void w4g_mma(float* c, const uint32_t* a, uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
      "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
__device__ __forceinline__ void w4g_ldm4(uint32_t* r, const void* smem) {
  const unsigned s = (unsigned)__cvta_generic_to_shared(smem);
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(s));
}
// One packed word -> the A fragment of a 16 x 16 tile: nibbles (0, 4) are rows g, k 2t / 2t+1;
// (1, 5) rows g + 8; (2, 6) and (3, 7) the same at k + 8 (see pack()). sb = scales of rows
// g, g + 8 | biases of rows g, g + 8.
__device__ __forceinline__ void w4g_deq(uint32_t* a, uint32_t q, uint2 sb) {
  const __half2 s_lo = __low2half2(*reinterpret_cast<__half2*>(&sb.x));
  const __half2 s_hi = __high2half2(*reinterpret_cast<__half2*>(&sb.x));
  const __half2 b_lo = __low2half2(*reinterpret_cast<__half2*>(&sb.y));
  const __half2 b_hi = __high2half2(*reinterpret_cast<__half2*>(&sb.y));
  const __half2 k1024 = __float2half2_rn(1024.f), k16th = __float2half2_rn(0.0625f), km64 = __float2half2_rn(-64.f);
  const uint32_t q2 = q >> 8;
  uint32_t t0 = (q & 0x000F000Fu) | 0x64006400u, t1 = (q & 0x00F000F0u) | 0x64006400u;
  uint32_t t2 = (q2 & 0x000F000Fu) | 0x64006400u, t3 = (q2 & 0x00F000F0u) | 0x64006400u;
  // (1024 + n) - 1024 and (1024 + 16 n) / 16 - 64 are exact; then one rounding, as mlx's
  // scale * q + bias.
  __half2 v0 = __hfma2(__hsub2(*reinterpret_cast<__half2*>(&t0), k1024), s_lo, b_lo);
  __half2 v1 = __hfma2(__hfma2(*reinterpret_cast<__half2*>(&t1), k16th, km64), s_hi, b_hi);
  __half2 v2 = __hfma2(__hsub2(*reinterpret_cast<__half2*>(&t2), k1024), s_lo, b_lo);
  __half2 v3 = __hfma2(__hfma2(*reinterpret_cast<__half2*>(&t3), k16th, km64), s_hi, b_hi);
  a[0] = *reinterpret_cast<uint32_t*>(&v0);
  a[1] = *reinterpret_cast<uint32_t*>(&v1);
  a[2] = *reinterpret_cast<uint32_t*>(&v2);
  a[3] = *reinterpret_cast<uint32_t*>(&v3);
}
""" + w4mma.CP_ASYNC_HEADER

# Templates: MT (tiles of 8 input rows, even), RT (16-row weight tiles a warp), NW (warps),
# ST (pipeline stages), GS (group size: 32, 64 or 128), ATOMIC (fp32 result every K split
# adds into), RES (+ residual, added by split 0), PROBE (bench/gpu_probe.py only, results
# garbage: 1 no loads, the math alone; 2 no dequantization, raw words as fragments; 3 the
# loads alone).
#
# Inputs: x (M, K) fp16; wp (N/16, K/64, 32, 4) uint32 and sbp (N/16, K/GS, 8, 4) fp16 from
# pack() with NW * RT tiles a block; res (M, N) fp16 or a dummy. Output y (M, N), fp16 or
# fp32 (ATOMIC).
SOURCE = r"""
  constexpr int TILES = NW * RT;             // 16-row weight tiles a block
  constexpr int ROWS = TILES * 16;
  constexpr int XR = MT * 8;                 // input rows a block
  constexpr int GPC = GS >= 64 ? 1 : 64 / GS;  // groups a chunk
  const int M = x_shape[0];
  const int K = x_shape[1];
  const int N = wp_shape[0] * 16;
  const int C = K / 64;                      // chunks along K
  const int G = sbp_shape[1];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int tile0 = blockIdx.x * TILES;
  const int m0 = blockIdx.z * XR;            // first input row of this block
  const int c_lo = (int)((long long)blockIdx.y * C / gridDim.y);
  const int c_hi = (int)((long long)(blockIdx.y + 1) * C / gridDim.y);

  extern __shared__ __align__(16) unsigned char w4g_dyn[];
  // per stage: input rows [XR][8] 16-byte units, unit u of row r at u ^ (r & 7) (ldmatrix
  // reads 8 rows at one unit: 8 distinct bank groups); weights [TILES][32 lanes]; scales and
  // biases [TILES][GPC][8].
  uint4 (*xs)[XR][8] = reinterpret_cast<uint4 (*)[XR][8]>(w4g_dyn);
  uint4 (*ws)[TILES][32] = reinterpret_cast<uint4 (*)[TILES][32]>(w4g_dyn + ST * XR * 128);
  uint2 (*ss)[TILES][GPC][8] = reinterpret_cast<uint2 (*)[TILES][GPC][8]>(w4g_dyn + ST * (XR * 128 + TILES * 512));

  const uint4* wp4 = reinterpret_cast<const uint4*>(wp);
  const uint2* sb2 = reinterpret_cast<const uint2*>(sbp);
  auto issue = [&](int c, int st) {
    if (PROBE == 1) return;
#pragma unroll
    for (int i = threadIdx.x; i < XR * 8; i += NW * 32) {
      const int r = i >> 3, u = i & 7;
      const bool ok = m0 + r < M;
      w4_cp<16>(&xs[st][r][u ^ (r & 7)], x + (ok ? (size_t)(m0 + r) * K + (size_t)c * 64 + u * 8 : 0), ok);
    }
#pragma unroll
    for (int i = threadIdx.x; i < TILES * 32; i += NW * 32) {
      const int tl = i >> 5;
      w4_cp<16>(&ws[st][tl][i & 31], wp4 + (((size_t)blockIdx.x * C + c) * TILES + tl) * 32 + (i & 31), true);
    }
    for (int i = threadIdx.x; i < TILES * GPC * 8; i += NW * 32) {
      const int tl = i / (GPC * 8), j = (i / 8) % GPC, gg = i & 7;
      const int grp = (c * 64) / GS + j;
      w4_cp<8>(&ss[st][tl][j][gg], sb2 + (((size_t)blockIdx.x * G + grp) * TILES + tl) * 8 + gg, true);
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
  // ldmatrix.x4 for two 8-row input tiles: lanes 0-7 / 8-15 / 16-23 / 24-31 address rows
  // of (tile j, k 0-7) / (j, k 8-15) / (j + 1, k 0-7) / (j + 1, k 8-15) of a k16 step.
  const int lrow = ((lane >> 4) << 3) + (lane & 7);
  const int lhalf = (lane >> 3) & 1;
  for (int c = c_lo; c < c_hi; ++c) {
    const int st = (c - c_lo) % ST;
    w4_cp_wait<ST - 2>();
    __syncthreads();
    // The stage refilled here was read in the previous iteration, which every warp has
    // finished (the barrier above).
    if (c + ST - 1 < c_hi) issue(c + ST - 1, (c - c_lo + ST - 1) % ST);
    w4_cp_commit();

    uint4 wq[RT];
#pragma unroll
    for (int i = 0; i < RT; ++i) wq[i] = ws[st][warp * RT + i][lane];
    if (PROBE == 3) {
      acc[0][0][0] += (float)(wq[0].x & 1u) + (float)(ss[st][0][0][g].x & 1u) + (float)(xs[st][lane & 7][0].x & 1u);
      continue;
    }
#pragma unroll
    for (int s = 0; s < 4; ++s) {
      uint32_t a[RT][4];
#pragma unroll
      for (int i = 0; i < RT; ++i)
        if (PROBE == 2) {
          const uint32_t q = reinterpret_cast<const uint32_t*>(&wq[i])[s];
          a[i][0] = q; a[i][1] = q >> 4; a[i][2] = q >> 8; a[i][3] = q >> 12;
        } else
        w4g_deq(a[i], reinterpret_cast<const uint32_t*>(&wq[i])[s], ss[st][warp * RT + i][(s * 16) / (GS < 64 ? GS : 64)][g]);
#pragma unroll
      for (int j = 0; j < MT; j += 2) {
        const int r = 8 * j + lrow;
        uint32_t b[4];
        w4g_ldm4(b, &xs[st][r][(2 * s + lhalf) ^ (r & 7)]);
#pragma unroll
        for (int i = 0; i < RT; ++i) {
          w4g_mma(acc[i][j], a[i], b[0], b[1]);
          w4g_mma(acc[i][j + 1], a[i], b[2], b[3]);
        }
      }
    }
  }
  w4_cp_wait<0>();

  const int row0 = (tile0 + warp * RT) * 16;
  const bool add_res = RES && blockIdx.y == 0;
#pragma unroll
  for (int i = 0; i < RT; ++i)
#pragma unroll
    for (int j = 0; j < MT; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int row = row0 + 16 * i + g + 8 * (e >> 1);
        const int tok = m0 + 8 * j + 2 * t + (e & 1);
        if (tok < M) {
          const size_t o = (size_t)tok * N + row;
          float v = acc[i][j][e];
          if (add_res) v += __half2float(res[o]);
          if constexpr (ATOMIC) atomicAdd(&y[o], v);
          else y[o] = __float2half(v);
        }
      }
"""

_MT_BUCKETS = (2, 4, 8)  # ldmatrix.x4 reads two 8-row tiles


@functools.cache
def _kernel(shared_bytes: int):
    return kernel_files.cuda_kernel(
        name="tandem_w4gemm",
        input_names=["x", "wp", "sbp", "res"],
        output_names=["y"],
        source=SOURCE,
        header=HEADER,
        shared_memory=shared_bytes,
    )


def shared_bytes(mt: int, rt: int, stages: int, group_size: int) -> int:
    """Dynamic shared memory of one block: per stage the input chunk, the packed weights
    and the scales and biases of its tiles."""
    tiles = WARPS * rt
    gpc = max(1, KC // group_size)
    return stages * (mt * 8 * 128 + tiles * 512 + tiles * gpc * 64)


STAGES = 4
ROW_TILES = 2


def row_tiles(n: int) -> int:
    """16-row weight tiles a warp: 2 (a block reads its input once for 256 weight rows) when
    N divides into such blocks, else 1."""
    return ROW_TILES if n % (WARPS * ROW_TILES * 16) == 0 else 1


def supports(rows: int, n: int, k: int, group_size: int, x_dtype) -> bool:
    """Whether ``w4_gemm`` covers this product: fp16 input of at most ``MAX_ROWS`` rows, N a
    multiple of 128, K of 64, group 32/64/128."""
    return (1 <= rows <= MAX_ROWS and x_dtype == mx.float16 and group_size in (32, 64, 128)
            and n % (WARPS * 16) == 0 and k % KC == 0 and k % group_size == 0)


def k_splits(n: int, k: int, rt: int) -> int:
    """Blocks along K: enough blocks in all for the card, at least four chunks each."""
    blocks = n // (WARPS * rt * 16)
    return max(1, min(k // (4 * KC), round(TARGET_BLOCKS / max(blocks, 1))))


def pack(wq: mx.array, scales: mx.array, biases: mx.array, group_size: int,
         block_tiles: int | None = None) -> tuple[mx.array, mx.array]:
    """MLX affine 4-bit weights (N, K/8) uint32 + (N, K/gs) scales and biases -> the kernel's
    layout: ``wp`` (N/16, K/64, 32, 4) uint32 and ``sbp`` (N/16, K/gs, 8, 4) fp16.

    Word ``s`` of lane ``(g, t)`` (``lane = 4 g + t``) of tile ``T``, chunk ``c`` holds, at
    nibble ``j = 4 e + 2 h + r`` (``e, h, r`` in 0..1), the weight of row ``16 T + g + 8 r``
    at ``k = 64 c + 16 s + 8 h + 2 t + e``: the A fragment of ``mma.m16n8k16`` for that
    k16 step, in the order the dequantization's masks take the nibbles out. ``sbp[T, grp,
    g]`` = (scale of row g, of row g + 8, bias of row g, of row g + 8) of tile T.

    The pieces are stored block by block (``block_tiles`` tiles, default ``WARPS *
    row_tiles(N)``, the kernel's), then chunk by chunk: what one block reads for one chunk
    is one contiguous run, and the shapes above only count the pieces. (Stored tile by
    tile, all chunks of tile 0 first, the kernel ran as fast.) ``block_tiles=0``
    gives the tile-by-tile order, which the tests read back."""
    n, words = wq.shape
    k = words * 8
    shifts = mx.arange(8, dtype=mx.uint32) * 4
    nib = (wq[:, :, None] >> shifts) & 15                         # (N, K/8, 8): k = 8 w + i
    nib = nib.reshape(n // 16, 2, 8, k // 64, 4, 2, 4, 2)          # T, r, g, c, s, h, t, e
    nib = nib.transpose(0, 3, 2, 6, 4, 7, 5, 1)                    # T, c, g, t, s, e, h, r
    nib = nib.reshape(n // 16, k // 64, 32, 4, 8)
    wp = (nib << shifts).sum(axis=-1).astype(mx.uint32)
    groups = scales.shape[1]

    def pairs(a):  # (N, G) -> (N/16, G, 8, 2): rows g and g + 8 of each tile side by side
        return a.reshape(n // 16, 2, 8, groups).transpose(0, 3, 2, 1)

    sbp = mx.concatenate([pairs(scales), pairs(biases)], axis=-1).astype(mx.float16)
    if block_tiles is None:
        block_tiles = WARPS * row_tiles(n)
    if block_tiles:
        def blocked(a):  # (T, X, ...) -> (T / tb, X, tb, ...), read back as (T, X, ...)
            shape = a.shape
            return a.reshape(shape[0] // block_tiles, block_tiles, *shape[1:]).swapaxes(1, 2).reshape(shape)
        wp, sbp = blocked(wp), blocked(sbp)
    return wp, sbp


def w4_gemm(x: mx.array, wp: mx.array, sbp: mx.array, group_size: int = 64, *,
            residual: mx.array | None = None, splits: int | None = None,
            block_tiles: int | None = None, probe: int = 0) -> mx.array:
    """``x @ dequantize(w).T [+ residual]`` for fp16 ``x`` of 1-256 rows, with ``wp, sbp =
    pack(w, scales, biases, group_size, block_tiles)``. Returns (M, N) fp16."""
    m, k = x.shape
    n = wp.shape[0] * 16
    mt = next((b for b in _MT_BUCKETS if 8 * b >= m), _MT_BUCKETS[-1])
    rt = block_tiles // WARPS if block_tiles else row_tiles(n)
    if n % (rt * WARPS * 16):
        raise ValueError(f"w4_gemm: {n} weight rows do not divide into blocks of {rt * WARPS * 16}")
    ks = splits or k_splits(n, k, rt)
    atomic = ks > 1
    kw = {"init_value": 0.0} if atomic else {}
    (y,) = _kernel(shared_bytes(mt, rt, STAGES, group_size))(
        inputs=[x, wp, sbp, residual if residual is not None else qmm._dummy(mx.float16)],
        template=[("MT", mt), ("RT", rt), ("NW", WARPS), ("ST", STAGES), ("GS", group_size),
                  ("ATOMIC", atomic), ("RES", residual is not None), ("PROBE", probe)],
        grid=(n // (WARPS * rt * 16) * WARPS * 32, ks, -(-m // (8 * mt))),
        threadgroup=(WARPS * 32, 1, 1),
        output_shapes=[(m, n)],
        output_dtypes=[mx.float32 if atomic else mx.float16],
        **kw,
    )
    return qmm.to_half(y) if atomic else y


def w4_gemm_reference(x, wq, scales, biases, group_size: int = 64, *, residual=None):
    """Pure-ops definition: dequantize, multiply in fp32, add the residual, round to fp16."""
    return qmm.quantized_matmul_reference(x, wq, scales, biases, group_size, 4, residual=residual)
