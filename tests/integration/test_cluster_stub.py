"""Broker + workers as real processes over loopback, with the model-free stub engine.

The stub's next token is a function of every token before it, like greedy decoding, so
"the stream equals an uninterrupted run" is checked against ``reference_tokens``.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest

from tandem.kvtypes import SamplingParams
from tandem.wire.client import AsyncClient, Busy
from tests.stub_engine import reference_tokens


def collect(client, prompt, max_tokens, **kw):
    toks, last = [], None
    for ev in client.generate(prompt, SamplingParams(max_tokens=max_tokens), **kw):
        toks += ev.tokens
        last = ev
    return toks, last


def wait_clean(client, timeout=10.0):
    """No request held anywhere: broker in-flight, worker engines, KV blocks."""
    deadline = time.monotonic() + timeout
    while True:
        st = client.stats()
        held = [(w["node"], w["inflight"], w["running"], w["waiting"], w["used_blocks"])
                for w in st["workers"] if w["state"] != "down" and (w["inflight"] or w["running"] or w["waiting"] or w["used_blocks"])]
        if not held and st["requests"]["running"] == 0 and st["queue_depth"] == 0:
            return st
        if time.monotonic() > deadline:
            raise AssertionError(f"still held after {timeout}s: {held} {st['requests']}")
        time.sleep(0.2)


def test_disaggregated_stream_equals_reference_and_reports_usage(cluster):
    cluster.start_broker()
    cluster.start_worker("prefill")
    cluster.start_worker("decode")
    c = cluster.client()
    cluster.wait_workers(c, prefill=1, decode=1)
    toks, last = collect(c, [5, 6, 7], 20)
    assert toks == reference_tokens([5, 6, 7], 20)
    assert last.finish_reason == "length" and last.usage.prompt_tokens == 3 and last.usage.completion_tokens == 20
    st = wait_clean(c)
    assert st["counters"]["handoffs"] == 1
    # Transfer bandwidth: the prefill worker's next heartbeat reports the handoff it sent
    # (KV bytes and seconds), the decode worker's the bytes it ingested.
    deadline = time.monotonic() + 10
    while True:
        workers = {w["role"]: w for w in c.stats()["workers"]}
        if workers["prefill"]["kv_handoffs"] == 1 and workers["decode"]["kv_received_bytes"] > 0:
            break
        assert time.monotonic() < deadline, workers
        time.sleep(0.1)
    p, d = workers["prefill"], workers["decode"]
    assert p["kv_sent_bytes"] > 0 and p["kv_gb_s"] > 0 and p["kv_gb_s_recent"] > 0
    assert d["kv_handoffs"] == 0 and d["kv_gb_s"] is None
    from tandem.commands.stats import render

    lines = render(c.stats()).splitlines()
    header = next(line for line in lines if line.startswith("node")).split()
    row = dict(zip(header, next(line for line in lines if line.startswith("prefill-0")).split()))
    assert [row["kv_handoffs"], row["kv_sent"], row["kv_GB/s"]] == ["1", f"{p['kv_sent_bytes'] / 1e6:.1f}MB", f"{p['kv_gb_s_recent']:.3f}"]


def test_500_concurrent_short_requests_gapless(cluster):
    cluster.start_broker("--max-queue", "1000")
    cluster.start_worker("prefill", "--parallel", "256")
    cluster.start_worker("decode", "--parallel", "256")
    cluster.start_worker("hybrid", "--parallel", "256")
    sync = cluster.client()
    cluster.wait_workers(sync, prefill=1, decode=1, hybrid=1)

    async def main():
        async with AsyncClient(cluster.endpoints["frontend"], cluster.endpoints["stream_out"], secret=cluster.secret, timeout_s=60) as ac:
            async def one(i):
                prompt = [i, i + 1, 7]
                out = []
                async for ev in ac.generate(prompt, SamplingParams(max_tokens=4)):
                    out += ev.tokens  # the client itself raises StreamError on any seq gap
                return out == reference_tokens(prompt, 4)
            return await asyncio.gather(*(one(i) for i in range(500)))

    results = asyncio.run(main())
    assert all(results), f"{results.count(False)} of 500 streams differ"
    wait_clean(sync)


@pytest.mark.parametrize("strategy", ["round_robin", "least_loaded", "memory_aware", "prompt_length_aware", "prefix_aware"])
def test_strategies_spread_load(cluster, strategy):
    cluster.start_broker("--strategy", strategy)
    for _ in range(2):
        cluster.start_worker("hybrid", "--stub-step-ms", "20")
    c = cluster.client()
    cluster.wait_workers(c, hybrid=2)

    async def main():
        async with AsyncClient(cluster.endpoints["frontend"], cluster.endpoints["stream_out"], secret=cluster.secret) as ac:
            async def one(i):
                # Distinct prompts (no shared prefix), so every strategy should split them.
                prompt = [1000 + i] * 40
                return [t async for ev in ac.generate(prompt, SamplingParams(max_tokens=8)) for t in ev.tokens]
            await asyncio.gather(*(one(i) for i in range(20)))

    asyncio.run(main())
    st = wait_clean(c)
    counts = sorted(w["dispatched"] for w in st["workers"])
    assert sum(counts) == 20 and counts[0] >= 6, counts


def test_queue_full_answers_busy_with_retry_after(cluster):
    cluster.env["TANDEM_WORKER_CAPACITY"] = "1"
    cluster.start_broker("--max-queue", "1")
    cluster.start_worker("hybrid", "--parallel", "1", "--stub-step-ms", "50")
    c = cluster.client()
    cluster.wait_workers(c, hybrid=1)

    async def main():
        async with AsyncClient(cluster.endpoints["frontend"], cluster.endpoints["stream_out"], secret=cluster.secret) as ac:
            async def one(started=None):
                n = 0
                try:
                    async for ev in ac.generate([1, 2], SamplingParams(max_tokens=20)):
                        n += len(ev.tokens)
                        if started is not None and not started.done():
                            started.set_result(None)
                    return n
                except Busy as exc:
                    return exc
            started = asyncio.get_running_loop().create_future()
            first = asyncio.ensure_future(one(started))
            await started  # the worker's only slot is taken; the broker queue holds 1
            rest = await asyncio.gather(*(one() for _ in range(3)))
            return [await first, *rest]

    results = asyncio.run(main())
    busy = [r for r in results if isinstance(r, Busy)]
    assert busy and all(b.reason == "busy" and b.retry_after_s > 0 for b in busy)
    assert results.count(20) >= 2  # one ran, one waited in the broker's queue
    wait_clean(c)


def test_decode_sigkill_mid_stream_migrates_exactly(cluster):
    cluster.start_broker("--stats-verbose")
    cluster.start_worker("prefill")
    d1 = cluster.start_worker("decode", "--stub-step-ms", "30")
    d2 = cluster.start_worker("decode", "--stub-step-ms", "30")
    c = cluster.client()
    cluster.wait_workers(c, prefill=1, decode=2)
    prompt = [9, 8, 7, 6]
    toks, killed = [], None
    for ev in c.generate(prompt, SamplingParams(max_tokens=60)):
        toks += ev.tokens
        if killed is None and len(toks) >= 10:
            killed = _kill_holder(c, cluster, (d1, d2))
    assert killed is not None
    assert toks == reference_tokens(prompt, 60)
    st = wait_clean(c)
    assert st["counters"]["migrations"] == 1


def _kill_holder(client, cluster, procs):
    st = client.stats(verbose=True)
    holders = {w.get("name") for w in st["workers"] if w["inflight"] and w["role"] == "decode"}
    for p in procs:
        if p.info.get("node") in holders:
            p.signal(signal.SIGKILL)
            return p
    # Stats are redacted unless the broker allows verbose: fall back on asking each worker's pid.
    raise AssertionError(f"could not find the decode worker holding the request: {st['workers']}")


def test_prefill_killed_request_completes_elsewhere(cluster):
    cluster.start_broker()
    slow = cluster.start_worker("prefill", "--stub-step-ms", "3000")  # prefill takes 3 s
    c = cluster.client()
    cluster.start_worker("decode")
    cluster.wait_workers(c, prefill=1, decode=1)

    async def main_with_fast_prefill():
        async with AsyncClient(cluster.endpoints["frontend"], cluster.endpoints["stream_out"], secret=cluster.secret, timeout_s=30) as ac:
            task = asyncio.ensure_future(_agen_tokens(ac, [3, 1, 4, 1, 5], 12))
            await asyncio.sleep(1.0)
            slow.signal(signal.SIGKILL)
            cluster.start_worker("prefill", wait=False)
            return await task

    toks = asyncio.run(main_with_fast_prefill())
    assert toks == reference_tokens([3, 1, 4, 1, 5], 12)
    st = wait_clean(c)
    assert st["counters"].get("migrations") == 1, st


async def _agen_tokens(ac, prompt, n):
    return [t async for ev in ac.generate(prompt, SamplingParams(max_tokens=n)) for t in ev.tokens]


def test_broker_restart_workers_and_clients_reconnect(cluster):
    cluster.start_broker()
    cluster.start_worker("hybrid")
    c = cluster.client()
    cluster.wait_workers(c, hybrid=1)
    assert collect(c, [1, 2, 3], 5)[0] == reference_tokens([1, 2, 3], 5)
    cluster.broker.kill()
    cluster.start_broker(reuse_ports=True)
    cluster.wait_workers(c, hybrid=1, timeout=30)
    assert collect(c, [4, 5, 6], 5)[0] == reference_tokens([4, 5, 6], 5)


def test_a_stream_the_restarted_broker_lost_ends_with_an_error_soon(cluster):
    """The request in flight when its broker dies ends with a clean error within about
    subscribe_timeout_s of the new broker, not after the client's idle timeout (found
    by bench/chaos.py, where streams hung for the edge's whole request_timeout_s)."""
    from tandem.wire.client import StreamError

    cluster.start_broker()
    worker = cluster.start_worker("hybrid", "--stub-step-ms", "50")
    c = cluster.client(timeout_s=5.0, idle_timeout_s=120.0)
    cluster.wait_workers(c, hybrid=1)
    gen = c.generate([1, 2, 3], SamplingParams(max_tokens=100_000))
    next(gen)
    # The worker falls silent (as a prefill whose handoff the restart broke): no later
    # token tells the client that its stream is gone.
    worker.signal(signal.SIGSTOP)
    try:
        cluster.broker.kill()
        cluster.start_broker("--config", str(_subscribe_timeout_config(cluster.tmp, 2.0)), reuse_ports=True)
        t0 = time.monotonic()
        with pytest.raises(StreamError, match="restarted"):
            for _ in gen:
                pass
        assert time.monotonic() - t0 < 30  # the idle timeout is 120 s
    finally:
        worker.signal(signal.SIGCONT)


