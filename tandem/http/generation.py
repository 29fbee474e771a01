"""One choice of one request: the cluster's token stream → text deltas, stops, usage.

A :class:`Choice` owns its request id, its detokenizer and its stop matcher. Tokens
are processed one by one so a stop string cuts the completion (and its token count
and logprobs) exactly at the token that completed it. Whatever way a choice ends
early (stop string, client gone, error), :meth:`Choice.close` aborts the request on
the cluster so the worker frees its KV blocks.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import time
from dataclasses import dataclass, field
from typing import AsyncIterator

from tandem.http.backend import Backend, StreamError
from tandem.http.detokenizer import Detokenizer
from tandem.http.metrics import EdgeMetrics
from tandem.http.stops import StopMatcher
from tandem.http.tokenizer import EdgeTokenizer
from tandem.kvtypes import REQUEST_ID_BYTES, SamplingParams

@dataclass
class Delta:
    """What one choice adds to the response in one step."""

    index: int
    text: str = ""
    logprobs: list = field(default_factory=list)  # TokenLogprob of the tokens in this delta
    tokens: list[int] = field(default_factory=list)
    finish_reason: str | None = None


@dataclass
class ChoiceUsage:
    prompt_tokens: int
    completion_tokens: int = 0
    cached_tokens: int = 0


class Choice:
    def __init__(
        self,
        backend: Backend,
        tokenizer: EdgeTokenizer,
        metrics: EdgeMetrics,
        *,
        index: int,
        prompt_tokens: list[int],
        sampling: SamplingParams,
        stops: list[str],
        priority: int,
        request_timeout_s: float,
    ):
        self.index = index
        self.request_id = os.urandom(REQUEST_ID_BYTES)
        self.usage = ChoiceUsage(prompt_tokens=len(prompt_tokens))
        self.finish_reason: str | None = None
        self._backend = backend
        self._metrics = metrics
        self._prompt = prompt_tokens
        self._sampling = dataclasses.replace(sampling)
        self._detok = Detokenizer(tokenizer)
        self._stops = StopMatcher(stops)
        self._priority = priority
        self._timeout = request_timeout_s
        self._events: AsyncIterator | None = None
        self._first = None
        self._submitted = 0.0
        self._last_event = 0.0
        self._counted_waiting = False
        self._counted_running = False
        self._closed = False

    async def start(self) -> None:
        """Submit and wait for the first event. Busy/Unavailable propagate from here,
        before any response byte is sent."""
        self._submitted = time.monotonic()
        self._events = self._backend.generate(
            self._prompt, self._sampling, priority=self._priority, request_id=self.request_id
        ).__aiter__()
        self._metrics.waiting.inc()
        self._counted_waiting = True
        self._first = await self._next()
        now = time.monotonic()
        self._metrics.ttft.observe(now - self._submitted)
        self._last_event = now
        self._metrics.waiting.dec()
        self._counted_waiting = False
        self._metrics.running.inc()
        self._counted_running = True

    async def deltas(self) -> AsyncIterator[Delta]:
        """Yield deltas until the choice finishes; raises StreamError on a cluster error."""
        assert self._first is not None, "start() must succeed before deltas()"
        event, self._first = self._first, None
        while True:
            delta = self._apply(event)
            if delta.text or delta.logprobs or delta.finish_reason:
                yield delta
            if delta.finish_reason:
                return
            event = await self._next()
            now = time.monotonic()
            self._metrics.observe_gap(now - self._last_event, len(event.tokens))
            self._last_event = now

    async def close(self) -> None:
        """Release the request: abort it on the cluster unless it already finished. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._counted_waiting:
            self._metrics.waiting.dec()
        if self._counted_running:
            self._metrics.running.dec()
        # A stop string ends the choice here while the worker is still generating. (The
        # worker sends nothing after an abort; the cached-prompt count came with the
        # stream's first message.)
        aborted_on_stop = self.finish_reason == "stop" and self._stops.stopped
        if self._events is not None and (self.finish_reason is None or aborted_on_stop):
            try:
                await self._backend.abort(self.request_id)
            except Exception:  # the request is gone either way; a dead broker forgets it
                pass
        if self.finish_reason is not None:
            self._metrics.prompt_tokens.inc(self.usage.prompt_tokens)
            self._metrics.cached_tokens.inc(self.usage.cached_tokens)
            self._metrics.generation_tokens.inc(self.usage.completion_tokens)
            self._metrics.e2e.observe(time.monotonic() - self._submitted)
        if self._events is not None and hasattr(self._events, "aclose"):
            try:
                await self._events.aclose()
            except Exception:
                pass

    async def _next(self):
        try:
            # asyncio.timeout, not wait_for: no extra task around the stream's __anext__.
            async with asyncio.timeout(self._timeout):
                return await self._events.__anext__()
        except StopAsyncIteration:
            raise StreamError("the token stream ended without a finish reason") from None
        except asyncio.TimeoutError:
            raise StreamError(f"no token from the cluster for {self._timeout:.0f} s") from None

    def _apply(self, event) -> Delta:
        if event.error:
            raise StreamError(event.error)
        delta = Delta(index=self.index)
        logprobs = event.logprobs or []
        for i, token in enumerate(event.tokens):
            self.usage.completion_tokens += 1
            delta.tokens.append(token)
            if i < len(logprobs):
                delta.logprobs.append(logprobs[i])
            delta.text += self._stops.feed(self._detok.add([token]))
            if self._stops.stopped:
                self.finish_reason = delta.finish_reason = "stop"
                return delta
        if event.usage is not None:
            self._take_usage(event.usage, final=bool(event.finish_reason))
        if event.finish_reason:
            if event.finish_reason not in ("stop", "length"):
                raise StreamError(f"the cluster ended the request ({event.finish_reason})")
            delta.text += self._stops.feed(self._detok.finish())
            if not self._stops.stopped:
                delta.text += self._stops.flush()
            self.finish_reason = delta.finish_reason = "stop" if self._stops.stopped else event.finish_reason
        return delta

    def _take_usage(self, usage, final: bool) -> None:
        # A mid-stream usage of a migrated request counts its resubmitted prompt; the
        # client's prompt bounds what can have been cached.
        self.usage.cached_tokens = min(int(getattr(usage, "cached_prompt_tokens", 0) or 0), self.usage.prompt_tokens)
        if final:
            self.usage.prompt_tokens = int(getattr(usage, "prompt_tokens", self.usage.prompt_tokens))
            self.usage.completion_tokens = int(getattr(usage, "completion_tokens", self.usage.completion_tokens))
