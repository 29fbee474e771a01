"""The one socket factory: every ZeroMQ socket tandem opens is made here.

Options that are easy to forget and expensive to get wrong live in one place:
LINGER (a closing socket must not block shutdown), HWMs, ROUTER_MANDATORY (an
unroutable message raises instead of vanishing), MAXMSGSIZE (libzmq drops a peer that
sends an oversized frame before Python sees it), IPv6 off, and CURVE security derived
from the cluster secret. A binding socket is the CURVE server, a connecting one the client.
"""

from __future__ import annotations

import functools

import zmq

from tandem.wire import protocol as P
from tandem.wire.curve import CurveKeys, apply_curve, derive_curve_keys

DEFAULT_HWM = 10_000
DEFAULT_LINGER_MS = 0

_LOOPBACK_PREFIXES = ("tcp://127.", "tcp://localhost:", "tcp://[::1]", "ipc://", "inproc://")


@functools.lru_cache(maxsize=8)
def _keys_for(secret: bytes) -> CurveKeys:
    return derive_curve_keys(secret)


def make_socket(
    ctx: zmq.Context,
    sock_type: int,
    *,
    bind: str | None = None,
    connect: str | list[str] | None = None,
    identity: bytes | None = None,
    hwm: int = DEFAULT_HWM,
    linger: int = DEFAULT_LINGER_MS,
    router_mandatory: bool | None = None,
    security: bytes | CurveKeys | None = None,
    subscribe: list[bytes] | None = None,
    xpub_verbose: bool = False,
    max_msg_size: int = P.MAX_FRAME_BYTES + 1024,
    rcvtimeo: int | None = None,
    sndtimeo: int | None = None,
) -> zmq.Socket:
    """Create, configure and bind or connect a socket.

    ``security`` is the cluster secret (bytes) or derived :class:`CurveKeys`, or None for
    an unauthenticated development socket. ``router_mandatory`` defaults to True for
    ROUTER sockets. ``connect`` may list several endpoints. Options are applied before
    bind/connect because libzmq reads most of them only then.
    """
    if (bind is None) == (connect is None):
        raise ValueError("give exactly one of bind= or connect=")
    sock = ctx.socket(sock_type)
    try:
        sock.linger = linger
        sock.sndhwm = hwm
        sock.rcvhwm = hwm
        sock.setsockopt(zmq.MAXMSGSIZE, max_msg_size)
        if identity is not None:
            sock.setsockopt(zmq.ROUTING_ID, identity)
        if sock_type == zmq.ROUTER and router_mandatory is not False:
            sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        if sock_type == zmq.XPUB and xpub_verbose:
            sock.setsockopt(zmq.XPUB_VERBOSE, 1)
        if rcvtimeo is not None:
            sock.rcvtimeo = rcvtimeo
        if sndtimeo is not None:
            sock.sndtimeo = sndtimeo
        if security is not None:
            keys = security if isinstance(security, CurveKeys) else _keys_for(bytes(security))
            apply_curve(sock, keys, server=bind is not None)
        if sock_type == zmq.SUB:
            for topic in subscribe or ():
                sock.setsockopt(zmq.SUBSCRIBE, topic)
        if bind is not None:
            sock.bind(bind)
        else:
            for endpoint in [connect] if isinstance(connect, str) else connect:
                sock.connect(endpoint)
    except BaseException:
        sock.close(0)
        raise
    return sock


def is_loopback(endpoint: str) -> bool:
    """True for endpoints that cannot leave this machine (dev mode may run without a secret)."""
    return endpoint.startswith(_LOOPBACK_PREFIXES)


def bound_endpoint(sock: zmq.Socket) -> str:
    """The concrete endpoint after binding to port 0 or ``*`` (``tcp://127.0.0.1:*``)."""
    return sock.getsockopt_string(zmq.LAST_ENDPOINT)
