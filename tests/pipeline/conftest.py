"""Engine fixtures: the tiny model loaded once, and mlx_lm.generate as the oracle."""

from __future__ import annotations

import ctypes
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


def continue_import(engine, snapshot, timeout: float = 30.0):
    """Start ``engine``, import ``snapshot`` and run it to its end -> (its tokens, the final
    event); the engine is stopped again."""
    import queue

    out: queue.Queue = queue.Queue()
    engine.start()
    try:
        engine.import_kv(snapshot, out.put)
        toks = []
        while True:
            ev = out.get(timeout=timeout)
            toks += ev.tokens
            if ev.finish_reason:
                return toks, ev
    finally:
        engine.stop()


def random_prompts(n: int, lo: int, hi: int, seed: int = 0, vocab: int = 380) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


_pinned_stand_ins = []


def host_alloc(nbytes: int) -> int:
    """A stand-in for the driver's pinned allocation (tests on the CPU): host memory kept alive."""
    buf = ctypes.create_string_buffer(nbytes)
    _pinned_stand_ins.append(buf)
    return ctypes.addressof(buf)


def two_row_engine(model_dir, prompts: list[list[int]], max_tokens: int):
    """An engine on the tiny model (prefills of two rows at most) and mlx-lm's tokens for each
    prompt alone (from a model loaded apart, so nothing the engine does can touch it)."""
    from mlx_lm import load

    from tandem.pipeline.engine import Engine
    from tandem.pipeline.settings import EngineSettings

    ref, _ = load(str(model_dir))
    want = [oracle(ref, p, max_tokens) for p in prompts]
    model, _ = load(str(model_dir))
    eng = Engine(model, EngineSettings(kv_cache_budget="16MiB", max_batch_prefill=2), model_id="tiny",
                 eos_token_ids=[EOS])
    return eng, want
