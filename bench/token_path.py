"""The token path alone: broker + one stub-engine worker + wire-client processes, no model,
no HTTP. What worker IO, the broker's stream proxy and the edge's client cost per token.

Two measurements, each run against this tree and (``--baseline REF``) a ``git archive`` of
another commit, alternating round by round so both see the same machine load:

1. ``streams``: ``--streams`` concurrent streams of ``--tokens`` tokens each, closed loop,
   spread over ``--clients`` client processes (each one :class:`tandem.wire.client.AsyncClient`,
   as an edge process has), the stub stepping every ``--step-ms``: tokens/s received.
2. ``requests``: one-token requests/s through one AsyncClient process and the stub worker,
   ``--concurrency`` in flight (bench/broker.py's full-stack row).

Both trees run the same stub engine (this tree's tests/stub_engine.py), so only the
product code differs.

    .venv/bin/python bench/token_path.py --baseline main --rounds 3

Writes docs/benchmarks/token_path.{md,json}.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import ROOT, baseline_tree, cpu_s, machine, write_results

STUB = ROOT / "tests" / "stub_engine.py"


def _client_run(spec: dict) -> None:
    """One client process: ``spec["streams"]`` loops of requests of ``spec["tokens"]``
    tokens, counting the tokens (and finished requests) that arrive between ``start`` and
    ``start + seconds`` (wall clock, shared by every client process). Prints one JSON line."""
    import asyncio

    from tandem.kvtypes import SamplingParams
    from tandem.wire.client import AsyncClient

    async def main():
        secret = spec["secret"].encode()
        sp = SamplingParams(max_tokens=spec["tokens"], ignore_eos=True)
        start, end = spec["start"], spec["start"] + spec["seconds"]
        counts = {"tokens": 0, "requests": 0, "errors": 0}
        async with AsyncClient(spec["frontend"], spec["stream_out"], secret=secret, timeout_s=60) as ac:

            async def loop(i):
                n = 0
                while time.time() < end:
                    n += 1
                    try:
                        async for ev in ac.generate([(i * 7919 + n) % 1000 + 1, 2, 3], sp):
                            if start <= time.time() < end:
                                counts["tokens"] += len(ev.tokens)
                        if start <= time.time() < end:
                            counts["requests"] += 1
                    except Exception:
                        counts["errors"] += 1
                        await asyncio.sleep(0.05)

            await asyncio.gather(*(loop(spec["index"] * spec["streams"] + i) for i in range(spec["streams"])))
        print(json.dumps(counts), flush=True)

    asyncio.run(main())


_CHILD = """
import json, os, runpy, sys
src, script, spec = sys.argv[1:4]
sys.path.insert(0, src)
sys.path.insert(1, os.path.dirname(script))
import tandem  # this tree's package, before the script's own path setup
ns = runpy.run_path(script, run_name="bench_child")
ns["_client_run"](json.loads(spec))
"""


def _tree(ref: str | None) -> Path:
    """This tree, or ``tandem/`` of ``ref`` with this tree's stub engine beside it."""
    if ref is None:
        return ROOT
    dest = baseline_tree(ref)
    (dest / "tests").mkdir()
    (dest / "tests" / "__init__.py").write_text("")
    shutil.copy(STUB, dest / "tests" / "stub_engine.py")
    return dest


