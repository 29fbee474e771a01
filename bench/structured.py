"""Structured-output benchmark: does a JSON-schema-constrained request slow the batch?

One tandem stack (broker + hybrid worker + edge, as bench/serving.py starts it), one
client. Levels alternate between two workloads of ``--clients`` streaming chat requests
each, the same prompts shape and token budget: ``plain`` (no constraint) and ``half``
(every other request carries ``response_format`` json_schema, an array of at least 200
short strings, so its output never completes before ``--max-tokens`` and every request
generates exactly the budget, as in bench/serving.py where EOS is suppressed).
``--pairs`` pairs run back to back (plain, half, plain, half, ...), each level on prompts
the server has not seen; the result is the median aggregate tok/s of each workload and
their ratio (half / plain).

    flock /tmp/tandem-bench.lock .venv/bin/python bench/structured.py

Writes docs/benchmarks/structured.md and structured.json. Loopback only.
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

import serving  # bench/ is first on sys.path when run as a script

ROOT = Path(__file__).resolve().parents[1]
SCHEMA = {"type": "array", "items": {"type": "string", "maxLength": 40}, "minItems": 200}


def constrain(body: dict) -> dict:
    return {**body, "response_format": {"type": "json_schema",
                                        "json_schema": {"name": "items", "schema": SCHEMA, "strict": True}}}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="mlx-lm model directory (default: tandem's default model)")
    p.add_argument("--weights", choices=("dense", "quantized"), default="dense")
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--pairs", type=int, default=3, help="plain/half level pairs")
    p.add_argument("--prompt-tokens", type=int, default=170)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--parallel", type=int, default=32)
    p.add_argument("--timeout", type=float, default=900.0)
    p.add_argument("--out", default=str(ROOT / "docs" / "benchmarks" / "structured"))
    args = p.parse_args()

    from tandem.pipeline.model_store import resolve_model

    model = resolve_model(args.model)
    n = args.clients
    bodies, prompt_len = serving.build_bodies(model, args.prompt_tokens, args.max_tokens, 2 * args.pairs * n + 1)
    load0 = os.getloadavg()[0]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        procs, port = serving.start_tandem(model, args.weights, args.parallel, 1, Path(tmp), env)
        try:
            model_id = model.name
            bodies = [dict(b, model=model_id) for b in bodies]
            asyncio.run(serving.run_level(port, [constrain(bodies[-1])], 1, 1, args.max_tokens, args.timeout))  # warm-up
            groups = {pr.name: pr.p.pid for pr in procs}
            offset = 0
            for k in range(2 * args.pairs):
                workload = "plain" if k % 2 == 0 else "half"
                level = bodies[offset: offset + n]
                offset += n
                if workload == "half":
                    level = [constrain(b) if i % 2 == 0 else b for i, b in enumerate(level)]
                row = asyncio.run(serving.run_level(port, level, n, 1, args.max_tokens, args.timeout, groups))
                row["workload"] = workload
                rows.append(row)
                print(f"  {workload:6s} {n} clients: {row['tok_per_s']:7.1f} tok/s  TTFT p95 {row['ttft_p95_s']:.2f} s  "
                      f"ITL {row['itl_mean_ms']:.1f} ms  errors {row['errors']} {row['error_examples'][:1]}", flush=True)
        finally:
            for pr in reversed(procs):
                pr.stop()
    med = {w: statistics.median(r["tok_per_s"] for r in rows if r["workload"] == w) for w in ("plain", "half")}
    ratio = med["half"] / med["plain"] if med["plain"] else float("nan")
    # The worker's CPU time per generated token: what a constraint costs the machine,
    # much less sensitive than wall-clock tok/s to what else runs on a shared one.
    for r in rows:
        r["worker_cpu_ms_per_token"] = 1000 * r["cpu_s"].get("hybrid", 0.0) / r["tokens"] if r["tokens"] else float("nan")
    cpu = {w: statistics.median(r["worker_cpu_ms_per_token"] for r in rows if r["workload"] == w) for w in ("plain", "half")}
    meta = {"command": "bench/structured.py " + " ".join(sys.argv[1:]), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "machine": f"{platform.machine()}, {os.cpu_count()} cores", "model": model.name, "weights": args.weights,
            "clients": n, "pairs": args.pairs, "prompt_tokens": prompt_len, "max_tokens": args.max_tokens,
            "load_average_at_start": load0, "schema": SCHEMA}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps({"meta": meta, "rows": rows, "median_tok_per_s": med, "ratio": ratio,
                                                  "median_worker_cpu_ms_per_token": cpu}, indent=1))
    table = ["| level | workload | tok/s | worker CPU ms / token | TTFT mean / p95 (s) | ITL mean / p95 (ms) | errors |",
             "|---|---|---|---|---|---|---|"]
    for i, r in enumerate(rows):
        table.append(f"| {i + 1} | {r['workload']} | {r['tok_per_s']:.1f} | {r['worker_cpu_ms_per_token']:.2f} | "
                     f"{r['ttft_mean_s']:.2f} / {r['ttft_p95_s']:.2f} | "
                     f"{r['itl_mean_ms']:.1f} / {r['itl_p95_ms']:.1f} | {r['errors']}/{r['requests']} |")
    md = [
        "# Structured output: half the requests JSON-schema constrained vs none",
        "",
        f"Produced by `{meta['command']}` on {meta['date']} ({meta['machine']}), under `flock /tmp/tandem-bench.lock`.",
        "",
        f"Model `{model.name}` ({args.weights} weights), tandem broker + one hybrid worker (parallel {args.parallel}) + edge. "
        f"{n} clients, one streaming chat request each per level, prompts of {prompt_len} tokens on average (new to the "
        f"server at every level), {args.max_tokens} new tokens, temperature 0, EOS suppressed. `half`: every other request "
        f"carries `response_format` json_schema `{json.dumps(SCHEMA)}` (strict), which cannot complete within the budget, "
        "so both workloads generate the same tokens. Levels alternate plain / half. 1-minute load average at start: "
        f"{load0:.1f}" + (" (other work shared the machine: single levels' tok/s move with its load, so read the "
                          "CPU time per token)." if load0 > 1.0 else "."),
        "",
        f"**Median aggregate tok/s: plain {med['plain']:.1f}, half constrained {med['half']:.1f}: ratio {ratio:.2f}x.** "
        f"Median worker CPU time per generated token: plain {cpu['plain']:.2f} ms, half {cpu['half']:.2f} ms "
        f"({cpu['half'] / cpu['plain']:.2f}x): the load-insensitive view of the same question.",
        "",
        *table,
        "",
    ]
    out.with_suffix(".md").write_text("\n".join(md))
    print(f"median plain {med['plain']:.1f} tok/s, half {med['half']:.1f} tok/s: {ratio:.2f}x; "
          f"worker CPU ms/token {cpu['plain']:.2f} vs {cpu['half']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
