"""AES-256-GCM sealed messages for one direction pair of one connection.

A message of frames ``f_0 .. f_{n-1}`` is sealed as ``n`` records ``[head_i, ct_i]``:
``head_i = b"TD" + version + SEALED + base (u64 BE) + n (u16 BE)
+ i (u16 BE)`` and ``ct_i = AES-256-GCM(key, nonce = 0^4 || u64(base + i), f_i, aad =
head_i)``. ``base`` starts at 0 per direction and advances by ``n`` per message, so each
nonce is used once per key. Records travel either all in one ZeroMQ message
(:meth:`SealedChannel.seal`, for small messages) or one ZeroMQ message per record
(:meth:`SealedChannel.seal_records`, for bulk KV): then the sender seals frame ``i + 1``
while ZeroMQ already transmits frame ``i``, and the receiver opens frame ``i`` while the
rest is in flight, so a large KV message costs max(cipher, network), not their sum.

The receiver insists on exactly the next ``base`` and index (ZeroMQ keeps one
connection's messages in order), which rejects replayed, reordered, dropped or
duplicated records; the GCM tag over ``head_i`` rejects any altered byte. After any
rejection the channel is *broken*: every later record is refused too, and the owner
must drop the connection (a fresh handshake gives fresh keys).
"""

from __future__ import annotations

import logging
import struct
from collections import Counter
from typing import Iterator

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from tandem.wire import protocol as P
from tandem.wire.codec import as_buffer
from tandem.wire.errors import AuthError, WireError

log = logging.getLogger(__name__)

TAG_BYTES = 16
IN_PLACE_MIN_BYTES = 64 * 1024  # below these, allocation is cheap and one-shot AEAD is faster
ARENA_MIN_BYTES = 64 * 1024
_HEAD = struct.Struct(">QHH")
_HEAD_LEN = P.PREFIX_LEN + _HEAD.size
_MAX_COUNTER = (1 << 64) - 1 - (1 << 16)

# Rejections by reason across every channel of this process (exported by stats).
REJECTED: Counter = Counter()


class SealedChannel:
    def __init__(self, send_key: bytes, recv_key: bytes):
        self._send_key, self._recv_key = send_key, recv_key
        self._send = AESGCM(send_key)
        self._recv = AESGCM(recv_key)
        self._send_counter = 0
        self._recv_counter = 0
        self._partial: list = []
        self._partial_n = 0
        self.broken: str | None = None
        self.bytes_sealed = 0
        self.bytes_opened = 0

    def seal(self, frames: list) -> list:
        """All records of one message as one ZeroMQ multipart message."""
        return [part for record in self.seal_records(frames) for part in record]

    def seal_records(self, frames: list, alloc=None) -> Iterator[list]:
        """Yield the records of one message, one ZeroMQ message each, sealing each only
        when the previous one has been taken (so sending overlaps sealing).

        ``alloc(nbytes)`` may return a writable buffer to encrypt a large frame into (a
        reused arena: fresh multi-MB allocations cost a page fault per 4 KiB, which was
        most of the sealing time here), or None for a new ``bytes``."""
        n = len(frames)
        if not 1 <= n <= P.MAX_FRAMES:
            raise ValueError(f"can seal 1 to {P.MAX_FRAMES} frames, got {n}")
        base = self._send_counter
        if base > _MAX_COUNTER:
            raise WireError("sealed channel exhausted its nonces; reconnect", "exhausted")
        self._send_counter = base + n  # reserved now: a half-consumed generator never reuses nonces
        prefix = P.header_prefix(P.MsgType.SEALED)
        return self._records(prefix, base, frames, alloc)

    def _records(self, prefix: bytes, base: int, frames: list, alloc) -> Iterator[list]:
        n = len(frames)
        for i, frame in enumerate(frames):
            head = prefix + _HEAD.pack(base, n, i)
            data = as_buffer(frame)
            self.bytes_sealed += len(data)
            out = alloc(len(data) + TAG_BYTES) if alloc is not None and len(data) >= ARENA_MIN_BYTES else None
            if out is None:
                yield [head, self._send.encrypt(_nonce(base + i), data, head)]
                continue
            enc = Cipher(algorithms.AES(self._send_key), modes.GCM(_nonce(base + i))).encryptor()
            enc.authenticate_additional_data(head)
            enc.update_into(data, out)
            enc.finalize()
            out[len(data) :] = enc.tag
            yield [head, out]

    def open(self, frames) -> list | None:
        """Open the records in one ZeroMQ message. Returns the plaintext frames once a
        message's last record has arrived, None before that; AuthError (and the channel
        breaks) on anything out of place. Large frames received as writable buffers
        (``recv(copy=False)``) are decrypted in place and returned as memoryviews of them."""
        if self.broken:
            raise AuthError(f"sealed channel already rejected a frame ({self.broken}); reconnect", "broken")
        try:
            if not 2 <= len(frames) <= 2 * P.MAX_FRAMES or len(frames) % 2:
                raise AuthError(f"sealed message with {len(frames)} frames", "frames")
            result = None
            for j in range(0, len(frames), 2):
                if result is not None:
                    raise AuthError("records after the end of a sealed message", "frames")
                result = self._open(frames[j], frames[j + 1])
            return result
        except WireError as exc:
            self.broken = exc.reason
            self._partial = []
            REJECTED[exc.reason] += 1
            log.warning("rejected sealed record (%s): %s", exc.reason, exc)
            raise

    def _open(self, head, ct) -> list[bytes] | None:
        head = bytes(as_buffer(head))
        if len(head) != _HEAD_LEN or head[: P.PREFIX_LEN] != P.header_prefix(P.MsgType.SEALED):
            raise AuthError("not a sealed record header", "header")
        base, n, i = _HEAD.unpack_from(head, P.PREFIX_LEN)
        if self._partial and i == 0:
            raise AuthError(f"a new message began after record {len(self._partial)} of {self._partial_n}", "truncated")
        if base != self._recv_counter:
            reason = "replay" if base < self._recv_counter else "reorder"
            raise AuthError(f"sealed counter {base}, expected {self._recv_counter}", reason)
        if i != len(self._partial) or not 1 <= n <= P.MAX_FRAMES or (self._partial and n != self._partial_n):
            raise AuthError(f"sealed record {i} of {n}, expected record {len(self._partial)}", "reorder")
        ct = as_buffer(ct)
        if len(ct) < TAG_BYTES or len(ct) > P.MAX_FRAME_BYTES + TAG_BYTES:
            raise AuthError(f"sealed frame of {len(ct)} bytes", "size")
        try:
            if len(ct) >= IN_PLACE_MIN_BYTES and not ct.readonly:
                # Decrypt into the received buffer itself: no second multi-MB allocation.
                dec = Cipher(algorithms.AES(self._recv_key), modes.GCM(_nonce(base + i), bytes(ct[-TAG_BYTES:]))).decryptor()
                dec.authenticate_additional_data(head)
                dec.update_into(ct[:-TAG_BYTES], ct)
                dec.finalize()
                frame = ct[:-TAG_BYTES]
            else:
                frame = self._recv.decrypt(_nonce(base + i), ct, head)
        except InvalidTag:
            raise AuthError("sealed frame failed authentication (altered or wrong key)", "altered") from None
        self._partial.append(frame)
        self._partial_n = n
        if len(self._partial) < n:
            return None
        out, self._partial = self._partial, []
        self._recv_counter = base + n
        self.bytes_opened += sum(len(f) for f in out)
        return out


def _nonce(counter: int) -> bytes:
    return b"\0\0\0\0" + counter.to_bytes(8, "big")
