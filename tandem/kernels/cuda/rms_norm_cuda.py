"""``rms_norm`` of a step's rows before a product that does not fold it in, on CUDA.

At one row the decode products fold the norm into their kernel; from two rows
``FlatLinear.fused`` runs it as an op of its own, and MLX's ``mx.fast.rms_norm`` is not a
kernel the graph step can record (``pipeline/runners/cuda/graph_step.py`` replays only
kernels made through ``kernel_files.cuda_kernel``): every decode step of 2-16 rows had an
MLX op between its kernels and could not be captured. This is the same arithmetic as
MLX's kernel: the mean of squares in fp32, ``rsqrt(mean + eps)``, ``x * r`` rounded to
the type, times the weight in the type. One block per row; only the order of the fp32
sum differs from MLX's.

``rms_norm_reference`` is MLX's; ``rms_norm`` picks the kernel where it applies
(``ENABLED``, CUDA, 2-D fp16 / bf16 rows) and the reference otherwise.
"""

from __future__ import annotations

import functools

import mlx.core as mx

from tandem.kernels.cuda import kernel_files
from tandem.kernels.cuda.quantized_matmul import cuda_available

ENABLED = True
"""Whether ``rms_norm`` runs the kernel or MLX's (False, for tests)."""
THREADS = 256

# Template: T. Inputs: x (M, N) row-contiguous, w (N,), eps (1,) float32. Output: out (M, N).
_SOURCE = r"""
  const int n = x_shape[1];
  const size_t row = blockIdx.x;
  const T* xr = x + row * n;
  float acc = 0.f;
  for (int i = threadIdx.x; i < n; i += THREADS) {
    const float t = static_cast<float>(xr[i]);
    acc += t * t;
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
  __shared__ float part[THREADS / 32];
  if ((threadIdx.x & 31) == 0) part[threadIdx.x >> 5] = acc;
  __syncthreads();
  if (threadIdx.x < 32) {
    acc = threadIdx.x < THREADS / 32 ? part[threadIdx.x] : 0.f;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
    if (threadIdx.x == 0) part[0] = acc;
  }
  __syncthreads();
  const float r = rsqrtf(part[0] / n + eps[0]);
  T* o_row = out + row * n;
  for (int i = threadIdx.x; i < n; i += THREADS) {
    const T y = static_cast<T>(static_cast<float>(xr[i]) * r);
    o_row[i] = static_cast<T>(static_cast<float>(w[i]) * static_cast<float>(y));
  }
"""


@functools.cache
def _kernel():
    return kernel_files.cuda_kernel(name="tandem_rms_norm", input_names=["x", "w", "eps"], output_names=["out"],
                                    source=_SOURCE, header=f"constexpr int THREADS = {THREADS};\n")


@functools.cache
def _eps(eps: float) -> mx.array:
    e = mx.array([eps], mx.float32)
    mx.eval(e)
    return e


def applies(x: mx.array, w: mx.array) -> bool:
    return (ENABLED and x.ndim == 2 and x.dtype in (mx.float16, mx.bfloat16) and w.dtype == x.dtype
            and w.ndim == 1 and w.shape[0] == x.shape[1] and cuda_available())


def rms_norm_reference(x: mx.array, w: mx.array, eps: float) -> mx.array:
    return mx.fast.rms_norm(x, w, eps)


def rms_norm_kernel(x: mx.array, w: mx.array, eps: float) -> mx.array:
    """The kernel itself (CUDA only; ``applies`` says where)."""
    m = x.shape[0]
    (out,) = _kernel()(inputs=[x, w, _eps(float(eps))], template=[("T", x.dtype)], grid=(m * THREADS, 1, 1),
                       threadgroup=(THREADS, 1, 1), output_shapes=[x.shape], output_dtypes=[x.dtype])
    return out


def rms_norm(x: mx.array, w: mx.array, eps: float) -> mx.array:
    """(M, N) rows -> rms_norm(rows) * w: the kernel where it applies."""
    return rms_norm_kernel(x, w, eps) if applies(x, w) else rms_norm_reference(x, w, eps)
