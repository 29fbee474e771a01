"""Messages <-> ZeroMQ frames. msgpack only; arrays ride as separate zero-copy frames.

Layout of one message: ``[header, *payload]`` where ``header = b"TD" + version + type +
msgpack(fields as an array)``. A ROUTER sees ``[identity, header, *payload]`` (peers are
DEALERs and send no empty delimiter); use :func:`split_route` / :func:`route`. A token
stream message is ``[request_id (topic), header]``; a batch of them ``[topic, header]``
with the topic a worker's P.STREAM_BATCH_TOPIC or a client's stream topic.

:func:`decode` and :func:`decode_tokens` take frames from the network and raise only
:class:`WireError`: every frame count, size, type and bound is checked before anything
is built from it, and msgpack is capped so a small frame cannot make a large allocation.
"""

from __future__ import annotations

from typing import Sequence

import msgpack
import zmq

from tandem.wire import protocol as P
from tandem.wire.errors import WireError
from tandem.wire.messages import REGISTRY, KVChunk, Message, TokenBatch, TokenMessage

# Below this, copying into a zmq message is cheaper than pinning the Python buffer.
ZERO_COPY_THRESHOLD = 64 * 1024

_PACKER_OPTS = dict(use_bin_type=True)


def _unpack_opts(limit: int) -> dict:
    return dict(
        raw=False,
        use_list=True,
        strict_map_key=True,
        max_str_len=limit,
        max_bin_len=limit,
        max_array_len=P.MAX_PROMPT_TOKENS + P.MAX_NEW_TOKENS,
        max_map_len=1 << 16,
        max_ext_len=0,  # no ext types on this protocol
    )


_UNPACK = _unpack_opts(P.MAX_HEADER_BYTES)


def as_buffer(frame) -> memoryview:
    """A read-only view of a frame (bytes, bytearray, memoryview or zmq.Frame)."""
    try:
        view = memoryview(frame)
    except TypeError:
        raise WireError(f"a frame must be a bytes-like object, got {type(frame).__name__}") from None
    if view.ndim != 1 or view.itemsize != 1:
        view = view.cast("B")
    return view


def pack_header(msg: Message) -> bytes:
    body = [spec.pack(getattr(msg, name)) for name, spec in msg.SPECS]
    return P.header_prefix(msg.TYPE) + msgpack.packb(body, **_PACKER_OPTS)


def encode(msg: Message) -> list:
    """``[header, *payload]``. Payload buffers are passed through, not copied."""
    head = pack_header(msg)
    if isinstance(msg, KVChunk):
        return [head, *msg.frames]
    return [head]


def peek_type(frame) -> P.MsgType:
    """The message type of a header frame, checking magic and version only."""
    head = as_buffer(frame)
    if len(head) < P.PREFIX_LEN or head[:2] != P.MAGIC:
        raise WireError("not a tandem frame (bad magic)", "magic")
    if head[2] != P.PROTOCOL_VERSION:
        raise WireError(
            f"peer speaks tandem protocol v{head[2]}, this process speaks v{P.PROTOCOL_VERSION}: "
            "run the same tandem version on every node",
            "version",
        )
    try:
        return P.MsgType(head[3])
    except ValueError:
        raise WireError(f"unknown message type {head[3]}", "type") from None


def decode(frames: Sequence) -> Message:
    """Frames ``[header, *payload]`` -> a message dataclass, or :class:`WireError`."""
    if not 1 <= len(frames) <= P.MAX_FRAMES:
        raise WireError(f"{len(frames)} frames; a message has 1 to {P.MAX_FRAMES}", "frames")
    msg_type = peek_type(frames[0])
    cls = REGISTRY.get(msg_type)
    if cls is None or cls is TokenMessage or cls is TokenBatch:
        raise WireError(f"message type {msg_type.name} does not travel as a plain message", "type")
    msg = _decode_body(cls, as_buffer(frames[0]))
    payload = frames[1:]
    if cls is KVChunk:
        msg.frames = [as_buffer(f) for f in payload]
        for view in msg.frames:
            if len(view) > P.MAX_FRAME_BYTES:
                raise WireError(f"payload frame of {len(view)} bytes exceeds {P.MAX_FRAME_BYTES}", "size")
    elif payload:
        raise WireError(f"{msg_type.name} carries no payload frames, got {len(payload)}", "frames")
    return msg


def _decode_body(cls, head: memoryview) -> Message:
    if len(head) > P.MAX_HEADER_BYTES:
        raise WireError(f"header of {len(head)} bytes exceeds {P.MAX_HEADER_BYTES}", "size")
    try:
        body = msgpack.unpackb(head[P.PREFIX_LEN:], **_UNPACK)
    except Exception as exc:  # msgpack raises several unrelated types on garbage
        raise WireError(f"{cls.__name__}: undecodable msgpack ({type(exc).__name__})") from None
    if type(body) is not list or len(body) != len(cls.SPECS):
        raise WireError(f"{cls.__name__}: expected an array of {len(cls.SPECS)} fields")
    kwargs = {name: spec.unpack(value, f"{cls.__name__}.{name}") for (name, spec), value in zip(cls.SPECS, body)}
    return cls(**kwargs)


def encode_tokens(msg: TokenMessage) -> list:
    """``[topic, header]`` for a PUB socket; the topic is the 16-byte request id."""
    if len(msg.request_id) != P.REQUEST_ID_BYTES:
        raise ValueError(f"request_id must be {P.REQUEST_ID_BYTES} bytes")
    return [bytes(msg.request_id), pack_header(msg)]


