"""The flatten-rows patch changes nothing numerically; formats dispatch as documented."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx_lm.models import llama

from tandem.kernels.cuda import linear
from tandem.kernels.cuda import w4mma
from tandem.kernels.cuda.linear import FlatLinear, flatten_linears, fuse_linears, choose_weight_format


def _tiny_llama(seed=0):
    mx.random.seed(seed)
    args = llama.ModelArgs(model_type="llama", hidden_size=128, num_hidden_layers=2,
                           intermediate_size=256, num_attention_heads=4, num_key_value_heads=2,
                           rms_norm_eps=1e-5, vocab_size=256, tie_word_embeddings=False)
    model = llama.Model(args)
    mx.eval(model.parameters())
    return model


@pytest.mark.parametrize("quantize", [False, True])
def test_flattened_model_gives_identical_logits(quantize):
    model = _tiny_llama()
    if quantize:
        nn.quantize(model, group_size=32, bits=4)
    tokens = mx.random.randint(0, 256, (3, 7))
    before = model(tokens)
    n = flatten_linears(model)
    assert n == 2 * 7 + 1
    assert all(isinstance(m, FlatLinear) for _, m in model.named_modules()
               if isinstance(m, (nn.Linear, nn.QuantizedLinear)) or "proj" in _)
    after = model(tokens)
    assert mx.array_equal(before, after).item()


def test_flat_linear_reshapes_any_leading_shape():
    mx.random.seed(1)
    lin = nn.Linear(64, 48, bias=True)
    x = mx.random.normal((2, 3, 5, 64))
    flat = FlatLinear(weight=lin.weight, bias=lin.bias)
    assert flat(x).shape == (2, 3, 5, 48)
    assert mx.array_equal(flat(x), lin(x.reshape(-1, 64)).reshape(2, 3, 5, 48)).item()


def test_dual_format_uses_quantized_for_small_rows_and_dense_above():
    mx.random.seed(2)
    q = nn.QuantizedLinear(128, 64, bias=False, group_size=32, bits=4)
    dual = linear._from_module(q, "dual", mx.float32, small_rows=4)
    x_small, x_big = mx.random.normal((1, 3, 128)), mx.random.normal((2, 8, 128))
    assert mx.array_equal(dual(x_small), q(x_small)).item()
    dense = mx.dequantize(q.weight, q.scales, q.biases, group_size=32, bits=4)
    assert mx.allclose(dual(x_big), x_big @ dense.T, atol=1e-5).item()
    assert "dense-float32" in linear.paths_used()


def test_quantized_rows_are_chunked_to_the_launch_limit(monkeypatch):
    mx.random.seed(3)
    q = nn.QuantizedLinear(64, 32, bias=False, group_size=32, bits=4)
    flat = linear._from_module(q, "quantized", mx.float32, small_rows=0)
    calls = []
    real = mx.quantized_matmul

    def spy(x, *a, **k):
        calls.append(x.shape[0])
        return real(x, *a, **k)

    monkeypatch.setattr(linear, "QUANTIZED_MAX_ROWS", 5)
    monkeypatch.setattr(mx, "quantized_matmul", spy)
    x = mx.random.normal((3, 4, 64))
    y = flat(x)
    monkeypatch.undo()
    assert calls == [5, 5, 2]
    assert mx.array_equal(y, q(x)).item()


def test_fused_linears_equal_the_concatenated_outputs():
    mx.random.seed(4)
    parts = [nn.QuantizedLinear(64, n, bias=False, group_size=32, bits=4) for n in (32, 16, 16)]
    flats = [linear._from_module(p, "dual", mx.float32, small_rows=16) for p in parts]
    fused = fuse_linears(flats)
    for rows in (2, 40):
        x = mx.random.normal((rows, 64))
        want = mx.concatenate([f(x) for f in flats], axis=-1)
        assert mx.allclose(fused(x), want, atol=1e-5).item()


def test_weight_format_choice_per_backend():
    gib = 2**30
    assert choose_weight_format(True, 16 * gib, 5 * gib, 139 * gib, "cuda")[0] == "dual"
    assert choose_weight_format(True, 16 * gib, 5 * gib, 24 * gib, "cuda")[0] == "quantized"
    # w4gemm's packed copy counts against the budget: 16 + 5 fits 60% of 36 GiB, + 4 does not
    assert choose_weight_format(True, 16 * gib, 5 * gib, 36 * gib, "cuda")[0] == "dual"
    assert choose_weight_format(True, 16 * gib, 5 * gib, 36 * gib, "cuda", packed_bytes=4 * gib)[0] == "quantized"
    assert "packed 4.0 GiB" in choose_weight_format(True, 16 * gib, 5 * gib, 139 * gib, "cuda", packed_bytes=4 * gib)[1]
    assert choose_weight_format(True, 16 * gib, 5 * gib, None, "cpu")[0] == "dense"
    assert choose_weight_format(True, 16 * gib, 5 * gib, None, "metal")[0] == "quantized"
    assert choose_weight_format(False, 16 * gib, 0, None, "cuda")[0] == "dense"


def test_fused_call_falls_back_to_the_separate_ops():
    mx.random.seed(5)
    q = nn.QuantizedLinear(128, 64, bias=False, group_size=32, bits=4)
    flat = linear._from_module(q, "dual", mx.float32, small_rows=16)
    h = mx.random.normal((3, 128))
    g = mx.random.normal((128,))
    res = mx.random.normal((3, 64))
    got = flat.fused(h, norm_weight=g, eps=1e-5, residual=res)
    assert mx.array_equal(got, res + flat(mx.fast.rms_norm(h, g, 1e-5))).item()
    gu = mx.random.normal((3, 256))
    got = flat.fused(gu, swiglu=True)
    want = flat(nn.silu(gu[:, :128]) * gu[:, 128:])
    assert mx.allclose(got, want, atol=1e-5).item()


@pytest.mark.gpu
@pytest.mark.skipif(not linear.qmm.cuda_available(), reason="needs MLX's CUDA backend")
@pytest.mark.timeout(120, method="thread")
@pytest.mark.parametrize("rows", [1, 3, 8, 40])
def test_cuda_dual_layer_matches_dequantized_product(rows):
    """dual: the multirow kernel (<= 4 rows), the tensor-core 4-bit kernel (up to
    W4MMA_MAX_ROWS) and the dense GEMM (more) give the same product."""
    mx.random.seed(rows)
    w = (mx.random.normal((512, 1024)) / 32).astype(mx.float16)
    q = nn.QuantizedLinear.from_linear(_linear_with(w), group_size=64, bits=4)
    flat = linear._from_module(q, "dual", mx.float16, 4)
    x = mx.random.normal((rows, 1, 1024)).astype(mx.float16)
    want = (x.astype(mx.float32) @ mx.dequantize(q.weight, q.scales, q.biases, group_size=64,
                                                  bits=4).T).astype(mx.float16)
    got = flat(x)
    assert got.shape == (rows, 1, 512)
    err = (mx.abs(got.astype(mx.float32) - want.astype(mx.float32)).max()
           / mx.abs(want.astype(mx.float32)).max()).item()
    assert err < 5e-3
    used = linear.paths_used()
    want_path = ("cuda-multirow-4bit" if rows <= 4 else "cuda-w4mma-4bit"
                 if rows <= linear.W4MMA_MAX_ROWS and w4mma.MIN_WEIGHTS <= 512 * 1024 else "dense-float16")
    assert want_path in used


def _linear_with(w):
    lin = nn.Linear(w.shape[1], w.shape[0], bias=False)
    lin.weight = w
    return lin


@pytest.mark.gpu
@pytest.mark.skipif(not linear.qmm.cuda_available(), reason="needs MLX's CUDA backend")
@pytest.mark.timeout(120, method="thread")
@pytest.mark.parametrize("rows", [1, 3])
def test_cuda_fused_layer_matches_separate_ops(rows):
    """fused(): norm / swiglu / residual folded into the multirow kernel (or run beside it)
    give what the separate ops give."""
    mx.random.seed(10 + rows)
    K, N = 1024, 512
    w = (mx.random.normal((N, K)) / 32).astype(mx.float16)
    q = nn.QuantizedLinear.from_linear(_linear_with(w), group_size=64, bits=4)
    flat = linear._from_module(q, "dual", mx.float16, 4)
    wd = mx.dequantize(q.weight, q.scales, q.biases, group_size=64, bits=4).astype(mx.float32)
    x = (4 * mx.random.normal((rows, K))).astype(mx.float16)
    gu = mx.random.normal((rows, 2 * K)).astype(mx.float16)
    g = (1 + 0.1 * mx.random.normal((K,))).astype(mx.float16)
    res = mx.random.normal((rows, N)).astype(mx.float16)

    def rel(got, want):
        got = got.astype(mx.float32)
        return (mx.abs(got - want).max() / mx.abs(want).max()).item()

    xf = x.astype(mx.float32)
    normed = xf * mx.rsqrt(mx.mean(xf * xf, axis=-1, keepdims=True) + 1e-5) * g.astype(mx.float32)
    assert rel(flat.fused(x, norm_weight=g, eps=1e-5), normed @ wd.T) < 5e-3
    gf = gu.astype(mx.float32)
    act = gf[:, :K] * mx.sigmoid(gf[:, :K]) * gf[:, K:]
    assert rel(flat.fused(gu, swiglu=True, residual=res), act @ wd.T + res.astype(mx.float32)) < 5e-3


@pytest.mark.gpu
@pytest.mark.skipif(not linear.qmm.cuda_available(), reason="needs MLX's CUDA backend")
@pytest.mark.timeout(120, method="thread")
def test_cuda_dual_layer_uses_the_tensor_core_kernel_between_multirow_and_dense(monkeypatch):
    monkeypatch.setattr(w4mma, "MIN_WEIGHTS", 0)
    monkeypatch.setattr(linear, "W4MMA_MAX_ROWS", 8)
    mx.random.seed(12)
    w = (mx.random.normal((512, 1024)) / 32).astype(mx.float16)
    q = nn.QuantizedLinear.from_linear(_linear_with(w), group_size=64, bits=4)
    flat = linear._from_module(q, "dual", mx.float16, 4)
    rows = min(linear.W4MMA_MAX_ROWS, 7)
    x = mx.random.normal((rows, 1024)).astype(mx.float16)
    res = mx.random.normal((rows, 512)).astype(mx.float16)
    wd = mx.dequantize(q.weight, q.scales, q.biases, group_size=64, bits=4).astype(mx.float32)
    want = (x.astype(mx.float32) @ wd.T + res.astype(mx.float32)).astype(mx.float16)
    got = flat.fused(x, residual=res)
    err = (mx.abs(got.astype(mx.float32) - want.astype(mx.float32)).max()
           / mx.abs(want.astype(mx.float32)).max()).item()
    assert err < 5e-3
    assert "cuda-w4mma-4bit" in linear.paths_used()


def test_capture_rows_puts_every_packed_product_of_17_rows_and_up_on_wgmma(monkeypatch):
    """Launched by MLX, only one-pass products take ``w4wgmma`` (down's K splits lost to
    cuBLAS); a step the graph step captures needs every product to be a tandem kernel, so
    ``capture_rows`` gives the kernel every packed product of 17 rows up to its bound."""
    from tandem.kernels.cuda import w4gemm
    from tandem.kernels.cuda import w4wgmma

    monkeypatch.setattr(w4gemm, "MIN_WEIGHTS", 0)
    monkeypatch.setattr(w4wgmma, "available", lambda: True)
    mx.random.seed(3)
    model = nn.Sequential(_linear_with((mx.random.normal((256, 4096)) / 64).astype(mx.float16)))
    model.layers[0] = linear._from_module(nn.QuantizedLinear.from_linear(model.layers[0], group_size=64, bits=4),
                                          "dual", mx.float16, 4)
    down = model.layers[0]  # few output rows against a long K: split along K
    assert down.pack_w4gemm() and w4wgmma.k_splits(256, 4096) > 1

    def applies(rows):
        return down._w4wg_applies(mx.zeros((rows, 4096), mx.float16))

    def packed(rows):
        return down._w4g_applies(mx.zeros((rows, 4096), mx.float16))

    assert [applies(r) for r in (16, 17, 64, 128)] == [False] * 4  # cuBLAS's dense product
    assert [packed(r) for r in (16, 17, 64)] == [True, False, False]
    assert linear.capture_rows(model, 128) == 1
    assert [applies(r) for r in (16, 17, 64, 128, 129)] == [False, True, True, True, False]
    assert [packed(r) for r in (17, 128, 129)] == [True, True, False]
    # A layer wgmma does not cover (output rows not whole 256-row blocks) takes w4gemm.
    monkeypatch.setattr(down, "w4g_tiles", 8)
    assert [applies(r) for r in (17, 128)] == [False, False] and [packed(r) for r in (17, 128)] == [True, True]
    linear.capture_rows(model, 0)
    assert not packed(64)
