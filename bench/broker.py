"""Broker dispatch capacity and added latency, with instant stub workers.

Three measurements in one run:

1. ``decisions``: the broker's routing core (``Dispatcher``) driven in-process with the
   full per-request message sequence (subscribe, submit, dispatch, first/final token,
   done) against 8 workers: requests/s and per-request CPU time, no sockets.
2. ``capacity``: real processes on loopback (broker + stub hybrid workers that produce
   one token instantly): closed loop with many requests in flight, requests/s.
3. ``latency``: open loop at a fixed rate (default 1,000 req/s): submit -> final token
   p50/p99 end to end through the broker. The stub answers at once, so this is the
   broker's added latency plus two loopback hops and the client's own overhead (an
   upper bound on what the broker adds); ``raw`` measures those same hops with a
   pass-through forwarder (ROUTER->DEALER, XSUB->XPUB, no decisions) in the same run.

    .venv/bin/python bench/broker.py [--workers 2] [--seconds 5] [--rate 1000]

Writes docs/benchmarks/broker.{md,json}.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import tandem  # noqa: E402,F401


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def bench_decisions(n: int) -> dict:
    from tandem.broker.dispatcher import Dispatcher
    from tandem.broker.settings import BrokerSettings
    from tandem.kvtypes import SamplingParams
    from tandem.wire import messages as M

    sent = []
    d = Dispatcher(BrokerSettings(max_queue=n + 1), to_worker=lambda i, m: sent.append(m),
                   to_client=lambda i, m: None, publish=lambda m: None)
    for i in range(8):
        ident = f"w{i}".encode()
        d.worker_message(ident, M.Ready(f"w{i}", "hybrid", "m", 1 << 20, None, 16, 1000))
        d.stream_ping(ident)
    sp = SamplingParams(max_tokens=1)
    rids = [os.urandom(16) for _ in range(n)]
    per = []
    t0 = time.perf_counter()
    for rid in rids:
        t = time.perf_counter()
        d.subscribe(rid)
        d.submit(b"client", M.Submit(rid, [1, 2, 3, 4, 5, 6, 7, 8], sp))
        disp = sent[-1]
        d.stream(d.jobs.get(rid), disp.attempt, M.TokenMessage(rid, 0, [9], None, "length", M.Usage(8, 1)))
        d.worker_message(_holder(d, rid), M.Done(rid, "length", M.Usage(8, 1)))
        d.unsubscribe(rid)
        per.append(time.perf_counter() - t)
    dt = time.perf_counter() - t0
    assert not d.jobs, "every request must be finished and forgotten"
    return {"requests": n, "per_s": n / dt, "p50_us": pct(per, 0.5) * 1e6, "p99_us": pct(per, 0.99) * 1e6}


def _holder(d, rid):
    job = d.jobs.get(rid)
    return next(iter(job.holders)) if job and job.holders else b"w0"


async def _closed_loop(fe, so, secret, seconds, concurrency):
    from tandem.kvtypes import SamplingParams
    from tandem.wire.client import AsyncClient

    async with AsyncClient(fe, so, secret=secret, timeout_s=30) as ac:
        done = 0
        stop = time.monotonic() + seconds

        async def loop(i):
            nonlocal done
            while time.monotonic() < stop:
                async for _ in ac.generate([i % 1000 + 1, 2, 3], SamplingParams(max_tokens=1)):
                    pass
                done += 1
        t = time.monotonic()
        await asyncio.gather(*(loop(i) for i in range(concurrency)))
        return done / (time.monotonic() - t)


async def _open_loop(fe, so, secret, seconds, rate):
    from tandem.kvtypes import SamplingParams
    from tandem.wire.client import AsyncClient

    async with AsyncClient(fe, so, secret=secret, timeout_s=30) as ac:
        lat = []

        async def one(i):
            t = time.perf_counter()
            async for _ in ac.generate([i % 1000 + 1, 2, 3], SamplingParams(max_tokens=1)):
                pass
            lat.append(time.perf_counter() - t)
        tasks = []
        start = time.perf_counter()
        n = int(seconds * rate)
        for i in range(n):
            due = start + i / rate
            delay = due - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(i)))
        await asyncio.gather(*tasks)
        achieved = n / (time.perf_counter() - start)
        return {"offered_per_s": rate, "achieved_per_s": achieved, "p50_ms": pct(lat, 0.5) * 1e3,
                "p99_ms": pct(lat, 0.99) * 1e3, "requests": n}


def bench_sockets(args) -> dict:
    from tests.integration.cluster import Cluster

    tmp = Path(tempfile.mkdtemp(prefix="tandem-bench-broker-"))
    c = Cluster(tmp, heartbeat_ms=1000)
    try:
        c.start_broker("--max-queue", "100000")
        for _ in range(args.workers):
            c.start_worker("hybrid", "--parallel", "4096")
        cl = c.client()
        c.wait_workers(cl, hybrid=args.workers)
        fe, so = c.endpoints["frontend"], c.endpoints["stream_out"]
        asyncio.run(_closed_loop(fe, so, c.secret, 1.0, 64))  # warm up
        capacity = asyncio.run(_closed_loop(fe, so, c.secret, args.seconds, args.concurrency))
        latency = asyncio.run(_open_loop(fe, so, c.secret, args.seconds, args.rate))
        return {"capacity_per_s": capacity, "latency": latency}
    finally:
        c.close()


def bench_raw(args) -> dict:
    """The same hops with a forwarder that makes no decisions: client DEALER -> ROUTER
    -> worker DEALER, worker PUB -> XSUB -> XPUB -> client SUB, in threads of this process."""
    import threading

    import zmq

    ctx = zmq.Context()
    fe = ctx.socket(zmq.ROUTER); fe_port = fe.bind_to_random_port("tcp://127.0.0.1")
    be = ctx.socket(zmq.ROUTER); be_port = be.bind_to_random_port("tcp://127.0.0.1")
    xs = ctx.socket(zmq.XSUB); xs_port = xs.bind_to_random_port("tcp://127.0.0.1")
    xp = ctx.socket(zmq.XPUB); xp_port = xp.bind_to_random_port("tcp://127.0.0.1")
    xs.send(b"\x01")
    stop = threading.Event()

    def forwarder():
        poller = zmq.Poller()
        for s in (fe, xs):
            poller.register(s, zmq.POLLIN)
        while not stop.is_set():
            for s, _ in poller.poll(50):
                if s is fe:
                    ident, body = fe.recv_multipart()
                    be.send_multipart([b"w", ident, body])
                else:
                    xp.send_multipart(xs.recv_multipart())

    def worker():
        d = ctx.socket(zmq.DEALER); d.setsockopt(zmq.ROUTING_ID, b"w"); d.connect(f"tcp://127.0.0.1:{be_port}")
        pub = ctx.socket(zmq.PUB); pub.connect(f"tcp://127.0.0.1:{xs_port}")
        d.poll(0)
        while not stop.is_set():
            if d.poll(50):
                ident, body = d.recv_multipart()
                pub.send_multipart([body[:16], body])
        d.close(0); pub.close(0)

    threads = [threading.Thread(target=forwarder, daemon=True), threading.Thread(target=worker, daemon=True)]
    for t in threads:
        t.start()
    be_ready = time.monotonic() + 2
    while time.monotonic() < be_ready:
        time.sleep(0.05)
    cli = ctx.socket(zmq.DEALER); cli.connect(f"tcp://127.0.0.1:{fe_port}")
    sub = ctx.socket(zmq.SUB); sub.connect(f"tcp://127.0.0.1:{xp_port}")
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    time.sleep(0.3)
    lat = []
    n = int(args.seconds * args.rate)
    start = time.perf_counter()
    for i in range(n):
        due = start + i / args.rate
        while time.perf_counter() < due:
            pass
        rid = os.urandom(16)
        t = time.perf_counter()
        cli.send(rid + b"x" * 40)
        sub.recv_multipart()
        lat.append(time.perf_counter() - t)
    stop.set()
    for t in threads:
        t.join(1)
    for s in (fe, be, xs, xp, cli, sub):
        s.close(0)
    ctx.term()
    return {"p50_ms": pct(lat, 0.5) * 1e3, "p99_ms": pct(lat, 0.99) * 1e3, "requests": n}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--seconds", type=float, default=5.0)
    p.add_argument("--rate", type=float, default=1000.0)
    p.add_argument("--concurrency", type=int, default=256)
    p.add_argument("--decisions", type=int, default=50_000)
    p.add_argument("--out", default=str(ROOT / "docs" / "benchmarks"))
    args = p.parse_args()

    decisions = bench_decisions(args.decisions)
    sockets = bench_sockets(args)
    raw = bench_raw(args)
    lat = sockets["latency"]
    result = {
        "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "cpus": os.cpu_count(),
        "python": platform.python_version(), "args": vars(args),
        "decisions": decisions, "capacity_per_s": sockets["capacity_per_s"], "latency": lat, "raw_hops": raw,
        "added_p50_ms": lat["p50_ms"] - raw["p50_ms"], "added_p99_ms": lat["p99_ms"] - raw["p99_ms"],
    }
    rows = [
        ("routing core, in-process (decisions/s)", f"{decisions['per_s']:,.0f}", f"{decisions['p50_us']:.1f} µs", f"{decisions['p99_us']:.1f} µs"),
        (f"end to end, closed loop, {args.concurrency} in flight (req/s)", f"{sockets['capacity_per_s']:,.0f}", "", ""),
        (f"end to end, open loop at {args.rate:.0f} req/s (achieved {lat['achieved_per_s']:.0f})", "", f"{lat['p50_ms']:.2f} ms", f"{lat['p99_ms']:.2f} ms"),
        (f"raw hops, pass-through forwarder at {args.rate:.0f} req/s", "", f"{raw['p50_ms']:.2f} ms", f"{raw['p99_ms']:.2f} ms"),
        ("added by the broker (end to end − raw)", "", f"{result['added_p50_ms']:.2f} ms", f"{result['added_p99_ms']:.2f} ms"),
    ]
    md = [f"# Broker dispatch capacity and added latency\n",
          f"{result['when']}, {result['cpus']} cores (shared with other work), {args.workers} stub hybrid workers "
          f"(one token, instantly), CURVE on every broker socket.\n",
          f"Command: `python bench/broker.py --workers {args.workers} --seconds {args.seconds:g} --rate {args.rate:g}`\n",
          "| measurement | rate | p50 | p99 |", "|---|---:|---:|---:|"]
    md += [f"| {a} | {b} | {c} | {d} |" for a, b, c, d in rows]
    md.append("\nEnd-to-end latency is submit → final token at the client, through broker, worker and both "
              "loopback hops; the raw row is the same hops with a forwarder that decodes nothing and decides "
              "nothing (one process, threads), so the difference bounds what the broker's Python work adds.")
    text = "\n".join(md) + "\n"
    print(text)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "broker.md").write_text(text)
    (out / "broker.json").write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
