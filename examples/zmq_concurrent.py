"""Many concurrent requests through one asyncio client (one DEALER + one SUB for all).

    python examples/zmq_concurrent.py --requests 32 --cluster-secret-file cluster.secret

Prints each request's time to first token and the aggregate token rate. Cancelling a
consumer (Ctrl-C here, a client disconnect in the HTTP edge) closes its generator,
which sends ABORT to the broker and frees the request's KV on the worker.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import time

import tandem  # noqa: F401

from tandem.kvtypes import SamplingParams
from tandem.wire.client import AsyncClient, Busy
from tandem.wire.secret import load_cluster_secret


async def main(args) -> int:
    rng = random.Random(0)
    secret = load_cluster_secret(args.cluster_secret_file)
    async with AsyncClient(args.broker, args.stream, secret=secret, timeout_s=30) as client:
        async def one(i: int):
            prompt = [rng.randrange(100, 10_000) for _ in range(args.prompt_tokens)]
            t0, ttft, n = time.perf_counter(), None, 0
            try:
                async for ev in client.generate(prompt, SamplingParams(max_tokens=args.max_tokens)):
                    if ttft is None and ev.tokens:
                        ttft = time.perf_counter() - t0
                    n += len(ev.tokens)
            except Busy as exc:
                print(f"request {i}: busy ({exc.reason}), retry after {exc.retry_after_s:.1f}s")
                return 0
            print(f"request {i}: {n} tokens, first after {ttft * 1000:.0f} ms")
            return n

        t = time.perf_counter()
        total = sum(await asyncio.gather(*(one(i) for i in range(args.requests))))
        print(f"{total} tokens in {time.perf_counter() - t:.2f}s = {total / (time.perf_counter() - t):.1f} tok/s")
        stats = await client.stats()
        for w in stats["workers"]:
            kv = ""
            if w.get("kv_handoffs"):
                # KV handoffs this (prefill) worker sent and their bandwidth (bytes / seconds).
                kv = f"  KV sent {w['kv_handoffs']} x, {w['kv_sent_bytes'] / 1e6:.1f} MB at {w['kv_gb_s']:.2f} GB/s"
            print(f"  {w['node']:<12} {w['state']:<6} dispatched {w['dispatched']:>5}  decode-targeted {w['decode_targeted']:>5}{kv}")
    return 0


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--broker", default="tcp://127.0.0.1:5555")
    p.add_argument("--stream", default="tcp://127.0.0.1:5558")
    p.add_argument("--cluster-secret-file")
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=32)
    sys.exit(asyncio.run(main(p.parse_args())))
