from __future__ import annotations

import dataclasses

import msgpack
import pytest

from tandem.wire import codec, protocol as P
from tandem.wire import messages as M
from tandem.wire.errors import WireError
from tests.wire.samples import RID, all_messages, token_messages


def _same(a, b):
    if isinstance(a, M.KVChunk):
        assert [bytes(f) for f in a.frames] == [bytes(f) for f in b.frames]
        a, b = dataclasses.replace(a, frames=[]), dataclasses.replace(b, frames=[])
    assert a == b


def test_every_message_type_has_a_sample():
    covered = {type(m) for m in all_messages() + token_messages()}
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
