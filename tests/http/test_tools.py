"""Tool calls, reasoning content and CORS at the edge (fake backend): parsing, streaming
shape, template rendering, grammar, and the marker splitter under any chunking."""

from __future__ import annotations

import json

from hypothesis import given, settings, strategies as st

from tandem.http.markers import MarkerSplitter
from tandem.http.tools import CALL_END, CALL_START, parse_tools
from tests.http.asgi import call
from tests.http.test_app import run
from tests.http.fakes import FakeBackend

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}},
         {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}]
CALLS_TEXT = (f'Let me check.{CALL_START}\n{{"name": "get_weather", "arguments": {{"city": "Paris"}}}}\n{CALL_END}\n'
              f'{CALL_START}\n{{"name": "get_time", "arguments": {{}}}}\n{CALL_END}')


def _pieces(text: str, cuts: list[int]) -> list[str]:
    cuts = sorted({c % (len(text) + 1) for c in cuts})
    return [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]


@settings(max_examples=200, deadline=None)
@given(cuts=st.lists(st.integers(0, 10_000), max_size=12), inside=st.booleans())
def test_splitter_gives_the_same_split_however_text_is_cut(cuts, inside):
    text = "a<think>b</thi</think>c<th<think>d" if not inside else "x</think>y<think>z"
    whole = MarkerSplitter("<think>", "</think>", inside)
    want = whole.feed(text) + whole.finish()
    got_split = MarkerSplitter("<think>", "</think>", inside)
    got = [e for p in _pieces(text, cuts) for e in got_split.feed(p)] + got_split.finish()

    def merged(events):
        out = []
        for kind, t in events:
            if out and kind == out[-1][0] and kind != "close":
                out[-1] = (kind, out[-1][1] + t)
            else:
                out.append((kind, t))
        return out

    assert merged(got) == merged(want)
    assert "".join(t for k, t in want if k == "in") == ("b</thi" + "d" if not inside else "xz")


def _fake(edge_tokenizer, text: str) -> FakeBackend:
    eos = min(edge_tokenizer.eos_token_ids)
    answer = edge_tokenizer.encode(text) + [eos]
    return FakeBackend(lambda prompt: list(answer), eos=eos, chunk=2)


def _chat(app, body):
    r = run(call(app, "POST", "/v1/chat/completions", body))
    return r, (json.loads(r.body) if not body.get("stream") else None)


def _stream_events(r) -> list[dict]:
    out = []
    for line in r.body.decode().splitlines():
        if line.startswith("data: ") and line != "data: [DONE]":
            out.append(json.loads(line[6:]))
    return out


def test_tool_calls_parsed_whole_and_streamed(make_app, edge_tokenizer):
    app = make_app(_fake(edge_tokenizer, CALLS_TEXT))
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Weather?"}], "tools": TOOLS}
    r, whole = _chat(app, body)
    msg = whole["choices"][0]["message"]
    assert whole["choices"][0]["finish_reason"] == "tool_calls"
    assert msg["content"] == "Let me check."
    calls = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in msg["tool_calls"]]
    assert calls == [("get_weather", {"city": "Paris"}), ("get_time", {})]
    assert all(c["id"].startswith("call_") and c["type"] == "function" for c in msg["tool_calls"])

    r, _ = _chat(app, {**body, "stream": True})
    chunks = _stream_events(r)
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    streamed = [tc for d in deltas for tc in d.get("tool_calls", [])]
    assert [(t["index"], t["function"]["name"], json.loads(t["function"]["arguments"])) for t in streamed] == \
        [(0, "get_weather", {"city": "Paris"}), (1, "get_time", {})]
    assert "".join(d.get("content") or "" for d in deltas) == "Let me check."
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_tool_choice_none_and_unparsable_blocks_stay_text(make_app, edge_tokenizer):
    bad = f"{CALL_START}not json{CALL_END} done"
    app = make_app(_fake(edge_tokenizer, bad))
    base = {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "tools": TOOLS}
    _, whole = _chat(app, base)
    assert whole["choices"][0]["message"]["content"] == bad
    assert whole["choices"][0]["finish_reason"] == "stop"
    app = make_app(_fake(edge_tokenizer, CALLS_TEXT))
    _, whole = _chat(app, {**base, "tool_choice": "none"})
    assert "tool_calls" not in whole["choices"][0]["message"]


def test_tools_and_tool_messages_reach_the_template(make_app, edge_tokenizer):
    fake = _fake(edge_tokenizer, "It is sunny.")
    app = make_app(fake)
    messages = [{"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"}]
    r, whole = _chat(app, {"model": "tiny", "messages": messages, "tools": TOOLS})
    assert r.status == 200 and whole["choices"][0]["message"]["content"] == "It is sunny."
    prompt = edge_tokenizer.decode(fake.submitted[0][1])
    # The tiny template does not take tools: they and the call history are written as text.
    assert '"name": "get_weather"' in prompt and "<tools>" in prompt
    assert f'{CALL_START}\n{{"name": "get_weather", "arguments": {{"city": "Paris"}}}}\n{CALL_END}' in prompt
    assert "<tool_response>\nsunny, 21 C\n</tool_response>" in prompt
    assert fake.submitted[0][2].grammar is None  # auto: the model decides


