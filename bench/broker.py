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
import gc
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import ROOT, baseline_tree, cpu_s, machine, pct, write_results

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


def bench_codec(n: int) -> dict:
    """The broker's per-request codec work (decode SUBMIT, DONE and a batch holding the
    final token message; encode ACCEPTED and DISPATCH), through the generic codec
    (tandem.wire.codec) and through the broker's compiled one (tandem.broker.frames),
    alternating in one run: microseconds per request, best of 5 passes."""
    from tandem.broker import frames as F
    from tandem.kvtypes import SamplingParams
    from tandem.kvtypes import Usage
    from tandem.wire import codec
    from tandem.wire import messages as M

    rid = os.urandom(16)
    sp = SamplingParams(temperature=0.7, top_p=0.9, seed=7, max_tokens=64)
    submit = codec.encode(M.Submit(rid, list(range(1, 65)), sp))[0]
    done = codec.encode(M.Done(rid, "length", Usage(64, 1)))[0]
    tokens = codec.batch_headers([codec.stream_entry(1, M.TokenMessage(rid, 0, [7], None, "length", Usage(64, 1)))])[0]
    topic = b"\x00" * 17
    dispatch = M.Dispatch(rid, "hybrid", list(range(1, 65)), sp, 0, "", None, None, 1)

    def generic():
        codec.decode([submit]), codec.decode([done]), codec.decode_batch([topic, tokens])
        codec.encode(M.Accepted(rid, 3)), codec.encode(dispatch)

    def compiled():
        F.decode(submit), F.decode(done), F.decode_batch(tokens)
        F.encode(M.Accepted(rid, 3)), F.encode(dispatch)

    best = {"generic": float("inf"), "compiled": float("inf")}
    for _ in range(5):
        for name, fn in (("generic", generic), ("compiled", compiled)):
            t = time.perf_counter()
            for _ in range(n):
                fn()
            best[name] = min(best[name], (time.perf_counter() - t) / n * 1e6)
    return {"generic_us": best["generic"], "compiled_us": best["compiled"], "ratio": best["compiled"] / best["generic"]}


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


# The load generators below must cost as little as possible, so that the broker, not
# the client or the workers, is what the 2-core machine runs out of: one process each,
# no engine or threads, socket calls at pyzmq's Cython level, every header the stubs
# send pre-encoded once (only the 16-byte request id is spliced in), and each poll
# round's receives handled before its sends go out together.
_send = None  # zmq.backend.Socket.send / recv, bound in the child processes
_RID_AT = 7  # the request id's offset in a SUBMIT or DONE header: 4-byte prefix, array tag, bin8 tag + length


def _template(head: bytes, placeholder: bytes) -> tuple[bytes, bytes]:
    at = head.index(placeholder)
    assert at == _RID_AT, "the header layout changed: fix _RID_AT"
    return head[:at], head[at + len(placeholder):]


