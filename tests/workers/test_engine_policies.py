"""What a worker's role changes in the settings its engine is built with, against the real
engine and tiny model (and that the engine emits each exporting batch before it prefills
the next): a decode worker keeps no prefix cache, so its KV store stays at the working set."""

from __future__ import annotations

import queue

import pytest

from tandem.kvtypes import SamplingParams
from tandem.pipeline.api import EngineRequest
from tandem.pipeline.engine import Engine
from tandem.pipeline.settings import EngineSettings
from tandem.workers import roles

EOS = 2


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    from mlx_lm import load

    model, _ = load(str(tiny_model_dir))
    return model


def make(model, role: str = "hybrid", prefill_batch: int = 0, **kw) -> Engine:
    """An engine built as a ``role`` worker builds it."""
    kw.setdefault("kv_cache_budget", "16MiB")
    settings = EngineSettings(**kw)
    roles.engine_settings(settings, role, prefill_batch=prefill_batch)
    return Engine(model, settings, model_id="tiny", eos_token_ids=[EOS])


def prompts(n, length, seed):
    import random

    rng = random.Random(seed)
    return [[rng.randrange(3, 380) for _ in range(length)] for _ in range(n)]


def export_all(eng, ps):
    """Prefill-worker style: every prompt exported after its first token. Returns the
    snapshots by prompt index and, per prefill step, which prompts had their export out
    when the step was scheduled."""
    emitted, seen_at_prefill = [], []
    rid = {bytes([i + 1]) * 16: i for i in range(len(ps))}

    def after(plan):
        if plan is not None and plan.kind == "prefill":
            seen_at_prefill.append((sorted(rid[r.seq.request_id] for r in plan.rows), sorted(emitted)))
    eng.add_schedule_hooks(after=after)
    out: queue.Queue = queue.Queue()

    def on_event(ev):
        if ev.snapshot is not None:  # (the first token came in an event before it)
            emitted.append(rid[ev.request_id])
        out.put(ev)
    sp = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    for r, i in rid.items():  # all queued before the loop starts: batches of two
        eng.submit(EngineRequest(r, ps[i], sp, on_event, export_after_prefill=True))
    eng.start()
    try:
        snaps, firsts = {}, {}
        while len(snaps) < len(ps):
            ev = out.get(timeout=60)
            if ev.snapshot is None:
                assert rid[ev.request_id] not in snaps and len(ev.tokens) == 1  # the first token, before its KV
                firsts[rid[ev.request_id]] = ev.tokens
            else:
                assert ev.tokens == [] and firsts[rid[ev.request_id]] == ev.snapshot.tokens[-1:]
                snaps[rid[ev.request_id]] = ev.snapshot
    finally:
        eng.stop()
    return snaps, seen_at_prefill


def test_an_exporting_batch_is_out_before_the_next_prefill_even_where_steps_pipeline(tiny):
    ps = prompts(6, 40, seed=1)
    cpu, cpu_seen = export_all(make(tiny, max_batch_prefill=2), ps)
    # As on a GPU, where the engine queues step N+1 before it reads step N back: a step
    # that exports is still read back first (its export would compute step N+1's writes).
    gpu_like = make(tiny, max_batch_prefill=2)
    gpu_like._read_back_first = False
    snaps, seen = export_all(gpu_like, ps)
    for got in (seen, cpu_seen):
        assert [rows for rows, _ in got] == [[0, 1], [2, 3], [4, 5]]
        # When each batch is scheduled, every earlier batch's first tokens and KV are out.
        assert [done for _, done in got] == [[], [0, 1], [0, 1, 2, 3]]
    for i in range(len(ps)):  # the same first token and the same KV either way
        a, b = snaps[i], cpu[i]
        assert a.tokens == b.tokens and a.num_computed == b.num_computed
        for x, y in zip(a.keys + a.values, b.keys + b.values):
            assert (x == y).all()


def _import_run(eng, snap):
    out: queue.Queue = queue.Queue()
    eng.import_kv(snap, out.put)
    toks = []
    while True:
        ev = out.get(timeout=60)
        toks += ev.tokens
        if ev.finish_reason:
            return toks


@pytest.fixture(scope="module")
def six_snapshots(tiny):
    snaps, _ = export_all(make(tiny), prompts(6, 70, seed=2))
    return [snaps[i] for i in range(6)]


def _imports(tiny, snaps, policy: bool):
    dst = make(tiny, "decode" if policy else "hybrid")
    assert dst.scheduler.prefix_caching is not policy
    dst.start()
    try:
        return dst, [_import_run(dst, s) for s in snaps]  # one after another
    finally:
        dst.stop()


