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
