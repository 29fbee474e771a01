"""A one-row decode step's layer tail in one persistent launch: o + residual, rms_norm,
gate/up + swiglu, down + residual, and the next layer's rms_norm + QKV.

At one row the step is set by launches as much as by bytes (docs/benchmarks/gpu_decode.md,
runs 47-50): seven kernels a layer, each ~10-14 us of the engine thread's time in MLX and
a ramp up and down of the GPU's loads. After the attention, everything up to the next
layer's attention is four products over one row, each needing all of the previous one's
output: so one grid, one block per SM (all resident at once), with a grid-wide barrier
where a product needs its whole input:

    A  h2 = h + o(a)                      barrier
    B  g  = swiglu(gate_up(norm2(h2)))    barrier
    C  h' = h2 + down(g)                  barrier (when there is a next layer)
    D  y  = qkv'(norm1'(h'))

Each phase streams its weights as ``qgemv``'s streaming kernel does (a group of threads
covers one row's K, one 16-byte chunk of 32 weights a thread, the input in registers), but
through ``cp.async`` into shared memory, ``STAGES - 1`` passes of ``ROWS`` rows ahead; a
named barrier a group and pass guards the stages (a row's scales and biases are copied
by a few threads and read by all). Units of rows are handed out by ticket counters. Before a
grid barrier every thread already issues the next phase's first passes: the weights do
not depend on the barrier, so their latency hides behind it. The rms norms are computed
by every block from the whole input row (4 K fp16 values) instead of by a launch of their
own.

The barrier's counter is one int32 pair (arrivals, generation) that the last arriving
block resets, and the phases' ticket counters sit beside it, zeroed at barriers every block
has passed, so one buffer serves every layer and every step (the layers run in order on
one stream). A block that spins past ~2 s traps: a launch that cannot have every block
resident fails with an error instead of hanging the device.

What the H200 showed (runs 86-87, docs/benchmarks/gpu_decode.md): correct (10/10 GPU
tests, bit-equal to the separate kernels over 8 chained layers), but slower on the GPU,
77.8 us a layer against 59.7 for the separate kernels: the phases stream about as fast as
``qgemv`` does alone (gate/up 28.0 us median a block, down 14.2), and each grid barrier,
with the sums and the next prologue, costs 5-7 us where the bare barrier took 1.9. The
engine thread's tick fell from 2.2-3.4 to 1.5-2.0 ms, but the GPU then set the step: batch 1
252 / 253 tok/s against 299 / 283. Hence off by default.

Layout is MLX's affine 4-bit (fp16 scales and biases, groups of 32-128); K % 1024 == 0
for every product. ``decode_block_reference`` is the same chain through ``qgemv``'s
reference.
"""

from __future__ import annotations

import functools
import os

import mlx.core as mx

from tandem.kernels.cuda import constants
from tandem.kernels.cuda import kernel_files
from tandem.kernels.cuda import qgemv as qg
from tandem.kernels.cuda import w4wgmma

THREADS = 512
ROWS = int(os.environ.get("TANDEM_BLOCK_ROWS", "4"))
STAGES = int(os.environ.get("TANDEM_BLOCK_STAGES", "5"))
ENABLED = os.environ.get("TANDEM_DECODE_BLOCK", "0") == "1"
"""Whether one-row decode steps run the layer tail as this one launch (``1``), or as the
separate kernels (the default: runs 86-87 measured this kernel slower on the GPU, 77.8
against 59.7 us a layer, and the engine at batch 1 252 / 253 against 299 / 283 tok/s)."""

