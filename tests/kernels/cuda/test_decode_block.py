"""The one-launch layer tail agrees with the chain of separate products, on fresh inputs."""

from __future__ import annotations

import mlx.core as mx
import pytest

from tandem.kernels.cuda import decode_block as db
from tandem.kernels.cuda import quantized_matmul as qm

gpu = pytest.mark.skipif(not qm.cuda_available(), reason="needs MLX's CUDA backend")
hang_guard = pytest.mark.timeout(120, method="thread")


def _q(n, k, gs):
    w = mx.random.normal((n, k)) / k**0.5
    return mx.quantize(w.astype(mx.float16), group_size=gs, bits=4)


def _case(hidden, ffn, nqkv, gs, seed, nxt=True):
    mx.random.seed(seed)
    a = mx.random.normal((1, hidden)).astype(mx.float16)
    h = (4 * mx.random.normal((1, hidden))).astype(mx.float16)
    ln2 = (1 + 0.1 * mx.random.normal((hidden,))).astype(mx.float16)
    ln1 = (1 + 0.1 * mx.random.normal((hidden,))).astype(mx.float16)
    weights = dict(o=_q(hidden, hidden, gs), gate_up=_q(2 * ffn, hidden, gs), down=_q(hidden, ffn, gs))
    if nxt:
        weights.update(ln1_next=ln1, qkv_next=_q(nqkv, hidden, gs))
    mx.eval(a, h, ln2, weights)
    return a, h, ln2, weights


def _rel_err(got, want):
    got, want = got.astype(mx.float32), want.astype(mx.float32)
    return (mx.abs(got - want).max() / (mx.abs(want).max() + 1e-6)).item()


def _dense(w, s, b, gs):
    return mx.dequantize(w, s, b, group_size=gs, bits=4).astype(mx.float32)


def test_reference_is_the_layer_tail():
    """The reference against the layer written out with dense weights: o + residual,
    rms_norm, [gate; up] with swiglu, down + residual, then the next layer's norm + QKV."""
    hidden, ffn, nqkv, gs = 256, 512, 384, 64
    a, h, ln2, wts = _case(hidden, ffn, nqkv, gs, seed=3)
    got_h, got_y = db.decode_block_reference(a, h, wts["o"], ln2, wts["gate_up"], wts["down"], wts["ln1_next"],
                                             wts["qkv_next"], eps2=1e-5, eps1=1e-6, group_size=gs)

    def norm(x, w, eps):
        x = x.astype(mx.float32)
        return x * mx.rsqrt(mx.mean(x * x, axis=-1, keepdims=True) + eps) * w.astype(mx.float32)

    h2 = h.astype(mx.float32) + a.astype(mx.float32) @ _dense(*wts["o"], gs).T
    gu = norm(h2, ln2, 1e-5) @ _dense(*wts["gate_up"], gs).T
    gate, up = gu[:, :ffn], gu[:, ffn:]
    h3 = h2 + (gate * mx.sigmoid(gate) * up) @ _dense(*wts["down"], gs).T
    y = norm(h3, wts["ln1_next"], 1e-6) @ _dense(*wts["qkv_next"], gs).T
    assert got_y.shape == (1, nqkv) and got_h.shape == (1, hidden)
    assert _rel_err(got_h, h3) < 2e-2
    assert _rel_err(got_y, y) < 2e-2
    last_h, none = db.decode_block_reference(a, h, wts["o"], ln2, wts["gate_up"], wts["down"], eps2=1e-5,
                                             group_size=gs)
    assert none is None and mx.array_equal(last_h, got_h).item()


def test_support_rules():
    assert db.supports(4096, 14336, 6144, {64})
    assert db.supports(1024, 2048, 1536, {32, 128})
    assert not db.supports(4096, 14336, 6144, {256})        # groups of 32-128
    assert not db.supports(4096 + 512, 14336, 6144, {64})   # K % 1024
    assert not db.supports(4096, 32768, 6144, {64})         # down's row within one block
    assert not db.supports(4096, 14336, 6146, {64})         # whole units of rows


