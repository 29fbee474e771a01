"""The broker's message codec: :mod:`tandem.wire.codec`'s checks on its hot path.

Every message the broker receives is untrusted and is checked in full, as
:func:`tandem.wire.codec.decode` checks it (magic, version, known type, header size,
msgpack limits, every field's type and bound), but through each message's compiled
``unpack_fields`` (:func:`tandem.wire.schema.compile_unpacker`) and without enum or
memoryview conversions: the broker decodes three messages per request, and at tens of
thousands of requests a second the generic path was a third of its CPU.
tests/broker/test_frames.py holds both decoders to the same verdict on fuzzed input.

The broker never receives payload frames (only KV_CHUNK has them, and it travels
between workers), so a message here is exactly one header frame.
"""

from __future__ import annotations

import msgpack

from tandem.wire import protocol as P
from tandem.wire.errors import WireError
from tandem.wire.messages import REGISTRY, KVChunk, TokenBatch, TokenMessage

_VERSION = P.PROTOCOL_VERSION
_MAGIC = P.MAGIC
_MAX_HEADER = P.MAX_HEADER_BYTES
_TOKENS = int(P.MsgType.TOKENS)
_BATCH = int(P.MsgType.TOKEN_BATCH)
_unpack_batch = TokenBatch.unpack_fields
# Type code -> (class, compiled unpacker) for what travels as a plain message.
_PLAIN = {int(t): (cls, cls.unpack_fields) for t, cls in REGISTRY.items() if cls not in (TokenMessage, TokenBatch)}
_PREFIX = {cls: P.header_prefix(t) for t, cls in REGISTRY.items()}
# The codec's msgpack limits. They are passed as literal keywords below (a **dict costs
# a quarter of a microsecond per call); str/bin lengths are left at unpackb's default,
# the buffer's length, which the header size check caps at _MAX_HEADER.
_MAX_ARRAY = P.MAX_PROMPT_TOKENS + P.MAX_NEW_TOKENS
_MAX_MAP = 1 << 16
_unpackb = msgpack.unpackb
assert P.PREFIX_LEN == 4  # the slices below
# One packer, reused (packb builds one per call). Its pack() runs start to end under the
# GIL (no callbacks: no default hook), so brokers in several threads may share it.
_pack = msgpack.Packer(use_bin_type=True).pack


def _check_prefix(head: bytes) -> int:
    if len(head) < P.PREFIX_LEN or head[:2] != P.MAGIC:
        raise WireError("not a tandem frame (bad magic)", "magic")
    if head[2] != _VERSION:
        raise WireError(
            f"peer speaks tandem protocol v{head[2]}, this process speaks v{_VERSION}: "
            "run the same tandem version on every node",
            "version",
        )
    return head[3]


def decode(head: bytes):
    """One header frame (bytes) -> a message dataclass, or :class:`WireError`."""
    # The prefix check and body unpacking are inlined: this runs for three messages of
    # every request.
    if head[:2] != _MAGIC or len(head) < P.PREFIX_LEN or head[2] != _VERSION:
        _check_prefix(head)  # raises the precise error
    entry = _PLAIN.get(head[3])
    if entry is None:
        if head[3] in (_TOKENS, _BATCH):
            raise WireError(f"message type {P.MsgType(head[3]).name} does not travel as a plain message", "type")
        raise WireError(f"unknown message type {head[3]}", "type")
    cls, unpack = entry
    if len(head) > _MAX_HEADER:
        raise WireError(f"header of {len(head)} bytes exceeds {_MAX_HEADER}", "size")
    try:
        # (A bytes slice: cheaper than a memoryview for the small headers of the hot path.)
        body = _unpackb(head[4:], raw=False, strict_map_key=True, max_array_len=_MAX_ARRAY, max_map_len=_MAX_MAP,
                        max_ext_len=0)  # no ext types on this protocol
    except Exception as exc:  # msgpack raises several unrelated types on garbage
        raise WireError(f"{cls.__name__}: undecodable msgpack ({type(exc).__name__})") from None
    msg = unpack(body)
    if cls is KVChunk:
        msg.frames = []
    return msg


def decode_batch(head: bytes) -> tuple[list, list]:
    """A TOKEN_BATCH header frame -> (its entries as msgpack decoded them, the same entries
    as ``(attempt, TokenMessage)``): the first to forward without re-checking, the second
    to judge."""
    if head[:2] != _MAGIC or len(head) < P.PREFIX_LEN or head[2] != _VERSION:
        _check_prefix(head)  # raises the precise error
    if head[3] != _BATCH:
        raise WireError("token batch frame is not a TOKEN_BATCH message", "type")
    if len(head) > _MAX_HEADER:
        raise WireError(f"header of {len(head)} bytes exceeds {_MAX_HEADER}", "size")
    try:
        body = _unpackb(head[4:], raw=False, strict_map_key=True, max_array_len=_MAX_ARRAY, max_map_len=_MAX_MAP,
                        max_ext_len=0)
    except Exception as exc:  # msgpack raises several unrelated types on garbage
        raise WireError(f"TokenBatch: undecodable msgpack ({type(exc).__name__})") from None
    entries = _unpack_batch(body).entries  # (checks the body's shape first)
    return body[0], entries


def pack_entry(raw: list) -> bytes:
    """A decoded stream entry, packed again (:func:`tandem.wire.codec.batch_headers` joins them)."""
    return _pack(raw)


def encode(msg) -> bytes:
    """The header frame of a message without payload frames (what the broker sends)."""
    return _PREFIX[type(msg)] + _pack(msg.pack_fields(msg))


# DISPATCH carries SUBMIT's prompt, sampling, priority and model unchanged, in the same
# order: [id, mode, prompt, sampling, priority, model, node, address, attempt] against
# SUBMIT's [id, prompt, sampling, priority, model, stream]. So the broker sends those four values
# as the bytes it received and checked in full (decode() refuses trailing bytes), instead
# of re-encoding a prompt of up to 128k tokens on every dispatch.
_SUBMIT_LEAD = b"\x96\xc4\x10"  # fixarray of 6, bin8 of 16: the request id
_SUBMIT_TAIL_AT = P.PREFIX_LEN + len(_SUBMIT_LEAD) + P.REQUEST_ID_BYTES
_DISPATCH_LEAD = P.header_prefix(P.MsgType.DISPATCH) + b"\x99\xc4\x10"  # fixarray of 9, bin8 of 16


def submit_tail(head: bytes, stream: bytes | None) -> bytes | None:
    """The encoded prompt, sampling, priority and model of a SUBMIT header that
    :func:`decode` accepted (its ``stream`` given), or None if its array is not laid out
    the common way."""
    if head[P.PREFIX_LEN:_SUBMIT_TAIL_AT - P.REQUEST_ID_BYTES] != _SUBMIT_LEAD:
        return None
    last = _pack(stream)  # the last field, encoded the common way (or not: then None)
    if not head.endswith(last):
        return None
    return head[_SUBMIT_TAIL_AT:len(head) - len(last)]


def encode_dispatch(rid: bytes, mode: str, tail: bytes, node: str | None, address: str | None, attempt: int) -> bytes:
    """The DISPATCH header of a request whose SUBMIT gave ``tail`` (:func:`submit_tail`):
    byte for byte what :func:`encode` makes of the same Dispatch."""
    return _DISPATCH_LEAD + rid + _pack(mode) + tail + _pack(node) + _pack(address) + _pack(attempt)
