"""The broker's compiled codec (tandem/broker/frames.py) against the generic one
(tandem/wire/codec.py): the same bytes out, the same verdict on any input."""

from __future__ import annotations

import random

import msgpack
import pytest

from tandem.broker import frames as F
from tandem.wire import codec
from tandem.wire import protocol as P
from tandem.wire.errors import WireError
from tandem.wire.messages import KVChunk, REGISTRY
from tests.wire import fuzz_inputs as FI
from tests.wire.samples import STREAM, all_messages, token_batches, token_messages


def _verdict(fn, *args):
    try:
        # repr: free-form stats may hold NaN, which is never equal to itself.
        return ("ok", repr(fn(*args)))
    except WireError:
        return ("error", None)


def _same_verdict(head: bytes) -> None:
    generic = _verdict(codec.decode, [head])
    compiled = _verdict(F.decode, head)
    assert compiled == generic, (head[:80], generic, compiled)


def _same_batch_verdict(head: bytes) -> None:
    generic = _verdict(codec.decode_batch, [STREAM, head])
    compiled = _verdict(lambda h: F.decode_batch(h)[1], head)
    assert compiled == generic, (head[:80], generic, compiled)


@pytest.mark.parametrize("batch", token_batches(), ids=lambda b: str(len(b.entries)))
def test_token_batches_match(batch):
    head = codec.pack_header(batch)
    assert F.encode(batch) == head
    raws, entries = F.decode_batch(head)
    assert entries == codec.decode_batch([STREAM, head]) == batch.entries
    # Forwarded entries (packed again as decoded) make the same batch.
    assert codec.batch_headers([F.pack_entry(r) for r in raws]) == ([head] if raws else [])


def test_each_bound_of_a_batch_entry_is_enforced_by_both():
    head = codec.pack_header(token_batches()[0])
    body = msgpack.unpackb(head[P.PREFIX_LEN:])
    for e in range(len(body[0])):
        for i in range(len(body[0][e])):
            for bad in (-1, (1 << 64) - 1, "x" * 2000, 1.5, None, True, [], b"\0" * 17, [[]], {"k": 1}):
                copy = [[list(x) for x in body[0]]]
                copy[0][e][i] = bad
                _same_batch_verdict(head[: P.PREFIX_LEN] + msgpack.packb(copy, use_bin_type=True))


@pytest.mark.parametrize("msg", [m for m in all_messages() if not isinstance(m, KVChunk)], ids=lambda m: type(m).__name__)
def test_encode_is_byte_identical_and_decodes_to_the_same_message(msg):
    head = codec.encode(msg)[0]
    assert F.encode(msg) == head
    assert F.decode(head) == codec.decode([head]) == msg


@pytest.mark.parametrize("msg", token_messages(), ids=lambda m: f"seq{m.seq}")
def test_token_messages_match(msg):
    rid, head = codec.encode_tokens(msg)
    assert F.encode(msg) == head
    assert codec.decode_tokens([rid, head]) == msg


def test_each_bound_is_enforced_by_both():
    """Every field of every message set to a value just outside its bound (or of the
    wrong type) is refused by both decoders (token messages: as batch entries, below)."""
    for msg in all_messages():
        head = codec.encode(msg)[0]
        body = msgpack.unpackb(head[P.PREFIX_LEN:])
        # Top-level fields, and one level down (the sampling and usage arrays).
        paths = [(i,) for i in range(len(body))]
        paths += [(i, j) for i, v in enumerate(body) if type(v) is list for j in range(len(v))]
        for path in paths:
            for bad in (-1, (1 << 64) - 1, -(1 << 63), "x" * 2000, 1.5, float("nan"), None, True, [], b"\0" * 17, [[]], {"k": 1}):
                copy = [list(v) if type(v) is list else v for v in body]
                target = copy if len(path) == 1 else copy[path[0]]
                target[path[-1]] = bad
                _same_verdict(head[: P.PREFIX_LEN] + msgpack.packb(copy, use_bin_type=True))


def test_framing_errors():
    with pytest.raises(WireError):
        F.decode(b"XX\x02\x01" + msgpack.packb([]))
    with pytest.raises(WireError, match="protocol v1"):
        F.decode(b"TD\x01\x01" + msgpack.packb([]))
    with pytest.raises(WireError, match="unknown message type"):
        F.decode(P.MAGIC + bytes((P.PROTOCOL_VERSION, 250)) + msgpack.packb([]))
    with pytest.raises(WireError, match="TOKENS"):
        F.decode(P.header_prefix(P.MsgType.TOKENS) + msgpack.packb([0, [], None, None, None, None]))
    with pytest.raises(WireError, match="exceeds"):
        F.decode(P.header_prefix(P.MsgType.ABORT) + b"\0" * P.MAX_HEADER_BYTES)


def test_every_plain_message_type_has_a_compiled_decoder():
    assert set(F._PLAIN) == {int(t) for t, cls in REGISTRY.items() if cls.__name__ not in ("TokenMessage", "TokenBatch")}


def _fuzz(n: int, seed: int) -> None:
    rng = random.Random(seed)
    for _ in range(n):
        frames = rng.choice([FI.structured, FI.mutated, FI.garbage])(rng)
        if not frames:
            continue
        head = bytes(frames[-1] if len(frames) == 2 and len(frames[0]) in (16, 17) else frames[0])
        _same_verdict(head)
        _same_batch_verdict(bytes(frames[-1]) if len(frames) == 2 else head)


def test_fuzzed_input_gets_the_same_verdict():
    _fuzz(20_000, 5)


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_fuzzed_input_gets_the_same_verdict_100k():
    _fuzz(100_000, 20261130)


@pytest.mark.parametrize("submit", [m for m in all_messages() if type(m).__name__ == "Submit"], ids=lambda m: str(len(m.prompt)))
def test_dispatch_spliced_from_the_submit_bytes_equals_the_encoded_dispatch(submit):
    from tandem.wire import messages as M

    head = codec.encode(submit)[0]
    tail = F.submit_tail(head, submit.stream)
    assert tail is not None
    for mode, node, address, attempt in (("hybrid", None, None, 1), ("prefill", "decode-a", "tcp://127.0.0.1:7001", 3),
                                         ("decode", None, None, P.MAX_ATTEMPTS)):
        want = F.encode(M.Dispatch(submit.request_id, mode, submit.prompt, submit.sampling, submit.priority,
                                   submit.model, node, address, attempt))
        got = F.encode_dispatch(submit.request_id, mode, tail, node, address, attempt)
        assert got == want
        assert F.decode(got) == F.decode(want)


def test_a_submit_laid_out_another_way_is_not_spliced():
    from tandem.wire import messages as M

    submit = next(m for m in all_messages() if isinstance(m, M.Submit))
    body = msgpack.unpackb(codec.encode(submit)[0][P.PREFIX_LEN:])
    # The same values with a 16-bit array length: valid, decodes to the same message.
    head = codec.encode(submit)[0][:P.PREFIX_LEN] + b"\xdc\x00\x06" + b"".join(msgpack.packb(v, use_bin_type=True) for v in body)
    assert F.decode(head) == submit
    assert F.submit_tail(head, submit.stream) is None
