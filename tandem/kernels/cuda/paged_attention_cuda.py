"""Paged decode attention on CUDA, reading KV blocks in place (split-K / flash-decoding).

Pool layout is the engine's (``tandem.pipeline.kv_store``): per layer a flat
``(num_slots, n_kv_heads, head_dim)`` array, slot ``block * block_size + i`` holding
token ``i`` of ``block``; a batch addresses it with a block table ``(B, nb)`` of store
block ids and ``context_lens (B,)``. The pure-mx path (``paged_attention.paged_attention``)
gathers every row's blocks into a dense copy each step and runs SDPA on it: the KV is
read, written and read again. Here one CUDA block handles one (row, KV head, partition
of the context): it reads the partition's keys and values once for all query heads of
that KV head (GQA), keeps an online softmax, and writes a partial (max, sum, acc). A
second small kernel merges the partitions. Splitting over the context is what fills the
card for one long sequence, where a (row, head) grid has only 8 blocks.

Its companion for the step's new tokens, RoPE and the in-place KV write, is
``tandem.kernels.cuda.kv_write_cuda``.
"""

from __future__ import annotations

import functools

import mlx.core as mx

from tandem.kernels.cuda import constants
from tandem.kernels.cuda import kernel_files

_ATT_THREADS = 128  # 4 warps x 4 token slots x 8 lanes
_SLOTS = 16
MAX_PARTITION = 2048  # tokens per partition; the kernel holds its table slice in shared memory
# Smallest partition: splitting a short context buys parallelism at the price of one more
# launch (the merge); never splitting short contexts (2048) gained nothing.
MIN_PARTITION = 64

HEADER = r"""
#define PA_MAX_PART 2048
__device__ __forceinline__ float pa_f(__half v) { return __half2float(v); }
__device__ __forceinline__ float pa_f(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float pa_f(float v) { return v; }
__device__ __forceinline__ void pa_st(__half* p, float v) { *p = __float2half(v); }
__device__ __forceinline__ void pa_st(__nv_bfloat16* p, float v) { *p = __float2bfloat16(v); }
__device__ __forceinline__ void pa_st(float* p, float v) { *p = v; }
// NV consecutive values of T held raw (16-byte words when T is 2 bytes wide), so a
// load can be issued one iteration before its values are needed.
template <typename T, int NV>
struct PaRaw {
  static constexpr bool VEC = sizeof(T) == 2 && NV % 8 == 0;
  uint4 u[VEC ? NV / 8 : 1];
  T s[VEC ? 1 : NV];
  __device__ __forceinline__ void load(const T* p) {
    if constexpr (VEC) {
#pragma unroll
      for (int c = 0; c < NV / 8; ++c) u[c] = reinterpret_cast<const uint4*>(p)[c];
    } else {
#pragma unroll
      for (int i = 0; i < NV; ++i) s[i] = p[i];
    }
  }
  __device__ __forceinline__ void get(float* f) const {
    if constexpr (VEC) {
#pragma unroll
      for (int c = 0; c < NV / 8; ++c) {
        const T* h = reinterpret_cast<const T*>(&u[c]);
#pragma unroll
        for (int i = 0; i < 8; ++i) f[c * 8 + i] = pa_f(h[i]);
      }
    } else {
#pragma unroll
      for (int i = 0; i < NV; ++i) f[i] = pa_f(s[i]);
    }
  }
};
template <typename T, int NV>
__device__ __forceinline__ void pa_load(const T* p, float* f) {
  if constexpr (sizeof(T) == 2 && NV % 8 == 0) {
#pragma unroll
    for (int c = 0; c < NV / 8; ++c) {
      uint4 u = reinterpret_cast<const uint4*>(p)[c];
      const T* h = reinterpret_cast<const T*>(&u);
#pragma unroll
      for (int i = 0; i < 8; ++i) f[c * 8 + i] = pa_f(h[i]);
    }
  } else {
#pragma unroll
    for (int i = 0; i < NV; ++i) f[i] = pa_f(p[i]);
  }
}
"""

# The prologue's query load: decode_attention_cuda's tile-wise kernel with the KV write
# swaps it for one that rotates the queries from the fused QKV row.
_Q_LOAD = r"""  __shared__ __align__(16) float sm_q[G][D];
  for (int e = tid; e < G * D; e += blockDim.x)
    sm_q[e / D][e % D] = pa_f(q[((size_t)b * KVH * G + h * G) * D + e]) * sc;
"""

# The partition's slice of the block table (tokens [t0, t1) of row b), read once into
# shared memory: a table load per token would put a second dependent global load in
# front of every K/V load. Shared with decode_attention_cuda's one-launch kernel.
_TABLE_SLICE = r"""
  constexpr int MAXB = PA_MAX_PART / BS + 2;
  __shared__ int sm_tbl[MAXB];
  const int fb = t0 / BS;
  const int nblk = t1 > t0 ? (t1 - 1) / BS - fb + 1 : 0;
  for (int i = tid; i < nblk; i += blockDim.x) sm_tbl[i] = table[(size_t)b * NB + fb + i];
"""

