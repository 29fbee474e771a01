"""Handshake and sealed frames: wrong secrets, flipped bytes, replays and reorders are refused."""

from __future__ import annotations

import msgpack
import pytest

from tandem.wire import protocol as P
from tandem.wire.errors import AuthError, WireError
from tandem.wire.handshake import Initiator, PeerAtCapacity, Responder
from tandem.wire.sealed import REJECTED, SealedChannel

SECRET = b"k" * 32


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
    # Frames of group_bytes up to 1.5x the record size are records of their own (larger
    # ones are split: test_large_frames_travel_in_pieces); a small message is one record.
    wire, _ = _group_wire([bytes(group)] * 8, group)
    sizes = [len(c) - 16 for _, c in wire]
    assert sizes.count(group) >= 5 and max(sizes) == group and sum(sizes) == 8 * group
    wire, _ = _group_wire([b"a" * 10] * 50, group)
    assert len(wire) == 1


def _piece_heads(wire):
    import struct

    return [struct.unpack(">QHHHII", h[4:]) for h, _ in wire if len(h) == 4 + 22]  # base, n, i, 0, size, offset


def test_large_frames_travel_in_pieces():
    # A frame well over the record size is sealed as pieces of it, ramped like records,
    # and reassembled into one contiguous buffer (decrypted straight into it).
    import random

    from tandem.wire.kvchannel import SendArena
    from tandem.wire.sealed import RAMP_MIN_BYTES

    rng = random.Random(5)
    big = rng.randbytes(7 * RAMP_MIN_BYTES + 12345)
    frames = [b"hdr", big, rng.randbytes(300_000), rng.randbytes(3 * RAMP_MIN_BYTES), b"tail"]
    arena = SendArena(16 << 20)
    group = 2 * RAMP_MIN_BYTES
    wire, keys = _group_wire(frames, group, alloc=arena.alloc)
    pieces = _piece_heads(wire)
    assert {p[2] for p in pieces} == {1, 3}  # only the two large frames
    sizes = [len(c) - 16 for h, c in wire]
    assert sizes[0] <= RAMP_MIN_BYTES + 3 and max(sizes) <= group + group // 4
    offsets = [p[5] for p in pieces if p[2] == 1]
    assert offsets[0] == 0 and offsets == sorted(offsets) and all(p[4] == len(big) for p in pieces if p[2] == 1)
    for writable in (True, False):
        rx = SealedChannel(*keys)
        outs = [rx.open([bytearray(h), bytearray(c)] if writable else [h, c]) for h, c in wire]
        assert all(o is None for o in outs[:-1])
        assert [bytes(f) for f in outs[-1]] == frames
        assert isinstance(outs[-1][1], memoryview) and outs[-1][1].contiguous and not outs[-1][1].readonly
    # The next message on the same channel opens as usual; the counter moved by 5 frames.
    tx = SealedChannel(keys[1], keys[0])
    list(tx.seal_records(frames, group_bytes=group))
    assert rx.open(tx.seal([b"next"])) == [b"next"]


def test_piece_tampering_reorder_and_truncation_rejected():
    import struct

    from tandem.wire.sealed import RAMP_MIN_BYTES

    group = RAMP_MIN_BYTES // 4
    frames = [b"h", bytes(range(256)) * (4 * group // 256), b"t" * 10]
    wire, keys = _group_wire(frames, group)
    pieces = [j for j, (h, _) in enumerate(wire) if len(h) == 4 + 22]
    assert len(pieces) >= 3
    assert [bytes(f) for f in _deliver(wire, keys)] == frames

    # Every bit of a piece's head is authenticated (or structurally refused).
    j = pieces[1]
    for pos in range(len(wire[j][0])):
        bad = [list(r) for r in wire]
        bad[j][0] = bytes(b ^ (0x04 if k == pos else 0) for k, b in enumerate(bad[j][0]))
        with pytest.raises(AuthError):
            _deliver(bad, keys)
    # Pieces swapped, repeated, dropped; a whole record inside a frame's pieces; a
    # message cut off after a piece.
    a, b = pieces[0], pieces[1]
    for order, reason in [
        ([0, b, a], "reorder"),
        ([0, a, a], "reorder"),
        ([0, a] + list(range(b + 1, len(wire))), "reorder"),
        ([0, a, len(wire) - 1], "reorder"),
    ]:
        with pytest.raises(AuthError) as err:
            _deliver([wire[k] for k in order], keys)
        assert err.value.reason == reason, order
    tx, rx = SealedChannel(keys[1], keys[0]), SealedChannel(*keys)
    records = [[bytes(h), bytes(c)] for h, c in tx.seal_records(frames, group_bytes=group)]
    rx.open(records[0])
    rx.open(records[1])  # the first piece of frame 1; then the next message begins
    with pytest.raises(AuthError):
        rx.open(tx.seal([b"next"]))

    # Forged heads: a piece under another piece's nonce, a one-piece "split", a frame
    # over the size bound, a length that changes mid-frame, a gap between pieces.
    head = wire[a][0]
    base, n, i, _, size, offset = struct.unpack(">QHHHII", head[4:])
    second_ct = wire[b][1]
    m = len(wire[a][1]) - 16
    forged = [
        ([wire[0], [head[:-4] + struct.pack(">I", 0), second_ct]], "altered"),  # piece 1 in piece 0's place
        ([wire[0], [head[:-8] + struct.pack(">II", m, 0), wire[a][1]]], "header"),
        ([wire[0], [head[:-8] + struct.pack(">II", P.MAX_FRAME_BYTES + 1, 0), wire[a][1]]], "header"),
        ([wire[0], wire[a], [head[:-8] + struct.pack(">II", size + 1, m), second_ct]], "reorder"),
        ([wire[0], wire[a], [head[:-8] + struct.pack(">II", size, m + 1), second_ct]], "reorder"),
    ]
    for records, reason in forged:
        with pytest.raises(AuthError) as err:
            _deliver(records, keys)
        assert err.value.reason == reason


def _deliver(wire, keys):
    rx = SealedChannel(*keys)
    out = None
    for h, c in wire:
        out = rx.open([bytearray(h), bytearray(c)])
    return out