def _lean_worker(backend: str, stream_in: str, secret: bytes, name: str, raw: bool = False) -> None:
    """A protocol-speaking worker with no engine and no threads: every DISPATCH is answered
    at once with a final one-token stream entry and DONE, the entries of one poll round in
    one TOKEN_BATCH (as a worker batches an engine step's). Runs in its own process until
    killed. ``raw``: the peer is the pass-through forwarder, which hands over the client's
    SUBMIT as it came; the same replies go out."""
    import msgpack
    import zmq

    from tandem.wire.protocol import STREAM_BATCH_TOPIC, STREAM_PING_TOPIC
    from tandem.kvtypes import Usage
    from tandem.wire import codec
    from tandem.wire import messages as M
    from tandem.wire import protocol as P
    from tandem.wire.sockets import make_socket

    gc.disable()  # a load generator makes no reference cycles: no collector pauses in its replies
    send, recv = zmq.backend.Socket.send, zmq.backend.Socket.recv
    NOBLOCK, MORE = int(zmq.NOBLOCK), int(zmq.NOBLOCK | zmq.SNDMORE)
    ctx = zmq.Context()
    d = make_socket(ctx, zmq.DEALER, connect=backend, identity=name.encode(), security=secret, hwm=1_000_000)
    pub = make_socket(ctx, zmq.PUB, connect=stream_in, security=secret, hwm=1_000_000)
    ready = codec.encode(M.Ready(name, "hybrid", "stub", 1 << 30, None, 16, 1000))
    d.send_multipart(ready)
    dispatch_type = int(P.MsgType.DISPATCH)
    placeholder = bytes(range(100, 116))
    replies: dict[int, tuple[bytes, bytes, bytes]] = {}  # prompt length -> (stream entry after the attempt, DONE prefix, suffix)
    pack = msgpack.Packer(use_bin_type=True).pack

    def reply_for(n: int):
        r = replies.get(n)
        if r is None:
            usage = Usage(n, 1)
            entry = codec.stream_entry(0, M.TokenMessage(placeholder, 0, [7], None, "length", usage))
            tail = entry[entry.index(placeholder) + len(placeholder) + 1:]  # after [.., rid, attempt 0
            r = replies[n] = (tail, *_template(codec.pack_header(M.Done(placeholder, "length", usage)), placeholder))
        return r

    next_hb = 0.0
    while True:
        now = time.monotonic()
        if now >= next_hb:
            d.send_multipart(codec.encode(M.Heartbeat(name, 0, 0, 1000, 1000)))
            pub.send_multipart([STREAM_PING_TOPIC, name.encode()])
            next_hb = now + 0.5
        if not d.poll(100):
            continue
        out = []
        for _ in range(4096):
            try:
                head = recv(d, NOBLOCK)
            except zmq.Again:
                break
            if raw:
                rid = head[_RID_AT:_RID_AT + 16]
                out.append((1, *reply_for(4), rid))
                continue
            if head[3] != dispatch_type:
                msg = codec.decode([head])
                if isinstance(msg, M.Disconnect):
                    d.send_multipart(ready)
                continue
            body = msgpack.unpackb(head[4:])
            rid = body[0]
            out.append((body[8], *reply_for(len(body[2])), rid))
        if not out:
            continue
        entries = [b"\x98\xc4\x10" + rid + pack(attempt) + tail for attempt, tail, pre, post, rid in out]
        for batch in codec.batch_headers(entries):
            send(pub, STREAM_BATCH_TOPIC, MORE)
            send(pub, batch, NOBLOCK)
        for attempt, tail, pre, post, rid in out:
            send(d, pre + rid + post, NOBLOCK)


