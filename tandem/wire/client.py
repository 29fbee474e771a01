"""The broker client: submit token ids, stream tokens back (asyncio and synchronous).

One process needs one client: a DEALER to the broker's frontend for control messages
and ONE SUB to its XPUB for every stream of this process. The SUB subscribes once, at
start, to this client's own stream topic, which every SUBMIT names: the broker sends all
of this client's tokens there, many requests' in one TOKEN_BATCH, demultiplexed here by
request id into per-request queues (one message per engine step, not per request per
step). The broker dispatches a request only after its XPUB has seen that subscription,
so the first token cannot be lost. Sequence numbers are checked per request: a gap ends
that stream with :class:`StreamError` instead of silently dropping text. Closing or
cancelling the generator sends ABORT, which reaches the worker and frees the request's
KV.

A restarted broker knows none of the requests in flight. When the stream subscription
is announced again (the broker answers each with an empty batch), the client subscribes
to each in-flight request's own topic too: a worker still streaming a request reaches it
there, and the broker ends with an error each such stream that no request of its own
claims (:meth:`Dispatcher._end_unclaimed_streams`).
"""

from __future__ import annotations

import asyncio
import os
import threading
from collections import deque
from dataclasses import dataclass
from typing import AsyncIterator, Iterator

import zmq
import zmq.asyncio

from tandem.kvtypes import SamplingParams, Usage
from tandem.wire import codec
from tandem.wire import messages as M
from tandem.wire import protocol as P
from tandem.wire.errors import WireError
from tandem.wire.sockets import make_socket

STREAM_IDLE_TIMEOUT_S = 300.0  # no message at all for this long after acceptance: give up


class Busy(Exception):
    """The broker cannot take the request now; retry after ``retry_after_s``."""

    def __init__(self, reason: str, retry_after_s: float, message: str = ""):
        super().__init__(message or reason)
        self.reason = reason
        self.retry_after_s = retry_after_s


class Unavailable(Exception):
    """The broker did not answer in time (down, unreachable, or wrong secret)."""


class InvalidRequest(ValueError):
    """The broker refused the request itself (too long, duplicate id, ...)."""


class StreamError(Exception):
    """The stream broke after it started: a sequence gap, a worker failure with no
    migration left, or an error message from the cluster."""


@dataclass
class StreamEvent:
    tokens: list[int]
    logprobs: list | None
    finish_reason: str | None
    usage: Usage | None
    error: str | None


async def _read_all(sock: zmq.asyncio.Socket, handle) -> None:
    """Hand every message of ``sock`` to ``handle``, for ever: woken once, then everything
    waiting is taken without another await (a future and an event-loop round per message
    were the larger part of this client's CPU)."""
    drain = zmq.Socket.shadow(sock.underlying)
    while True:
        frames = await sock.recv_multipart(copy=True)
        while True:
            handle(frames)
            try:
                frames = drain.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break


