"""Prefills on the host (fast_llama's token-column layers: OpenBLAS products, C norms,
RoPE, KV write into the paged pool and attention) == mlx_lm.generate alone."""

from __future__ import annotations

import pytest

from tandem import _blas
from tandem.kvtypes import SamplingParams
from tandem.pipeline.runners.cpu import fast_llama
from tandem.kernels.cpu import q4_kernels
from tandem.pipeline.engine import Engine
from tandem.pipeline.settings import EngineSettings
from tests.pipeline.conftest import EOS, oracle, random_prompts

pytestmark = pytest.mark.skipif(not q4_kernels.available() or _blas.openblas_sgemm() is None,
                                reason="no C kernels or no OpenBLAS in numpy: prefills take the mlx path")


@pytest.fixture
def counted(monkeypatch):
    """How often the host layers ran, and how often their KV went straight into the pool."""
    calls = {"layers": 0, "pool": 0}
    layers, kv = fast_llama.FastLlama._layers_blas, q4_kernels.prefill_kv

    def count_layers(*a, **kw):
        calls["layers"] += 1
        return layers(*a, **kw)

    def count_kv(*a, **kw):
        calls["pool"] += 1
        return kv(*a, **kw)

    monkeypatch.setattr(fast_llama.FastLlama, "_layers_blas", count_layers)
    monkeypatch.setattr(q4_kernels, "prefill_kv", count_kv)
    return calls


@pytest.mark.parametrize("settings", [{}, dict(prefill_chunk_size=32), dict(block_size=4)],
                         ids=["default", "chunked", "small-blocks"])
def test_host_prefill_matches_the_oracle(tiny, counted, settings):
    system = random_prompts(1, 32, 32, seed=11)[0]  # 2 blocks of 16: prefix hits from the second prompt on
    prompts = [system + p for p in random_prompts(12, 20, 60, seed=12)]
    expected = [oracle(tiny, p, 8) for p in prompts]
    eng = Engine(tiny, EngineSettings(kv_cache_budget="16MiB", **settings), model_id="tiny", eos_token_ids=[EOS])
    sp = SamplingParams(temperature=0.0, max_tokens=8)
    assert eng.generate_many([(p, sp) for p in prompts]) == expected
    # again, every prompt's system part from the prefix cache (rows start past 0)
    assert eng.generate_many([(p, sp) for p in prompts]) == expected
    assert counted["layers"] > 0 and counted["pool"] == counted["layers"] * len(tiny.model.layers)
    eng.pool.check()


def test_default_model_host_prefill_matches_the_oracle(counted):
    from tests.pipeline.test_models import default_model, word_chat_prompts

    lm = default_model()
    prompts = word_chat_prompts(lm.tokenizer, 4, first=40, step=13, stride=5)
    expected = [oracle(lm.model, p, 12, eos=()) for p in prompts]
    eng = Engine(lm.model, EngineSettings(kv_cache_budget="256MiB"), model_id=lm.model_id,
                 eos_token_ids=lm.eos_token_ids)
    sp = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    assert eng.generate_many([(p, sp) for p in prompts]) == expected
    assert counted["layers"] > 0 and counted["pool"] > 0
