"""The engine against mlx_lm.generate: batched, paged, chunked, cached, preempted == alone."""

from __future__ import annotations

import os
import queue
import threading

import pytest

from tandem.kvtypes import SamplingParams
from tandem.pipeline.api import EngineRefused, EngineRequest
from tandem.pipeline.engine import Engine, _ranges, parse_cpus
from tandem.pipeline.settings import EngineSettings
from tests.pipeline.conftest import EOS, continue_import, oracle, random_prompts

MAX_TOKENS = 16


@pytest.fixture(scope="module")
def mixed(tiny):
    """16 prompts of 1..70 tokens and what the oracle yields for each alone."""
    prompts = random_prompts(16, 1, 70, seed=7)
    return prompts, [oracle(tiny, p, MAX_TOKENS) for p in prompts]


def make(model, **kw) -> Engine:
    kw.setdefault("kv_cache_budget", "16MiB")
    return Engine(model, EngineSettings(**kw), model_id="tiny", eos_token_ids=[EOS])


def greedy(n=MAX_TOKENS, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, **kw)


CONFIGS = {
    "default": {},
    "chunked": dict(prefill_chunk_size=16, prefill_grant_interval=2),
    "chunked-no-grant": dict(prefill_chunk_size=16, prefill_grant_interval=0),
    "sequential-prefill": dict(max_batch_prefill=1),
    "small-blocks-small-batch": dict(block_size=4, max_batch_size=3, parallel=8),
    "prefill-token-cap": dict(max_batch_prefill=8, max_batch_prefill_tokens=96),
    "no-prefix-cache": dict(enable_prefix_caching=False),
    "no-decode-mirror": dict(decode_mirror=False, max_batch_size=5),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_batch_matches_single(tiny, mixed, name):
    prompts, expected = mixed
    eng = make(tiny, **CONFIGS[name])
    got = eng.generate_many([(p, greedy()) for p in prompts])
    assert got == expected


@pytest.mark.parametrize("n", [1, 2, 5])
def test_small_batches_match_single(tiny, mixed, n):
    prompts, expected = mixed
    assert make(tiny).generate_many([(p, greedy()) for p in prompts[:n]]) == expected[:n]


def test_prefix_hits_reuse_blocks_and_match(tiny):
    system = random_prompts(1, 48, 48, seed=3)[0]  # exactly 3 blocks of 16
    prompts = [system + s for s in random_prompts(6, 1, 20, seed=4)] + [system]
    expected = [oracle(tiny, p, MAX_TOKENS) for p in prompts]
    eng = make(tiny)
    assert eng.generate_many([(p, greedy()) for p in prompts]) == expected
    # Second round: every prompt finds its prefix cached, including the block-aligned one
    # whose last cached block must be copied before its last token is recomputed.
    before = eng.stats()
    assert eng.generate_many([(p, greedy()) for p in prompts]) == expected
    after = eng.stats()
    assert after.prefix_hits - before.prefix_hits == len(prompts)
    assert after.running == after.waiting == 0 and after.free_blocks == after.total_blocks
    assert after.steps > before.steps > 0 and after.tokens_per_s > 0 and after.block_size == 16
    assert after.cached_blocks > 0 and 0 < after.prefix_hit_ratio <= 1
    assert after.kv_store_bytes == eng.store.nbytes > 0  # what heartbeats report as the store's memory
    assert after.mlx_cache_bytes > 0  # freed arrays MLX keeps for reuse (heartbeats count them as not in use)
    assert after.prefix_tokens_saved - before.prefix_tokens_saved >= 48 * len(prompts) - 1
    assert eng.pool.counters.cow_copies >= 1
    eng.pool.check()
    assert all(c == 0 for c in eng.pool.ref_count)


def test_concurrent_borrowers_share_one_copy(tiny):
    system = random_prompts(1, 64, 64, seed=5)[0]
    eng = make(tiny)
    eng.generate_many([(system + [7], greedy(1))])
    prompts = [system + s for s in random_prompts(4, 2, 9, seed=6)]
    expected = [oracle(tiny, p, MAX_TOKENS) for p in prompts]
    assert eng.generate_many([(p, greedy()) for p in prompts]) == expected
    assert eng.stats().prefix_hits == 5 - 1  # the first request had nothing to hit
    assert eng.pool.num_cached >= 4  # the shared blocks stay cached once, not per borrower


@pytest.mark.parametrize("preempt", [True, False])
def test_kv_pressure_preempts_or_queues_and_still_matches(tiny, mixed, preempt):
    prompts, expected = mixed
    # 8 KiB per block for the tiny model: 24 blocks hold a few sequences, not 16.
    eng = make(tiny, kv_cache_budget="192KiB", enable_preemption=preempt)
    assert eng.pool.num_blocks == 24
    got = eng.generate_many([(p, greedy()) for p in prompts])
    assert got == expected
    if preempt:
        assert eng.scheduler.preemptions > 0 and eng.stats().preemptions == eng.scheduler.preemptions
    else:
        assert eng.scheduler.preemptions == 0
    eng.pool.check()
    assert all(c == 0 for c in eng.pool.ref_count)


def test_priority_preempts_to_admit(tiny, mixed):
    prompts, _ = mixed
    n = 24
    expected = [oracle(tiny, p, n, eos=()) for p in prompts[:3]]
    eng = make(tiny, parallel=2, enable_preemption=True)
    events: queue.Queue = queue.Queue()
    got: dict[bytes, list[int]] = {}
    ids = [bytes([65 + i]) * 16 for i in range(3)]
    eng.start()
    try:
        for rid, p in zip(ids[:2], prompts[:2]):
            eng.submit(EngineRequest(rid, p, greedy(n, ignore_eos=True), events.put, priority=0))
        done = 0
        while done < 3:
            ev = events.get(timeout=30)
            got.setdefault(ev.request_id, []).extend(ev.tokens)
            if len(got) == 2 and ids[2] not in got and all(len(v) >= 2 for v in got.values()):
                got[ids[2]] = []  # both low-priority streams are decoding: now the urgent one
                eng.submit(EngineRequest(ids[2], prompts[2], greedy(n, ignore_eos=True), events.put, priority=5))
            done += ev.finish_reason is not None
    finally:
        eng.stop()
    assert [got[r] for r in ids] == expected  # the preempted stream continued without loss
    assert eng.scheduler.preemptions >= 1


def test_export_import_continues_token_identically(tiny):
    prompt = random_prompts(1, 37, 37, seed=11)[0]
    expected = oracle(tiny, prompt, MAX_TOKENS)
    src = make(tiny)
    events: queue.Queue = queue.Queue()
    src.start()
    try:
        src.submit(EngineRequest(b"x" * 16, prompt, greedy(), events.put, export_after_prefill=True))
        first, ev = events.get(timeout=30), events.get(timeout=30)
    finally:
        src.stop()
    # The first token comes out before the export, in an event of its own; then the KV.
    assert first.tokens == expected[:1] and first.snapshot is None and first.finish_reason is None
    assert first.usage.prompt_tokens == len(prompt) and first.usage.completion_tokens == 1
    assert ev.finish_reason is None and ev.snapshot is not None and ev.tokens == []
    assert events.empty()
    snap = ev.snapshot
    assert snap.num_computed == len(prompt) and snap.tokens == prompt + expected[:1]
    assert snap.keys[0].shape == (3, 2, 16, 16)
    assert all(c == 0 for c in src.pool.ref_count)
    for block_size in (16, 8):  # the decode side may page differently
        toks, e = continue_import(make(tiny, block_size=block_size), snap)
        assert expected[:1] + toks == expected
        assert e.usage.prompt_tokens == len(prompt) and e.usage.completion_tokens == len(expected) + (len(expected) < MAX_TOKENS)


def test_a_streamed_export_is_the_whole_export_in_parts(tiny):
    """stream_kv: each prefill chunk's completed blocks come out as a part before the first
    token; the parts and the final event's blocks, joined, are bit for bit the export of
    the same prompt in one piece, with the same token state; and the import continues
    exactly. A prefix-cache hit's blocks go out in the first part."""
    import dataclasses

    import numpy as np

    prompt = random_prompts(1, 150, 150, seed=21)[0]  # 10 blocks of 16, 5 chunks of 32
    expected = oracle(tiny, prompt, MAX_TOKENS)

    def export(stream: bool, eng, p=prompt):
        events: queue.Queue = queue.Queue()
        eng.submit(EngineRequest(os.urandom(16), p, greedy(), events.put, export_after_prefill=True, stream_kv=stream))
        evs = [events.get(timeout=30)]
        while evs[-1].snapshot is None:
            evs.append(events.get(timeout=30))
        return evs

    whole_engine, streamed_engine = make(tiny, prefill_chunk_size=32), make(tiny, prefill_chunk_size=32)
    whole_engine.start()
    streamed_engine.start()
    try:
        (first, whole), evs = export(False, whole_engine), export(True, streamed_engine)
        # The first 9 blocks are in the prefix cache now; 106 more tokens are 4 chunks.
        again = export(True, streamed_engine, prompt + random_prompts(1, 100, 100, seed=22)[0])
    finally:
        whole_engine.stop()
        streamed_engine.stop()
    parts, token, final = evs[:-2], evs[-2], evs[-1]
    assert [p.kv_part.first_block for p in parts] == [0, 2, 4, 6]  # chunks end at 32, 64, 96, 128 tokens
    assert all(p.tokens == [] and p.snapshot is None for p in parts) and token.tokens == first.tokens == expected[:1]
    assert all(p.kv_part.num_computed == len(prompt) and p.kv_part.tokens == prompt for p in parts)
    assert final.snapshot.first_block == 8 and final.kv_part is None
    pieces = [p.kv_part for p in parts] + [final.snapshot]
    joined = dataclasses.replace(final.snapshot, first_block=0,
                                 keys=[np.concatenate(k) for k in zip(*(p.keys for p in pieces))],
                                 values=[np.concatenate(v) for v in zip(*(p.values for p in pieces))])
    ref = whole.snapshot
    assert joined.tokens == ref.tokens and joined.num_computed == ref.num_computed and joined.first_block == 0
    for a, b in zip(joined.keys + joined.values, ref.keys + ref.values):
        assert np.array_equal(a, b)
    cached = [e.kv_part for e in again if e.kv_part is not None]
    assert [c.first_block for c in cached] == [0, 11, 13] and cached[0].keys[0].shape[0] == 11
    assert again[-1].snapshot.first_block == 15 and again[-1].snapshot.keys[0].shape[0] == 1
    assert all(c == 0 for c in streamed_engine.pool.ref_count)
    toks, _ = continue_import(make(tiny), joined)
    assert expected[:1] + toks == expected


def test_seeded_sampling_is_reproducible_regardless_of_batch_mates(tiny):
    prompt = random_prompts(1, 20, 20, seed=12)[0]
    sp = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, min_p=0.01, seed=1234, max_tokens=24, ignore_eos=True)
    alone = make(tiny).generate_many([(prompt, sp)])[0]
    mates = [(p, SamplingParams(temperature=1.0, seed=i, max_tokens=30, ignore_eos=True)) for i, p in enumerate(random_prompts(7, 1, 60, seed=13))]
    crowd = make(tiny, prefill_chunk_size=16).generate_many(mates[:3] + [(prompt, sp)] + mates[3:])[3]
    assert alone == crowd and len(alone) == 24
    other_seed = make(tiny).generate_many([(prompt, SamplingParams(**{**sp.__dict__, "seed": 99}))])[0]
    assert other_seed != alone
    greedy_run = make(tiny).generate_many([(prompt, greedy(24, ignore_eos=True))])[0]
    assert greedy_run != alone  # temperature 0.9 really samples


