"""Fixtures for the edge: the tiny model's tokenizer and an app around a fake backend."""

from __future__ import annotations

import pytest

from tandem.config import Config
from tandem.http.app import create_app
from tandem.http.tokenizer import load_tokenizer
from tests.http.fakes import FakeBackend

TEXT = "Hello, world! Ünïcödé 😀 and the quick brown fox."


@pytest.fixture(scope="session")
def edge_tokenizer(tiny_model_dir):
    return load_tokenizer(tiny_model_dir)


@pytest.fixture
def fake(edge_tokenizer):
    eos = min(edge_tokenizer.eos_token_ids)
    answer = edge_tokenizer.encode(TEXT) + [eos] + edge_tokenizer.encode(" never seen")
    return FakeBackend(lambda prompt: list(answer), eos=eos, chunk=3, cached=2)


def make_config(**edge):
    config = Config()
    config.edge.model_name = "tiny"
    for key, value in edge.items():
        setattr(config.edge, key, value)
    return config


@pytest.fixture
def make_app(edge_tokenizer):
    def build(backend, **edge):
        return create_app(make_config(**edge), backend=backend, tokenizer=edge_tokenizer)

    return build