def _lean_client(frontend: str, stream_out: str, secret: bytes, *, seconds: float, rate: float | None, window: int,
                 linger: float = 10.0, raw: bool = False) -> dict:
    """A client on raw sockets in one thread, as the wire client does it: one stream topic
    subscribed at the start, then SUBMIT naming it and the final token read from the
    batches that come there. ``rate`` set: open loop at that rate (latency from the
    SUBMIT to the final token's arrival); None: closed loop, ``window`` in flight.
    ``raw``: against the pass-through forwarder, which passes the workers' batches on
    under their own topic."""
    import msgpack
    import zmq

    from tandem.kvtypes import SamplingParams
    from tandem.wire import codec
    from tandem.wire import messages as M
    from tandem.wire.protocol import CLIENT_STREAM_BYTES, STREAM_BATCH_TOPIC
    from tandem.wire.sockets import make_socket

    gc.disable()  # no reference cycles here: no collector pauses inside measured latencies
    send, recv = zmq.backend.Socket.send, zmq.backend.Socket.recv
    NOBLOCK = int(zmq.NOBLOCK)
    unpackb = msgpack.unpackb
    ctx = zmq.Context()
    dealer = make_socket(ctx, zmq.DEALER, connect=frontend, security=secret, hwm=1_000_000)
    sub = make_socket(ctx, zmq.SUB, connect=stream_out, security=secret, hwm=1_000_000)
    placeholder = bytes(range(100, 116))
    stream = os.urandom(CLIENT_STREAM_BYTES)
    sub.setsockopt(zmq.SUBSCRIBE, STREAM_BATCH_TOPIC if raw else stream)
    pre, post = _template(codec.pack_header(M.Submit(placeholder, [1, 2, 3, 4], SamplingParams(max_tokens=1), stream=stream)),
                          placeholder)
    prefix = os.urandom(8)
    counter = int.from_bytes(os.urandom(4), "little") << 24
    clock = time.perf_counter
    sent: dict[bytes, float] = {}
    lat = []
    done = in_window = 0
    poller = zmq.Poller()
    poller.register(sub, zmq.POLLIN)
    poller.register(dealer, zmq.POLLIN)

    time.sleep(0.3)
    start = clock()
    end = start + seconds
    issued = 0
    while True:
        now = clock()
        if now < end:
            if rate is None:
                want = window - len(sent)
            else:
                want = int((now - start) * rate) + 1 - issued
            for _ in range(want):
                counter += 1
                rid = prefix + counter.to_bytes(8, "little")
                sent[rid] = clock()
                send(dealer, pre + rid + post, NOBLOCK)
            issued += max(0, want)
            # Open loop: sleep in poll until the next request is due. Whole milliseconds,
            # rounded up: pyzmq truncates a float timeout, and 0 would spin a core.
            timeout = 10 if rate is None else math.ceil(max(0.0, (start + issued / rate - clock()) * 1e3))
        elif not sent or now > end + linger:
            break
        else:
            timeout = 10
        if not poller.poll(timeout):
            continue
        while True:  # ACCEPTED / REFUSED: nothing to do
            try:
                recv(dealer, NOBLOCK)
            except zmq.Again:
                break
        while True:
            try:
                recv(sub, NOBLOCK)  # the topic
            except zmq.Again:
                break
            now = clock()
            for entry in unpackb(recv(sub, 0)[4:])[0]:  # every message here is [topic, TOKEN_BATCH]
                t = sent.pop(entry[0], None)
                if t is not None:
                    lat.append(now - t)
                    done += 1
                    in_window += now <= end
    dealer.close(0)
    sub.close(0)
    ctx.term()
    # The rate counts what completed within the measured seconds: the tail after it (and
    # the forwarder's lost requests, see _forwarder) stays out of it.
    return {"per_s": in_window / seconds, "p50_ms": pct(lat, 0.5) * 1e3, "p99_ms": pct(lat, 0.99) * 1e3,
            "p999_ms": pct(lat, 0.999) * 1e3, "max_ms": max(lat) * 1e3 if lat else float("nan"),
            "completed": done, "issued": issued, "lost": len(sent)}