# Both attention kernels start alike: which (row, KV head, partition) this block takes,
# the group's scaled queries and the partition's slice of the block table in shared
# memory, and the online-softmax state (NACC accumulators per query head and lane).
_ATT_PROLOGUE = r"""
  const int part = blockIdx.x;
  const int h = blockIdx.y;
  const int b = blockIdx.z;
  const int npart = gridDim.x;
  const int tid = threadIdx.x;
  const int warp = tid >> 5, lane = tid & 31;
  const int NB = table_shape[1];
  const int PART = CONSTS ? PART_C : (int)params[1];
  const int len = lens[b];
  const int t0 = part * PART;
  const int t1 = min(len, t0 + PART);
  const float sc = CONSTS ? __int_as_float(SCALE_BITS) : params[0];

  // The scaled queries of the group live in shared memory, not registers: registers
  // bound how many blocks an SM holds, and that bounds the K/V loads in flight.
""" + _Q_LOAD + _TABLE_SLICE + r"""
  float mx_[G], l_[G], acc[G][NACC];
#pragma unroll
  for (int g = 0; g < G; ++g) {
    mx_[g] = -INFINITY;
    l_[g] = 0.f;
#pragma unroll
    for (int i = 0; i < NACC; ++i) acc[g][i] = 0.f;
  }
"""

# Pieces of the v2 kernel that ``decode_attention_cuda`` shares. One token per 8-lane group
# (kf, vf: its K and V in fp32, valid: inside the partition): the scores of the group's
# query heads and the online-softmax update.
_V2_TOKEN = r"""
#pragma unroll
    for (int g = 0; g < G; ++g) {
      float s = 0.f;
      if constexpr (DL % 4 == 0) {
        const float4* qv = reinterpret_cast<const float4*>(&sm_q[g][sub * DL]);
#pragma unroll
        for (int i = 0; i < DL / 4; ++i) {
          const float4 qq = qv[i];
          s = fmaf(qq.x, kf[4 * i], s);
          s = fmaf(qq.y, kf[4 * i + 1], s);
          s = fmaf(qq.z, kf[4 * i + 2], s);
          s = fmaf(qq.w, kf[4 * i + 3], s);
        }
      } else {
#pragma unroll
        for (int i = 0; i < DL; ++i) s = fmaf(sm_q[g][sub * DL + i], kf[i], s);
      }
      s += __shfl_xor_sync(0xffffffffu, s, 1);
      s += __shfl_xor_sync(0xffffffffu, s, 2);
      s += __shfl_xor_sync(0xffffffffu, s, 4);
      if (!valid) continue;
      const float mn = fmaxf(mx_[g], s);
      const float c = __expf(mx_[g] - mn);
      const float pr = __expf(s - mn);
      l_[g] = l_[g] * c + pr;
#pragma unroll
      for (int i = 0; i < DL; ++i) acc[g][i] = fmaf(acc[g][i], c, pr * vf[i]);
      mx_[g] = mn;
    }
"""

# The warp's 4 token groups (lanes differing in bits 3 and 4) into one softmax state.
_V2_WARP_MERGE = r"""
  // Merge the 4 token groups of a warp (lanes differing in bits 3 and 4).
#pragma unroll
  for (int g = 0; g < G; ++g) {
#pragma unroll
    for (int o = 8; o <= 16; o <<= 1) {
      const float om = __shfl_xor_sync(0xffffffffu, mx_[g], o);
      const float ol = __shfl_xor_sync(0xffffffffu, l_[g], o);
      const float mn = fmaxf(mx_[g], om);
      const float ca = (mx_[g] == -INFINITY) ? 0.f : __expf(mx_[g] - mn);
      const float cb = (om == -INFINITY) ? 0.f : __expf(om - mn);
      l_[g] = l_[g] * ca + ol * cb;
#pragma unroll
      for (int i = 0; i < DL; ++i) {
        const float oa = __shfl_xor_sync(0xffffffffu, acc[g][i], o);
        acc[g][i] = acc[g][i] * ca + oa * cb;
      }
      mx_[g] = mn;
    }
  }
"""

# Each warp's state into shared memory, for the merge of the 4 warps.
_V2_STAGE_WARPS = r"""
  // Merge the 4 warps through shared memory.
  __shared__ float sm_m[4][G], sm_l[4][G];
  __shared__ float sm_acc[4][G][D];
  if (lane < 8) {
#pragma unroll
    for (int g = 0; g < G; ++g) {
#pragma unroll
      for (int i = 0; i < DL; ++i) sm_acc[warp][g][sub * DL + i] = acc[g][i];
      if (sub == 0) { sm_m[warp][g] = mx_[g]; sm_l[warp][g] = l_[g]; }
    }
  }
"""

