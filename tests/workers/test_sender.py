"""The prefill side of a handoff, HandoffSender, against a decode side's KVIngest over real
loopback sockets: every strategy and encoding the [transfer] settings ask for arrives as
it was sent (and as those settings shape it), refusals and silence come back as failed
outcomes, and the adaptive selector explores, then keeps the faster strategy."""

from __future__ import annotations

import math
import time

import numpy as np
import pytest
import zmq

from tandem.wire import messages as M
from tandem.wire.settings import TransferSettings
from tandem.workers.handoff import KVIngest
from tandem.workers.sender import AdaptiveSelector, HandoffSender
from tests.wire.test_kvframes import make_snapshot

SECRET = b"t" * 32


class Decode:
    """A decode worker's side of the handoff, as workers/transfers.py runs it: accept (or
    refuse) each new transfer's header, acknowledge each completed one. Records what each
    connection sent."""

    def __init__(self, ctx, *, accept=True, timeout_s=5.0):
        self.ingest = KVIngest(ctx, "tcp://127.0.0.1:*", secret=SECRET, node_id="decode-1", timeout_s=timeout_s)
        self.address = self.ingest.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.accept = accept
        self.done: list = []  # (attempt, header, snapshot)
        self.sent: list = []  # (connection, message type) in arrival order
        decoded = self.ingest.on_decoded

        def spy(peer, msg):
            self.sent.append((peer, type(msg).__name__))
            return decoded(peer, msg)
        self.ingest.on_decoded = spy

    def pump(self) -> None:
        while self.ingest.sock.poll(0):
            for peer, attempt, header, snap in self.ingest.on_message(self.ingest.sock.recv_multipart(copy=False),
                                                                       at_capacity=lambda: False):
                rid = header.request_id
                if snap is None and not self.accept:
                    self.ingest.refuse(peer, rid, "at_capacity", "decode worker is full", 0.5)
                elif snap is None:
                    self.ingest.reply(peer, M.KVAck(rid, complete=False))
                else:
                    self.ingest.reply(peer, M.KVAck(rid, complete=True))
                    self.done.append((attempt, header, snap))


def hand_off(ctx, decode: Decode, snap, transfer: TransferSettings, *, timeout_s=5.0):
    """Start one handoff and move messages until it has an outcome; returns (outcome, sender)."""
    poller = zmq.Poller()
    sender = HandoffSender(ctx, secret=SECRET, node_id="prefill-1", transfer=transfer, timeout_s=timeout_s, poller=poller)
    sender.start(snap, attempt=2, decode_node="decode-1", address=decode.address, stream_seq=1, priority=0)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        decode.pump()
        for sock, _ in poller.poll(10):
            for rid, failure in sender.on_message(sender.peer_for(sock), sock.recv_multipart(copy=False)):
                return (rid, failure), sender
        for rid, failure in sender.expired(time.monotonic()):
            return (rid, failure), sender
    raise AssertionError("no outcome")


@pytest.mark.parametrize("transfer", [
    TransferSettings(strategy="full"),
    TransferSettings(strategy="streamed", blocks_per_chunk=2, compression="lz4"),
    TransferSettings(strategy="layer_parallel", connections=3),
    TransferSettings(strategy="layer_parallel", connections=2, quantization="int8"),
    TransferSettings(strategy="adaptive"),
], ids=["full", "streamed", "layer_parallel", "layer_parallel-int8", "adaptive"])
def test_every_strategy_arrives_as_the_settings_shape_it(ctx, transfer):
    decode = Decode(ctx)
    snap = make_snapshot(num_computed=100, layers=4)  # 13 blocks of 8
    (rid, failure), sender = hand_off(ctx, decode, snap, transfer)
    assert rid == snap.request_id and failure is None
    (attempt, header, got), = decode.done
    assert attempt == 2 and header.stream_seq == 1
    assert got.tokens == snap.tokens and got.sampling == snap.sampling
    for a, b in zip(got.keys + got.values, snap.keys + snap.values):
        if transfer.quantization == "none":
            np.testing.assert_array_equal(a, b)
        else:
            np.testing.assert_allclose(a.astype(np.float32), b.astype(np.float32), atol=0.05)
    assert sender.counters["handoffs"] == 1 and sender.counters["handoff_bytes"] == snap.nbytes
    connections = {peer for peer, kind in decode.sent if kind == "KVHeader"}
    chunks = sum(kind == "KVChunk" for _, kind in decode.sent)
    # transfer.connections and transfer.blocks_per_chunk shape the transfer (the defaults,
    # 2 and 64, would give other counts here).
    if transfer.strategy == "layer_parallel":
        assert len(connections) == len(sender.peers) == transfer.connections
    else:
        assert len(connections) == 1
    if transfer.strategy == "streamed":
        assert chunks == math.ceil(13 / transfer.blocks_per_chunk)
    sender.close()
    decode.ingest.close()


