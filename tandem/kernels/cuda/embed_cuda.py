"""The token embedding of an affine-quantized table (mlx ``QuantizedEmbedding``), on CUDA.

mlx computes ``dequantize(weight[ids], scales[ids], biases[ids])``: three gathers and a
dequantize. On the H200 the gathers of a 512-token prompt took ~300 us each (950 us
of a 12.2 ms prefill, 8% of it), where the table rows they move are
2 MB. This kernel reads each token's id once, its packed row, scales and biases with
16-byte loads, and writes the dequantized row: one launch instead of four.

``quantized_embedding_reference`` is mlx's own computation; ``embed`` picks the kernel
when it applies and the module's own call otherwise (CPU, other modes and widths).
"""

from __future__ import annotations

import functools

import mlx.core as mx
import mlx.nn as nn

from tandem.kernels.cuda import kernel_files
from tandem.kernels.cuda.paged_attention_cuda import i32
from tandem.kernels.cuda.quantized_matmul import cuda_available

BITS = (4, 8)

# Template: T (scale dtype = output dtype), BITS, GS (group size), WPR (uint32 words per
# table row). Inputs: ids (N,) int32, w (V, WPR) uint32, scales, biases (V, dims / GS).
# Output: out (N, dims). One thread per 16 bytes of a packed row (4 words: 32 values at
# 4 bits, 16 at 8), each inside one group since GS >= 32; blockIdx.y is the token.
_SOURCE = r"""
  constexpr int VPW = 32 / BITS;                 // values per word
  constexpr int DIMS = WPR * VPW;
  constexpr int NG = DIMS / GS;
  const int t = blockIdx.x * blockDim.x + threadIdx.x;
  if (t >= WPR / 4) return;
  const int n = blockIdx.y;
  const size_t row = (size_t)(uint32_t)ids[n];
  const uint4 u = reinterpret_cast<const uint4*>(w + row * WPR)[t];
  const int c0 = t * 4 * VPW;                    // first value of this thread
  const T s = scales[row * NG + c0 / GS];
  const T b = biases[row * NG + c0 / GS];
  const uint32_t wd[4] = {u.x, u.y, u.z, u.w};
  T v[4 * VPW];
#pragma unroll
  for (int j = 0; j < 4; ++j)
#pragma unroll
    for (int i = 0; i < VPW; ++i) {
      const uint32_t d = (wd[j] >> (BITS * i)) & ((1u << BITS) - 1u);
      // mlx's affine_dequantize: scale * T(d) + bias in T arithmetic.
      v[j * VPW + i] = s * static_cast<T>((float)d) + b;
    }
  uint4* dst = reinterpret_cast<uint4*>(out + (size_t)n * DIMS + c0);
#pragma unroll
  for (int k = 0; k < 4 * VPW * (int)sizeof(T) / 16; ++k) dst[k] = reinterpret_cast<const uint4*>(v)[k];
"""


@functools.cache
def _kernel():
    return kernel_files.cuda_kernel(
        name="tandem_quantized_embedding",
        input_names=["ids", "w", "scales", "biases"],
        output_names=["out"],
        source=_SOURCE,
    )


def supported(module) -> bool:
    """Whether ``embed`` runs the kernel for this embedding module (on a CUDA device)."""
    if not isinstance(module, nn.QuantizedEmbedding) or getattr(module, "mode", "affine") != "affine":
        return False
    return (module.get("biases") is not None and module.bits in BITS and module.group_size >= 32
            and module.scales.dtype in (mx.float16, mx.bfloat16)
            and module.weight.shape[-1] % 4 == 0 and cuda_available())


def quantized_embedding(ids: mx.array, w: mx.array, scales: mx.array, biases: mx.array,
                        group_size: int, bits: int) -> mx.array:
    """ids (any shape) -> (*ids.shape, dims) in the scales' dtype, equal to mlx's
    ``dequantize(w[ids], scales[ids], biases[ids])``."""
    if bits not in BITS:
        raise ValueError(f"{bits}-bit tables: the kernel covers {BITS}")
    wpr = w.shape[-1]
    if wpr % 4 or group_size < 32:
        raise ValueError(f"rows of {wpr} words / group size {group_size}: need a multiple of 4 words and groups >= 32")
    dims = wpr * 32 // bits
    flat = i32(ids.reshape(-1))
    n = flat.shape[0]
    if n == 0:
        return mx.zeros((*ids.shape, dims), scales.dtype)
    threads = wpr // 4
    tg = min(128, threads)
    (out,) = _kernel()(
        inputs=[flat, w, scales, biases],
        template=[("T", scales.dtype), ("BITS", bits), ("GS", group_size), ("WPR", wpr)],
        grid=(-(-threads // tg) * tg, n, 1),
        threadgroup=(tg, 1, 1),
        output_shapes=[(n, dims)],
        output_dtypes=[scales.dtype],
    )
    return out.reshape(*ids.shape, dims)


def quantized_embedding_reference(ids: mx.array, w: mx.array, scales: mx.array, biases: mx.array,
                                  group_size: int, bits: int) -> mx.array:
    """mlx's computation (``nn.QuantizedEmbedding.__call__``)."""
    return mx.dequantize(w[ids], scales=scales[ids], biases=biases[ids], group_size=group_size, bits=bits)


def embed(module, ids: mx.array) -> mx.array:
    """``module(ids)``, through the kernel when :func:`supported` says so."""
    if supported(module):
        return quantized_embedding(ids, module.weight, module.scales, module.biases,
                                   module.group_size, module.bits)
    return module(ids)