# Template: T, D (head dim), KVH, G (query heads per KV head), BS (block size), SINGLE
# (one partition: write the final output); shapes and the partition length stay runtime
# (each template variant is an NVRTC compile).
# Inputs: q (B, KVH*G, D), k_pool/v_pool (S, KVH, D), table (B, nb) int32,
# lens (B,) int32, params (2,) float32 = [scale, partition tokens].
# Output: out (B, KVH*G, NPART, D + 2) float32 = per partition [acc, max, sum], or with
# SINGLE the attention output (B, KVH*G * D) in T.
_ATT_SOURCE = r"""
  constexpr int DL = D / 8;                 // dims per lane
  constexpr int NACC = DL;
""" + _ATT_PROLOGUE + r"""
  const int sub = lane & 7;                 // which D/8 slice of the head
  const int slot = warp * 4 + (lane >> 3);  // which token this 8-lane group takes
  __syncthreads();

  // K/V of this lane's next token are loaded one iteration ahead (raw), so the loads of
  // one iteration overlap the arithmetic of the previous one.
  PaRaw<T, DL> nk, nv;
  if (t0 + slot < t1) {
    const int t = t0 + slot;
    const size_t base = (((size_t)sm_tbl[t / BS - fb] * BS + (t % BS)) * KVH + h) * D + sub * DL;
    nk.load(k_pool + base);
    nv.load(v_pool + base);
  }

  // Every lane runs the same number of iterations: the full-mask shuffles below would
  // deadlock if the token groups of a warp left the loop at different times (they did,
  // for partitions whose length is not a multiple of 16).
  for (int tb = t0; tb < t1; tb += 16) {
    const int t = tb + slot;
    const bool valid = t < t1;
    float kf[DL], vf[DL];
    if (valid) {
      nk.get(kf);
      nv.get(vf);
    } else {
#pragma unroll
      for (int i = 0; i < DL; ++i) { kf[i] = 0.f; vf[i] = 0.f; }
    }
    if (t + 16 < t1) {
      const int tn = t + 16;
      const size_t base = (((size_t)sm_tbl[tn / BS - fb] * BS + (tn % BS)) * KVH + h) * D + sub * DL;
      nk.load(k_pool + base);
      nv.load(v_pool + base);
    }
""" + _V2_TOKEN + r"""  }

""" + _V2_WARP_MERGE + _V2_STAGE_WARPS

# The 4 warps' (max, sum, acc) in shared memory -> the block's output, for both kernels.
# Inside a loop over e = (query head g, dim d): the 4 warps' states for (g, d) combined
# into the block's max mn, sum lsum and accumulator a.
_WARPS_COMBINE = r"""
    const int g = e / D, d = e % D;
    float mn = -INFINITY;
#pragma unroll
    for (int w = 0; w < 4; ++w) mn = fmaxf(mn, sm_m[w][g]);
    float lsum = 0.f, a = 0.f;
#pragma unroll
    for (int w = 0; w < 4; ++w) {
      const float c = (sm_m[w][g] == -INFINITY) ? 0.f : __expf(sm_m[w][g] - mn);
      lsum += sm_l[w][g] * c;
      a += sm_acc[w][g][d] * c;
    }
"""

_MERGE_TAIL = r"""
  __syncthreads();
  for (int e = tid; e < G * D; e += blockDim.x) {
""" + _WARPS_COMBINE + r"""    if constexpr (SINGLE) {
      // One partition covers every row: write the normalized result, no merge kernel.
      pa_st(out + ((size_t)b * KVH * G + h * G + g) * D + d, lsum > 0.f ? a / lsum : 0.f);
    } else {
      auto* o = out + (((size_t)b * KVH * G + h * G + g) * npart + part) * (D + 2);
      pa_st(o + d, a);
      if (d == 0) { pa_st(o + D, mn); pa_st(o + D + 1, lsum); }
    }
  }
"""


