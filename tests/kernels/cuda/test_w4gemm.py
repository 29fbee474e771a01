"""The fragment-order 4-bit product: its packing read back the way the kernel reads it
gives mlx's dequantized weights (CPU), and the kernel agrees with dequantize + matmul on
fresh random inputs (GPU)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from tandem.kernels.cuda import quantized_matmul as qm
from tandem.kernels.cuda import w4gemm
from tandem.kernels.cuda import w4wgmma
from tests.kernels.cuda.four_bit import case as _case, rel_err

gpu = pytest.mark.skipif(not qm.cuda_available(), reason="needs MLX's CUDA backend")
hang_guard = pytest.mark.timeout(180, method="thread")


def _half_pair(words: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A uint32 array read as fp16 pairs: (low half, high half) as float32."""
    h = words.astype(np.uint32).view(np.uint16).reshape(*words.shape, 2).view(np.float16)
    return h[..., 0].astype(np.float32), h[..., 1].astype(np.float32)


def _unpack_like_the_kernel(wp: np.ndarray, sbp: np.ndarray, gs: int) -> np.ndarray:
    """The dense (N, K) weights the kernel's lanes hold: the same masks, exponent trick and
    fp16 roundings as ``w4g_deq``, placed where ``mma.m16n8k16``'s A fragment puts them
    (register 0: row g, k 2t/2t+1; 1: row g+8; 2: row g, k+8; 3: row g+8, k+8)."""
    tiles, chunks = wp.shape[:2]
    n, k = tiles * 16, chunks * 64
    out = np.full((n, k), np.nan, np.float32)
    f16 = lambda v: v.astype(np.float16).astype(np.float32)  # noqa: E731
    q = wp.astype(np.uint32)                                  # (T, C, 32, 4)
    q2 = q >> 8
    regs = [(q & 0x000F000F) | 0x64006400, (q & 0x00F000F0) | 0x64006400,
            (q2 & 0x000F000F) | 0x64006400, (q2 & 0x00F000F0) | 0x64006400]
    lane = np.arange(32)
    g, t = lane // 4, lane % 4
    T, C, L, S = np.meshgrid(np.arange(tiles), np.arange(chunks), lane, np.arange(4), indexing="ij")
    G, Tq = g[L], t[L]
    kbase = 64 * C + 16 * S + 2 * Tq
    grp = kbase // gs
    sb = sbp.astype(np.float32)                               # (T, groups, 8, 4)
    for r, word in enumerate(regs):
        hi_row = r in (1, 3)
        lo, hi = _half_pair(word)
        if hi_row:  # (1024 + 16 n) / 16 - 64
            lo, hi = f16(lo * 0.0625 - 64), f16(hi * 0.0625 - 64)
        else:       # (1024 + n) - 1024
            lo, hi = f16(lo - 1024), f16(hi - 1024)
        scale = sb[T, grp, G, 1 if hi_row else 0]
        bias = sb[T, grp, G, 3 if hi_row else 2]
        row = 16 * T + G + (8 if hi_row else 0)
        kk = kbase + (8 if r >= 2 else 0)
        out[row, kk] = f16(lo * scale + bias)
        out[row, kk + 1] = f16(hi * scale + bias)
    return out