def test_sampled_export_import_matches_single_engine(tiny):
    prompt = random_prompts(1, 25, 25, seed=14)[0]
    sp = SamplingParams(temperature=0.8, seed=77, max_tokens=12, ignore_eos=True)
    whole = make(tiny).generate_many([(prompt, sp)])[0]
    src, dst = make(tiny), make(tiny)
    q1: queue.Queue = queue.Queue()
    src.start()
    src.submit(EngineRequest(b"y" * 16, prompt, sp, q1.put, export_after_prefill=True))
    first, snap = q1.get(timeout=30).tokens, q1.get(timeout=30).snapshot
    assert first == whole[:1]
    src.stop()
    q2: queue.Queue = queue.Queue()
    dst.start()
    dst.import_kv(snap, q2.put)
    toks = []
    while True:
        e = q2.get(timeout=30)
        toks += e.tokens
        if e.finish_reason:
            break
    dst.stop()
    assert snap.tokens[-1:] + toks == whole


def test_stop_ids_logit_bias_and_logprobs(tiny, mixed):
    import mlx.core as mx

    prompts, expected = mixed
    p, exp = prompts[0], expected[0]
    eng = make(tiny)
    # a stop id ends the stream without emitting it
    stopped = eng.generate_many([(p, greedy(stop_token_ids=[exp[3]]))])[0]
    assert stopped == exp[: exp.index(exp[3])]
    # a large bias forces a token
    biased = eng.generate_many([(p, greedy(4, logit_bias={42: 1e4}))])[0]
    assert biased == [42, 42, 42, 42]
    # logprobs: the chosen token's log-softmax and the top-N list, best first
    events: queue.Queue = queue.Queue()
    eng.start()
    eng.submit(EngineRequest(b"z" * 16, p, greedy(3, logprobs=5), events.put))
    evs = []
    while not evs or evs[-1].finish_reason is None:
        evs.append(events.get(timeout=30))
    eng.stop()
    logits = tiny(mx.array([p]))[0, -1]
    ref = (logits - mx.logsumexp(logits)).tolist()
    first = evs[0].logprobs[0]
    assert first.token == exp[0] and abs(first.logprob - ref[exp[0]]) < 1e-4
    assert [t for t, _ in first.top][0] == exp[0] and len(first.top) == 5
    assert all(a[1] >= b[1] for a, b in zip(first.top, first.top[1:]))


