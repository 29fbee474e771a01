"""``w4gemm`` on Hopper's warpgroup MMA (``wgmma``), for 17-64 input rows.

At 64 rows ``w4gemm``'s math alone (``mma.sync``, ~210 TFLOPS) is slower than cuBLAS's
whole fp16 product, which runs on ``wgmma``.
``wgmma`` is an ``sm_90a`` instruction; MLX compiles custom kernels for the device's
plain compute capability (``sm_90``), so this kernel is compiled here, with NVRTC through
ctypes (the library MLX itself loaded), to a cubin that ``mx.fast.precompiled_cuda_kernel``
launches.

It reads the same packed weights as ``w4gemm`` (:func:`w4gemm.pack`, 16 tiles a block) and
keeps its pipeline. What changes is the product: a block's two warpgroups each own two
64-row weight tiles; per k16 step a warpgroup multiplies its dequantized A fragments
(registers; ``wgmma``'s A layout per warp is ``mma.m16n8k16``'s, so the packing is the
same) by the 64 input rows in shared memory (a matrix descriptor: K-major, 128-byte
swizzle, which is the XOR layout ``w4gemm`` already stores them in) into 32 fp32
accumulators a thread per tile. ``linear`` uses it for the packed products it runs in one
pass over K (gate/up and the head at 17-64 rows) where :func:`available` says the machine
can run it.
"""

from __future__ import annotations

import functools
import logging

import mlx.core as mx

from tandem.kernels.cuda import cuda_driver
from tandem.kernels.cuda import kernel_files
from tandem.kernels.cuda import nvrtc
from tandem.kernels.cuda import quantized_matmul as qmm
from tandem.kernels.cuda import w4gemm

log = logging.getLogger(__name__)

ROWS_PER_BLOCK = 64
"""Input rows one block multiplies (``wgmma`` n = 64); more run along ``gridDim.z``."""
STAGES = 4
"""``cp.async`` stages (chunks of 64 of K; ``STAGES - 1`` in flight a block)."""
MIN_BLOCKS = 0
"""Blocks an SM should hold (``__launch_bounds__``; 0 = none). The kernel needs 127
registers and 70.6 KB of shared memory, so two blocks fit an SM without the bound; with it
(128 registers) it measured no different. A stream-K variant (one block an SM, equal runs
of all units) measured slower for gate/up and the head: it is no longer selectable. Its
branch (``BAL``) stays in the kernel text, as the cubin changed without it."""

