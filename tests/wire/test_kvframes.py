"""KV snapshots through every strategy and option: raw and LZ4 bit-exact, int8/int4 within bound."""

from __future__ import annotations

import dataclasses
import itertools
import random

import numpy as np
import pytest

from tandem.wire import kv_quant
from tandem.kvtypes import KVSnapshot, SamplingParams
from tandem.wire import codec
from tandem.wire.errors import WireError
from tandem.wire.kvframes import KVAssembler, KVOptions, snapshot_messages
from tandem.wire.messages import KVChunk, KVHeader


def make_snapshot(num_computed=37, layers=3, heads=2, block_size=8, head_dim=16, dtype="float16", seed=0):
    rng = np.random.default_rng(seed)
    nb = -(-num_computed // block_size)
    shape = (nb, heads, block_size, head_dim)

    def arr():
        return kv_quant.from_float32(rng.standard_normal(shape).astype(np.float32), dtype)

    tokens = list(rng.integers(0, 1000, num_computed + 1))
    return KVSnapshot(
        request_id=b"R" * 16, model_id="m", block_size=block_size, num_layers=layers, num_kv_heads=heads,
        head_dim=head_dim, dtype=dtype, tokens=[int(t) for t in tokens], num_computed=num_computed,
        prompt_len=num_computed, keys=[arr() for _ in range(layers)], values=[arr() for _ in range(layers)],
        sampling=SamplingParams(temperature=0.5, seed=3), num_generated=1, num_cached_prompt_tokens=8,
    )


def transfer(snap, options, shuffle_seed=None):
    """Encode, push every message through the codec, deliver (optionally interleaved), reassemble."""
    per_conn = snapshot_messages(snap, options)
    wire = [[codec.decode(codec.encode(m)) for m in msgs] for msgs in per_conn]
    order = [m for msgs in wire for m in msgs]
    if shuffle_seed is not None:  # connections interleave arbitrarily; each keeps its own order
        rng = random.Random(shuffle_seed)
        queues = [list(msgs) for msgs in wire]
        order = []
        while any(queues):
            q = rng.choice([q for q in queues if q])
            order.append(q.pop(0))
    asm = None
    for msg in order:
        if isinstance(msg, KVHeader):
            if asm is None:
                asm = KVAssembler(msg)
            assert asm.same_geometry(msg)
        else:
            asm.add(msg)
    assert asm.complete
    return asm.snapshot(), len(per_conn)


def _meta(s):
    return {f.name: getattr(s, f.name) for f in dataclasses.fields(s) if f.name not in ("keys", "values")}


STRATEGIES = [
    KVOptions(strategy="full"),
    KVOptions(strategy="streamed", blocks_per_chunk=2),
    KVOptions(strategy="layer_parallel", connections=2),
]


@pytest.mark.parametrize("compression", ["none", "lz4"])
@pytest.mark.parametrize("options", STRATEGIES, ids=lambda o: o.strategy)
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_lossless_round_trip_is_bit_exact(options, compression, dtype):
    snap = make_snapshot(dtype=dtype)
    got, conns = transfer(snap, dataclasses.replace(options, compression=compression), shuffle_seed=1)
    assert conns == (2 if options.strategy == "layer_parallel" else 1)
    assert _meta(got) == _meta(snap)
    for a, b in zip(got.keys + got.values, snap.keys + snap.values):
        assert a.dtype == b.dtype and a.shape == b.shape
        np.testing.assert_array_equal(a.view(np.uint8), b.view(np.uint8))


@pytest.mark.parametrize("quantization,compression,options", list(itertools.product(["int8", "int4"], ["none", "lz4"], STRATEGIES)))
def test_quantized_round_trip_within_bound(quantization, compression, options):
    snap = make_snapshot(dtype="float16")
    opts = dataclasses.replace(options, quantization=quantization, compression=compression)
    got, _ = transfer(snap, opts)
    bits = 8 if quantization == "int8" else 4
    for a, b in zip(got.keys + got.values, snap.keys + snap.values):
        _, scales = kv_quant.quantize(b, bits)
        err = np.abs(a.astype(np.float32) - b.astype(np.float32))
        assert np.all(err <= kv_quant.error_bound(b, scales, "float16"))


def test_empty_snapshot_completes_with_header_only():
    snap = make_snapshot(num_computed=0)
    snap.tokens, snap.prompt_len = [5], 1
    got, _ = transfer(snap, KVOptions())
    assert got.num_computed == 0 and all(k.shape[0] == 0 for k in got.keys)


def _header_and_chunk(options=KVOptions()):
    snap = make_snapshot()
    header, chunk = snapshot_messages(snap, options)[0][:2]
    return header, chunk


def test_bad_chunks_refused():
    header, chunk = _header_and_chunk()
    for bad in [
        dataclasses.replace(chunk, request_id=b"X" * 16),
        dataclasses.replace(chunk, layer_end=header.num_layers + 1),
        dataclasses.replace(chunk, block_end=header.num_blocks + 1),
        dataclasses.replace(chunk, frames=chunk.frames[:-1]),
        dataclasses.replace(chunk, frames=[bytes(chunk.frames[0])[:-1]] + chunk.frames[1:]),
        dataclasses.replace(chunk, frames=[bytes(chunk.frames[0]) + b"x"] + chunk.frames[1:]),
    ]:
        with pytest.raises(WireError):
            KVAssembler(header).add(bad)
    asm = KVAssembler(header)
    asm.add(chunk)
    with pytest.raises(WireError, match="repeats"):
        asm.add(chunk)


def test_lz4_bomb_and_garbage_refused():
    import lz4.frame

    header, chunk = _header_and_chunk(KVOptions(compression="lz4"))
    bomb = lz4.frame.compress(b"\0" * (64 << 20))
    for frame in (bomb, b"garbage", bomb[:20]):
        with pytest.raises(WireError):
            KVAssembler(header).add(dataclasses.replace(chunk, frames=[frame] + chunk.frames[1:]))


def test_inconsistent_headers_refused():
    header, _ = _header_and_chunk()
    for bad in [
        dataclasses.replace(header, num_blocks=header.num_blocks + 1),
        dataclasses.replace(header, num_computed=len(header.tokens) + 1),
        dataclasses.replace(header, num_layers=256, num_kv_heads=256, head_dim=1024, block_size=1024,
                            num_blocks=128, num_computed=128 * 1024, tokens=[1] * (128 * 1024)),
    ]:
        with pytest.raises(WireError):
            KVAssembler(bad)


def test_non_final_header_holds_completion_until_the_final_one():
    snap = make_snapshot()
    header, *chunks = snapshot_messages(snap, KVOptions(strategy="streamed", blocks_per_chunk=2))[0]
    early = dataclasses.replace(header, final=False, tokens=header.tokens[:-1])
    asm = KVAssembler(early)
    for c in chunks:
        asm.add(c)
    assert not asm.complete  # every block is here, but the token state is not final
    asm.update(header)
    assert asm.complete and asm.snapshot().tokens == snap.tokens
    asm.update(early)  # a late copy of the early header changes nothing
    assert asm.complete and asm.header.final
    with pytest.raises(WireError):
        asm.update(dataclasses.replace(header, num_layers=header.num_layers + 1))


@pytest.mark.parametrize("strategy", ["streamed", "layer_parallel"])
def test_blocks_taken_as_they_complete_and_the_snapshot_stays_whole(strategy):
    """take_ready hands out each leading run of blocks whose every layer is in (Streamed:
    a chunk's blocks at once; LayerParallel: only once the other connection's layers are
    in too), never a block twice; the final snapshot is still the whole transfer."""
    snap = make_snapshot(num_computed=37)  # 5 blocks of 8
    options = KVOptions(strategy=strategy, blocks_per_chunk=2, connections=2)
    per_conn = [[codec.decode(codec.encode(m)) for m in msgs] for msgs in snapshot_messages(snap, options)]
    asm = KVAssembler(per_conn[0][0])
    order = [m for msgs in per_conn for m in msgs[1:]]
    parts = []
    for msg in order:
        asm.add(msg) if isinstance(msg, KVChunk) else asm.update(msg)
        if msg is not order[-1]:
            parts.append(asm.take_ready())
    whole = asm.snapshot()
    taken = [p for p in parts if p is not None]
    if strategy == "streamed":
        assert [(p.first_block, len(p.keys[0])) for p in taken] == [(0, 2), (2, 2)]
    else:  # the first connection's layers alone complete no block; the second's last chunk completes all
        assert taken == []
    for p in taken:
        for got, want in zip(p.keys + p.values, snap.keys + snap.values):
            assert np.array_equal(got, want[p.first_block : p.first_block + len(got)])
    for got, want in zip(whole.keys + whole.values, snap.keys + snap.values):  # the whole, taken blocks too
        assert np.array_equal(got, want)
    assert _meta(whole) == _meta(snap)
