"""Model families through the paged adapter, the dense fallback, and the default model."""

from __future__ import annotations

import json
import logging

import pytest

from tandem.kvtypes import SamplingParams
from tandem.pipeline.engine import Engine
from tandem.pipeline.settings import EngineSettings
from tests.pipeline.conftest import EOS, oracle, random_prompts
from tests.tiny_model import build_tiny_model


def check_family(model, pageable: bool, n: int = 6, chunk: int = 16):
    prompts = random_prompts(n, 1, 40, seed=21)
    expected = [oracle(model, p, 12) for p in prompts]
    eng = Engine(model, EngineSettings(kv_cache_budget="16MiB", prefill_chunk_size=chunk), model_id="m", eos_token_ids=[EOS])
    assert eng.shape.pageable is pageable
    assert eng.generate_many([(p, SamplingParams(max_tokens=12)) for p in prompts]) == expected
    return eng


@pytest.mark.parametrize("model_type", ["qwen2", "qwen3", "gemma"])
def test_family_pages_and_matches(tmp_path, model_type):
    from mlx_lm import load

    model, _ = load(str(build_tiny_model(tmp_path / model_type, model_type=model_type)))
    check_family(model, pageable=True)


def test_unpageable_model_falls_back_to_dense_and_says_so(tmp_path, caplog):
    from mlx_lm import load

    d = build_tiny_model(tmp_path / "swa")
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(layer_types=["sliding_attention", "full_attention"], sliding_window=8)
    (d / "config.json").write_text(json.dumps(cfg))
    model, _ = load(str(d))
    with caplog.at_level(logging.WARNING, logger="tandem.engine"):
        eng = check_family(model, pageable=False)
    assert sum("cannot be paged" in r.message for r in caplog.records) == 1
    assert eng.stats().prefix_queries == 0


def test_quantized_tiny_model(tiny_quantized_model_dir):
    from mlx_lm import load

    model, _ = load(str(tiny_quantized_model_dir))
    check_family(model, pageable=True)


def default_model():
    from tandem.pipeline import model_store

    path = model_store.default_model_dir()
    if not model_store.is_model_dir(path):
        pytest.skip("default model not fetched (tandem model fetch)")
    from tandem.pipeline.loader import load_model

    return load_model(path)


def word_chat_prompts(tok, count: int, first: int, step: int, stride: int) -> list[list[int]]:
    """count chat prompts of first + step * i common words each, different from prompt to
    prompt (each starts stride words further into the list)."""
    words = "the of and to in is was for on that with as by at from it an be this which".split()
    texts = [" ".join(words[(i * stride + j) % len(words)] for j in range(first + step * i)) for i in range(count)]
    return [tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True) for t in texts]


def test_default_model_batch_matches_single():
    lm = default_model()
    tok = lm.tokenizer
    texts = ["What is the capital of France?", "Write a haiku about the sea.", "Hi"]
    prompts = [tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True) for t in texts]
    eos = tuple(lm.eos_token_ids)
    expected = [oracle(lm.model, p, 16, eos=eos) for p in prompts]
    eng = Engine(lm.model, EngineSettings(kv_cache_budget="512MiB", prefill_chunk_size=16), model_id=lm.model_id, eos_token_ids=eos)
    got = eng.generate_many([(p, SamplingParams(max_tokens=16)) for p in prompts])
    assert got == expected
    # again, now from the prefix cache (the chat template's shared system prompt)
    assert eng.generate_many([(p, SamplingParams(max_tokens=16)) for p in prompts]) == expected
    assert eng.stats().prefix_hits >= len(prompts)


@pytest.mark.slow
def test_default_model_sixteen_mixed_prompts_with_pressure():
    """16 chat prompts of mixed length, chunked prefill, small KV budget (preemption)."""
    lm = default_model()
    prompts = word_chat_prompts(lm.tokenizer, 16, first=3, step=9, stride=7)
    expected = [oracle(lm.model, p, 32, eos=()) for p in prompts]
    # about 737 KB per block: 12 MiB is 17 blocks (272 tokens) for 16 sequences
    eng = Engine(lm.model, EngineSettings(kv_cache_budget="12MiB", prefill_chunk_size=64), model_id=lm.model_id,
                 eos_token_ids=lm.eos_token_ids)
    assert eng.generate_many([(p, SamplingParams(max_tokens=32, ignore_eos=True)) for p in prompts]) == expected
    assert eng.scheduler.preemptions > 0
