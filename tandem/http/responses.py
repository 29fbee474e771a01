"""OpenAI response shapes: completion objects, stream chunks, usage, logprobs."""

from __future__ import annotations

import json
import time
import uuid

import tandem
from tandem.http.generation import ChoiceUsage, Delta
from tandem.http.tokenizer import EdgeTokenizer

FINGERPRINT = f"tandem-{tandem.__version__}"


def dumps(obj) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


def usage_body(groups: list[list[ChoiceUsage]]) -> dict:
    """Usage over prompts (one group of n choices each): a prompt is counted once, as
    OpenAI does for n > 1; its cached tokens are those every one of its choices reused."""
    prompt = sum(g[0].prompt_tokens for g in groups if g)
    cached = sum(min(c.cached_tokens for c in g) for g in groups if g)
    completion = sum(c.completion_tokens for g in groups for c in g)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


def _token_label(tok: EdgeTokenizer, token: int) -> tuple[str, list[int]]:
    raw = tok.raw_bytes(token)
    try:
        return raw.decode("utf-8"), list(raw)
    except UnicodeDecodeError:
        # A piece of a multi-byte character: name its bytes, as OpenAI does.
        return "bytes:" + "".join(f"\\x{b:02x}" for b in raw), list(raw)


class Formatter:
    """Builds every object of one response; holds the id, clock and per-choice offsets."""

    def __init__(self, kind: str, model: str, tokenizer: EdgeTokenizer, include_usage: bool = False):
        self.kind = kind
        self.model = model
        self.tok = tokenizer
        self.include_usage = include_usage
        self.id = ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self._offsets: dict[int, int] = {}

    # -- logprobs --------------------------------------------------------------

    def logprobs(self, delta: Delta) -> dict | None:
        if self.kind == "chat":
            content = []
            for lp in delta.logprobs:
                text, raw = _token_label(self.tok, lp.token)
                top = []
                for token, value in lp.top:
                    t_text, t_raw = _token_label(self.tok, token)
                    top.append({"token": t_text, "logprob": float(value), "bytes": t_raw})
                content.append({"token": text, "logprob": float(lp.logprob), "bytes": raw, "top_logprobs": top})
            return {"content": content, "refusal": None}
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        offset = self._offsets.get(delta.index, 0)
        for lp in delta.logprobs:
            text, _ = _token_label(self.tok, lp.token)
            out["tokens"].append(text)
            out["token_logprobs"].append(float(lp.logprob))
            out["top_logprobs"].append({_token_label(self.tok, t)[0]: float(v) for t, v in lp.top})
            out["text_offset"].append(offset)
            offset += len(self.tok.token_text(lp.token))
        self._offsets[delta.index] = offset
        return out

    # -- streaming -------------------------------------------------------------

    def _chunk(self, choices: list[dict]) -> dict:
        obj = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
        chunk = {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                 "system_fingerprint": FINGERPRINT, "choices": choices}
        if self.include_usage:
            chunk["usage"] = None
        return chunk

    def role_chunk(self, index: int) -> dict:
        return self._chunk([{"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}])

    def delta_chunks(self, delta: Delta, with_logprobs: bool) -> list[dict]:
        """One chunk for the delta's text (if any), one for its finish reason (if any)."""
        out = []
        if delta.text or (with_logprobs and delta.logprobs):
            lp = self.logprobs(delta) if with_logprobs else None
            if self.kind == "chat":
                choice = {"index": delta.index, "delta": {"content": delta.text}, "logprobs": lp, "finish_reason": None}
            else:
                choice = {"index": delta.index, "text": delta.text, "logprobs": lp, "finish_reason": None}
            out.append(self._chunk([choice]))
        if delta.finish_reason:
            out.append(self.finish_chunk(delta.index, delta.finish_reason))
        return out

    def parts_chunks(self, index: int, parts, first_call: int, lp: dict | None = None) -> list[dict]:
        """Chat chunks for a shaped delta: reasoning, content (with the delta's logprobs),
        then one chunk per completed tool call, numbered from ``first_call``."""
        out = []
        if parts.reasoning:
            out.append(self._chunk([{"index": index, "delta": {"reasoning_content": parts.reasoning},
                                     "logprobs": None, "finish_reason": None}]))
        if parts.content or lp is not None:
            out.append(self._chunk([{"index": index, "delta": {"content": parts.content}, "logprobs": lp,
                                     "finish_reason": None}]))
        for k, call in enumerate(parts.tool_calls):
            out.append(self._chunk([{"index": index, "delta": {"tool_calls": [call.body(first_call + k)]},
                                     "logprobs": None, "finish_reason": None}]))
        return out

    def finish_chunk(self, index: int, finish_reason: str) -> dict:
        if self.kind == "chat":
            return self._chunk([{"index": index, "delta": {}, "logprobs": None, "finish_reason": finish_reason}])
        return self._chunk([{"index": index, "text": "", "logprobs": None, "finish_reason": finish_reason}])

    def usage_chunk(self, usage: dict) -> dict:
        chunk = self._chunk([])
        chunk["usage"] = usage
        return chunk

    # -- whole response --------------------------------------------------------

    def completion(self, choices: list[dict], usage: dict) -> dict:
        obj = "chat.completion" if self.kind == "chat" else "text_completion"
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "system_fingerprint": FINGERPRINT, "choices": choices, "usage": usage}

    def choice(self, index: int, text: str, finish_reason: str, logprobs: dict | None, parts=None) -> dict:
        """``parts``: the shaped message (reasoning, tool calls) of a chat choice, if shaped."""
        if self.kind == "chat":
            message = {"role": "assistant", "content": text, "refusal": None}
            if parts is not None:
                message["content"] = parts.content if parts.content.strip() or not parts.tool_calls else None
                if parts.reasoning:
                    message["reasoning_content"] = parts.reasoning
                if parts.tool_calls:
                    message["tool_calls"] = [c.body(k) for k, c in enumerate(parts.tool_calls)]
                    for c in message["tool_calls"]:
                        del c["index"]
            return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": finish_reason}
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}


def error_chunk(message: str, type_: str = "server_error", code: str | None = "stream_error") -> dict:
    return {"error": {"message": message, "type": type_, "param": None, "code": code}}