# Tile-wise attention (``v6``): the same grid, inputs and outputs as the kernel above,
# with a tile-wise softmax. Each warp takes 32-token tiles:
# in the score phase a lane owns one token and dots its whole K row with the group's
# queries (no shuffles per token); the tile's max and one rescale of the accumulators
# follow; in the value phase lanes own D/32 dims and walk the tile's tokens. The kernel
# above rescales every accumulator with two exponentials per token and query head, and on
# the H200 it stayed at 0.85-1.3 TB/s of KV whatever the grid.
_ATT_TILE_SOURCE = r"""
  constexpr int DPL = D / 32;               // value dims per lane
  constexpr int KW = D / 8;                 // 16-byte words per K row
  constexpr int NACC = DPL;
""" + _ATT_PROLOGUE + r"""
  __shared__ float sm_p[4][32][G];
  __shared__ __align__(16) T sm_v[4][32][D];
  __syncthreads();

  // Warp-uniform loop: every lane of a warp runs the same tiles (full-mask shuffles).
  for (int tb = t0 + 32 * warp; tb < t1; tb += 128) {
    const int t = tb + lane;
    const bool valid = t < t1;
    const int nv = min(32, t1 - tb);
    uint4 kr[KW];
    if (valid) {
      const T* kp = k_pool + (((size_t)sm_tbl[t / BS - fb] * BS + (t % BS)) * KVH + h) * D;
#pragma unroll
      for (int c = 0; c < KW; ++c) kr[c] = reinterpret_cast<const uint4*>(kp)[c];
    }
    // The tile's V loads go out with its K loads (they do not depend on the scores), so
    // a tile costs one memory latency, not five (K, then V in four chunks of 8 tokens:
    // the first tile-wise kernel, 197 us at batch 64 against 110): into shared memory by
    // cp.async, 16-byte chunks, a warp-wide copy covering two whole rows, so no registers
    // are held while they are in flight (into registers instead, 226 against 128 of them,
    // it lost to the tensor-core kernel at every batch and is gone).
#pragma unroll
    for (int k = 0; k < KW; ++k) {
      const int ci = lane + 32 * k;
      const int jv = ci / KW, w = ci % KW;
      if (jv < nv) {
        const int ti = tb + jv;
        const T* vp = v_pool + (((size_t)sm_tbl[ti / BS - fb] * BS + (ti % BS)) * KVH + h) * D + w * 8;
        const unsigned dst = (unsigned)__cvta_generic_to_shared(&sm_v[warp][jv][w * 8]);
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" :: "r"(dst), "l"(vp));
      }
    }
    asm volatile("cp.async.commit_group;\n" ::);

    float s[G];
#pragma unroll
    for (int g = 0; g < G; ++g) s[g] = -INFINITY;
    if (valid) {
#pragma unroll
      for (int g = 0; g < G; ++g) s[g] = 0.f;
#pragma unroll
      for (int c = 0; c < KW; ++c) {
        const T* kh = reinterpret_cast<const T*>(&kr[c]);
#pragma unroll
        for (int g = 0; g < G; ++g) {
          const float4 qa = *reinterpret_cast<const float4*>(&sm_q[g][c * 8]);
          const float4 qb = *reinterpret_cast<const float4*>(&sm_q[g][c * 8 + 4]);
          float a = s[g];
          a = fmaf(qa.x, pa_f(kh[0]), a); a = fmaf(qa.y, pa_f(kh[1]), a);
          a = fmaf(qa.z, pa_f(kh[2]), a); a = fmaf(qa.w, pa_f(kh[3]), a);
          a = fmaf(qb.x, pa_f(kh[4]), a); a = fmaf(qb.y, pa_f(kh[5]), a);
          a = fmaf(qb.z, pa_f(kh[6]), a); a = fmaf(qb.w, pa_f(kh[7]), a);
          s[g] = a;
        }
      }
    }
    // One max and one rescale per tile and query head (lane 0's token is always valid).
#pragma unroll
    for (int g = 0; g < G; ++g) {
      float mt = s[g];
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) mt = fmaxf(mt, __shfl_xor_sync(0xffffffffu, mt, o));
      const float mn = fmaxf(mx_[g], mt);
      const float c = (mx_[g] == -INFINITY) ? 0.f : __expf(mx_[g] - mn);
      const float p = valid ? __expf(s[g] - mn) : 0.f;
      l_[g] = l_[g] * c + p;   // this lane's tokens only; summed over lanes at the end
#pragma unroll
      for (int i = 0; i < DPL; ++i) acc[g][i] *= c;
      mx_[g] = mn;
      sm_p[warp][lane][g] = p;
    }
    asm volatile("cp.async.wait_group 0;\n" ::);
    __syncwarp();
#pragma unroll
    for (int j = 0; j < 32; ++j) {
      if (j < nv) {
        float vf[DPL];
#pragma unroll
        for (int d = 0; d < DPL; ++d) vf[d] = pa_f(sm_v[warp][j][lane * DPL + d]);
#pragma unroll
        for (int g = 0; g < G; ++g) {
          const float pg = sm_p[warp][j][g];
#pragma unroll
          for (int d = 0; d < DPL; ++d) acc[g][d] = fmaf(pg, vf[d], acc[g][d]);
        }
      }
    }
    __syncwarp();
  }
#pragma unroll
  for (int g = 0; g < G; ++g)
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) l_[g] += __shfl_xor_sync(0xffffffffu, l_[g], o);

  __shared__ float sm_m[4][G], sm_l[4][G];
  __shared__ float sm_acc[4][G][D];
#pragma unroll
  for (int g = 0; g < G; ++g) {
#pragma unroll
    for (int i = 0; i < DPL; ++i) sm_acc[warp][g][lane * DPL + i] = acc[g][i];
    if (lane == 0) { sm_m[warp][g] = mx_[g]; sm_l[warp][g] = l_[g]; }
  }
"""