def _subscribe_timeout_config(tmp, seconds: float):
    path = tmp / "broker-subscribe.toml"
    path.write_text(f"[broker]\nsubscribe_timeout_s = {seconds}\n")
    return path


def test_wrong_secret_worker_is_refused(cluster, tmp_path):
    cluster.start_broker()
    bad = tmp_path / "other.secret"
    bad.write_bytes(os.urandom(32).hex().encode())
    bad.chmod(0o600)
    cluster.start_worker("hybrid", secret_file=bad, name="intruder")
    c = cluster.client()
    time.sleep(1.5)  # several heartbeat intervals: it would have registered by now
    st = c.stats()
    assert st["workers"] == [] and st["ready"] == {"prefill": 0, "decode": 0, "hybrid": 0}
    cluster.start_worker("hybrid", name="member")
    cluster.wait_workers(c, hybrid=1)
    for _ in range(4):
        assert collect(c, [2, 2], 3)[0] == reference_tokens([2, 2], 3)
    st = c.stats()
    assert len(st["workers"]) == 1 and st["workers"][0]["dispatched"] == 4


def test_client_abort_frees_the_request_on_the_worker(cluster):
    cluster.start_broker()
    cluster.start_worker("prefill")
    cluster.start_worker("decode", "--stub-step-ms", "20")
    c = cluster.client()
    cluster.wait_workers(c, prefill=1, decode=1)
    gen = c.generate([1, 1, 1], SamplingParams(max_tokens=10_000))
    got = 0
    for ev in gen:
        got += len(ev.tokens)
        if got >= 5:
            break
    gen.close()  # what an HTTP disconnect does: closes the generator -> ABORT
    st = wait_clean(c)
    assert st["counters"]["aborted"] == 1


