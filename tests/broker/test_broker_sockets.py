"""The broker's socket loop in a thread, driven over real loopback sockets: messages of
the wrong shape or content are counted and dropped, and the loop keeps serving."""

from __future__ import annotations

import threading
import logging
import time

import pytest
import zmq

from tandem.broker.broker import Broker
from tandem.broker.settings import BrokerSettings
from tandem.kvtypes import SamplingParams
from tandem.wire import codec
from tandem.wire import messages as M
from tandem.wire.protocol import CLIENT_STREAM_BYTES, STREAM_BATCH_TOPIC, STREAM_PING_TOPIC
from tandem.wire.sockets import make_socket

ANY = "tcp://127.0.0.1:*"


@pytest.fixture
def broker():
    ctx = zmq.Context()
    b = Broker(BrokerSettings(frontend=ANY, backend=ANY, stream_in=ANY, stream_out=ANY, stats=ANY), secret=None, ctx=ctx)
    t = threading.Thread(target=b.run, daemon=True)
    t.start()
    socks = []

    def sock(kind, endpoint, **kw):
        s = make_socket(ctx, kind, connect=b.endpoints[endpoint], **kw)
        socks.append(s)
        return s

    try:
        yield b, sock
    finally:
        b.stop()
        t.join(5)
        for s in socks:
            s.close(0)
        ctx.term()


def _stats(stats_sock) -> dict:
    stats_sock.send(codec.encode(M.StatsRequest())[0])
    assert stats_sock.poll(5000)
    return codec.decode(stats_sock.recv_multipart()).stats


def test_malformed_messages_are_counted_and_the_loop_keeps_serving(broker, caplog):
    b, sock = broker
    caplog.set_level(logging.WARNING, logger="tandem.broker")
    client = sock(zmq.DEALER, "frontend")
    worker = sock(zmq.DEALER, "backend", identity=b"w0")
    pub = sock(zmq.PUB, "stream_in")
    sub = sock(zmq.SUB, "stream_out")
    stats = sock(zmq.DEALER, "stats")
    # Wrong shapes: an extra frame on each ROUTER, a lone frame and a triple on the XSUB.
    client.send_multipart([codec.encode(M.StatsRequest())[0], b"extra"])
    worker.send_multipart([b"TD", b"x", b"y"])
    time.sleep(0.3)  # the PUB's connection to the XSUB
    pub.send(b"lonely")
    pub.send_multipart([b"r" * 17, b"h", b"extra"])
    # Wrong content: garbage headers, a wrong protocol version, a bad field.
    client.send(b"\x00garbage")
    worker.send(b"TD\x01\x10" + b"\x90")
    bad = codec.encode(M.Submit(b"r" * 16, [1], SamplingParams()))[0].replace(b"\xc4\x10" + b"r" * 16, b"\xc4\x0f" + b"r" * 15)
    client.send(bad)
    deadline = time.monotonic() + 5
    while True:
        st = _stats(stats)
        c = st["counters"]
        if c.get("bad_messages", 0) >= 5 and c.get("bad_stream_messages", 0) >= 2:
            break
        assert time.monotonic() < deadline, c
        time.sleep(0.05)
    assert c["bad_messages"] == 5 and c["bad_stream_messages"] == 2 and not c.get("submitted")
    # A node of another version is named where operators look, once (not each message).
    assert [r.levelname for r in caplog.records if "another version" in r.getMessage()] == ["WARNING"]
    # Still serving: a worker registers, and a request is dispatched to it and streamed back.
    _register(worker, pub, stats)
    rid = b"q" * 16
    sub.setsockopt(zmq.SUBSCRIBE, rid)
    client.send(codec.encode(M.Submit(rid, [1, 2, 3], SamplingParams(max_tokens=1)))[0])
    assert worker.poll(5000)
    msg = codec.decode(worker.recv_multipart())
    assert isinstance(msg, M.Dispatch) and msg.request_id == rid and msg.prompt == [1, 2, 3]
    _batch(pub, (msg.attempt, M.TokenMessage(rid, 0, [5], None, "length", M.Usage(3, 1))))
    assert sub.poll(5000)
    assert codec.decode_tokens(sub.recv_multipart()).tokens == [5]


