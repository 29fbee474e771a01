"""The CPU fast path against the plain one: cpu_math against mlx's own ops, FastLlama
against the mlx-lm forward, and the engine with it against the engine without it."""

from __future__ import annotations

import math

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_lm.models.cache import make_prompt_cache

from tandem.kvtypes import SamplingParams
from tandem.kernels.cpu import cpu_kernels
from tandem.kernels.cpu import cpu_math
from tandem.pipeline.runners.cpu import fast_llama
from tandem.pipeline.engine import Engine
from tandem.pipeline.settings import EngineSettings
from tests.pipeline.conftest import EOS, oracle, random_prompts
from tests.tiny_model import build_tiny_model


def test_exp_is_accurate_over_the_float_range():
    x = mx.concatenate([mx.linspace(-87.0, 88.0, 200_001), mx.array([0.0, -1e-8, 1e-8, 0.5, -0.5])])
    got = np.array(cpu_math.exp(x), np.float64)
    want = np.exp(np.array(x, np.float64))
    # float32 rounding of x * log2(e) alone is ~4e-6 relative at |x| = 88 (mx.exp has the same)
    assert np.max(np.abs(got - want) / want) < 1e-5
    small = np.abs(np.array(x)) < 10
    assert np.max((np.abs(got - want) / want)[small]) < 1e-6
    tiny = np.array(cpu_math.exp(mx.array([-100.0, -1e4, -math.inf])))
    assert np.all((tiny >= 0) & (tiny < 1e-37))  # never NaN, never a meaningful weight


@pytest.mark.parametrize("shape", [(3, 7), (64, 1024)])  # below and above cpu_math.SMALL
def test_silu_mul_and_softmax_match_mlx(shape):
    g = mx.random.normal(shape, key=mx.random.key(1)) * 6
    u = mx.random.normal(shape, key=mx.random.key(2))
    assert mx.allclose(cpu_math.silu_mul(g, u), nn.silu(g) * u, rtol=1e-5, atol=1e-6).item()
    s = mx.where(mx.random.uniform(shape=shape, key=mx.random.key(3)) < 0.3, -mx.inf, g)
    s[:, 0] = 0.0  # every row keeps a visible entry, as every causal row does
    assert mx.allclose(cpu_math.softmax(s), mx.softmax(s, axis=-1), rtol=1e-5, atol=1e-7).item()


@pytest.mark.parametrize("L,starts", [(1, [9, 4]), (40, [0, 0]), (300, [0, 37]), (300, [130, 5])])
def test_attention_matches_sdpa_with_causal_offsets(L, starts):
    """Blocked attention (L > 128 splits) with per-row offsets == SDPA with a boolean mask."""
    B, Hq, Hkv, D = len(starts), 6, 2, 16
    K = max(starts) + L
    q = mx.random.normal((B, Hq, L, D), key=mx.random.key(4))
    k = mx.random.normal((B, Hkv, K, D), key=mx.random.key(5))
    v = mx.random.normal((B, Hkv, K, D), key=mx.random.key(6))
    ctx = [s + L for s in starts]
    add = cpu_math.additive_mask(starts, L, K, context_lens=ctx)
    got = cpu_math.attention(q, k, v, 0.25, add, max(starts))
    want = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.25, mask=add == 0)
    assert mx.allclose(got, want, rtol=1e-4, atol=1e-5).item()


def _load(tmp_path, model_type):
    from mlx_lm import load

    model, _ = load(str(build_tiny_model(tmp_path / model_type, model_type=model_type)))
    return model


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("left_below", [10**9, 1])  # W @ x.T everywhere / x @ W.T everywhere
def test_fast_forward_equals_mlx_lm_forward(tmp_path, model_type, left_below):
    model = _load(tmp_path, model_type)
    prompts = mx.array(random_prompts(3, 20, 20, seed=5))  # (3, 20)
    ref_cache = make_prompt_cache(model)
    want_prefill = model(prompts, cache=ref_cache)[:, -1]
    want_step = model(prompts[:, :1], cache=ref_cache)[:, -1]

    fast = fast_llama.FastLlama(model)
    fast.left_below = left_below
    cache = make_prompt_cache(model)
    mask = cpu_math.additive_mask([0, 0, 0], 20, 20)
    got_prefill = fast(prompts, cache, mask, 0, mx.array([19, 19, 19]))
    got_step = fast(prompts[:, :1], cache, None, 0, None)
    assert mx.allclose(got_prefill, want_prefill, rtol=1e-4, atol=1e-4).item()
    assert mx.allclose(got_step, want_step, rtol=1e-4, atol=1e-4).item()
    # the fused weights are views the model itself still computes with
    assert mx.array_equal(model(prompts, cache=make_prompt_cache(model))[:, -1], want_prefill).item()