def test_a_decode_worker_keeps_its_kv_store_at_the_working_set(tiny, six_snapshots):
    dst, runs = _imports(tiny, six_snapshots, policy=True)
    cached, cached_runs = _imports(tiny, six_snapshots, policy=False)
    assert runs == cached_runs and all(len(r) == 7 for r in runs)  # 8 tokens, the first from the prefill side
    per_request = dst.pool.blocks_for(70 + 8)
    assert dst.pool.num_cached == 0
    assert dst.pool.high_water <= per_request  # each request reused the blocks of the one before
    # With the cache, finished requests' full blocks stay cached and every new request
    # takes fresh blocks: the high-water mark (and the KV store behind it) climbs.
    assert cached.pool.high_water >= 5 * (per_request - 1)


def test_a_decode_worker_imports_a_burst_in_one_step(tiny, six_snapshots):
    """Imports are one token each: all that wait go into one step (not max_batch_prefill
    at a time), and the tokens are those of importing them one by one."""
    _, one_by_one = _imports(tiny, six_snapshots, policy=True)
    dst = make(tiny, "decode")
    plans = []
    dst.add_schedule_hooks(after=lambda plan: plans.append((plan.kind, len(plan.rows))) if plan else None)
    outs = [queue.Queue() for _ in six_snapshots]
    for s, q in zip(six_snapshots, outs):  # queued before the loop starts: one burst
        dst.import_kv(s, q.put)
    dst.start()
    try:
        got = []
        for q in outs:
            toks = []
            while True:
                ev = q.get(timeout=60)
                toks += ev.tokens
                if ev.finish_reason:
                    break
            got.append(toks)
    finally:
        dst.stop()
    assert plans[0] == ("prefill", 6) and all(k == "decode" for k, _ in plans[1:])
    assert got == one_by_one
    assert not dst.scheduler.prefix_caching
    # The store was allocated for the whole batch up front (16 MiB pool: all of it).
    assert dst.store.capacity == min(dst.pool.num_blocks, 16 * dst.pool.blocks_for(512)) > 64


def test_a_prefill_worker_batches_as_its_engine_by_default_or_as_told(tiny):
    eng = make(tiny, "prefill")  # engine default: 4 a step
    ps = prompts(5, 30, seed=3)
    snaps, seen = export_all(eng, ps)
    assert seen == [([0, 1, 2, 3], []), ([4], [0, 1, 2, 3])]
    two = make(tiny, "prefill", prefill_batch=2)
    assert export_all(two, ps)[1] == [([0, 1], []), ([2, 3], [0, 1]), ([4], [0, 1, 2, 3])]
    one = make(tiny, "prefill", prefill_batch=1)
    assert [rows for rows, _ in export_all(one, ps[:2])[1]] == [[0], [1]]
    hybrid = make(tiny, "hybrid")  # the engine's own defaults are a hybrid worker's
    own = EngineSettings(kv_cache_budget="16MiB").resolve(on_cpu=True)
    assert hybrid.settings == own and hybrid.scheduler.prefix_caching


def test_a_decode_worker_is_built_for_its_batch_without_a_prefix_cache():
    s = EngineSettings(parallel=8, block_size=16, prefill_chunk_size=100, kv_initial_tokens=64)
    roles.engine_settings(s, "decode")
    assert not s.enable_prefix_caching
    assert s.max_batch_prefill == 8  # every waiting import in one step
    assert s.kv_initial_tokens == 8 * 112  # parallel x the chunk's blocks
    big = EngineSettings(parallel=2, kv_initial_tokens=100_000)
    roles.engine_settings(big, "decode")
    assert big.kv_initial_tokens == 100_000  # never smaller than the operator asked


def test_only_a_prefill_worker_builds_its_engine_without_decode_graphs():
    from tandem.pipeline.settings import EngineSettings

    for role, graphs in (("prefill", False), ("decode", True), ("hybrid", True)):
        s = EngineSettings()
        assert s.decode_graphs  # the engine's own default
        roles.engine_settings(s, role)
        assert s.decode_graphs is graphs, role


def test_the_engine_hands_its_decode_graphs_setting_to_the_runner(tiny, monkeypatch):
    import tandem.pipeline.engine as engine_mod

    seen = []
    real = engine_mod.make_runner
    monkeypatch.setattr(engine_mod, "make_runner", lambda model, store, shape, settings: seen.append(settings.decode_graphs) or real(model, store, shape, settings))
    for graphs in (False, True):
        make(tiny, decode_graphs=graphs)
    assert seen == [False, True]