def test_logprobs_match_tokens_when_a_stop_id_ends_the_stream(tiny, mixed):
    """The stop token is not emitted, so it gets no logprob either: a final event with one
    logprob too many failed the wire's check and the whole request (found by bench/chaos.py)."""
    prompts, expected = mixed
    p, exp = prompts[0], expected[0]
    events: queue.Queue = queue.Queue()
    eng = make(tiny)
    eng.start()
    eng.submit(EngineRequest(b"y" * 16, p, greedy(stop_token_ids=[exp[3]], logprobs=2), events.put))
    evs = []
    while not evs or evs[-1].finish_reason is None:
        evs.append(events.get(timeout=30))
    eng.stop()
    assert evs[-1].finish_reason == "stop"
    for ev in evs:
        assert len(ev.logprobs or []) == len(ev.tokens)
    assert [lp.token for ev in evs for lp in ev.logprobs or []] == exp[: exp.index(exp[3])]


def test_abort_refusals_and_validation(tiny):
    eng = make(tiny, max_queue_depth=2, kv_cache_budget="64KiB")  # 8 blocks of 16 tokens
    with pytest.raises(EngineRefused):
        eng.submit(EngineRequest(b"a" * 16, list(range(3, 300)), greedy(), print))
    with pytest.raises(ValueError):
        eng.submit(EngineRequest(b"a" * 16, [], greedy(), print))
    with pytest.raises(ValueError):
        eng.submit(EngineRequest(b"short", [5], greedy(), print))
    events: queue.Queue = queue.Queue()
    eng.submit(EngineRequest(b"1" * 16, [5, 6, 7], greedy(1000, ignore_eos=True), events.put))
    eng.submit(EngineRequest(b"2" * 16, [5, 6, 8], greedy(1000, ignore_eos=True), events.put))
    with pytest.raises(EngineRefused):  # not started: both still queued
        eng.submit(EngineRequest(b"3" * 16, [5], greedy(), events.put))
    eng.start()
    try:
        first = events.get(timeout=30)
        eng.abort(b"1" * 16)
        eng.abort(b"1" * 16)  # idempotent
        eng.abort(b"9" * 16)  # unknown: ignored
        seen = {b"1" * 16: None, b"2" * 16: None}
        while seen[b"1" * 16] is None:
            e = events.get(timeout=30)
            if e.finish_reason:
                seen[e.request_id] = e.finish_reason
        assert seen[b"1" * 16] == "abort"
    finally:
        eng.stop()
    assert first.finish_reason is None
    # stop() ends whatever is left with "abort" and frees every block
    while True:
        e = events.get(timeout=5)
        if e.request_id == b"2" * 16 and e.finish_reason:
            assert e.finish_reason == "abort"
            break
    assert all(c == 0 for c in eng.pool.ref_count)


