"""Fresh random 4-bit products for the tensor-core kernels' tests (w4mma, w4gemm, w4wgmma)."""

from __future__ import annotations

import mlx.core as mx


def case(m: int, n: int, k: int, gs: int, seed: int):
    """x (m, k) fp16 and an (n, k) fp16 weight quantized to MLX's affine 4-bit: (x, wq, scales, biases)."""
    mx.random.seed(seed)
    w = (mx.random.normal((n, k)) / k**0.5).astype(mx.float16)
    wq, s, b = mx.quantize(w, group_size=gs, bits=4)
    x = mx.random.normal((m, k)).astype(mx.float16)
    return x, wq, s, b


def rel_err(got: mx.array, want: mx.array) -> float:
    """Largest absolute difference over the largest magnitude of ``want``, in fp32."""
    got, want = got.astype(mx.float32), want.astype(mx.float32)
    return (mx.abs(got - want).max() / (mx.abs(want).max() + 1e-6)).item()
