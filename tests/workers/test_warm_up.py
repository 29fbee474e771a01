"""A worker's warm-up before READY runs the paths serving meets: a fresh prefill, a
prefix-cache hit (the other prefill path), greedy and sampled decoding; the engine ends idle."""

from __future__ import annotations

import pytest

from tandem.commands.worker import warm_up
from tandem.pipeline.engine import Engine
from tandem.pipeline.settings import EngineSettings
from tests.pipeline.conftest import EOS, tiny  # noqa: F401  (the fixture)


def test_warm_up_meets_a_prefix_hit_and_leaves_the_engine_idle(tiny):
    eng = Engine(tiny, EngineSettings(kv_cache_budget="16MiB"), model_id="tiny", eos_token_ids=[EOS])
    assert warm_up(eng) > 0
    st = eng.stats()
    assert st.prefix_hits >= 1  # the extended prompt reused the first prompt's blocks
    assert st.running == st.waiting == 0 and st.free_blocks == st.total_blocks
    eng.pool.check()


def test_warm_up_leaves_no_step_timings_behind(tiny):
    """Its steps pay first-use costs: a speculator's step times start unmeasured after it."""
    from tandem.pipeline.drafters import NgramDrafter
    from tandem.pipeline.speculation import Speculator

    spec = Speculator(NgramDrafter())
    eng = Engine(tiny, EngineSettings(kv_cache_budget="16MiB"), model_id="tiny", eos_token_ids=[EOS], speculator=spec)
    observed = []
    real = spec.times.observe
    spec.times.observe = lambda *a, **k: (observed.append(a), real(*a, **k))
    warm_up(eng)
    assert observed  # it timed the warm-up's decode steps...
    assert spec.times.at(4) == pytest.approx(1.3)  # ...and forgot them: the prior, in one-row steps


@pytest.mark.parametrize("role", ["prefill", "decode", "hybrid"])
def test_only_workers_that_decode_get_a_speculator(tiny_model_dir, role):
    from tandem import config as config_mod
    from tandem.commands.worker import build_engine
    from tandem.pipeline.drafters import NgramDrafter

    cfg = config_mod.load(None, env={}, overrides={"model.path": str(tiny_model_dir), "worker.role": role,
                                                   "engine.kv_cache_budget": "16MiB"})
    eng, _ = build_engine(cfg, None, lambda m: None)
    if role == "prefill":
        assert eng.speculator is None
    else:  # auto: prompt lookup on the CPU
        assert isinstance(eng.speculator.drafter, NgramDrafter)


@pytest.mark.parametrize("role", ["prefill", "decode", "hybrid"])
def test_warm_up_runs_the_shape_classes_each_role_meets(tiny, role, monkeypatch):
    """A runner with prefill length classes and decode row classes: a decode worker warms
    no fresh-prefill classes (its prompts arrive as KV), a prefill worker no decode classes
    (it hands requests on after their first token), a hybrid worker both; prefill batches
    stop at the scheduler's token cap."""
    eng = Engine(tiny, EngineSettings(kv_cache_budget="16MiB", prefill_chunk_size=128, max_batch_prefill=3,
                                      max_batch_prefill_tokens=256),
                 model_id="tiny", eos_token_ids=[EOS])
    lengths, decode = [], []
    real = eng.runner.forward
    eng.runner.forward = lambda rows, inputs: (lengths.append((len(rows), max(r.n for r in rows)))
                                               if all(r.start == 0 for r in rows) else None) or real(rows, inputs)
    eng.runner.prefill_length_multiple = 64
    eng.runner.warm_decode = lambda rows: decode.append(rows)
    warm_up(eng, role)
    classes = {(b, n) for b, n in lengths if n % 64 == 0}
    assert classes == (set() if role == "decode" else {(1, 64), (2, 64), (3, 64), (1, 128), (2, 128)})
    assert decode == ([] if role == "prefill" else [eng.scheduler.max_batch_size])