_SOURCE = r"""
typedef unsigned int u32;
typedef unsigned short u16;
typedef unsigned long long u64;

__device__ __forceinline__ u32 hsub2(u32 a, u32 b) {
  u32 r; asm("sub.rn.f16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b)); return r;
}
__device__ __forceinline__ u32 hfma2(u32 a, u32 b, u32 c) {
  u32 r; asm("fma.rn.f16x2 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(c)); return r;
}
template <int BYTES>
__device__ __forceinline__ void cp_async(u32 smem, const void* gmem, bool valid) {
  if (BYTES == 16)
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" :: "r"(smem), "l"(gmem), "r"(valid ? 16 : 0));
  else
    asm volatile("cp.async.ca.shared.global [%0], [%1], 8, %2;\n" :: "r"(smem), "l"(gmem), "r"(valid ? 8 : 0));
}
// One packed word -> the A fragment of a 16 x 16 tile (w4gemm.pack's nibble order).
__device__ __forceinline__ void deq(u32* a, u32 q, u32 sx, u32 sy) {
  const u32 s_lo = __byte_perm(sx, 0, 0x1010), s_hi = __byte_perm(sx, 0, 0x3232);
  const u32 b_lo = __byte_perm(sy, 0, 0x1010), b_hi = __byte_perm(sy, 0, 0x3232);
  const u32 k1024 = 0x64006400u, k16th = 0x2C002C00u, km64 = 0xD400D400u;
  const u32 q2 = q >> 8;
  a[0] = hfma2(hsub2((q & 0x000F000Fu) | 0x64006400u, k1024), s_lo, b_lo);
  a[1] = hfma2(hfma2((q & 0x00F000F0u) | 0x64006400u, k16th, km64), s_hi, b_hi);
  a[2] = hfma2(hsub2((q2 & 0x000F000Fu) | 0x64006400u, k1024), s_lo, b_lo);
  a[3] = hfma2(hfma2((q2 & 0x00F000F0u) | 0x64006400u, k16th, km64), s_hi, b_hi);
}
__device__ __forceinline__ void keep(float* d) {
#pragma unroll
  for (int i = 0; i < 32; ++i) asm volatile("" : "+f"(d[i]) :: "memory");
}
__device__ __forceinline__ void keep(u32* a) {
#pragma unroll
  for (int i = 0; i < 4; ++i) asm volatile("" : "+r"(a[i]) :: "memory");
}
// D(64 x 64, fp32) += A(64 x 16, registers) * B(16 x 64, shared memory, K-major)
__device__ __forceinline__ void wgmma_64x64(float* d, const u32* a, u64 desc) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "
      "{%32, %33, %34, %35}, %36, p, 1, 1, 0;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
        "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(1));
}
// K-major, 128-byte swizzle: rows of 128 bytes, 8-row atoms 1024 bytes apart.
__device__ __forceinline__ u64 b_desc(u32 smem_addr) {
  return (u64)((smem_addr & 0x3FFFF) >> 4) | ((u64)1 << 16) | ((u64)(1024 >> 4) << 32) | ((u64)1 << 62);
}

extern "C" __global__ void LAUNCH_BOUNDS KERNEL_NAME(const u16* x, const u32* wp, const u16* sbp, const u16* res,
                                       int* tile_count, OUT_T* y, float* partial, int M, int K, int N, int G) {
  constexpr int TILES = 16;                  // 16-row weight tiles a block: 2 warpgroups x RT x 4 warps
  constexpr int RT = 2;
  constexpr int XR = 64;
  constexpr int GPC = GS >= 64 ? 1 : 64 / GS;
  constexpr int STAGE = XR * 128 + TILES * 512 + TILES * GPC * 64;
  const int C = K / 64;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int wg = warp >> 2, w4 = warp & 3;
  const int m0 = blockIdx.z * XR;
  // Work units are (256-row block i, chunk c) pairs, u = i * C + c: the packed weights are
  // stored in that order. Split mode: block (x, y) takes chunks [c_lo, c_hi) of block x.
  // Balanced mode: gridDim.x blocks (one an SM) take equal runs of all units, so no SM idles
  // while another finishes a last wave; a 256-row block that spans several runs is summed by
  // whichever of its runs ends last (tile_count), from the partial sums the others left.
  const long long U = (long long)(N / 256) * C;
  const int u_lo = BAL ? (int)(U * blockIdx.x / gridDim.x)
                       : blockIdx.x * C + (int)((long long)blockIdx.y * C / gridDim.y);
  const int u_hi = BAL ? (int)(U * (blockIdx.x + 1) / gridDim.x)
                       : blockIdx.x * C + (int)((long long)(blockIdx.y + 1) * C / gridDim.y);

  extern __shared__ __align__(16) unsigned char dyn[];
  __shared__ int last_run;
  const u32 raw = (u32)__cvta_generic_to_shared(dyn);
  const u32 base = (raw + 1023u) & ~1023u;   // the swizzle repeats every 1024 bytes
  unsigned char* gbase = dyn + (base - raw);
  // per stage: input rows [64][8 units of 16 bytes], unit u of row r at u ^ (r & 7); packed
  // weights [TILES][32 lanes] uint4; scales and biases [TILES][GPC][8] uint2
  auto xs_at = [&](int st) { return base + st * STAGE; };
  auto ws_at = [&](int st) { return base + st * STAGE + XR * 128; };
  auto ss_at = [&](int st) { return base + st * STAGE + XR * 128 + TILES * 512; };

  // A thread's share of a chunk's loads, with the addresses worked out once: per chunk only
  // the unit's offset changes. (Computed afresh a chunk, the general loops cost ~400
  // instructions a thread, more than the dequantization and the products' issue together.)
  constexpr int XI = XR * 8 / 256, WI = TILES * 32 / 256;   // 16-byte pieces a thread
  constexpr int SN = TILES * GPC * 8, SI = (SN + 255) / 256;  // 8-byte pieces
  const u16* x_src[XI];
  u32 x_dst[XI], x_ok[XI];
#pragma unroll
  for (int j = 0; j < XI; ++j) {
    const int i = threadIdx.x + 256 * j, r = i >> 3, u = i & 7;
    x_ok[j] = m0 + r < M;
    x_src[j] = x + (x_ok[j] ? (size_t)(m0 + r) * K + u * 8 : 0);
    x_dst[j] = r * 128 + ((u ^ (r & 7)) << 4);
  }
  const u32* w_src = wp + (size_t)threadIdx.x * 4;
  const int s_i = threadIdx.x, s_tl = s_i / (GPC * 8), s_j = (s_i / 8) % GPC, s_gg = s_i & 7;
  const u16* s_src = sbp + ((size_t)s_tl * 8 + s_gg) * 4;

  auto issue = [&](int i, int c, int st) {
#pragma unroll
    for (int j = 0; j < XI; ++j)
      cp_async<16>(xs_at(st) + x_dst[j], x_src[j] + (x_ok[j] ? c * 64 : 0), x_ok[j]);
#pragma unroll
    for (int j = 0; j < WI; ++j)
      cp_async<16>(ws_at(st) + (threadIdx.x + 256 * j) * 16,
                   w_src + (((size_t)i * C + c) * TILES * 32 + 256 * j) * 4, true);
#pragma unroll
    for (int j = 0; j < SI; ++j) {
      if (SN % 256 == 0 || s_i + 256 * j < SN) {
        // piece i + 256 j: GPC * 8 pieces a tile, so 256 j / (GPC * 8) tiles further on
        const size_t grp = (size_t)i * G + (c * 64) / GS + s_j;
        cp_async<8>(ss_at(st) + (s_i + 256 * j) * 8,
                    s_src + (grp * TILES * 8 + (256 * j / (GPC * 8)) * 8) * 4, true);
      }
    }
  };

  float acc[RT][32];
  auto zero = [&]() {
#pragma unroll
    for (int i = 0; i < RT; ++i)
#pragma unroll
      for (int e = 0; e < 32; ++e) acc[i][e] = 0.f;
  };
  zero();

  // A fragments of one chunk (4 k16 steps x RT tiles) from stage st.
  auto dequant = [&](int st, u32 (&a)[4][RT][4]) {
#pragma unroll
    for (int i = 0; i < RT; ++i) {
      const int tl = (wg * RT + i) * 4 + w4;
      const uint4 wq = *reinterpret_cast<const uint4*>(gbase + (ws_at(st) - base) + (tl * 32 + lane) * 16);
#pragma unroll
      for (int s = 0; s < 4; ++s) {
        const uint2 sb = *reinterpret_cast<const uint2*>(
            gbase + (ss_at(st) - base) + ((tl * GPC + (s * 16) / (GS < 64 ? GS : 64)) * 8 + g) * 8);
        const u32 q = s == 0 ? wq.x : s == 1 ? wq.y : s == 2 ? wq.z : wq.w;
        deq(a[s][i], q, sb.x, sb.y);
      }
    }
  };
  // keep_acc: pin the accumulators before the products (only when none is in flight: ptxas
  // serializes every wgmma if other instructions define their registers mid-pipeline).
  auto multiply = [&](int st, u32 (&a)[4][RT][4], bool keep_acc) {
    asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
    if (keep_acc)
#pragma unroll
      for (int i = 0; i < RT; ++i) keep(acc[i]);
#pragma unroll
    for (int s = 0; s < 4; ++s)
#pragma unroll
      for (int i = 0; i < RT; ++i) wgmma_64x64(acc[i], a[s][i], b_desc(xs_at(st) + s * 32));
    asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
  };
  auto keep_all = [&](u32 (&a)[4][RT][4]) {
#pragma unroll
    for (int s = 0; s < 4; ++s)
#pragma unroll
      for (int i = 0; i < RT; ++i) keep(a[s][i]);
  };

  // The accumulators of 256-row block i -> y (+ the residual, added once).
  auto store = [&](int i, bool add_res) {
#pragma unroll
    for (int r = 0; r < RT; ++r) {
      const int row0 = (i * TILES + (wg * RT + r) * 4 + w4) * 16;
#pragma unroll
      for (int j = 0; j < 8; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int row = row0 + g + 8 * (e >> 1);
          const int tok = m0 + 8 * j + 2 * t + (e & 1);
          if (tok < M) {
            const size_t o = (size_t)tok * N + row;
            float v = acc[r][4 * j + e];
            if (add_res) {
              float rv;
              asm("cvt.f32.f16 %0, %1;" : "=f"(rv) : "h"(res[o]));
              v += rv;
            }
            if (ATOMIC) {
              atomicAdd(reinterpret_cast<float*>(y) + o, v);
            } else {
              u16 h;
              asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(v));
              reinterpret_cast<u16*>(y)[o] = h;
            }
          }
        }
    }
  };
  // Balanced mode: the run of block b, and the block whose run holds unit u.
  auto run_lo = [&](int b) { return (int)(U * b / gridDim.x); };
  auto run_of = [&](int u) {
    int b = (int)((long long)u * gridDim.x / U);
    while (b + 1 < (int)gridDim.x && run_lo(b + 1) <= u) ++b;
    while (b > 0 && run_lo(b) > u) --b;
    return b;
  };
  // The end of a run's stretch [seg_lo, u_end) of 256-row block i. A block's run touches
  // at most two blocks only in part (its first and its last stretch): partial slot 0 holds
  // its first, slot 1 its last; layout [slot of run][64 values][256 threads].
  auto finish = [&](int i, int seg_lo, int u_end) {
    const int b_lo = i * C, b_hi = b_lo + C;
    if (seg_lo == b_lo && u_end == b_hi) {
      store(i, RES);
      return;
    }
    const int slot = seg_lo == u_lo ? 0 : 1;
    float* mine = partial + (size_t)(blockIdx.x * 2 + slot) * 64 * 256 + threadIdx.x;
#pragma unroll
    for (int r = 0; r < RT; ++r)
#pragma unroll
      for (int e = 0; e < 32; ++e) __stcg(mine + (r * 32 + e) * 256, acc[r][e]);
    __threadfence();
    __syncthreads();
    const int first = run_of(b_lo), last = run_of(b_hi - 1);
    if (threadIdx.x == 0) last_run = atomicAdd(tile_count + i, 1) == last - first;
    __syncthreads();
    if (!last_run) return;
    __threadfence();
    for (int b = first; b <= last; ++b) {
      if (b == (int)blockIdx.x) continue;
      const float* theirs = partial + (size_t)(b * 2 + (run_lo(b) >= b_lo ? 0 : 1)) * 64 * 256 + threadIdx.x;
#pragma unroll
      for (int r = 0; r < RT; ++r)
#pragma unroll
        for (int e = 0; e < 32; ++e) acc[r][e] += __ldcg(theirs + (r * 32 + e) * 256);
    }
    store(i, RES);
    if (threadIdx.x == 0) atomicExch(tile_count + i, 0);  // ready for the next call
  };

  if constexpr (PROBE == 1 || PROBE == 4) {
    // bench only: the products alone on whatever the first stage holds, with (1) or without
    // (4: one chunk's products left in flight) a drain of the wgmma pipeline every chunk.
    u32 a[4][RT][4];
#pragma unroll
    for (int s = 0; s < 4; ++s)
#pragma unroll
      for (int i = 0; i < RT; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) a[s][i][j] = 0x3C003C00u ^ (lane << j);
    for (int u = u_lo; u < u_hi; ++u) {
      multiply(0, a, PROBE == 1);
      if (PROBE == 1) {
        asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
#pragma unroll
        for (int i = 0; i < RT; ++i) keep(acc[i]);
      } else {
        asm volatile("wgmma.wait_group.sync.aligned 1;\n" ::: "memory");
      }
    }
    asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
#pragma unroll
    for (int i = 0; i < RT; ++i) keep(acc[i]);
    keep_all(a);
    if (u_lo < u_hi) store(u_lo / C, false);
    return;
  }

  // One chunk: wait for its stage, refill the stage read last time, dequantize, multiply.
  auto step = [&](int n, int i_next, int c_next, bool more) {
    const int st = n % ST;
    asm volatile("cp.async.wait_group %0;\n" :: "n"(ST - 2));
    // cp.async wrote through the generic proxy; wgmma reads through the async one.
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
    __syncthreads();
    if (more) issue(i_next, c_next, (n + ST - 1) % ST);
    asm volatile("cp.async.commit_group;\n" ::);
    u32 a[4][RT][4];
    if (PROBE == 3) return;  // bench only: the loads alone
    if (PROBE == 2) {
      // bench only: the packed words as they are, no dequantization
      const uint4 wq = *reinterpret_cast<const uint4*>(gbase + (ws_at(st) - base) + (w4 * 32 + lane) * 16);
#pragma unroll
      for (int s2 = 0; s2 < 4; ++s2)
#pragma unroll
        for (int i = 0; i < RT; ++i) {
          a[s2][i][0] = wq.x; a[s2][i][1] = wq.y; a[s2][i][2] = wq.z; a[s2][i][3] = wq.w;
        }
    } else {
      dequant(st, a);
    }
    multiply(st, a, true);
    asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
#pragma unroll
    for (int i = 0; i < RT; ++i) keep(acc[i]);
    keep_all(a);
  };

  if constexpr (!BAL) {
    // one stretch of one 256-row block (blockIdx.x)
    const int i = blockIdx.x, c_lo = u_lo - i * C, c_hi = u_hi - i * C;
#pragma unroll
    for (int p = 0; p < ST - 1; ++p) {
      if (c_lo + p < c_hi) issue(i, c_lo + p, p);
      asm volatile("cp.async.commit_group;\n" ::);
    }
    for (int c = c_lo; c < c_hi; ++c) step(c - c_lo, i, c + ST - 1, c + ST - 1 < c_hi);
    asm volatile("cp.async.wait_group 0;\n" ::);
    store(i, RES && blockIdx.y == 0);
  } else {
    // units tracked as (block, chunk) pairs, the one issued ST - 1 ahead of the one multiplied
    int i = u_lo / C, c = u_lo - i * C, ip = i, cp = c;
#pragma unroll
    for (int p = 0; p < ST - 1; ++p) {
      if (u_lo + p < u_hi) issue(ip, cp, p);
      asm volatile("cp.async.commit_group;\n" ::);
      if (++cp == C) { cp = 0; ++ip; }
    }
    int seg_lo = u_lo;
    for (int u = u_lo; u < u_hi; ++u) {
      step(u - u_lo, ip, cp, u + ST - 1 < u_hi);
      if (++cp == C) { cp = 0; ++ip; }
      if (++c == C || u + 1 == u_hi) {
        finish(i, seg_lo, u + 1);
        zero();
        seg_lo = u + 1;
        if (c == C) { c = 0; ++i; }
      }
    }
    asm volatile("cp.async.wait_group 0;\n" ::);
  }
}
"""


