"""The tensor-core 4-bit product agrees with dequantize + matmul on fresh random inputs."""

from __future__ import annotations

import mlx.core as mx
import pytest

from tandem.kernels.cuda import quantized_matmul as qm
from tandem.kernels.cuda import w4mma
from tests.kernels.cuda.four_bit import case as _case, rel_err as _rel_err

gpu = pytest.mark.skipif(not qm.cuda_available(), reason="needs MLX's CUDA backend")
hang_guard = pytest.mark.timeout(180, method="thread")


@pytest.fixture(autouse=True)
def _small_products(monkeypatch):
    # The dispatcher keeps small products on the dense GEMM; the tests use small ones.
    monkeypatch.setattr(w4mma, "MIN_WEIGHTS", 0)


def test_support_rules():
    _, wq, s, b = _case(1, 256, 512, 64, seed=1)
    assert w4mma.supports(64, wq, s, b, mx.float16, 64, 4)
    assert not w4mma.supports(65, wq, s, b, mx.float16, 64, 4)
    assert not w4mma.supports(64, wq, s, b, mx.bfloat16, 64, 4)
    assert not w4mma.supports(64, wq, s, None, mx.float16, 64, 4)
    assert not w4mma.supports(64, wq, s, b, mx.float16, 128, 4)  # 2 bytes of scales a chunk: no cp.async
    _, wq8, s8, b8 = _case(1, 256, 512, 64, seed=1)
    assert not w4mma.supports(64, wq8, s8, b8, mx.float16, 64, 8)
    _, wq_odd, s_odd, b_odd = _case(1, 96, 512, 64, seed=2)  # 96 rows: not whole 64-row blocks
    assert not w4mma.supports(8, wq_odd, s_odd, b_odd, mx.float16, 64, 4)


def test_small_products_stay_on_the_dense_gemm(monkeypatch):
    monkeypatch.setattr(w4mma, "MIN_WEIGHTS", 1 << 25)
    _, wq, s, b = _case(1, 256, 512, 64, seed=3)
    assert not w4mma.supports(16, wq, s, b, mx.float16, 64, 4)
    big = mx.zeros((4096, 14336 // 8), dtype=mx.uint32)
    gs = mx.zeros((4096, 14336 // 64), dtype=mx.float16)
    assert w4mma.supports(16, big, gs, gs, mx.float16, 64, 4)
    # Without a dense copy the alternative is MLX's 4-bit GEMM: small products qualify too.
    assert w4mma.supports(16, wq, s, b, mx.float16, 64, 4, against_dense=False)


def test_k_splits_fill_the_card_but_keep_two_chunks_per_block():
    assert w4mma.k_splits(4096, 4096, 8) >= 4  # 32 row blocks: split K
    assert w4mma.k_splits(4096, 14336, 2) == 8  # down at 16 rows: 64 row blocks x 8
    assert w4mma.k_splits(128256, 4096, 8) == 1  # the head has blocks enough
    assert w4mma.k_splits(4096, 256, 8) == 1  # one 256-wide K cannot be split further


@gpu
@pytest.mark.gpu
@hang_guard
@pytest.mark.parametrize("m,n,k,gs,splits,res", [
    (1, 256, 512, 64, 1, False), (5, 512, 1024, 32, 1, True), (16, 1024, 2048, 32, 1, False),
    (33, 512, 1024, 64, 4, True), (64, 1024, 2048, 64, None, False), (50, 256, 3072, 64, 3, False),
    (64, 512, 1024, 64, 1, True), (64, 4096, 1024, 64, None, True),
])
def test_kernel_matches_reference(m, n, k, gs, splits, res):
    x, wq, s, b = _case(m, n, k, gs, seed=m * 7 + n + k)
    r = mx.random.normal((m, n)).astype(mx.float16) if res else None
    got = w4mma.w4_matmul(x, wq, s, b, gs, residual=r, splits=splits)
    want = w4mma.w4_matmul_reference(x, wq, s, b, gs, residual=r)
    assert got.shape == want.shape and got.dtype == mx.float16
    assert _rel_err(got, want) < 5e-3
