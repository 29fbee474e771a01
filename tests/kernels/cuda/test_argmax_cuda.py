"""The greedy-token kernel gives the sampler's argmax of the float32 logits, index for index."""

from __future__ import annotations

import mlx.core as mx
import pytest

from tandem.kernels.cuda import argmax_cuda
from tandem.kvtypes import SamplingParams
from tandem.pipeline import sampler
from tests.kernels.cuda.test_paged_attention_cuda import gpu, hang_guard


def _logits(rows: int, vocab: int, dtype, seed: int) -> mx.array:
    mx.random.seed(seed)
    x = (4 * mx.random.normal((rows, vocab))).astype(dtype)
    mx.eval(x)
    return x


def test_falls_back_to_the_three_ops_where_the_kernel_does_not_apply(monkeypatch):
    monkeypatch.setattr(argmax_cuda, "ENABLED", True)
    for dtype, vocab in ((mx.float32, 64), (mx.float16, 60), (mx.float16, 64)):
        x = _logits(3, vocab, dtype, seed=vocab)
        if dtype == mx.float32 or vocab % 8 or not argmax_cuda.cuda_available():
            assert not argmax_cuda.applies(x)
        got = argmax_cuda.argmax(x)
        assert got.dtype == mx.int32 and got.shape == (3,)
        assert mx.array_equal(got, mx.argmax(x.astype(mx.float32), axis=-1).astype(mx.int32)).item()
    monkeypatch.setattr(argmax_cuda, "ENABLED", False)
    assert not argmax_cuda.applies(_logits(3, 64, mx.float16, seed=1))


def test_sampler_takes_the_kernel_only_for_all_greedy_rows_without_extras(monkeypatch):
    """Temperature, logprobs or a logit bias on any row: the general path (float32 logits)."""
    calls = []
    monkeypatch.setattr(argmax_cuda, "applies", lambda x: True)
    monkeypatch.setattr(argmax_cuda, "argmax_kernel", lambda x: calls.append(1) or argmax_cuda.argmax_reference(x))
    x = _logits(2, 64, mx.float16, seed=3)
    want = argmax_cuda.argmax_reference(x)
    greedy = SamplingParams(max_tokens=4)
    for params, kernel in (([greedy, greedy], True),
                           ([greedy, SamplingParams(max_tokens=4, temperature=0.7, seed=1)], False),
                           ([greedy, SamplingParams(max_tokens=4, logprobs=2)], False),
                           ([SamplingParams(max_tokens=4, logit_bias={5: 1.0}), greedy], False)):
        calls.clear()
        out = sampler.sample(x, params, [0, 0])
        assert bool(calls) == kernel
        if kernel:
            assert mx.array_equal(out.tokens, want).item()


@gpu
@pytest.mark.gpu
@hang_guard
@pytest.mark.parametrize("rows,vocab,dtype", [(1, 128256, mx.float16), (64, 128256, mx.float16),
                                              (5, 49152, mx.bfloat16), (3, 8, mx.float16)])
def test_kernel_matches_the_three_ops(rows, vocab, dtype):
    x = _logits(rows, vocab, dtype, seed=rows + vocab)
    # Ties: every row's maximum planted twice, and once more in an all-equal row, so the
    # lowest index has to win inside a thread, across lanes and across warps.
    top = mx.max(x.astype(mx.float32), axis=-1) + 1
    cols = mx.array([[(7 * r + 3) % vocab, vocab - 1 - r % vocab] for r in range(rows)])
    x = mx.put_along_axis(x, cols, top[:, None].astype(dtype) * mx.ones((rows, 2), dtype), axis=-1)
    if rows > 2:
        x[2] = mx.zeros((vocab,), dtype)
    got = argmax_cuda.argmax_kernel(x)
    assert mx.array_equal(got, argmax_cuda.argmax_reference(x)).item()