def test_a_refusal_reaches_the_sender_as_a_failed_outcome(ctx):
    decode = Decode(ctx, accept=False)
    (rid, failure), sender = hand_off(ctx, decode, make_snapshot(), TransferSettings(strategy="full"))
    assert "refused" in failure and "full" in failure and decode.done == []
    assert sender.counters["handoff_failures"] == 1 and not sender._transfers
    sender.close()
    decode.ingest.close()


def test_an_unacknowledged_handoff_fails_after_the_timeout(ctx):
    decode = Decode(ctx)
    decode.pump = lambda: None  # the decode worker hangs: nothing is read, nothing acknowledged
    (rid, failure), sender = hand_off(ctx, decode, make_snapshot(), TransferSettings(strategy="full"), timeout_s=0.3)
    assert "not acknowledged" in failure and sender.counters["handoff_failures"] == 1
    sender.close()
    decode.ingest.close()


def test_adaptive_selector_explores_then_exploits():
    sel = AdaptiveSelector(small_bytes=1000, explore_every=4)
    assert sel.choose("d1", 10) == "full"  # small: always full
    first, second = sel.choose("d1", 10_000), sel.choose("d1", 10_000)
    assert {first, second} == {"full", "layer_parallel"}
    sel.record("d1", "full", 10_000, 1e-5)  # 1 GB/s
    sel.record("d1", "layer_parallel", 10_000, 5e-6)  # 2 GB/s
    picks = [sel.choose("d1", 10_000) for _ in range(8)]
    assert picks.count("layer_parallel") >= 6 and "full" in picks  # mostly the faster, sometimes re-checks
    assert sel.bandwidth("d1") == pytest.approx(2.0)
    assert sel.choose("d2", 10_000) == "full"  # per peer
    assert sel.choose("d3", 10_000, streaming=True) in ("full", "layer_parallel", "streamed")


def split(snap, *bounds):
    """A snapshot as a streamed export hands it out: parts of blocks [a, b) with the final
    geometry and the prompt only, then the final part with the sampled token."""
    import dataclasses

    edges = [0, *bounds, snap.keys[0].shape[0]]
    parts = []
    for a, b in zip(edges, edges[1:]):
        last = b == edges[-1]
        parts.append(dataclasses.replace(
            snap, first_block=a, keys=[k[a:b] for k in snap.keys], values=[v[a:b] for v in snap.values],
            tokens=snap.tokens if last else snap.tokens[: snap.prompt_len], num_generated=snap.num_generated if last else 0))
    return parts


def pump_until(sender, poller, decode, done, seconds=10.0):
    """Move messages both ways until ``done()``; returns the sender's outcomes meanwhile."""
    outcomes = []
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and not done():
        decode.pump()
        for sock, _ in poller.poll(10):
            outcomes += sender.on_message(sender.peer_for(sock), sock.recv_multipart(copy=False))
        outcomes += sender.expired(time.monotonic())
    assert done(), "timed out"
    return outcomes


def new_sender(ctx, transfer=None, timeout_s=5.0):
    poller = zmq.Poller()
    sender = HandoffSender(ctx, secret=SECRET, node_id="prefill-1", transfer=transfer or TransferSettings(strategy="streamed"),
                           timeout_s=timeout_s, poller=poller)
    return sender, poller


def stream(sender, decode, part, final, seq):
    sender.stream(part, final=final, attempt=2, decode_node="decode-1", address=decode.address, stream_seq=seq, priority=0)


@pytest.mark.parametrize("transfer", [
    TransferSettings(strategy="streamed", blocks_per_chunk=2),
    TransferSettings(strategy="adaptive", compression="lz4"),
    TransferSettings(strategy="streamed", quantization="int8"),
], ids=["raw", "lz4", "int8"])
def test_a_streamed_export_completes_only_with_its_final_part(ctx, transfer):
    """Parts sent while the prompt is prefilled open the transfer on the decode side, which
    holds it (no snapshot yet) until the final part brings the sampled token; the joined
    KV is the snapshot's, exact (int8: within its bound), with the final token state."""
    decode = Decode(ctx)
    snap = make_snapshot(num_computed=100, layers=4)  # 13 blocks of 8
    sender, poller = new_sender(ctx, transfer)
    parts = split(snap, 5, 10)
    for part in parts[:2]:
        stream(sender, decode, part, False, 0)
    pump_until(sender, poller, decode, lambda: sum(k == "KVChunk" for _, k in decode.sent) >= 2)
    assert decode.done == [] and decode.ingest.partial == 1 and sender._transfers
    stream(sender, decode, parts[2], True, 1)
    outcomes = pump_until(sender, poller, decode, lambda: bool(decode.done))
    (attempt, header, got), = decode.done
    assert outcomes == [(snap.request_id, None)] and decode.ingest.partial == 0
    assert attempt == 2 and header.stream_seq == 1 and header.final and got.tokens == snap.tokens
    assert got.num_generated == 1 and got.first_block == 0
    for a, b in zip(got.keys + got.values, snap.keys + snap.values):
        if transfer.quantization == "none":
            np.testing.assert_array_equal(a, b)
        else:
            np.testing.assert_allclose(a.astype(np.float32), b.astype(np.float32), atol=0.05)
    assert [k for _, k in decode.sent].count("KVHeader") == 2  # the opening one and the final one
    assert sender.counters["handoffs"] == 1 and sender.counters["handoff_bytes"] == snap.nbytes
    sender.close()
    decode.ingest.close()


