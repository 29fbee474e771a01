"""POST /v1/chat/completions and /v1/completions: validate, tokenize, fan out, answer.

Every choice is submitted, and its first event awaited, before the response starts:
BUSY and an unreachable broker arrive before the first event, so they can still
become a 503. After that the response is committed; a failure becomes an SSE error
event followed by ``[DONE]`` (or a 500 body for a non-streaming request).
"""

from __future__ import annotations

import asyncio
import json
import logging

import falcon
from falcon.asgi import SSEvent

from tandem.http.backend import Busy, InvalidRequest, StreamError, Unavailable
from tandem.http.errors import ApiError, bad_request, busy, unavailable
from tandem.http.generation import Choice, Delta
from tandem.http.message import MessageShaper
from tandem.http.protocol import Job, parse_chat, parse_completion
from tandem.http.structured import check_grammar
from tandem.http.responses import Formatter, dumps, error_chunk, usage_body

log = logging.getLogger("tandem.edge")
PRIORITY_RANGE = (-100, 100)
MAX_CHOICES = 64  # prompts x n of one request: each is a separate request on the cluster
_END = object()


async def read_json(req: falcon.asgi.Request, limit: int):
    """The body as JSON, refusing oversized bodies before reading them whole."""
    if req.content_length is not None and req.content_length > limit:
        raise ApiError(413, f"request body is {req.content_length} bytes; the limit is {limit}", code="request_too_large")
    data = await req.stream.read(limit + 1)
    if len(data) > limit:
        raise ApiError(413, f"request body exceeds the limit of {limit} bytes", code="request_too_large")
    if not data:
        raise bad_request("the request body is empty; send a JSON object", None, "invalid_json")
    try:
        return json.loads(data)
    except (UnicodeDecodeError, ValueError) as exc:
        raise bad_request(f"the request body is not valid JSON ({exc})", None, "invalid_json") from None
    except RecursionError:
        raise bad_request("the request body nests too deeply", None, "invalid_json") from None


def priority_of(req: falcon.asgi.Request) -> int:
    raw = req.get_header("X-Priority")
    if raw is None:
        return 0
    try:
        value = int(raw.strip())
    except ValueError:
        raise bad_request(f"X-Priority must be an integer; got {raw!r}", "X-Priority") from None
    lo, hi = PRIORITY_RANGE
    if not lo <= value <= hi:
        raise bad_request(f"X-Priority must be between {lo} and {hi}; got {value}", "X-Priority")
    return value


