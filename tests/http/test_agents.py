"""The agent-facing API through `tandem serve` (broker, a prefill and a decode worker, the
edge), driven by the official ``openai`` client: structured output validated with
``jsonschema`` (also across a killed decode worker), penalties, tool calls."""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import jsonschema
import pytest
from openai import OpenAI

from tests.http.schemas import SCHEMAS
from tests.ops.test_serve import Serve, free_port_block, pids_in_session

MESSAGES = [{"role": "user", "content": "Describe it as JSON."}]
FAST = [0, 6, 10, 16]
# Penalties too: their state (the generated tokens) must travel with a migrated request.
PENALTIES = {"presence_penalty": 0.4, "frequency_penalty": 0.3, "extra_body": {"repetition_penalty": 1.1}}  # nested array of objects, anyOf, $defs: the default suite's share of the 20


@pytest.fixture(scope="module")
def served(tiny_model_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("serve")
    base = free_port_block(13)
    port = base + 12  # from the same block: two separate picks can overlap
    s = Serve(["--model", str(tiny_model_dir), "--base-port", str(base), "--port", str(port),
               "--served-model-name", "tiny"], tmp)
    s.url = f"http://127.0.0.1:{port}"
    try:
        s.wait_for("ready: http://")
        yield s
    finally:
        s.stop()


def _client(served) -> OpenAI:
    return OpenAI(base_url=served.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def _fmt(i: int) -> dict:
    return {"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": SCHEMAS[i], "strict": True}}


def _ask(client, i: int, stream: bool, seed: int) -> tuple[str, str]:
    args = dict(model="tiny", messages=MESSAGES, response_format=_fmt(i), max_tokens=400, temperature=0.9, seed=seed,
                **PENALTIES)
    if not stream:
        r = client.chat.completions.create(**args)
        return r.choices[0].message.content, r.choices[0].finish_reason
    text, finish = "", None
    for chunk in client.chat.completions.create(stream=True, **args):
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            finish = chunk.choices[0].finish_reason or finish
    return text, finish


def _check(i: int, text: str, finish: str) -> None:
    assert finish == "stop", (i, text)
    jsonschema.validate(json.loads(text), SCHEMAS[i])


def _schemas_validate(served, which):
    client = _client(served)
    for i in which:
        for stream in (False, True):
            _check(i, *_ask(client, i, stream, seed=100 + i))


def test_json_schemas_validate(served):
    _schemas_validate(served, FAST)


@pytest.mark.slow
def test_twenty_json_schemas_validate(served):
    _schemas_validate(served, range(len(SCHEMAS)))


def test_json_object_and_streamed_equals_whole(served):
    client = _client(served)
    r = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=60, temperature=0,
                                       response_format={"type": "json_object"})
    # Any object: random weights may fill a key until the budget ends, but never leave JSON.
    text = r.choices[0].message.content
    assert text.startswith("{")
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)
    assert _ask(client, 6, False, seed=5) == _ask(client, 6, True, seed=5)


def test_penalties_change_output_through_the_api(served):
    client = _client(served)

    def run(**kw):
        return client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=48, temperature=0,
                                              **kw).choices[0].message.content

    base = run()
    assert run(extra_body={"repetition_penalty": 3.0}) != base
    assert run(frequency_penalty=2.0, presence_penalty=2.0) != base
    assert run(presence_penalty=0.0) == base


def _decode_pid(served) -> int:
    pids = pids_in_session(served.proc.pid)
    served.descendants |= pids
    decode = [p for p in pids if "--role\0decode" in open(f"/proc/{p}/cmdline").read()]
    assert len(decode) == 1
    return decode[0]


@pytest.mark.parametrize("which", [pytest.param(FAST[:2], id="two"),
                                   pytest.param(range(len(SCHEMAS)), id="twenty", marks=pytest.mark.slow)])
