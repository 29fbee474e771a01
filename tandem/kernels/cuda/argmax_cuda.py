"""Each row's greedy token, on CUDA: the argmax of fp16 / bf16 logits as int32, one launch.

A greedy step took three ops to pick its tokens: the logits to float32, ``mx.argmax``, its
uint32 result to int32 (one row of 128,256 logits: 2.6 + 15.6 + 2.5 us of GPU time on the
H200, and three of the ~160 ops whose encoding on the engine thread sets a one-row step).
Here one block of 1,024 threads a row reads the row 16 bytes at a time, each thread keeps
its largest value and that value's lowest index, and the block's reduction keeps the
lowest index of the largest value, as ``mx.argmax`` does. An fp16 or bf16 value converts
to float32 exactly, so the comparison is the one on the float32 logits. (NaN logits have
no defined answer here, as a sampling input.)

``argmax_reference`` is the three ops; ``argmax`` runs the kernel where it applies
(``ENABLED``, CUDA, 2-D fp16 / bf16 logits whose rows are whole 16-byte chunks) and the
reference otherwise.
"""

from __future__ import annotations

import functools

import mlx.core as mx

from tandem.kernels.cuda import kernel_files
from tandem.kernels.cuda.quantized_matmul import cuda_available

ENABLED = True
"""Whether greedy sampling runs the kernel (False, for tests: the three ops). One launch
where there were three, and two fewer of the ~165 ops whose encoding on the engine thread
is half of a one-row step: within the processes' spread at one row, but never more work."""

THREADS = 1024

# Template: T. Input: logits (B, V), row-contiguous, V % 8 == 0. Output: out (B,) int32.
_SOURCE = r"""
  constexpr int NW = THREADS / 32;
  constexpr int NONE = 0x7fffffff;           // no index yet: any value beats it
  const int V = logits_shape[1];
  const T* row = logits + (size_t)blockIdx.x * V;
  constexpr int NL = 8;                      // 16-byte loads a thread has in flight at once
  constexpr int STRIDE = THREADS * 8;
  const uint32_t zero = (uint32_t)V >> 30;   // 0 at run time (V < 2^30), unknown to the compiler
  float best = 0.f;
  int at = NONE;
  // A thread's indices only grow, so a strict > keeps the lowest index of its largest. A
  // row of 128,256 logits is 16 loads a thread: two rounds of NL in flight, not 16 round trips.
  for (int c0 = threadIdx.x * 8; c0 < V; c0 += NL * STRIDE) {
    uint4 raw[NL];
    uint32_t dep = 0;
#pragma unroll
    for (int i = 0; i < NL; ++i) {
      const int c = c0 + i * STRIDE;
      raw[i] = c < V ? *reinterpret_cast<const uint4*>(row + c) : make_uint4(0u, 0u, 0u, 0u);
      dep |= raw[i].x;
    }
    // The indices wait on every load of the round (dep & zero is 0), so ptxas cannot sink
    // each load to its first use and keep one in flight at a time.
    const int base = c0 + (int)(dep & zero);
#pragma unroll
    for (int i = 0; i < NL; ++i) {
      const int c = base + i * STRIDE;
      if (c >= V) break;
      const T* v = reinterpret_cast<const T*>(&raw[i]);
#pragma unroll
      for (int k = 0; k < 8; ++k) {
        const float f = static_cast<float>(v[k]);
        if (at == NONE || f > best) { best = f; at = c + k; }
      }
    }
  }
  // Larger value first, then the lower index.
  auto take = [](float& b, int& i, float ob, int oi) {
    if (oi != NONE && (i == NONE || ob > b || (ob == b && oi < i))) { b = ob; i = oi; }
  };
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1)
    take(best, at, __shfl_xor_sync(0xffffffffu, best, o), __shfl_xor_sync(0xffffffffu, at, o));
  __shared__ float sb[NW];
  __shared__ int si[NW];
  if (lane == 0) { sb[warp] = best; si[warp] = at; }
  __syncthreads();
  if (warp == 0) {
    best = lane < NW ? sb[lane] : 0.f;
    at = lane < NW ? si[lane] : NONE;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1)
      take(best, at, __shfl_xor_sync(0xffffffffu, best, o), __shfl_xor_sync(0xffffffffu, at, o));
    if (lane == 0) out[blockIdx.x] = at;
  }
"""


@functools.cache
def _kernel():
    return kernel_files.cuda_kernel(name="tandem_argmax_rows", input_names=["logits"], output_names=["out"],
                                    source=_SOURCE, header=f"constexpr int THREADS = {THREADS};\n")


def applies(logits: mx.array) -> bool:
    return (ENABLED and cuda_available() and logits.ndim == 2 and logits.dtype in (mx.float16, mx.bfloat16)
            and logits.shape[1] % 8 == 0 and logits.shape[1] > 0)


def argmax_reference(logits: mx.array) -> mx.array:
    """(B, V) -> (B,) int32: the sampler's three ops."""
    return mx.argmax(logits.astype(mx.float32), axis=-1).astype(mx.int32)


def argmax_kernel(logits: mx.array) -> mx.array:
    """The kernel itself (CUDA only; ``applies`` says where)."""
    B = logits.shape[0]
    (out,) = _kernel()(inputs=[logits], template=[("T", logits.dtype)], grid=(B * THREADS, 1, 1),
                       threadgroup=(THREADS, 1, 1), output_shapes=[(B,)], output_dtypes=[mx.int32])
    return out


def argmax(logits: mx.array) -> mx.array:
    """(B, V) logits -> (B,) int32 greedy tokens: the kernel where it applies."""
    return argmax_kernel(logits) if applies(logits) else argmax_reference(logits)