def _forwarder(spec: dict) -> None:
    """The pass-through forwarder of the ``raw`` rows, as its own process with the same
    CURVE sockets as the broker: SUBMIT -> a worker (round robin) and an ACCEPTED-sized
    reply to the client, the worker's DONE taken and dropped, XSUB -> XPUB, the XPUB's
    subscriptions read and dropped. The same messages and hops as through the broker, with no
    decoding and no decisions. Without the broker's subscription confirmation a token can
    overtake its subscription and be lost (counted as ``lost``; the client stops waiting
    for them a second after the run). Prints its endpoints as one JSON line."""
    import zmq

    from tandem.wire.sockets import bound_endpoint, make_socket

    send, recv = zmq.backend.Socket.send, zmq.backend.Socket.recv
    NOBLOCK, MORE = int(zmq.NOBLOCK), int(zmq.NOBLOCK | zmq.SNDMORE)
    secret = spec["secret"].encode()
    ctx = zmq.Context()
    any_ = "tcp://127.0.0.1:*"
    fe = make_socket(ctx, zmq.ROUTER, bind=any_, security=secret, hwm=1_000_000)
    be = make_socket(ctx, zmq.ROUTER, bind=any_, security=secret, hwm=1_000_000)
    xs = make_socket(ctx, zmq.XSUB, bind=any_, security=secret, hwm=1_000_000)
    xp = make_socket(ctx, zmq.XPUB, bind=any_, security=secret, hwm=1_000_000, xpub_verbose=True)
    xs.send(b"\x01")
    print(json.dumps({"event": "forwarder", "frontend": bound_endpoint(fe), "backend": bound_endpoint(be),
                      "stream_in": bound_endpoint(xs), "stream_out": bound_endpoint(xp)}), flush=True)
    workers = [f"lean-{i}".encode() for i in range(spec["workers"])]
    accepted = b"TD\x02\x02\x92\xc4\x10" + bytes(16) + b"\x00"
    poller = zmq.Poller()
    for s in (fe, be, xs, xp):
        poller.register(s, zmq.POLLIN)
    i = 0
    while True:
        for s, _ in poller.poll(100):
            for _ in range(4096):
                try:
                    first = recv(s, NOBLOCK)
                except zmq.Again:
                    break
                if s is fe:
                    head = recv(s, 0)
                    i += 1
                    send(be, workers[i % len(workers)], MORE)
                    send(be, head, NOBLOCK)
                    send(fe, first, MORE)
                    send(fe, accepted, NOBLOCK)
                elif s is be:
                    recv(s, 0)  # READY / HEARTBEAT / DONE
                elif s is xs:
                    send(xp, first, MORE)
                    send(xp, recv(s, 0), NOBLOCK)
                # (the XPUB's subscriptions: consumed, as the broker consumes them)


def _lean_client_run(spec: dict) -> None:
    """The client process of :func:`bench_lean`: waits for the workers, warms up, then
    reports on stdout (one JSON line each) when the closed-loop run starts, its result,
    and the open-loop result with the broker's own loop-round stats. ``raw``: against
    the pass-through forwarder (no broker to ask)."""
    secret = spec["secret"].encode()
    fe, so = spec["frontend"], spec["stream_out"]
    cl = None
    if spec.get("raw"):
        time.sleep(1.0)  # the workers connect
    else:
        from tandem.wire.client import Client

        cl = Client(fe, so, secret=secret, timeout_s=20)
        deadline = time.monotonic() + 60
        while (cl.ready().get("workers") or {}).get("hybrid", 0) < spec["workers"]:
            if time.monotonic() > deadline:
                raise TimeoutError("lean workers did not register")
            time.sleep(0.1)

    def say(event, **kw):
        print(json.dumps({"event": event, **kw}), flush=True)

    linger = 1.0 if spec.get("raw") else 10.0
    raw = bool(spec.get("raw"))
    _lean_client(fe, so, secret, seconds=1.0, rate=None, window=64, linger=linger, raw=raw)  # warm-up
    say("cap_start")
    say("cap", **_lean_client(fe, so, secret, seconds=spec["seconds"], rate=None, window=spec["concurrency"], linger=linger,
                              raw=raw))
    say("lat_start")
    lat = _lean_client(fe, so, secret, seconds=spec["seconds"], rate=spec["rate"], window=0, linger=linger, raw=raw)
    if cl is not None:
        # The broker's own view: how long its busy poll rounds took, i.e. what it added
        # to the messages in them, apart from scheduling delays outside it.
        rounds = cl.stats().get("loop_rounds", {})
        if rounds.get("rounds"):
            lat["round_p50_ms"], lat["round_p99_ms"], lat["round_max_ms"] = rounds["p50_ms"], rounds["p99_ms"], rounds["max_ms"]
        cl.close()
    say("lat", **lat)