_HEADER = qg._HEADER + r"""
namespace tdb {

__device__ __forceinline__ unsigned smem_u32(const void* p) {
  return (unsigned)__cvta_generic_to_shared(p);
}
__device__ __forceinline__ void cp16(void* dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" :: "r"(smem_u32(dst)), "l"(src));
}
__device__ __forceinline__ void commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void wait_group() { asm volatile("cp.async.wait_group %0;\n" :: "n"(N)); }

// All blocks of the grid, resident at once (one per SM). bar[0]: arrivals, bar[1]:
// generation. The generation is read before arriving, so no block can miss its change;
// the reads are acquire loads at GPU scope (from L2, never a stale L1 line).
// bar[TICKET + i]: phase i's next unit (a line of their own, away from the barrier's).
constexpr int TICKET = 32;
__device__ __forceinline__ int read_gen(const int* p) {
  int v;
  asm volatile("ld.acquire.gpu.global.b32 %0, [%1];\n" : "=r"(v) : "l"(p) : "memory");
  return v;
}

// The last block to arrive also zeroes the ticket counters in ``reset`` (a bit a phase):
// every block has taken its last ticket of those phases before it arrives.
__device__ __forceinline__ void grid_sync(int* bar, int reset) {
  __syncthreads();
  if (threadIdx.x == 0) {
    const int gen = read_gen(bar + 1);
    __threadfence();
    if (atomicAdd(bar, 1) == (int)gridDim.x - 1) {
      atomicExch(bar, 0);
      for (int i = 0; i < 4; ++i)
        if (reset & (1 << i)) atomicExch(bar + TICKET + i, 0);
      __threadfence();
      atomicAdd(bar + 1, 1);
    } else {
      const long long t0 = clock64();
      while (read_gen(bar + 1) == gen)
        if (clock64() - t0 > (4LL << 30)) __trap();  // a block was never resident
    }
    __threadfence();
  }
  __syncthreads();
}

// One thread's 32 input values (one 16-byte weight chunk's worth) as the nibble unpacking
// pairs them, and their sum (the affine bias term).
struct XChunk { __half2 xp[16]; float xs; };

__device__ __forceinline__ void load_chunk(const __half* x, int c, uint4 (&u)[4], bool coherent) {
  const uint4* p = reinterpret_cast<const uint4*>(x + c * 32);
#pragma unroll
  for (int i = 0; i < 4; ++i) u[i] = coherent ? __ldcg(p + i) : p[i];
}

__device__ __forceinline__ float sum_squares(const uint4 (&u)[4]) {
  float ss = 0.f;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const __half2* h = reinterpret_cast<const __half2*>(&u[i]);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const float2 f = __half22float2(h[j]);
      ss = fmaf(f.x, f.x, fmaf(f.y, f.y, ss));
    }
  }
  return ss;
}

// rms_norm's 1 / sqrt(mean(x^2) + eps) for a block whose first WPG warps hold the row once.
template <int WPG>
__device__ __forceinline__ float block_rs(float ss, float* sred, int k, float eps) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
  if (lane == 0) sred[warp] = ss;
  __syncthreads();
  float t = 0.f;
#pragma unroll
  for (int i = 0; i < WPG; ++i) t += sred[i];
  __syncthreads();  // sred is reused by the next norm
  return rsqrtf(t / k + eps);
}

// With norm_w: rms_norm's roundings (x * rs to fp16, times the weight, to fp16).
__device__ __forceinline__ void prep(const uint4 (&u)[4], const __half* norm_w, int c, float rs, XChunk& X) {
  float s = 0.f;
#pragma unroll
  for (int w4 = 0; w4 < 4; ++w4) {
    __half h[8];
    *reinterpret_cast<uint4*>(h) = u[w4];
    if (norm_w) {
      const uint4 v = *reinterpret_cast<const uint4*>(norm_w + c * 32 + w4 * 8);
      const __half* g = reinterpret_cast<const __half*>(&v);
#pragma unroll
      for (int i = 0; i < 8; ++i)
        h[i] = __float2half(__half2float(__float2half(__half2float(h[i]) * rs)) * __half2float(g[i]));
    }
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      X.xp[w4 * 4 + q] = __halves2half2(h[q], h[q + 4]);
      s += __half2float(h[q]) + __half2float(h[q + 4]);
    }
  }
  X.xs = s;
}

// One product's streaming over this block: K (a multiple of 1024) split into CH chunks,
// a group of CH threads per row, NGB groups a block; each pass of a group is one unit of
// R rows (PAIR: R/2 gate rows and their up rows, N/2 further). Units are handed out by a
// ticket counter, not by block index, so a block that streams faster takes more of them:
// with a fixed share every phase waited for its slowest block, 1.3-2.7 us a phase past
// the median one (run 87: gate/up 25.5 / 28.0 / 29.6 us min / median / max a block).
// The group's leader takes the ticket of pass p + S during pass p (the atomic's latency
// hides behind the pass's arithmetic) into the group's list in shared memory, where the
// group's barrier at pass p + 1 publishes it before that pass issues its copies. A group
// takes at most CAP passes (the room of the partial sums), and the tickets a group gets
// only grow, so its first ticket past the end ends it.
template <int K, int R, int S, bool PAIR, int RED, int TICKS>
struct Product {
  static constexpr int CH = K / 32;
  static constexpr int NGB = THREADS / CH;
  static constexpr int WPG = CH / 32;
  static constexpr int CAP = RED / (NGB * R * WPG);
  static constexpr int TPG = CAP + S + 1;  // a group's tickets, then its count of passes
  static_assert(CAP >= S && NGB * TPG <= TICKS, "decode_block: partial sums or tickets too small");
  const uint4* w;
  const __half* sc;
  const __half* bi;
  int* counter;
  int* tickets;  // this block's lists, TPG a group
  int n, ng, units, c, gi;
  bool active;
  int probe;

  __device__ Product(const uint32_t* w_, const __half* s_, const __half* b_, int n_, int ng_, int* counter_,
                     int* tickets_, int probe_)
      : w(reinterpret_cast<const uint4*>(w_)), sc(s_), bi(b_), counter(counter_), tickets(tickets_), n(n_),
        ng(ng_), probe(probe_) {
    units = n / R;
    gi = threadIdx.x / CH;
    c = threadIdx.x % CH;
    active = threadIdx.x < NGB * CH;
  }
  __device__ int unit(int p) const { return tickets[gi * TPG + p]; }
  __device__ void group_sync() const {
    if constexpr (CH == 32) __syncwarp();
    else asm volatile("bar.sync %0, %1;\n" :: "r"(1 + gi), "r"(CH) : "memory");
  }
  __device__ int row(int u, int r) const {
    return PAIR ? u * (R / 2) + r / 2 + (r % 2) * (n / 2) : u * R + r;
  }
  // Shared memory of one stage: per group and row, the row's CH 16-byte weight chunks,
  // then its ng scales and ng biases (each thread reads its chunk and its group's pair).
  __device__ int row_bytes() const { return CH * 16 + ng * 4; }
  __device__ unsigned char* slot(unsigned char* dyn, int st, int r) const {
    return dyn + ((st * NGB + gi) * R + r) * row_bytes();
  }
  // Copies pass p into stage st and closes a cp.async group, also when there is nothing to
  // copy, so every thread counts the same groups. Each thread copies its weight chunk; the
  // first ng / 4 threads of a group the row's scales and biases, 16 bytes each.
  __device__ void issue(unsigned char* dyn, int st, int p) const {
    const int u = active ? unit(p) : units;
    if (u < units) {
      const int sch = ng / 8;  // 16-byte chunks of a row's scales (and of its biases)
#pragma unroll
      for (int r = 0; r < R; ++r) {
        const size_t rw = row(u, r);
        unsigned char* base = slot(dyn, st, r);
        cp16(base + c * 16, w + rw * CH + c);
        if (c < sch) cp16(base + CH * 16 + c * 16, sc + rw * ng + c * 8);
        else if (c < 2 * sch) cp16(base + CH * 16 + ng * 2 + (c - sch) * 16, bi + rw * ng + (c - sch) * 8);
      }
    }
    commit();
  }
  // Pass p (a unit this group holds) from stage st: each warp's R row sums into red[(p * NGB + gi) * R + row][warp in group].
  __device__ void compute(unsigned char* dyn, int st, int p, const XChunk& X, float* red) const {
    const int lane = threadIdx.x & 31;
    const int gidx = c * 32 / (K / ng);
    const __half2 k1032 = __floats2half2_rn(1032.f, 1032.f);
    float acc[R];
#pragma unroll
    for (int r = 0; r < R; ++r) {
      const unsigned char* base = slot(dyn, st, r);
      const uint4 q = *reinterpret_cast<const uint4*>(base + c * 16);
      const __half s16 = reinterpret_cast<const __half*>(base + CH * 16)[gidx];
      const __half b16 = reinterpret_cast<const __half*>(base + CH * 16 + ng * 2)[gidx];
      const uint32_t wd4[4] = {q.x, q.y, q.z, q.w};
      float dot = 0.f;
#pragma unroll
      for (int w4 = 0; w4 < 4; ++w4) {
        const float2 f = __half22float2(qgemv_word_dot(wd4[w4], &X.xp[w4 * 4], k1032));
        dot += f.x + f.y;
      }
      const float s = __half2float(s16);
      acc[r] = s * dot + fmaf(8.f, s, __half2float(b16)) * X.xs;
    }
    int row_ix;
    const float sum = qgemv_row_sums<R>(acc, lane, row_ix);
    if ((lane & (32 / R - 1)) == 0) red[((p * NGB + gi) * R + row_ix) * WPG + c / 32] = sum;
  }
  // Pass p, once this thread's copies have landed and the group's barrier (named, one a
  // group) says the others' have too and that everyone is done with pass p - 1, whose
  // stage then takes pass p + S - 1.
  __device__ void run(unsigned char* dyn, const XChunk& X, float* red) const {
    if (!active) return;
    int p = 0;
    for (; p < CAP; ++p) {
      wait_group<S - 2>();
      group_sync();
      if (unit(p) >= units) break;
      const int next = c == 0 && p + S < CAP ? atomicAdd(counter, 1) : units;
      issue(dyn, (p + S - 1) % S, p + S - 1);
      compute(dyn, p % S, p, X, red);
      if (c == 0) tickets[gi * TPG + p + S] = min(next, units);
    }
    // The list's slots past p + S hold another phase's tickets: finish reads only p.
    if (c == 0) tickets[gi * TPG + TPG - 1] = p;
  }
  // The first S tickets in one atomic, then passes 0 .. S - 2; the caller has made sure no
  // thread still reads those stages or this list.
  __device__ void prologue(unsigned char* dyn) const {
    if (active) {
      if (c == 0) {
        const int base = probe == 1 ? units : atomicAdd(counter, S);
#pragma unroll
        for (int i = 0; i < S; ++i) tickets[gi * TPG + i] = min(base + i, units);
      }
      group_sync();
    }
#pragma unroll
    for (int p = 0; p < S - 1; ++p) issue(dyn, p, p);
  }
  // The sum of output o's partials (entries e of this block: pass, group, output).
  template <typename F>
  __device__ void finish(const float* red, F&& write) const {
    constexpr int OUT = PAIR ? R / 2 : R;
    for (int e = threadIdx.x; e < CAP * NGB * OUT; e += THREADS) {
      const int p = e / (NGB * OUT), g = (e / OUT) % NGB, i = e % OUT;
      if (p >= tickets[g * TPG + TPG - 1]) continue;
      const int u = tickets[g * TPG + p];
      const float* rr = red + ((p * NGB + g) * R) * WPG;
      if constexpr (PAIR) {
        float gsum = 0.f, usum = 0.f;
#pragma unroll
        for (int wi = 0; wi < WPG; ++wi) { gsum += rr[(2 * i) * WPG + wi]; usum += rr[(2 * i + 1) * WPG + wi]; }
        write(u * OUT + i, gsum, usum);
      } else {
        float v = 0.f;
#pragma unroll
        for (int wi = 0; wi < WPG; ++wi) v += rr[i * WPG + wi];
        write(u * OUT + i, v, 0.f);
      }
    }
  }
};

}  // namespace tdb
"""

