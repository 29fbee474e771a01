"""OpenAI request bodies → a validated :class:`Job`.

Every field OpenAI defines is either honoured or refused with a 400 that names it;
nothing is silently ignored. Unknown fields are refused the way OpenAI refuses them.
Extensions (``top_k``, ``min_p``, ``ignore_eos``, ``repetition_penalty``) are documented in docs/http.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from tandem.http.errors import ApiError, bad_request, unsupported
from tandem.http.settings import EdgeSettings
from tandem.http.structured import response_format_grammar
from tandem.http.tools import Tools, parse_message_tool_calls, parse_tools
from tandem.wire.protocol import MAX_REPETITION_PENALTY, MIN_REPETITION_PENALTY
from tandem.kvtypes import SamplingParams

_COMMON = {
    "model", "max_tokens", "temperature", "top_p", "seed", "stop", "n", "stream", "stream_options",
    "user", "presence_penalty", "frequency_penalty", "logit_bias", "logprobs",
    "top_k", "min_p", "ignore_eos", "repetition_penalty",  # extensions
}
_CHAT_ONLY = {
    "messages", "max_completion_tokens", "top_logprobs", "response_format", "tools", "tool_choice",
    "parallel_tool_calls", "functions", "function_call", "store", "metadata", "service_tier",
    "modalities", "audio", "prediction", "reasoning_effort", "web_search_options",
}
_COMPLETION_ONLY = {"prompt", "echo", "suffix", "best_of"}
_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}
MAX_TOP_LOGPROBS = 20
MAX_COMPLETION_LOGPROBS = 5


@dataclass
class Job:
    """One validated request: what to generate and how to answer."""

    kind: str  # "chat" | "completion"
    model: str
    n: int
    stream: bool
    include_usage: bool
    stop: list[str]
    sampling: SamplingParams
    logprobs: bool
    max_tokens: int | None  # None: the default, capped by the context left
    messages: list[dict] | None = None
    prompts: list[Any] = field(default_factory=list)  # completions: str or list[int] per prompt
    user: str | None = None
    tools: Tools | None = None
    thinking: bool = False  # the rendered prompt opened the model's reasoning block


def _num(body: dict, name: str, lo: float, hi: float, default: float, *, lo_open: bool = False) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise bad_request(f"{name!r} must be a number", name, "invalid_type")
    if value < lo or value > hi or (lo_open and value == lo):
        low = "(" if lo_open else "["
        raise bad_request(f"{name!r} must be in {low}{lo}, {hi}]; got {value}", name)
    return float(value)


def _int(body: dict, name: str, lo: int, hi: int | None = None) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad_request(f"{name!r} must be an integer", name, "invalid_type")
    if value < lo or (hi is not None and value > hi):
        bound = f"between {lo} and {hi}" if hi is not None else f"at least {lo}"
        raise bad_request(f"{name!r} must be {bound}; got {value}", name)
    return value


def _bool(body: dict, name: str, default: bool = False) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise bad_request(f"{name!r} must be true or false", name, "invalid_type")
    return value


def _refuse_set(body: dict, name: str, allowed: tuple = (), why: str = "") -> None:
    value = body.get(name)
    if value is None or value in allowed or value == [] or value == {}:
        return
    raise unsupported(name, why)


def _stops(body: dict, settings: EdgeSettings) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise bad_request("'stop' must be a string or a list of strings", "stop", "invalid_type")
    if len(stops) > settings.max_stop:
        raise bad_request(f"'stop' may hold at most {settings.max_stop} strings; got {len(stops)}", "stop")
    if any(s == "" for s in stops):
        raise bad_request("'stop' strings must not be empty", "stop")
    return list(dict.fromkeys(stops))


def _logit_bias(body: dict) -> dict[int, float]:
    bias = body.get("logit_bias")
    if bias is None:
        return {}
    if not isinstance(bias, dict):
        raise bad_request("'logit_bias' must map token ids to numbers", "logit_bias", "invalid_type")
    out: dict[int, float] = {}
    for key, value in bias.items():
        try:
            token = int(key)
        except (TypeError, ValueError):
            raise bad_request(f"'logit_bias' key {key!r} is not a token id", "logit_bias") from None
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not -100 <= value <= 100:
            raise bad_request(f"'logit_bias' value for {key} must be a number in [-100, 100]", "logit_bias")
        out[token] = float(value)
    return out


def _common(body: Any, kind: str, settings: EdgeSettings) -> dict:
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object", None, "invalid_type")
    known = _COMMON | (_CHAT_ONLY if kind == "chat" else _COMPLETION_ONLY)
    for name in body:
        if name not in known:
            raise ApiError(400, f"Unrecognized request argument supplied: {name}", param=name, code="unknown_parameter")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad_request("'model' is required and must be a string", "model", "missing_required_parameter" if model is None else "invalid_type")
    stream = _bool(body, "stream")
    options = body.get("stream_options")
    include_usage = False
    if options is not None:
        if not stream:
            raise bad_request("'stream_options' is only allowed when 'stream' is true", "stream_options")
        if not isinstance(options, dict):
            raise bad_request("'stream_options' must be an object", "stream_options", "invalid_type")
        for key in options:
            if key != "include_usage":
                raise unsupported(f"stream_options.{key}")
        include_usage = _bool(options, "include_usage")
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise bad_request("'user' must be a string", "user", "invalid_type")
    return {
        "model": model,
        "n": _int(body, "n", 1, settings.max_n) or 1,
        "stream": stream,
        "include_usage": include_usage,
        "stop": _stops(body, settings),
        "user": user,
    }


def _sampling(body: dict, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise bad_request("'seed' must be an integer", "seed", "invalid_type")
    if seed is not None and not -(2**63) <= seed < 2**63:
        raise bad_request("'seed' must fit in a signed 64-bit integer", "seed")
    return SamplingParams(
        temperature=_num(body, "temperature", 0.0, 2.0, 1.0),
        top_p=_num(body, "top_p", 0.0, 1.0, 1.0, lo_open=True),
        top_k=_int(body, "top_k", 0, 1 << 31) or 0,
        min_p=_num(body, "min_p", 0.0, 1.0, 0.0),
        seed=seed,
        max_tokens=max_tokens or 0,
        logit_bias=_logit_bias(body),
        logprobs=logprobs,
        ignore_eos=_bool(body, "ignore_eos"),
        presence_penalty=_num(body, "presence_penalty", -2.0, 2.0, 0.0),
        frequency_penalty=_num(body, "frequency_penalty", -2.0, 2.0, 0.0),
        repetition_penalty=_num(body, "repetition_penalty", MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY, 1.0),
    )


def _message(i: int, msg: Any) -> dict:
    where = f"messages[{i}]"
    if not isinstance(msg, dict):
        raise bad_request(f"{where} must be an object with 'role' and 'content'", where, "invalid_type")
    role = msg.get("role")
    if not isinstance(role, str) or role not in _ROLES:
        if role == "function":
            raise unsupported(f"{where}.role", "the legacy 'function' role is not served; send role 'tool'")
        raise bad_request(f"{where}.role must be one of system, developer, user, assistant, tool; got {role!r}", f"{where}.role")
    allowed = {"role", "content", "name"} | ({"tool_calls"} if role == "assistant" else set()) | (
        {"tool_call_id"} if role == "tool" else set())
    for key in msg:
        if key not in allowed:
            if key in ("tool_calls", "function_call", "refusal", "audio") and msg[key] in (None, []):
                continue
            raise unsupported(f"{where}.{key}")
    calls = parse_message_tool_calls(where, msg["tool_calls"]) if msg.get("tool_calls") else None
    content = msg.get("content")
    if content is None and calls:
        content = ""
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise unsupported(f"{where}.content[{j}]", f"only text parts are accepted, got {kind!r}")
            parts.append(part["text"])
        content = "".join(parts)
    if not isinstance(content, str):
        raise bad_request(f"{where}.content must be a string or a list of text parts", f"{where}.content", "invalid_type")
    out = {"role": _ROLES[role], "content": content}
    if calls:
        out["tool_calls"] = calls
    if role == "tool":
        call_id = msg.get("tool_call_id")
        if not isinstance(call_id, str) or not call_id:
            raise bad_request(f"{where}.tool_call_id is required for role 'tool'", f"{where}.tool_call_id",
                              "missing_required_parameter" if call_id is None else "invalid_type")
        out["tool_call_id"] = call_id
    if msg.get("name") is not None:
        if not isinstance(msg["name"], str):
            raise bad_request(f"{where}.name must be a string", f"{where}.name", "invalid_type")
        out["name"] = msg["name"]
    return out


def parse_chat(body: Any, settings: EdgeSettings) -> Job:
    common = _common(body, "chat", settings)
    messages = body.get("messages")
    # One code per fault, each with its own message (as for 'prompt').
    if messages is None:
        raise bad_request("'messages' is required", "messages", "missing_required_parameter")
    if not isinstance(messages, list):
        raise bad_request("'messages' must be a list of messages", "messages", "invalid_type")
    if not messages:
        raise bad_request("'messages' must not be empty", "messages", "invalid_value")
    parsed = [_message(i, m) for i, m in enumerate(messages)]
    tools = parse_tools(body)
    _refuse_set(body, "store", (False,), "completions are never stored")
    _refuse_set(body, "metadata", why="metadata only applies to stored completions")
    _refuse_set(body, "service_tier", ("auto", "default"))
    _refuse_set(body, "modalities", (["text"],), "only text output")
    for name in ("audio", "prediction", "reasoning_effort", "web_search_options"):
        _refuse_set(body, name)
    grammar = response_format_grammar(body.get("response_format"))
    forced = tools.grammar() if tools is not None else None
    if forced is not None:
        if grammar is not None:
            raise bad_request("'response_format' cannot be combined with a forced 'tool_choice'", "response_format")
        grammar = forced
    max_tokens = _int(body, "max_tokens", 1)
    max_completion = _int(body, "max_completion_tokens", 1)
    if max_tokens is not None and max_completion is not None and max_tokens != max_completion:
        raise bad_request("'max_tokens' and 'max_completion_tokens' disagree; send one of them", "max_completion_tokens")
    want_logprobs = _bool(body, "logprobs")
    top = _int(body, "top_logprobs", 0, MAX_TOP_LOGPROBS)
    if top is not None and not want_logprobs:
        raise bad_request("'top_logprobs' requires 'logprobs': true", "top_logprobs")
    limit = max_completion if max_completion is not None else max_tokens
    sampling = _sampling(body, limit, (top or 0) if want_logprobs else None)
    sampling.grammar = grammar
    return Job(kind="chat", tools=tools, sampling=sampling, logprobs=want_logprobs, max_tokens=limit, messages=parsed, **common)


def parse_completion(body: Any, settings: EdgeSettings) -> Job:
    common = _common(body, "completion", settings)
    prompt = body.get("prompt")
    if prompt is None:
        raise bad_request("'prompt' is required", "prompt", "missing_required_parameter")
    if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and all(_is_token(t) for t in prompt)):
        prompts = [prompt]
    elif isinstance(prompt, list) and prompt and all(
        isinstance(p, str) or (isinstance(p, list) and p and all(_is_token(t) for t in p)) for p in prompt
    ):
        prompts = list(prompt)
    else:
        raise bad_request("'prompt' must be a string, a list of strings, a list of token ids, or a list of such lists", "prompt", "invalid_type")
    if any(p == "" for p in prompts):
        raise bad_request("'prompt' must not be empty", "prompt")
    if _bool(body, "echo"):
        raise unsupported("echo", "prompt echo with logprobs is not implemented")
    _refuse_set(body, "suffix", why="insertion (suffix) is not implemented")
    best_of = _int(body, "best_of", 1)
    if best_of is not None and best_of != common["n"]:
        raise unsupported("best_of", "only best_of equal to n")
    logprobs = _int(body, "logprobs", 0, MAX_COMPLETION_LOGPROBS)
    max_tokens = _int(body, "max_tokens", 1)
    sampling = _sampling(body, max_tokens, logprobs)
    return Job(kind="completion", sampling=sampling, logprobs=logprobs is not None, max_tokens=max_tokens, prompts=prompts, **common)


def _is_token(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
