"""The cluster handshake: both ends prove they hold the secret, agree on fresh keys, and
the responder's accept / at-capacity verdict is authenticated.

Three messages (the initiator connects, the responder is bound)::

    HELLO      I -> R   [node_id_i, nonce_i]                          (32 random bytes)
    CHALLENGE  R -> I   [node_id_r, nonce_r, verdict, retry_after_s, mac_r]
    PROOF      I -> R   [mac_i]

``T = SHA-256("tandem-handshake" || HELLO frame || CHALLENGE frame without mac_r)``
covers the protocol version (in each frame's prefix), both node ids, both nonces and
the verdict. ``mac_r = HMAC-SHA256(K, "responder" || T)`` and ``mac_i = HMAC(K,
"initiator" || T)`` with ``K = HKDF(secret, info="tandem handshake mac v1")``: each side
proves possession of the secret over a transcript that includes a nonce it chose
itself, so no recorded handshake can be replayed to either side. Session keys are
``HKDF(secret, salt=nonce_i || nonce_r, info="tandem session v1" || T)`` split into an
initiator->responder and a responder->initiator AES-256 key.

These classes are socket-agnostic: they turn frames into frames. Any failure raises
:class:`AuthError` (or :class:`WireError` for malformed input) and the caller drops
the connection; :class:`PeerAtCapacity` is the authenticated "come back later".
"""

from __future__ import annotations

import hashlib
import hmac
import os

import msgpack
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from tandem.wire import protocol as P
from tandem.wire import schema as S
from tandem.wire.codec import as_buffer, peek_type
from tandem.wire.errors import AuthError, WireError
from tandem.wire.sealed import SealedChannel

NONCE_BYTES = 32
MAC_BYTES = 32
VERDICTS = ("accept", "at_capacity")
_MAX_HANDSHAKE_FRAME = 1024
_NONCE = S.Bytes(exact=NONCE_BYTES)
_MAC = S.Bytes(exact=MAC_BYTES)


class PeerAtCapacity(WireError):
    """The responder proved it is a cluster member and said it cannot take this connection now."""

    def __init__(self, node_id: str, retry_after_s: float):
        super().__init__(f"KV peer {node_id} is at capacity; retry in {retry_after_s:.2f}s", "at_capacity")
        self.node_id = node_id
        self.retry_after_s = retry_after_s


def _hkdf(secret: bytes, length: int, info: bytes, salt: bytes | None = None) -> bytes:
    return HKDF(algorithm=hashes.SHA256(), length=length, salt=salt, info=info).derive(secret)


def _mac_key(secret: bytes) -> bytes:
    return _hkdf(secret, 32, b"tandem handshake mac v1")


def _frame(msg_type: P.MsgType, fields: list) -> bytes:
    return P.header_prefix(msg_type) + msgpack.packb(fields, use_bin_type=True)


def _parse(frames, expected: P.MsgType, n_fields: int) -> tuple[bytes, list]:
    if len(frames) != 1:
        raise WireError(f"handshake {expected.name} must be one frame, got {len(frames)}", "handshake")
    head = bytes(as_buffer(frames[0]))
    if len(head) > _MAX_HANDSHAKE_FRAME:
        raise WireError("oversized handshake frame", "handshake")
    got = peek_type(head)
    if got == P.MsgType.HANDSHAKE_ERROR and expected != P.MsgType.HANDSHAKE_ERROR:
        raise AuthError("KV peer refused the handshake (wrong cluster secret?)", "refused")
    if got != expected:
        raise WireError(f"expected handshake {expected.name}, got {got.name}", "handshake")
    try:
        fields = msgpack.unpackb(head[P.PREFIX_LEN:], raw=False, max_ext_len=0)
    except Exception:
        raise WireError(f"undecodable handshake {expected.name}", "handshake") from None
    if type(fields) is not list or len(fields) != n_fields:
        raise WireError(f"handshake {expected.name} must have {n_fields} fields", "handshake")
    return head, fields


def _session_keys(secret: bytes, nonce_i: bytes, nonce_r: bytes, transcript: bytes) -> tuple[bytes, bytes]:
    okm = _hkdf(secret, 64, b"tandem session v1" + transcript, salt=nonce_i + nonce_r)
    return okm[:32], okm[32:]


def error_frames(reason: str = "handshake failed") -> list[bytes]:
    """Unauthenticated notice so a refused initiator fails fast instead of timing out."""
    return [_frame(P.MsgType.HANDSHAKE_ERROR, [reason[:200]])]


