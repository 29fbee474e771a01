"""A small batch's decode attention in one launch: RoPE, the KV write, split-K attention
and the merge of the partitions, on CUDA.

At one row a layer's attention was three kernels (the engine's trace, per layer):
RoPE + write 7.3 us, split-K attention 23.1 us, merge 2.7 us: a third of the GPU's step
for 2.4 MB of KV. And each launch costs the engine thread ~10-14 us of MLX work, which at
one row is as long as the GPU's step. Here one grid of (partition, KV head, row)
blocks does all of it:

- every block rotates its group's queries itself (the sincos of one position per pair);
- the block whose partition holds the step's token rotates that token's key, writes key
  and value into their pool slot, and folds the token into its softmax from shared
  memory (it never reads the slot back: a load may take the non-coherent path);
- the other pool tokens go through the per-token online softmax of
  ``paged_attention_cuda``'s v2 kernel (the same layout: 8 lanes per token), with every
  K/V load of a 64-token chunk issued before its arithmetic;
- the last block of a (row, KV head) to finish, found with an atomic ticket, merges the
  partitions' partials and writes the output; it resets the ticket, so the counters are
  zero between launches and one array serves every layer (the layers run in order on
  one stream).

Inputs and pools as in ``kv_write_cuda.write_kv_rope`` and
``paged_attention_cuda.paged_decode_attention``; the reference is those two kernels'
references in sequence.
"""

from __future__ import annotations

import functools

import mlx.core as mx

from tandem.kernels.cuda import constants
from tandem.kernels.cuda import kernel_files
from tandem.kernels.cuda import paged_attention_cuda as pac

MAX_ROWS = pac.TILE_MIN_BATCH
"""Decode steps of fewer rows than this run the fused kernel; from ``TILE_MIN_BATCH`` rows
on, the tile-wise attention kernels run. Rows are the counters' capacity too. At one row
it cut 64 launches a step and the engine thread's work per step by about a third: at one
row the host, not the GPU, sets the step time."""

CHUNK = 64
"""Tokens whose K/V loads a block issues at once (a multiple of 16): the partition at one
row is 64 tokens (``paged_attention_cuda.choose_partition``)."""
STAGED_MERGE = True
"""The last block's merge of the partitions: staged (every partition's max and sum in
shared memory first, then each thread's partials loaded 8 partitions at a time: three L2
round trips at 12 partitions) rather than the walk over the partitions one load at a time
(~20 dependent round trips), which remains for more than 128 partitions: the kernel took
10-20% less time at one row (``staged_merge=False`` selects the walk, for tests)."""