_SOURCE = r"""
  using namespace tdb;
  extern __shared__ __align__(16) unsigned char dyn[];
  __shared__ float red[RED];
  // Two lists, so that a phase's prologue (before the grid barrier) never overwrites the
  // tickets the previous phase's sums still read.
  __shared__ int tickets[2][TICKS];
  __shared__ float sred[THREADS / 32];
  int* barrier = const_cast<int*>(bar);
  const __half* no_norm = nullptr;
  // PROBE 3: each block's global timer at the start and after each phase and barrier.
  auto stamp = [&](int i) {
    if (PROBE == 3 && threadIdx.x == 0) {
      unsigned long long t;
      asm volatile("mov.u64 %0, %globaltimer;" : "=l"(t));
      ts[blockIdx.x * 8 + i] = t;
    }
  };
  stamp(0);

  int* tk = barrier + TICKET;
  const Product<HID, R, S, false, RED, TICKS> po(o_w, o_s, o_b, HID, o_s_shape[1], tk, tickets[0], PROBE);
  const Product<HID, R, S, true, RED, TICKS> pgu(gu_w, gu_s, gu_b, 2 * FFN, gu_s_shape[1], tk + 1, tickets[1], PROBE);
  const Product<FFN, R, S, false, RED, TICKS> pd(d_w, d_s, d_b, HID, d_s_shape[1], tk + 2, tickets[0], PROBE);

  // A: h2 = h + o(a).
  po.prologue(dyn);
  XChunk X;
  {
    uint4 u[4];
    load_chunk(a, po.c, u, false);
    prep(u, no_norm, po.c, 1.f, X);
  }
  po.run(dyn, X, red);
  __syncthreads();  // every pass read (the next prologue reuses the stages) and summed
  stamp(1);
  pgu.prologue(dyn);
  po.finish(red, [&](int o, float v, float) { h2[o] = __float2half(v + __half2float(h[o])); });
  // Zeroes A's tickets, and C's and D's: the last launch's C and D are over, this one's not begun.
  grid_sync(barrier, 0b1101);
  stamp(2);

  // A phase's input chunk c of x (written by other blocks before the barrier: read from
  // L2), through rms_norm with weight norm_w.
  auto load_normed = [&](const __half* x, const __half* norm_w, int c, float eps) {
    uint4 u[4];
    load_chunk(x, c, u, true);
    prep(u, norm_w, c, block_rs<HID / 1024>(sum_squares(u), sred, HID, eps), X);
  };

  // B: g = swiglu(gate_up(rms_norm(h2))).
  load_normed(h2, ln2, pgu.c, __int_as_float(EPS2));
  pgu.run(dyn, X, red);
  __syncthreads();
  stamp(3);
  pd.prologue(dyn);
  pgu.finish(red, [&](int o, float gs, float us) {
    // The unfused path's roundings: gate and up in fp16, then swiglu.
    const float gg = __half2float(__float2half(gs)), uu = __half2float(__float2half(us));
    g[o] = __float2half(gg / (1.f + __expf(-gg)) * uu);
  });
  grid_sync(barrier, 0b0010);
  stamp(4);

  // C: h' = h2 + down(g).
  if (pd.active) {
    uint4 u[4];
    load_chunk(g, pd.c, u, true);
    prep(u, no_norm, pd.c, 1.f, X);
  }
  pd.run(dyn, X, red);
  __syncthreads();
  stamp(5);
  if constexpr (NEXT) {
    const Product<HID, R, S, false, RED, TICKS> pq(q_w, q_s, q_b, NQKV, q_s_shape[1], tk + 3, tickets[1], PROBE);
    pq.prologue(dyn);
    pd.finish(red, [&](int o, float v, float) { h_out[o] = __float2half(v + __half2float(__ldcg(h2 + o))); });
    grid_sync(barrier, 0);
    stamp(6);

    // D: y = qkv'(rms_norm'(h')).
    load_normed(h_out, ln1, pq.c, __int_as_float(EPS1));
    pq.run(dyn, X, red);
    __syncthreads();
    stamp(7);
    pq.finish(red, [&](int o, float v, float) { y[o] = __float2half(v); });
  } else {
    pd.finish(red, [&](int o, float v, float) { h_out[o] = __float2half(v + __half2float(__ldcg(h2 + o))); });
  }
  wait_group<0>();
"""