# Tensor-core attention (``tc``): the tile-wise kernels' grid, inputs,
# outputs and 32-token warp tiles, with both products on ``mma.sync.m16n8k16``. The group's
# G query heads are the A operand's rows (G <= 8 of 16; the other rows are zero), so one
# mma scores 8 tokens against every query head of the group, and the probabilities go
# back in as A for the value product without leaving registers (the C fragment of two
# 8-token score tiles is the A fragment of a 16-token step). At batch 64 v6 took 80 us
# (cold, 576-token rows) where its loads alone took 50: its fp32 FMAs and
# half-to-float conversions, ~1,000 a lane a tile, are what the tensor cores remove.
#
# K and V go by cp.async into shared memory, 16 lanes a row (the loads alone read 3 TB/s
# at batch 64 that way), rows XOR-swizzled by 16-byte word so that ``ldmatrix``
# reads 8 rows of one word without bank conflicts: plain for K's B fragments, ``.trans``
# for V's (the value product needs V transposed). Rows past the partition are
# zero-filled, as a zero probability times an uninitialized NaN would still be NaN.
# K loaded from global memory straight into B fragments (each lane quad taking whole
# 16-byte words of a token's row, the query's A fragment permuted to match) held 64 more
# registers (210, 2 blocks an SM) and was slower: 67.6 against 52.7 us.
TC_HEADER = r"""
__device__ __forceinline__ void tc_mma(const __half*, float* c, unsigned a0, unsigned a2, unsigned b0,
                                       unsigned b1) {
  float u2, u3;  // rows 8-15 of the product: the A rows there are zero
  asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%10,%11,%12,%13};\n"
      : "=f"(c[0]), "=f"(c[1]), "=f"(u2), "=f"(u3)
      : "r"(a0), "r"(0u), "r"(a2), "r"(0u), "r"(b0), "r"(b1), "f"(c[0]), "f"(c[1]), "f"(0.f), "f"(0.f));
}
__device__ __forceinline__ void tc_mma(const __nv_bfloat16*, float* c, unsigned a0, unsigned a2, unsigned b0,
                                       unsigned b1) {
  float u2, u3;
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%10,%11,%12,%13};\n"
      : "=f"(c[0]), "=f"(c[1]), "=f"(u2), "=f"(u3)
      : "r"(a0), "r"(0u), "r"(a2), "r"(0u), "r"(b0), "r"(b1), "f"(c[0]), "f"(c[1]), "f"(0.f), "f"(0.f));
}
__device__ __forceinline__ unsigned tc_pack(const __half*, float lo, float hi) {
  __half2 h = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<unsigned*>(&h);
}
__device__ __forceinline__ unsigned tc_pack(const __nv_bfloat16*, float lo, float hi) {
  __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<unsigned*>(&h);
}
"""