# Runs a role of this script against the tandem tree on argv[1] (this one or a baseline):
# client, workers and broker of one measurement all speak that tree's protocol.
_CHILD = """
import json, os, runpy, sys
src, script, role, spec = sys.argv[1:5]
sys.path.insert(0, src)
sys.path.insert(1, os.path.dirname(script))
import tandem  # this tree's package, before the script's own path setup
ns = runpy.run_path(script, run_name="bench_child")
spec = json.loads(spec)
if role == "worker":
    ns["_lean_worker"](spec["backend"], spec["stream_in"], spec["secret"].encode(), spec["name"], spec.get("raw", False))
elif role == "forwarder":
    ns["_forwarder"](spec)
else:
    ns["_lean_client_run"](spec)
"""


def _child(src: Path, role: str, spec: dict, log: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", _CHILD, str(src), str(Path(__file__).resolve()), role, json.dumps(spec)],
                            stdout=subprocess.PIPE, stderr=open(log, "ab"), cwd=str(src))


def _event(proc: subprocess.Popen, want: str, log: Path) -> dict:
    while True:
        line = proc.stdout.readline()
        if not line:
            raise RuntimeError(f"bench client exited before '{want}': {log.read_text()[-2000:]}")
        if line.startswith(b"{"):
            msg = json.loads(line)
            if msg.get("event") == want:
                return msg


def bench_lean(args, src: Path | None = None, *, raw: bool = False) -> dict:
    """Broker process between a raw-socket client and protocol-speaking workers in other
    processes: what the broker itself costs, without the Python client and engine thread.
    ``src``: run broker, client and workers from that copy of ``tandem/`` (a baseline).
    ``raw``: the pass-through forwarder process in the broker's place."""
    from tests.integration.cluster import Cluster

    tmp = Path(tempfile.mkdtemp(prefix="tandem-bench-broker-"))
    c = Cluster(tmp, heartbeat_ms=1000)
    tree = src or ROOT
    procs = []
    try:
        secret = c.secret.decode()
        if raw:
            fwd = _child(tree, "forwarder", {"secret": secret, "workers": args.workers}, tmp / "forwarder.log")
            procs.append(fwd)
            e = _event(fwd, "forwarder", tmp / "forwarder.log")
            pid = fwd.pid
        else:
            # ``python -m`` puts the working directory first on sys.path: start it from the tree.
            c.env["PYTHONPATH"] = str(tree)
            here = os.getcwd()
            os.chdir(tree)
            try:
                c.start_broker("--max-queue", "100000")
            finally:
                os.chdir(here)
                c.env.pop("PYTHONPATH")
            e = c.endpoints
            pid = c.broker.p.pid
        for i in range(args.workers):
            procs.append(_child(tree, "worker", {"backend": e["backend"], "stream_in": e["stream_in"], "secret": secret,
                                                 "name": f"lean-{i}", "raw": raw}, tmp / f"lean-worker-{i}.log"))
        log = tmp / "lean-client.log"
        client = _child(tree, "client", {"frontend": e["frontend"], "stream_out": e["stream_out"], "secret": secret,
                                         "workers": args.workers, "seconds": args.seconds, "rate": args.rate,
                                         "concurrency": args.concurrency, "raw": raw}, log)
        procs.append(client)
        _event(client, "cap_start", log)
        cpu0 = cpu_s(pid)
        cap = _event(client, "cap", log)
        # The broker's own CPU per request (Python thread + libzmq I/O thread with CURVE):
        # what it would sustain on one idle core, independent of how loaded this box is.
        cap["broker_cpu_us"] = (cpu_s(pid) - cpu0) / max(1, cap["completed"]) * 1e6
        cap["per_core_per_s"] = 1e6 / cap["broker_cpu_us"] if cap["broker_cpu_us"] else float("nan")
        _event(client, "lat_start", log)
        cpu0 = cpu_s(pid)
        lat = _event(client, "lat", log)
        lat["broker_cpu_us"] = (cpu_s(pid) - cpu0) / max(1, lat["completed"]) * 1e6
        for r in (cap, lat):
            r.pop("event")
        return {"capacity": cap, "latency": lat}
    finally:
        for p in procs:
            p.kill()
            p.wait(10)
            if p.stdout:
                p.stdout.close()
        c.close()


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