@pytest.mark.parametrize("n,k,gs", [(32, 128, 64), (64, 256, 32), (48, 256, 128)])
def test_packing_read_as_fragments_gives_the_dequantized_weights(n, k, gs):
    _, wq, s, b = _case(1, n, k, gs, seed=n + k + gs)
    wp, sbp = w4gemm.pack(wq, s, b, gs, block_tiles=0)  # tile by tile: the order read back here
    assert wp.shape == (n // 16, k // 64, 32, 4) and wp.dtype == mx.uint32
    assert sbp.shape == (n // 16, k // gs, 8, 4) and sbp.dtype == mx.float16
    got = _unpack_like_the_kernel(np.array(wp), np.array(sbp), gs)
    want = np.array(mx.dequantize(wq, s, b, group_size=gs, bits=4).astype(mx.float32))
    assert not np.isnan(got).any()  # every weight landed in some lane's fragment
    np.testing.assert_allclose(got, want, rtol=2e-3, atol=1e-4)


def test_block_order_is_each_blocks_chunk_in_one_run():
    _, wq, s, b = _case(1, 512, 256, 64, seed=4)
    wp, sbp = (np.array(a) for a in w4gemm.pack(wq, s, b, 64, block_tiles=0))
    wpb, sbpb = (np.array(a) for a in w4gemm.pack(wq, s, b, 64, block_tiles=16))
    assert wpb.shape == wp.shape and sbpb.shape == sbp.shape
    # block 1, chunk 2: its 16 tiles' pieces, one after another
    np.testing.assert_array_equal(wpb.reshape(2, 4, 16, 32, 4)[1, 2], wp[16:32, 2])
    np.testing.assert_array_equal(sbpb.reshape(2, 4, 16, 8, 4)[1, 3], sbp[16:32, 3])


def test_blocks_must_divide_the_weight_rows():
    x, wq, s, b = _case(1, 384, 256, 64, seed=6)
    wp, sbp = w4gemm.pack(wq, s, b, 64, block_tiles=8)
    with pytest.raises(ValueError, match="384 weight rows"):
        w4gemm.w4_gemm(x, wp, sbp, 64, block_tiles=16)


def test_support_rules():
    assert w4gemm.supports(64, 4096, 4096, 64, mx.float16)
    assert w4gemm.supports(256, 128, 64, 32, mx.float16)
    assert not w4gemm.supports(257, 4096, 4096, 64, mx.float16)
    assert not w4gemm.supports(64, 4096, 4096, 64, mx.bfloat16)
    assert not w4gemm.supports(64, 96, 4096, 64, mx.float16)    # N not whole 128-row blocks
    assert not w4gemm.supports(64, 4096, 4000, 64, mx.float16)  # K not whole 64-chunks
    assert not w4gemm.supports(64, 4096, 4096, 16, mx.float16)


def test_k_splits_fill_the_card_but_keep_four_chunks_per_block():
    assert w4gemm.k_splits(4096, 14336, 2) > 8          # down: 16 row blocks
    assert w4gemm.k_splits(128256, 4096, 2) == 1        # the head has blocks enough
    assert w4gemm.k_splits(4096, 256, 2) == 1           # one 256-wide K is four chunks
    assert w4gemm.row_tiles(4096) == w4gemm.ROW_TILES
    assert w4gemm.row_tiles(128 * 3) == 1               # 384 rows: not whole 256-row blocks


@gpu
@pytest.mark.gpu
@hang_guard
@pytest.mark.parametrize("m,n,k,gs,splits,res", [
    (1, 256, 512, 64, 1, False), (9, 256, 512, 64, 1, True), (16, 1024, 2048, 32, 1, False),
    (33, 512, 1024, 64, 4, True), (64, 4096, 1024, 64, None, True), (64, 384, 1024, 128, 1, False),
    (50, 256, 3072, 64, 3, False), (100, 512, 1024, 64, 2, True), (128, 1024, 2048, 64, None, False),
])
def test_kernel_matches_reference(m, n, k, gs, splits, res):
    x, wq, s, b = _case(m, n, k, gs, seed=m * 7 + n + k)
    wp, sbp = w4gemm.pack(wq, s, b, gs)
    r = mx.random.normal((m, n)).astype(mx.float16) if res else None
    got = w4gemm.w4_gemm(x, wp, sbp, gs, residual=r, splits=splits)
    want = w4gemm.w4_gemm_reference(x, wq, s, b, gs, residual=r)
    assert got.shape == want.shape and got.dtype == mx.float16
    assert rel_err(got, want) < 5e-3


def _flat(n, k, gs, bits=4, seed=0, dense=True):
    from tandem.kernels.cuda import linear
    mx.random.seed(seed)
    w = (mx.random.normal((n, k)) / k**0.5).astype(mx.float16)
    wq, s, b = mx.quantize(w, group_size=gs, bits=bits)
    wd = mx.dequantize(wq, s, b, group_size=gs, bits=bits).astype(mx.float16)
    return linear.FlatLinear(weight=wd if dense else None, qweight=wq, scales=s, biases=b,
                             group_size=gs, bits=bits)


def test_layers_pack_only_what_the_kernel_covers(monkeypatch):
    from tandem.kernels.cuda import linear
    monkeypatch.setattr(linear, "USE_W4G", True)
    monkeypatch.setattr(linear, "USE_W4WG", False)
    assert not _flat(256, 512, 64).pack_w4gemm()  # small products stay on the dense GEMM
    monkeypatch.setattr(w4gemm, "MIN_WEIGHTS", 0)
    lay = _flat(256, 512, 64)
    assert lay.pack_w4gemm() and lay["w4g_wp"].shape == (16, 8, 32, 4)
    rows = lambda m: mx.zeros((m, 512), mx.float16)  # noqa: E731
    lo, hi = linear.W4G_ROWS
    assert lay._w4g_applies(rows(lo)) and lay._w4g_applies(rows(hi))
    assert not lay._w4g_applies(rows(lo - 1)) and not lay._w4g_applies(rows(hi + 1))
    assert not _flat(256, 512, 64, bits=8).pack_w4gemm()
    assert not _flat(96, 512, 64).pack_w4gemm()   # 96 rows: no whole 128-row block
    # The wgmma kernel takes its rows where it runs in one pass over K and the machine
    # compiles it.
    wide = rows(linear.W4WG_ROWS[1])
    assert not lay._w4g_applies(wide)
    monkeypatch.setattr(linear, "USE_W4WG", True)
    monkeypatch.setattr(w4wgmma, "available", lambda: False)
    assert not lay._w4g_applies(wide)
    monkeypatch.setattr(w4wgmma, "available", lambda: True)
    assert lay._w4g_applies(wide) and lay._w4wg_applies(wide) and not lay._w4wg_applies(rows(hi))
    deep = _flat(256, 4096, 64)   # like down: 16 K splits
    assert deep.pack_w4gemm() and not deep._w4wg_applies(mx.zeros((linear.W4WG_ROWS[1], 4096), mx.float16))
    monkeypatch.setattr(linear, "USE_W4G", False)
    assert not _flat(256, 512, 64).pack_w4gemm()


@gpu
@pytest.mark.gpu
@hang_guard
def test_layer_dispatches_batch_rows_to_the_kernel(monkeypatch):
    from tandem.kernels.cuda import linear
    monkeypatch.setattr(w4gemm, "MIN_WEIGHTS", 0)
    lay = _flat(1024, 2048, 64, seed=5)
    assert lay.pack_w4gemm()
    monkeypatch.setattr(linear, "_seen_paths", set())
    rows = linear.W4G_ROWS[1]
    x = mx.random.normal((rows, 2048)).astype(mx.float16)
    res = mx.random.normal((rows, 1024)).astype(mx.float16)
    got = lay.fused(x, residual=res).astype(mx.float32)
    want = (res.astype(mx.float32) + x.astype(mx.float32) @ lay["weight"].astype(mx.float32).T)
    assert "cuda-w4gemm-4bit" in linear.paths_used()
    assert (mx.abs(got - want).max() / mx.abs(want).max()).item() < 5e-3
