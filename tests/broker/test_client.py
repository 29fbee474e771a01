"""The wire client against a hand-driven broker: gaps, refusals, cancellation -> ABORT."""

from __future__ import annotations

import asyncio
import os

import pytest
import zmq

from tandem.kvtypes import SamplingParams
from tandem.wire import codec
from tandem.wire import messages as M
from tandem.wire.client import AsyncClient, Busy, InvalidRequest, StreamError, Unavailable


class FakeBroker:
    def __init__(self, ctx, secret):
        from tandem.wire.sockets import make_socket

        self.front = make_socket(ctx, zmq.ROUTER, bind="tcp://127.0.0.1:*", security=secret)
        self.xpub = make_socket(ctx, zmq.XPUB, bind="tcp://127.0.0.1:*", security=secret, xpub_verbose=True)
        self.addrs = (self.front.getsockopt_string(zmq.LAST_ENDPOINT), self.xpub.getsockopt_string(zmq.LAST_ENDPOINT))

    async def submit(self):
        """Wait for the subscription (once per client) and the submit (either order);
        returns (client, Submit)."""
        sub, got = getattr(self, "topic", None), None
        loop = asyncio.get_running_loop()
        while sub is None or got is None:
            if self.xpub.poll(0):
                ev = self.xpub.recv()
                if ev[0] == 1:
                    sub = ev[1:]
            if self.front.poll(0):
                ident, *frames = self.front.recv_multipart()
                msg = codec.decode(frames)
                if isinstance(msg, M.Submit):
                    got = (ident, msg)
            await asyncio.sleep(0.005)
        assert sub == got[1].stream  # subscribed to exactly the stream it names
        self.topic = sub
        return got

    async def next_control(self, timeout=2.0):
        for _ in range(int(timeout / 0.005)):
            if self.front.poll(0):
                ident, *frames = self.front.recv_multipart()
                return codec.decode(frames)
            await asyncio.sleep(0.005)
        return None

    def reply(self, ident, msg):
        self.front.send_multipart([ident, *codec.encode(msg)])

    def publish(self, *msgs):
        """One batch on the client's stream topic holding ``msgs``."""
        self.xpub.send_multipart([self.topic, codec.pack_header(M.TokenBatch([(0, m) for m in msgs]))])


@pytest.fixture
def fake():
    ctx = zmq.Context()
    secret = os.urandom(32)
    b = FakeBroker(ctx, secret)
    yield b, secret
    ctx.destroy(0)


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 20))


def test_stream_and_gap_detection(fake):
    b, secret = fake

    async def main():
        async with AsyncClient(*b.addrs, secret=secret) as ac:
            async def consume():
                got = []
                try:
                    async for ev in ac.generate([1, 2], SamplingParams()):
                        got.append(ev.tokens)
                except StreamError as exc:
                    return got, exc
                return got, None
            task = asyncio.ensure_future(consume())
            ident, sub = await b.submit()
            b.reply(ident, M.Accepted(sub.request_id))
            b.publish(M.TokenMessage(sub.request_id, 0, [5, 6]))
            b.publish(M.TokenMessage(sub.request_id, 2, [8]))  # seq 1 never came
            return await task

    got, exc = run(main())
    assert got == [[5, 6]] and exc is not None and "gap" in str(exc)


def test_busy_and_invalid_raise_before_first_event(fake):
    b, secret = fake

    async def main():
        async with AsyncClient(*b.addrs, secret=secret) as ac:
            out = []
            for reason, exc_type in (("busy", Busy), ("invalid", InvalidRequest)):
                task = asyncio.ensure_future(_drain(ac))
                ident, sub = await b.submit()
                b.reply(ident, M.Refused(sub.request_id, reason, "nope", 2.5))
                try:
                    await task
                except exc_type as exc:
                    out.append(exc)
            return out

    busy, invalid = run(main())
    assert busy.reason == "busy" and busy.retry_after_s == 2.5 and isinstance(invalid, InvalidRequest)


async def _drain(ac):
    return [t async for ev in ac.generate([1], SamplingParams()) for t in ev.tokens]


async def _accepted(b, ac):
    """A request the fake broker accepted, drained in a task of its own: (task, its SUBMIT)."""
    task = asyncio.ensure_future(_drain(ac))
    ident, sub = await b.submit()
    b.reply(ident, M.Accepted(sub.request_id))
    return task, sub


