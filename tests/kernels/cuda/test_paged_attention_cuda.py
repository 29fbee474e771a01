"""Paged decode attention and the fused RoPE + KV write agree with pure-mx references."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.models.rope_utils import initialize_rope

from tandem.kernels import paged_attention as pa
from tandem.kernels.cuda import paged_attention_cuda as pac
from tandem.kernels.cuda import kv_write_cuda as kvw
from tandem.kernels.cuda.quantized_matmul import cuda_available

gpu = pytest.mark.skipif(not cuda_available(), reason="needs MLX's CUDA backend")
# A deadlocked kernel blocks inside mx.eval, where the signal method cannot interrupt
# it: the thread method ends the whole run instead of hanging the device call.
hang_guard = pytest.mark.timeout(120, method="thread")

LLAMA31 = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
           "original_max_position_embeddings": 8192, "rope_type": "llama3"}


def _pool_case(B, H, KVH, D, bs, lens, seed, dtype=mx.float16):
    """A pool with shuffled block assignment; block 0 is scratch, like the engine's store."""
    mx.random.seed(seed)
    nbs = [-(-n // bs) for n in lens]
    total = sum(nbs) + 1
    perm = (mx.random.permutation(total - 1) + 1).tolist()
    table = mx.zeros((B, max(nbs)), dtype=mx.int32)
    at = 0
    rows = []
    for b, nb in enumerate(nbs):
        rows.append(perm[at:at + nb] + [0] * (max(nbs) - nb))
        at += nb
    table = mx.array(rows, dtype=mx.int32)
    k_pool = mx.random.normal((total * bs, KVH, D)).astype(dtype)
    v_pool = mx.random.normal((total * bs, KVH, D)).astype(dtype)
    q = mx.random.normal((B, H, D)).astype(dtype)
    return q, k_pool, v_pool, table, mx.array(lens, dtype=mx.int32)


@pytest.mark.parametrize("rope_scaling", [None, LLAMA31])
@pytest.mark.parametrize("traditional", [False, True])
def test_rope_reference_matches_mlx_rope(rope_scaling, traditional):
    D = 64
    rope = initialize_rope(D, 500000.0, traditional, rope_scaling, 131072)
    inv = kvw.rope_inv_freq(rope, D)
    mx.random.seed(0)
    x = mx.random.normal((1, 3, 9, D))  # (B, heads, L, D)
    want = rope(x, offset=37)
    tok = x[0].transpose(1, 0, 2)  # (L, heads, D)
    got = kvw.rope_reference(tok, mx.arange(37, 46), inv, traditional)
    assert mx.allclose(got, want[0].transpose(1, 0, 2), atol=1e-4).item()


def test_decode_reference_matches_the_engines_paged_attention_reference():
    B, H, KVH, D, bs = 3, 8, 2, 32, 16
    lens = [5, 40, 17]
    q, kp, vp, table, lens_a = _pool_case(B, H, KVH, D, bs, lens, seed=1, dtype=mx.float32)
    ours = pac.paged_decode_attention_reference(q, kp, vp, table, lens_a, 0.3, bs)
    theirs = pa.paged_attention_reference(q[:, :, None], kp, vp, table, lens_a - 1, bs, 0.3)
    assert mx.allclose(ours, theirs[:, :, 0], atol=1e-5).item()


def test_write_reference_scatters_rotated_keys_and_skips_negative_slots():
    H, KVH, D = 4, 2, 16
    mx.random.seed(2)
    qkv = mx.random.normal((3, (H + 2 * KVH) * D))
    inv = kvw.rope_inv_freq(initialize_rope(D, 10000.0, False, None, 4096), D)
    pos, slots = mx.array([0, 7, 3]), mx.array([5, -1, 2])
    kp, vp = mx.zeros((8, KVH, D)), mx.zeros((8, KVH, D))
    q, k, kp2, vp2 = kvw.write_kv_rope_reference(qkv, pos, slots, inv, kp, vp, H, KVH)
    x = qkv.reshape(3, H + 2 * KVH, D)
    assert mx.allclose(q[0], x[0, :H]).item()  # position 0: rotation is the identity
    assert mx.allclose(kp2[5], k[0]).item() and mx.allclose(vp2[2], x[2, H + KVH:]).item()
    assert mx.array_equal(kp2[7], mx.zeros((KVH, D))).item()
    assert mx.array_equal(kp, mx.zeros((8, KVH, D))).item()  # inputs untouched


def test_partition_choice_grows_with_batch():
    assert pac.choose_partition(1, 8, 600) == 64
    assert pac.choose_partition(64, 8, 600) > pac.choose_partition(4, 8, 600)


def test_tile_variant_falls_back_to_v6_where_the_tensor_core_kernel_does_not_apply():
    assert pac.tile_variant("tc", mx.float16, 128, 4) == ("tc", [], 2 * 4 * 32 * 128 * 2)  # K and V tiles
    assert pac.tile_variant("tc", mx.bfloat16, 64, 8) == ("tc", [], 2 * 4 * 32 * 64 * 2)
    assert pac.tile_variant("tc", mx.float16, 128, 16) == ("tile", [], 0)  # 16 heads a KV head
    assert pac.tile_variant("tc", mx.float16, 96, 4) == ("tile", [], 0)
    assert pac.tile_variant("v6", mx.float16, 128, 4) == ("tile", [], 0)


def test_tensor_core_kernel_runs_unsplit_where_one_wave_covers_the_card(monkeypatch):
    assert pac.auto_kernel(15) == "v2" and pac.auto_kernel(16) == "tc"
    assert pac.choose_partition(16, 8, 600) >= 600  # 128 blocks: one wave of 132 SMs
    assert pac.choose_partition(4, 8, 600) < 600  # v2 at 4 rows still splits
    assert pac.choose_partition(16, 8, 8192) == pac.MAX_PARTITION
    monkeypatch.setattr(pac, "TILE_MIN_BATCH", 64)
    assert pac.auto_kernel(16) == "v2" and pac.choose_partition(16, 8, 600) < 600


RAGGED = [64, 65, 1, 127, 128, 129, 1000, 16, 17, 15, 2, 63]  # around partition and 16-token edges


@gpu
@pytest.mark.gpu
@hang_guard
@pytest.mark.parametrize("dtype,lens,bs,part", [
    (mx.float16, [1, 600, 33, 129], 16, None), (mx.float16, [2000], 16, 64),
    (mx.float16, [17, 31], 32, 128), (mx.float16, [700] * 8, 16, None),
    (mx.bfloat16, [5, 300], 16, 64),
    (mx.float16, RAGGED, 16, 64),  # B x KVH x partitions grid, many empty partitions
    (mx.float16, RAGGED, 16, None),
    (mx.float16, RAGGED, 16, 2048),  # one partition: the merge-free variant
    (mx.float16, [576 - i % 7 for i in range(16)], 16, None),  # the shape that once hung
    (mx.float16, [65, 66, 67], 16, 64),  # partitions of 64 + 1..3 (a loop that once hung)
    (mx.float16, [1 + (37 * i) % 300 for i in range(64)], 16, None),  # batch 64, ragged
])
def test_cuda_decode_matches_reference(dtype, lens, bs, part):
    B, H, KVH, D = len(lens), 32, 8, 128
    q, kp, vp, table, la = _pool_case(B, H, KVH, D, bs, lens, seed=sum(lens), dtype=dtype)
    want = pac.paged_decode_attention_reference(q, kp, vp, table, la, D**-0.5, bs)
    for kernel in ("v2", "v6", "tc"):
        got = pac.paged_decode_attention(q, kp, vp, table, la, D**-0.5, bs, max(lens), part, kernel=kernel)
        err = mx.abs(got.astype(mx.float32) - want.astype(mx.float32)).max().item()
        assert err < (3e-2 if dtype == mx.bfloat16 else 5e-3), kernel
        flat = pac.paged_decode_attention(q, kp, vp, table, la, D**-0.5, bs, max(lens), part, flat=True,
                                          kernel=kernel)
        assert flat.shape == (B, H * D) and mx.array_equal(flat, got.reshape(B, H * D)).item(), kernel


@gpu
@pytest.mark.gpu
@hang_guard
@pytest.mark.parametrize("lens,part", [([1, 70, 300], 64), ([33, 5], None)])
def test_cuda_decode_tile_kernels_head_dim_64(lens, part):
    B, H, KVH, D = len(lens), 8, 2, 64
    q, kp, vp, table, la = _pool_case(B, H, KVH, D, 16, lens, seed=5, dtype=mx.float16)
    want = pac.paged_decode_attention_reference(q, kp, vp, table, la, D**-0.5, 16)
    for kernel in ("v6", "tc"):
        got = pac.paged_decode_attention(q, kp, vp, table, la, D**-0.5, 16, max(lens), part, kernel=kernel)
        assert mx.abs(got.astype(mx.float32) - want.astype(mx.float32)).max().item() < 5e-3, kernel


@gpu
@pytest.mark.gpu
@hang_guard
@pytest.mark.parametrize("heads,kv_heads", [(8, 8), (16, 8), (64, 8), (12, 4)])
def test_cuda_decode_tc_query_groups(heads, kv_heads):
    """The tensor-core kernel puts a group's query heads in the rows of its mma tiles:
    1, 2, 8 and 3 heads a KV head (the 8B shape's 4 is in the tests above)."""
    lens = [1, 70, 129, 600, 33]
    B, D = len(lens), 128
    q, kp, vp, table, la = _pool_case(B, heads, kv_heads, D, 16, lens, seed=heads, dtype=mx.float16)
    want = pac.paged_decode_attention_reference(q, kp, vp, table, la, D**-0.5, 16)
    for part in (64, None):
        got = pac.paged_decode_attention(q, kp, vp, table, la, D**-0.5, 16, max(lens), part, kernel="tc")
        assert mx.abs(got.astype(mx.float32) - want.astype(mx.float32)).max().item() < 5e-3, part


@gpu
@pytest.mark.gpu
@hang_guard
@pytest.mark.parametrize("lens,part", [([1, 70, 30, 9, 64, 65, 2], 64), ([33, 5, 80], None), (RAGGED, 16)])
def test_cuda_decode_fp32_head_dim_16(lens, part):
    """The tiny test model's shape (fp32, 16-wide heads, 2 query heads a KV head): every
    version falls back to v2, which must still agree with the reference."""
    B, H, KVH, D = len(lens), 4, 2, 16
    q, kp, vp, table, la = _pool_case(B, H, KVH, D, 16, lens, seed=7, dtype=mx.float32)
    want = pac.paged_decode_attention_reference(q, kp, vp, table, la, D**-0.5, 16)
    for kernel in ("v2", "v6"):
        got = pac.paged_decode_attention(q, kp, vp, table, la, D**-0.5, 16, max(lens), part, kernel=kernel)
        assert mx.abs(got - want).max().item() < 1e-4, kernel


@gpu
@pytest.mark.gpu
@hang_guard
@pytest.mark.parametrize("traditional", [False, True])
def test_cuda_write_kv_rope_matches_reference(traditional):
    H, KVH, D, N = 32, 8, 128, 5
    mx.random.seed(3)
    qkv = mx.random.normal((N, (H + 2 * KVH) * D)).astype(mx.float16)
    inv = kvw.rope_inv_freq(initialize_rope(D, 500000.0, traditional, LLAMA31, 131072), D)
    pos = mx.array([0, 511, 12, 4000, 77], dtype=mx.int32)
    slots = mx.array([3, 9, -1, 0, 17], dtype=mx.int32)
    kp = mx.random.normal((20, KVH, D)).astype(mx.float16)
    vp = mx.random.normal((20, KVH, D)).astype(mx.float16)
    mx.eval(kp, vp)
    q_r, k_r, kp_r, vp_r = kvw.write_kv_rope_reference(qkv, pos, slots, inv, kp, vp, H, KVH,
                                                       traditional=traditional)
    mx.eval(q_r, k_r, kp_r, vp_r)
    q, k = kvw.write_kv_rope(qkv, pos, slots, inv, kp, vp, H, KVH, traditional=traditional)
    mx.eval(q, k)
    assert mx.allclose(q, q_r, atol=2e-2).item() and mx.allclose(k, k_r, atol=2e-2).item()
    assert mx.allclose(kp, kp_r, atol=2e-2).item()
    assert mx.array_equal(vp, vp_r).item()