def test_unsupported_models_keep_the_mlx_lm_forward(tmp_path, tiny_quantized_model_dir):
    from mlx_lm import load

    gemma = _load(tmp_path, "gemma")
    assert fast_llama.supports(gemma) is not None
    quantized, _ = load(str(tiny_quantized_model_dir))
    assert fast_llama.supports(quantized) is not None
    eng = Engine(quantized, EngineSettings(kv_cache_budget="16MiB"), model_id="q")
    assert eng.runner.fast is None


def test_engine_with_and_without_fast_forward_yield_the_same_tokens(tiny):
    prompts = random_prompts(10, 1, 300, seed=9)
    reqs = [(p, SamplingParams(max_tokens=10)) for p in prompts]
    runs = []
    for fast in (True, False):
        eng = Engine(tiny, EngineSettings(kv_cache_budget="32MiB", prefill_chunk_size=256, max_batch_prefill=4,
                                          fast_forward=fast), model_id="t", eos_token_ids=[EOS])
        assert (eng.runner.fast is not None) is fast
        runs.append(eng.generate_many(reqs))
    assert runs[0] == runs[1]
    assert runs[0][:3] == [oracle(tiny, p, 10) for p in prompts[:3]]


@pytest.mark.parametrize("model_type,why", [("llama", None), ("qwen2", None), ("qwen3", "per-head q/k norms")])
def test_compiled_decode_layers_equal_the_eager_layers(tmp_path, model_type, why):
    """The compiled decode step (RoPE from tables) == the eager per-op layer, per-row offsets."""
    model = _load(tmp_path, model_type)
    fast = fast_llama.FastLlama(model)
    assert fast.decode.why == why
    if why is not None:
        return

    class Rows:  # per-row positions, as the paged cache gives them
        def __init__(self, offsets, k, v):
            self.offset, self.k, self.v = mx.array(offsets), k, v

        def update_and_fetch(self, keys, values):
            return mx.concatenate([self.k, keys], axis=2), mx.concatenate([self.v, values], axis=2)

    args = model.args
    H, D = args.num_key_value_heads, args.hidden_size // args.num_attention_heads
    ctx = [mx.random.normal((2, H, 30, D), key=mx.random.key(i)) for i in range(2 * len(model.model.layers))]
    caches = [Rows([29, 900], ctx[2 * i], ctx[2 * i + 1]) for i in range(len(model.model.layers))]
    tokens = mx.array([[11], [42]])
    got = fast(tokens, caches, None, 900, None)
    fast.decode.why = "off"
    want = fast(tokens, caches, None, 900, None)
    assert mx.allclose(got, want, rtol=1e-5, atol=1e-5).item()


def test_a_traditional_rope_keeps_the_eager_decode_layers(tmp_path):
    model = _load(tmp_path, "llama")
    for layer in model.model.layers:
        layer.self_attn.rope = nn.RoPE(layer.self_attn.rope.dims, traditional=True, base=10000)
    assert fast_llama.FastLlama(model).decode.why == "a RoPE that is not a plain half-split rotation"


@pytest.mark.parametrize("B,Hq,Hkv,D,threads,spread", [(5, 9, 3, 64, 2, 3), (3, 4, 4, 16, 1, 3), (16, 6, 2, 32, 3, 3),
                                                        (1, 2, 1, 8, 2, 3), (4, 8, 2, 128, 2, 40)])
def test_decode_kernel_matches_mlx_attention_on_ragged_rows(B, Hq, Hkv, D, threads, spread):
    """The C decode attention == cpu_math.attention with an additive mask, rows of
    different lengths; what lies past each row's length (NaN here) is never read."""
    if not cpu_kernels.available():
        pytest.skip("no C compiler: the runner keeps the mlx formulation")
    rng = np.random.default_rng(B * 100 + Hq)
    cap = 160
    lens = rng.integers(1, cap + 1, B).astype(np.int32)
    lens[0] = cap
    q = rng.normal(size=(B, Hq, D)).astype(np.float32) * spread  # 40: most weights underflow
    k = rng.normal(size=(B, Hkv, cap, D)).astype(np.float32)
    v = rng.normal(size=(B, Hkv, cap, D)).astype(np.float32)
    for b, n in enumerate(lens):
        k[b, :, n:] = np.nan
        v[b, :, n:] = np.nan
    got = cpu_kernels.decode_attention(q, k, v, lens, 0.125, num_threads=threads)
    n = int(lens.max())
    kk, vv = mx.array(np.nan_to_num(k[:, :, :n])), mx.array(np.nan_to_num(v[:, :, :n]))
    mask = cpu_math.additive_mask(lens - 1, 1, n)
    want = cpu_math.attention(mx.array(q)[:, :, None], kk, vv, 0.125, mask, 0)[:, :, 0]
    assert np.isfinite(got).all()
    # Scores of magnitude ~100 (spread 40) carry float32 rounding of ~1e-5 that exp
    # amplifies the same way whichever order the dot products sum in.
    tol = 1e-5 if spread <= 3 else 2e-4
    np.testing.assert_allclose(got, np.array(want), rtol=tol, atol=tol)


