"""The edge app against an in-process fake backend (unit tests; the real stack is in test_integration.py)."""

from __future__ import annotations

import asyncio
import gc
from pathlib import Path

import pytest

from tests.http.asgi import call
from tests.http.conftest import TEXT

CHAT = {"model": "tiny", "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}], "temperature": 0}


def run(coro):
    return asyncio.run(coro)


def post(app, path, body, **kw):
    return run(call(app, "POST", path, body, **kw))


def get(app, path, **kw):
    return run(call(app, "GET", path, **kw))


def test_chat_non_streaming_text_usage_and_template(make_app, fake, edge_tokenizer):
    app = make_app(fake)
    r = post(app, "/v1/chat/completions", CHAT)
    assert r.status == 200, r.body
    body = r.json()
    assert body["object"] == "chat.completion"
    (choice,) = body["choices"]
    assert choice["message"] == {"role": "assistant", "content": TEXT, "refusal": None}
    assert choice["finish_reason"] == "stop"
    (rid, prompt, sampling, priority), = fake.submitted
    # mlx-lm's own tokenizer wrapper is the oracle for the prompt tokens.
    from mlx_lm.tokenizer_utils import load

    oracle = load(Path(edge_tokenizer.hf.name_or_path))
    expected_prompt = oracle.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}], add_generation_prompt=True)
    assert prompt == list(expected_prompt)
    assert sampling.temperature == 0.0 and priority == 0 and len(rid) == 16
    completion = len(edge_tokenizer.encode(TEXT)) + 1  # the EOS token counts, its text does not
    assert body["usage"] == {"prompt_tokens": len(prompt), "completion_tokens": completion,
                             "total_tokens": len(prompt) + completion, "prompt_tokens_details": {"cached_tokens": 2}}


def test_chat_stream_matches_non_stream_and_has_usage_chunk(make_app, fake):
    app = make_app(fake)
    r = post(app, "/v1/chat/completions", {**CHAT, "stream": True, "stream_options": {"include_usage": True}})
    assert r.status == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = r.events()
    assert events[-1] == "[DONE]"
    chunks = r.chunks_json()
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all(c["object"] == "chat.completion.chunk" and c["id"] == chunks[0]["id"] for c in chunks)
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert text == TEXT
    finishes = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert finishes == ["stop"]
    assert all(c["usage"] is None for c in chunks[:-1])
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] > 0
    assert chunks[-1]["usage"]["prompt_tokens_details"] == {"cached_tokens": 2}


def test_stream_without_include_usage_has_no_usage_key(make_app, fake):
    r = post(make_app(fake), "/v1/chat/completions", {**CHAT, "stream": True})
    assert all("usage" not in c for c in r.chunks_json())


@pytest.mark.parametrize("stream", [False, True])
def test_stop_string_across_tokens_is_cut_and_request_aborted(make_app, fake, edge_tokenizer, stream):
    stop = "world! Ü"  # spans several tokens of the tiny tokenizer
    pieces = [edge_tokenizer.decode([t]) for t in edge_tokenizer.encode(TEXT)]
    assert not any(stop in p for p in pieces)
    app = make_app(fake)
    r = post(app, "/v1/completions", {"model": "tiny", "prompt": "x", "stop": [stop, "zzz"], "stream": stream, "max_tokens": 50})
    if stream:
        chunks = r.chunks_json()
        text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
        reasons = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    else:
        text = r.json()["choices"][0]["text"]
        reasons = [r.json()["choices"][0]["finish_reason"]]
    assert text == TEXT[: TEXT.index(stop)]
    assert reasons == ["stop"]
    assert fake.aborted == [fake.submitted[0][0]]
    if not stream:
        # Tokens up to the one that completed the stop string, no further.
        ids = edge_tokenizer.encode(TEXT)
        k = next(k for k in range(1, len(ids) + 1) if stop in edge_tokenizer.decode(ids[:k]))
        assert r.json()["usage"]["completion_tokens"] == k


