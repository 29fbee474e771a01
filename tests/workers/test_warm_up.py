"""A worker's warm-up before READY runs the paths serving meets: a fresh prefill, a
prefix-cache hit (the other prefill path), greedy and sampled decoding; the engine ends idle."""

from __future__ import annotations

import pytest

from tandem.commands.worker import warm_up
from tandem.kvtypes import SamplingParams
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
def test_warm_up_runs_the_decode_classes_where_the_role_decodes(tiny, role):
    """A runner that traces its decode step per row class: a prefill worker warms none (it
    hands requests on after their first token), a decode or hybrid worker every class up to
    the scheduler's batch."""
    eng = Engine(tiny, EngineSettings(kv_cache_budget="16MiB"), model_id="tiny", eos_token_ids=[EOS])
    decode = []
    eng.runner.warm_decode = lambda rows, verify_rows: decode.append((rows, verify_rows))
    warm_up(eng, role)
    assert decode == ([] if role == "prefill" else [(eng.scheduler.max_batch_size, 0)])


def test_warm_up_prefills_the_shapes_that_run_their_own_kernels(tiny):
    """A fresh prompt of a multiple of 64 tokens (the CUDA runner's compiled prefill), a
    prefix hit followed by a few tokens and one followed by many (each runs other kernels)."""
    from tandem.commands.worker import WARM_HIT_TOKENS, WARM_PROMPT
    from tandem.pipeline.runners.cuda.runner import PREFILL_COMPILE_MULTIPLE

    eng = Engine(tiny, EngineSettings(kv_cache_budget="16MiB"), model_id="tiny", eos_token_ids=[EOS])
    seen = []
    forward = eng.runner.forward

    def spy(rows, inputs):
        if inputs.shape[1] > 1:
            seen.append((all(r.start == 0 for r in rows), max(r.n for r in rows)))
        return forward(rows, inputs)

    eng.runner.forward = spy
    warm_up(eng)
    assert WARM_PROMPT % PREFILL_COMPILE_MULTIPLE == 0
    assert (True, WARM_PROMPT) in seen  # fresh, compiled on CUDA
    hits = [n for fresh, n in seen if not fresh]
    assert min(hits) <= 8 and max(hits) >= WARM_HIT_TOKENS >= 64


@pytest.mark.parametrize("role", ["prefill", "decode", "hybrid"])
def test_a_disaggregated_worker_warms_its_handoff_and_ends_idle(tiny, role):
    """Export after prefill (the prefill worker's side) and import then decode (the decode
    worker's): first met with the first request otherwise. The engine ends idle, every
    block free, and can start again."""
    eng = Engine(tiny, EngineSettings(kv_cache_budget="16MiB"), model_id="tiny", eos_token_ids=[EOS])
    calls = []
    for name in ("import_kv",):
        real = getattr(eng, name)
        setattr(eng, name, lambda *a, _real=real, _name=name, **k: (calls.append(_name), _real(*a, **k))[1])
    exports = []
    real_export = eng.store.export_blocks
    eng.store.export_blocks = lambda ids: (exports.append(len(ids)), real_export(ids))[1]
    warm_up(eng, role)
    assert (calls == ["import_kv"] and exports) if role != "hybrid" else (not calls and not exports)
    st = eng.stats()
    assert st.running == st.waiting == 0 and st.free_blocks == st.total_blocks
    eng.pool.check()
    assert len(eng.generate_many([([5, 6, 7], SamplingParams(max_tokens=2, ignore_eos=True))])[0]) == 2


def test_a_drafting_worker_warms_its_verifying_steps_too(tiny):
    """With a speculator, the decode classes' warm-up also covers the verifying step's rows:
    the batch times one plus the longest draft."""
    from tandem.pipeline.drafters import NgramDrafter
    from tandem.pipeline.speculation import Speculator

    eng = Engine(tiny, EngineSettings(kv_cache_budget="16MiB"), model_id="tiny", eos_token_ids=[EOS],
                 speculator=Speculator(NgramDrafter(), max_draft=3))
    decode = []
    eng.runner.warm_decode = lambda rows, verify_rows: decode.append((rows, verify_rows))
    warm_up(eng, "decode")
    assert decode == [(eng.scheduler.max_batch_size, 4 * eng.scheduler.max_batch_size)]