def test_partial_sums_fit_the_largest_phase():
    # 8B shape, 132 SMs, 4 rows a pass: gate/up is 7,168 units over 528 groups, 14 passes
    # a group's fair share; room for 21 of 4 groups x 4 rows x 4 warps.
    red = db.red_floats(4096, 14336, 6144, 4, 132, 5)
    assert red == 21 * 4 * 4 * 4
    # Ticket lists: 4 groups of K = 4096 with 21 passes each, 5 ahead and a count.
    assert db.ticket_ints(4096, 14336, 6144, 4, red, 5) == 4 * (21 + 5 + 1)
    # A small model: the room is at least the stages for every product, however few
    # passes its fair share is.
    assert db.red_floats(1024, 2048, 1536, 4, 132, 5) == 5 * 16 * 4 * 1
    # Per stage: 4 groups x 4 rows x (2 KB of weights + 64 scales + 64 biases).
    assert db.shared_bytes([(4096, 64), (14336, 224)], 4, 5) == 5 * 4 * 4 * (2048 + 256)
    assert db.supports(4096, 14336, 6144, {64}, rows=4, stages=5)
    assert not db.supports(4096, 14336, 6144, {64}, rows=8, stages=4)   # stages past shared memory
    # Fewer SMs: each group's share of passes, and with it the partial sums, grows.
    assert db.red_floats(4096, 14336, 6144, 4, 66, 5) > red


@gpu
@pytest.mark.gpu
@hang_guard
@pytest.mark.parametrize("hidden,ffn,nqkv,gs,nxt", [(4096, 14336, 6144, 64, True), (4096, 14336, 6144, 64, False),
                                                    (1024, 2048, 1536, 32, True), (2048, 5120, 3072, 128, True),
                                                    (1024, 2048, 1536, 64, True), (1024, 2048, 1536, 64, False)])
def test_kernel_matches_reference(hidden, ffn, nqkv, gs, nxt):
    a, h, ln2, wts = _case(hidden, ffn, nqkv, gs, seed=hidden + ffn, nxt=nxt)
    bar = db.counter()
    want_h, want_y = db.decode_block_reference(a, h, wts["o"], ln2, wts["gate_up"], wts["down"],
                                               wts.get("ln1_next"), wts.get("qkv_next"), eps2=1e-5,
                                               eps1=1e-6, group_size=gs)
    for _ in range(2):  # the second launch runs on the counter the first one left
        got_h, got_y = db.decode_block(a, h, wts["o"], ln2, wts["gate_up"], wts["down"], wts.get("ln1_next"),
                                       wts.get("qkv_next"), eps2=1e-5, eps1=1e-6, bar=bar)
        mx.eval(got_h, got_y)
        assert _rel_err(got_h, want_h) < 5e-3
        if nxt:
            assert _rel_err(got_y, want_y) < 5e-3
        else:
            assert got_y is None
    # Arrivals back at zero, a generation a barrier, and the tickets of o and gate/up,
    # whose last barrier has passed, back at zero.
    assert bar[0].item() == 0 and bar[1].item() == 2 * (3 if nxt else 2)
    assert bar[32].item() == 0 and bar[33].item() == 0


@gpu
@pytest.mark.gpu
@hang_guard
@pytest.mark.parametrize("rows,stages", [(8, 2), (2, 8), (4, 2)])
def test_pass_shapes_match_reference(rows, stages):
    a, h, ln2, wts = _case(4096, 14336, 6144, 64, seed=5)
    want_h, want_y = db.decode_block_reference(a, h, wts["o"], ln2, wts["gate_up"], wts["down"], wts["ln1_next"],
                                               wts["qkv_next"], eps2=1e-5, group_size=64)
    got_h, got_y = db.decode_block(a, h, wts["o"], ln2, wts["gate_up"], wts["down"], wts["ln1_next"],
                                   wts["qkv_next"], eps2=1e-5, bar=db.counter(), rows=rows, stages=stages)
    assert _rel_err(got_h, want_h) < 5e-3 and _rel_err(got_y, want_y) < 5e-3


@gpu
@pytest.mark.gpu
@hang_guard
def test_layers_chained_in_a_compiled_function():
    """Four layers in one compiled function, each launch reading the last one's outputs."""
    hidden, ffn, nqkv, gs = 1024, 2048, 1536, 64
    layers = [_case(hidden, ffn, nqkv, gs, seed=20 + i) for i in range(4)]
    a0, h0 = layers[0][0], layers[0][1]
    bar = db.counter()

    def chain(a, h, kernel):
        outs = []
        for _, _, ln2, w in layers:
            if kernel:
                h, y = db.decode_block(a, h, w["o"], ln2, w["gate_up"], w["down"], w["ln1_next"], w["qkv_next"],
                                       eps2=1e-5, bar=bar)
            else:
                h, y = db.decode_block_reference(a, h, w["o"], ln2, w["gate_up"], w["down"], w["ln1_next"],
                                                 w["qkv_next"], eps2=1e-5, group_size=gs)
            a = y[:, :hidden]  # stands in for the attention output
            outs.append(h)
        return outs

    got = mx.compile(lambda a, h: chain(a, h, True))(a0, h0)
    want = chain(a0, h0, False)
    for g, w in zip(got, want):
        assert _rel_err(g, w) < 1e-2
