"""The quantized-embedding kernel gives mlx's QuantizedEmbedding rows, bit for bit."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import pytest

from tandem.kernels.cuda import embed_cuda
from tests.kernels.cuda.test_paged_attention_cuda import gpu, hang_guard


def _table(vocab: int, dims: int, bits: int, group_size: int, dtype, seed: int):
    mx.random.seed(seed)
    w = (mx.random.normal((vocab, dims)) * 0.05).astype(dtype)
    q, s, b = mx.quantize(w, group_size=group_size, bits=bits)
    mx.eval(q, s, b)
    return q, s, b


def test_refuses_what_it_does_not_cover():
    q = mx.zeros((8, 12), mx.uint32)
    s = mx.zeros((8, 3), mx.float16)
    with pytest.raises(ValueError, match="3-bit"):
        embed_cuda.quantized_embedding(mx.array([1]), q, s, s, 32, 3)
    q = mx.zeros((8, 6), mx.uint32)  # 6 words a row: not whole 16-byte loads
    with pytest.raises(ValueError, match="multiple of 4 words"):
        embed_cuda.quantized_embedding(mx.array([1]), q, s, s, 64, 4)


def test_embed_falls_back_to_the_module_where_the_kernel_does_not_apply():
    emb = nn.Embedding(50, 64)  # not quantized: always the module's own call
    ids = mx.array([[3, 7, 49]])
    assert not embed_cuda.supported(emb)
    assert mx.array_equal(embed_cuda.embed(emb, ids), emb(ids)).item()
    qemb = nn.QuantizedEmbedding(50, 64, group_size=32, bits=4)
    assert mx.array_equal(embed_cuda.embed(qemb, ids), qemb(ids)).item()
    three = nn.QuantizedEmbedding(50, 64, group_size=32, bits=3)
    assert not embed_cuda.supported(three)


@gpu
@pytest.mark.gpu
@hang_guard
@pytest.mark.parametrize("dtype,bits,gs,shape", [
    (mx.float16, 4, 64, (1, 512)),     # a prompt of the bench's length
    (mx.float16, 4, 64, (64, 1)),      # a batch-64 decode step
    (mx.float16, 8, 32, (3, 7)),
    (mx.bfloat16, 4, 128, (2, 5)),
])
def test_kernel_equals_mlx(dtype, bits, gs, shape):
    vocab, dims = 1000, 4096
    q, s, b = _table(vocab, dims, bits, gs, dtype, seed=bits + gs)
    mx.random.seed(7)
    ids = mx.random.randint(0, vocab, shape).astype(mx.int32)
    ids = ids.at[0, 0].add(vocab - 1 - ids[0, 0])  # the table's last row
    got = embed_cuda.quantized_embedding(ids, q, s, b, gs, bits)
    want = embed_cuda.quantized_embedding_reference(ids, q, s, b, gs, bits)
    assert got.shape == (*shape, dims) and got.dtype == dtype
    assert mx.array_equal(got, want).item()


@gpu
@pytest.mark.gpu
@hang_guard
def test_module_dispatch_on_the_gpu():
    qemb = nn.QuantizedEmbedding(300, 256, group_size=64, bits=4)
    qemb.scales = qemb.scales.astype(mx.float16)
    qemb.biases = qemb.biases.astype(mx.float16)
    ids = mx.array([[0, 299, 5, 5]])
    assert embed_cuda.supported(qemb)
    assert mx.array_equal(embed_cuda.embed(qemb, ids), qemb(ids)).item()