# Template: T, D, KVH, G, BS, ROPE, TRAD, NIT (16-token iterations whose loads go out
# together), SMERGE (the staged merge, see STAGED_MERGE). Inputs: qkv (B, (KVH*G + 2*KVH) * D), pos (B,)
# int32 (the step's token index = the pool length before it), slots (B,) int32 (<0: no
# write), inv_freq (D/2,) f32, k_pool / v_pool (S, KVH, D), table (B, nb) int32, params
# (2,) f32 = [scale, partition tokens], counters (>= B*KVH,) int32, zero. Outputs: out
# (B, KVH*G*D) T; part (B, KVH*G, NPART, D + 2) f32 scratch for the partials.
_SOURCE = r"""
  constexpr int DL = D / 8;
  constexpr int H = KVH * G;
  constexpr int HEADS = H + 2 * KVH;
  constexpr int NT = 128;                    // the launch's threadgroup
  constexpr int MERGE_MAXP = 128;            // partitions the staged merge holds
  constexpr int HALF_D = D / 2;
  const int part_i = blockIdx.x;
  const int h = blockIdx.y;
  const int b = blockIdx.z;
  const int npart = gridDim.x;
  const int tid = threadIdx.x;
  const int warp = tid >> 5, lane = tid & 31;
  const int NB = table_shape[1];
  const float sc = CONSTS ? __int_as_float(SCALE_BITS) : params[0];
  const int PART = CONSTS ? PART_C : (int)params[1];
  const int p = pos[b];
  const int t0 = part_i * PART;
  const int t1 = min(p, t0 + PART);          // pool tokens of this partition: [t0, t1)
  const bool owner = t0 <= p && p < t0 + PART;

  // The table slice first: the K/V addresses wait on it, the rotation below does not.
""" + pac._TABLE_SLICE + r"""

  __shared__ __align__(16) float sm_q[G][D];
  __shared__ float sm_kn[D], sm_vn[D];
  const T* row = qkv + (size_t)b * HEADS * D;
  for (int i = tid; i < HALF_D; i += blockDim.x) {
    const int i0 = TRAD ? 2 * i : i;
    const int i1 = TRAD ? 2 * i + 1 : i + HALF_D;
    float sn = 0.f, cs = 1.f;
    if (ROPE) sincosf((float)p * inv_freq[i], &sn, &cs);
#pragma unroll
    for (int g = 0; g < G; ++g) {
      const T* src = row + (size_t)(h * G + g) * D;
      const float a = pa_f(src[i0]), c = pa_f(src[i1]);
      sm_q[g][i0] = (a * cs - c * sn) * sc;
      sm_q[g][i1] = (a * sn + c * cs) * sc;
    }
    if (owner) {
      const T* ks = row + (size_t)(H + h) * D;
      const T* vs = row + (size_t)(H + KVH + h) * D;
      const float a = pa_f(ks[i0]), c = pa_f(ks[i1]);
      // Rounded to T as the pool keeps it: later steps score this token from the pool.
      T k0, k1;
      pa_st(&k0, a * cs - c * sn);
      pa_st(&k1, a * sn + c * cs);
      const T v0 = vs[i0], v1 = vs[i1];
      const int s = slots[b];
      if (s >= 0) {
        T* kd = const_cast<T*>(k_pool) + ((size_t)s * KVH + h) * D;
        T* vd = const_cast<T*>(v_pool) + ((size_t)s * KVH + h) * D;
        kd[i0] = k0; kd[i1] = k1; vd[i0] = v0; vd[i1] = v1;
      }
      sm_kn[i0] = pa_f(k0); sm_kn[i1] = pa_f(k1);
      sm_vn[i0] = pa_f(v0); sm_vn[i1] = pa_f(v1);
    }
  }

  float mx_[G], l_[G], acc[G][DL];
#pragma unroll
  for (int g = 0; g < G; ++g) {
    mx_[g] = -INFINITY;
    l_[g] = 0.f;
#pragma unroll
    for (int i = 0; i < DL; ++i) acc[g][i] = 0.f;
  }
  const int sub = lane & 7;
  const int slot = warp * 4 + (lane >> 3);
  __syncthreads();

  // Chunks of NIT x 16 tokens: every K and V load of a chunk is issued before any of its
  // arithmetic, so a 64-token partition costs one memory latency, not one per 16 tokens
  // (the one-ahead loads of paged_attention_cuda's v2 kernel). Warp-uniform trip counts
  // (full-mask shuffles inside).
  for (int tc = t0; tc < t1; tc += 16 * NIT) {
    PaRaw<T, DL> nk[NIT], nv[NIT];
#pragma unroll
    for (int j = 0; j < NIT; ++j) {
      const int t = tc + 16 * j + slot;
      if (t < t1) {
        const size_t base = (((size_t)sm_tbl[t / BS - fb] * BS + (t % BS)) * KVH + h) * D + sub * DL;
        nk[j].load(k_pool + base);
        nv[j].load(v_pool + base);
      }
    }
#pragma unroll
    for (int j = 0; j < NIT; ++j) {
      const int t = tc + 16 * j + slot;
      const bool valid = t < t1;
      float kf[DL], vf[DL];
      if (valid) {
        nk[j].get(kf);
        nv[j].get(vf);
      } else {
#pragma unroll
        for (int i = 0; i < DL; ++i) { kf[i] = 0.f; vf[i] = 0.f; }
      }
""" + pac._V2_TOKEN + r"""    }
  }
""" + pac._V2_WARP_MERGE + r"""  // The step's own token, from shared memory, into warp 0's state.
  if (owner && warp == 0) {
#pragma unroll
    for (int g = 0; g < G; ++g) {
      float s = 0.f;
#pragma unroll
      for (int i = 0; i < DL; ++i) s = fmaf(sm_q[g][sub * DL + i], sm_kn[sub * DL + i], s);
      s += __shfl_xor_sync(0xffffffffu, s, 1);
      s += __shfl_xor_sync(0xffffffffu, s, 2);
      s += __shfl_xor_sync(0xffffffffu, s, 4);
      const float mn = fmaxf(mx_[g], s);
      const float c = (mx_[g] == -INFINITY) ? 0.f : __expf(mx_[g] - mn);
      const float pr = __expf(s - mn);
      l_[g] = l_[g] * c + pr;
#pragma unroll
      for (int i = 0; i < DL; ++i) acc[g][i] = fmaf(acc[g][i], c, pr * sm_vn[sub * DL + i]);
      mx_[g] = mn;
    }
  }
""" + pac._V2_STAGE_WARPS + r"""  __syncthreads();
  for (int e = tid; e < G * D; e += blockDim.x) {
""" + pac._WARPS_COMBINE + r"""    if (npart == 1) {
      pa_st(out + ((size_t)b * H + h * G + g) * D + d, lsum > 0.f ? a / lsum : 0.f);
    } else {
      float* o = part + (((size_t)b * H + h * G + g) * npart + part_i) * (D + 2);
      o[d] = a;
      if (d == 0) { o[D] = mn; o[D + 1] = lsum; }
    }
  }
  if (npart == 1) return;

  // The last block of this (row, KV head) to get here merges every partition's partial.
  __shared__ int sm_last;
  __threadfence();
  __syncthreads();
  int* ticket = const_cast<int*>(counters) + (b * KVH + h);
  if (tid == 0) sm_last = atomicAdd(ticket, 1) == npart - 1;
  __syncthreads();
  if (!sm_last) return;
  __threadfence();
  const float* pb = part + ((size_t)b * H + h * G) * npart * (D + 2);  // head g's partials at g * npart
  if (SMERGE && npart <= MERGE_MAXP) {
    // Every partition's max and sum first, staged in shared memory: the weights
    // exp(m_i - max) and their l-weighted sum are then a warp's work per head, and each
    // thread issues all its partials' loads for a batch of 8 partitions at once. The loop
    // below this branch walks partitions one load at a time (~20 dependent L2 round trips
    // at 12 partitions); this one makes three.
    __shared__ float sm_pc[G][MERGE_MAXP], sm_pl[G][MERGE_MAXP], sm_ls[G];
    for (int e = tid; e < G * npart; e += NT) {
      const int g = e / npart, i = e % npart;
      const float* pi = pb + ((size_t)g * npart + i) * (D + 2);
      sm_pc[g][i] = __ldcg(pi + D);
      sm_pl[g][i] = __ldcg(pi + D + 1);
    }
    __syncthreads();
    for (int g = warp; g < G; g += NT / 32) {
      float mn = -INFINITY;
      for (int i = lane; i < npart; i += 32) mn = fmaxf(mn, sm_pc[g][i]);
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) mn = fmaxf(mn, __shfl_xor_sync(0xffffffffu, mn, o));
      float ls = 0.f;
      for (int i = lane; i < npart; i += 32) {
        const float m = sm_pc[g][i];
        const float c = (m == -INFINITY) ? 0.f : __expf(m - mn);
        sm_pc[g][i] = c;  // read and written by this lane only
        ls += sm_pl[g][i] * c;
      }
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) ls += __shfl_xor_sync(0xffffffffu, ls, o);
      if (lane == 0) sm_ls[g] = ls;
    }
    __syncthreads();
    constexpr int EPT = (G * D + NT - 1) / NT;
    float a[EPT];
#pragma unroll
    for (int k = 0; k < EPT; ++k) a[k] = 0.f;
    for (int i0 = 0; i0 < npart; i0 += 8) {
      float v[EPT][8];
#pragma unroll
      for (int k = 0; k < EPT; ++k) {
        const int e = tid + NT * k;
        const int g = e / D, d = e % D;
#pragma unroll
        for (int j = 0; j < 8; ++j)
          v[k][j] = (e < G * D && i0 + j < npart) ? __ldcg(pb + ((size_t)g * npart + i0 + j) * (D + 2) + d) : 0.f;
      }
#pragma unroll
      for (int k = 0; k < EPT; ++k) {
        const int g = min((tid + NT * k) / D, G - 1);
#pragma unroll
        for (int j = 0; j < 8; ++j)
          if (i0 + j < npart) a[k] = fmaf(v[k][j], sm_pc[g][i0 + j], a[k]);
      }
    }
#pragma unroll
    for (int k = 0; k < EPT; ++k) {
      const int e = tid + NT * k;
      if (e < G * D) {
        const int g = e / D, d = e % D;
        const float ls = sm_ls[g];
        pa_st(out + ((size_t)b * H + h * G + g) * D + d, ls > 0.f ? a[k] / ls : 0.f);
      }
    }
  } else {
    for (int e = tid; e < G * D; e += blockDim.x) {
      const int g = e / D, d = e % D;
      const float* pp = pb + (size_t)g * npart * (D + 2);
      float mn = -INFINITY;
      for (int i = 0; i < npart; ++i) mn = fmaxf(mn, __ldcg(pp + i * (D + 2) + D));
      float lsum = 0.f, a = 0.f;
      for (int i = 0; i < npart; ++i) {
        const float m = __ldcg(pp + i * (D + 2) + D);
        const float c = (m == -INFINITY) ? 0.f : __expf(m - mn);
        lsum += __ldcg(pp + i * (D + 2) + D + 1) * c;
        a += __ldcg(pp + i * (D + 2) + d) * c;
      }
      pa_st(out + ((size_t)b * H + h * G + g) * D + d, lsum > 0.f ? a / lsum : 0.f);
    }
  }
  if (tid == 0) *ticket = 0;
"""


