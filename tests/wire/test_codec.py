from __future__ import annotations

import dataclasses

import msgpack
import pytest

from tandem.wire import codec, protocol as P
from tandem.wire import messages as M
from tandem.wire.errors import WireError
from tests.wire.samples import RID, STREAM, all_messages, token_batches, token_messages


def _same(a, b):
    if isinstance(a, M.KVChunk):
        assert [bytes(f) for f in a.frames] == [bytes(f) for f in b.frames]
        a, b = dataclasses.replace(a, frames=[]), dataclasses.replace(b, frames=[])
    assert a == b


def test_every_message_type_has_a_sample():
    covered = {type(m) for m in all_messages() + token_messages() + token_batches()}
    assert covered == set(M.REGISTRY.values())


@pytest.mark.parametrize("msg", all_messages(), ids=lambda m: type(m).__name__)
def test_round_trip(msg):
    frames = codec.encode(msg)
    _same(codec.decode(frames), msg)
    # The same through a ROUTER envelope.
    identity, body = codec.split_route(codec.route(b"peer-7", frames))
    assert identity == b"peer-7"
    _same(codec.decode(body), msg)


@pytest.mark.parametrize("msg", token_messages(), ids=lambda m: str(m.seq))
def test_token_round_trip(msg):
    frames = codec.encode_tokens(msg)
    assert frames[0] == RID
    assert codec.decode_tokens(frames) == msg


def _header(msg_type, body, version=P.PROTOCOL_VERSION):
    return P.MAGIC + bytes((version, msg_type)) + msgpack.packb(body, use_bin_type=True)


def _submit_body(**changes):
    body = codec.encode(M.Submit(RID, [1, 2, 3], M.SamplingParams()))[0][4:]
    fields = msgpack.unpackb(body)
    names = [n for n, _ in M.Submit.SPECS]
    for k, v in changes.items():
        fields[names.index(k)] = v
    return fields


@pytest.mark.parametrize(
    "change",
    [
        {"request_id": b"short"},
        {"request_id": "x" * 16},
        {"prompt": []},
        {"prompt": [1, -1]},
        {"prompt": [1, P.MAX_TOKEN_ID + 1]},
        {"prompt": [1, 2.0]},
        {"prompt": [True]},
        {"prompt": list(range(P.MAX_PROMPT_TOKENS + 1))},
        {"priority": P.MAX_PRIORITY + 1},
        {"model": "m" * (P.MODEL_MAX_CHARS + 1)},
        {"sampling": [0.0] * 9},
        {"sampling": [float("nan"), 1.0, 0, 0.0, None, 16, [], [], None, False]},
        {"sampling": [0.0, 1.0, 0, 0.0, -1, 16, [], [], None, False]},
        {"sampling": [0.0, 1.0, 0, 0.0, None, 0, [], [], None, False]},
        {"sampling": [0.0, 1.0, 0, 0.0, None, 16, [], [[1]], None, False]},
        {"sampling": [0.0, 1.0, 0, 0.0, None, 16, [], [], 999, False]},
    ],
)
def test_bad_fields_are_refused(change):
    with pytest.raises(WireError):
        codec.decode([_header(P.MsgType.SUBMIT, _submit_body(**change))])


def test_framing_errors():
    good = codec.encode(M.Abort(RID))[0]
    with pytest.raises(WireError, match="magic"):
        codec.decode([b"XX" + good[2:]])
    with pytest.raises(WireError, match="protocol v9") as err:
        codec.decode([good[:2] + b"\x09" + good[3:]])
    assert err.value.reason == "version"
    with pytest.raises(WireError, match="unknown message type"):
        codec.decode([good[:3] + b"\xee" + good[4:]])
    with pytest.raises(WireError):
        codec.decode([])
    with pytest.raises(WireError, match="no payload"):
        codec.decode([good, b"extra"])
    with pytest.raises(WireError):
        codec.decode([good[:3]])
    with pytest.raises(WireError):
        codec.decode([good + b"\x00"])  # trailing bytes
    with pytest.raises(WireError):
        codec.decode([good[:-1]])  # truncated
    with pytest.raises(WireError):
        codec.decode([good] * (P.MAX_FRAMES + 1))
    with pytest.raises(WireError):
        codec.decode([_header(P.MsgType.ABORT, [RID, 1])])  # extra field
    with pytest.raises(WireError):
        codec.decode([_header(P.MsgType.ABORT, {"request_id": RID})])
    with pytest.raises(WireError):
        codec.decode([object()])
    with pytest.raises(WireError):
        codec.decode(codec.encode_tokens(token_messages()[0])[1:])  # tokens need a topic


