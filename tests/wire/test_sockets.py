"""The socket factory and CURVE: cluster members talk, everyone else gets nothing."""

from __future__ import annotations

import time

import pytest
import zmq

from tandem.wire import codec
from tandem.wire.curve import derive_curve_keys, zap_handler
from tandem.wire.messages import Abort, TokenMessage
from tandem.wire.sockets import bound_endpoint, is_loopback, make_socket

SECRET = b"s" * 32
OTHER = b"o" * 32
RID = b"r" * 16


@pytest.fixture
def ctx():
    ctx = zmq.Context()
    yield ctx
    ctx.destroy(linger=0)


def _poll_recv(sock, timeout_ms):
    if sock.poll(timeout_ms):
        return sock.recv_multipart()
    return None


def test_keys_are_deterministic_and_secret_dependent():
    a, b, c = derive_curve_keys(SECRET), derive_curve_keys(SECRET), derive_curve_keys(OTHER)
    assert a == b and a.server_public != c.server_public and a.client_public != a.server_public
    assert zmq.curve_public(a.client_secret) == a.client_public


def test_factory_options(ctx):
    router = make_socket(ctx, zmq.ROUTER, bind="tcp://127.0.0.1:*", identity=b"broker", hwm=7)
    assert router.getsockopt(zmq.SNDHWM) == 7 and router.linger == 0
    assert router.getsockopt(zmq.ROUTING_ID) == b"broker"
    with pytest.raises(zmq.ZMQError):  # ROUTER_MANDATORY: unknown peer raises instead of dropping
        router.send_multipart([b"nobody", b"x"])
    with pytest.raises(ValueError):
        make_socket(ctx, zmq.DEALER)
    assert is_loopback(bound_endpoint(router)) and not is_loopback("tcp://10.0.0.1:5")


@pytest.mark.parametrize("client_secret", [SECRET, OTHER, None], ids=["member", "wrong-secret", "no-security"])
def test_router_admits_only_cluster_members(ctx, client_secret):
    router = make_socket(ctx, zmq.ROUTER, bind="tcp://127.0.0.1:*", security=SECRET)
    dealer = make_socket(ctx, zmq.DEALER, connect=bound_endpoint(router), security=client_secret)
    dealer.send_multipart(codec.encode(Abort(RID)))
    got = _poll_recv(router, 1000 if client_secret == SECRET else 400)
    if client_secret == SECRET:
        assert got is not None and codec.decode(got[1:]) == Abort(RID)
        # and the reply path works
        router.send_multipart([got[0], *codec.encode(Abort(RID))])
        assert _poll_recv(dealer, 1000) is not None
    else:
        assert got is None


def test_zap_refuses_a_client_that_knows_only_the_server_key(ctx):
    # The server public key is not secret in CURVE's model; the ZAP handler is what
    # limits clients to holders of the cluster's client secret key.
    router = make_socket(ctx, zmq.ROUTER, bind="tcp://127.0.0.1:*", security=SECRET)
    denied_before = zap_handler(ctx).denied
    public, secret = zmq.curve_keypair()
    dealer = ctx.socket(zmq.DEALER)
    dealer.linger = 0
    dealer.curve_publickey, dealer.curve_secretkey = public, secret
    dealer.curve_serverkey = derive_curve_keys(SECRET).server_public
    dealer.connect(bound_endpoint(router))
    dealer.send_multipart(codec.encode(Abort(RID)))
    assert _poll_recv(router, 400) is None
    assert zap_handler(ctx).denied > denied_before


@pytest.mark.parametrize("sub_secret", [SECRET, OTHER, None], ids=["member", "wrong-secret", "no-security"])
def test_token_stream_reaches_only_cluster_members(ctx, sub_secret):
    xpub = make_socket(ctx, zmq.XPUB, bind="tcp://127.0.0.1:*", security=SECRET)
    sub = make_socket(ctx, zmq.SUB, connect=bound_endpoint(xpub), security=sub_secret, subscribe=[RID])
    deadline = time.monotonic() + (2.0 if sub_secret == SECRET else 0.5)
    subscribed = None
    while time.monotonic() < deadline and subscribed is None:
        subscribed = _poll_recv(xpub, 50)
    if sub_secret != SECRET:
        assert subscribed is None
        # Publish anyway (XPUB has no subscriber, but make sure nothing arrives).
        xpub.send_multipart(codec.encode_tokens(TokenMessage(RID, 0, [1])))
        assert _poll_recv(sub, 300) is None
        return
    assert subscribed == [b"\x01" + RID]
    xpub.send_multipart(codec.encode_tokens(TokenMessage(RID, 0, [1, 2])))
    got = _poll_recv(sub, 1000)
    assert got is not None and codec.decode_tokens(got).tokens == [1, 2]


def test_context_terminates_with_zap_handler_running():
    ctx = zmq.Context()
    sock = make_socket(ctx, zmq.ROUTER, bind="tcp://127.0.0.1:*", security=SECRET)
    sock.close()
    t0 = time.monotonic()
    ctx.term()  # must not hang on the ZAP thread's socket
    assert time.monotonic() - t0 < 5