_ATT_TC_SOURCE = r"""
  constexpr int NACC = 1;                   // the prologue's accumulators stay unused
  constexpr int KW = D / 8;                 // 16-byte words per row
  constexpr int KS = D / 16;                // k-steps of the score product
  constexpr int NT = D / 8;                 // 8-wide D tiles of the value product
""" + _ATT_PROLOGUE + r"""
  // The warps' V and K tiles, in dynamic shared memory (64 KB at D = 128, over the 48 KB
  // a block may declare statically).
  extern __shared__ __align__(128) unsigned char tc_dyn[];
  T (*sm_v)[32][D] = reinterpret_cast<T (*)[32][D]>(tc_dyn);
  T (*sm_k)[32][D] = reinterpret_cast<T (*)[32][D]>(tc_dyn + 4 * 32 * D * sizeof(T));
  __syncthreads();

  const int gq = lane >> 2, cq = lane & 3;  // fragment row (query head) and column pair
  const T* tag = nullptr;
  unsigned qa[KS][2];
#pragma unroll
  for (int ks = 0; ks < KS; ++ks) {
    // The queries as T, unscaled: sm_q holds T values times sc, which divides back exactly.
    const int d0 = 16 * ks + 2 * cq, d2 = d0 + 8;
    float q0 = 0.f, q1 = 0.f, q2 = 0.f, q3 = 0.f;
    if (gq < G) {
      q0 = sm_q[gq][d0] / sc;
      q1 = sm_q[gq][d0 + 1] / sc;
      q2 = sm_q[gq][d2] / sc;
      q3 = sm_q[gq][d2 + 1] / sc;
    }
    qa[ks][0] = tc_pack(tag, q0, q1);
    qa[ks][1] = tc_pack(tag, q2, q3);
  }
  float m = -INFINITY, l = 0.f;             // this lane's query head gq (rows >= G: unused)
  float o[NT][2];
#pragma unroll
  for (int n = 0; n < NT; ++n) o[n][0] = o[n][1] = 0.f;

  // Warp-uniform loop (mma.sync and the shuffles need the whole warp).
  for (int tb = t0 + 32 * warp; tb < t1; tb += 128) {
    const int nv = min(32, t1 - tb);
    // Rows past the partition are zero-filled (src-size 0) from a valid address.
#pragma unroll 1  // unrolled, the 16 addresses held at once cost 30 registers
    for (int k = 0; k < KW; ++k) {
      const int ci = lane + 32 * k;
      const int jv = ci / KW, w = ci % KW;
      const int ti = tb + min(jv, nv - 1);
      const size_t off = (((size_t)sm_tbl[ti / BS - fb] * BS + (ti % BS)) * KVH + h) * D + w * 8;
      const int sw = (w ^ (jv & 7)) * 8;
      const unsigned kd = (unsigned)__cvta_generic_to_shared(&sm_k[warp][jv][sw]);
      asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" :: "r"(kd), "l"(k_pool + off), "r"(jv < nv ? 16 : 0));
      const unsigned vd = (unsigned)__cvta_generic_to_shared(&sm_v[warp][jv][sw]);
      asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" :: "r"(vd), "l"(v_pool + off), "r"(jv < nv ? 16 : 0));
    }
    asm volatile("cp.async.commit_group;\n" ::);

    asm volatile("cp.async.wait_group 0;\n" ::);
    __syncwarp();
    float s[4][2] = {};
#pragma unroll
    for (int ks = 0; ks < KS; ++ks) {
#pragma unroll
      for (int hf = 0; hf < 2; ++hf) {
        // Matrices: tokens +0-7 / +8-15 of this half, D words 2ks / 2ks + 1.
        const int mi = lane >> 3;
        const int row = 16 * hf + (mi >> 1) * 8 + (lane & 7);
        const int word = 2 * ks + (mi & 1);
        const unsigned addr = (unsigned)__cvta_generic_to_shared(&sm_k[warp][row][(word ^ (row & 7)) * 8]);
        unsigned b0, b1, b2, b3;
        asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                     : "=r"(b0), "=r"(b1), "=r"(b2), "=r"(b3) : "r"(addr));
        tc_mma(tag, s[2 * hf], qa[ks][0], qa[ks][1], b0, b1);
        tc_mma(tag, s[2 * hf + 1], qa[ks][0], qa[ks][1], b2, b3);
      }
    }
    float mt = -INFINITY;
#pragma unroll
    for (int nt = 0; nt < 4; ++nt) {
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        s[nt][i] = (nt * 8 + 2 * cq + i < nv) ? s[nt][i] * sc : -INFINITY;
        mt = fmaxf(mt, s[nt][i]);
      }
    }
    // Token tb (column 0 of lane quad 0's first tile) is always valid: mt is finite.
    mt = fmaxf(mt, __shfl_xor_sync(0xffffffffu, mt, 1));
    mt = fmaxf(mt, __shfl_xor_sync(0xffffffffu, mt, 2));
    const float mn = fmaxf(m, mt);
    const float corr = (m == -INFINITY) ? 0.f : __expf(m - mn);
    m = mn;
    unsigned pa[4];
    float ps = 0.f;
#pragma unroll
    for (int nt = 0; nt < 4; ++nt) {
      const float p0 = __expf(s[nt][0] - mn), p1 = __expf(s[nt][1] - mn);
      ps += p0 + p1;
      pa[nt] = tc_pack(tag, p0, p1);
    }
    l = l * corr + ps;
#pragma unroll
    for (int n = 0; n < NT; ++n) { o[n][0] *= corr; o[n][1] *= corr; }

    __syncwarp();
#pragma unroll
    for (int k2 = 0; k2 < 2; ++k2) {
#pragma unroll
      for (int n = 0; n < NT; n += 2) {
        // Matrices: tokens +0-7 / +8-15 of this k-step, D tiles n / n + 1.
        const int mi = lane >> 3;
        const int row = 16 * k2 + (mi & 1) * 8 + (lane & 7);
        const int word = n + (mi >> 1);
        const unsigned addr = (unsigned)__cvta_generic_to_shared(&sm_v[warp][row][(word ^ (row & 7)) * 8]);
        unsigned b0, b1, b2, b3;
        asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                     : "=r"(b0), "=r"(b1), "=r"(b2), "=r"(b3) : "r"(addr));
        tc_mma(tag, o[n], pa[2 * k2], pa[2 * k2 + 1], b0, b1);
        tc_mma(tag, o[n + 1], pa[2 * k2], pa[2 * k2 + 1], b2, b3);
      }
    }
    __syncwarp();
  }
  l += __shfl_xor_sync(0xffffffffu, l, 1);
  l += __shfl_xor_sync(0xffffffffu, l, 2);

  // The warps' states go where their V tiles were (static shared memory stops at 48 KB):
  // every warp has to be done with its tiles first.
  __shared__ float sm_m[4][G], sm_l[4][G];
  static_assert(sizeof(float) * 4 * G * D <= sizeof(T) * 4 * 32 * D, "sm_acc does not fit in sm_v");
  float (*sm_acc)[G][D] = reinterpret_cast<float (*)[G][D]>(&sm_v[0][0][0]);
  __syncthreads();
  if (gq < G) {
#pragma unroll
    for (int n = 0; n < NT; ++n) {
      sm_acc[warp][gq][n * 8 + 2 * cq] = o[n][0];
      sm_acc[warp][gq][n * 8 + 2 * cq + 1] = o[n][1];
    }
    if (cq == 0) { sm_m[warp][gq] = m; sm_l[warp][gq] = l; }
  }
"""

