"""The 4-bit kernels against their references: the values they multiply == mx.dequantize
bit for bit, products == numpy, and the engine's decode step through them == the dense
decode, batched == single, and == mlx-lm at temperature 0."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from tandem import _blas
from tandem.kvtypes import SamplingParams
from tandem.pipeline.runners.cpu import fast_llama
from tandem.pipeline.runners.cpu import native_decode
from tandem.kernels.cpu import q4_kernels
from tandem.pipeline.engine import Engine
from tandem.pipeline.loader import load_model
from tandem.pipeline.settings import EngineSettings
from tests.pipeline.conftest import EOS, oracle, random_prompts

pytestmark = pytest.mark.skipif(not q4_kernels.available(), reason="no AVX-512 C kernels: the dense path runs")


def _quantized(n, k, bits, group, dtype, seed=0):
    rng = np.random.default_rng(seed)
    w = mx.array(rng.normal(size=(n, k)).astype(np.float32)).astype(dtype)
    wq, s, b = mx.quantize(w, group_size=group, bits=bits)
    dense = np.array(mx.dequantize(wq, s, b, group_size=group, bits=bits).astype(mx.float32))
    return (np.array(wq), np.array(s.astype(mx.float32)), np.array(b.astype(mx.float32)), group, dtype == mx.float16), dense


@pytest.mark.parametrize("bits,group,dtype,table", [(4, 32, mx.float16, True), (4, 32, mx.float16, False),
                                                    (4, 64, mx.float32, True), (8, 32, mx.float16, True),
                                                    (8, 64, mx.float32, True)])
def test_expanded_weights_are_the_dense_weights_bit_for_bit(bits, group, dtype, table):
    packed, dense = _quantized(70, 192, bits, group, dtype)
    m = q4_kernels.Q4Matrix.from_mlx(*packed)
    if not table and bits == 4:
        m = q4_kernels.Q4Matrix(m.nib, m.dm, m.round16, 4, table=False)
    assert np.array_equal(m.reference(), dense)
    assert np.array_equal(m.expand(), dense)


@pytest.mark.parametrize("bits,dtype", [(4, mx.float16), (4, mx.float32), (8, mx.float16)])
@pytest.mark.parametrize("rows", [1, 2, 7, 8, 9, 16, 23, 33])
def test_product_matches_numpy(bits, dtype, rows):
    packed, dense = _quantized(101, 320, bits, 32, dtype, seed=rows)  # odd n: the last row pair is short
    m = q4_kernels.Q4Matrix.from_mlx(*packed)
    x = np.random.default_rng(rows).normal(size=(rows, 320)).astype(np.float32)
    want = x.astype(np.float64) @ dense.T.astype(np.float64)
    for threads in (1, 2, 3):
        np.testing.assert_allclose(m.matmul(x, threads), want, rtol=1e-4, atol=1e-4)


def _forms(n, k, seed):
    """One matrix in each form the one-row product reads: fp16 table, fp16-rounded scale
    and offset, fp32 scale and offset, 8-bit as fp16 values."""
    lut, dense16 = _quantized(n, k, 4, 32, mx.float16, seed)
    f32, dense32 = _quantized(n, k, 4, 32, mx.float32, seed)
    b8, dense8 = _quantized(n, k, 8, 32, mx.float16, seed)
    m = q4_kernels.Q4Matrix.from_mlx(*lut)
    return [(m, dense16), (q4_kernels.Q4Matrix(m.nib, m.dm, m.round16, 4, table=False), dense16),
            (q4_kernels.Q4Matrix.from_mlx(*f32), dense32), (q4_kernels.Q4Matrix.from_mlx(*b8), dense8)]


@pytest.mark.parametrize("n", [1, 7, 8, 101, 960])
def test_one_row_product_is_bit_identical_to_its_row_in_a_batch(n):
    # One activation row takes its own kernel (codes straight into the dot products); each
    # output must be the same FMA chain and lane sum as the batched tile's.
    x = np.random.default_rng(n).normal(size=(5, 320)).astype(np.float32)
    for m, dense in _forms(n, 320, n):
        batch = m.matmul(x, 2)
        for threads in (1, 2, 3):
            for r in range(len(x)):
                assert np.array_equal(m.matmul(x[r : r + 1], threads), batch[r : r + 1])
        np.testing.assert_allclose(batch, x.astype(np.float64) @ dense.T.astype(np.float64), rtol=1e-4, atol=1e-4)


def test_rows_are_the_expanded_rows():
    ids = np.array([[0, 70], [3, 3]], np.int32)
    for m, dense in _forms(71, 96, 3):
        assert np.array_equal(m.rows(ids), dense[ids])
        with pytest.raises(IndexError):
            m.rows(np.array([71], np.int32))


def test_stacked_rows_are_the_concatenation():
    (a, da), (b, db) = _quantized(32, 64, 4, 32, mx.float16, 1), _quantized(18, 64, 4, 32, mx.float16, 2)
    m = q4_kernels.Q4Matrix.stack([q4_kernels.Q4Matrix.from_mlx(*a), q4_kernels.Q4Matrix.from_mlx(*b)])
    assert np.array_equal(m.expand(), np.concatenate([da, db]))


@pytest.fixture(scope="module")
def dense_q4(tiny_quantized_model_dir):
    """The tiny 4-bit model dequantized by the loader, its packed codes kept."""
    return load_model(tiny_quantized_model_dir, "dense")


def _engine(model, q4: bool, **kw) -> Engine:
    return Engine(model, EngineSettings(kv_cache_budget="32MiB", native_kernels=q4, **kw), model_id="q", eos_token_ids=[EOS])


def test_native_decode_is_built_for_a_model_loaded_from_4_bit_weights(dense_q4, tiny):
    eng = _engine(dense_q4.model, True)
    assert eng.runner.fast.native is not None, eng.runner.fast.native_why
    assert _engine(dense_q4.model, False).runner.fast.native is None
    plain = _engine(tiny, True)  # a dense checkpoint: nothing packed to run on
    assert plain.runner.fast.native is None and "4-bit" in plain.runner.fast.native_why


def test_engine_with_and_without_the_4_bit_decode_yields_the_same_tokens(dense_q4, monkeypatch):
    calls = []
    real = q4_kernels.decode_step
    monkeypatch.setattr(q4_kernels, "decode_step", lambda *a, **kw: calls.append(a[3].shape[0]) or real(*a, **kw))
    prompts = random_prompts(12, 1, 200, seed=21)
    reqs = [(p, SamplingParams(max_tokens=14)) for p in prompts]
    runs = [_engine(dense_q4.model, q4, max_batch_prefill=3).generate_many(reqs) for q4 in (True, False)]
    assert calls and max(calls) > 1  # batched steps ran through the kernel
    assert runs[0] == runs[1]
    # batched == single, and == mlx-lm's own generation on the same dense weights
    single = _engine(dense_q4.model, True)
    assert [single.generate_many([r])[0] for r in reqs[:4]] == runs[0][:4]
    assert runs[0][:3] == [oracle(dense_q4.model, p, 14) for p in prompts[:3]]


def test_decode_inputs_come_from_the_host_with_mlx_values(dense_q4):
    # The step's embedding rows (the tied vocabulary matrix's) and RoPE tables come from
    # host tables: the same values as mlx's embedding and the model's RoPE, row by row.
    fast = fast_llama.FastLlama(dense_q4.model)
    nat = fast.native
    assert nat.embed_host
    ids = np.array([0, 5, 17, nat.head.n - 1], np.int32)
    assert np.array_equal(nat.head.rows(ids), np.array(nat.embed(mx.array(ids)).astype(mx.float32)))
    pos = np.array([0, 1, 700, 3, 2047, 1500, 1024], np.int64)
    cos, sin = fast.decode.host_tables(pos)
    for i, p in enumerate(pos):  # one position per call, as a step of one row computed them
        c, s_ = fast.decode.tables(mx.array([int(p)]), 1)
        assert np.array_equal(cos[i], np.array(c).reshape(-1)) and np.array_equal(sin[i], np.array(s_).reshape(-1))
    c, s_ = fast.decode.tables(mx.array(pos.astype(np.int32)), len(pos))  # and as one batch
    assert np.array_equal(cos, np.array(c)[:, :, 0].T) and np.array_equal(sin, np.array(s_)[:, :, 0].T)


def test_a_row_decoded_alone_gets_the_logits_it_gets_in_a_batch(dense_q4):
    # A one-row step takes its own products (and its gate/up product writes SwiGLU's
    # output itself); each row's logits must still be those of the batched step.
    nat = fast_llama.FastLlama(dense_q4.model).native
    hidden, hq, hkv, d, inter = nat.dims
    nl, cap = len(dense_q4.model.model.layers), 64
    rng = np.random.default_rng(5)
    lens = np.array([37, 50, 9], np.int32)
    kv = [rng.normal(size=(len(lens), hkv, cap, d)).astype(np.float32) for _ in range(2 * nl)]
    ids = np.array([[3], [11], [7]], np.int32)

    def step(rows):
        mirror = q4_kernels.HostMirror([np.ascontiguousarray(a[rows]) for a in kv[:nl]],
                                       [np.ascontiguousarray(a[rows]) for a in kv[nl:]])
        return np.array(nat.step(ids[rows], (mirror, lens[rows], cap)))

    batch = step([0, 1, 2])
    for r in range(3):
        assert np.array_equal(step([r]), batch[r : r + 1])


def test_weights_that_no_longer_match_their_codes_keep_the_dense_path(tiny_quantized_model_dir):
    lm = load_model(tiny_quantized_model_dir, "dense")
    layer = lm.model.model.layers[1].mlp.down_proj
    layer.weight = layer.weight * 1.01
    fast = fast_llama.FastLlama(lm.model)
    assert fast.native is None and "down_proj" in fast.native_why


def test_without_the_kernels_the_dense_path_runs(tiny_quantized_model_dir, monkeypatch):
    monkeypatch.setattr(q4_kernels, "available", lambda: False)
    lm = load_model(tiny_quantized_model_dir, "dense")
    fast = fast_llama.FastLlama(lm.model)
    assert fast.native is None and fast.native_why.startswith("no 4-bit kernels")


def test_rows_beyond_the_limit_take_the_dense_step(dense_q4, monkeypatch):
    monkeypatch.setattr(native_decode, "MAX_ROWS", 2)
    calls = []
    real = q4_kernels.decode_step
    monkeypatch.setattr(q4_kernels, "decode_step", lambda *a, **kw: calls.append(a[3].shape[0]) or real(*a, **kw))
    prompts = random_prompts(5, 3, 30, seed=4)
    reqs = [(p, SamplingParams(max_tokens=3 + 4 * i, ignore_eos=True)) for i, p in enumerate(prompts)]  # rows drop out
    got = _engine(dense_q4.model, True, max_batch_prefill=5).generate_many(reqs)
    assert calls and max(calls) <= 2
    assert got == _engine(dense_q4.model, False, max_batch_prefill=5).generate_many(reqs)


def test_column_rope_and_silu_match_mlx():
    import mlx.nn as nn

    rng = np.random.default_rng(3)
    heads, d, t = 3, 16, 37
    x = rng.normal(size=(heads * d + 8, t)).astype(np.float32)  # 8 rows past the heads stay as they are
    pos = mx.array(rng.integers(0, 2000, t).astype(np.int32))
    rope = nn.RoPE(d, base=10000)
    cos, sin = (np.ascontiguousarray(np.array(a)) for a in fast_llama._tables(rope, pos, d))
    got = q4_kernels.rope_cols(x.copy(), heads, d, cos, sin)
    heads_first = mx.array(x[: heads * d]).reshape(heads, d, t).transpose(2, 0, 1)[:, :, None]  # (t, H, 1, d)
    want = rope(heads_first, offset=pos).reshape(t, heads * d).T
    np.testing.assert_allclose(got[: heads * d], np.array(want), rtol=1e-5, atol=1e-5)
    assert np.array_equal(got[heads * d :], x[heads * d :])
    rows = q4_kernels.rope_rows(np.ascontiguousarray(x.T), heads, d, np.ascontiguousarray(cos.T),
                                np.ascontiguousarray(sin.T))
    assert np.array_equal(rows, got.T)  # the same arithmetic, a token per row
    gu = (rng.normal(size=(2 * 40, t)) * 6).astype(np.float32)
    want = np.array(nn.silu(mx.array(gu[:40])) * mx.array(gu[40:]))
    np.testing.assert_allclose(q4_kernels.silu_rows(gu), want, rtol=1e-5, atol=1e-6)
    assert np.array_equal(q4_kernels.silu_cols(np.ascontiguousarray(np.concatenate([gu[:40].T, gu[40:].T], 1))),
                          q4_kernels.silu_rows(gu).T)


@pytest.mark.parametrize("left_below", [10**9, 1])  # token columns / token rows (mlx's products)
def test_prefill_with_and_without_the_column_kernels_agree(tiny, left_below, monkeypatch):
    from mlx_lm.models.cache import make_prompt_cache

    from tandem.kernels.cpu import cpu_math

    calls = []
    blas_rows = q4_kernels.blas_rows
    monkeypatch.setattr(q4_kernels, "blas_rows", lambda *a, **kw: calls.append(1) or blas_rows(*a, **kw))
    prompts = mx.array(random_prompts(3, 24, 24, seed=8))
    mask = cpu_math.additive_mask([0, 0, 0], 24, 24)
    out = []
    # the host layers (72 rows: from BLAS_ROWS_FROM, token columns whatever left_below
    # says), the kernels with mlx's products in left_below's layout, no kernels
    for on, blas in ((True, True), (True, False), (False, False)):
        fast = fast_llama.FastLlama(tiny)
        fast.prefill_kernels = on
        fast.left_below = left_below
        if not blas:
            fast.prefill_sgemm = None
        calls.clear()
        out.append(fast(prompts, make_prompt_cache(tiny), mask, 0, mx.array([23, 23, 23])))
        # 4 products per layer and the vocabulary's (no packed weights here)
        assert len(calls) == (4 * len(tiny.model.layers) + 1 if on and blas and _blas.openblas_sgemm() else 0)
    # logits up to ~15; the products and norms sum in other orders (differences ~3e-5)
    assert mx.allclose(out[0], out[2], rtol=1e-5, atol=1e-4).item()
    assert mx.allclose(out[1], out[2], rtol=1e-5, atol=1e-4).item()


@pytest.mark.skipif(_blas.openblas_sgemm() is None, reason="numpy has no bundled OpenBLAS")
@pytest.mark.parametrize("n,k,m", [(1, 24, 1), (17, 40, 5), (100, 576, 70), (960, 576, 33), (576, 1536, 154)])
@pytest.mark.parametrize("transposed", [True, False])
def test_blas_rows_matches_numpy(n, k, m, transposed):
    rng = np.random.default_rng(n + k + m)
    w = rng.normal(size=(n, k)).astype(np.float32)
    x = rng.normal(size=(m, k) if transposed else (k, m)).astype(np.float32)
    got = q4_kernels.blas_rows(_blas.openblas_sgemm(), w, x, transposed)
    want = w.astype(np.float64) @ (x.T if transposed else x).astype(np.float64)
    assert got.shape == (n, m)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.sqrt(k))
    acc = rng.normal(size=(n, m)).astype(np.float32)
    out = q4_kernels.blas_rows(_blas.openblas_sgemm(), w, x, transposed, add_to=acc.copy())
    np.testing.assert_allclose(out, want + acc, rtol=1e-4, atol=1e-4 * np.sqrt(k))


@pytest.mark.parametrize("t", [1, 16, 37])
def test_column_rms_norm_matches_mlx(t):
    rng = np.random.default_rng(t)
    x = (rng.normal(size=(t, 96)) * 3).astype(np.float32)
    w = rng.normal(size=96).astype(np.float32)
    want = np.array(mx.fast.rms_norm(mx.array(x), mx.array(w), 1e-5))
    got = q4_kernels.rms_norm_cols(np.ascontiguousarray(x.T), w, 1e-5)
    np.testing.assert_allclose(got.T, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("columns", [True, False])
def test_prefill_attention_matches_the_masked_mlx_attention(columns):
    from tandem.kernels.cpu import cpu_math

    B, L, Hq, Hkv, D, K = 3, 37, 6, 2, 64, 96  # 37 queries: a last block of 5; K beyond every row's reach
    rng = np.random.default_rng(4)
    starts = np.array([0, 20, 59], np.int32)
    q = rng.normal(size=(B, Hq, L, D)).astype(np.float32)
    k = rng.normal(size=(B, Hkv, K, D)).astype(np.float32)
    v = rng.normal(size=(B, Hkv, K, D)).astype(np.float32)
    want = cpu_math.attention(mx.array(q), mx.array(k), mx.array(v), 0.125, cpu_math.additive_mask(starts, L, K),
                              int(starts.max()))
    want = np.array(want).transpose(0, 2, 1, 3).reshape(B * L, Hq * D)  # a token per row
    tokens = np.ascontiguousarray(q.transpose(0, 2, 1, 3).reshape(B * L, Hq * D))
    qin = np.ascontiguousarray(tokens.T) if columns else tokens
    got = q4_kernels.prefill_attention(qin, k, v, starts, L, 0.125, columns=columns)
    np.testing.assert_allclose(got.T if columns else got, want, rtol=1e-5, atol=1e-5)
