"""AES-256-GCM sealed messages for one direction pair of one connection.

A message of frames ``f_0 .. f_{n-1}`` is sealed as records ``[head, ct]``, each covering
the consecutive frames ``i .. i + k - 1`` (``k >= 1``):

- one frame (``k = 1``): ``head = b"TD" + version + SEALED + base (u64 BE) + n (u16 BE)
  + i (u16 BE)``;
- a group (``k >= 2``, added for bulk KV: see below): ``head = b"TD" + version + SEALED
  + base (u64) + n (u16) + i (u16) + k (u16) + len(f_i) .. len(f_{i+k-1}) (u32 each)``;
- a piece (``k = 0``, added for frames larger than a record): ``head = b"TD" + version +
  SEALED + base (u64) + n (u16) + i (u16) + 0 (u16) + len(f_i) (u32) + offset (u32)``,
  the ``p``-th consecutive slice of frame ``i``, under nonce ``u32(p) || u64(base + i)``;

and ``ct = AES-256-GCM(key, nonce = 0^4 || u64(base + i), f_i || .. || f_{i+k-1}, aad =
head)``. ``base`` starts at 0 per direction and advances by ``n`` per message, and the
records of a message cover disjoint frame ranges, so each nonce is used once per key.
Records travel either all in one ZeroMQ message (:meth:`SealedChannel.seal`, for small
messages) or one ZeroMQ message per record (:meth:`SealedChannel.seal_records`, for bulk
KV): then the sender seals record ``j + 1`` while ZeroMQ already transmits record ``j``,
and the receiver opens record ``j`` while the rest is in flight, so a large KV message
costs max(cipher, network), not their sum. Grouping frames into records of about
``group_bytes`` (a KV layer's K or V of a short prompt is 0.75-2 MB) divides the fixed
costs per record (a ZeroMQ message, a zero-copy release, wake-ups on each side) by the
group size; :func:`record_target` keeps a message's first and last records small, since
their cipher work is what nothing overlaps. The receiver splits a group back into views
of one buffer, still zero-copy, and decrypts the pieces of a frame straight into one
buffer for it (so a frame arrives contiguous, and each received piece is freed at once).

The receiver insists on exactly the next ``base`` and frame index (ZeroMQ keeps one
connection's messages in order), which rejects replayed, reordered, dropped or
duplicated records; the GCM tag over ``head`` rejects any altered byte, the frame
lengths of a group included. After any rejection the channel is *broken*: every later
record is refused too, and the owner must drop the connection (a fresh handshake gives
fresh keys).
"""

from __future__ import annotations

import logging
import struct
from collections import Counter
from typing import Iterator

import numpy as np
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from tandem.wire import protocol as P
from tandem.wire.codec import as_buffer
from tandem.wire.errors import AuthError, WireError

log = logging.getLogger(__name__)

TAG_BYTES = 16
OUT_OF_PLACE_MIN_BYTES = 64 * 1024  # below these, one-shot AEAD returning new bytes is faster
ARENA_MIN_BYTES = 64 * 1024
_HEAD = struct.Struct(">QHH")
_HEAD_LEN = P.PREFIX_LEN + _HEAD.size
_GROUP_HEAD = struct.Struct(">QHHH")  # base, n, i, k; then k frame lengths (u32)
_GROUP_HEAD_LEN = P.PREFIX_LEN + _GROUP_HEAD.size
MAX_GROUP = 256  # frames per record
_PIECE = struct.Struct(">II")  # a piece (k = 0): the whole frame's length, this piece's offset in it
_PIECE_HEAD_LEN = _GROUP_HEAD_LEN + _PIECE.size
_PREFIX = P.header_prefix(P.MsgType.SEALED)
_MAX_COUNTER = (1 << 64) - 1 - (1 << 16)

# Rejections by reason across every channel of this process (exported by stats).
REJECTED: Counter = Counter()