def test_unavailable_when_nobody_answers():
    async def main():
        async with AsyncClient("tcp://127.0.0.1:1", "tcp://127.0.0.1:2", secret=None, timeout_s=0.3) as ac:
            with pytest.raises(Unavailable):
                await _drain(ac)
    run(main())


def test_cancelling_the_consumer_sends_abort(fake):
    b, secret = fake

    async def main():
        async with AsyncClient(*b.addrs, secret=secret) as ac:
            task, sub = await _accepted(b, ac)
            b.publish(M.TokenMessage(sub.request_id, 0, [5]))
            await asyncio.sleep(0.05)
            task.cancel()  # what an HTTP disconnect does to the handler's task
            with pytest.raises(asyncio.CancelledError):
                await task
            msg = await b.next_control()
            return sub.request_id, msg

    rid, msg = run(main())
    assert isinstance(msg, M.Abort) and msg.request_id == rid


def test_error_message_raises_stream_error_after_tokens(fake):
    b, secret = fake

    async def main():
        async with AsyncClient(*b.addrs, secret=secret) as ac:
            task, sub = await _accepted(b, ac)
            b.publish(M.TokenMessage(sub.request_id, 0, [5]))
            b.publish(M.TokenMessage(sub.request_id, 1, [], None, "error", None, "worker failed and no migration is left"))
            with pytest.raises(StreamError, match="no migration"):
                await task
            # A finished stream sends no ABORT.
            return await b.next_control(timeout=0.3)

    assert run(main()) is None


def test_one_batch_feeds_many_streams_and_a_gap_ends_only_its_own(fake):
    """Entries of several requests in one batch reach their own streams, in order; a gap
    in one request's entries ends that stream and no other."""
    b, secret = fake

    async def main():
        async with AsyncClient(*b.addrs, secret=secret) as ac:
            async def consume(prompt):
                got = []
                try:
                    async for ev in ac.generate(prompt, SamplingParams()):
                        got.append(ev.tokens)
                except StreamError as exc:
                    return got, str(exc)
                return got, None
            tasks, rids = [], []
            for i in range(3):
                tasks.append(asyncio.ensure_future(consume([i + 1])))
                ident, sub = await b.submit()
                b.reply(ident, M.Accepted(sub.request_id))
                rids.append(sub.request_id)
            a, g, c = rids
            b.publish(M.TokenMessage(a, 0, [1]), M.TokenMessage(g, 0, [2]), M.TokenMessage(c, 0, [3]),
                      M.TokenMessage(a, 1, [4]), M.TokenMessage(g, 2, [5]), M.TokenMessage(c, 1, [6], None, "stop"))
            b.publish(M.TokenMessage(a, 2, [7], None, "length"))
            return await asyncio.gather(*tasks)

    (ga, ea), (gg, eg), (gc, ec) = run(main())
    assert (ga, ea) == ([[1], [4], [7]], None)
    assert gg == [[2]] and "gap" in eg
    assert (gc, ec) == ([[3], [6]], None)


def test_a_stream_announced_again_falls_back_to_the_request_topics(fake):
    """A second announcement of the client's stream (its SUB reconnected, perhaps to a
    restarted broker that lost the request) makes the client listen on the request's own
    topic as well, where a broker ends a stream it does not know."""
    b, secret = fake

    async def main():
        async with AsyncClient(*b.addrs, secret=secret) as ac:
            task, sub = await _accepted(b, ac)
            b.publish()  # the announcement when the stream was first seen
            b.publish(M.TokenMessage(sub.request_id, 0, [5]))
            await asyncio.sleep(0.05)
            b.publish()  # seen again
            for _ in range(400):
                if b.xpub.poll(0):
                    ev = b.xpub.recv()
                    if ev == b"\x01" + sub.request_id:
                        break
                await asyncio.sleep(0.005)
            else:
                raise AssertionError("the client did not subscribe to the request's topic")
            b.xpub.send_multipart(codec.encode_tokens(M.TokenMessage(sub.request_id, 1, [], None, "error", None,
                                                                     "the broker restarted and lost it")))
            with pytest.raises(StreamError, match="restarted"):
                await task

    run(main())