def test_sigterm_drains_in_flight_requests(cluster):
    cluster.start_broker()
    w = cluster.start_worker("hybrid", "--stub-step-ms", "20")
    c = cluster.client()
    cluster.wait_workers(c, hybrid=1)

    async def main():
        async with AsyncClient(cluster.endpoints["frontend"], cluster.endpoints["stream_out"], secret=cluster.secret) as ac:
            task = asyncio.ensure_future(_agen_tokens(ac, [7, 7], 40))
            await asyncio.sleep(0.3)
            w.signal(signal.SIGTERM)
            return await task

    toks = asyncio.run(main())
    assert toks == reference_tokens([7, 7], 40)
    w.p.wait(10)
    assert w.p.returncode == 0
    st = c.stats()
    assert st["workers"] == []  # it deregistered


def test_client_and_stats_commands(cluster):
    import json
    import subprocess
    import sys

    cluster.start_broker()
    cluster.start_worker("hybrid")
    c = cluster.client()
    cluster.wait_workers(c, hybrid=1)
    e, sf = cluster.endpoints, str(cluster.secret_file)
    base = [sys.executable, "-m", "tandem.cli"]
    out = subprocess.run(base + ["client", "--token-ids", "1,2,3", "--max-tokens", "6", "--broker", e["frontend"],
                                 "--stream", e["stream_out"], "--cluster-secret-file", sf],
                         capture_output=True, text=True, timeout=60, env=cluster.env)
    assert out.returncode == 0, out.stderr
    assert [int(t) for t in out.stdout.split()] == reference_tokens([1, 2, 3], 6)
    st = subprocess.run(base + ["stats", "--json", "--stats", e["stats"], "--cluster-secret-file", sf],
                        capture_output=True, text=True, timeout=60, env=cluster.env)
    stats = json.loads(st.stdout)
    assert stats["workers"][0]["node"] == "hybrid-0" and "name" not in stats["workers"][0]  # redacted
    assert stats["workers"][0]["device"] == "cpu"  # where its engine runs (serve --gpus places workers on GPUs)
    assert stats["counters"]["completed"] == 1
    table = subprocess.run(base + ["stats", "--stats", e["stats"], "--cluster-secret-file", sf],
                           capture_output=True, text=True, timeout=60, env=cluster.env)
    assert "hybrid-0" in table.stdout and "dispatched" in table.stdout and "kv_GB/s" in table.stdout
    assert "device" in table.stdout.splitlines()[0] or any("device" in line for line in table.stdout.splitlines()[:3])


def test_the_product_worker_ships_no_model_free_engine(capsys):
    """`tandem worker` always loads a model: the stub engine is a test module, and the
    command refuses the flag that once selected it."""
    import importlib.util

    import pytest

    from tandem import cli

    with pytest.raises(SystemExit) as exc:
        cli.main(["worker", "--engine", "stub"])
    assert exc.value.code == 2
    assert "--engine" in capsys.readouterr().err
    assert importlib.util.find_spec("tandem.workers.stub") is None
