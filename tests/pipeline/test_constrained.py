"""Penalties and grammars in the engine: valid output from random weights, batch == alone,
and a KV handoff or a resume continues exactly what one engine would have produced."""

from __future__ import annotations

import json
import queue

import jsonschema
import pytest

from tandem.http.structured import schema_grammar
from tandem.kvtypes import SamplingParams
from tandem.pipeline.api import EngineRequest
from tandem.pipeline.engine import Engine
from tandem.pipeline.settings import EngineSettings
from tests.pipeline.conftest import EOS, random_prompts

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "tags", "ok"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def hf(tiny_model_dir):
    from mlx_lm.tokenizer_utils import load

    return load(tiny_model_dir, eos_token_ids=[EOS])


def make(tiny, hf, **kw) -> Engine:
    kw.setdefault("kv_cache_budget", "16MiB")
    return Engine(tiny, EngineSettings(**kw), model_id="tiny", eos_token_ids=[EOS], tokenizer=hf)


def test_json_schema_output_validates_and_batch_equals_alone(tiny, hf):
    grammar = schema_grammar(SCHEMA)
    prompts = random_prompts(4, 3, 30, seed=3)
    constrained = [SamplingParams(temperature=t, seed=s, max_tokens=120, grammar=grammar)
                   for t, s in ((0.0, None), (1.0, 5), (0.7, 6), (1.3, 7))]
    plain = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    eng = make(tiny, hf)
    crowd = eng.generate_many([(p, sp) for p, sp in zip(prompts, constrained)] + [(prompts[0], plain)])
    for toks in crowd[:4]:
        assert len(toks) < 120  # the grammar finished, then only the end token was allowed
        jsonschema.validate(json.loads(hf.decode(toks)), SCHEMA)
    alone = [make(tiny, hf).generate_many([(p, sp)])[0] for p, sp in zip(prompts[:2], constrained[:2])]
    assert crowd[:2] == alone
    assert crowd[4] == make(tiny, hf).generate_many([(prompts[0], plain)])[0]  # untouched by its neighbours


def test_penalties_change_the_output(tiny, hf):
    prompt = random_prompts(1, 10, 10, seed=4)[0]
    base = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    runs = make(tiny, hf).generate_many([
        (prompt, base),
        (prompt, SamplingParams(**{**base.__dict__, "frequency_penalty": 2.0})),
        (prompt, SamplingParams(**{**base.__dict__, "presence_penalty": 2.0})),
        (prompt, SamplingParams(**{**base.__dict__, "repetition_penalty": 3.0})),
    ])
    assert all(r != runs[0] for r in runs[1:])
    assert len(set(runs[2])) > len(set(runs[0]))  # presence pushes towards unseen tokens


def _events(q) -> list[int]:
    toks = []
    while True:
        e = q.get(timeout=60)
        assert e.error is None, e.error
        toks += e.tokens
        if e.finish_reason:
            return toks


def test_handoff_and_resume_continue_grammar_and_penalties(tiny, hf):
    prompt = random_prompts(1, 20, 20, seed=9)[0]
    sp = SamplingParams(temperature=0.9, seed=21, max_tokens=60, grammar=schema_grammar(SCHEMA),
                        presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.2)
    whole = make(tiny, hf).generate_many([(prompt, sp)])[0]
    assert len(whole) > 6
    # The prefill role's export, imported by another engine.
    src, dst = make(tiny, hf), make(tiny, hf)
    q1: queue.Queue = queue.Queue()
    src.start()
    src.submit(EngineRequest(b"h" * 16, prompt, sp, q1.put, export_after_prefill=True))
    first, snap = q1.get(timeout=60).tokens, q1.get(timeout=60).snapshot
    src.stop()
    q2: queue.Queue = queue.Queue()
    dst.start()
    dst.import_kv(snap, q2.put)
    assert first + _events(q2) == whole
    dst.stop()
    # A migration: prompt + the 5 tokens streamed so far, seed_offset 5.
    k = 5
    resumed = SamplingParams(**{**sp.__dict__, "max_tokens": sp.max_tokens - k, "seed_offset": k})
    rest = make(tiny, hf).generate_many([(prompt + whole[:k], resumed)])[0]
    assert whole[:k] + rest == whole


def test_bad_grammar_is_refused_at_submit(tiny, hf):
    eng = make(tiny, hf)
    with pytest.raises(ValueError, match="grammar"):
        eng.submit(EngineRequest(b"b" * 16, [5, 6], SamplingParams(grammar='{"grammars": [{"lark_grammar": "start: ("}]}'),
                                 lambda e: None))
    without = Engine(tiny, EngineSettings(kv_cache_budget="16MiB"), model_id="tiny", eos_token_ids=[EOS])
    with pytest.raises(ValueError, match="tokenizer"):
        without.submit(EngineRequest(b"c" * 16, [5, 6], SamplingParams(grammar=schema_grammar(SCHEMA)), lambda e: None))