def test_token_stream_errors():
    msg = token_messages()[1]
    topic, head = codec.encode_tokens(msg)
    with pytest.raises(WireError):
        codec.decode_tokens([topic[:15], head])
    with pytest.raises(WireError):
        codec.decode_tokens([topic])
    with pytest.raises(WireError):
        codec.decode_tokens([topic, codec.encode(M.Abort(RID))[0]])
    bad = M.TokenMessage(RID, 1, [1, 2], msg.logprobs)  # one logprob for two tokens
    with pytest.raises(WireError, match="one entry per token"):
        codec.decode_tokens(codec.encode_tokens(bad))


@pytest.mark.parametrize("batch", token_batches(), ids=lambda b: str(len(b.entries)))
def test_token_batch_round_trip(batch):
    head = codec.pack_header(batch)
    # Entries packed one by one and joined are the same bytes as the batch encoded whole.
    assert codec.batch_headers([codec.stream_entry(a, m) for a, m in batch.entries]) == ([head] if batch.entries else [])
    assert codec.decode_batch([STREAM, head]) == batch.entries
    assert codec.decode_batch([P.STREAM_BATCH_TOPIC, head]) == batch.entries
    with pytest.raises(WireError, match="plain message"):
        codec.decode([head])


def test_batches_split_at_the_entry_and_size_bounds():
    entries = [codec.stream_entry(1, M.TokenMessage(RID, i, [i % 1000])) for i in range(P.MAX_STREAM_ENTRIES + 5)]
    heads = codec.batch_headers(entries)
    assert [len(codec.decode_batch([STREAM, h])) for h in heads] == [P.MAX_STREAM_ENTRIES, 5]
    assert [m.seq for h in heads for _, m in codec.decode_batch([STREAM, h])] == list(range(P.MAX_STREAM_ENTRIES + 5))
    big = [codec.stream_entry(0, M.TokenMessage(RID, i, [P.MAX_TOKEN_ID] * P.MAX_TOKENS_PER_STREAM_MESSAGE)) for i in range(400)]
    heads = codec.batch_headers(big)
    assert len(heads) > 1 and all(len(h) <= P.MAX_HEADER_BYTES for h in heads)
    assert [m.seq for h in heads for _, m in codec.decode_batch([STREAM, h])] == list(range(400))


def test_token_batch_errors():
    head = codec.pack_header(token_batches()[1])
    with pytest.raises(WireError):
        codec.decode_batch([RID, head])  # a request's topic, not a stream's
    with pytest.raises(WireError):
        codec.decode_batch([STREAM])
    with pytest.raises(WireError, match="TOKEN_BATCH"):
        codec.decode_batch([STREAM, codec.encode_tokens(token_messages()[0])[1]])
    entry = [RID, 0, 0, [1], None, None, None, None]
    for bad in ([b"short", *entry[1:]], [RID, P.MAX_ATTEMPTS + 1, *entry[2:]], entry[:-1], [*entry, None],
                [RID, 0, -1, *entry[3:]], [RID, 0, 0, [1, 2], [[1, -0.5, []]], None, None, None], "entry"):
        with pytest.raises(WireError):
            codec.decode_batch([STREAM, _header(P.MsgType.TOKEN_BATCH, [[entry, bad]])])
    with pytest.raises(WireError):
        codec.decode_batch([STREAM, _header(P.MsgType.TOKEN_BATCH, [[entry] * (P.MAX_STREAM_ENTRIES + 1)])])


def test_large_frames_go_zero_copy_and_are_tracked():
    import numpy as np
    import zmq

    ctx = zmq.Context.instance()
    a, b = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
    try:
        a.bind("inproc://codec-zero-copy")
        b.connect("inproc://codec-zero-copy")
        big = np.arange(1 << 16, dtype=np.float32)
        msg = M.KVChunk(RID, 0, 0, 1, 0, 1, True, [memoryview(big), b"small"])
        tracker = codec.send(a, codec.encode(msg), track=True)
        assert tracker is not None
        got = codec.decode(codec.recv_frames(b, copy=False))
        assert bytes(got.frames[0]) == big.tobytes() and bytes(got.frames[1]) == b"small"
        assert not tracker.done  # inproc shares the buffer with the receiver's frame
        del got
        tracker.wait(5)
        assert codec.send(a, codec.encode(M.Abort(RID)), track=True) is None
        codec.recv_frames(b)
    finally:
        a.close(0)
        b.close(0)
