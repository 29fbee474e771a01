"""Handshake and sealed frames: wrong secrets, flipped bytes, replays and reorders are refused."""

from __future__ import annotations

import msgpack
import pytest
import zmq

from tandem.wire import codec
from tandem.wire import protocol as P
from tandem.wire.errors import AuthError, WireError
from tandem.wire.handshake import Initiator, PeerAtCapacity, Responder
from tandem.wire.kvchannel import KVReceiver, KVSender
from tandem.wire.messages import KVAck, KVChunk
from tandem.wire.sealed import REJECTED, SealedChannel

SECRET = b"k" * 32
RID = b"q" * 16


def _pair(secret_i=SECRET, secret_r=SECRET, at_capacity=False):
    ini, res = Initiator(secret_i, "prefill-1"), Responder(secret_r, "decode-1")
    challenge = res.on_hello(ini.hello(), at_capacity=at_capacity)
    proof, ch_i, peer = ini.on_challenge(challenge)
    assert peer == "decode-1"
    return ch_i, res.on_proof(proof)


def test_handshake_and_both_directions():
    ch_i, ch_r = _pair()
    frames = [b"header", b"x" * 100_000, b""]
    assert ch_r.open(ch_i.seal(frames)) == frames
    assert ch_i.open(ch_r.seal([b"ack"])) == [b"ack"]
    assert ch_r.open(ch_i.seal([b"second"])) == [b"second"]


def test_fresh_keys_per_connection():
    a, _ = _pair()
    b, _ = _pair()
    assert a.seal([b"same"])[1] != b.seal([b"same"])[1]


@pytest.mark.parametrize("side", ["initiator", "responder"])
def test_wrong_secret_refused(side):
    other = b"w" * 32
    ini = Initiator(other if side == "initiator" else SECRET, "p")
    res = Responder(other if side == "responder" else SECRET, "d")
    with pytest.raises(AuthError, match="wrong cluster secret"):
        ini.on_challenge(res.on_hello(ini.hello()))


def test_forged_proof_refused():
    ini, res = Initiator(SECRET, "p"), Responder(SECRET, "d")
    res.on_hello(ini.hello())
    with pytest.raises(AuthError):
        res.on_proof([P.header_prefix(P.MsgType.PROOF) + msgpack.packb([b"\0" * 32])])


def test_at_capacity_verdict_is_authenticated():
    ini, res = Initiator(SECRET, "p"), Responder(SECRET, "d")
    challenge = res.on_hello(ini.hello(), at_capacity=True, retry_after_s=0.25)
    with pytest.raises(PeerAtCapacity) as err:
        ini.on_challenge(challenge)
    assert err.value.retry_after_s == 0.25
    # A forger cannot turn an accept into a refusal (or back) without breaking the MAC.
    ini, res = Initiator(SECRET, "p"), Responder(SECRET, "d")
    accept = res.on_hello(ini.hello())[0]
    assert b"\xa6accept" in accept
    tampered = accept.replace(b"\xa6accept", b"\xabat_capacity")
    with pytest.raises(AuthError):
        ini.on_challenge([tampered])


def test_every_single_byte_flip_is_rejected():
    k1, k2 = b"1" * 32, b"2" * 32
    sealed = SealedChannel(k1, k2).seal([b"hdr" * 10, bytes(range(256)) * 2])
    assert SealedChannel(k2, k1).open(sealed) == [b"hdr" * 10, bytes(range(256)) * 2]
    flips = 0
    for f, frame in enumerate(sealed):
        for pos in range(len(frame)):
            tampered = [bytearray(x) for x in sealed]
            tampered[f][pos] ^= 0x01 << (pos % 8)
            with pytest.raises(WireError):
                SealedChannel(k2, k1).open([bytes(x) for x in tampered])
            flips += 1
    assert flips == sum(len(x) for x in sealed)