def test_n_fans_out_with_distinct_seeds(make_app, fake, edge_tokenizer):
    app = make_app(fake)
    r = post(app, "/v1/chat/completions", {**CHAT, "n": 2, "seed": 7, "temperature": 0.8})
    body = r.json()
    assert [c["index"] for c in body["choices"]] == [0, 1]
    assert all(c["message"]["content"] == TEXT for c in body["choices"])
    assert sorted(s.seed for _, _, s, _ in fake.submitted) == [7, 8]
    per_choice = len(fake.submitted[0][1])
    assert body["usage"]["prompt_tokens"] == per_choice  # a prompt counts once, as OpenAI does
    assert body["usage"]["completion_tokens"] == 2 * (len(edge_tokenizer.encode(TEXT)) + 1)  # each up to its EOS
    assert body["usage"]["prompt_tokens_details"] == {"cached_tokens": 2}


def test_n_stream_interleaves_both_choices(make_app, fake):
    r = post(make_app(fake), "/v1/chat/completions", {**CHAT, "n": 2, "stream": True})
    texts = {0: "", 1: ""}
    for c in r.chunks_json():
        for ch in c["choices"]:
            texts[ch["index"]] += ch["delta"].get("content", "")
    assert texts == {0: TEXT, 1: TEXT}


def test_completions_batch_prompts_and_token_prompts(make_app, fake, edge_tokenizer):
    ids = edge_tokenizer.encode("Paris")
    r = post(make_app(fake), "/v1/completions", {"model": "tiny", "prompt": ["a b", ids], "n": 2, "max_tokens": 4})
    body = r.json()
    assert body["object"] == "text_completion"
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    assert [p for _, p, _, _ in fake.submitted] == [edge_tokenizer.encode("a b")] * 2 + [ids] * 2
    assert all(c["finish_reason"] == "length" for c in body["choices"])
    assert body["choices"][0]["text"] == edge_tokenizer.decode(edge_tokenizer.encode(TEXT)[:4])
    assert body["usage"]["prompt_tokens"] == len(edge_tokenizer.encode("a b")) + len(ids)
    assert body["usage"]["completion_tokens"] == 16


def test_chat_logprobs_shape(make_app, fake, edge_tokenizer):
    r = post(make_app(fake), "/v1/chat/completions", {**CHAT, "logprobs": True, "top_logprobs": 3, "max_tokens": 5})
    choice = r.json()["choices"][0]
    content = choice["logprobs"]["content"]
    ids = edge_tokenizer.encode(TEXT)[:5]
    assert fake.submitted[0][2].logprobs == 3
    assert [bytes(e["bytes"]) for e in content] == [edge_tokenizer.raw_bytes(t) for t in ids]
    assert b"".join(bytes(e["bytes"]) for e in content).decode() == choice["message"]["content"]
    assert all(len(e["top_logprobs"]) == 3 and e["logprob"] < 0 for e in content)


def test_completion_logprobs_shape_streaming(make_app, fake):
    r = post(make_app(fake), "/v1/completions", {"model": "tiny", "prompt": "x", "logprobs": 2, "max_tokens": 6, "stream": True})
    lps = [c["choices"][0]["logprobs"] for c in r.chunks_json() if c["choices"][0]["logprobs"]]
    tokens = sum((lp["tokens"] for lp in lps), [])
    offsets = sum((lp["text_offset"] for lp in lps), [])
    assert len(tokens) == 6 and offsets[0] == 0 and offsets == sorted(offsets)
    assert all(len(t) == 2 for lp in lps for t in lp["top_logprobs"])


def test_max_tokens_and_ignore_eos_pass_through(make_app, fake, edge_tokenizer):
    r = post(make_app(fake), "/v1/chat/completions", {**CHAT, "max_completion_tokens": 100, "ignore_eos": True,
                                                      "logit_bias": {"5": -100}, "top_k": 4, "min_p": 0.1, "top_p": 0.9})
    sampling = fake.submitted[0][2]
    assert sampling.max_tokens == 100 and sampling.ignore_eos
    assert (sampling.logit_bias, sampling.top_k, sampling.min_p, sampling.top_p) == ({5: -100.0}, 4, 0.1, 0.9)
    body = r.json()
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["choices"][0]["message"]["content"] == TEXT + " never seen"


