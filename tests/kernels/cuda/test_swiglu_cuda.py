"""The swiglu kernel gives mlx-lm's compiled swiglu of a [gate, up] array, bit for bit."""

from __future__ import annotations

import mlx.core as mx
import pytest

from tandem.kernels.cuda import swiglu_cuda
from tests.kernels.cuda.test_paged_attention_cuda import gpu, hang_guard


def _gate_up(rows: int, f: int, dtype, seed: int, scale: float = 3.0) -> mx.array:
    mx.random.seed(seed)
    y = (mx.random.normal((rows, 2 * f)) * scale).astype(dtype)
    mx.eval(y)
    return y


def test_falls_back_to_mlx_lm_where_the_kernel_does_not_apply(monkeypatch):
    """Off, on the CPU, in fp32 or at half widths that are not whole 16-byte loads, the
    result is mlx-lm's swiglu of the two halves."""
    from mlx_lm.models.activations import swiglu as mlx_lm_swiglu

    monkeypatch.setattr(swiglu_cuda, "ENABLED", True)
    for dtype, f in ((mx.float32, 64), (mx.float16, 12), (mx.float16, 64)):
        y = _gate_up(3, f, dtype, seed=f)
        if dtype != mx.float16 or f % 8:
            assert not swiglu_cuda.applies(y)
        got = swiglu_cuda.swiglu(y)
        assert got.shape == (3, f) and got.dtype == dtype
        assert mx.array_equal(got, mlx_lm_swiglu(y[:, :f], y[:, f:])).item()
    monkeypatch.setattr(swiglu_cuda, "ENABLED", False)
    assert not swiglu_cuda.applies(_gate_up(3, 64, mx.float16, seed=1))


@gpu
@pytest.mark.gpu
@hang_guard
@pytest.mark.parametrize("rows,f,dtype,scale", [
    (512, 14336, mx.float16, 3.0),   # a 512-token prefill of the 8B shape
    (64, 14336, mx.bfloat16, 3.0),   # a batch-64 decode step
    (5, 2048, mx.float16, 12.0),     # saturated sigmoids, |g| up to ~50
    (1, 8, mx.float16, 0.01),        # one load a row; tiny values
])
def test_kernel_matches_mlx_lm_bit_for_bit(rows, f, dtype, scale, monkeypatch):
    monkeypatch.setattr(swiglu_cuda, "ENABLED", True)
    y = _gate_up(rows, f, dtype, seed=rows + f, scale=scale)
    assert swiglu_cuda.applies(y)
    got = swiglu_cuda.swiglu(y)
    want = swiglu_cuda.swiglu_reference(y)
    mx.eval(got, want)
    err = mx.abs(got.astype(mx.float32) - want.astype(mx.float32)).max().item()
    assert mx.array_equal(got, want).item(), err