def test_replay_reorder_truncation_rejected_and_counted():
    ch_i, ch_r = _pair()
    m1, m2, m3 = ch_i.seal([b"one"]), ch_i.seal([b"two"]), ch_i.seal([b"three", b"four"])
    assert ch_r.open(m1) == [b"one"]
    before = dict(REJECTED)
    with pytest.raises(AuthError) as err:
        ch_r.open(m1)  # replay
    assert err.value.reason == "replay" and REJECTED["replay"] == before.get("replay", 0) + 1
    with pytest.raises(AuthError, match="already rejected"):
        ch_r.open(m2)  # the channel is broken: drop the connection
    ch_i, ch_r = _pair()
    m1, m2 = ch_i.seal([b"one"]), ch_i.seal([b"two"])
    with pytest.raises(AuthError) as err:
        ch_r.open(m2)  # reorder
    assert err.value.reason == "reorder"
    ch_i, ch_r = _pair()
    m = ch_i.seal([b"a", b"b"])
    assert ch_r.open(m[:2]) is None  # first record only: incomplete, not yet an error
    with pytest.raises(AuthError) as err:
        ch_r.open(ch_i.seal([b"next"]))  # the last record of the previous message never came
    assert err.value.reason == "truncated"
    for bad in ([0, 3, 2, 1], [2, 3, 0, 1], [0, 1, 2], [0, 1, 0, 1, 2, 3], [0, 1, 2, 3, 2, 3]):
        ch_i, ch_r = _pair()
        m = ch_i.seal([b"a", b"b"])
        with pytest.raises(AuthError):
            ch_r.open([m[k] for k in bad])  # swapped, reordered, dropped or duplicated records


def test_records_one_per_zeromq_message():
    ch_i, ch_r = _pair()
    frames = [b"h", b"x" * 1000, b"y" * 10]
    records = list(ch_i.seal_records(frames))
    assert len(records) == 3 and all(len(r) == 2 for r in records)
    assert ch_r.open(records[0]) is None and ch_r.open(records[1]) is None
    assert ch_r.open(records[2]) == frames
    assert ch_r.open(ch_i.seal([b"after"])) == [b"after"]
    with pytest.raises(AuthError):
        ch_r.open(records[1])  # replayed record


@pytest.fixture
def ctx():
    ctx = zmq.Context()
    yield ctx
    ctx.destroy(linger=0)


def test_kv_sender_receiver_over_zeromq(ctx):
    rx = KVReceiver(ctx, "tcp://127.0.0.1:*", SECRET, "decode-1")
    import threading

    result = {}

    def sender():
        tx = KVSender(ctx, rx.endpoint, SECRET, "prefill-1")
        tx.send(KVChunk(RID, 0, 0, 1, 0, 1, True, [b"K" * 70_000, b"V"]))
        result["ack"] = tx.recv(timeout_s=5)
        tx.close()

    t = threading.Thread(target=sender)
    t.start()
    got = None
    while got is None:
        got = rx.recv(timeout_s=5)
        assert got is not None or t.is_alive()
    peer, msg = got
    assert rx.peer_ids[peer] == "prefill-1"
    assert [bytes(f) for f in msg.frames] == [b"K" * 70_000, b"V"]
    rx.send(peer, KVAck(RID, True))
    t.join(5)
    assert result["ack"] == KVAck(RID, True)
    rx.close()


def test_wrong_secret_peer_refused_over_zeromq(ctx):
    rx = KVReceiver(ctx, "tcp://127.0.0.1:*", SECRET, "decode-1")
    import threading

    errors = []

    def sender():
        try:
            KVSender(ctx, rx.endpoint, b"x" * 32, "intruder", timeout_s=5)
        except Exception as exc:  # noqa: BLE001 - the test inspects it
            errors.append(exc)

    t = threading.Thread(target=sender)
    t.start()
    assert rx.recv(timeout_s=1.0) is None
    t.join(5)
    assert isinstance(errors[0], AuthError)
    assert not rx._channels


