"""The real engine on the tiny model behind the broker: disaggregated (2 prefill + 2
decode workers, KV handed off over sealed channels) == hybrid == one in-process engine,
token for token at temperature 0, for 32 concurrent requests."""

from __future__ import annotations

import asyncio
import collections
import json
import random
import re
import signal

import pytest

from tandem.kvtypes import SamplingParams
from tandem.wire.client import AsyncClient
from tests.integration.test_cluster_stub import wait_clean

N_REQUESTS = 32


def _prompts():
    rng = random.Random(7)
    # Varied lengths (several KV blocks, partial last blocks) and a shared prefix for some,
    # so prefix caching and multi-block handoffs are both exercised.
    shared = [rng.randrange(3, 380) for _ in range(40)]
    out = []
    for i in range(N_REQUESTS):
        n = rng.randrange(3, 70)
        body = [rng.randrange(3, 380) for _ in range(n)]
        out.append(shared + body if i % 3 == 0 else body)
    return out


def _sampling():
    return SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def _single_process(model_dir, requests) -> list[list[int]]:
    """What one in-process engine yields for each (prompt, sampling) alone."""
    from tandem.pipeline.engine import Engine
    from tandem.pipeline.loader import load_model
    from tandem.pipeline.settings import EngineSettings

    loaded = load_model(model_dir)
    engine = Engine(loaded.model, EngineSettings(), model_id=loaded.model_id, eos_token_ids=loaded.eos_token_ids)
    try:
        return [engine.generate_many([r])[0] for r in requests]
    finally:
        engine.stop()


def _client(cluster) -> AsyncClient:
    return AsyncClient(cluster.endpoints["frontend"], cluster.endpoints["stream_out"],
                       secret=cluster.secret, timeout_s=120)


def _run_all(cluster, prompts):
    async def main():
        async with _client(cluster) as ac:
            async def one(p):
                return [t async for ev in ac.generate(p, _sampling()) for t in ev.tokens]
            return await asyncio.gather(*(one(p) for p in prompts))
    return asyncio.run(main())


def _again_on_a_hybrid_worker(cluster, c, procs, model_dir, prompts):
    """Drain ``procs`` and run ``prompts`` again on one hybrid worker of the same cluster."""
    for p in procs:
        p.signal(signal.SIGTERM)  # drain: nothing in flight, so they leave at once
    for p in procs:
        p.p.wait(30)
    cluster.start_worker("hybrid", engine="mlx", model=model_dir)
    cluster.wait_workers(c, hybrid=1, timeout=120)
    out = _run_all(cluster, prompts)
    wait_clean(c, timeout=20)
    return out


def test_disaggregated_equals_hybrid_equals_single_process(cluster, tiny_model_dir):
    # Slow heartbeats: on a busy machine a 0.6 s liveness window can declare a healthy
    # worker dead, and a migrated request is re-prefilled (not bit-identical in float).
    cluster.heartbeat_ms = 1000
    # The four workers share the cores, so they share a CPU gate (prefill first): it must
    # change when steps run, never what they compute.
    cluster.env["TANDEM_WORKER_CPU_GATE"] = str(cluster.tmp / "cpu.gate")
    prompts = _prompts()
    cluster.start_broker()
    procs = [cluster.start_worker(role, engine="mlx", model=tiny_model_dir, wait=False)
             for role in ("prefill", "prefill", "decode", "decode")]
    for p in procs:
        p.wait_ready(120)
    c = cluster.client(timeout_s=60)
    cluster.wait_workers(c, prefill=2, decode=2, timeout=120)
    disagg = _run_all(cluster, prompts)
    st = wait_clean(c, timeout=20)
    assert st["counters"].get("migrations", 0) == 0, st["counters"]
    assert st["counters"]["handoffs"] == N_REQUESTS
    prefill_counts = [w["dispatched"] for w in st["workers"] if w["role"] == "prefill"]
    decode_counts = [w["decode_targeted"] for w in st["workers"] if w["role"] == "decode"]
    assert min(prefill_counts) > 0 and min(decode_counts) > 0, st["workers"]

    hybrid = _again_on_a_hybrid_worker(cluster, c, procs, tiny_model_dir, prompts)

    single = _single_process(tiny_model_dir, [(p, _sampling()) for p in prompts])

    assert all(len(t) == 12 for t in single)
    assert disagg == single
    assert hybrid == single