def test_default_max_tokens_is_capped_by_context(make_app, fake, edge_tokenizer):
    post(make_app(fake, default_max_tokens=100000), "/v1/chat/completions", CHAT)
    prompt, sampling = fake.submitted[0][1], fake.submitted[0][2]
    assert sampling.max_tokens == edge_tokenizer.context_length - len(prompt)


def test_priority_header(make_app, fake):
    post(make_app(fake), "/v1/chat/completions", CHAT, headers={"X-Priority": "5"})
    assert fake.submitted[0][3] == 5


BAD = [
    ("not json", None, 400, "invalid_json"),
    ("[1, 2]", None, 400, "invalid_type"),
    ({**CHAT, "frobnicate": 1}, "frobnicate", 400, "unknown_parameter"),
    ({**CHAT, "presence_penalty": 2.5}, "presence_penalty", 400, "invalid_value"),
    ({**CHAT, "frequency_penalty": "x"}, "frequency_penalty", 400, "invalid_type"),
    ({**CHAT, "repetition_penalty": 0}, "repetition_penalty", 400, "invalid_value"),
    ({**CHAT, "tools": [{"type": "function", "function": {"name": "no spaces"}}]}, "tools[0].function.name", 400, "invalid_value"),
    ({**CHAT, "tools": [{"type": "code"}]}, "tools[0]", 400, "invalid_type"),
    ({**CHAT, "tool_choice": "required"}, "tool_choice", 400, "invalid_value"),
    ({**CHAT, "tools": [{"type": "function", "function": {"name": "f"}}],
      "tool_choice": {"type": "function", "function": {"name": "g"}}}, "tool_choice", 400, "invalid_value"),
    ({**CHAT, "functions": [{"name": "f"}]}, "functions", 400, "unsupported_parameter"),
    ({**CHAT, "response_format": {"type": "xml"}}, "response_format.type", 400, "invalid_value"),
    ({**CHAT, "response_format": {"type": "json_schema"}}, "response_format.json_schema", 400, "invalid_type"),
    ({**CHAT, "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
     "response_format", 400, "invalid_value"),
    ({**CHAT, "response_format": {"type": "json_schema", "json_schema": {"name": "x", "strict": True,
      "schema": {"type": "string", "format": "no-such-format"}}}}, "response_format", 400, "invalid_value"),
    ({**CHAT, "n": 0}, "n", 400, "invalid_value"),
    ({**CHAT, "n": 999}, "n", 400, "invalid_value"),
    ({**CHAT, "temperature": 3}, "temperature", 400, "invalid_value"),
    ({**CHAT, "temperature": "hot"}, "temperature", 400, "invalid_type"),
    ({**CHAT, "top_p": 0}, "top_p", 400, "invalid_value"),
    ({**CHAT, "max_tokens": 0}, "max_tokens", 400, "invalid_value"),
    ({**CHAT, "max_tokens": 5, "max_completion_tokens": 6}, "max_completion_tokens", 400, "invalid_value"),
    ({**CHAT, "max_tokens": 10**6}, "max_tokens", 400, "context_length_exceeded"),
    ({**CHAT, "top_logprobs": 2}, "top_logprobs", 400, "invalid_value"),
    ({**CHAT, "logprobs": True, "top_logprobs": 21}, "top_logprobs", 400, "invalid_value"),
    ({**CHAT, "stream_options": {"include_usage": True}}, "stream_options", 400, "invalid_value"),
    ({**CHAT, "stream": True, "stream_options": {"continuous_usage_stats": True}}, "stream_options.continuous_usage_stats", 400, "unsupported_parameter"),
    ({**CHAT, "stop": ["a", ""]}, "stop", 400, "invalid_value"),
    ({**CHAT, "stop": 5}, "stop", 400, "invalid_type"),
    ({**CHAT, "seed": 1.5}, "seed", 400, "invalid_type"),
    ({**CHAT, "logit_bias": {"999999": 5}}, "logit_bias", 400, "invalid_value"),
    ({**CHAT, "logit_bias": {"3": 500}}, "logit_bias", 400, "invalid_value"),
    ({**CHAT, "messages": []}, "messages", 400, "invalid_value"),
    ({"model": "tiny"}, "messages", 400, "missing_required_parameter"),
    ({**CHAT, "messages": "hi"}, "messages", 400, "invalid_type"),
    ({**CHAT, "messages": [{"role": "tool", "content": "x"}]}, "messages[0].tool_call_id", 400, "missing_required_parameter"),
    ({**CHAT, "messages": [{"role": "function", "content": "x"}]}, "messages[0].role", 400, "unsupported_parameter"),
    ({**CHAT, "messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role", 400, "invalid_value"),
    ({**CHAT, "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, "messages[0].content[0]", 400, "unsupported_parameter"),
    ({**CHAT, "messages": [{"role": "user", "content": 5}]}, "messages[0].content", 400, "invalid_type"),
    ({"messages": CHAT["messages"]}, "model", 400, "missing_required_parameter"),
    ({**CHAT, "model": "gpt-4"}, "model", 404, "model_not_found"),
]


def test_each_messages_fault_has_one_code_and_its_own_text(make_app, fake):
    """Missing, empty and mistyped 'messages' differ in code and in text (issue #45)."""
    seen = {}
    for messages in (None, [], "hi"):
        body = {"model": CHAT["model"]} if messages is None else {**CHAT, "messages": messages}
        err = post(make_app(fake), "/v1/chat/completions", body).json()["error"]
        seen[err["code"]] = err["message"]
    assert len(seen) == 3 and len(set(seen.values())) == 3, seen


@pytest.mark.parametrize("body,param,status,code", BAD)
def test_bad_chat_requests_get_openai_errors(make_app, fake, body, param, status, code):
    raw = body.encode() if isinstance(body, str) else None
    r = run(call(make_app(fake), "POST", "/v1/chat/completions", None if raw else body, raw=raw))
    assert r.status == status, r.body
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert (err["param"], err["code"]) == (param, code)
    assert fake.submitted == []


@pytest.mark.parametrize("body,param,code", [
    ({"model": "tiny"}, "prompt", "missing_required_parameter"),
    ({"model": "tiny", "prompt": "x", "echo": True}, "echo", "unsupported_parameter"),
    ({"model": "tiny", "prompt": "x", "suffix": "y"}, "suffix", "unsupported_parameter"),
    ({"model": "tiny", "prompt": "x", "best_of": 3}, "best_of", "unsupported_parameter"),
    ({"model": "tiny", "prompt": "x", "logprobs": 6}, "logprobs", "invalid_value"),
    ({"model": "tiny", "prompt": [1, 10**6]}, "prompt", "invalid_value"),
    ({"model": "tiny", "prompt": [[1], "x", 3]}, "prompt", "invalid_type"),
    ({"model": "tiny", "prompt": "x", "messages": []}, "messages", "unknown_parameter"),
])
def test_bad_completion_requests(make_app, fake, body, param, code):
    r = post(make_app(fake), "/v1/completions", body)
    assert r.status == 400 and (r.json()["error"]["param"], r.json()["error"]["code"]) == (param, code)


def test_bad_priority_header(make_app, fake):
    r = post(make_app(fake), "/v1/chat/completions", CHAT, headers={"X-Priority": "high"})
    assert r.status == 400 and r.json()["error"]["param"] == "X-Priority"


def test_oversized_body_is_413(make_app, fake):
    big = {**CHAT, "messages": [{"role": "user", "content": "x" * 5000}]}
    r = post(make_app(fake, max_request_bytes=2048), "/v1/chat/completions", big)
    assert r.status == 413 and r.json()["error"]["code"] == "request_too_large"


def test_router_errors_are_openai_shaped(make_app, fake):
    app = make_app(fake)
    r = get(app, "/v1/chat/completions")
    assert r.status == 405 and set(r.json()["error"]) == {"message", "type", "param", "code"}
    r = get(app, "/v1/nothing")
    assert r.status == 404 and r.json()["error"]["code"] == "not_found"


def test_busy_is_503_with_retry_after(make_app, fake):
    fake.busy = ("queue_full", 2.5)
    app = make_app(fake)
    r = post(app, "/v1/chat/completions", {**CHAT, "stream": True})
    assert r.status == 503 and r.headers["retry-after"] == "3"
    assert r.json()["error"]["code"] == "queue_full"
    metrics = get(app, "/metrics").body.decode()
    assert 'tandem_requests_refused_total{reason="queue_full"} 1.0' in metrics


def test_unavailable_is_503(make_app, fake):
    fake.unavailable = True
    r = post(make_app(fake), "/v1/chat/completions", CHAT)
    assert r.status == 503 and r.json()["error"]["code"] == "unavailable"


def test_error_after_stream_began_is_error_event_then_done(make_app, fake):
    fake.fail_after = 3
    r = post(make_app(fake), "/v1/chat/completions", {**CHAT, "stream": True, "stream_options": {"include_usage": True}})
    events = r.events()
    assert events[-1] == "[DONE]"
    chunks = r.chunks_json()
    assert "error" in chunks[-1] and "worker died" in chunks[-1]["error"]["message"]
    assert set(chunks[-1]["error"]) == {"message", "type", "param", "code"}
    assert not any(c.get("choices") == [] for c in chunks)  # no usage chunk after a failure


def test_error_in_non_streaming_request_is_500(make_app, fake):
    fake.fail_after = 3
    r = post(make_app(fake), "/v1/chat/completions", CHAT)
    assert r.status == 500 and r.json()["error"]["code"] == "stream_error"


def test_client_disconnect_mid_stream_aborts_request(make_app, fake, edge_tokenizer):
    fake.script = lambda prompt: edge_tokenizer.encode(TEXT) * 40
    fake.delay_s = 0.02
    app = make_app(fake, keepalive_s=0.05)

    async def scenario():
        r = await call(app, "POST", "/v1/chat/completions", {**CHAT, "stream": True, "ignore_eos": True, "max_tokens": 400},
                       disconnect_after=3)
        for _ in range(50):  # Falcon drops the emitter; its cleanup runs on the loop
            gc.collect()
            await asyncio.sleep(0.01)
            if fake.aborted:
                break
        return r

    r = run(scenario())
    assert r.status == 200
    assert fake.aborted == [fake.submitted[0][0]]
    assert fake.active == set()


@pytest.mark.parametrize("key_header,status", [(None, 401), ("Bearer wrong", 401), ("Basic c2VjcmV0", 401), ("Bearer s3cret-key", 200)])
def test_api_key(make_app, fake, tmp_path, key_header, status):
    key_file = tmp_path / "key"
    key_file.write_text("s3cret-key\n")
    app = make_app(fake, api_key_file=str(key_file))
    r = post(app, "/v1/chat/completions", CHAT, headers={"Authorization": key_header} if key_header else None)
    assert r.status == status
    if status == 401:
        assert r.json()["error"]["type"] == "authentication_error"
        assert fake.submitted == []
    assert get(app, "/health").status == 200  # probes need no key


def test_models_health_ready(make_app, fake):
    app = make_app(fake)
    assert get(app, "/v1/models").json()["data"][0]["id"] == "tiny"
    assert get(app, "/v1/models/tiny").status == 200
    assert get(app, "/v1/models/other").status == 404
    assert get(app, "/health").json() == {"status": "ok"}
    assert get(app, "/ready").status == 200
    fake.ready_reply = {"broker": True, "workers": {"prefill": 1, "decode": 0, "hybrid": 0}}
    assert get(app, "/ready").status == 503
    fake.ready_reply = {"broker": True, "workers": {"prefill": 1, "decode": 2, "hybrid": 0}}
    assert get(app, "/ready").status == 200
    fake.unavailable = True
    r = get(app, "/ready")
    assert r.status == 503 and r.json()["ready"] is False


def test_stats_are_redacted(make_app, fake):
    app = make_app(fake)
    stats = get(app, "/v1/stats").json()
    assert stats["workers"][0]["free_blocks"] == 30
    assert "address" not in stats["workers"][0]
    assert get(make_app(fake, expose_stats=False), "/v1/stats").status == 404


def test_metrics_count_tokens_and_latency(make_app, fake):
    app = make_app(fake)
    post(app, "/v1/chat/completions", CHAT)
    post(app, "/v1/chat/completions", {**CHAT, "stream": True})
    text = get(app, "/metrics").body.decode()
    for name in ("tandem_time_to_first_token_seconds_count 2.0", "tandem_request_duration_seconds_count 2.0",
                 "tandem_requests_running 0.0", "tandem_requests_waiting 0.0", "tandem_kv_cache_usage_ratio 0.25",
                 "tandem_prefix_cache_hit_ratio 0.25", 'tandem_requests_total{endpoint="chat",finish_reason="stop"} 2.0'):
        assert name in text, name
    gen = [line for line in text.splitlines() if line.startswith("tandem_generation_tokens_total")]
    itl = [line for line in text.splitlines() if line.startswith("tandem_inter_token_latency_seconds_count")]
    tokens = float(gen[0].split()[-1])
    assert tokens > 0 and float(itl[0].split()[-1]) == tokens - 2 * 3  # first events carry 3 tokens each


def test_metrics_carry_the_brokers_counters_and_each_workers_load(make_app, fake):
    fake.stats_reply = {
        "queue_depth": 3,
        "counters": {"submitted": 9, "tokens": 120, "migrations": 2, "refused_busy": 4, "refused_timeout": 1},
        "workers": [{"node": "prefill-0", "role": "prefill", "state": "up", "used_blocks": 0, "total_blocks": 64,
                     "free_blocks": 64, "tokens": 1},
                    {"node": "decode-0", "role": "decode", "state": "down", "used_blocks": 10, "total_blocks": 64,
                     "free_blocks": 54, "tokens": 41, "spec_draft_tokens": 30, "spec_accepted_tokens": 12,
                     "kv_store_bytes": 1 << 20, "heap_free_bytes": 1 << 19,
                     "kv_mirror_bytes": 1 << 18},
                    {"node": "decode-1", "role": "decode", "state": "up", "used_blocks": 0, "total_blocks": 64,
                     "free_blocks": 64, "tokens": 0, "spec_draft_tokens": 5, "spec_accepted_tokens": 1}],
    }
    text = get(make_app(fake), "/metrics").body.decode()
    for line in ("tandem_broker_requests_queued 3.0", "tandem_broker_requests_submitted_total 9.0",
                 "tandem_broker_generated_tokens_total 120.0", "tandem_broker_migrations_total 2.0",
                 'tandem_broker_requests_refused_total{reason="busy"} 4.0',
                 'tandem_broker_requests_refused_total{reason="no_worker"} 0.0',
                 'tandem_broker_requests_refused_total{reason="timeout"} 1.0',
                 'tandem_workers{role="decode",state="down"} 1.0', 'tandem_workers{role="prefill",state="up"} 1.0',
                 'tandem_workers{role="decode",state="up"} 1.0',
                 'tandem_worker_kv_blocks_used{node="decode-0",role="decode"} 10.0',
                 'tandem_worker_generated_tokens_total{node="decode-0",role="decode"} 41.0',
                 'tandem_worker_kv_store_bytes{node="decode-0",role="decode"} 1.048576e+06',
                 'tandem_worker_heap_free_bytes{node="decode-0",role="decode"} 524288.0',
                 'tandem_worker_kv_mirror_bytes{node="decode-0",role="decode"} 262144.0',
                 "tandem_spec_draft_tokens_total 35.0", "tandem_spec_accepted_tokens_total 13.0"):
        assert line in text, line


def test_too_many_choices_and_deep_json(make_app, fake):
    app = make_app(fake)
    r = post(app, "/v1/completions", {"model": "tiny", "prompt": ["a"] * 20, "n": 4})
    assert r.status == 400 and "at most" in r.json()["error"]["message"]
    r = run(call(app, "POST", "/v1/chat/completions", raw=b"[" * 100000 + b"]" * 100000))
    assert r.status == 400 and r.json()["error"]["code"] == "invalid_json"


def test_redact_drops_addresses_keeps_numbers():
    from tandem.http.ops import redact

    stats = {"workers": [{"node": "decode-0", "kv_address": "tcp://10.1.2.3:7000", "ip": "10.1.2.3",
                          "free_blocks": 3, "pipeline_depth": 2}], "endpoint": "tcp://x", "counters": {"aborted": 1}}
    assert redact(stats) == {"workers": [{"node": "decode-0", "free_blocks": 3, "pipeline_depth": 2}], "counters": {"aborted": 1}}