def _run(tree: Path, args, mode: str) -> dict:
    from tests.integration.cluster import Proc

    tmp = Path(tempfile.mkdtemp(prefix="tandem-bench-tokpath-"))
    secret = os.urandom(32).hex()
    (tmp / "secret").write_text(secret)
    (tmp / "secret").chmod(0o600)
    # A queue as deep as the load: the engine refuses a submit past max_queue_depth, and a
    # refusing worker is left alone until its next heartbeat, which would measure that
    # back-off (a second per refusal) instead of the path.
    (tmp / "worker.toml").write_text("[engine]\nmax_queue_depth = 8192\n")
    env = dict(os.environ, PYTHONUNBUFFERED="1",
               PYTHONPATH=os.pathsep.join(filter(None, (str(tree), os.environ.get("PYTHONPATH")))))
    env.pop("TANDEM_CLUSTER_SECRET", None)
    procs = []
    here = os.getcwd()
    os.chdir(tree)  # ``python -m`` puts the working directory first on sys.path: start each process from its tree
    try:
        any_ = "tcp://127.0.0.1:*"
        broker = Proc([sys.executable, "-m", "tandem.cli", "broker", "--frontend", any_, "--backend", any_,
                       "--stream-in", any_, "--stream-out", any_, "--stats", any_, "--max-queue", "100000",
                       "--cluster-secret-file", str(tmp / "secret")], env, tmp / "broker.log")
        procs.append(broker)
        e = broker.wait_ready()
        step = args.step_ms if mode == "streams" else 0.0
        worker = Proc([sys.executable, "-m", "tests.stub_engine", "--stub-step-ms", str(step), "worker", "--role", "hybrid",
                       "--broker-backend", e["backend"], "--broker-stream", e["stream_in"], "--parallel", "4096",
                       "--config", str(tmp / "worker.toml"), "--cluster-secret-file", str(tmp / "secret")], env, tmp / "worker.log")
        procs.append(worker)
        worker.wait_ready()
        time.sleep(1.0)  # the worker registers
        clients = args.clients if mode == "streams" else 1
        streams = args.streams // clients if mode == "streams" else args.concurrency
        start = time.time() + 2.0 + 0.3 * clients  # every client connected and warmed up
        spec = {"frontend": e["frontend"], "stream_out": e["stream_out"], "secret": secret, "streams": streams,
                "tokens": args.tokens if mode == "streams" else 1, "start": start, "seconds": args.seconds}
        kids = [subprocess.Popen([sys.executable, "-c", _CHILD, str(tree), str(Path(__file__).resolve()),
                                  json.dumps(dict(spec, index=i))], stdout=subprocess.PIPE,
                                 stderr=open(tmp / f"client-{i}.log", "ab"), cwd=str(tree), env=env)
                for i in range(clients)]
        time.sleep(max(0.0, start - time.time()))
        cpu0 = {name: cpu_s(p.p.pid) for name, p in (("broker", broker), ("worker", worker))}
        cpu0["clients"] = sum(cpu_s(k.pid) for k in kids)
        time.sleep(args.seconds)
        cpu = {name: cpu_s(p.p.pid) - cpu0[name] for name, p in (("broker", broker), ("worker", worker))}
        cpu["clients"] = sum(cpu_s(k.pid) for k in kids) - cpu0["clients"]
        total = {"tokens": 0, "requests": 0, "errors": 0}
        for k in kids:
            out, _ = k.communicate(timeout=120)
            line = out.decode().strip().splitlines()
            if k.returncode != 0 or not line:
                raise RuntimeError(f"client failed: {(tmp / 'client-0.log').read_text()[-2000:]}")
            for key, v in json.loads(line[-1]).items():
                total[key] += v
        unit = total["tokens"] if mode == "streams" else total["requests"]
        if not unit:
            tails = "\n".join(f"--- {f.name}\n{f.read_text(errors='replace')[-1500:]}" for f in sorted(tmp.glob("*.log")))
            raise RuntimeError(f"nothing streamed ({total}); logs in {tmp}\n{tails}")
        return {"per_s": unit / args.seconds, **total,
                "cpu_us": {k: v / max(1, unit) * 1e6 for k, v in cpu.items()}}
    finally:
        os.chdir(here)
        for p in procs:
            p.kill()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--streams", type=int, default=256)
    p.add_argument("--tokens", type=int, default=256, help="tokens per request in the streams measurement")
    p.add_argument("--clients", type=int, default=2, help="client processes the streams are spread over")
    p.add_argument("--step-ms", type=float, default=2.0, help="stub engine step time in the streams measurement")
    p.add_argument("--concurrency", type=int, default=256, help="one-token requests in flight")
    p.add_argument("--seconds", type=float, default=5.0)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--baseline", metavar="GIT_REF")
    p.add_argument("--modes", default="streams,requests")
    p.add_argument("--out", default=str(ROOT / "docs" / "benchmarks"))
    args = p.parse_args()

    trees = {"this": _tree(None)}
    if args.baseline:
        trees = {"baseline": _tree(args.baseline), **trees}
    modes = args.modes.split(",")
    runs = {(name, mode): [] for name in trees for mode in modes}
    for r in range(args.rounds):
        for mode in modes:
            for name, tree in trees.items():
                res = _run(tree, args, mode)
                runs[name, mode].append(res)
                print(f"round {r + 1} {mode} {name}: {res['per_s']:,.0f}/s "
                      f"cpu µs/unit {json.dumps({k: round(v, 1) for k, v in res['cpu_us'].items()})}", flush=True)
    med = {f"{name}/{mode}": statistics.median(x["per_s"] for x in rs) for (name, mode), rs in runs.items()}
    result = {**machine(), "args": vars(args), "medians": med,
              "runs": {f"{name}/{mode}": rs for (name, mode), rs in runs.items()}}
    label = {"streams": f"{args.streams} streams of {args.tokens} tokens over {args.clients} client processes, "
                        f"stub step {args.step_ms:g} ms: tokens/s",
             "requests": f"one-token requests, {args.concurrency} in flight, one client process: requests/s"}
    cmd = "python bench/token_path.py " + " ".join(
        f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if v is not None and k != "out")
    md = ["# The token path alone (stub engine, wire client, no HTTP)\n",
          f"{result['when']}, {result['cpus']} cores shared with other work (1-minute load average "
          f"{result['load_avg_1m']:.1f} at the end), CURVE on every socket, one hybrid stub worker, one broker.\n",
          f"Command: `{cmd}`\n"]
    head = "| measurement | " + " | ".join(trees) + (" | this / baseline |" if args.baseline else "")
    md += [head, "|---" * (len(trees) + 1 + bool(args.baseline)) + "|"]
    for mode in modes:
        row = [label[mode]] + [f"{med[f'{n}/{mode}']:,.0f}" for n in trees]
        if args.baseline:
            row.append(f"×{med[f'this/{mode}'] / med[f'baseline/{mode}']:.2f}")
        md.append("| " + " | ".join(row) + " |")
    md.append(f"\nMedians of {args.rounds} alternating rounds. CPU per token or request of each process "
              "(µs, medians):\n")
    md += ["| measurement | tree | broker | worker | clients |", "|---|---|---:|---:|---:|"]
    for (name, mode), rs in runs.items():
        c = {k: statistics.median(x["cpu_us"][k] for x in rs) for k in rs[0]["cpu_us"]}
        md.append(f"| {mode} | {name} | {c['broker']:.1f} | {c['worker']:.1f} | {c['clients']:.1f} |")
    write_results(args.out, "token_path", "\n".join(md) + "\n", result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