def test_required_and_named_tool_choice_carry_a_grammar(make_app, edge_tokenizer):
    import llguidance

    fake = _fake(edge_tokenizer, "x")
    app = make_app(fake)
    base = {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "tools": TOOLS}
    for choice in ("required", {"type": "function", "function": {"name": "get_time"}}):
        r, _ = _chat(app, {**base, "tool_choice": choice, "parallel_tool_calls": False})
        assert r.status == 200
        grammar = fake.submitted[-1][2].grammar
        tok = app.edge.grammar_tokenizer
        m = llguidance.LLMatcher(tok, grammar)
        call = f'{CALL_START}\n{{"name": "get_time", "arguments": {{}}}}\n{CALL_END}'
        assert m.consume_tokens(tok.tokenize_str(call)) and m.is_accepting()
        wrong = llguidance.LLMatcher(tok, grammar)
        other = '{"name": "get_weather", "arguments": {"city": "P"}}'
        ok = wrong.try_consume_tokens(tok.tokenize_str(f"{CALL_START}\n{other}\n{CALL_END}"))
        assert (choice == "required") == (ok == len(tok.tokenize_str(f"{CALL_START}\n{other}\n{CALL_END}")))


def test_reasoning_content_whole_and_streamed(make_app, edge_tokenizer):
    text = "<think>The user wants a greeting.</think>Hello!"
    app = make_app(_fake(edge_tokenizer, text), reasoning="<think>,</think>")
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}]}
    _, whole = _chat(app, body)
    msg = whole["choices"][0]["message"]
    assert (msg["reasoning_content"], msg["content"]) == ("The user wants a greeting.", "Hello!")
    r, _ = _chat(app, {**body, "stream": True})
    deltas = [c["choices"][0]["delta"] for c in _stream_events(r) if c["choices"]]
    assert "".join(d.get("reasoning_content") or "" for d in deltas) == "The user wants a greeting."
    assert "".join(d.get("content") or "" for d in deltas) == "Hello!"
    # Off (the tiny vocabulary has no <think> token, so "auto" is off too): all of it is content.
    _, whole = _chat(make_app(_fake(edge_tokenizer, text)), body)
    assert whole["choices"][0]["message"]["content"] == text


def test_cors_is_opt_in(make_app, fake):
    headers = {"Origin": "https://app.example.com", "Access-Control-Request-Method": "POST"}
    r = run(call(make_app(fake), "OPTIONS", "/v1/chat/completions", None, headers=headers))
    assert "access-control-allow-origin" not in r.headers
    app = make_app(fake, cors_origins="https://app.example.com", api_key_file=None)
    r = run(call(app, "OPTIONS", "/v1/chat/completions", None, headers=headers))
    assert r.headers.get("access-control-allow-origin") == "https://app.example.com"
    r = run(call(app, "OPTIONS", "/v1/chat/completions", None, headers={**headers, "Origin": "https://evil.example"}))
    assert r.headers.get("access-control-allow-origin") != "https://evil.example"


def test_parse_tools_defaults():
    t = parse_tools({"tools": TOOLS})
    assert (t.choice, t.parallel, [f["name"] for f in t.functions]) == ("auto", True, ["get_weather", "get_time"])
    assert t.grammar() is None
    assert parse_tools({"tool_choice": "none"}) is None


NATIVE_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nTOOLS:{% for t in tools %} {{ t.function.name }}{% endfor %}<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
    "{% for c in m.tool_calls or [] %}CALL {{ c.function.name }} {{ c.function.arguments | tojson }}{% endfor %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_a_template_that_takes_tools_renders_them_itself(edge_tokenizer):
    import copy

    from tandem.http.tools import parse_message_tool_calls

    tok = copy.copy(edge_tokenizer)
    tok.hf = copy.copy(edge_tokenizer.hf)
    tok.hf.chat_template = NATIVE_TEMPLATE
    assert tok.template_takes_tools and not edge_tokenizer.template_takes_tools
    calls = parse_message_tool_calls("messages[1]", [
        {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}])
    messages = [{"role": "user", "content": "Weather?"}, {"role": "assistant", "content": "", "tool_calls": calls},
                {"role": "tool", "content": "sunny", "tool_call_id": "c1"}]
    text = tok.render_chat(messages, parse_tools({"tools": TOOLS}))
    assert "TOOLS: get_weather get_time" in text
    assert 'CALL get_weather {"city": "Paris"}' in text  # arguments reach the template as an object
    assert "<|im_start|>tool\nsunny" in text and "<tools>" not in text
    assert "TOOLS:" not in tok.render_chat(messages, parse_tools({"tools": TOOLS, "tool_choice": "none"}))


def test_a_model_family_with_its_own_call_format_is_parsed_by_its_mlx_lm_parser(make_app, edge_tokenizer):
    """Qwen3-Coder writes XML-ish calls; mlx-lm's parser for it (chosen by load_tokenizer
    from the template) types the arguments by the tool's schema."""
    import copy

    from mlx_lm.tool_parsers import qwen3_coder

    from tandem.http.tools import CallFormat

    tok = copy.copy(edge_tokenizer)
    tok.call_format = CallFormat(qwen3_coder.tool_call_start, qwen3_coder.tool_call_end, qwen3_coder.parse_tool_call)
    text = ("Checking.<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n"
            "</tool_call>")
    eos = min(tok.eos_token_ids)
    fake = FakeBackend(lambda prompt: tok.encode(text) + [eos], eos=eos, chunk=2)
    from tests.http.conftest import make_config
    from tandem.http.app import create_app

    app = create_app(make_config(), backend=fake, tokenizer=tok)
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Weather?"}], "tools": TOOLS}
    _, whole = _chat(app, body)
    msg = whole["choices"][0]["message"]
    assert msg["content"] == "Checking." and whole["choices"][0]["finish_reason"] == "tool_calls"
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in msg["tool_calls"]] == \
        [("get_weather", {"city": "Paris"})]
    r, _ = _chat(app, {**body, "stream": True})
    streamed = [tc for c in _stream_events(r) if c["choices"] for tc in c["choices"][0]["delta"].get("tool_calls", [])]
    assert [(t["function"]["name"], json.loads(t["function"]["arguments"])) for t in streamed] == [("get_weather", {"city": "Paris"})]
