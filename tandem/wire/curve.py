"""CURVE keys derived from the cluster secret, and the ZAP handler that admits only them.

Control and token sockets (broker frontend/backend, XSUB/XPUB, stats) use ZeroMQ's
CURVE mechanism: encryption and authentication inside libzmq's I/O threads, at no
Python cost per message (see docs/protocol.md for the measurement behind this choice).
Every process that holds the secret derives the same two keypairs: binding sockets are
CURVE servers with the *server* pair, connecting sockets are clients with the *client*
pair. A ZAP handler in each context admits a connection only if the client proved
possession of the cluster's client secret key; anyone else is rejected during the
handshake and never gets a message through.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass

import zmq
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from zmq.utils import z85

log = logging.getLogger(__name__)

ZAP_ENDPOINT = "inproc://zeromq.zap.01"


@dataclass(frozen=True)
class CurveKeys:
    """Z85-encoded CURVE keypairs shared by the whole cluster."""

    server_public: bytes
    server_secret: bytes
    client_public: bytes
    client_secret: bytes


def _derive_secret_key(secret: bytes, label: bytes) -> bytes:
    seed = HKDF(algorithm=hashes.SHA256(), length=32, salt=b"tandem-curve-v1", info=label).derive(secret)
    return z85.encode(seed)


def derive_curve_keys(secret: bytes) -> CurveKeys:
    """Deterministic keypairs from the cluster secret (Curve25519 accepts any 32 bytes)."""
    if not zmq.has("curve"):
        raise RuntimeError("this libzmq was built without CURVE; install pyzmq's bundled wheel")
    server_secret = _derive_secret_key(secret, b"server")
    client_secret = _derive_secret_key(secret, b"client")
    return CurveKeys(zmq.curve_public(server_secret), server_secret, zmq.curve_public(client_secret), client_secret)


class ZapHandler:
    """Answers libzmq's ZAP requests for one context: CURVE clients must present an
    allowed public key; NULL is allowed because only sockets made without security use
    it (a CURVE server never accepts a NULL peer). Runs in a daemon thread that exits
    when the context terminates, so ``ctx.term()`` never hangs on it."""

    def __init__(self, ctx: zmq.Context):
        self.allowed: set[bytes] = set()
        self.denied = 0
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(ctx,), name="tandem-zap", daemon=True)
        self._thread.start()
        self._ready.wait()
        if self._error is not None:
            raise self._error

    def allow(self, public_key_z85: bytes) -> None:
        self.allowed.add(z85.decode(public_key_z85))

    def _run(self, ctx: zmq.Context) -> None:
        try:
            # Not ctx.socket(): ctx.destroy() would close it under this thread (libzmq aborts);
            # unregistered, it closes itself when term() wakes recv with ETERM.
            sock = zmq.Socket(ctx, zmq.REP)
            sock.linger = 0
            sock.bind(ZAP_ENDPOINT)
        except zmq.ZMQError as exc:
            self._error = exc
            self._ready.set()
            return
        self._ready.set()
        try:
            while True:
                request = sock.recv_multipart()
                sock.send_multipart(self._answer(request))
        except zmq.ContextTerminated:
            pass
        finally:
            sock.close(0)

    def _answer(self, request: list[bytes]) -> list[bytes]:
        if len(request) < 6:
            return [b"1.0", b"", b"500", b"malformed ZAP request", b"", b""]
        version, request_id, _domain, address, _identity, mechanism = request[:6]
        credentials = request[6:]
        if mechanism == b"NULL":
            return [version, request_id, b"200", b"OK", b"", b""]
        if mechanism == b"CURVE" and len(credentials) == 1 and credentials[0] in self.allowed:
            return [version, request_id, b"200", b"OK", b"cluster", b""]
        self.denied += 1
        log.warning("refused %s connection from %s: not a cluster key", mechanism.decode(errors="replace"), address.decode(errors="replace"))
        return [version, request_id, b"400", b"not a cluster member", b"", b""]


_handlers: dict[int, ZapHandler] = {}
_handlers_lock = threading.Lock()


def zap_handler(ctx: zmq.Context) -> ZapHandler:
    """The context's ZAP handler, started on first use."""
    with _handlers_lock:
        handler = _handlers.get(id(ctx))
        if handler is None or not handler._thread.is_alive():
            handler = _handlers[id(ctx)] = ZapHandler(ctx)
        return handler


def apply_curve(sock: zmq.Socket, keys: CurveKeys, *, server: bool) -> None:
    """Make ``sock`` a CURVE server (binding side) or client (connecting side)."""
    if server:
        zap_handler(sock.context).allow(keys.client_public)
        sock.curve_secretkey = keys.server_secret
        sock.curve_publickey = keys.server_public
        sock.curve_server = True
        sock.zap_domain = b"tandem"
    else:
        sock.curve_secretkey = keys.client_secret
        sock.curve_publickey = keys.client_public
        sock.curve_serverkey = keys.server_public
