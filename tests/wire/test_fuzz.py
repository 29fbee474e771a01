"""Fuzzing every decoder: anything a peer sends ends in a decoded message or WireError, nothing else.

The default suite runs a small hypothesis budget; ``-m slow`` runs >= 100,000 inputs per
decoder family with an allocation check.
"""

from __future__ import annotations

import logging
import random
import warnings
import resource
import tracemalloc

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tandem.wire import codec
from tandem.wire.errors import WireError
from tandem.wire.handshake import Initiator, Responder
from tandem.wire.kvframes import KVAssembler, KVOptions, snapshot_messages
from tandem.wire.messages import KVChunk
from tandem.wire.sealed import SealedChannel
from tests.wire import fuzz_inputs as F
from tests.wire.test_kvframes import make_snapshot

SECRET = b"f" * 32
K1, K2 = b"1" * 32, b"2" * 32
_SNAP = make_snapshot(num_computed=20, layers=2, heads=1, block_size=8, head_dim=8)
_KV = {q: snapshot_messages(_SNAP, KVOptions(strategy="streamed", blocks_per_chunk=2, quantization=q, compression=c))[0]
       for q, c in [("none", "none"), ("int4", "lz4")]}


def _expect_wire_error_only(fn, frames):
    try:
        fn(frames)
    except WireError:
        pass


def decode_any(frames):
    if len(frames) == 2 and len(frames[0]) == 16:
        _expect_wire_error_only(codec.decode_tokens, frames)
    if len(frames) == 2 and len(frames[0]) == 17:
        _expect_wire_error_only(codec.decode_batch, frames)
    _expect_wire_error_only(codec.decode, frames)


def handshake_any(frames):
    ini = Initiator(SECRET, "p")
    ini.hello()
    _expect_wire_error_only(ini.on_challenge, frames)
    res = Responder(SECRET, "d")
    _expect_wire_error_only(res.on_hello, frames)
    res2 = Responder(SECRET, "d")
    res2.on_hello(Initiator(SECRET, "p").hello())
    _expect_wire_error_only(res2.on_proof, frames)


def sealed_any(frames):
    _expect_wire_error_only(SealedChannel(K2, K1).open, frames)


def kv_any(rng, frames_source):
    """Decode a mutated KV header/chunk and feed it to an assembler."""
    quant = rng.choice(list(_KV))
    msgs = _KV[quant]
    header = msgs[0]
    target = rng.choice(msgs)
    frames = F.mutated(rng, codec.encode(target)) if frames_source is None else frames_source
    try:
        msg = codec.decode(frames)
        asm = KVAssembler(msg if not isinstance(msg, KVChunk) and hasattr(msg, "num_blocks") else header)
        if isinstance(msg, KVChunk):
            asm.add(msg)
    except WireError:
        pass


_INGEST = None


def ingest_any(rng):
    """Mutated KV headers/chunks straight into the decode worker's KVIngest (past its sealed
    channel): it must absorb every bad message (refuse and forget the transfer), never raise."""
    global _INGEST
    if _INGEST is None:
        import zmq

        from tandem.workers.handoff import KVIngest

        _INGEST = KVIngest(zmq.Context.instance(), "tcp://127.0.0.1:*", secret=SECRET, node_id="fuzz", timeout_s=30)
    msgs = _KV[rng.choice(list(_KV))]
    for msg in msgs[: rng.randrange(1, len(msgs) + 1)]:
        frames = codec.encode(msg)
        if rng.random() < 0.5:
            frames = F.mutated(rng, frames)
        try:
            decoded = codec.decode(frames)
        except WireError:
            continue
        for _, _, _, snap in _INGEST.on_decoded(b"peer", decoded):
            if snap is not None:  # a mutation that still assembles is a well-formed snapshot
                assert len(snap.keys) == len(snap.values) == snap.num_layers
    _INGEST.expire(float("inf"))  # forget every partial and refused transfer


def _one_round(rng):
    frames = rng.choice([F.structured, F.mutated, F.garbage])(rng)
    decode_any(frames)
    handshake_any(frames)
    if rng.random() < 0.5:  # mutated sealed messages: single-frame records, grouped ones, or pieces of frames
        n = rng.randrange(1, 5)
        longest = rng.choice([40, 400])
        sealed = SealedChannel(K1, K2).seal([b"x" * rng.randrange(longest) for _ in range(n)], group_bytes=rng.choice([0, 64]))
        frames = F.mutated(rng, sealed)
    sealed_any(frames)
    kv_any(rng, None)
    ingest_any(rng)


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.integers(0, 2**32), st.lists(st.binary(max_size=80), min_size=1, max_size=4))
def test_hypothesis_decoders(seed, raw):
    rng = random.Random(seed)
    decode_any(raw)
    handshake_any(raw)
    sealed_any(raw)
    _one_round(rng)


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_fuzz_100k_inputs_per_decoder(monkeypatch):
    # pytest keeps every captured log record; 100k rejection warnings would be the leak.
    monkeypatch.setattr(logging.getLogger("tandem.wire"), "level", logging.ERROR)
    warnings.simplefilter("ignore", RuntimeWarning)  # overflowing scales in mutated KV chunks
    rng = random.Random(20261130)
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    for _ in range(100_000):
        _one_round(rng)
    grown_mb = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss_before) / 1024
    assert grown_mb < 64, f"peak RSS grew by {grown_mb:.0f} MB"
    tracemalloc.start()  # per input: no input may make a large allocation
    try:
        for _ in range(2000):
            tracemalloc.reset_peak()
            _one_round(rng)
            assert tracemalloc.get_traced_memory()[1] < 32 << 20
    finally:
        tracemalloc.stop()
