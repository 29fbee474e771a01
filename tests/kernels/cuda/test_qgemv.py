"""The one-row staged 4-bit kernel agrees with its pure-ops reference on fresh inputs."""

from __future__ import annotations

import mlx.core as mx
import pytest

from tandem.kernels.cuda import qgemv as qg
from tandem.kernels.cuda import quantized_matmul as qm

gpu = pytest.mark.skipif(not qm.cuda_available(), reason="needs MLX's CUDA backend")
hang_guard = pytest.mark.timeout(120, method="thread")


def _case(n, k, gs, seed):
    mx.random.seed(seed)
    w = mx.random.normal((n, k)) / k**0.5
    wq, s, b = mx.quantize(w.astype(mx.float16), group_size=gs, bits=4)
    x = mx.random.normal((1, k)).astype(mx.float16)
    return x, wq, s, b


def _rel_err(got, want):
    got, want = got.astype(mx.float32), want.astype(mx.float32)
    return (mx.abs(got - want).max() / (mx.abs(want).max() + 1e-6)).item()


def test_support_rules():
    x, wq, s, _ = _case(64, 1024, 64, seed=1)
    assert qg.supports(x, wq, s, 4, 64)
    assert not qg.supports(x, wq, s, 8, 64)                        # 4-bit only
    assert not qg.supports(mx.concatenate([x, x]), wq, s, 4, 64)    # one row only
    assert not qg.supports(x.astype(mx.float32), wq, s, 4, 64)      # fp16 only
    x2, wq2, s2, _ = _case(64, 512, 64, seed=2)
    assert not qg.supports(x2, wq2, s2, 4, 64)                     # K % 1024
    assert not qg.supports(x, wq[:62], s[:62], 4, 64, pair=True)   # pairs need N % 4


def test_large_products_stay_on_the_multirow_kernel():
    x, wq, s, _ = _case(qg.MAX_N + 2, 1024, 64, seed=3)
    assert not qg.supports(x, wq, s, 4, 64)


@gpu
@pytest.mark.gpu
@hang_guard
@pytest.mark.parametrize("n,k,gs", [(6144, 4096, 64), (4096, 14336, 64), (1024, 2048, 32),
                                    (512, 1024, 128)])
def test_plain_matches_reference(n, k, gs):
    x, wq, s, b = _case(n, k, gs, seed=n + k)
    got = qg.qgemv(x, wq, s, b, gs)
    assert _rel_err(got, qg.qgemv_reference(x, wq, s, b, gs)) < 5e-3


