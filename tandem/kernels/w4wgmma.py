"""``w4gemm`` on Hopper's warpgroup MMA (``wgmma``), for 17-64 input rows. Experimental.

At 64 rows ``w4gemm``'s math alone (``mma.sync``, ~210 TFLOPS) is slower than cuBLAS's
whole fp16 product, which runs on ``wgmma`` (docs/benchmarks/gpu_decode.md, run 76).
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
accumulators a thread per tile. Not dispatched by default: ``linear`` uses it only with
``TANDEM_W4WG=1``.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import glob
import os
import sys

import mlx.core as mx

from tandem.kernels import w4gemm

ROWS_PER_BLOCK = 64
"""Input rows one block multiplies (``wgmma`` n = 64); more run along ``gridDim.z``."""
STAGES = int(os.environ.get("TANDEM_W4WG_STAGES", "4"))
"""``cp.async`` stages (chunks of 64 of K; ``STAGES - 1`` in flight a block)."""
OVERLAP = os.environ.get("TANDEM_W4WG_OVERLAP", "0") == "1"
"""Dequantize chunk c + 1 while chunk c's ``wgmma`` runs (two register sets of A
fragments): compiled, not yet run on the H200."""
MIN_BLOCKS = int(os.environ.get("TANDEM_W4WG_MIN_BLOCKS", "0"))
"""Blocks an SM should hold (``__launch_bounds__``; 0 = none, the kernel run 77 measured:
122-140 registers, one block an SM). In run 77 a block waited out its own ``wgmma`` before
dequantizing the next chunk, and gate/up took 65-69 us at every row count. With 2 (at most
128 registers a thread; nvcc: no spills) a second block could fill that wait: compiled,
not yet run on the H200."""

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

extern "C" __global__ void LAUNCH_BOUNDS KERNEL_NAME(const u16* x, const u32* wp, const u16* sbp, const u16* res, OUT_T* y,
                                       int M, int K, int N, int G) {
  constexpr int TILES = 16;                  // 16-row weight tiles a block: 2 warpgroups x RT x 4 warps
  constexpr int RT = 2;
  constexpr int XR = 64;
  constexpr int GPC = GS >= 64 ? 1 : 64 / GS;
  constexpr int STAGE = XR * 128 + TILES * 512 + TILES * GPC * 64;
  const int C = K / 64;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int wg = warp >> 2, w4 = warp & 3;
  const int tile0 = blockIdx.x * TILES;
  const int m0 = blockIdx.z * XR;
  const int c_lo = (int)((long long)blockIdx.y * C / gridDim.y);
  const int c_hi = (int)((long long)(blockIdx.y + 1) * C / gridDim.y);

  extern __shared__ __align__(16) unsigned char dyn[];
  const u32 raw = (u32)__cvta_generic_to_shared(dyn);
  const u32 base = (raw + 1023u) & ~1023u;   // the swizzle repeats every 1024 bytes
  unsigned char* gbase = dyn + (base - raw);
  // per stage: input rows [64][8 units of 16 bytes], unit u of row r at u ^ (r & 7); packed
  // weights [TILES][32 lanes] uint4; scales and biases [TILES][GPC][8] uint2
  auto xs_at = [&](int st) { return base + st * STAGE; };
  auto ws_at = [&](int st) { return base + st * STAGE + XR * 128; };
  auto ss_at = [&](int st) { return base + st * STAGE + XR * 128 + TILES * 512; };

  auto issue = [&](int c, int st) {
#pragma unroll
    for (int i = threadIdx.x; i < XR * 8; i += 256) {
      const int r = i >> 3, u = i & 7;
      const bool ok = m0 + r < M;
      cp_async<16>(xs_at(st) + r * 128 + ((u ^ (r & 7)) << 4),
                   x + (ok ? (size_t)(m0 + r) * K + (size_t)c * 64 + u * 8 : 0), ok);
    }
#pragma unroll
    for (int i = threadIdx.x; i < TILES * 32; i += 256) {
      const int tl = i >> 5;
      cp_async<16>(ws_at(st) + i * 16, wp + ((((size_t)blockIdx.x * C + c) * TILES + tl) * 32 + (i & 31)) * 4, true);
    }
    for (int i = threadIdx.x; i < TILES * GPC * 8; i += 256) {
      const int tl = i / (GPC * 8), j = (i / 8) % GPC, gg = i & 7;
      const int grp = (c * 64) / GS + j;
      cp_async<8>(ss_at(st) + i * 8, sbp + ((((size_t)blockIdx.x * G + grp) * TILES + tl) * 8 + gg) * 4, true);
    }
  };

  float acc[RT][32];
#pragma unroll
  for (int i = 0; i < RT; ++i)
#pragma unroll
    for (int e = 0; e < 32; ++e) acc[i][e] = 0.f;

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

  if constexpr (!OVERLAP) {
#pragma unroll
    for (int p = 0; p < ST - 1; ++p) {
      if (c_lo + p < c_hi) issue(c_lo + p, p);
      asm volatile("cp.async.commit_group;\n" ::);
    }
    for (int c = c_lo; c < c_hi; ++c) {
      const int st = (c - c_lo) % ST;
      asm volatile("cp.async.wait_group %0;\n" :: "n"(ST - 2));
      // cp.async wrote through the generic proxy; wgmma reads through the async one.
      asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
      __syncthreads();
      if (c + ST - 1 < c_hi) issue(c + ST - 1, (c - c_lo + ST - 1) % ST);
      asm volatile("cp.async.commit_group;\n" ::);
      u32 a[4][RT][4];
      dequant(st, a);
      multiply(st, a, true);
      asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
#pragma unroll
      for (int i = 0; i < RT; ++i) keep(acc[i]);
      keep_all(a);
    }
  } else {
    // Chunk c + 1 is dequantized while chunk c's wgmma runs: two register sets of A
    // fragments, alternated by unrolling two chunks a turn (a register array indexed at run
    // time would live in local memory). A set is written again only after
    // wgmma.wait_group 1 has retired the product that read it, and keep() tells the
    // compiler it is still read up to there. A stage is refilled only after every
    // warpgroup has retired the product of the chunk it held (the barrier after that wait).
    u32 a0[4][RT][4], a1[4][RT][4];
#pragma unroll
    for (int p = 0; p < ST - 1; ++p) {
      if (c_lo + p < c_hi) issue(c_lo + p, p);
      asm volatile("cp.async.commit_group;\n" ::);
    }
    asm volatile("cp.async.wait_group %0;\n" :: "n"(ST - 2));
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
    __syncthreads();
    if (c_lo < c_hi) dequant(0, a0);
    auto turn = [&](int c, u32 (&cur)[4][RT][4], u32 (&nxt)[4][RT][4]) {
      multiply((c - c_lo) % ST, cur, false);
      asm volatile("wgmma.wait_group.sync.aligned 1;\n" ::: "memory");  // chunk c - 1 retired
      keep_all(nxt);
      if (c + 1 < c_hi) {
        // committed: chunks up to c + ST - 2; chunk c + 1 must have landed
        asm volatile("cp.async.wait_group %0;\n" :: "n"(ST - 3));
        asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
        __syncthreads();
        if (c + ST - 1 < c_hi) issue(c + ST - 1, (c - c_lo + ST - 1) % ST);  // chunk c - 1's stage
      }
      asm volatile("cp.async.commit_group;\n" ::);
      if (c + 1 < c_hi) dequant((c + 1 - c_lo) % ST, nxt);
    };
    int c = c_lo;
    for (; c + 1 < c_hi; c += 2) {
      turn(c, a0, a1);
      turn(c + 1, a1, a0);
    }
    if (c < c_hi) turn(c, a0, a1);
    asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
#pragma unroll
    for (int i = 0; i < RT; ++i) keep(acc[i]);
    keep_all(a0);
    keep_all(a1);
  }
  asm volatile("cp.async.wait_group 0;\n" ::);

  const bool add_res = RES && blockIdx.y == 0;
#pragma unroll
  for (int i = 0; i < RT; ++i) {
    const int row0 = (tile0 + (wg * RT + i) * 4 + w4) * 16;
#pragma unroll
    for (int j = 0; j < 8; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int row = row0 + g + 8 * (e >> 1);
        const int tok = m0 + 8 * j + 2 * t + (e & 1);
        if (tok < M) {
          const size_t o = (size_t)tok * N + row;
          float v = acc[i][4 * j + e];
          if (add_res) {
            float r;
            asm("cvt.f32.f16 %0, %1;" : "=f"(r) : "h"(res[o]));
            v += r;
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
}
"""