def _batch(pub, *entries) -> None:
    for head in codec.batch_headers([codec.stream_entry(a, m) for a, m in entries]):
        pub.send_multipart([STREAM_BATCH_TOPIC, head])


def _register(worker, pub, stats) -> None:
    worker.send(codec.encode(M.Ready("w0", "hybrid", "m", 16, None, 16, 100))[0])
    deadline = time.monotonic() + 5
    while _stats(stats)["ready"]["hybrid"] < 1:
        pub.send_multipart([STREAM_PING_TOPIC, b"w0"])
        assert time.monotonic() < deadline
        time.sleep(0.05)


def test_a_batch_is_judged_entry_by_entry_and_regrouped_per_client(broker):
    """One worker batch holds entries for two clients: one on its stream topic, one on a
    request's own topic. A gap in one request's entry holds that request only; the others
    go out at once, the stream client's in one batch, in order."""
    b, sock = broker
    client, worker = sock(zmq.DEALER, "frontend"), sock(zmq.DEALER, "backend", identity=b"w0")
    pub, stats = sock(zmq.PUB, "stream_in"), sock(zmq.DEALER, "stats")
    streamed, plain = sock(zmq.SUB, "stream_out"), sock(zmq.SUB, "stream_out")
    time.sleep(0.3)
    _register(worker, pub, stats)
    topic = b"S" * CLIENT_STREAM_BYTES
    streamed.setsockopt(zmq.SUBSCRIBE, topic)
    assert streamed.poll(5000)  # the broker announces a stream it sees subscribed: an empty batch
    assert codec.decode_batch(streamed.recv_multipart()) == []
    r1, r2, r3 = b"1" * 16, b"2" * 16, b"3" * 16
    plain.setsockopt(zmq.SUBSCRIBE, r3)
    time.sleep(0.2)
    for rid, stream in ((r1, topic), (r2, topic), (r3, None)):
        client.send(codec.encode(M.Submit(rid, [1, 2], SamplingParams(max_tokens=2), stream=stream))[0])
    attempts = {}
    while len(attempts) < 3:
        assert worker.poll(5000)
        msg = codec.decode(worker.recv_multipart())
        if isinstance(msg, M.Dispatch):
            attempts[msg.request_id] = msg.attempt
    usage = M.Usage(2, 2)
    _batch(pub, (attempts[r1], M.TokenMessage(r1, 0, [5])), (attempts[r2], M.TokenMessage(r2, 1, [6], None, "length", usage)),
           (attempts[r3], M.TokenMessage(r3, 0, [7])), (attempts[r1], M.TokenMessage(r1, 1, [8], None, "length", usage)))
    assert streamed.poll(5000)
    got = codec.decode_batch(streamed.recv_multipart())
    assert [(m.request_id, m.seq, m.tokens) for _, m in got] == [(r1, 0, [5]), (r1, 1, [8])]
    assert plain.poll(5000)
    assert codec.decode_tokens(plain.recv_multipart()).tokens == [7]
    _batch(pub, (attempts[r2], M.TokenMessage(r2, 0, [9])), (attempts[r3] + 1, M.TokenMessage(r3, 1, [1])))
    assert streamed.poll(5000)
    got = codec.decode_batch(streamed.recv_multipart())
    assert [(m.request_id, m.seq, m.tokens, m.finish_reason) for _, m in got] == [(r2, 0, [9], None), (r2, 1, [6], "length")]
    assert not plain.poll(300)  # another attempt's entry: dropped
    c = _stats(stats)["counters"]
    assert c["reordered_stream_messages"] == 1 and c["stale_stream_messages"] == 1 and c["completed"] == 2