@gpu
@pytest.mark.gpu
@hang_guard
def test_fusions_match_reference():
    n, k = 2048, 4096
    x, wq, s, b = _case(n, k, 64, seed=7)
    g = (1 + 0.1 * mx.random.normal((k,))).astype(mx.float16)
    got = qg.qgemv(3 * x, wq, s, b, 64, norm_weight=g, eps=1e-5)
    assert _rel_err(got, qg.qgemv_reference(3 * x, wq, s, b, 64, norm_weight=g, eps=1e-5)) < 5e-3
    res = mx.random.normal((1, n // 2)).astype(mx.float16)
    got = qg.qgemv(x, wq, s, b, 64, norm_weight=g, pair=True, residual=res)
    want = qg.qgemv_reference(x, wq, s, b, 64, norm_weight=g, pair=True, residual=res)
    assert got.shape == (1, n // 2) and _rel_err(got, want) < 5e-3



def _stream_shapes(k):
    shapes = [(1, 8, 1), (1, 4, 2), (1, 16, 1), (1, 2, 3)]
    if (k // 32) % 64 == 0:
        shapes.append((2, 8, 1))
    return shapes


@gpu
@pytest.mark.gpu
@hang_guard
@pytest.mark.parametrize("n,k,gs", [(6144, 4096, 64), (4096, 14336, 64), (1000, 2048, 32),
                                    (516, 1024, 128)])
def test_stream_matches_reference(n, k, gs):
    """Every block shape, including row counts that leave a block's last passes past N."""
    x, wq, s, b = _case(n, k, gs, seed=3 * n + k)
    res = mx.random.normal((1, n)).astype(mx.float16)
    for shape in _stream_shapes(k):
        got = qg.qgemv_stream(x, wq, s, b, shape=shape)
        assert got.shape == (1, n) and _rel_err(got, qg.qgemv_reference(x, wq, s, b, gs)) < 5e-3, shape
        got = qg.qgemv_stream(x, wq, s, b, residual=res, shape=shape)
        assert _rel_err(got, qg.qgemv_reference(x, wq, s, b, gs, residual=res)) < 5e-3, shape


@gpu
@pytest.mark.gpu
@hang_guard
@pytest.mark.parametrize("n,k", [(28672 // 4, 4096), (2 * 250, 1024)])
def test_stream_pair_matches_reference(n, k):
    x, wq, s, b = _case(n, k, 64, seed=n + 2 * k)
    res = mx.random.normal((1, n // 2)).astype(mx.float16)
    for shape in _stream_shapes(k):
        if shape[1] < 2:
            continue
        got = qg.qgemv_stream(x, wq, s, b, pair=True, residual=res, shape=shape)
        want = qg.qgemv_reference(x, wq, s, b, 64, pair=True, residual=res)
        assert got.shape == (1, n // 2) and _rel_err(got, want) < 5e-3, shape


@gpu
@pytest.mark.gpu
@hang_guard
def test_dispatch_to_the_stream_kernel_applies_the_norm():
    """The norm runs inside the kernel: the reference's result."""
    n, k = 2048, 4096
    x, wq, s, b = _case(n, k, 64, seed=11)
    g = (1 + 0.1 * mx.random.normal((k,))).astype(mx.float16)
    got = qg.qgemv(3 * x, wq, s, b, 64, norm_weight=g, eps=1e-5, pair=True)
    want = qg.qgemv_reference(3 * x, wq, s, b, 64, norm_weight=g, eps=1e-5, pair=True)
    assert _rel_err(got, want) < 5e-3


@gpu
@pytest.mark.gpu
@hang_guard
@pytest.mark.parametrize("unpack", [0, 1])
@pytest.mark.parametrize("n,k,pair", [(6144, 4096, False), (2048, 4096, True), (1000, 14336, False)])
def test_stream_fused_norm_and_unpacking_match_reference(n, k, pair, unpack):
    x, wq, s, b = _case(n, k, 64, seed=5 * n + k)
    g = (1 + 0.1 * mx.random.normal((k,))).astype(mx.float16)
    for shape in [(1, 8, 1), (1, 4, 4)]:
        got = qg.qgemv_stream(3 * x, wq, s, b, norm_weight=g, eps=1e-5, pair=pair, shape=shape, unpack=unpack)
        want = qg.qgemv_reference(3 * x, wq, s, b, 64, norm_weight=g, eps=1e-5, pair=pair)
        assert _rel_err(got, want) < 5e-3, shape
        got = qg.qgemv_stream(x, wq, s, b, pair=pair, shape=shape, unpack=unpack)
        assert _rel_err(got, qg.qgemv_reference(x, wq, s, b, 64, pair=pair)) < 5e-3, shape


def test_stream_shape_by_product(monkeypatch):
    """QKV and o (at most SMALL_ROWS rows) take SHAPE_SMALL, gate/up SHAPE_NARROW, rows of
    8,192 weights and more SHAPE_WIDE; the defaults give QKV and o gate/up's shape."""
    assert qg.stream_shape(4096, 6144) == qg.stream_shape(4096, 28672) == (1, 8, 1)
    assert qg.stream_shape(14336, 4096) == (1, 4, 4)
    monkeypatch.setattr(qg, "SHAPE_SMALL", (1, 4, 2))
    assert qg.stream_shape(4096, 6144) == qg.stream_shape(4096, 4096) == (1, 4, 2)
    assert qg.stream_shape(4096, 28672) == qg.stream_shape(4096) == (1, 8, 1)
    assert qg.stream_shape(14336, 4096) == (1, 4, 4)


def test_lean_inputs_drop_what_a_call_does_not_read():
    assert qg.lean_inputs(False, True, False) == ["x", "w", "scales", "biases", "res"]
    assert qg.lean_inputs(True, False, True) == ["x", "w", "scales", "biases", "norm_w", "fparams"]
    src = qg.lean_source(qg.lean_inputs(True, False, False))
    # The dropped names are null pointers for the body alone; a kept one is left alone.
    assert "#define res ((const __half*)nullptr)" in src and "#undef res" in src
    assert "#define fparams" in src and "#define norm_w" not in src


@gpu
@pytest.mark.gpu
@hang_guard
@pytest.mark.parametrize("in_template", [True, False])
def test_kernel_matches_reference_for_each_kind_of_decode_call(monkeypatch, in_template):
    """Every kind of call a decode layer makes (QKV and gate/up with their norm, o and down
    with their residual), with the eps in the template or read from an array."""
    from tandem.kernels.cuda import constants
    monkeypatch.setattr(constants, "IN_TEMPLATE", in_template)
    for n, k, pair, norm, res in [(6144, 4096, False, True, False), (4096, 4096, False, False, True),
                                  (2048, 4096, True, True, False), (4096, 14336, False, False, True)]:
        x, wq, s, b = _case(n, k, 64, seed=n + k)
        g = (1 + 0.1 * mx.random.normal((k,))).astype(mx.float16) if norm else None
        r = mx.random.normal((1, n // 2 if pair else n)).astype(mx.float16) if res else None
        got = qg.qgemv_stream(3 * x, wq, s, b, norm_weight=g, eps=1e-5, residual=r, pair=pair)
        want = qg.qgemv_reference(3 * x, wq, s, b, 64, norm_weight=g, eps=1e-5, residual=r, pair=pair)
        assert _rel_err(got, want) < 5e-3, (n, k, pair, norm, res)