def tc_smem_bytes(head_dim: int, dtype) -> int:
    """Dynamic shared memory of a tensor-core block: the 4 warps' K and V tiles."""
    return 2 * 4 * 32 * head_dim * dtype.size


def tc_supported(dtype, head_dim: int, group: int) -> bool:
    """Whether the tensor-core kernel covers this dtype, head size and query heads per KV head."""
    return dtype in (mx.float16, mx.bfloat16) and head_dim in (64, 128) and group <= 8


def kernel_header(kind: str) -> str:
    """The helpers a kernel of source ``kind`` (``v2``, ``tile`` or ``tc``) is compiled with."""
    return HEADER + (TC_HEADER if kind == "tc" else "")


def tile_variant(version: str, dtype, head_dim: int, group: int) -> tuple[str, list, int]:
    """A tile-wise version (v6 or tc; tc falls back to v6 where it does not apply) ->
    (source kind ``tile`` / ``tc``, the template arguments that pick the variant, bytes of
    dynamic shared memory)."""
    if version == "tc" and tc_supported(dtype, head_dim, group):
        return "tc", [], tc_smem_bytes(head_dim, dtype)
    return "tile", [], 0


TILE_MIN_BATCH = 16
"""From how many rows decode attention runs ``tc`` (tile-wise on the tensor cores, K and V
by cp.async; ``v6``, tile-wise on the CUDA cores with V by cp.async into shared memory,
where ``tc`` does not apply: more than 8 query heads a KV head), and below it ``v2`` (per-token
online softmax). The tile-wise kernels need a 2-byte dtype and head_dim 64 or 128 (else
v2). At batch 16-128, 8B shape, tc took 24-101 us against v6's 42-127 and v2's 76-145,
and the engine at batch 32-64 gained 5-15% tok/s; below 16 rows decode runs
``decode_attention_cuda`` (its own one-launch kernel) anyway. A tile-wise kernel that
held each tile's V in registers lost to tc at every batch and is gone."""


def auto_kernel(batch: int) -> str:
    """The decode attention kernel for ``batch`` rows: v2 below ``TILE_MIN_BATCH``, tc from there."""
    return "v2" if batch < TILE_MIN_BATCH else "tc"


# Template: T, D. Inputs: part (B, H, NPART, D + 2). Output: o (B, H, D) in T.
_REDUCE_SOURCE = r"""
  const int bh = blockIdx.x;
  const int npart = part_shape[2];
  const float* p = part + (size_t)bh * npart * (D + 2);
  float mn = -INFINITY;
  for (int i = 0; i < npart; ++i) mn = fmaxf(mn, p[i * (D + 2) + D]);
  for (int d = threadIdx.x; d < D; d += blockDim.x) {
    float lsum = 0.f, a = 0.f;
    for (int i = 0; i < npart; ++i) {
      const float m = p[i * (D + 2) + D];
      const float c = (m == -INFINITY) ? 0.f : __expf(m - mn);
      lsum += p[i * (D + 2) + D + 1] * c;
      a += p[i * (D + 2) + d] * c;
    }
    pa_st(&o[(size_t)bh * D + d], lsum > 0.f ? a / lsum : 0.f);
  }
"""

_KERNEL_SOURCES = {"v2": ("tandem_paged_decode", _ATT_SOURCE), "tile": ("tandem_paged_decode_tile", _ATT_TILE_SOURCE),
                   "tc": ("tandem_paged_decode_tc", _ATT_TC_SOURCE)}


@functools.cache
def _attention_kernel(kind: str, shared_bytes: int = 0):
    name, source = _KERNEL_SOURCES[kind]
    return kernel_files.cuda_kernel(
        name=name,
        input_names=["q", "k_pool", "v_pool", "table", "lens", "params"],
        output_names=["out"],
        source=source + _MERGE_TAIL,
        header=kernel_header(kind),
        shared_memory=shared_bytes,
    )


@functools.cache
def _reduce_kernel():
    # A merge spread over the block's threads (block reductions) gained nothing over this
    # walk: below 16 rows decode runs ``decode_attention_cuda``, which merges itself.
    return kernel_files.cuda_kernel(
        name="tandem_paged_reduce",
        input_names=["part"],
        output_names=["o"],
        source=_REDUCE_SOURCE,
        header=HEADER,
    )


def i32(a: mx.array) -> mx.array:
    # No astype node when it is already int32: every op costs ~10 us of MLX dispatch.
    return a if a.dtype == mx.int32 else a.astype(mx.int32)


@functools.cache
def _params(scale: float, part: int) -> mx.array:
    a = mx.array([scale, float(part)], dtype=mx.float32)
    mx.eval(a)  # usable from any thread (see quantized_matmul._dummy)
    return a


ATT_WAVES = 4.0
TC_WAVES = 1.0
"""``ATT_WAVES`` for the tensor-core kernel, which is fastest unsplit: at batch 16 and
576-token contexts 24.1 us in one partition against 34.2 + 4.2 (merge) in three."""


