"""The worker handoff (tandem.workers.handoff) sends KV as grouped sealed records, one
ZeroMQ message each, sealed into a shared arena without ever blocking the IO thread (and
through a small arena that wraps within a transfer, bit-exact); the decode side opens
each record as it arrives."""

from __future__ import annotations

import os
import time

import numpy as np
import pytest
import zmq

from tandem.kvtypes import KVSnapshot, SamplingParams
from tandem.wire.kvchannel import SendArena
from tandem.wire.kvframes import KVOptions, snapshot_messages
from tandem.workers.handoff import KVIngest, KVPeer, Outgoing


def big_snapshot(seed: int, tokens: int = 1024, layers: int = 4, heads: int = 4, dim: int = 128) -> KVSnapshot:
    rng = np.random.default_rng(seed)
    nb = tokens // 16
    keys = [rng.standard_normal((nb, heads, 16, dim)).astype(np.float16) for _ in range(layers)]
    values = [rng.standard_normal((nb, heads, 16, dim)).astype(np.float16) for _ in range(layers)]
    return KVSnapshot(os.urandom(16), "m", 16, layers, heads, dim, "float16", list(range(tokens + 1)),
                      tokens, tokens, keys, values, SamplingParams(max_tokens=4))


@pytest.mark.parametrize("tokens", [1024, 4096])  # 1 MiB frames: records; 4 MiB frames: pieces of them
def test_large_handoffs_travel_as_records_and_stay_bit_exact(ctx, tokens):
    secret = os.urandom(32)
    ingest = KVIngest(ctx, "tcp://127.0.0.1:*", secret=secret, node_id="decode-a", timeout_s=10)
    addr = ingest.sock.getsockopt_string(zmq.LAST_ENDPOINT)
    # 1 MiB K/V frames; a 4 MiB arena takes 1 MiB records, so it wraps within each transfer
    # and a region still held by libzmq must be skipped (the IO thread never waits for it).
    arena = SendArena(4 << 20)
    peer = KVPeer(ctx, addr, secret=secret, node_id="prefill-a", arena=arena)
    snaps = [big_snapshot(s, tokens) for s in range(3)]
    frame_mib = snaps[0].keys[0].nbytes >> 20
    assert frame_mib == tokens // 1024
    for snap in snaps:
        (msgs,) = snapshot_messages(snap, KVOptions(), stream_seq=0, priority=0, attempt=1)
        peer.queue(Outgoing(snap.request_id, 1, "decode-a", msgs, time.monotonic() + 10))
    done, zmq_messages, deadline = {}, 0, time.monotonic() + 20
    while len(done) < len(snaps) and time.monotonic() < deadline:
        if peer.channel is None and peer.sock.poll(10):  # the handshake's challenge
            peer.on_message(peer.sock.recv_multipart(copy=False))
        while ingest.sock.poll(10):
            zmq_messages += 1
            for _, _, header, snap in ingest.on_message(ingest.sock.recv_multipart(copy=False), at_capacity=lambda: False):
                if snap is not None:
                    done[header.request_id] = snap
    assert len(done) == len(snaps) and ingest.partial == 0 and not peer.failed
    for snap in snaps:
        back = done[snap.request_id]
        for a, b in zip(back.keys + back.values, snap.keys + snap.values):
            np.testing.assert_array_equal(a, b)
    # Each transfer's 8 frames went as records of at most 1 MiB (each its own ZeroMQ
    # message; a 4 MiB frame as pieces), not as one message.
    assert zmq_messages >= 3 * 8 * frame_mib and arena._view is not None
