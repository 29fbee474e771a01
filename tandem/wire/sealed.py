"""AES-256-GCM sealed messages for one direction pair of one connection.

A sealed message is ``[head, ct_0, ..., ct_{n-1}]``: ``head = b"TD" + version + SEALED +
counter (u64 BE) + n (u16 BE)``; ``ct_i = AES-256-GCM(key, nonce = 0^4 || u64(counter + i),
frame_i, aad = head || u16(i))``. The counter starts at 0 per direction and advances by
the frames sealed, so each nonce is used once per key. The receiver insists on exactly
the next counter (ZeroMQ keeps one connection's messages in order), which rejects a
replayed or reordered message; ``n`` and each frame's index in the associated data
reject dropped, added or swapped frames; the GCM tag rejects any altered byte.

After any rejection the channel is *broken*: every later message is refused too, and
the owner must drop the connection (a fresh handshake gives fresh keys).
"""

from __future__ import annotations

import logging
import struct
from collections import Counter

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from tandem.wire import protocol as P
from tandem.wire.codec import as_buffer
from tandem.wire.errors import AuthError, WireError

log = logging.getLogger(__name__)

TAG_BYTES = 16
_HEAD = struct.Struct(">QH")
_HEAD_LEN = P.PREFIX_LEN + _HEAD.size
_INDEX = struct.Struct(">H")
_MAX_COUNTER = (1 << 64) - 1 - (1 << 16)

# Rejections by reason across every channel of this process (exported by stats).
REJECTED: Counter = Counter()


class SealedChannel:
    def __init__(self, send_key: bytes, recv_key: bytes):
        self._send = AESGCM(send_key)
        self._recv = AESGCM(recv_key)
        self._send_counter = 0
        self._recv_counter = 0
        self.broken: str | None = None
        self.bytes_sealed = 0
        self.bytes_opened = 0

    def seal(self, frames: list) -> list:
        if not 1 <= len(frames) <= P.MAX_FRAMES:
            raise ValueError(f"can seal 1 to {P.MAX_FRAMES} frames, got {len(frames)}")
        counter = self._send_counter
        if counter > _MAX_COUNTER:
            raise WireError("sealed channel exhausted its nonces; reconnect", "exhausted")
        head = P.header_prefix(P.MsgType.SEALED) + _HEAD.pack(counter, len(frames))
        out = [head]
        for i, frame in enumerate(frames):
            data = as_buffer(frame)
            self.bytes_sealed += len(data)
            out.append(self._send.encrypt(_nonce(counter + i), data, head + _INDEX.pack(i)))
        self._send_counter = counter + len(frames)
        return out

    def open(self, frames) -> list[bytes]:
        """The plaintext frames of a sealed message, or AuthError (and the channel breaks)."""
        if self.broken:
            raise AuthError(f"sealed channel already rejected a frame ({self.broken}); reconnect", "broken")
        try:
            return self._open(frames)
        except WireError as exc:
            self.broken = exc.reason
            REJECTED[exc.reason] += 1
            log.warning("rejected sealed message (%s): %s", exc.reason, exc)
            raise

    def _open(self, frames) -> list[bytes]:
        if not 2 <= len(frames) <= P.MAX_FRAMES + 1:
            raise AuthError(f"sealed message with {len(frames)} frames", "frames")
        head = bytes(as_buffer(frames[0]))
        if len(head) != _HEAD_LEN or head[: P.PREFIX_LEN] != P.header_prefix(P.MsgType.SEALED):
            raise AuthError("not a sealed message header", "header")
        counter, n = _HEAD.unpack_from(head, P.PREFIX_LEN)
        if n != len(frames) - 1:
            raise AuthError(f"sealed message says {n} frames, carries {len(frames) - 1}", "truncated")
        if counter != self._recv_counter:
            reason = "replay" if counter < self._recv_counter else "reorder"
            raise AuthError(f"sealed counter {counter}, expected {self._recv_counter}", reason)
        out = []
        for i in range(n):
            ct = as_buffer(frames[i + 1])
            if len(ct) < TAG_BYTES or len(ct) > P.MAX_FRAME_BYTES + TAG_BYTES:
                raise AuthError(f"sealed frame of {len(ct)} bytes", "size")
            try:
                out.append(self._recv.decrypt(_nonce(counter + i), ct, head + _INDEX.pack(i)))
            except InvalidTag:
                raise AuthError("sealed frame failed authentication (altered or wrong key)", "altered") from None
        self._recv_counter = counter + n
        self.bytes_opened += sum(len(f) for f in out)
        return out


def _nonce(counter: int) -> bytes:
    return b"\0\0\0\0" + counter.to_bytes(8, "big")