def kernel_source(gs: int, atomic: bool, res: bool, stages: int = STAGES,
                  min_blocks: int = MIN_BLOCKS, overlap: bool = False) -> tuple[str, str]:
    """(name, complete CUDA source) of one variant."""
    if overlap and stages < 3:
        raise ValueError("the overlapped loop needs 3 stages or more")
    name = f"tandem_w4wg_g{gs}_a{int(atomic)}_r{int(res)}_s{stages}_b{min_blocks}_o{int(overlap)}"
    head = (f"#define KERNEL_NAME {name}\n#define OUT_T {'float' if atomic else 'u16'}\n"
            f"#define LAUNCH_BOUNDS {f'__launch_bounds__(256, {min_blocks})' if min_blocks else ''}\n"
            f"constexpr int GS = {gs};\nconstexpr bool ATOMIC = {str(atomic).lower()};\n"
            f"constexpr bool RES = {str(res).lower()};\nconstexpr int ST = {stages};\n"
            f"constexpr bool OVERLAP = {str(overlap).lower()};\n")
    src = _SOURCE.replace('extern "C"', head + 'extern "C"', 1)  # after the typedefs OUT_T names
    return name, src


def shared_bytes(gs: int, stages: int = STAGES) -> int:
    """w4gemm's stages at 64 input rows and 16 tiles, and 1 KB to align them to the swizzle."""
    return w4gemm.shared_bytes(ROWS_PER_BLOCK // 8, 2, stages, gs) + 1024


class NvrtcError(RuntimeError):
    """The sm_90a kernel could not be compiled on this machine (no NVRTC, or a compile error)."""


@functools.cache
def _nvrtc():
    names = ["libnvrtc.so.13", "libnvrtc.so.12", "libnvrtc.so"]
    found = ctypes.util.find_library("nvrtc")
    if found:
        names.append(found)
    for p in sys.path:
        names += sorted(glob.glob(os.path.join(p, "nvidia", "**", "libnvrtc.so*"), recursive=True))
    for name in names:
        try:
            return ctypes.CDLL(name)
        except OSError:
            continue
    raise NvrtcError("libnvrtc not found: the sm_90a kernel cannot be compiled here")


@functools.cache
def compile_cubin(gs: int, atomic: bool, res: bool, arch: str = "sm_90a", stages: int = STAGES,
                  min_blocks: int = MIN_BLOCKS, overlap: bool = False) -> tuple[str, bytes]:
    """NVRTC-compiled cubin of one variant: (kernel name, bytes)."""
    lib = _nvrtc()
    name, src = kernel_source(gs, atomic, res, stages, min_blocks, overlap)
    prog = ctypes.c_void_p()
    if lib.nvrtcCreateProgram(ctypes.byref(prog), src.encode(), f"{name}.cu".encode(), 0, None, None):
        raise NvrtcError("nvrtcCreateProgram failed")
    opts = [f"--gpu-architecture={arch}".encode(), b"--std=c++17"]
    try:
        rc = lib.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*opts))
        if rc:
            size = ctypes.c_size_t()
            lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
            log = ctypes.create_string_buffer(size.value)
            lib.nvrtcGetProgramLog(prog, log)
            raise NvrtcError(f"{name} did not compile for {arch}:\n{log.value.decode(errors='replace')}")
        size = ctypes.c_size_t()
        lib.nvrtcGetCUBINSize(prog, ctypes.byref(size))
        cubin = ctypes.create_string_buffer(size.value)
        lib.nvrtcGetCUBIN(prog, cubin)
        return name, cubin.raw
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))


