"""KV handoff: framing round trip, the sealed channel between KVPeer and KVIngest,
wrong secrets, and timeouts that release KV on both sides."""

from __future__ import annotations

import os
import time

import numpy as np
import pytest
import zmq

from tandem.kvtypes import KVSnapshot, SamplingParams
from tandem.wire import messages as M
from tandem.wire.kvframes import KVOptions, snapshot_messages
from tandem.workers.handoff import KVIngest, KVPeer, Outgoing


def snapshot(n_tokens=37, layers=3, heads=2, block=16, dim=8, dtype=np.float16):
    rng = np.random.default_rng(0)
    nb = -(-(n_tokens - 1) // block)
    keys = [rng.standard_normal((nb, heads, block, dim)).astype(dtype) for _ in range(layers)]
    values = [rng.standard_normal((nb, heads, block, dim)).astype(dtype) for _ in range(layers)]
    return KVSnapshot(os.urandom(16), "m", block, layers, heads, dim, np.dtype(dtype).name, list(range(n_tokens)),
                      n_tokens - 1, 30, keys, values, SamplingParams(max_tokens=9), num_generated=7)


@pytest.mark.parametrize("strategy", ["full", "streamed", "layer_parallel"])
def test_every_strategy_reassembles_bit_exact_through_sealed_channels(ctx, strategy):
    secret = os.urandom(32)
    ingest = KVIngest(ctx, "tcp://127.0.0.1:*", secret=secret, node_id="d", timeout_s=5)
    addr = ingest.sock.getsockopt_string(zmq.LAST_ENDPOINT)
    snap = snapshot(n_tokens=100)
    per_conn = snapshot_messages(snap, KVOptions(strategy=strategy, blocks_per_chunk=2, compression="lz4"),
                                 stream_seq=4, priority=0, attempt=3)
    peers = [KVPeer(ctx, addr, secret=secret, node_id=f"p{i}") for i in range(len(per_conn))]
    assert len(peers) == (2 if strategy == "layer_parallel" else 1)
    for peer, msgs in zip(peers, per_conn):
        peer.queue(Outgoing(snap.request_id, 3, "d", msgs, time.monotonic() + 5))
    got = []
    for _ in range(50):
        for peer in peers:
            while peer.sock.poll(10):
                peer.on_message(peer.sock.recv_multipart(copy=False))
        while ingest.sock.poll(10):
            got += ingest.on_message(ingest.sock.recv_multipart(copy=False), at_capacity=lambda: False)
        if any(s is not None for *_, s in got):
            break
    (_, attempt, header, back), = [g for g in got if g[3] is not None]
    assert attempt == 3 and header.stream_seq == 4
    for a, b in zip(back.keys + back.values, snap.keys + snap.values):
        assert np.array_equal(a, b)
    assert ingest.partial == 0


def pump(peer: KVPeer, ingest: KVIngest, *, at_capacity=lambda: False, rounds=50):
    """Move messages both ways until quiet; returns (ingest results, peer verdicts)."""
    got, verdicts = [], []
    for _ in range(rounds):
        moved = False
        while ingest.sock.poll(20):
            got += ingest.on_message(ingest.sock.recv_multipart(copy=False), at_capacity=at_capacity)
            moved = True
        while peer.sock.poll(20):
            verdicts += peer.on_message(peer.sock.recv_multipart(copy=False))
            moved = True
        if not moved and (got or verdicts):
            break
    return got, verdicts


def test_sealed_handoff_end_to_end(ctx):
    secret = os.urandom(32)
    ingest = KVIngest(ctx, "tcp://127.0.0.1:*", secret=secret, node_id="decode-a", timeout_s=5)
    addr = ingest.sock.getsockopt_string(zmq.LAST_ENDPOINT)
    peer = KVPeer(ctx, addr, secret=secret, node_id="prefill-a")
    snap = snapshot()
    (msgs,) = snapshot_messages(snap, KVOptions(), stream_seq=1, priority=0, attempt=5)
    peer.queue(Outgoing(snap.request_id, 5, "decode-a", msgs, time.monotonic() + 5))
    got, _ = pump(peer, ingest)
    (_, attempt_h, header, none), (peer_id, attempt, header2, back) = got
    assert none is None and attempt == attempt_h == 5 and header.stream_seq == 1
    assert np.array_equal(back.values[2], snap.values[2])
    ingest.reply(peer_id, M.KVAck(snap.request_id, complete=True))
    _, verdicts = pump(peer, ingest)
    assert verdicts and isinstance(verdicts[-1][1], M.KVAck) and verdicts[-1][1].complete
    assert not peer.pending and ingest.partial == 0


def test_wrong_secret_gets_nothing_through(ctx):
    ingest = KVIngest(ctx, "tcp://127.0.0.1:*", secret=os.urandom(32), node_id="decode-a", timeout_s=5)
    addr = ingest.sock.getsockopt_string(zmq.LAST_ENDPOINT)
    peer = KVPeer(ctx, addr, secret=os.urandom(32), node_id="intruder")
    snap = snapshot()
    peer.queue(Outgoing(snap.request_id, 1, "decode-a", snapshot_messages(snap, KVOptions(), stream_seq=1, priority=0)[0], time.monotonic() + 5))
    got, verdicts = pump(peer, ingest, rounds=10)
    assert got == []  # no header, no KV reached the decode side
    assert verdicts and isinstance(verdicts[0][1], M.KVRefuse) and verdicts[0][1].reason == "unauthorized"
    assert peer.failed and not peer.pending


def test_at_capacity_verdict_is_authenticated_refusal(ctx):
    secret = os.urandom(32)
    ingest = KVIngest(ctx, "tcp://127.0.0.1:*", secret=secret, node_id="decode-a", timeout_s=5)
    peer = KVPeer(ctx, ingest.sock.getsockopt_string(zmq.LAST_ENDPOINT), secret=secret, node_id="p")
    snap = snapshot()
    peer.queue(Outgoing(snap.request_id, 1, "decode-a", snapshot_messages(snap, KVOptions(), stream_seq=1, priority=0)[0], time.monotonic() + 5))
    _, verdicts = pump(peer, ingest, at_capacity=lambda: True, rounds=10)
    assert verdicts[0][1].reason == "at_capacity"


def test_partial_transfer_released_after_timeout_on_both_sides(ctx):
    secret = os.urandom(32)
    ingest = KVIngest(ctx, "tcp://127.0.0.1:*", secret=secret, node_id="d", timeout_s=0.2)
    peer = KVPeer(ctx, ingest.sock.getsockopt_string(zmq.LAST_ENDPOINT), secret=secret, node_id="p")
    snap = snapshot()
    header = snapshot_messages(snap, KVOptions(), stream_seq=1, priority=0)[0][0]
    # Only the header goes out (the prefill side "dies" before the data).
    peer.queue(Outgoing(snap.request_id, 1, "d", iter([header]), time.monotonic() + 0.2))
    got, _ = pump(peer, ingest, rounds=10)
    assert got and ingest.partial == 1
    time.sleep(0.3)
    expired_in = ingest.expire(time.monotonic())
    expired_out = peer.expired(time.monotonic())
    assert [i.header.request_id for i in expired_in] == [snap.request_id] and ingest.partial == 0
    assert [o.request_id for o in expired_out] == [snap.request_id] and not peer.pending


def test_unauthenticated_garbage_gets_nothing(ctx):
    """A peer that never completes the handshake: a non-hello, a message in the clear, a
    record sealed under keys of another session. Each is refused and counted; none
    reaches the worker."""
    from tandem.wire import codec
    from tandem.wire.handshake import Initiator, Responder

    ingest = KVIngest(ctx, "tcp://127.0.0.1:*", secret=os.urandom(32), node_id="decode-a", timeout_s=5)
    d = ctx.socket(zmq.DEALER)
    d.linger = 0
    d.connect(ingest.sock.getsockopt_string(zmq.LAST_ENDPOINT))
    other = os.urandom(32)
    res = Responder(other, "elsewhere")
    ini = Initiator(other, "p")
    _, channel, _ = ini.on_challenge(res.on_hello(ini.hello()))
    got = []
    for frames in ([b"hello?"], codec.encode(M.KVAck(b"q" * 16)), channel.seal([b"sealed under other keys"])):
        d.send_multipart(frames)
        assert ingest.sock.poll(2000)
        got += ingest.on_message(ingest.sock.recv_multipart(copy=False), at_capacity=lambda: False)
    assert got == [] and ingest.rejected == 3 and ingest.partial == 0
    d.close()


def test_a_progressive_transfer_completes_only_with_its_final_header(ctx):
    """KV sent while it is computed: a non-final header with the final geometry, blocks as
    they are done, then the final header with the sampled token. Every block arriving
    does not complete the transfer; the final header does, with its token state."""
    import dataclasses

    from tandem.wire.kvframes import encode_blocks, make_header

    secret = os.urandom(32)
    ingest = KVIngest(ctx, "tcp://127.0.0.1:*", secret=secret, node_id="d", timeout_s=5)
    peer = KVPeer(ctx, ingest.sock.getsockopt_string(zmq.LAST_ENDPOINT), secret=secret, node_id="p")
    final = snapshot(n_tokens=97, block=8)  # 12 blocks
    options = KVOptions(compression="lz4")
    header = make_header(final, options, stream_seq=1, attempt=2)
    first = dataclasses.replace(header, tokens=header.tokens[:-1], final=False)
    blocks = [encode_blocks(final.request_id, final.dtype, [k[b:b + 5] for k in final.keys],
                            [v[b:b + 5] for v in final.values], 0, b, options, i, last=False)
              for i, b in enumerate(range(0, 12, 5))]
    peer.queue(Outgoing(final.request_id, 2, "d", [first, *blocks], time.monotonic() + 5))
    got, _ = pump(peer, ingest, rounds=10)
    assert [s for *_, s in got] == [None] and ingest.partial == 1  # the header alone was announced
    peer.queue(Outgoing(final.request_id, 2, "d", [header], time.monotonic() + 5))
    got, _ = pump(peer, ingest, rounds=10)
    (_, attempt, h, back), = got
    assert attempt == 2 and h.final and back.tokens == final.tokens and ingest.partial == 0
    for a, b in zip(back.keys + back.values, final.keys + final.values):
        assert np.array_equal(a, b)


def test_progressive_transfer_parts_and_every_way_one_is_dropped(ctx):
    """A transfer marked progressive hands out its blocks as chunks complete them and
    completes with the rest; a newer attempt's header replaces an open transfer (reported
    by expire, so its receiver frees what it reserved) while an older one's is refused
    without touching it; a refused transfer and one cut off with its connection are
    reported too."""
    import dataclasses

    from tandem.wire.kvframes import make_header, part_messages

    ingest = KVIngest(ctx, "tcp://127.0.0.1:*", secret=os.urandom(32), node_id="d", timeout_s=5)
    snap = snapshot(n_tokens=81)  # 5 blocks of 16
    opts = KVOptions(strategy="streamed", blocks_per_chunk=2)
    prompt = dataclasses.replace(snap, tokens=snap.tokens[:80], num_computed=80, num_generated=0)

    def msgs(attempt, final):
        first = make_header(prompt if not final else snap, opts, attempt=attempt, final=final)
        return list(part_messages(dataclasses.replace(prompt, keys=[k[:4] for k in prompt.keys],
                                                      values=[v[:4] for v in prompt.values]),
                                  opts, first_index=0, header=first)[0])

    rid = snap.request_id
    opening = msgs(1, False)
    assert ingest.on_decoded(b"p1", opening[0])[0][3] is None  # a new transfer
    ingest.import_progressively(rid)
    for m in opening[1:]:
        assert ingest.on_decoded(b"p1", m) == []
    assert [(a, p.first_block, len(p.keys[0])) for a, p in ingest.take_parts()] == [(1, 0, 2), (1, 2, 2)]
    assert ingest.take_parts() == []
    # Attempt 2 from another prefill worker replaces it; a late attempt-1 header is refused.
    assert ingest.on_decoded(b"p2", msgs(2, False)[0])[0][1] == 2
    assert ingest.on_decoded(b"p1", msgs(1, False)[0]) == []
    assert ingest.partial == 1 and [i.attempt for i in ingest.expire(time.monotonic())] == [1]
    ingest.refuse(b"p2", rid, "at_capacity", "no room")
    assert [i.attempt for i in ingest.expire(time.monotonic())] == [2] and ingest.partial == 0
    other = dataclasses.replace(snap, request_id=os.urandom(16))
    ingest.on_decoded(b"p3", make_header(other, opts, attempt=1, final=False))
    ingest._drop_peer(b"p3", "sealed channel broke")
    assert [i.header.request_id for i in ingest.expire(time.monotonic())] == [other.request_id]
    ingest.close()