@pytest.mark.parametrize("n", [2, 15, 16, 17, 40])
def test_decode_kernel_finds_the_largest_score_anywhere_in_a_row(n):
    """Two keys score 200 and 150, the rest ~0, at the front, inside a 16-key block or in
    the tail past the last full block (the softmax's maximum is taken 16 scores at a time,
    the rest one by one): attention returns the first one's value. A maximum that missed
    both would clamp both exponentials to the largest power of two and average them."""
    if not cpu_kernels.available():
        pytest.skip("no C compiler: the runner keeps the mlx formulation")
    rng = np.random.default_rng(n)
    D = 16
    q = rng.normal(size=D).astype(np.float32)
    for top in sorted({0, max(0, n // 2 - 1), n - 2}):
        k = rng.normal(size=(1, 1, n, D)).astype(np.float32) * 1e-3
        v = rng.normal(size=(1, 1, n, D)).astype(np.float32)
        k[0, 0, top] = q / np.dot(q, q) * 200 / 0.125
        k[0, 0, top + 1] = q / np.dot(q, q) * 150 / 0.125
        got = cpu_kernels.decode_attention(np.repeat(q[None, None], 3, 1), k, v, np.array([n], np.int32), 0.125)
        np.testing.assert_allclose(got[0], np.repeat(v[0, 0, top][None], 3, 0), rtol=1e-5, atol=1e-5)


def test_engine_with_and_without_the_decode_kernel_yield_the_same_tokens(tiny, monkeypatch):
    if not cpu_kernels.available():
        pytest.skip("no C compiler: the runner keeps the mlx formulation")
    calls = []
    real = cpu_kernels.decode_attention
    monkeypatch.setattr(cpu_kernels, "decode_attention", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    prompts = random_prompts(12, 1, 200, seed=11)
    reqs = [(p, SamplingParams(max_tokens=12)) for p in prompts]
    runs = []
    for kernel in (True, False):
        eng = Engine(tiny, EngineSettings(kv_cache_budget="32MiB", max_batch_prefill=3), model_id="t", eos_token_ids=[EOS])
        eng.runner.fast.decode_kernel = kernel
        before = len(calls)
        runs.append(eng.generate_many(reqs))
        assert (len(calls) > before) is kernel
    assert runs[0] == runs[1]
    assert runs[0][:3] == [oracle(tiny, p, 12) for p in prompts[:3]]


def test_attention_threads_setting_is_checked(monkeypatch):
    monkeypatch.setenv("TANDEM_ATTENTION_THREADS", "two")
    with pytest.raises(ValueError, match="TANDEM_ATTENTION_THREADS"):
        cpu_kernels.threads()
    monkeypatch.setenv("TANDEM_ATTENTION_THREADS", "3")
    assert cpu_kernels.threads() == 3


def test_forward_built_on_one_thread_runs_on_another(tiny, monkeypatch):
    """The engine builds the forward on the caller's thread and runs it on its own; at 8
    rows the vocabulary projection runs in row blocks, which must not be arrays that
    still wait on the building thread's stream."""
    import threading

    monkeypatch.setattr(fast_llama, "HEAD_CHUNK_ROWS", 128)  # the tiny vocabulary in blocks too
    fast = fast_llama.FastLlama(tiny)
    assert len(fast.head_chunks) > 1
    tokens = mx.array([[5 + i] for i in range(8)])
    mx.eval(tokens)
    got = []

    def run():
        try:
            out = fast(tokens, make_prompt_cache(tiny), None, 0, None)
            mx.eval(out)
            got.append(np.array(out))
        finally:
            mx.synchronize()
            mx.clear_streams()  # as the engine thread does (mlx aborts at exit otherwise)

    t = threading.Thread(target=run)
    t.start()
    t.join(60)
    want = fast(tokens, make_prompt_cache(tiny), None, 0, None)  # here only after: it would evaluate the blocks
    assert got and np.allclose(got[0], np.array(want), rtol=1e-5, atol=1e-5)