def test_unauthenticated_garbage_gets_nothing(ctx):
    rx = KVReceiver(ctx, "tcp://127.0.0.1:*", SECRET, "decode-1")
    d = ctx.socket(zmq.DEALER)
    d.linger = 0
    d.connect(rx.endpoint)
    ch_i, _ = _pair()
    for frames in ([b"hello?"], codec.encode(KVAck(RID)), ch_i.seal([b"sealed under other keys"])):
        d.send_multipart(frames)
        assert rx.recv(timeout_s=0.3) is None
    assert sum(v for k, v in rx.stats.items() if k.startswith("rejected_")) == 3
    d.close()


def test_large_writable_frames_decrypt_in_place_and_reject_flips():
    import random

    from tandem.wire.kvchannel import SendArena

    k1, k2 = b"1" * 32, b"2" * 32
    big = bytes(random.Random(0).randbytes(200_000))
    arena = SendArena(1 << 20)
    records = list(SealedChannel(k1, k2).seal_records([b"hdr", big], alloc=arena.alloc))
    assert isinstance(records[1][1], memoryview)  # sealed into the arena
    wire = [[bytes(h), bytes(c)] for h, c in records]

    def deliver(tamper=None):
        rx = SealedChannel(k2, k1)
        out = None
        for r, (h, c) in enumerate(wire):
            frames = [bytearray(h), bytearray(c)]  # writable, as recv(copy=False) gives
            if tamper and tamper[0] == r:
                frames[tamper[1]][tamper[2]] ^= 0x10
            out = rx.open(frames)
        return out

    out = deliver()
    assert bytes(out[0]) == b"hdr" and bytes(out[1]) == big and isinstance(out[1], memoryview)
    rng = random.Random(1)
    positions = list(range(len(wire[1][0]))) + [0, 1, len(wire[1][1]) - 1] + rng.sample(range(len(wire[1][1])), 100)
    for k, pos in enumerate(positions):
        part = 0 if k < len(wire[1][0]) else 1
        with pytest.raises(WireError):
            deliver((1, part, pos))


def _group_wire(frames, group_bytes, alloc=None):
    k1, k2 = b"1" * 32, b"2" * 32
    records = list(SealedChannel(k1, k2).seal_records(frames, alloc=alloc, group_bytes=group_bytes))
    return [[bytes(h), bytes(c)] for h, c in records], (k2, k1)


def test_grouped_records_round_trip_in_place_and_small():
    import random

    from tandem.wire.kvchannel import SendArena

    rng = random.Random(2)
    frames = [b"hdr"] + [rng.randbytes(rng.choice([0, 5, 40_000, 90_000, 300_000])) for _ in range(40)] + [b"tail"]
    arena = SendArena(8 << 20)
    wire, keys = _group_wire(frames, 256_000, alloc=arena.alloc)
    # Frames under group_bytes share records; every record stays under twice that.
    assert 2 < len(wire) < len(frames) and all(len(c) - 16 < 2 * 256_000 for _, c in wire)
    for writable in (True, False):  # in place (recv(copy=False) buffers) and one-shot decrypt
        rx = SealedChannel(*keys)
        outs = [rx.open([bytearray(h), bytearray(c)] if writable else [h, c]) for h, c in wire]
        assert all(o is None for o in outs[:-1])
        assert [bytes(f) for f in outs[-1]] == frames
    # The same message in one ZeroMQ message (seal) with grouping, then an ungrouped one.
    tx, rx = SealedChannel(keys[1], keys[0]), SealedChannel(*keys)
    assert [bytes(f) for f in rx.open(tx.seal(frames, group_bytes=1 << 20))] == frames
    assert rx.open(tx.seal([b"next"])) == [b"next"]