def test_a_stream_lives_while_its_prefill_does_and_is_dropped_when_it_dies(ctx):
    """A chunk that computes longer than the transfer timeout (a large model on the CPU):
    the sender's keep-alives hold the transfer open on the decode side, and it completes.
    A prefill that dies mid-stream sends none: the decode side drops the partial transfer
    after the timeout."""
    decode = Decode(ctx, timeout_s=0.3)
    sender, poller = new_sender(ctx, timeout_s=0.3)
    parts = split(make_snapshot(num_computed=100), 6)
    stream(sender, decode, parts[0], False, 0)
    pump_until(sender, poller, decode, lambda: decode.ingest.partial == 1)
    t_end = time.monotonic() + 1.0  # three timeouts without a part
    outcomes = pump_until(sender, poller, decode, lambda: time.monotonic() > t_end, seconds=3)
    assert outcomes == [] and decode.ingest.expire(time.monotonic()) == [] and decode.ingest.partial == 1
    stream(sender, decode, parts[1], True, 1)
    outcomes = pump_until(sender, poller, decode, lambda: bool(decode.done))
    assert outcomes == [(parts[0].request_id, None)] and decode.ingest.partial == 0

    dead = split(make_snapshot(num_computed=100, seed=1), 6)[0]
    dead.request_id = b"D" * 16
    stream(sender, decode, dead, False, 0)
    pump_until(sender, poller, decode, lambda: decode.ingest.partial == 1)
    sender.close()  # the prefill worker is gone: nothing more comes
    time.sleep(0.35)
    (gone,) = decode.ingest.expire(time.monotonic())
    assert gone.header.request_id == dead.request_id and decode.ingest.partial == 0 and len(decode.done) == 1
    decode.ingest.close()


def test_a_cancelled_stream_is_dropped_by_the_decode_side_at_once(ctx):
    """An abort, or a request that ends at its first token, while its KV streams: the
    prefill side says so and the decode side frees the transfer's place without waiting
    for its timeout; later parts of it go nowhere."""
    decode = Decode(ctx, timeout_s=60)
    sender, poller = new_sender(ctx, timeout_s=60)
    parts = split(make_snapshot(num_computed=100), 6)
    stream(sender, decode, parts[0], False, 0)
    pump_until(sender, poller, decode, lambda: decode.ingest.partial == 1)
    sender.cancel(parts[0].request_id, "request was aborted")
    pump_until(sender, poller, decode, lambda: decode.ingest.partial == 0)
    (gone,) = decode.ingest.expire(time.monotonic())
    assert gone.header.request_id == parts[0].request_id and not sender._transfers
    stream(sender, decode, parts[1], True, 1)  # the final part of a cancelled transfer is dropped
    time.sleep(0.1)
    decode.pump()
    assert decode.done == [] and decode.ingest.partial == 0 and not sender._transfers
    sender.close()
    decode.ingest.close()


def test_adaptive_streams_a_long_prompt_when_that_leaves_the_least_after_the_prefill():
    """With streaming possible, Streamed is tried too; its time is what remains after the
    prefill, as for the others (which start then), so it wins when the overlap pays."""
    sel = AdaptiveSelector(small_bytes=1000, explore_every=100)
    tried = {sel.choose("d1", 10_000, streaming=True) for _ in range(3)}
    assert tried == {"full", "layer_parallel", "streamed"}
    sel.record("d1", "full", 10_000, 1e-5)
    sel.record("d1", "layer_parallel", 10_000, 8e-6)
    sel.record("d1", "streamed", 10_000, 1e-6)  # only the last chunk's blocks were left
    assert [sel.choose("d1", 10_000, streaming=True) for _ in range(5)] == ["streamed"] * 5
    assert sel.choose("d1", 10_000) == "layer_parallel"  # one chunk: nothing to overlap