def test_repeated_blocks_never_alias_after_copy_on_write(tiny):
    """A full-prompt hit copies its last block; the copy must not be registered under the
    next position's hash, or a prompt repeating that block would reuse the wrong KV."""
    x = random_prompts(1, 16, 16, seed=31)[0]
    eng = make(tiny)
    eng.generate_many([(x + x, greedy(4))])
    eng.generate_many([(x + x, greedy(4))])  # full hit: recompute the last token after a copy
    assert eng.pool.counters.cow_copies == 1
    longer = x + x + x + [5, 6, 7]
    assert eng.generate_many([(longer, greedy())]) == [oracle(tiny, longer, MAX_TOKENS)]
    assert eng.stats().prefix_tokens_saved == 31 + 32  # two blocks, not three


def test_seed_offset_continues_a_sampled_stream_after_migration(tiny):
    """A request resubmitted as prompt + its first k tokens with seed_offset k draws the
    same remaining tokens the uninterrupted run drew (what broker migration relies on)."""
    prompt = random_prompts(1, 18, 18, seed=15)[0]
    sp = SamplingParams(temperature=0.9, top_k=40, seed=4242, max_tokens=20, ignore_eos=True)
    whole = make(tiny).generate_many([(prompt, sp)])[0]
    k = 7
    rest = SamplingParams(**{**sp.__dict__, "max_tokens": 20 - k, "seed_offset": k})
    resumed = make(tiny).generate_many([(prompt + whole[:k], rest)])[0]
    assert resumed == whole[k:]
    restarted = make(tiny).generate_many([(prompt + whole[:k], SamplingParams(**{**rest.__dict__, "seed_offset": 0}))])[0]
    assert restarted != whole[k:]  # without the offset the stream would not continue