class AsyncClient:
    def __init__(self, broker_frontend: str, broker_stream: str, *, secret: bytes | None, timeout_s: float = 10.0,
                 idle_timeout_s: float = STREAM_IDLE_TIMEOUT_S):
        self.frontend, self.stream = broker_frontend, broker_stream
        self.secret = secret
        self.timeout_s = timeout_s
        self.idle_timeout_s = idle_timeout_s
        self._queues: dict[bytes, asyncio.Queue] = {}
        self._topic = os.urandom(P.CLIENT_STREAM_BYTES)  # this client's stream
        self._notices = 0  # empty batches seen: the broker (re)announcing our stream
        self._fallback: set[bytes] = set()  # request topics subscribed after a broker restart
        self._stats_waiters: deque[asyncio.Future] = deque()
        self._tasks: list[asyncio.Task] = []
        self._ctx: zmq.asyncio.Context | None = None
        self._dealer = self._sub = None

    async def start(self) -> None:
        if self._ctx is not None:
            return
        self._ctx = zmq.asyncio.Context()
        # LINGER 0 everywhere: a client must never block its process's exit.
        self._dealer = make_socket(self._ctx, zmq.DEALER, connect=self.frontend, security=self.secret)
        self._sub = make_socket(self._ctx, zmq.SUB, connect=self.stream, security=self.secret, hwm=100_000)
        self._sub.setsockopt(zmq.SUBSCRIBE, self._topic)
        self._tasks = [asyncio.create_task(self._read_control()), asyncio.create_task(self._read_streams())]

    async def close(self) -> None:
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            try:
                await t
            except (asyncio.CancelledError, Exception):
                pass
        self._tasks = []
        for q in self._queues.values():
            q.put_nowait(StreamError("client closed"))
        if self._ctx is not None:
            self._dealer.close(0)
            self._sub.close(0)
            self._ctx.term()
            self._ctx = None

    async def __aenter__(self):
        await self.start()
        return self

    async def __aexit__(self, *exc):
        await self.close()

    # ---- readers: one task per socket ---------------------------------------------------
    async def _read_control(self) -> None:
        await _read_all(self._dealer, self._on_control)

    def _on_control(self, frames) -> None:
        try:
            msg = codec.decode(frames)
        except WireError:
            return
        if isinstance(msg, M.StatsReply):
            while self._stats_waiters:
                fut = self._stats_waiters.popleft()
                if not fut.done():
                    fut.set_result(msg.stats)
                    break
            return
        q = self._queues.get(getattr(msg, "request_id", b""))
        if q is not None:
            q.put_nowait(msg)

    async def _read_streams(self) -> None:
        await _read_all(self._sub, self._on_stream)

    def _on_stream(self, frames) -> None:
        try:
            if len(frames) == 2 and len(frames[0]) == P.CLIENT_STREAM_BYTES:
                msgs = [msg for _, msg in codec.decode_batch(frames)]
                if not msgs:
                    self._announced()
            else:
                msgs = [codec.decode_tokens(frames)]
        except WireError:
            return
        queues = self._queues
        for msg in msgs:
            q = queues.get(msg.request_id)
            if q is not None:
                q.put_nowait(msg)

    def _announced(self) -> None:
        """The broker saw our stream subscription. Again after the first time: it may have
        restarted and lost the requests in flight (see the module docstring)."""
        self._notices += 1
        if self._notices > 1:
            for rid in self._queues.keys() - self._fallback:
                self._sub.setsockopt(zmq.SUBSCRIBE, rid)
                self._fallback.add(rid)

    # ---- requests -----------------------------------------------------------------------
    def _send(self, msg) -> None:
        # zmq.asyncio sends at once when the pipe has room; not awaiting keeps this usable
        # from a generator's ``finally`` while it is being cancelled.
        self._dealer.send_multipart(codec.encode(msg))

    async def generate(self, prompt_tokens: list[int], sampling: SamplingParams, *, priority: int = 0,
                       request_id: bytes | None = None, model: str = "") -> AsyncIterator[StreamEvent]:
        """Stream a completion. Raises Busy/Unavailable/InvalidRequest before the first
        event, StreamError after."""
        if self._ctx is None:
            await self.start()
        rid = request_id or os.urandom(P.REQUEST_ID_BYTES)
        if len(rid) != P.REQUEST_ID_BYTES:
            raise ValueError(f"request_id must be {P.REQUEST_ID_BYTES} bytes")
        if rid in self._queues:
            raise ValueError("request_id is already streaming in this client")
        q: asyncio.Queue = asyncio.Queue()
        self._queues[rid] = q
        finished = False
        try:
            self._send(M.Submit(rid, list(prompt_tokens), sampling, priority, model, self._topic))
            accepted = False
            expected_seq = 0
            loop = asyncio.get_running_loop()
            deadline = loop.time() + self.timeout_s
            while True:
                wait = deadline - loop.time()
                try:
                    if q.empty():
                        async with asyncio.timeout(max(0.0, wait)):  # (no task per message, as wait_for makes)
                            msg = await q.get()
                    else:
                        msg = q.get_nowait()
                except TimeoutError:
                    if expected_seq == 0 and not accepted:
                        raise Unavailable(f"broker at {self.frontend} did not answer within {self.timeout_s:.1f}s") from None
                    raise StreamError(f"no tokens for {self.idle_timeout_s:.0f}s; the cluster lost the request") from None
                if isinstance(msg, Exception):
                    raise msg
                if isinstance(msg, M.Accepted):
                    accepted = True
                    deadline = loop.time() + self.idle_timeout_s
                elif isinstance(msg, M.Subscribed):
                    deadline = loop.time() + self.idle_timeout_s
                elif isinstance(msg, M.Refused):
                    if expected_seq:
                        raise StreamError(f"refused mid-stream: {msg.message or msg.reason}")
                    finished = True  # nothing to abort
                    if msg.reason == "invalid":
                        raise InvalidRequest(msg.message or "invalid request")
                    raise Busy(msg.reason, msg.retry_after_s, msg.message)
                elif isinstance(msg, M.TokenMessage):
                    if msg.seq != expected_seq and msg.error is not None and not msg.tokens:
                        raise StreamError(msg.error)  # the broker ends a stream it cannot number
                    if msg.seq != expected_seq:
                        raise StreamError(f"token stream gap: expected message {expected_seq}, got {msg.seq}")
                    expected_seq += 1
                    deadline = loop.time() + self.idle_timeout_s
                    done = msg.finish_reason is not None or msg.error is not None
                    if done:
                        finished = True
                    if msg.error is not None and msg.finish_reason in (None, "error"):
                        if msg.tokens:
                            yield StreamEvent(msg.tokens, msg.logprobs, None, None, None)
                        raise StreamError(msg.error)
                    yield StreamEvent(msg.tokens, msg.logprobs, msg.finish_reason, msg.usage, msg.error)
                    if done:
                        return
        finally:
            self._queues.pop(rid, None)
            if self._ctx is not None:
                try:
                    if rid in self._fallback:
                        self._fallback.discard(rid)
                        self._sub.setsockopt(zmq.UNSUBSCRIBE, rid)
                    if not finished:
                        self._send(M.Abort(rid))
                except zmq.ZMQError:
                    pass

    async def abort(self, request_id: bytes) -> None:
        if self._ctx is None:
            await self.start()
        self._send(M.Abort(request_id))

    async def stats(self, verbose: bool = False) -> dict:
        if self._ctx is None:
            await self.start()
        fut = asyncio.get_running_loop().create_future()
        self._stats_waiters.append(fut)
        self._send(M.StatsRequest(verbose))
        try:
            return await asyncio.wait_for(fut, self.timeout_s)
        except asyncio.TimeoutError:
            raise Unavailable(f"broker at {self.frontend} did not answer within {self.timeout_s:.1f}s") from None

    async def ready(self) -> dict:
        stats = await self.stats()
        return {"broker": True, "workers": dict(stats.get("ready", {}))}


