"""An in-process stand-in for the wire client, for unit tests of the edge only.

It streams a deterministic token script: ``script(prompt_tokens)`` gives the tokens a
request produces; events carry ``chunk`` tokens each; EOS ends a request unless
``ignore_eos``; ``max_tokens`` ends it with "length". Failure modes are switches.
"""

from __future__ import annotations

import asyncio
import math
from typing import Callable

from tandem.http.backend import Busy, StreamEvent, Unavailable
from tandem.kvtypes import TokenLogprob, Usage


class FakeBackend:
    def __init__(
        self,
        script: Callable[[list[int]], list[int]],
        *,
        eos: int | None = None,
        chunk: int = 2,
        cached: int = 0,
        delay_s: float = 0.0,
        first_delay_s: float = 0.0,
    ):
        self.script = script
        self.eos = eos
        self.chunk = chunk
        self.cached = cached
        self.delay_s = delay_s
        self.first_delay_s = first_delay_s
        self.busy: tuple[str, float] | None = None
        self.unavailable = False
        self.fail_after: int | None = None  # tokens streamed before an error event
        self.submitted: list[tuple[bytes, list[int], object, int]] = []
        self.active: set[bytes] = set()
        self.aborted: list[bytes] = []
        self.started = 0
        self.closed = 0
        self.stats_reply: dict = {"workers": [{"running": 1, "waiting": 0, "free_blocks": 30, "total_blocks": 40,
                                                "prefix_queries": 4, "prefix_hits": 1, "address": "tcp://10.0.0.1:1"}],
                                  "queued": 0}
        self.ready_reply: dict = {"broker": True, "workers": {"prefill": 0, "decode": 0, "hybrid": 1}}

    async def start(self):
        self.started += 1

    async def close(self):
        self.closed += 1

    async def generate(self, prompt_tokens, sampling, *, priority=0, request_id=None):
        if self.unavailable:
            raise Unavailable("broker unreachable (fake)")
        if self.busy:
            raise Busy(*self.busy)
        self.submitted.append((request_id, list(prompt_tokens), sampling, priority))
        self.active.add(request_id)
        try:
            tokens = self.script(list(prompt_tokens))
            out: list[int] = []
            finish = "length"
            for t in tokens:
                if len(out) >= sampling.max_tokens:
                    break
                out.append(t)
                if t == self.eos and not sampling.ignore_eos:
                    finish = "stop"
                    break
            await asyncio.sleep(self.first_delay_s)
            sent = 0
            while True:
                if request_id in self.aborted:
                    yield StreamEvent(tokens=[], logprobs=None, finish_reason="abort", usage=self._usage(prompt_tokens, sent), error=None)
                    return
                if self.fail_after is not None and sent >= self.fail_after:
                    yield StreamEvent(tokens=[], logprobs=None, finish_reason="error", usage=None, error="worker died (fake)")
                    return
                piece = out[sent:sent + self.chunk]
                sent += len(piece)
                done = sent >= len(out)
                yield StreamEvent(
                    tokens=piece,
                    logprobs=[self._logprob(t, sampling.logprobs) for t in piece] if sampling.logprobs is not None else None,
                    finish_reason=finish if done else None,
                    usage=self._usage(prompt_tokens, sent) if done else None,
                    error=None,
                )
                if done:
                    return
                await asyncio.sleep(self.delay_s)
        finally:
            self.active.discard(request_id)

    def _usage(self, prompt, completion):
        return Usage(prompt_tokens=len(prompt), completion_tokens=completion, cached_prompt_tokens=self.cached)

    @staticmethod
    def _logprob(token: int, top: int) -> TokenLogprob:
        alts = [(token, -0.5)] + [(token + k + 1, -1.0 - k) for k in range(max(top - 1, 0))]
        return TokenLogprob(token=token, logprob=math.log(0.6), top=alts[:top])

    async def abort(self, request_id: bytes):
        self.aborted.append(request_id)

    async def stats(self):
        if self.unavailable:
            raise Unavailable("fake")
        return self.stats_reply

    async def ready(self):
        if self.unavailable:
            raise Unavailable("fake")
        return self.ready_reply