def decode_tokens(frames: Sequence) -> TokenMessage:
    if len(frames) != 2:
        raise WireError(f"a token stream message has 2 frames, got {len(frames)}", "frames")
    topic = bytes(as_buffer(frames[0]))
    if len(topic) != P.REQUEST_ID_BYTES:
        raise WireError(f"topic must be a {P.REQUEST_ID_BYTES}-byte request id, got {len(topic)} bytes")
    if peek_type(frames[1]) != P.MsgType.TOKENS:
        raise WireError("token stream frame is not a TOKENS message", "type")
    msg = _decode_body(TokenMessage, as_buffer(frames[1]))
    msg.request_id = topic
    if msg.logprobs is not None and len(msg.logprobs) != len(msg.tokens):
        raise WireError("logprobs must have one entry per token")
    return msg


_pack_entry = msgpack.Packer(use_bin_type=True).pack
_BATCH_PREFIX = P.header_prefix(P.MsgType.TOKEN_BATCH) + b"\x91"  # the header's array of one field: the entries
# What one batch may hold: the decoder's bounds, with room for the array headers.
_BATCH_BYTES = P.MAX_HEADER_BYTES - 64


def stream_entry(attempt: int, msg: TokenMessage) -> bytes:
    """One request's entry of a TOKEN_BATCH, packed (:func:`batch_headers` joins them)."""
    return _pack_entry([msg.request_id, attempt, *msg.pack_fields(msg)])


def _array_header(n: int) -> bytes:
    if n < 16:
        return bytes((0x90 | n,))
    if n < 1 << 16:
        return b"\xdc" + n.to_bytes(2, "big")
    return b"\xdd" + n.to_bytes(4, "big")


def batch_headers(entries: list[bytes]) -> list[bytes]:
    """TOKEN_BATCH header frames holding ``entries`` (packed by :func:`stream_entry`), in
    order, each within the decoder's entry count and header size bounds. A msgpack array
    is its header followed by its items' encodings, so entries are joined, not re-encoded."""
    out, start, size = [], 0, 0
    for i, e in enumerate(entries):
        if i - start == P.MAX_STREAM_ENTRIES or (size + len(e) > _BATCH_BYTES and i > start):
            out.append(_BATCH_PREFIX + _array_header(i - start) + b"".join(entries[start:i]))
            start, size = i, 0
        size += len(e)
    if start < len(entries):
        out.append(_BATCH_PREFIX + _array_header(len(entries) - start) + b"".join(entries[start:]))
    return out


def decode_batch(frames: Sequence) -> list[tuple[int, TokenMessage]]:
    """``[topic, header]`` of a TOKEN_BATCH -> its ``(attempt, TokenMessage)`` entries."""
    if len(frames) != 2:
        raise WireError(f"a token batch has 2 frames, got {len(frames)}", "frames")
    topic = as_buffer(frames[0])
    if len(topic) not in (P.CLIENT_STREAM_BYTES, len(P.STREAM_BATCH_TOPIC)):
        raise WireError(f"a token batch's topic has {P.CLIENT_STREAM_BYTES} bytes, got {len(topic)}")
    if peek_type(frames[1]) != P.MsgType.TOKEN_BATCH:
        raise WireError("token batch frame is not a TOKEN_BATCH message", "type")
    return _decode_body(TokenBatch, as_buffer(frames[1])).entries


def split_route(frames: Sequence) -> tuple[bytes, list]:
    """ROUTER input ``[identity, header, *payload]`` -> ``(identity, [header, *payload])``."""
    if len(frames) < 2:
        raise WireError("ROUTER message without identity and header", "frames")
    return bytes(as_buffer(frames[0])), list(frames[1:])


def route(identity: bytes, frames: list) -> list:
    return [identity, *frames]


def send(sock: zmq.Socket, frames: list, *, track: bool = False, flags: int = 0) -> zmq.MessageTracker | None:
    """Send a multipart message; frames of ZERO_COPY_THRESHOLD bytes or more go zero-copy.

    With ``track=True`` the returned tracker covers only those large frames: wait on it
    (``tracker.wait()``) before mutating their buffers. Small frames are copied.
    """
    trackers = []
    last = len(frames) - 1
    for i, frame in enumerate(frames):
        more = zmq.SNDMORE if i < last else 0
        large = len(as_buffer(frame)) >= ZERO_COPY_THRESHOLD
        result = sock.send(frame, flags | more, copy=not large, track=track and large)
        if track and large:
            trackers.append(result)
    return zmq.MessageTracker(*trackers) if trackers else None


def recv_frames(sock: zmq.Socket, *, copy: bool = True, flags: int = 0, max_frames: int = P.MAX_FRAMES + 1) -> list:
    """Receive one multipart message, refusing (and draining) one with too many frames.

    ``max_frames`` counts a ROUTER's identity frame. libzmq bounds frame sizes
    (``MAXMSGSIZE``, set by the socket factory) but not frame counts, so count here.
    """
    frame = sock.recv(flags, copy=copy)
    frames = [frame]
    # A zmq.Frame knows whether more parts follow; asking the socket costs ~3 us a part.
    more = frame.more if not copy else sock.getsockopt(zmq.RCVMORE)
    while more:
        if len(frames) >= max_frames:
            while sock.getsockopt(zmq.RCVMORE):
                sock.recv(copy=False)
            raise WireError(f"message with more than {max_frames} frames", "frames")
        frame = sock.recv(copy=copy)
        frames.append(frame)
        more = frame.more if not copy else sock.getsockopt(zmq.RCVMORE)
    return frames
