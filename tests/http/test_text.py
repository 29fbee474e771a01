"""Incremental detokenization and stop strings, as properties over random inputs."""

from __future__ import annotations

import dataclasses

from hypothesis import given, settings
from hypothesis import strategies as st

from tandem.http.detokenizer import Detokenizer
from tandem.http.stops import StopMatcher

_SETTINGS = settings(max_examples=150, deadline=None)


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
