"""The multirow quantized kernel agrees with dequantize + matmul on fresh random inputs."""

from __future__ import annotations

import mlx.core as mx
import pytest

from tandem.kernels.cuda import quantized_matmul as qm

gpu = pytest.mark.skipif(not qm.cuda_available(), reason="needs MLX's CUDA backend")
hang_guard = pytest.mark.timeout(120, method="thread")  # a hung kernel ends the run, not the call


def _case(m, n, k, bits, gs, dtype, seed):
    mx.random.seed(seed)
    w = mx.random.normal((n, k)) / k**0.5
    wq, s, b = mx.quantize(w.astype(dtype), group_size=gs, bits=bits)
    x = mx.random.normal((m, k)).astype(dtype)
    return x, wq, s, b


def _rel_err(got, want):
    got, want = got.astype(mx.float32), want.astype(mx.float32)
    return (mx.abs(got - want).max() / (mx.abs(want).max() + 1e-6)).item()


@pytest.mark.parametrize("bits,gs", [(4, 32), (4, 64), (8, 64)])
def test_reference_matches_mlx_quantized_matmul_on_cpu(bits, gs):
    x, wq, s, b = _case(3, 64, 256, bits, gs, mx.float32, seed=bits + gs)
    want = mx.quantized_matmul(x, wq, s, b, transpose=True, group_size=gs, bits=bits)
    got = qm.quantized_matmul_reference(x, wq, s, b, gs, bits)
    assert mx.allclose(got, want, atol=1e-4, rtol=1e-4).item()


def test_dispatcher_falls_back_off_cuda_and_keeps_leading_dims():
    x, wq, s, b = _case(6, 64, 256, 4, 64, mx.float32, seed=7)
    x3 = x.reshape(2, 3, 256)
    got = qm.quantized_matmul(x3, wq, s, b, group_size=64, bits=4)
    want = mx.quantized_matmul(x, wq, s, b, transpose=True, group_size=64, bits=4)
    assert got.shape == (2, 3, 64)
    assert mx.allclose(got.reshape(6, 64), want, atol=1e-5).item()


def test_kernel_support_rules():
    _, wq, s, _ = _case(1, 64, 256, 4, 64, mx.float16, seed=8)
    assert qm.kernel_supports(16, wq, s, mx.float16, 64, 4)
    assert not qm.kernel_supports(17, wq, s, mx.float16, 64, 4)
    assert not qm.kernel_supports(1, wq, s, mx.float16, 64, 4, mode="mxfp4")
    assert not qm.kernel_supports(1, wq, s, mx.float16, 64, 3)


def test_reference_fusions_equal_the_separate_ops_on_cpu():
    x, wq, s, b = _case(3, 64, 256, 4, 64, mx.float32, seed=9)
    gate_up = mx.random.normal((3, 512))
    g = mx.random.normal((256,))
    res = mx.random.normal((3, 64))
    plain = lambda v: qm.quantized_matmul_reference(v, wq, s, b, 64, 4)  # noqa: E731
    got = qm.quantized_matmul_reference(x, wq, s, b, 64, 4, norm_weight=g, eps=1e-5, residual=res)
    want = plain(mx.fast.rms_norm(x, g, 1e-5)) + res
    assert mx.allclose(got, want, atol=1e-4).item()
    got = qm.quantized_matmul_reference(gate_up, wq, s, b, 64, 4, swiglu=True)
    want = plain(gate_up[:, :256] * mx.sigmoid(gate_up[:, :256]) * gate_up[:, 256:])
    assert mx.allclose(got, want, atol=1e-4).item()


# Each distinct template (dtype, bits, row bucket, fusions) costs an NVRTC compile of ~5 s
# on the GPU machine, so the cases below cover every path with few variants.
@gpu
@pytest.mark.gpu
@hang_guard
@pytest.mark.parametrize("bits,gs,dtype,m", [
    (4, 64, mx.float16, 1), (4, 32, mx.float16, 5), (4, 128, mx.float16, 16),
    (4, 64, mx.bfloat16, 3), (8, 64, mx.float16, 1), (8, 32, mx.bfloat16, 16),
])
def test_cuda_kernel_matches_reference(bits, gs, dtype, m):
    x, wq, s, b = _case(m, 1024, 2048, bits, gs, dtype, seed=m * 100 + bits + gs)
    got = qm.quantized_matmul_cuda(x, wq, s, b, gs, bits)
    want = qm.quantized_matmul_reference(x, wq, s, b, gs, bits)
    assert got.shape == want.shape and got.dtype == dtype
    assert _rel_err(got, want) < (2e-2 if dtype == mx.bfloat16 else 5e-3)


@gpu
@pytest.mark.gpu
@hang_guard
@pytest.mark.parametrize("m", [1, 4])
def test_cuda_kernel_fusions_match_reference(m):
    x, wq, s, b = _case(m, 1024, 2048, 4, 64, mx.float16, seed=11 + m)
    g = (1 + 0.1 * mx.random.normal((2048,))).astype(mx.float16)
    res = mx.random.normal((m, 1024)).astype(mx.float16)
    got = qm.quantized_matmul_cuda(3 * x, wq, s, b, 64, 4, norm_weight=g, eps=1e-5)
    want = qm.quantized_matmul_reference(3 * x, wq, s, b, 64, 4, norm_weight=g, eps=1e-5)
    assert _rel_err(got, want) < 5e-3
    gu = mx.random.normal((m, 4096)).astype(mx.float16)
    got = qm.quantized_matmul_cuda(gu, wq, s, b, 64, 4, swiglu=True, residual=res)
    want = qm.quantized_matmul_reference(gu, wq, s, b, 64, 4, swiglu=True, residual=res)
    assert _rel_err(got, want) < 5e-3


@gpu
@pytest.mark.gpu
@hang_guard
@pytest.mark.parametrize("n,k,half_math", [(4096, 14336, True), (6144, 4096, False), (130, 512, True)])
def test_cuda_kernel_matches_reference_at_model_shapes(n, k, half_math):
    x, wq, s, b = _case(4, n, k, 4, 64, mx.float16, seed=n + k)
    got = qm.quantized_matmul_cuda(x, wq, s, b, 64, 4, half_math=half_math)
    want = qm.quantized_matmul_reference(x, wq, s, b, 64, 4)
    assert _rel_err(got, want) < 5e-3


@pytest.mark.gpu
@gpu
@pytest.mark.timeout(120, method="thread")
def test_the_half_cast_kernel_rounds_as_mlxs_cast():
    """``to_half`` (the graph step can capture it; MLX's cast it cannot) gives MLX's cast bit
    for bit, ties, overflow and subnormals included, at sizes that end mid-block."""
    mx.random.seed(4)
    specials = mx.array([0.0, -0.0, 65504.0, 65520.0, 1e6, -1e6, 6e-8, 3e-8, 1.00048828125, 2049.0],
                        mx.float32)
    for shape in [(1, 10), (3, 1000), (64, 6144)]:
        y = mx.random.normal(shape) * 300
        y[0, :10] = specials
        got, want = qm.to_half(y), y.astype(mx.float16)
        assert got.dtype == mx.float16 and got.shape == y.shape
        assert mx.array_equal(got.view(mx.uint16), want.view(mx.uint16)).item(), shape
