"""The agent-facing API through `tandem serve` (broker, a prefill and a decode worker, the
edge), driven by the official ``openai`` client: structured output validated with
``jsonschema`` (also across a killed decode worker), penalties, tool calls."""

from __future__ import annotations

import json
import os
import signal
import time

import jsonschema
import pytest
from openai import OpenAI

from tests.http.schemas import SCHEMAS
from tests.ops.test_serve import Serve, free_port_block, pids_in_session

MESSAGES = [{"role": "user", "content": "Describe it as JSON."}]
FAST = [0, 6, 10, 16]  # nested array of objects, anyOf, $defs: the default suite's share of the 20


@pytest.fixture(scope="module")
def served(tiny_model_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("serve")
    port = free_port_block(1)
    s = Serve(["--model", str(tiny_model_dir), "--base-port", str(free_port_block(12)), "--port", str(port),
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
    args = dict(model="tiny", messages=MESSAGES, response_format=_fmt(i), max_tokens=400, temperature=0.9, seed=seed)
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


@pytest.mark.parametrize("which", [pytest.param(FAST[:1], id="one"),
                                   pytest.param(range(len(SCHEMAS)), id="twenty", marks=pytest.mark.slow)])
def test_schema_holds_when_the_decode_worker_dies_mid_stream(served, which):
    client = _client(served)
    for i in which:
        # The same request, undisturbed, first: the migrated stream must be exactly it.
        want = _ask(client, i, True, seed=7)
        args = dict(model="tiny", messages=MESSAGES, response_format=_fmt(i), max_tokens=400, temperature=0.9,
                    seed=7, stream=True)
        text, finish, killed = "", None, False
        for chunk in client.chat.completions.create(**args):
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
                finish = chunk.choices[0].finish_reason or finish
            if not killed and len(text) >= 3:
                os.kill(_decode_pid(served), signal.SIGKILL)
                killed = True
        assert killed
        _check(i, text, finish)
        assert (text, finish) == want
        served.wait_for("restarting it")
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
