"""A streamed import on the receiving engine: blocks reserved when the first part comes,
each part copied in as it arrives, only the final part's blocks left to copy at
admission; exact against mlx_lm.generate, and every way it can end frees the blocks."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import queue
import time

import numpy as np
import pytest

from tandem.pipeline.api import EngineRequest
from tests.pipeline.conftest import oracle, random_prompts
from tests.pipeline.test_engine import MAX_TOKENS, greedy, make


@pytest.fixture(scope="module")
def streamed(tiny):
    """A 150-token prompt (10 blocks of 16) exported in parts by an engine prefilling 32
    tokens a chunk: the parts (blocks 0-2, 2-4, 4-6, 6-8), the first token, the whole
    snapshot (what the decode worker's assembler holds once the final part is in); and
    the oracle's tokens."""
    prompt = random_prompts(1, 150, 150, seed=21)[0]
    src = make(tiny, prefill_chunk_size=32)
    events: queue.Queue = queue.Queue()
    src.start()
    try:
        src.submit(EngineRequest(os.urandom(16), prompt, greedy(), events.put, export_after_prefill=True, stream_kv=True))
        evs = [events.get(timeout=30)]
        while evs[-1].snapshot is None:
            evs.append(events.get(timeout=30))
    finally:
        src.stop()
    parts, tail = [e.kv_part for e in evs[:-2]], evs[-1].snapshot
    pieces = parts + [tail]
    whole = dataclasses.replace(tail, first_block=0, keys=[np.concatenate(k) for k in zip(*(p.keys for p in pieces))],
                                values=[np.concatenate(v) for v in zip(*(p.values for p in pieces))])
    return parts, evs[-2].tokens, whole, oracle(tiny, prompt, MAX_TOKENS)


def _until_final(q: queue.Queue, timeout: float = 30.0):
    toks = []
    while True:
        ev = q.get(timeout=timeout)
        toks += ev.tokens
        if ev.finish_reason is not None:
            return toks, ev


@contextlib.contextmanager
def _receiving(tiny, **settings):
    """A started engine and a queue for its events; stopped afterwards, holding no block."""
    eng, q = make(tiny, **settings), queue.Queue()
    eng.start()
    try:
        yield eng, q
    finally:
        eng.stop()
    _no_blocks_held(eng)


def _reserve(eng, final, q: queue.Queue) -> None:
    eng.reserve_kv(final.request_id, final.num_computed, q.put)
    assert q.get(timeout=10).kv_reserved


def _count_copies(dst) -> list[int]:
    """The sizes of the engine's block copies into its store, as they happen."""
    copies, store_import = [], dst.store.import_blocks
    dst.store.import_blocks = lambda blocks, k, v: (copies.append(len(blocks)), store_import(blocks, k, v))[1]
    return copies


def _no_blocks_held(eng) -> None:
    eng.pool.check()
    assert all(c == 0 for c in eng.pool.ref_count)


def test_parts_go_into_reserved_blocks_as_they_come_and_the_import_continues_exactly(tiny, streamed):
    parts, first, final, expected = streamed
    with _receiving(tiny) as (dst, q):
        copies = _count_copies(dst)
        _reserve(dst, final, q)
        for p in parts:
            dst.import_part(p)
        # Before the final part: the blocks are held and the parts copied, nothing runs.
        deadline = time.monotonic() + 10
        while len(copies) < len(parts):
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert dst.pool.num_free == dst.pool.num_blocks - 10 and dst.stats().running == 0
        dst.import_kv(final, q.put)
        toks, last = _until_final(q)
    assert first + toks == expected and last.finish_reason in ("stop", "length")
    assert copies == [2, 2, 2, 2, 2]  # each part as it came; at admission only the final part's blocks


def test_a_reservation_the_pool_cannot_hold_is_refused_and_holds_nothing(tiny, streamed):
    parts, _, final, _ = streamed
    with _receiving(tiny, kv_cache_budget=str(8 * make(tiny).bytes_per_block)) as (dst, q):  # 8 blocks, 10 needed
        dst.reserve_kv(final.request_id, final.num_computed, q.put)
        refusal = q.get(timeout=10)
        assert refusal.kv_reserved is False and refusal.finish_reason is None
        assert "cannot hold 10 more blocks" in refusal.error
        for p in parts[:2]:
            dst.import_part(p)  # late parts of a refused transfer: dropped
        assert dst.generate_many([(final.tokens[:20], greedy(4))])  # the engine serves on
        assert q.empty()


def test_an_abort_frees_a_reservation_and_a_new_attempt_reserves_again(tiny, streamed):
    """The prefill side died or the request was aborted or moved mid-transfer: the
    reservation goes with its parts, and the same request id can open a new one (a
    migration's next attempt) that continues exactly."""
    parts, first, final, expected = streamed
    with _receiving(tiny) as (dst, q):
        _reserve(dst, final, q)
        dst.import_part(parts[0])
        dst.abort(final.request_id)
        assert q.get(timeout=10).finish_reason == "abort"
        dst.import_part(parts[1])  # after the abort: dropped
        _reserve(dst, final, q)
        for p in parts:
            dst.import_part(p)
        dst.import_kv(final, q.put)
        toks, _ = _until_final(q)
    assert first + toks == expected


@pytest.mark.parametrize("bad", ["gap", "early_final"])
def test_parts_that_do_not_follow_their_reservation_still_continue_exactly(tiny, streamed, bad):
    """A part out of order drops the reservation (its owner hears: kv_reserved False) and
    the final import goes in whole; a final import before the last parts copies the
    blocks they would have brought from its own snapshot."""
    parts, first, final, expected = streamed
    with _receiving(tiny) as (dst, q):
        copies = _count_copies(dst)
        _reserve(dst, final, q)
        dst.import_part(parts[0])
        if bad == "gap":
            dst.import_part(parts[2])  # blocks 4-6 after 0-2
            dropped = q.get(timeout=10)
            assert dropped.kv_reserved is False and "does not follow" in dropped.error
        dst.import_kv(final, q.put)
        toks, _ = _until_final(q)
    assert first + toks == expected
    assert copies[-1] == (10 if bad == "gap" else 8) and copies[:-1] in ([], [2])


def test_a_part_of_another_block_size_is_refused_at_once(tiny, streamed):
    parts, *_ = streamed
    with pytest.raises(ValueError, match="blocks of 16 tokens, this pool's are 32"):
        make(tiny, block_size=32).import_part(parts[0])
    with pytest.raises(ValueError, match="does not match"):
        make(tiny).import_part(dataclasses.replace(parts[0], first_block=9))


def test_an_idle_engine_takes_parts_while_its_before_hook_would_wait(tiny, streamed):
    """A decode worker's CPU gate waits in a before-schedule hook while a co-located
    prefill runs: an idle engine runs no such hook, so the parts of that very prompt go
    into the store during its prefill; the request itself waits for the hook as any step."""
    import threading

    parts, first, final, expected = streamed
    gate, copies = threading.Event(), []
    dst = make(tiny)
    dst.add_schedule_hooks(before=lambda: gate.wait(30))
    store_import = dst.store.import_blocks
    dst.store.import_blocks = lambda blocks, k, v: (copies.append(len(blocks)), store_import(blocks, k, v))[1]
    q: queue.Queue = queue.Queue()
    dst.start()
    try:
        _reserve(dst, final, q)
        for p in parts:
            dst.import_part(p)
        deadline = time.monotonic() + 10
        while len(copies) < len(parts):
            assert time.monotonic() < deadline, "parts not copied while the gate is shut"
            time.sleep(0.01)
        dst.import_kv(final, q.put)
        time.sleep(0.2)
        assert q.empty() and copies == [2, 2, 2, 2]  # the request waits for the gate
        gate.set()
        toks, _ = _until_final(q)
    finally:
        gate.set()
        dst.stop()
    assert first + toks == expected and copies == [2, 2, 2, 2, 2]
    _no_blocks_held(dst)