def test_blocks_filled_by_mirrored_decode_serve_prefix_hits_and_reuse(tiny):
    """Decode steps append KV to the mirror and reach the pool only at a flush: a later
    prompt that continues a finished request's output hits the blocks filled during its
    decode, and those blocks, freed and reused by others, never leak stale entries."""
    first = random_prompts(3, 5, 9, seed=21)  # three rows keep the mirror in append mode
    eng = make(tiny, block_size=4)
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    outs = eng.generate_many([(p, params) for p in first])
    # Each prompt + all but the last generated token lies in blocks written by decode.
    follow = [p + o[:-1] for p, o in zip(first, outs)]
    before = eng.stats()
    got = eng.generate_many([(p, greedy()) for p in follow] + [(p, greedy()) for p in random_prompts(3, 30, 40, seed=22)])
    want = [oracle(tiny, p, MAX_TOKENS) for p in follow] + [oracle(tiny, p, MAX_TOKENS) for p in random_prompts(3, 30, 40, seed=22)]
    assert got == want
    assert eng.stats().prefix_tokens_saved - before.prefix_tokens_saved >= sum(len(p) for p in follow) - 3 * 4
    eng.pool.check()


def test_schedule_hooks_run_around_every_plan_on_the_engine_thread(tiny, mixed):
    prompts, expected = mixed
    eng = make(tiny)
    seen = []
    eng.add_schedule_hooks(before=lambda: seen.append(("before", threading.current_thread().name)),
                           after=lambda plan: seen.append(("after", plan.kind if plan else None)))
    assert eng.generate_many([(p, greedy()) for p in prompts[:3]]) == expected[:3]
    befores = [s for s in seen if s[0] == "before"]
    afters = [s[1] for s in seen if s[0] == "after"]
    # ``before`` ahead of every decision with work to schedule (none on an idle tick), ``after`` on every one.
    assert seen[0][0] == "before" and all(seen[i + 1][0] == "after" for i, s in enumerate(seen) if s[0] == "before")
    assert all(seen[i - 1][0] == "before" for i, s in enumerate(seen) if s[0] == "after" and s[1] is not None)
    assert "prefill" in afters and "decode" in afters
    assert all(name != threading.main_thread().name for _, name in befores)