def kernel_source(gs: int, atomic: bool, res: bool, stages: int = STAGES,
                  min_blocks: int = MIN_BLOCKS, probe: int = 0) -> tuple[str, str]:
    """(name, complete CUDA source) of one variant. ``probe`` (bench/gpu_probe.py only, results
    garbage by design): 1 the products alone, 2 no dequantization, 3 the loads alone, 4 the
    products alone with no drain a chunk."""
    name = (f"tandem_w4wg_g{gs}_a{int(atomic)}_r{int(res)}_s{stages}_b{min_blocks}"
            + (f"_p{probe}" if probe else ""))
    head = (f"#define KERNEL_NAME {name}\n#define OUT_T {'float' if atomic else 'u16'}\n"
            f"#define LAUNCH_BOUNDS {f'__launch_bounds__(256, {min_blocks})' if min_blocks else ''}\n"
            f"constexpr int GS = {gs};\nconstexpr bool ATOMIC = {str(atomic).lower()};\n"
            f"constexpr bool RES = {str(res).lower()};\nconstexpr int ST = {stages};\n"
            f"constexpr bool BAL = false;\nconstexpr int PROBE = {probe};\n")
    src = _SOURCE.replace('extern "C"', head + 'extern "C"', 1)  # after the typedefs OUT_T names
    return name, src