def choose_partition(batch: int, n_kv_heads: int, max_len: int, sms: int = 132) -> int:
    """Context tokens per partition: small enough that B x KVH x partitions covers the
    card about ``ATT_WAVES`` (``TC_WAVES`` for the tc kernel) times over, at least
    ``MIN_PARTITION`` so each partition amortizes its merge. When one partition covers
    every row the merge kernel is skipped (one launch less)."""
    target = (TC_WAVES if auto_kernel(batch) == "tc" else ATT_WAVES) * sms
    part = min(MAX_PARTITION, max(16, MIN_PARTITION))
    while part < MAX_PARTITION and batch * n_kv_heads * -(-max_len // part) > target:
        part *= 2
    return part


def paged_decode_attention(q: mx.array, k_pool: mx.array, v_pool: mx.array, table: mx.array,
                           lens: mx.array, scale: float, block_size: int, max_len: int,
                           partition: int | None = None, flat: bool = False,
                           kernel: str | None = None) -> mx.array:
    """One query token per row over its paged context, on CUDA.

    q: (B, H, D); pools: (S, KVH, D); table: (B, nb) int32 store block ids covering
    ``lens[b]`` tokens; lens: (B,) int32 (>= 1); max_len: host-side max of lens (sets
    the partition grid). Returns (B, H, D) in q's dtype, or (B, H * D) with ``flat`` (the
    o-projection's input, without a reshape op).
    """
    B, H, D = q.shape
    kvh = k_pool.shape[1]
    if H % kvh or D % 8 or D > 256:
        raise ValueError(f"paged_decode_attention: unsupported heads {H}/{kvh} or head_dim {D}")
    part = partition or choose_partition(B, kvh, max_len)
    if not 1 <= part <= MAX_PARTITION:
        raise ValueError(f"paged_decode_attention: partition {part} outside 1..{MAX_PARTITION}")
    npart = max(1, -(-max_len // part))
    single = npart == 1
    out_shape = ((B, H * D) if flat else (B, H, D)) if single else (B, H, npart, D + 2)
    version = kernel or auto_kernel(B)
    if version not in ("v2", "v6", "tc"):
        raise ValueError(f"paged_decode_attention: unknown kernel {version!r} (v2, v6 or tc)")
    if version != "v2" and (q.dtype not in (mx.float16, mx.bfloat16) or D not in (64, 128)):
        version = "v2"
    template = [("T", q.dtype), ("D", D), ("KVH", kvh), ("G", H // kvh), ("BS", block_size),
                ("SINGLE", single)] + constants.attention_template(float(scale), part)
    kind, smem = "v2", 0
    if version != "v2":
        kind, variant, smem = tile_variant(version, q.dtype, D, H // kvh)
        template += variant
    (partials,) = _attention_kernel(kind, smem)(
        inputs=[q, k_pool, v_pool, i32(table), i32(lens), _params(float(scale), part)],
        template=template,
        grid=(npart * _ATT_THREADS, kvh, B),
        threadgroup=(_ATT_THREADS, 1, 1),
        output_shapes=[out_shape],
        output_dtypes=[q.dtype if single else mx.float32],
    )
    if single:
        return partials
    return merge_partials(partials, q.dtype, flat)


def merge_partials(partials: mx.array, dtype, flat: bool) -> mx.array:
    """The split kernel's partials (B, H, NPART, D + 2) -> (B, H, D) in ``dtype`` (or
    (B, H * D) with ``flat``)."""
    B, H, D = partials.shape[0], partials.shape[1], partials.shape[3] - 2
    (o,) = _reduce_kernel()(
        inputs=[partials],
        template=[("T", dtype), ("D", D)],
        grid=(B * H * min(D, 128), 1, 1),
        threadgroup=(min(D, 128), 1, 1),
        output_shapes=[(B, H * D) if flat else (B, H, D)],
        output_dtypes=[dtype],
    )
    return o


def paged_decode_attention_reference(q: mx.array, k_pool: mx.array, v_pool: mx.array,
                                     table: mx.array, lens: mx.array, scale: float,
                                     block_size: int) -> mx.array:
    """Row by row in fp32 with explicit softmax over exactly ``lens[b]`` tokens."""
    B, H, D = q.shape
    kvh = k_pool.shape[1]
    out = []
    for b in range(B):
        n = int(lens[b].item())
        blocks = table[b, : -(-n // block_size)]
        slots = (blocks[:, None] * block_size + mx.arange(block_size)[None, :]).reshape(-1)[:n]
        k = mx.repeat(k_pool[slots].astype(mx.float32).transpose(1, 0, 2), H // kvh, axis=0)
        v = mx.repeat(v_pool[slots].astype(mx.float32).transpose(1, 0, 2), H // kvh, axis=0)
        s = (q[b].astype(mx.float32)[:, None, :] * scale) @ k.transpose(0, 2, 1)  # (H, 1, n)
        out.append((mx.softmax(s, axis=-1) @ v)[:, 0, :])
    return mx.stack(out).astype(q.dtype)
