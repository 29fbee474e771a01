"""Incremental detokenization and stop strings, as properties over random inputs."""

from __future__ import annotations

import dataclasses

from hypothesis import given, settings
from hypothesis import strategies as st

from tandem.http.detokenizer import Detokenizer
from tandem.http.stops import StopMatcher

_SETTINGS = settings(max_examples=100, deadline=None)


def _stream(tok, tokens, splits):
    """Feed tokens in pieces of the given sizes; return every delta and the result."""
    detok = Detokenizer(tok)
    deltas, i = [], 0
    for size in splits:
        if i >= len(tokens):
            break
        deltas.append(detok.add(tokens[i:i + size]))
        i += size
    if i < len(tokens):
        deltas.append(detok.add(tokens[i:]))
    deltas.append(detok.finish())
    return deltas


token_lists = st.lists(st.integers(min_value=0, max_value=384), max_size=60)
split_lists = st.lists(st.integers(min_value=1, max_value=4), max_size=60)


def test_tiny_tokenizer_takes_the_exact_byte_level_path(edge_tokenizer):
    assert edge_tokenizer.token_bytes is not None


@_SETTINGS
@given(tokens=token_lists, splits=split_lists)
def test_byte_level_stream_equals_full_decode(edge_tokenizer, tokens, splits):
    deltas = _stream(edge_tokenizer, tokens, splits)
    assert "".join(deltas) == edge_tokenizer.decode(tokens)
    # No delta may end inside a character: every delta but the flush is U+FFFD-free
    # unless the full decode has a replacement character there too.
    if "\ufffd" not in edge_tokenizer.decode(tokens):
        assert all("\ufffd" not in d for d in deltas)


@_SETTINGS
@given(tokens=token_lists, splits=split_lists)
def test_window_fallback_stream_equals_full_decode(edge_tokenizer, tokens, splits):
    generic = dataclasses.replace(edge_tokenizer, token_bytes=None)
    deltas = _stream(generic, tokens, splits)
    assert "".join(deltas) == edge_tokenizer.decode(tokens)


@_SETTINGS
@given(text=st.text(alphabet="abcé😀 ,.\n", max_size=40), splits=split_lists)
def test_multibyte_text_is_never_split(edge_tokenizer, text, splits):
    tokens = edge_tokenizer.encode(text)
    deltas = _stream(edge_tokenizer, tokens, splits)
    assert "".join(deltas) == text
    assert all("\ufffd" not in d for d in deltas)


@_SETTINGS
@given(
    text=st.text(alphabet="ab\nc", max_size=40),
    stops=st.lists(st.text(alphabet="ab\nc", min_size=1, max_size=4), min_size=1, max_size=3),
    cuts=st.lists(st.integers(min_value=0, max_value=40), max_size=10),
)
def test_stop_matcher_equals_cut_at_first_stop(text, stops, cuts):
    pieces, prev = [], 0
    for c in sorted(set(cuts)) + [len(text)]:
        pieces.append(text[prev:c])
        prev = max(prev, c)
    matcher = StopMatcher(stops)
    out = "".join(matcher.feed(p) for p in pieces)
    hits = [(text.find(s) + len(s), text.find(s)) for s in stops if s in text]
    if hits:
        # The stop that completes first ends the text; nothing of it is emitted.
        assert matcher.stopped and out == text[:min(hits)[1]]
    else:
        assert not matcher.stopped
        assert out + matcher.flush() == text


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=20,
)
_FIELDS = ["model", "messages", "prompt", "max_tokens", "max_completion_tokens", "temperature", "top_p", "seed",
           "stop", "n", "stream", "stream_options", "logprobs", "top_logprobs", "logit_bias", "user", "tools",
           "presence_penalty", "response_format", "echo", "best_of", "top_k", "min_p", "ignore_eos"]
bodies = st.one_of(json_values, st.dictionaries(st.sampled_from(_FIELDS), json_values, max_size=8))
messages = st.lists(st.fixed_dictionaries({"role": json_values | st.sampled_from(["user", "system", "tool"]),
                                           "content": json_values}), max_size=3)


@settings(max_examples=250, deadline=None)
@given(body=bodies, msgs=messages)
def test_request_parser_fuzz_never_raises_anything_but_api_errors(body, msgs):
    from tandem.http.errors import ApiError
    from tandem.http.protocol import parse_chat, parse_completion
    from tandem.http.settings import EdgeSettings

    chat, completion = body, body
    if isinstance(body, dict):
        chat = {"model": "m", **body, "messages": body.get("messages", msgs)}
        completion = {"model": "m", "prompt": "x", **{k: v for k, v in body.items() if k != "messages"}}
    for parse, request in ((parse_chat, chat), (parse_completion, completion)):
        try:
            job = parse(request, EdgeSettings())
        except ApiError as err:
            assert err.status == 400 and err.body()["error"]["message"]
        else:
            assert job.n >= 1 and isinstance(job.stop, list)


def test_an_over_long_prompt_leaves_no_transformers_warning(edge_tokenizer, capfd):
    """The edge refuses a prompt longer than the context itself; transformers' warning
    about it must not reach the log (issue #45)."""
    long = "hello world " * 3000
    assert len(edge_tokenizer.encode(long)) > edge_tokenizer.hf.model_max_length
    assert len(edge_tokenizer.apply_chat_template([{"role": "user", "content": long}])) > edge_tokenizer.hf.model_max_length
    assert "Token indices sequence length" not in capfd.readouterr().err


def test_loading_the_tokenizer_compiles_its_chat_template(tiny_model_dir, monkeypatch):
    """The first chat template render compiles the template; the edge pays it when it loads
    (in gunicorn's master, before the fork), not in the first request's time to first token."""
    from tandem.http import tokenizer as tokenizer_mod

    rendered = []
    real = tokenizer_mod.EdgeTokenizer.render_chat
    monkeypatch.setattr(tokenizer_mod.EdgeTokenizer, "render_chat",
                        lambda self, *a, **kw: rendered.append(a) or real(self, *a, **kw))
    tok = tokenizer_mod.load_tokenizer(tiny_model_dir)
    assert len(rendered) == 1 and tok.apply_chat_template([{"role": "user", "content": "hi"}])