def shared_bytes(gs: int, stages: int = STAGES) -> int:
    """w4gemm's stages at 64 input rows and 16 tiles, and 1 KB to align them to the swizzle."""
    return w4gemm.shared_bytes(ROWS_PER_BLOCK // 8, 2, stages, gs) + 1024


@functools.cache
def compile_cubin(gs: int, atomic: bool, res: bool, arch: str = "sm_90a", stages: int = STAGES,
                  min_blocks: int = MIN_BLOCKS, probe: int = 0) -> tuple[str, bytes]:
    """NVRTC-compiled cubin of one variant (``kernels.nvrtc``, cached on disk): (kernel name, bytes)."""
    name, src = kernel_source(gs, atomic, res, stages, min_blocks, probe)
    return name, nvrtc.compile_cubin(src, arch, f"{name}.cu")


@functools.cache
def available() -> bool:
    """Whether this machine compiles the kernel (NVRTC present, sm_90a accepted); the
    engine falls back to the dense product where it does not, with one warning."""
    major = _device_attribute(75)  # CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR
    if major != 9:
        log.warning("w4wgmma unavailable (compute capability %s, wgmma needs 9.x): products of "
                    "17-64 rows stay on the dense GEMM", major)
        return False
    try:
        compile_cubin(64, False, False)
        return True
    except nvrtc.CompileError as e:
        log.warning("w4wgmma unavailable, products of 17-64 rows stay on the dense GEMM: %s",
                    str(e).splitlines()[0])
        return False


def supports(rows: int, n: int, k: int, group_size: int) -> bool:
    """``w4gemm``'s rules, with whole 256-row blocks (the kernel's 16 tiles)."""
    return w4gemm.supports(rows, n, k, group_size, mx.float16) and n % 256 == 0


def k_splits(n: int, k: int) -> int:
    """``w4gemm``'s splits, but none where they would only double the blocks: gate/up at 64
    rows took 51 us in one pass against 60 in two, the fp32 fill, atomics and
    conversion of a split costing more than its extra blocks win."""
    ks = w4gemm.k_splits(n, k, 2)
    return 1 if ks <= 2 else ks


def _device_attribute(attribute: int) -> int | None:
    # The CUDA driver's value for device 0, None where there is no driver or device.
    drv = cuda_driver.driver()
    try:
        return None if drv is None else drv.device_attribute(attribute)
    except cuda_driver.CudaError:
        return None


def w4_wgmma(x: mx.array, wp: mx.array, sbp: mx.array, group_size: int = 64, *,
             residual: mx.array | None = None, splits: int | None = None,
             min_blocks: int | None = None, stages: int | None = None, probe: int = 0) -> mx.array:
    """``x @ dequantize(w).T [+ residual]`` with ``wp, sbp = w4gemm.pack(w, scales, biases,
    group_size, 16)``: fp16 x (M, K), M up to 256. Returns (M, N) fp16."""
    m, k = x.shape
    n = wp.shape[0] * 16
    groups = sbp.shape[1]
    if not supports(m, n, k, group_size):
        raise ValueError(f"w4_wgmma: {m} x {k} against {n} rows, group {group_size}: not covered")
    ks = splits or k_splits(n, k)
    atomic = ks > 1
    st = stages or STAGES
    mb = MIN_BLOCKS if min_blocks is None else min_blocks
    name, cubin = compile_cubin(group_size, atomic, residual is not None, stages=st, min_blocks=mb, probe=probe)
    blocks = n // 256
    y, _ = kernel_files.precompiled_kernel(
        name=name, cubin=cubin,
        inputs=[x, wp, sbp, residual if residual is not None else x, x],
        output_shapes=[(m, n), (1,)],
        output_dtypes=[mx.float32 if atomic else mx.float16, mx.float32],
        scalars=[m, k, n, groups],
        grid=(blocks * 256, ks, -(-m // ROWS_PER_BLOCK)), threadgroup=(256, 1, 1),
        shared_memory=shared_bytes(group_size, st), init_value=0.0 if atomic else None,
    )
    return qmm.to_half(y) if atomic else y