@functools.cache
def _kernel():
    # Not ensure_row_contiguous: a contiguity copy of a pool would swallow the writes.
    return kernel_files.cuda_kernel(
        name="tandem_decode_attention_fused",
        input_names=["qkv", "pos", "slots", "inv_freq", "k_pool", "v_pool", "table", "params", "counters"],
        output_names=["out", "part"],
        source=_SOURCE,
        header=pac.HEADER,
        ensure_row_contiguous=False,
    )


def counters(rows: int, n_kv_heads: int) -> mx.array:
    """The merge tickets for up to ``rows`` rows: zeros, made and evaluated outside any
    compiled function (a zeros op inside one would be a fill kernel every step)."""
    c = mx.zeros((rows * n_kv_heads,), mx.int32)
    mx.eval(c)
    return c


def supported(qkv: mx.array, n_heads: int, n_kv_heads: int, head_dim: int) -> bool:
    return (qkv.dtype in (mx.float16, mx.bfloat16, mx.float32) and head_dim % 8 == 0
            and head_dim <= 256 and n_heads % n_kv_heads == 0)


def decode_attention(qkv: mx.array, pos: mx.array, slots: mx.array, inv_freq: mx.array,
                     k_pool: mx.array, v_pool: mx.array, table: mx.array, n_heads: int,
                     n_kv_heads: int, scale: float, block_size: int, max_len: int,
                     counters_: mx.array, partition: int | None = None, rope: bool = True,
                     traditional: bool = False, staged_merge: bool | None = None) -> mx.array:
    """One decode token per row: rotate, write K/V at ``slots`` in place, attend over the
    row's ``pos + 1`` tokens. qkv: (B, (H + 2*KVH) * D) row-contiguous; table (B, nb)
    covering every row's tokens including this step's; max_len: an upper bound of
    ``pos + 1`` fixed by the table's shape (sets the grid); counters_: from
    ``counters(rows >= B, KVH)``. Returns (B, H * D) in qkv's dtype. The pools change when
    the result is evaluated (see ``kv_write_cuda``)."""
    B = qkv.shape[0]
    D = k_pool.shape[-1]
    H, KVH = n_heads, n_kv_heads
    if qkv.shape[1] != (H + 2 * KVH) * D:
        raise ValueError(f"qkv width {qkv.shape[1]} != ({H} + 2*{KVH}) * {D}")
    if counters_.size < B * KVH:
        raise ValueError(f"counters for {counters_.size // KVH} rows, batch has {B}")
    part = partition or pac.choose_partition(B, KVH, max_len)
    npart = max(1, -(-max_len // part))
    out, _ = _kernel()(
        inputs=[qkv, pac.i32(pos), pac.i32(slots), inv_freq, k_pool, v_pool, pac.i32(table),
                pac._params(float(scale), part), counters_],
        template=[("T", qkv.dtype), ("D", D), ("KVH", KVH), ("G", H // KVH), ("BS", block_size),
                  ("ROPE", bool(rope)), ("TRAD", bool(traditional)), ("NIT", CHUNK // 16),
                  ("SMERGE", STAGED_MERGE if staged_merge is None else bool(staged_merge))]
                 + constants.attention_template(float(scale), part),
        grid=(npart * 128, KVH, B),
        threadgroup=(128, 1, 1),
        output_shapes=[(B, H * D), (B, H, npart, D + 2)],
        output_dtypes=[qkv.dtype, mx.float32],
    )
    return out


# ---------------------------------------------------------------------------------------
# From TILE_MIN_BATCH rows on, the tile-wise kernels (tc / v6) with the step's RoPE and KV
# write in their prologue: each block rotates its group's queries from the fused QKV row,
# rounded to T as the write kernel stores them, so the scores equal the two-kernel path's;
# the block whose partition holds the step's token rotates its key and writes key and
# value into the pool, and the barrier that ends the prologue puts those writes before
# its warps read the partition. One launch a layer instead of two (the write kernel took
# 8.5 us a layer at batch 64 in the engine).
_Q_FROM_QKV = r"""  __shared__ __align__(16) float sm_q[G][D];
  {
    constexpr int H_ = KVH * G;
    const int p = pos[b];
    const bool owner = t0 <= p && p < t0 + PART;
    const T* row = qkv + (size_t)b * (H_ + 2 * KVH) * D;
    for (int i = tid; i < D / 2; i += blockDim.x) {
      const int i0 = TRAD ? 2 * i : i;
      const int i1 = TRAD ? 2 * i + 1 : i + D / 2;
      float sn, cs;
      sincosf((float)p * inv_freq[i], &sn, &cs);
#pragma unroll
      for (int g = 0; g < G; ++g) {
        const T* src = row + (size_t)(h * G + g) * D;
        const float a = pa_f(src[i0]), c = pa_f(src[i1]);
        T qa, qc;
        pa_st(&qa, a * cs - c * sn);
        pa_st(&qc, a * sn + c * cs);
        sm_q[g][i0] = pa_f(qa) * sc;
        sm_q[g][i1] = pa_f(qc) * sc;
      }
      const int s = slots[b];
      if (owner && s >= 0) {
        const T* ks = row + (size_t)(H_ + h) * D;
        const T* vs = row + (size_t)(H_ + KVH + h) * D;
        const float a = pa_f(ks[i0]), c = pa_f(ks[i1]);
        T* kd = const_cast<T*>(k_pool) + ((size_t)s * KVH + h) * D;
        T* vd = const_cast<T*>(v_pool) + ((size_t)s * KVH + h) * D;
        pa_st(kd + i0, a * cs - c * sn);
        pa_st(kd + i1, a * sn + c * cs);
        vd[i0] = vs[i0];
        vd[i1] = vs[i1];
      }
    }
  }
"""
_TILE_WRITE_SOURCES = {
    "tile": pac._ATT_TILE_SOURCE.replace(pac._Q_LOAD, _Q_FROM_QKV) + pac._MERGE_TAIL,
    "tc": pac._ATT_TC_SOURCE.replace(pac._Q_LOAD, _Q_FROM_QKV) + pac._MERGE_TAIL,
}

# Decode steps of ``MAX_ROWS`` rows and more run the write inside the tile-wise attention
# kernel (:func:`decode_attention_tile`) rather than the write kernel, then the attention:
# the engine at batch 64 gained 1-11% a pair of processes.


@functools.cache
def _tile_write_kernel(kind: str = "tile", shared_bytes: int = 0):
    # Not ensure_row_contiguous: a contiguity copy of a pool would swallow the writes.
    return kernel_files.cuda_kernel(
        name="tandem_paged_decode_tile_write" if kind == "tile" else "tandem_paged_decode_tc_write",
        input_names=["qkv", "k_pool", "v_pool", "table", "lens", "params", "pos", "slots", "inv_freq"],
        output_names=["out"],
        source=_TILE_WRITE_SOURCES[kind],
        header=pac.kernel_header(kind),
        ensure_row_contiguous=False,
        shared_memory=shared_bytes,
    )


def tile_supported(qkv: mx.array, head_dim: int) -> bool:
    """Whether :func:`decode_attention_tile` covers this dtype and head size."""
    return qkv.dtype in (mx.float16, mx.bfloat16) and head_dim in (64, 128)


def decode_attention_tile(qkv: mx.array, pos: mx.array, slots: mx.array, inv_freq: mx.array,
                          k_pool: mx.array, v_pool: mx.array, table: mx.array, lens: mx.array,
                          n_heads: int, n_kv_heads: int, scale: float, block_size: int, max_len: int,
                          partition: int | None = None, kernel: str | None = None,
                          traditional: bool = False) -> mx.array:
    """``write_kv_rope`` then ``paged_decode_attention(flat=True)`` in one launch (plus the
    merge kernel when the context is split), with the same result: qkv (B, (H + 2*KVH) *
    D) row-contiguous, one decode token per row at ``pos`` (= ``lens - 1``), written at
    ``slots`` (< 0: not written). Returns (B, H * D); the pools change when it is
    evaluated (see ``kv_write_cuda``). ``kernel``: ``v6`` or ``tc`` (default ``tc``, which
    falls back to ``v6`` where it does not apply)."""
    B = qkv.shape[0]
    D = k_pool.shape[-1]
    H, KVH = n_heads, n_kv_heads
    if qkv.shape[1] != (H + 2 * KVH) * D:
        raise ValueError(f"qkv width {qkv.shape[1]} != ({H} + 2*{KVH}) * {D}")
    if not tile_supported(qkv, D):
        raise ValueError(f"decode_attention_tile: {qkv.dtype} / head_dim {D} (fp16 or bf16, 64 or 128)")
    version = kernel or "tc"
    if version not in ("v6", "tc"):
        raise ValueError(f"decode_attention_tile: kernel {version!r} (v6 or tc)")
    part = partition or pac.choose_partition(B, KVH, max_len)
    npart = max(1, -(-max_len // part))
    single = npart == 1
    kind, variant, smem = pac.tile_variant(version, qkv.dtype, D, H // KVH)
    (partials,) = _tile_write_kernel(kind, smem)(
        inputs=[qkv, k_pool, v_pool, pac.i32(table), pac.i32(lens), pac._params(float(scale), part),
                pac.i32(pos), pac.i32(slots), inv_freq],
        template=[("T", qkv.dtype), ("D", D), ("KVH", KVH), ("G", H // KVH), ("BS", block_size),
                  ("SINGLE", single), ("TRAD", bool(traditional))] + variant
                 + constants.attention_template(float(scale), part),
        grid=(npart * pac._ATT_THREADS, KVH, B),
        threadgroup=(pac._ATT_THREADS, 1, 1),
        output_shapes=[(B, H * D) if single else (B, H, npart, D + 2)],
        output_dtypes=[qkv.dtype if single else mx.float32],
    )
    return partials if single else pac.merge_partials(partials, qkv.dtype, flat=True)
