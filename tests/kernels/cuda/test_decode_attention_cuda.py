"""The one-launch decode attention (RoPE + KV write + split-K attention + merge) agrees
with the write and attention references run in sequence."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.models.rope_utils import initialize_rope

from tandem.kernels.cuda import decode_attention_cuda as dac
from tandem.kernels.cuda import kv_write_cuda as kvw
from tandem.kernels.cuda import paged_attention_cuda as pac
from tests.kernels.cuda.test_paged_attention_cuda import LLAMA31, RAGGED, _pool_case, gpu, hang_guard


def _case(lens, H, KVH, D, bs, dtype, seed, pad_blocks=0, traditional=False):
    """Rows whose last token (index len - 1) is this step's: its K/V are in qkv, not yet
    in the pool. The table gets ``pad_blocks`` scratch columns, as the runner pads it."""
    B = len(lens)
    _, kp, vp, table, la = _pool_case(B, H, KVH, D, bs, lens, seed, dtype)
    if pad_blocks:
        table = mx.concatenate([table, mx.zeros((B, pad_blocks), mx.int32)], axis=1)
    mx.random.seed(seed + 1)
    qkv = mx.random.normal((B, (H + 2 * KVH) * D)).astype(dtype)
    pos = la - 1
    slots = table[mx.arange(B), pos // bs] * bs + pos % bs
    inv = kvw.rope_inv_freq(initialize_rope(D, 500000.0, traditional, LLAMA31, 131072), D)
    mx.eval(kp, vp, table, qkv, pos, slots, inv)
    return qkv, pos, slots, inv, kp, vp, table, la


def _reference(qkv, pos, slots, inv, kp, vp, table, la, H, KVH, D, bs, traditional=False):
    q, _, kp_r, vp_r = kvw.write_kv_rope_reference(qkv, pos, slots, inv, kp, vp, H, KVH,
                                                   traditional=traditional)
    out = pac.paged_decode_attention_reference(q, kp_r, vp_r, table, la, D**-0.5, bs)
    mx.eval(out, kp_r, vp_r)
    return out.reshape(la.shape[0], H * D), kp_r, vp_r


def test_too_few_counters_is_refused():
    qkv = mx.zeros((4, (8 + 4) * 16), mx.float16)
    pool = mx.zeros((64, 2, 16), mx.float16)
    with pytest.raises(ValueError, match="counters for 2 rows, batch has 4"):
        dac.decode_attention(qkv, mx.zeros((4,), mx.int32), mx.zeros((4,), mx.int32), mx.ones((8,)),
                             pool, pool, mx.zeros((4, 4), mx.int32), 8, 2, 0.25, 16, 64,
                             mx.zeros((4,), mx.int32))


@gpu
@pytest.mark.gpu
@hang_guard
@pytest.mark.parametrize("dtype,lens,part,pad,traditional", [
    (mx.float16, [577], None, 12, False),        # one row at the bench's length, padded table
    (mx.float16, [577], 16, 0, False),           # 37 partitions
    (mx.float16, [1, 40, 300], 32, 3, False),    # a row that is only this step's token
    (mx.float16, RAGGED, 64, 0, False),          # ragged, many empty partitions
    (mx.float16, [33, 700], 2048, 0, False),     # one partition: no merge
    (mx.float16, [2100], 16, 0, False),          # 132 partitions: more than the staged merge holds
    (mx.bfloat16, [5, 300], 64, 0, False),
    (mx.float16, [16, 17, 129], 64, 2, True),    # traditional RoPE
])
@pytest.mark.parametrize("staged_merge", [False, True])
def test_fused_decode_matches_write_then_attend(dtype, lens, part, pad, traditional, staged_merge):
    H, KVH, D, bs = 32, 8, 128, 16
    qkv, pos, slots, inv, kp, vp, table, la = _case(lens, H, KVH, D, bs, dtype, sum(lens), pad, traditional)
    want, kp_r, vp_r = _reference(qkv, pos, slots, inv, kp, vp, table, la, H, KVH, D, bs, traditional)
    ctr = dac.counters(len(lens), KVH)
    got = dac.decode_attention(qkv, pos, slots, inv, kp, vp, table, H, KVH, D**-0.5, bs,
                               table.shape[1] * bs, ctr, part, traditional=traditional, staged_merge=staged_merge)
    mx.eval(got)
    tol = 3e-2 if dtype == mx.bfloat16 else 5e-3
    assert got.shape == want.shape
    assert mx.abs(got.astype(mx.float32) - want.astype(mx.float32)).max().item() < tol
    assert mx.allclose(kp, kp_r, atol=2e-2).item()  # the new keys, rotated, in their slots
    assert mx.array_equal(vp, vp_r).item()
    assert mx.array_equal(ctr, mx.zeros_like(ctr)).item()  # tickets back at zero


@gpu
@pytest.mark.gpu
@hang_guard
@pytest.mark.parametrize("staged_merge", [False, True])
def test_counters_serve_consecutive_layers_and_steps(staged_merge):
    """Two "layers" (pools) and two steps through one counter array: every launch sees
    zeroed tickets, so every merge happens exactly once, by the last block."""
    H, KVH, D, bs = 8, 2, 64, 16
    lens = [130, 64, 2]
    ctr = dac.counters(4, KVH)
    for step in range(2):
        for layer in range(2):
            seed = 100 * step + layer
            qkv, pos, slots, inv, kp, vp, table, la = _case(lens, H, KVH, D, bs, mx.float16, seed, pad_blocks=1)
            want, _, _ = _reference(qkv, pos, slots, inv, kp, vp, table, la, H, KVH, D, bs)
            got = dac.decode_attention(qkv, pos, slots, inv, kp, vp, table, H, KVH, D**-0.5, bs,
                                       table.shape[1] * bs, ctr, 32, staged_merge=staged_merge)
            assert mx.abs(got.astype(mx.float32) - want.astype(mx.float32)).max().item() < 5e-3, (step, layer)
        lens = [n + 1 for n in lens]


@gpu
@pytest.mark.gpu
@hang_guard
@pytest.mark.parametrize("dtype,lens,part,kernel,traditional", [
    (mx.float16, [577] * 16, None, "v6", False),            # one partition a row
    (mx.float16, RAGGED + [300] * (16 - len(RAGGED)), 64, "v6", False),  # split rows, merge kernel
    (mx.float16, [100 + 7 * i for i in range(64)], None, "v6", False),
    (mx.float16, [100 + 7 * i for i in range(64)], 128, "v6", True),
    (mx.bfloat16, [40 + 3 * i for i in range(16)], 64, "v6", False),
    (mx.float16, [100 + 7 * i for i in range(64)], None, "tc", False),
    (mx.float16, RAGGED + [300] * (16 - len(RAGGED)), 64, "tc", True),
    (mx.bfloat16, [40 + 3 * i for i in range(16)], 64, "tc", False),
])
def test_tile_write_equals_write_then_attend(dtype, lens, part, kernel, traditional):
    """The tile-wise attention with the write in its prologue gives the two-kernel path's
    output and pools bit for bit (the queries are rounded to T as the write kernel stores
    them)."""
    H, KVH, D, bs = 32, 8, 128, 16
    qkv, pos, slots, inv, kp, vp, table, la = _case(lens, H, KVH, D, bs, dtype, len(lens), 2, traditional)
    max_len = table.shape[1] * bs
    kp2, vp2 = kp + 0, vp + 0  # the second path's own pools
    mx.eval(kp2, vp2)
    q, _ = kvw.write_kv_rope(qkv, pos, slots, inv, kp, vp, H, KVH, traditional=traditional)
    want = pac.paged_decode_attention(q, kp, vp, table, la, D**-0.5, bs, max_len, part, flat=True, kernel=kernel)
    mx.eval(want)
    got = dac.decode_attention_tile(qkv, pos, slots, inv, kp2, vp2, table, la, H, KVH, D**-0.5, bs, max_len,
                                    part, kernel=kernel, traditional=traditional)
    mx.eval(got)
    assert mx.array_equal(got, want).item()
    assert mx.array_equal(kp2, kp).item() and mx.array_equal(vp2, vp).item()


def test_tile_write_refuses_what_it_does_not_cover():
    qkv = mx.zeros((16, (8 + 4) * 16), mx.float32)
    pool = mx.zeros((64, 2, 16), mx.float32)
    z = mx.zeros((16,), mx.int32)
    with pytest.raises(ValueError, match="fp16 or bf16"):
        dac.decode_attention_tile(qkv, z, z, mx.ones((8,)), pool, pool, mx.zeros((16, 4), mx.int32), z + 1,
                                  8, 2, 0.25, 16, 64)
