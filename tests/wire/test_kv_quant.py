"""KV quantization: the numpy kernel equals the tile-by-tile reference, and stays within its bound."""

from __future__ import annotations

import numpy as np
import pytest

from tandem.wire import kv_quant as kq


def _cache(dtype, seed=0, shape=(5, 3, 16, 64), outliers=True):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape).astype(np.float32)
    if outliers:  # K caches have a few large channels; one tile is all zeros
        x[..., 3] *= 20
        x[1, 2] = 0
    return kq.from_float32(x, dtype)


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("dtype", kq.DTYPES)
def test_kernel_equals_reference(bits, dtype):
    x = _cache(dtype)
    q, s = kq.quantize(x, bits, dtype)
    q_ref, s_ref = kq.quantize_reference(x, bits, dtype)
    np.testing.assert_array_equal(s, s_ref)
    np.testing.assert_array_equal(q, q_ref)
    np.testing.assert_array_equal(kq.dequantize(q, s, bits, dtype), kq.dequantize_reference(q, s, bits, dtype))
    expected_shape = x.shape if bits == 8 else x.shape[:-1] + (x.shape[-1] // 2,)
    assert q.shape == expected_shape and s.shape == x.shape[:2] and s.dtype == np.float32


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("dtype", kq.DTYPES)
def test_error_within_documented_bound(bits, dtype):
    for seed in range(3):
        x = _cache(dtype, seed)
        q, s = kq.quantize(x, bits, dtype)
        x_hat = kq.dequantize(q, s, bits, dtype)
        err = np.abs(kq.to_float32(x, dtype) - kq.to_float32(x_hat, dtype))
        assert np.all(err <= kq.error_bound(x, s, dtype))
        # The bound is tight enough to mean something: the worst error uses a good part of it.
        assert err.max() > 0.3 * (s.max() / 2)
    # All-zero tiles come back exactly.
    assert np.all(kq.to_float32(x_hat, dtype)[1, 2] == 0)


def test_int8_relative_error_on_normal_data():
    x = _cache("float16", outliers=False)
    q, s = kq.quantize(x, 8)
    x_hat = kq.dequantize(q, s, 8, "float16")
    rel = np.linalg.norm(x_hat.astype(np.float32) - x.astype(np.float32)) / np.linalg.norm(x.astype(np.float32))
    assert rel < 0.012  # 0.8% measured on unit normals; the bound above is the contract


def test_bfloat16_round_trip_helpers():
    f = np.array([1.0009765625, 1e-3, 65504.0], np.float32)
    back = kq.to_float32(kq.from_float32(f, "bfloat16"), "bfloat16")
    assert np.all(np.abs(back - f) <= np.abs(f) * 2.0**-8)
    exact = np.array([1.0, -2.5, 3.140625], np.float32)  # representable in bfloat16
    np.testing.assert_array_equal(kq.to_float32(kq.from_float32(exact, "bfloat16"), "bfloat16"), exact)


def test_bad_shapes_refused():
    with pytest.raises(ValueError):
        kq.quantize(np.zeros((2, 2, 2), np.float16), 8)
    with pytest.raises(ValueError):
        kq.quantize(np.zeros((1, 1, 2, 3), np.float16), 4)
    with pytest.raises(ValueError):
        kq.quantize(np.zeros((1, 1, 2, 4), np.float16), 2)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_fast_conversions_match_numpy(dtype):
    rng = np.random.default_rng(0)
    x = (rng.standard_normal(1 << 16) * np.exp(rng.uniform(-25, 10, 1 << 16))).astype(np.float32)
    x = np.clip(x, -65504, 65504)
    x[:6] = [0.0, -0.0, 1e-8, 6e-8, 3e-8, 65504.0]
    if dtype == "float16":
        h = kq.from_float32(x, "float16")
        np.testing.assert_array_equal(h.view(np.uint16), x.astype(np.float16).view(np.uint16))
        np.testing.assert_array_equal(kq.to_float32(h, "float16"), h.astype(np.float32))
    else:
        b = kq.from_float32(x, "bfloat16")
        back = kq.to_float32(b, "bfloat16")
        assert np.all(np.abs(back - x) <= np.abs(x) * 2.0**-8)


def test_non_finite_kv_refused():
    for dtype in ("float16", "float32"):
        x = np.zeros((1, 1, 4, 4), dtype)
        x[0, 0, 1, 2] = np.inf
        with pytest.raises(ValueError, match="inf or NaN"):
            kq.quantize(x, 8)
        x[0, 0, 1, 2] = np.nan
        with pytest.raises(ValueError, match="inf or NaN"):
            kq.quantize(x, 4)


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("dtype", kq.DTYPES)
def test_dequantize_equals_reference_on_any_bytes_and_scales(bits, dtype):
    # The table-driven decode must match the reference for every byte value and scale,
    # over enough tiles to take several gather steps (and several groups for float32).
    rng = np.random.default_rng(7)
    shape = (40, 8, 16, 128 if bits == 8 else 64)
    q = rng.integers(0, 256, shape, dtype=np.uint8)
    q = q.view(np.int8) if bits == 8 else q
    limit = {"float16": 65504.0, "bfloat16": 3e38, "float32": 3e38}[dtype] / kq.QMAX[bits]
    s = (rng.random(shape[:2]) * min(limit, 1e3)).astype(np.float32)
    s[0, 0], s[1, 1], s[2, 2] = 0.0, np.float32(1e-30), np.float32(limit)  # zero, subnormal results, the largest allowed
    if bits == 8:
        q[3, 3] = -128  # outside the quantizer's range but a byte a peer can send
    got = kq.dequantize(q, s, bits, dtype)
    with np.errstate(over="ignore"):  # the reference warns where the decode table did not
        ref = kq.dequantize_reference(q, s, bits, dtype)
    assert got.dtype == ref.dtype and got.shape == ref.shape
    np.testing.assert_array_equal(got.view(np.uint8), ref.view(np.uint8))  # bit-exact, signed zeros too


def test_quantize_equals_reference_across_groups():
    x = _cache("float16", shape=(70, 8, 16, 128))
    for bits in (8, 4):
        q, s = kq.quantize(x, bits)
        q_ref, s_ref = kq.quantize_reference(x, bits)
        np.testing.assert_array_equal(q, q_ref)
        np.testing.assert_array_equal(s, s_ref)