def test_grouped_record_tampering_rejected():
    # Every byte of a group's header (frame count, lengths) is authenticated; structurally
    # impossible headers are refused before decrypting; records may not skip or repeat.
    frames = [b"a" * 100, b"b" * 200, b"c" * 300, b"d" * 50]
    wire, keys = _group_wire(frames, 1000)
    assert len(wire) == 1 and len(wire[0][0]) == 18 + 4 * 4
    head, ct = wire[0]
    assert [bytes(f) for f in SealedChannel(*keys).open([head, ct])] == frames
    for pos in range(len(head)):
        for bit in (0x01, 0x80):
            bad = bytearray(head)
            bad[pos] ^= bit
            with pytest.raises(AuthError):
                SealedChannel(*keys).open([bytes(bad), ct])
    import struct

    prefix = head[:4]
    swapped = prefix + struct.pack(">QHHH4I", 0, 4, 0, 4, 200, 100, 300, 50)  # same total, other split
    cases = [
        (swapped, ct, "altered"),
        (prefix + struct.pack(">QHHH", 0, 4, 0, 1) + struct.pack(">I", 650), ct, "header"),  # k = 1 in group form
        (prefix + struct.pack(">QHHH4I", 0, 4, 0, 4, 100, 200, 300, 51), ct, "size"),  # lengths != ciphertext
        (prefix + struct.pack(">QHHH4I", 0, 3, 0, 4, 100, 200, 300, 50), ct, "reorder"),  # more frames than the message
        (head[:-4], ct, "header"),  # a length missing
    ]
    for h, c, reason in cases:
        with pytest.raises(AuthError) as err:
            SealedChannel(*keys).open([h, c])
        assert err.value.reason == reason
    # Two groups delivered out of order, twice, or with one missing.
    wire, keys = _group_wire([b"x" * 600] * 6, 1000)
    assert len(wire) == 3
    for order in ([1, 0, 2], [0, 0, 1, 2], [0, 2]):
        rx = SealedChannel(*keys)
        with pytest.raises(AuthError):
            for j in order:
                rx.open(wire[j])


def test_record_sizes_ramp_up_and_down_and_round_trip():
    # A large message: small first and last records (nothing overlaps their cipher work),
    # records of about group_bytes between; frames as large as group_bytes stay alone.
    from tandem.wire.sealed import RAMP_MIN_BYTES, record_target

    group = 4 * RAMP_MIN_BYTES
    frames = [b"hdr"] + [bytes([i]) * (RAMP_MIN_BYTES // 2) for i in range(48)]
    wire, keys = _group_wire(frames, group)
    sizes = [len(c) - 16 for _, c in wire]
    assert sizes[0] <= RAMP_MIN_BYTES + 3 and sizes[-1] <= RAMP_MIN_BYTES  # (+ the 3-byte header frame)
    assert max(sizes) == group and sizes.count(group) >= 3 and all(s < 2 * group for s in sizes)
    assert sizes.index(group) > 1 and sizes[:sizes.index(group)] == sorted(sizes[:sizes.index(group)])
    rx = SealedChannel(*keys)
    outs = [rx.open([bytearray(h), bytearray(c)]) for h, c in wire]
    assert all(o is None for o in outs[:-1]) and [bytes(f) for f in outs[-1]] == frames
    # The rule itself: doubling from the start, halving to the end, group_bytes between.
    assert record_target(group, 0, 100 * group) == RAMP_MIN_BYTES
    assert record_target(group, 2 * RAMP_MIN_BYTES, 100 * group) == 2 * RAMP_MIN_BYTES
    assert record_target(group, 50 * group, 50 * group) == group
    assert record_target(group, 50 * group, 3 * RAMP_MIN_BYTES) == 3 * RAMP_MIN_BYTES // 2
    assert record_target(group, 50 * group, RAMP_MIN_BYTES) == RAMP_MIN_BYTES
    assert record_target(1000, 0, 10) == 1000  # a group smaller than the ramp's start
    # Frames of group_bytes or more are records of their own; a small message is one record.
    wire, _ = _group_wire([b"h", bytes(group), bytes(group), b"t"], group)
    assert [len(c) - 16 for _, c in wire] == [1, group, group, 1]
    wire, _ = _group_wire([b"a" * 10] * 50, group)
    assert len(wire) == 1