def _first_prefill_rows(tiny, mixed, gap_s: float, **kw) -> tuple[list[int], list[list[int]]]:
    """Start an idle engine, submit 4 prompts ``gap_s`` apart from this thread; return the
    row counts of its prefill plans and what each request generated."""
    prompts, _ = mixed
    eng = make(tiny, **kw)
    prefills = []
    eng.add_schedule_hooks(after=lambda plan: prefills.append(len(plan.rows)) if plan and plan.kind == "prefill" else None)
    eng.start()
    done: queue.Queue = queue.Queue()
    out: dict[bytes, list[int]] = {}
    ids = [bytes([i]) * 16 for i in range(4)]
    try:
        for rid, p in zip(ids, prompts[:4]):
            out[rid] = []
            eng.submit(EngineRequest(rid, p, greedy(), done.put))
            threading.Event().wait(gap_s)
        finished = 0
        while finished < 4:
            ev = done.get(timeout=60)
            out[ev.request_id].extend(ev.tokens)
            finished += ev.finish_reason is not None
    finally:
        eng.stop()
    return prefills, [out[rid] for rid in ids]


def test_an_idle_engine_gathers_a_burst_into_its_first_prefill(tiny, mixed):
    # Prompts 20 ms apart: within a 10 s window the first prefill waits for all four
    # (max_batch_prefill), and the tokens are still each prompt's own.
    _, expected = mixed
    rows, got = _first_prefill_rows(tiny, mixed, 0.02, admit_wait_ms=10_000, max_batch_prefill=4)
    assert rows == [4]
    assert got == expected[:4]
    # Without the window the engine starts on the first arrival.
    rows, got = _first_prefill_rows(tiny, mixed, 0.2, admit_wait_ms=0, max_batch_prefill=4)
    assert rows[0] == 1 and sum(rows) == 4
    assert got == expected[:4]


def test_decode_mirror_is_sized_for_the_rows_remaining_tokens(tiny):
    """A rebuild of the decode mirror gathers every row's blocks: the mirror is sized for
    what its rows may still generate, so a batch that runs to max_tokens rebuilds it once
    (with room for only 64 more tokens it rebuilt every ~128), and stays == alone."""
    prompts = random_prompts(3, 5, 9, seed=31)
    eng = make(tiny)
    rebuilds = []
    real = eng.runner.rebuild_mirror_layer
    eng.runner.rebuild_mirror_layer = lambda layer: (rebuilds.append(layer), real(layer))[1]
    params = SamplingParams(temperature=0.0, max_tokens=150, ignore_eos=True)
    got = eng.generate_many([(p, params) for p in prompts])
    assert got == [oracle(tiny, p, 150, eos=()) for p in prompts]
    assert rebuilds.count(0) == 1