class Initiator:
    """The connecting side (prefill worker): ``hello()``, then ``on_challenge(frames)``."""

    def __init__(self, secret: bytes, node_id: str):
        self._secret = secret
        self._node_id = node_id
        self._nonce = os.urandom(NONCE_BYTES)
        self._hello: bytes | None = None

    def hello(self) -> list[bytes]:
        self._hello = _frame(P.MsgType.HELLO, [self._node_id, self._nonce])
        return [self._hello]

    def on_challenge(self, frames) -> tuple[list[bytes], SealedChannel, str]:
        """Verify the responder; returns (PROOF frames, channel, responder node id).

        Raises AuthError if the responder does not hold the secret, PeerAtCapacity if it
        authenticated a refusal."""
        assert self._hello is not None, "hello() first"
        head, (node_id, nonce_r, verdict, retry_after, mac_r) = _parse(frames, P.MsgType.CHALLENGE, 5)
        node_id = S.NODE_ID.unpack(node_id, "CHALLENGE.node_id")
        nonce_r = _NONCE.unpack(nonce_r, "CHALLENGE.nonce")
        mac_r = _MAC.unpack(mac_r, "CHALLENGE.mac")
        verdict = S.Str(16, VERDICTS).unpack(verdict, "CHALLENGE.verdict")
        retry_after = S.RETRY_AFTER.unpack(retry_after, "CHALLENGE.retry_after_s")
        # The mac is the last msgpack element: a 32-byte bin is 0xc4 0x20 + 32 bytes.
        unsigned = head[: -(MAC_BYTES + 2)]
        transcript = hashlib.sha256(b"tandem-handshake" + self._hello + unsigned).digest()
        mac_key = _mac_key(self._secret)
        expected = hmac.new(mac_key, b"responder" + transcript, hashlib.sha256).digest()
        if not hmac.compare_digest(expected, mac_r):
            raise AuthError(f"KV peer {node_id!r} failed the cluster handshake: wrong cluster secret on one side", "bad_mac")
        if verdict == "at_capacity":
            raise PeerAtCapacity(node_id, retry_after)
        mac_i = hmac.new(mac_key, b"initiator" + transcript, hashlib.sha256).digest()
        k_ir, k_ri = _session_keys(self._secret, self._nonce, nonce_r, transcript)
        return [_frame(P.MsgType.PROOF, [mac_i])], SealedChannel(send_key=k_ir, recv_key=k_ri), node_id


class Responder:
    """The bound side (decode worker's KV ingest), one per connecting peer:
    ``on_hello(frames, at_capacity=...)`` then ``on_proof(frames)``."""

    def __init__(self, secret: bytes, node_id: str):
        self._secret = secret
        self._node_id = node_id
        self._nonce = os.urandom(NONCE_BYTES)
        self._transcript: bytes | None = None
        self._peer_nonce = b""
        self.peer_id = ""
        self.accepted = False

    def on_hello(self, frames, *, at_capacity: bool = False, retry_after_s: float = 1.0) -> list[bytes]:
        head, (node_id, nonce_i) = _parse(frames, P.MsgType.HELLO, 2)
        self.peer_id = S.NODE_ID.unpack(node_id, "HELLO.node_id")
        self._peer_nonce = _NONCE.unpack(nonce_i, "HELLO.nonce")
        verdict = "at_capacity" if at_capacity else "accept"
        self.accepted = not at_capacity
        unsigned = _frame(P.MsgType.CHALLENGE, [self._node_id, self._nonce, verdict, float(retry_after_s), b"\0" * MAC_BYTES])
        unsigned = unsigned[: -(MAC_BYTES + 2)]
        self._transcript = hashlib.sha256(b"tandem-handshake" + head + unsigned).digest()
        mac_r = hmac.new(_mac_key(self._secret), b"responder" + self._transcript, hashlib.sha256).digest()
        return [_frame(P.MsgType.CHALLENGE, [self._node_id, self._nonce, verdict, float(retry_after_s), mac_r])]

    def on_proof(self, frames) -> SealedChannel:
        """Verify the initiator; returns the responder's channel. Raises AuthError."""
        if self._transcript is None or not self.accepted:
            raise WireError("PROOF before an accepting CHALLENGE", "handshake")
        _, (mac_i,) = _parse(frames, P.MsgType.PROOF, 1)
        mac_i = _MAC.unpack(mac_i, "PROOF.mac")
        expected = hmac.new(_mac_key(self._secret), b"initiator" + self._transcript, hashlib.sha256).digest()
        if not hmac.compare_digest(expected, mac_i):
            raise AuthError(f"KV peer {self.peer_id!r} failed the cluster handshake: wrong cluster secret", "bad_mac")
        k_ir, k_ri = _session_keys(self._secret, self._peer_nonce, self._nonce, self._transcript)
        return SealedChannel(send_key=k_ri, recv_key=k_ir)