_INPUTS = ["a", "h", "o_w", "o_s", "o_b", "ln2", "gu_w", "gu_s", "gu_b", "d_w", "d_s", "d_b",
           "ln1", "q_w", "q_s", "q_b", "bar"]


@functools.cache
def _kernel(shared_bytes: int):
    # Not ensure_row_contiguous: every input is already a contiguous parameter or result.
    return kernel_files.cuda_kernel(
        name="tandem_decode_block",
        input_names=_INPUTS,
        output_names=["h_out", "y", "h2", "g", "ts"],
        source=_SOURCE,
        header=f"constexpr int THREADS = {THREADS};\n" + _HEADER,
        ensure_row_contiguous=False,
        shared_memory=shared_bytes,
    )


def shared_bytes(products: list[tuple[int, int]], rows: int = ROWS, stages: int = STAGES) -> int:
    """Dynamic shared memory for products of (K, groups a row): per stage, every group's
    ``rows`` rows of weights with their scales and biases, for the largest product."""
    per_stage = 0
    for k, ng in products:
        ch = k // 32
        per_stage = max(per_stage, THREADS // ch * rows * (ch * 16 + ng * 4))
    return stages * per_stage


SHARED_LIMIT = 227 * 1024
"""Shared memory a block may take on the H100 / H200, static and dynamic together."""


def _products(hidden: int, ffn: int, nqkv: int) -> list[tuple[int, int]]:
    """(K, N) of o, gate/up, down, QKV."""
    return [(hidden, hidden), (hidden, 2 * ffn), (ffn, hidden), (hidden, nqkv)]


def _pass_floats(k: int, rows: int) -> int:
    """Partial sums a pass of every group of a block leaves over rows of k weights: the
    kernel's NGB x R x WPG, which divides the room into its CAP passes."""
    return THREADS // (k // 32) * rows * (k // 1024)


def red_floats(hidden: int, ffn: int, nqkv: int, rows: int, blocks: int, stages: int = STAGES) -> int:
    """Shared floats for one phase's partial sums, which also bound the passes a group may
    take (``CAP`` in the kernel): room for 1.5 x a group's fair share of passes, at least
    ``stages``, in the product that needs most. A fast SM takes more units than its share,
    and 1.5 x every group's cap still covers every unit."""
    need = 0
    for k, n in _products(hidden, ffn, nqkv):
        fair = -(-(n // rows) // (blocks * (THREADS // (k // 32))))
        need = max(need, max(-(-3 * fair // 2), stages) * _pass_floats(k, rows))
    return need


def ticket_ints(hidden: int, ffn: int, nqkv: int, rows: int, red: int, stages: int = STAGES) -> int:
    """Shared ints for one phase's ticket lists: per group, its cap of passes plus the
    ``stages`` taken ahead, and its count."""
    need = 0
    for k, _ in _products(hidden, ffn, nqkv):
        need = max(need, THREADS // (k // 32) * (red // _pass_floats(k, rows) + stages + 1))
    return need


def static_bytes(red: int, tickets: int) -> int:
    """The partial sums, two ticket lists and the norms' warp sums."""
    return 4 * red + 2 * 4 * tickets + 4 * (THREADS // 32)


def counter() -> mx.array:
    """The barrier's (arrivals, generation), padding, and from word 32 the four phases'
    ticket counters: zeros, made and evaluated outside any compiled function. The kernel
    leaves arrivals at zero and zeroes each phase's tickets once every block is past them,
    so one buffer serves every launch. 64 words, not 2: MLX serves 8 bytes and less from a
    small pool of managed memory (advised accessed-by the GPU in the 0.32.4 wheel) that
    the host touches too, where every atomic waits on the page (run 86: 339 us a barrier
    against 1.9 with 64 words, bench/barrier_probe.py)."""
    c = mx.zeros((64,), mx.int32)
    mx.eval(c)
    return c


def supports(hidden: int, ffn: int, nqkv: int, group_sizes: set[int], rows: int = ROWS,
             stages: int = STAGES, blocks: int = 132) -> bool:
    """Shapes the kernel covers: K % 1024 for every product, a row's chunks within one block,
    whole units of ``rows`` rows, groups of 32-128, stages that fit shared memory with the
    partial sums of a grid of ``blocks``."""
    if not (hidden % 1024 == 0 and ffn % 1024 == 0 and hidden // 32 <= THREADS and ffn // 32 <= THREADS
            and hidden % rows == 0 and ffn % (rows // 2) == 0 and nqkv % rows == 0 and rows % 2 == 0
            and 32 % rows == 0 and stages >= 2 and group_sizes <= {32, 64, 128}):
        return False
    gs = min(group_sizes)
    red = red_floats(hidden, ffn, nqkv, rows, blocks, stages)
    return (shared_bytes([(hidden, hidden // gs), (ffn, ffn // gs)], rows, stages)
            + static_bytes(red, ticket_ints(hidden, ffn, nqkv, rows, red, stages)) <= SHARED_LIMIT)


def decode_block(a, h, o, ln2, gate_up, down, ln1_next=None, qkv_next=None, *, eps2: float,
                 eps1: float = 1e-5, bar: mx.array, rows: int | None = None,
                 stages: int | None = None, probe: int = 0) -> tuple[mx.array, mx.array | None]:
    """(h', y): ``h2 = h + o(a)``, ``h' = h2 + down(swiglu(gate_up(rms_norm(h2, ln2))))``
    and, with a next layer, ``y = qkv_next(rms_norm(h', ln1_next))`` (else None).

    a, h: (1, hidden) fp16. o, gate_up ([gate; up] stacked), down, qkv_next: (w, scales,
    biases) of MLX's 4-bit affine format. bar: :func:`counter`. probe (bench/gpu_probe.py
    only): 1 no products (the barriers, input loads and norms alone; results garbage by
    design); 3 the full kernel, returning (h', each block's global timer at its start and
    after each phase and barrier).
    """
    rows, stages = rows or ROWS, stages or STAGES
    hidden, ffn = h.shape[-1], down[0].shape[1] * 8
    nxt = qkv_next is not None
    q = qkv_next if nxt else o
    nqkv = q[0].shape[0] if nxt else rows
    blocks = w4wgmma.sm_count()
    red = red_floats(hidden, ffn, nqkv, rows, blocks, stages)
    ticks = ticket_ints(hidden, ffn, nqkv, rows, red, stages)
    smem = shared_bytes([(hidden, o[1].shape[1]), (hidden, gate_up[1].shape[1]), (ffn, down[1].shape[1]),
                         (hidden, q[1].shape[1])], rows, stages)
    if smem + static_bytes(red, ticks) > SHARED_LIMIT:
        raise ValueError(f"decode_block: {rows} rows x {stages} stages need {smem + static_bytes(red, ticks)} "
                         f"bytes of shared memory, more than a block's {SHARED_LIMIT}")
    h_out, y, _, _, ts = _kernel(smem)(
        inputs=[a, h, *o, ln2, *gate_up, *down, ln1_next if nxt else ln2, *q, bar],
        template=[("HID", hidden), ("FFN", ffn), ("NQKV", nqkv), ("R", rows), ("S", stages),
                  ("RED", red), ("TICKS", ticks), ("NEXT", nxt), ("PROBE", probe),
                  ("EPS2", constants.float_bits(eps2)), ("EPS1", constants.float_bits(eps1))],
        grid=(blocks * THREADS, 1, 1),
        threadgroup=(THREADS, 1, 1),
        # Unused outputs of 16 bytes, not 2 or 8: the scalar pool's pages are the ones to avoid.
        output_shapes=[(1, hidden), (1, nqkv if nxt else 8), (1, hidden), (1, ffn), (blocks * 8 if probe == 3 else 2,)],
        output_dtypes=[mx.float16] * 4 + [mx.uint64],
    )
    if probe == 3:
        return h_out, ts
    return h_out, (y if nxt else None)


def decode_block_reference(a, h, o, ln2, gate_up, down, ln1_next=None, qkv_next=None, *,
                           eps2: float, eps1: float = 1e-5, group_size: int = 64
                           ) -> tuple[mx.array, mx.array | None]:
    """The same chain through ``qgemv_reference``: what the separate kernels compute."""
    h2 = qg.qgemv_reference(a, *o, group_size, residual=h)
    g = qg.qgemv_reference(h2, *gate_up, group_size, norm_weight=ln2, eps=eps2, pair=True)
    h_out = qg.qgemv_reference(g, *down, group_size, residual=h2)
    if qkv_next is None:
        return h_out, None
    return h_out, qg.qgemv_reference(h_out, *qkv_next, group_size, norm_weight=ln1_next, eps=eps1)