def test_a_long_lived_engine_keeps_its_kv_store_at_the_working_set(tiny):
    """Distinct prompts one after another, each leaving its full blocks in the prefix
    cache: the pool evicts cached blocks before it hands out one past the KV store, so the
    store stays at its first 64 blocks (the pool handed out never-used blocks first, and
    the store doubled as the high-water mark crept up a request per request), and the
    latest prompt still hits the cache."""
    eng = make(tiny, kv_initial_tokens=0)  # the store's smallest start, 64 blocks
    ps = random_prompts(20, 70, 70, seed=21)  # 5 blocks each with their 8 tokens: 100 in all
    sp = greedy(8, ignore_eos=True)
    assert eng.store.capacity == 64 and eng.pool.num_blocks > 128
    eng.start()
    try:
        outs = [eng.generate_many([(p, sp)])[0] for p in ps]
        hits = eng.pool.counters.prefix_hits
        again = eng.generate_many([(ps[-1], sp)])[0]
    finally:
        eng.stop()
    assert eng.store.capacity == 64 and eng.pool.high_water <= 64 and eng.pool.counters.evictions > 0
    assert eng.pool.counters.prefix_hits == hits + 1 and again == outs[-1]
    assert outs[0] == oracle(tiny, ps[0], 8, eos=()) and outs[-1] == oracle(tiny, ps[-1], 8, eos=())


def test_the_kv_store_starts_at_a_full_engine_of_mid_length_prompts(tiny):
    """Unset, kv_initial_tokens is parallel x prefill_chunk_size / 2, so a burst of that
    many mid-length prompts never grows the store (each growth copies it inside a step);
    the pool's budget caps it, and a small setting keeps the old 64-block start."""
    big = make(tiny, parallel=8, prefill_chunk_size=256, block_size=8, kv_cache_budget="64MiB")
    assert big.store.capacity == 8 * 256 // 2 // 8 < big.pool.num_blocks
    capped = make(tiny, parallel=64, prefill_chunk_size=4096, block_size=8, kv_cache_budget="1MiB")
    assert capped.store.capacity == capped.pool.num_blocks
    small = make(tiny, kv_initial_tokens=100, block_size=8)
    assert small.store.capacity == 64
    prompts = random_prompts(8, 96, 104, seed=5)  # with 4 new tokens at most 14 blocks each: 112 of 128
    big.start()
    try:
        got = big.generate_many([(p, greedy(4, ignore_eos=True)) for p in prompts])
    finally:
        big.stop()
    assert big.store.capacity == 128 and got == [oracle(tiny, p, 4, eos=()) for p in prompts]


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="CPU pinning is Linux-only")
def test_engine_thread_runs_on_the_cpus_asked_for(tiny):
    allowed = sorted(os.sched_getaffinity(0))
    eng = make(tiny, cpus=str(allowed[-1]))
    eng.start()
    try:
        assert eng.generate_many([([5, 6, 7], greedy(2))]) and eng._thread is not None
        assert os.sched_getaffinity(eng._thread.native_id) == {allowed[-1]}
    finally:
        eng.stop()
    assert os.sched_getaffinity(0) == set(allowed)  # the caller's own threads are left alone


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="CPU pinning is Linux-only")
def test_bad_cpu_settings_fail_with_what_is_allowed():
    allowed = os.sched_getaffinity(0)
    assert parse_cpus(None) is None and parse_cpus(" ") is None
    assert parse_cpus(f"{min(allowed)}") == {min(allowed)}
    if len(allowed) > 1 and {0, 1} <= allowed:
        assert parse_cpus("0-1") == {0, 1} and parse_cpus("1,0") == {0, 1}
    assert _ranges({0, 1, 2, 5, 7, 8}) == "0-2,5,7-8"
    for text, words in (("x", "expected CPU numbers"), ("3-1", "runs backwards"),
                        (str(max(allowed) + 1000), "not available to this process; it may use " + _ranges(allowed))):
        with pytest.raises(ValueError, match=words):
            parse_cpus(text)