def supports(rows: int, n: int, k: int, group_size: int) -> bool:
    """``w4gemm``'s rules, with whole 256-row blocks (the kernel's 16 tiles)."""
    return w4gemm.supports(rows, n, k, group_size, mx.float16) and n % 256 == 0


def w4_wgmma(x: mx.array, wp: mx.array, sbp: mx.array, group_size: int = 64, *,
             residual: mx.array | None = None, splits: int | None = None,
             min_blocks: int | None = None, stages: int | None = None,
             overlap: bool | None = None) -> mx.array:
    """``x @ dequantize(w).T [+ residual]`` with ``wp, sbp = w4gemm.pack(w, scales, biases,
    group_size, 16)``: fp16 x (M, K), M up to 256. Returns (M, N) fp16."""
    m, k = x.shape
    n = wp.shape[0] * 16
    groups = sbp.shape[1]
    if not supports(m, n, k, group_size):
        raise ValueError(f"w4_wgmma: {m} x {k} against {n} rows, group {group_size}: not covered")
    ks = splits or w4gemm.k_splits(n, k, 2)
    atomic = ks > 1
    st = stages or STAGES
    name, cubin = compile_cubin(group_size, atomic, residual is not None, stages=st,
                                min_blocks=MIN_BLOCKS if min_blocks is None else min_blocks,
                                overlap=OVERLAP if overlap is None else overlap)
    (y,) = mx.fast.precompiled_cuda_kernel(
        name=name, compiled_source=cubin,
        inputs=[x, wp, sbp, residual if residual is not None else x],
        output_shapes=[(m, n)], output_dtypes=[mx.float32 if atomic else mx.float16],
        scalars=[m, k, n, groups],
        grid=(n // 256 * 256, ks, -(-m // ROWS_PER_BLOCK)), threadgroup=(256, 1, 1),
        shared_memory=shared_bytes(group_size, st), init_value=0.0 if atomic else None,
        ensure_row_contiguous=True,
    )
    return y.astype(mx.float16) if atomic else y