class Client:
    """The same client for synchronous code: an event loop in a background thread."""

    def __init__(self, broker_frontend: str, broker_stream: str, *, secret: bytes | None, timeout_s: float = 10.0,
                 idle_timeout_s: float = STREAM_IDLE_TIMEOUT_S):
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="tandem-client", daemon=True)
        self._thread.start()
        self._async = AsyncClient(broker_frontend, broker_stream, secret=secret, timeout_s=timeout_s, idle_timeout_s=idle_timeout_s)
        self._call(self._async.start())

    def _call(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def generate(self, prompt_tokens: list[int], sampling: SamplingParams, *, priority: int = 0,
                 request_id: bytes | None = None, model: str = "") -> Iterator[StreamEvent]:
        agen = self._async.generate(prompt_tokens, sampling, priority=priority, request_id=request_id, model=model)
        try:
            while True:
                try:
                    yield self._call(agen.__anext__())
                except StopAsyncIteration:
                    return
        finally:
            self._call(agen.aclose())

    def abort(self, request_id: bytes) -> None:
        self._call(self._async.abort(request_id))

    def stats(self, verbose: bool = False) -> dict:
        return self._call(self._async.stats(verbose))

    def ready(self) -> dict:
        return self._call(self._async.ready())

    def close(self) -> None:
        if self._loop.is_running():
            self._call(self._async.close())
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(5)
            self._loop.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