class SealedChannel:
    def __init__(self, send_key: bytes, recv_key: bytes):
        self._send_key = send_key  # grouped records encrypt several buffers in one GCM pass
        self._send = AESGCM(send_key)
        self._recv = AESGCM(recv_key)
        self._send_counter = 0
        self._recv_counter = 0
        self._partial: list = []
        self._partial_n = 0
        self._piece: _Piece | None = None  # the frame whose pieces are arriving
        self.broken: str | None = None
        self.bytes_sealed = 0
        self.bytes_opened = 0

    def seal(self, frames: list, group_bytes: int = 0) -> list:
        """All records of one message as one ZeroMQ multipart message."""
        return [part for record in self.seal_records(frames, group_bytes=group_bytes) for part in record]

    def seal_records(self, frames: list, alloc=None, group_bytes: int = 0) -> Iterator[list]:
        """Yield the records of one message, one ZeroMQ message each, sealing each only
        when the previous one has been taken (so sending overlaps sealing).

        ``alloc(nbytes)`` may return a writable buffer to encrypt a large record into (a
        reused arena: fresh multi-MB allocations cost a page fault per 4 KiB, which was
        most of the sealing time here), or None for a new buffer. ``group_bytes > 0``
        puts consecutive frames smaller than it into one record until the record holds at
        least :func:`record_target` bytes (``group_bytes`` in the middle of a large
        message, so a record stays under twice that); 0 seals each frame alone."""
        n = len(frames)
        if not 1 <= n <= P.MAX_FRAMES:
            raise ValueError(f"can seal 1 to {P.MAX_FRAMES} frames, got {n}")
        base = self._send_counter
        if base > _MAX_COUNTER:
            raise WireError("sealed channel exhausted its nonces; reconnect", "exhausted")
        self._send_counter = base + n  # reserved now: a half-consumed generator never reuses nonces
        return self._records(base, [as_buffer(f) for f in frames], alloc, group_bytes)

    def _records(self, base: int, views: list, alloc, group_bytes: int) -> Iterator[list]:
        n = len(views)
        sizes = [len(v) for v in views]
        done, rest = 0, sum(sizes)  # bytes of this message sealed so far, and still to seal
        i = 0
        while i < n:
            k, total = 1, sizes[i]
            if group_bytes:
                target = record_target(group_bytes, done, rest)
                if total > target + target // 2:  # a frame well over a record: pieces of it
                    for record in self._pieces(base, n, i, views[i], alloc, group_bytes, done, rest):
                        yield record
                    done, rest = done + total, rest - total
                    i += 1
                    continue
                while i + k < n and k < MAX_GROUP and total < target and sizes[i + k] < group_bytes:
                    total += sizes[i + k]
                    k += 1
            done, rest = done + total, rest - total
            self.bytes_sealed += total
            nonce = _nonce(base + i)
            out = alloc(total + TAG_BYTES) if alloc is not None and total >= ARENA_MIN_BYTES else None
            if k == 1:
                head = _PREFIX + _HEAD.pack(base, n, i)
                yield [head, self._encrypt(nonce, views[i], head, out)]
            else:
                head = _PREFIX + _GROUP_HEAD.pack(base, n, i, k) + struct.pack(f">{k}I", *sizes[i : i + k])
                buf = out if out is not None else bytearray(total + TAG_BYTES)
                out = memoryview(buf)
                enc = Cipher(algorithms.AES(self._send_key), modes.GCM(nonce)).encryptor()
                enc.authenticate_additional_data(head)
                pos = 0
                for view in views[i : i + k]:
                    enc.update_into(view, out[pos:])  # GCM writes exactly len(view); the slack is for the API
                    pos += len(view)
                enc.finalize()
                out[total:] = enc.tag
                yield [head, buf]
            i += k

    def _pieces(self, base: int, n: int, i: int, view, alloc, group_bytes: int, done: int, rest: int) -> Iterator[list]:
        """Frame ``i`` as consecutive pieces of about record_target bytes each (piece
        ``p`` under nonce ``u32(p) || u64(base + i)``: piece 0 takes the nonce the whole
        frame would have had, the others a nonce no other record can have)."""
        size = len(view)
        offset = p = 0
        while offset < size:
            m = min(size - offset, max(1, record_target(group_bytes, done + offset, rest - offset)))
            if size - offset - m < m // 4:  # no sliver of a last piece (never the first: size > 1.5 m)
                m = size - offset
            head = _PREFIX + _GROUP_HEAD.pack(base, n, i, 0) + _PIECE.pack(size, offset)
            out = alloc(m + TAG_BYTES) if alloc is not None and m >= ARENA_MIN_BYTES else None
            self.bytes_sealed += m
            yield [head, self._encrypt(_nonce(base + i, p), view[offset : offset + m], head, out)]
            offset += m
            p += 1

    def _encrypt(self, nonce: bytes, data, head: bytes, out):
        if out is None:
            return self._send.encrypt(nonce, data, head)
        self._send.encrypt_into(nonce, data, head, out)  # one call: no per-record cipher context
        return out

    def open(self, frames) -> list | None:
        """Open the records in one ZeroMQ message. Returns the plaintext frames once a
        message's last record has arrived, None before that; AuthError (and the channel
        breaks) on anything out of place. Large records are decrypted into buffers of their
        own and returned as memoryviews of them (of one buffer per group)."""
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
            self._partial, self._piece = [], None
            REJECTED[exc.reason] += 1
            log.warning("rejected sealed record (%s): %s", exc.reason, exc)
            raise

    def _open(self, head, ct) -> list | None:
        head = bytes(as_buffer(head))
        if head[: P.PREFIX_LEN] != _PREFIX:
            raise AuthError("not a sealed record header", "header")
        lengths = piece = None
        if len(head) == _HEAD_LEN:
            base, n, i = _HEAD.unpack_from(head, P.PREFIX_LEN)
            k = 1
        elif len(head) > _GROUP_HEAD_LEN:
            base, n, i, k = _GROUP_HEAD.unpack_from(head, P.PREFIX_LEN)
            if k == 0 and len(head) == _PIECE_HEAD_LEN:
                piece = _PIECE.unpack_from(head, _GROUP_HEAD_LEN)  # (frame length, offset)
                k = 1
            elif not 2 <= k <= MAX_GROUP or len(head) != _GROUP_HEAD_LEN + 4 * k:
                raise AuthError(f"sealed group header of {len(head)} bytes for {k} frames", "header")
            else:
                lengths = struct.unpack_from(f">{k}I", head, _GROUP_HEAD_LEN)
        else:
            raise AuthError("not a sealed record header", "header")
        if self._partial and i == 0 and self._piece is None:
            raise AuthError(f"a new message began after record {len(self._partial)} of {self._partial_n}", "truncated")
        if base != self._recv_counter:
            reason = "replay" if base < self._recv_counter else "reorder"
            raise AuthError(f"sealed counter {base}, expected {self._recv_counter}", reason)
        if i != len(self._partial) or not 1 <= n <= P.MAX_FRAMES or i + k > n or ((self._partial or self._piece) and n != self._partial_n):
            raise AuthError(f"sealed record of frames {i}..{i + k - 1} of {n}, expected frame {len(self._partial)}", "reorder")
        ct = as_buffer(ct)
        if len(ct) < TAG_BYTES or len(ct) > P.MAX_FRAME_BYTES + TAG_BYTES:
            raise AuthError(f"sealed frame of {len(ct)} bytes", "size")
        if lengths is not None and sum(lengths) != len(ct) - TAG_BYTES:
            raise AuthError(f"sealed group of {len(ct) - TAG_BYTES} bytes, its header says {sum(lengths)}", "size")
        if piece is not None or self._piece is not None:
            return self._open_piece(base, n, i, piece, head, ct)
        try:
            if len(ct) >= OUT_OF_PLACE_MIN_BYTES:
                # Into a buffer of its own, not in place: the received one is then freed as
                # soon as the caller drops it, and libzmq's next records land in that same
                # cache-hot memory (decrypting in place, every record was received into memory
                # that had dropped out of the cache). Interleaved A/B runs of 1k-token caches
                # measured 3-9% less CPU per GB, both processes together, in four of five; the
                # bench's --baseline comparison puts it within noise (docs/benchmarks/kv_transfer.md).
                plain = memoryview(np.empty(len(ct) - TAG_BYTES, dtype=np.uint8))
                self._recv.decrypt_into(_nonce(base + i), ct, head, plain)
            else:
                plain = self._recv.decrypt(_nonce(base + i), ct, head)
        except InvalidTag:
            raise AuthError("sealed frame failed authentication (altered or wrong key)", "altered") from None
        if lengths is None:
            self._partial.append(plain)
        else:
            pos = 0
            for size in lengths:  # views of one buffer (slices of small bytes copy, cheaply)
                self._partial.append(plain[pos : pos + size])
                pos += size
        return self._frames_done(base, n)

    def _open_piece(self, base: int, n: int, i: int, piece, head: bytes, ct) -> list | None:
        """A piece of frame ``i``, decrypted straight into that frame's buffer (so the
        received one can be reused at once). The pieces of a frame must come in order,
        back to back, each at the offset where the last one ended, all naming the same
        frame length; any other record in between is out of place."""
        if piece is None:
            raise AuthError(f"a whole record arrived inside frame {i}, whose pieces were arriving", "reorder")
        size, offset = piece
        m = len(ct) - TAG_BYTES
        state = self._piece
        if state is None:
            if offset != 0:
                raise AuthError(f"frame {i} began with the piece at {offset}", "reorder")
            if not 0 < m < size or size > P.MAX_FRAME_BYTES:
                raise AuthError(f"first piece of {m} bytes of a {size}-byte frame", "header")
            state = self._piece = _Piece(np.empty(size, dtype=np.uint8))
        elif size != len(state.buf) or offset != state.offset or m == 0 or offset + m > size:
            raise AuthError(f"piece of {m} bytes at {offset} of a {size}-byte frame, expected one at {state.offset} "
                            f"of {len(state.buf)}", "reorder")
        try:
            self._recv.decrypt_into(_nonce(base + i, state.count), ct, head, state.view[offset : offset + m])
        except InvalidTag:
            raise AuthError("sealed frame failed authentication (altered or wrong key)", "altered") from None
        state.offset += m
        state.count += 1
        if state.offset < size:
            self._partial_n = n
            return None
        self._piece = None
        self._partial.append(state.view)
        return self._frames_done(base, n)

    def _frames_done(self, base: int, n: int) -> list | None:
        self._partial_n = n
        if len(self._partial) < n:
            return None
        out, self._partial = self._partial, []
        self._recv_counter = base + n
        self.bytes_opened += sum(len(f) for f in out)
        return out


class _Piece:
    """A frame being received in pieces: its buffer and how far it is filled."""

    def __init__(self, buf: np.ndarray):
        self.buf = buf
        self.view = memoryview(buf)
        self.offset = 0
        self.count = 0


RAMP_MIN_BYTES = 1 << 20


def record_target(group_bytes: int, done: int, rest: int) -> int:
    """How many bytes the next record of a message should hold (it takes frames until it
    holds at least this), with ``done`` bytes of the message sealed and ``rest`` still to
    seal: ``group_bytes`` in the middle of a large message, less at both ends, where
    nothing overlaps the cipher (the first record is sealed before anything is sent, the
    last one opened after everything arrived). Records double from RAMP_MIN_BYTES up and
    halve towards the end; a message under RAMP_MIN_BYTES is one record."""
    return max(min(RAMP_MIN_BYTES, group_bytes), min(group_bytes, done, rest // 2))


def _nonce(counter: int, piece: int = 0) -> bytes:
    return piece.to_bytes(4, "big") + counter.to_bytes(8, "big")