def test_schemas_hold_when_the_decode_worker_dies_mid_stream(served, which):
    """All streams at once, the decode worker killed while every one is mid-stream: each
    continues elsewhere and ends exactly as it did undisturbed (grammar, penalties and
    seeded sampling resume where they were), valid against its schema."""
    client = _client(served)
    which = list(which)
    want = {i: _ask(client, i, False, seed=7) for i in which}
    started = {i: threading.Event() for i in which}
    got: dict[int, tuple] = {}

    def stream(i):
        text, finish = "", None
        try:
            for chunk in client.chat.completions.create(model="tiny", messages=MESSAGES, response_format=_fmt(i),
                                                        max_tokens=400, temperature=0.9, seed=7, stream=True,
                                                        **PENALTIES):
                if chunk.choices:
                    text += chunk.choices[0].delta.content or ""
                    finish = chunk.choices[0].finish_reason or finish
                if text:
                    started[i].set()
            got[i] = (text, finish)
        finally:
            started[i].set()

    threads = [threading.Thread(target=stream, args=(i,)) for i in which]
    for t in threads:
        t.start()
    for i in which:
        assert started[i].wait(120)
    running = [i for i in which if i not in got]
    os.kill(_decode_pid(served), signal.SIGKILL)
    for t in threads:
        t.join(300)
    assert running, "every stream ended before the kill: nothing was migrated"
    for i in which:
        _check(i, *got[i])
        assert got[i] == want[i], i
    served.wait_for("decode-0 was killed by signal 9")
    _wait_ready(served)


def _wait_ready(served, timeout=120):
    import urllib.request

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(served.url + "/ready", timeout=5) as r:
                if r.status == 200:
                    return
        except Exception:
            pass
        time.sleep(0.5)
    raise AssertionError("the stack did not become ready again")


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                                    "unit": {"enum": ["C", "F"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"type": "integer", "minimum": -12,
                                                                                 "maximum": 12}},
                                       "required": ["zone"], "additionalProperties": False}}}
SCHEMA_OF = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}


def _calls(client, messages, stream: bool, **kw):
    args = dict(model="tiny", messages=messages, tools=[WEATHER, TIME], max_tokens=300, temperature=0.8, seed=11, **kw)
    if not stream:
        r = client.chat.completions.create(**args)
        msg = r.choices[0].message
        return msg.content, [(c.function.name, c.function.arguments) for c in msg.tool_calls or []], r.choices[0].finish_reason
    content, calls, finish = "", {}, None
    for chunk in client.chat.completions.create(stream=True, **args):
        if not chunk.choices:
            continue
        d = chunk.choices[0].delta
        content += d.content or ""
        for tc in d.tool_calls or []:  # assembled the way OpenAI's clients do: by index, arguments appended
            slot = calls.setdefault(tc.index, ["", ""])
            slot[0] += tc.function.name or ""
            slot[1] += tc.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    return content or None, [tuple(calls[i]) for i in sorted(calls)], finish


def test_tool_call_round_trip_streamed_and_not(served):
    client = _client(served)
    messages = [{"role": "user", "content": "Weather and time in Paris?"}]
    for choice in ("required", {"type": "function", "function": {"name": "get_time"}}):
        # One call: with random weights, "another call?" may be answered yes until the budget ends.
        whole = _calls(client, messages, False, tool_choice=choice, parallel_tool_calls=False)
        assert _calls(client, messages, True, tool_choice=choice, parallel_tool_calls=False) == whole
        content, calls, finish = whole
        assert finish == "tool_calls" and calls
        for name, arguments in calls:
            assert choice == "required" or name == "get_time"
            jsonschema.validate(json.loads(arguments), SCHEMA_OF[name])
    # The calls go back with their results; the model answers in text.
    ids = [f"call_{i}" for i in range(len(calls))]
    messages += [{"role": "assistant", "content": None, "tool_calls": [
        {"id": i, "type": "function", "function": {"name": n, "arguments": a}} for i, (n, a) in zip(ids, calls)]}]
    messages += [{"role": "tool", "tool_call_id": i, "content": "sunny, 21"} for i in ids]
    answer = _calls(client, messages, False, tool_choice="none")
    assert _calls(client, messages, True, tool_choice="none") == answer
    assert answer[0] and answer[1] == [] and answer[2] in ("stop", "length")