class CompletionsResource:
    def __init__(self, edge, kind: str):
        self.edge = edge  # tandem.http.app.Edge: settings, tokenizer, metrics, backend
        self.kind = kind

    async def on_post(self, req: falcon.asgi.Request, resp: falcon.asgi.Response) -> None:
        edge = self.edge
        settings = edge.settings
        try:
            body = await read_json(req, settings.max_request_bytes)
            job = (parse_chat if self.kind == "chat" else parse_completion)(body, settings)
            if job.model != edge.model_name:
                raise ApiError(404, f"model {job.model!r} is not served here; this server serves {edge.model_name!r}",
                               param="model", code="model_not_found")
            priority = priority_of(req)
            vocab = edge.tokenizer.vocab_size
            bad = next((t for t in job.sampling.logit_bias if not 0 <= t < vocab), None)
            if bad is not None:
                raise bad_request(f"'logit_bias' names token {bad}, outside the vocabulary (0..{vocab - 1})", "logit_bias")
            if job.sampling.grammar is not None:
                forced = job.tools is not None and job.tools.choice in ("required", "named")
                await asyncio.to_thread(check_grammar, job.sampling.grammar, edge.grammar_tokenizer,
                                        "tools" if forced else "response_format")
            if len(job.prompts) * job.n > MAX_CHOICES:
                raise bad_request(f"a request may ask for at most {MAX_CHOICES} completions (prompts x n); "
                                  f"this one asks for {len(job.prompts) * job.n}", "prompt")
            prompts = await asyncio.to_thread(self._tokenize, job)
            limits = [self._max_tokens(job, p) for p in prompts]
        except ApiError as err:
            edge.metrics.refuse(err.code or "invalid_request")
            raise
        if job.user:
            log.debug("request for user %r: %d prompt(s) x n=%d", job.user, len(prompts), job.n)
        try:
            backend = await edge.get_backend()
        except Exception as exc:
            log.warning("wire client unavailable: %s", exc)
            edge.metrics.refuse("unavailable")
            raise unavailable(str(exc) or type(exc).__name__) from None
        choices = []
        for p_idx, (prompt, limit) in enumerate(zip(prompts, limits)):
            for i in range(job.n):
                sampling = _with(job, limit, i)
                choices.append(Choice(backend, edge.tokenizer, edge.metrics, index=p_idx * job.n + i,
                                      prompt_tokens=prompt, sampling=sampling, stops=job.stop,
                                      priority=priority, request_timeout_s=settings.request_timeout_s))
        await self._start(choices)
        fmt = Formatter(self.kind, edge.model_name, edge.tokenizer, include_usage=job.include_usage)
        if job.stream:
            resp.content_type = "text/event-stream"
            resp.set_header("Cache-Control", "no-cache")
            resp.set_header("X-Accel-Buffering", "no")
            resp.sse = self._stream(job, choices, fmt)
        else:
            resp.content_type = falcon.MEDIA_JSON
            resp.text = dumps(await self._collect(job, choices, fmt))

    def _tokenize(self, job: Job) -> list[list[int]]:
        tok = self.edge.tokenizer
        if job.kind == "chat":
            try:
                text = tok.render_chat(job.messages, job.tools)
                prompts = [tok.encode_chat(text)]
                markers = self.edge.reasoning
                job.thinking = markers is not None and text.rstrip().endswith(markers[0])
            except ValueError as exc:
                raise bad_request(str(exc), "messages") from None
            except Exception as exc:  # a template may raise on an unexpected role order
                raise bad_request(f"the chat template rejected these messages: {exc}", "messages") from None
        else:
            prompts = [tok.encode(p) if isinstance(p, str) else list(p) for p in job.prompts]
        vocab = tok.vocab_size
        for p in prompts:
            if not p:
                raise bad_request("the prompt encodes to no tokens", "prompt")
            bad = next((t for t in p if not 0 <= t < vocab), None)
            if bad is not None:
                raise bad_request(f"token id {bad} is outside the vocabulary (0..{vocab - 1})", "prompt")
        return prompts

    def _max_tokens(self, job: Job, prompt: list[int]) -> int:
        context = self.edge.tokenizer.context_length
        param = "messages" if job.kind == "chat" else "prompt"
        if context is None:
            return job.max_tokens or self.edge.settings.default_max_tokens
        room = context - len(prompt)
        if room < 1:
            raise ApiError(400, f"this model's context is {context} tokens and the prompt alone has {len(prompt)}; shorten it",
                           param=param, code="context_length_exceeded")
        if job.max_tokens is None:
            return min(self.edge.settings.default_max_tokens, room)
        if job.max_tokens > room:
            raise ApiError(400, f"this model's context is {context} tokens; the prompt has {len(prompt)} and "
                           f"max_tokens asks for {job.max_tokens} more; lower max_tokens to at most {room}",
                           param="max_tokens", code="context_length_exceeded")
        return job.max_tokens

    async def _start(self, choices: list[Choice]) -> None:
        try:
            results = await asyncio.gather(*(c.start() for c in choices), return_exceptions=True)
        except asyncio.CancelledError:  # the client left (or the worker stops) while queued
            await asyncio.gather(*(c.close() for c in choices), return_exceptions=True)
            raise
        failure = next((r for r in results if isinstance(r, BaseException)), None)
        if failure is None:
            return
        await asyncio.gather(*(c.close() for c in choices), return_exceptions=True)
        metrics = self.edge.metrics
        if isinstance(failure, Busy):
            metrics.refuse(failure.reason or "busy")
            raise busy(failure.reason, failure.retry_after_s, str(failure))
        if isinstance(failure, Unavailable):
            metrics.refuse("unavailable")
            raise unavailable(str(failure))
        if isinstance(failure, InvalidRequest):
            metrics.refuse("invalid_request")
            raise bad_request(f"the cluster refused the request: {failure}", None, "invalid_request")
        if isinstance(failure, StreamError):
            metrics.refuse("stream_error")
            raise ApiError(500, f"the cluster failed the request: {failure}", type="server_error", code="stream_error")
        raise failure

    def _shaper(self, job: Job) -> MessageShaper | None:
        """What splits a chat choice's text into reasoning, content and tool calls (None: plain text)."""
        tools = job.tools is not None and job.tools.choice != "none"
        if job.kind != "chat" or (self.edge.reasoning is None and not tools):
            return None
        # A grammar-forced choice is written in the grammar's (Hermes) format; otherwise the
        # model writes its own, which mlx-lm knows how to parse for many families.
        forced = job.tools is not None and job.tools.choice in ("required", "named")
        call_format = None if forced else self.edge.tokenizer.call_format
        tool_list = [{"type": "function", "function": f} for f in job.tools.functions] if tools else None
        return MessageShaper(self.edge.reasoning, job.thinking, tools, call_format, tool_list)

    async def _collect(self, job: Job, choices: list[Choice], fmt: Formatter) -> dict:
        texts = {c.index: [] for c in choices}
        lps = {c.index: [] for c in choices}

        async def run(choice: Choice) -> None:
            async for delta in choice.deltas():
                texts[choice.index].append(delta.text)
                lps[choice.index].extend(delta.logprobs)

        try:
            await asyncio.gather(*(run(c) for c in choices))
        except StreamError as exc:
            raise ApiError(500, f"the cluster failed the request: {exc}", type="server_error", code="stream_error") from None
        finally:
            await asyncio.gather(*(c.close() for c in choices), return_exceptions=True)
        body_choices = []
        for c in choices:
            lp = fmt.logprobs(Delta(index=c.index, logprobs=lps[c.index])) if job.logprobs else None
            text, parts, finish = "".join(texts[c.index]), None, c.finish_reason
            shaper = self._shaper(job)
            if shaper is not None:
                parts = shaper.take(text, final=True)
                finish = _finish(finish, shaper)
            body_choices.append(fmt.choice(c.index, text, finish, lp, parts))
        self._count(job, choices)
        return fmt.completion(body_choices, usage_body(_groups(job, choices)))

    async def _stream(self, job: Job, choices: list[Choice], fmt: Formatter):
        queue: asyncio.Queue = asyncio.Queue()
        keepalive = self.edge.settings.keepalive_s

        async def pump(choice: Choice) -> None:
            try:
                async for delta in choice.deltas():
                    queue.put_nowait(delta)
            except Exception as exc:
                queue.put_nowait(exc)
            finally:
                queue.put_nowait(_END)

        tasks = [asyncio.create_task(pump(c)) for c in choices]
        shapers = {c.index: s for c in choices if (s := self._shaper(job)) is not None}
        try:
            if job.kind == "chat":
                for c in choices:
                    yield SSEvent(text=dumps(fmt.role_chunk(c.index)))
            remaining, failed = len(tasks), False
            while remaining:
                try:
                    async with asyncio.timeout(keepalive):
                        item = await queue.get()
                except TimeoutError:
                    # A send is the only way the server learns the client left.
                    yield SSEvent(comment="keep-alive")
                    continue
                if item is _END:
                    remaining -= 1
                elif isinstance(item, Exception):
                    log.warning("stream %s failed after it started: %s", fmt.id, item)
                    message = str(item) if isinstance(item, StreamError) else "internal error; see the edge log"
                    yield SSEvent(text=dumps(error_chunk(f"the cluster failed the request: {message}")))
                    failed = True
                    break
                elif item.index in shapers:
                    for chunk in self._shaped_chunks(fmt, item, shapers[item.index], job.logprobs):
                        yield SSEvent(text=dumps(chunk))
                else:
                    for chunk in fmt.delta_chunks(item, job.logprobs):
                        yield SSEvent(text=dumps(chunk))
            if not failed:
                self._count(job, choices)
                if job.include_usage:
                    yield SSEvent(text=dumps(fmt.usage_chunk(usage_body(_groups(job, choices)))))
            yield SSEvent(text="[DONE]")
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await asyncio.gather(*(c.close() for c in choices), return_exceptions=True)

    @staticmethod
    def _shaped_chunks(fmt: Formatter, delta: Delta, shaper: MessageShaper, with_logprobs: bool) -> list[dict]:
        before = len(shaper.calls)
        parts = shaper.take(delta.text, final=bool(delta.finish_reason))
        lp = fmt.logprobs(delta) if with_logprobs and delta.logprobs else None
        out = fmt.parts_chunks(delta.index, parts, before, lp)
        if delta.finish_reason:
            out.append(fmt.finish_chunk(delta.index, _finish(delta.finish_reason, shaper)))
        return out

    def _count(self, job: Job, choices: list[Choice]) -> None:
        endpoint = "chat" if job.kind == "chat" else "completions"
        for c in choices:
            self.edge.metrics.requests.labels(endpoint=endpoint, finish_reason=c.finish_reason or "none").inc()


def _with(job: Job, limit: int, i: int):
    import dataclasses

    seed = job.sampling.seed
    return dataclasses.replace(job.sampling, max_tokens=limit, seed=None if seed is None else seed + i)


def _finish(reason: str | None, shaper: MessageShaper) -> str | None:
    """A choice that ended on its own after making calls finished to call them."""
    return "tool_calls" if reason == "stop" and shaper.calls else reason


def _groups(job: Job, choices: list[Choice]):
    return [[c.usage for c in choices[g * job.n:(g + 1) * job.n]] for g in range(len(choices) // job.n)]
