"""Scheduler policy without a model: the grant bound, admission limits, and no block leaks."""

from __future__ import annotations

import random

from tandem.kvtypes import SamplingParams
from tandem.pipeline.block_pool import BlockPool
from tandem.pipeline.scheduler import Scheduler
from tandem.pipeline.sequence import Sequence, Status
from tandem.pipeline.settings import EngineSettings


def seq(n_prompt: int, max_tokens: int = 10_000, priority: int = 0, tok: int = 1) -> Sequence:
    sp = SamplingParams(max_tokens=max_tokens, seed=0)
    return Sequence(bytes(16), [tok] * n_prompt, n_prompt, sp, lambda e: None, priority=priority)


def run_tick(s: Scheduler, rng: random.Random | None = None, stop_p: float = 0.0):
    """One schedule + launch + read-back, with made-up sampled tokens; returns the plan."""
    plan = s.schedule()
    if plan is None:
        return None
    s.advance(plan)
    for r in plan.rows:
        s.register_full_blocks(r.seq)
        if r.samples and r.seq.status is Status.RUNNING:
            r.seq.pending -= 1
            r.seq.tokens.append(rng.randrange(4) if rng else 1)
            r.seq.num_generated += 1
            s.register_full_blocks(r.seq)
            if r.seq.num_generated >= r.seq.sampling.max_tokens or r.seq.hold or (rng and rng.random() < stop_p):
                s.remove(r.seq)
        elif r.samples:
            r.seq.pending -= 1  # preempted after launch: the token still arrives
            r.seq.tokens.append(1)
            r.seq.num_generated += 1
    return plan


def settings(**kw) -> EngineSettings:
    return EngineSettings(**kw)


def test_grant_bounds_a_parked_prompts_first_token():
    for n in (1, 3, 16):
        chunk, C = 32, 5
        s = Scheduler(settings(parallel=8, prefill_chunk_size=chunk, prefill_grant_interval=n), BlockPool(4096, 16))
        for _ in range(4):
            s.add(seq(8))
        run_tick(s)  # the decoders are admitted and prefilled together
        assert len(s.running) == 4
        long = seq(C * chunk)
        s.add(long)
        ticks = 0
        while long.num_generated == 0:
            plan = run_tick(s)
            ticks += 1
            assert any(q is not long for q in s.running)  # decode always had work
            assert ticks <= C * (n + 1), f"first token not within C x (N + 1) = {C * (n + 1)} ticks"
        # and the bound is tight-ish: decoders got their N ticks between grants
        assert ticks == 1 + (C - 1) * (n + 1)
        assert s.grants == C - 1


def test_without_grant_a_parked_prompt_waits_for_decode_to_drain():
    s = Scheduler(settings(parallel=8, prefill_chunk_size=32, prefill_grant_interval=0), BlockPool(4096, 16))
    for _ in range(2):
        s.add(seq(8, max_tokens=50))
    run_tick(s)
    long = seq(3 * 32)
    s.add(long)
    ticks = 0
    while long.num_generated == 0:
        run_tick(s)
        ticks += 1
    assert ticks > 50  # only after the decoders finished


def test_admission_respects_parallel_batch_prefill_and_token_cap():
    s = Scheduler(settings(parallel=3, max_batch_prefill=2, prefill_chunk_size=64, max_batch_prefill_tokens=100), BlockPool(4096, 16))
    for n in (40, 40, 10, 10):
        s.add(seq(n))
    plan = s.schedule()
    assert plan.kind == "prefill" and [r.n for r in plan.rows] == [40, 40]  # 2 x 40 <= 100
    s.advance(plan)
    plan = s.schedule()
    assert plan.kind == "prefill" and [r.n for r in plan.rows] == [10]  # parallel = 3
    assert len(s.waiting) == 1


def test_only_one_long_prompt_parks_and_blocks_admission():
    s = Scheduler(settings(parallel=8, prefill_chunk_size=16), BlockPool(4096, 16))
    s.add(seq(40))
    s.add(seq(40))
    s.add(seq(5))
    plan = s.schedule()
    assert len(plan.rows) == 1 and s.parked is plan.rows[0].seq and not plan.rows[0].samples
    assert len(s.waiting) == 2  # head-of-line behind the parked prompt


def test_no_preemption_reserves_lifetime_blocks():
    pool = BlockPool(10, 16)
    s = Scheduler(settings(parallel=8, enable_preemption=False), pool)
    s.add(seq(16, max_tokens=64))  # needs ceil(80/16) = 5 blocks over its life
    s.add(seq(16, max_tokens=64))
    s.add(seq(16, max_tokens=64))
    plan = run_tick(s)
    assert len(plan.rows) == 2  # the third would overrun when all three grow
    for _ in range(1000):
        if not (s.running or s.waiting):
            break
        run_tick(s)
        assert len(s.running) <= 2 and pool.num_free >= 0
    assert not (s.running or s.waiting) and pool.num_free == 10


def test_random_interleavings_never_leak_blocks():
    """10,000 random submits, aborts, finishes and KV-pressure preemptions."""
    rng = random.Random(99)
    for preemption in (True, False):
        pool = BlockPool(48, 4)
        s = Scheduler(settings(parallel=6, max_batch_prefill=3, prefill_chunk_size=8, prefill_grant_interval=2,
                               enable_preemption=preemption, block_size=4), pool)
        live: list[Sequence] = []
        for step in range(10_000):
            op = rng.random()
            if op < 0.2 and len(s.waiting) < 8:
                prompt = [rng.randrange(3) for _ in range(rng.randint(1, 30))]
                q = seq(1, max_tokens=rng.randint(1, 20), priority=rng.randrange(3))
                q.tokens, q.prompt_len = prompt, len(prompt)
                q.export_after_prefill = rng.random() < 0.1
                s.add(q)
                live.append(q)
            elif op < 0.27 and live:
                victim = rng.choice(live)
                if victim.status is not Status.FINISHED:
                    s.remove(victim)
            else:
                plan = run_tick(s, rng, stop_p=0.05)
                if plan is not None:
                    for q, _ in plan.failed:
                        assert q.status is Status.FINISHED
            live = [q for q in live if q.status is not Status.FINISHED]
            if step % 1000 == 0:
                pool.check()
                held = sum(len(q.block_ids) for q in s.running)
                assert held >= sum(1 for c in pool.ref_count if c > 0)
        for q in list(s.waiting) + list(s.running):
            s.remove(q)
        pool.check()
        assert all(c == 0 for c in pool.ref_count), "a block is still referenced"
        assert pool.num_free == pool.num_blocks
        if preemption:
            assert s.preemptions > 0
