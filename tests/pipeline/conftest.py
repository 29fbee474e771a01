"""Engine fixtures: the tiny model loaded once, and mlx_lm.generate as the oracle."""

from __future__ import annotations

import random

import pytest

EOS = 2  # <|im_end|> in the tiny tokenizer


@pytest.fixture(scope="session")
def tiny(tiny_model_dir):
    from mlx_lm import load

    model, _ = load(str(tiny_model_dir))
    return model


def oracle(model, prompt: list[int], max_tokens: int, eos=(EOS,)) -> list[int]:
    """What mlx_lm.generate yields for this prompt alone at temperature 0 (stop token excluded)."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step

    out = []
    for tok, _ in generate_step(mx.array(prompt), model, max_tokens=max_tokens):
        tok = int(tok)
        if tok in eos:
            break
        out.append(tok)
    return out


def random_prompts(n: int, lo: int, hi: int, seed: int = 0, vocab: int = 380) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]