@pytest.mark.parametrize("sp", [
    SamplingParams(temperature=0.0, max_tokens=600, ignore_eos=True),
    # Sampled and seeded: the resumed worker must draw from the same random stream at
    # the same place (seed_offset = tokens already streamed), or the tail differs.
    SamplingParams(temperature=0.9, top_p=0.95, seed=20261130, max_tokens=600, ignore_eos=True),
], ids=["greedy", "seeded_sampling"])
@pytest.mark.parametrize("speculative", ["off", "ngram"])
def test_decode_sigkill_mid_stream_real_engine_exact(cluster, tiny_model_dir, sp, speculative):
    """With ``ngram`` the decode workers speculate (the one that takes the request over
    too): the stream still equals one engine's without speculation."""
    from tests.integration.test_cluster_stub import _kill_holder

    cluster.heartbeat_ms = 500
    cluster.start_broker("--stats-verbose")
    procs = [cluster.start_worker(role, *(["--speculative", speculative] if role == "decode" else []),
                                  engine="mlx", model=tiny_model_dir, wait=False)
             for role in ("prefill", "decode", "decode")]
    for p in procs:
        p.wait_ready(120)
    c = cluster.client(timeout_s=60)
    cluster.wait_workers(c, prefill=1, decode=2, timeout=120)
    prompt = _prompts()[0]
    toks, killed = [], None
    for ev in c.generate(prompt, sp):
        toks += ev.tokens
        # Early and with a long tail: a fast engine must not have finished the whole
        # stream (buffered on its way here) before the kill lands.
        if killed is None and len(toks) >= 8:
            killed = _kill_holder(c, cluster, procs[1:])
    assert killed is not None
    st = wait_clean(c, timeout=20)
    assert st["counters"]["migrations"] == 1
    if speculative != "off" and sp.temperature == 0:  # the survivor drafted (its heartbeats say so)
        survivor = [w for w in st["workers"] if w["role"] == "decode" and w["state"] == "up"]
        assert any(w["spec_draft_tokens"] > 0 for w in survivor), survivor

    (single,) = _single_process(tiny_model_dir, [(prompt, sp)])
    assert toks == single


def _prefill_decode_pair(cluster, model_dir, *prefill_flags):
    """A broker, one prefill worker (with ``prefill_flags``) and one decode worker, ready."""
    cluster.heartbeat_ms = 1000
    cluster.start_broker()
    procs = [cluster.start_worker("prefill", *prefill_flags, engine="mlx", model=model_dir, wait=False),
             cluster.start_worker("decode", engine="mlx", model=model_dir, wait=False)]
    for p in procs:
        p.wait_ready(120)
    c = cluster.client(timeout_s=60)
    cluster.wait_workers(c, prefill=1, decode=1, timeout=120)
    return procs, c


def test_layer_parallel_lz4_handoff_is_exact(cluster, tiny_model_dir):
    """Two connections per handoff (one per layer half), LZ4 frames: still bit-exact KV."""
    _, c = _prefill_decode_pair(cluster, tiny_model_dir, "--kv-strategy", "layer_parallel", "--kv-compression", "lz4")
    prompts = _prompts()[:4]
    got = _run_all(cluster, prompts)
    st = wait_clean(c, timeout=20)
    assert st["counters"]["handoffs"] == 4 and st["counters"].get("migrations", 0) == 0

    single = _single_process(tiny_model_dir, [(p, _sampling()) for p in prompts])
    assert got == single

    # The same prompt again hits the prefill worker's prefix cache. The first stream
    # message (published by the prefill worker, before the handoff) already says so:
    # an edge that stops reading early on a stop string reports cached tokens from it.
    async def events(p):
        async with _client(cluster) as ac:
            return [ev async for ev in ac.generate(p, _sampling())]
    evs = asyncio.run(events(prompts[0]))
    assert len(prompts[0]) > 32
    first = evs[0]
    assert first.usage is not None and 0 < first.usage.cached_prompt_tokens < len(prompts[0])
    assert evs[-1].usage.cached_prompt_tokens == first.usage.cached_prompt_tokens
    wait_clean(c, timeout=20)


@pytest.mark.parametrize("compression", ["none", "lz4"])
def test_long_prompts_streamed_during_their_prefill_are_exact(cluster, tiny_model_dir, compression):
    """Prompts of several prefill chunks (32 tokens here) with the Streamed strategy: each
    chunk's KV goes to the decode worker while the next computes, and into its KV store as
    it arrives; disaggregated == hybrid == one in-process engine, token for token, and
    nothing is held anywhere afterwards (no block of the decode worker's either)."""
    cluster.env["TANDEM_ENGINE_PREFILL_CHUNK_SIZE"] = "32"
    timeline = cluster.tmp / "timeline.jsonl"
    cluster.env["TANDEM_TIMELINE"] = str(timeline)
    procs, c = _prefill_decode_pair(cluster, tiny_model_dir, "--kv-strategy", "streamed", "--kv-compression", compression)
    rng = random.Random(11)
    prompts = [[rng.randrange(3, 380) for _ in range(n)] for n in (70, 129, 200, 257)]
    got = _run_all(cluster, prompts)
    st = wait_clean(c, timeout=20)
    assert st["counters"]["handoffs"] == 4 and st["counters"].get("migrations", 0) == 0
    # A prompt of C chunks goes in C parts: C - 1 while it is prefilled, then the final one.
    parts = sorted(int(n) for n in re.findall(r"handoff \w+: \d+ KV bytes .*\(streamed, (\d+) parts\)", procs[0].log.read_text()))
    assert parts == [3, 5, 7, 9], parts
    # The decode worker copied each part into its KV store as it came (blocks reserved at the
    # first): 2, 4, 6 and 8 parts of 2 blocks (a 32-token chunk) before the final part.
    marks = [json.loads(x) for x in timeline.read_text().splitlines() if '"kv_part_in"' in x]
    assert sorted(collections.Counter(m["rid"] for m in marks).values()) == [2, 4, 6, 8]
    assert all(m["blocks"] == 2 for m in marks)

    hybrid = _again_on_a_hybrid_worker(cluster, c, procs, tiny_model_dir, prompts)
    single = _single_process(tiny_model_dir, [(p, _sampling()) for p in prompts])
    assert got == hybrid == single