def _median_run(runs: list[dict]) -> dict:
    """Per-metric medians over runs of :func:`bench_lean` (machine load moves single runs)."""
    return {part: {k: statistics.median(r[part][k] for r in runs if k in r[part]) for k in runs[0][part]}
            for part in ("capacity", "latency")}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--seconds", type=float, default=5.0)
    p.add_argument("--rate", type=float, default=1000.0)
    p.add_argument("--concurrency", type=int, default=256)
    p.add_argument("--decisions", type=int, default=50_000)
    p.add_argument("--baseline", metavar="GIT_REF", help="also run the broker of this commit, alternating with this tree's")
    p.add_argument("--rounds", type=int, default=1, help="broker-process runs per tree (medians are reported)")
    p.add_argument("--no-full-stack", action="store_true", help="skip the AsyncClient + stub-engine worker rows")
    p.add_argument("--out", default=str(ROOT / "docs" / "benchmarks"))
    args = p.parse_args()

    decisions = bench_decisions(args.decisions)
    codec_us = bench_codec(5_000)
    base_src = baseline_tree(args.baseline) if args.baseline else None
    # Broker-process runs alternate baseline / this tree / the pass-through forwarder, so
    # all three see the same machine load.
    runs: dict[str, list] = {"this": [], "baseline": [], "raw": []}
    for _ in range(args.rounds):
        if base_src is not None:
            runs["baseline"].append(bench_lean(args, base_src))
        runs["this"].append(bench_lean(args, None))
        runs["raw"].append(bench_lean(args, None, raw=True))
    lean = _median_run(runs["this"])
    base = _median_run(runs["baseline"]) if base_src is not None else None
    fwd = _median_run(runs["raw"])
    raw = fwd["latency"]
    sockets = None if args.no_full_stack else bench_sockets(args)
    ll = lean["latency"]
    result = {
        **machine(), "args": vars(args),
        "decisions": decisions, "codec": codec_us, "broker_only": lean, "broker_only_runs": runs["this"],
        "baseline": base, "baseline_runs": runs["baseline"],
        "full_stack": sockets, "raw_hops": fwd, "raw_runs": runs["raw"],
        "added_p50_ms": ll["p50_ms"] - raw["p50_ms"], "added_p99_ms": ll["p99_ms"] - raw["p99_ms"],
    }
    rows = [("routing core in-process: subscribe+submit+dispatch+stream+done per request", f"{decisions['per_s']:,.0f}/s",
             f"{decisions['p50_us']:.1f} µs", f"{decisions['p99_us']:.1f} µs")]
    rows += [("codec per request, generic `tandem.wire.codec` (decode SUBMIT, DONE, final token; encode ACCEPTED, DISPATCH)",
              "", f"{codec_us['generic_us']:.1f} µs", ""),
             (f"same, the broker's compiled `tandem.broker.frames` (×{codec_us['ratio']:.2f})", "",
              f"{codec_us['compiled_us']:.1f} µs", "")]
    for label, r in ([("baseline " + args.baseline, base)] if base else []) + [("this tree", lean)]:
        cap, lt = r["capacity"], r["latency"]
        rows += [
            (f"{label}: broker process, raw-socket client and workers, closed loop ({args.concurrency} in flight)",
             f"{cap['per_s']:,.0f}/s", "", ""),
            (f"{label}: broker CPU per request (all its threads) → requests/s per idle core",
             f"{cap['per_core_per_s']:,.0f}/s", f"{cap['broker_cpu_us']:.0f} µs", ""),
            (f"{label}: open loop {args.rate:.0f}/s (achieved {lt['per_s']:.0f})", "",
             f"{lt['p50_ms']:.2f} ms", f"{lt['p99_ms']:.2f} ms"),
        ]
        if "round_p99_ms" in lt:
            rows.append((f"{label}: inside the broker, poll return → last send of a busy round at {args.rate:.0f}/s "
                         f"(max {lt['round_max_ms']:.2f} ms)", "", f"{lt['round_p50_ms']:.3f} ms", f"{lt['round_p99_ms']:.3f} ms"))
    fc = fwd["capacity"]
    rows += [
        (f"pass-through forwarder process (CURVE, same client and workers), closed loop ({args.concurrency} in flight): "
         "the load generators' ceiling", f"{fc['per_s']:,.0f}/s", "", ""),
        (f"same hops through the pass-through forwarder, open loop {args.rate:.0f}/s (achieved {raw['per_s']:.0f})", "",
         f"{raw['p50_ms']:.2f} ms", f"{raw['p99_ms']:.2f} ms"),
        ("**added by the broker** (this tree's open-loop row − forwarder row)", "", f"{result['added_p50_ms']:.2f} ms",
         f"{result['added_p99_ms']:.2f} ms"),
    ]
    if sockets:
        lat = sockets["latency"]
        rows += [
            (f"full stack: AsyncClient + `python -m tests.stub_engine worker`, closed loop ({args.concurrency} in flight)",
             f"{sockets['capacity_per_s']:,.0f}/s", "", ""),
            (f"full stack, open loop {args.rate:.0f}/s (achieved {lat['achieved_per_s']:.0f})", "", f"{lat['p50_ms']:.2f} ms",
             f"{lat['p99_ms']:.2f} ms"),
        ]
    cmd = f"python bench/broker.py --workers {args.workers} --seconds {args.seconds:g} --rate {args.rate:g} --rounds {args.rounds}"
    if args.baseline:
        cmd += f" --baseline {args.baseline}"
    if args.no_full_stack:
        cmd += " --no-full-stack"
    md = [f"# Broker dispatch capacity and added latency\n",
          f"{result['when']}, {result['cpus']} cores shared with other work (1-minute load average "
          f"{result['load_avg_1m']:.1f} at the end), {args.workers} workers that answer every dispatch at once "
          f"with one token, CURVE on every broker socket.\n",
          f"Command: `{cmd}`\n",
          "| measurement | rate | p50 | p99 |", "|---|---:|---:|---:|"]
    md += [f"| {a} | {b} | {c} | {d} |" for a, b, c, d in rows]
    if base:
        def ratio(key, sub):
            return lean[key][sub] / base[key][sub] if base[key][sub] else float("nan")
        md.append(f"\nThis tree vs baseline `{args.baseline}` (medians of {args.rounds} alternating rounds): "
                  f"closed-loop rate ×{ratio('capacity', 'per_s'):.2f}, broker CPU per request "
                  f"×{ratio('capacity', 'broker_cpu_us'):.2f}, open-loop p50 ×{ratio('latency', 'p50_ms'):.2f}, "
                  f"p99 ×{ratio('latency', 'p99_ms'):.2f}.")
    md.append("\nLatency is submit → final token at the client (which subscribed once, to its stream topic; the "
              "workers send each poll round's tokens in one TOKEN_BATCH, protocol v5). The forwarder rows run the same "
              "client and worker processes against a forwarder process with the same CURVE sockets and the same "
              "messages (SUBMIT → worker with an ACCEPTED back, worker PUB → XSUB → XPUB → client SUB, the worker's "
              "DONE and the client's subscription read and dropped) that decodes and decides nothing, so the difference is what the broker adds: message validation, routing, "
              "progress tracking per entry, regrouping per client, the subscription confirmation and its CURVE sockets. The full-stack rows add "
              "the asyncio client and the worker's engine thread (per-request Python on both ends). "
              "Broker CPU is read from /proc for the broker process during the closed-loop run; requests/s per "
              "idle core is 1 / that CPU time. Each tree's rows run its own broker, raw-socket client and workers "
              "(a baseline speaks its own protocol version), so the closed-loop rates also include each tree's "
              "client and worker code; the CPU figure is the broker's alone. "
              "What moved these numbers, and what did not: LOG.md.")
    write_results(args.out, "broker", "\n".join(md) + "\n", result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
