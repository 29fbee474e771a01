"""A long prompt's latency: hybrid vs disaggregated, the handoff code of a git
``--baseline`` vs this tree's, in one run.

Three layouts, each its own broker and workers, all up at once: one hybrid worker; one
prefill + one decode worker on the baseline tree's code; the same on this tree's. The
comparisons so far (docs/benchmarks/LOG.md): KV handed over after the prefill (af06864)
vs streamed while it runs; streamed but imported into the decode worker's KV store only
once the last part is in (51535d1, the default) vs each part imported as it arrives. Both
disaggregated layouts run as ``tandem serve`` starts them (CPU gate on, transfer strategy
``adaptive``). Every layout first gets ``--warm`` long prompts (the adaptive selector tries
each strategy once), then each of ``--prompts`` fresh prompts goes to every layout in turn,
one request at a time, the order rotated per prompt. Per request: time to the first token
(the prefill worker publishes it before the handoff), to the second (the first the decode
worker produces: the handoff is on its way) and to the last; reported as medians and as
the median over prompts of each layout's time / hybrid's for the same prompt.

    flock /tmp/tandem-bench.lock .venv/bin/python bench/long_prompt.py [--prompt-tokens 4096]

Writes docs/benchmarks/long_prompt.{md,json}.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

from _common import ROOT, baseline_tree, machine, write_results

SETTLE_S = 0.3


def prompts(n: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, 40000) for _ in range(length)] for _ in range(n)]


class Layout:
    def __init__(self, key: str, name: str, roles: list[str], args, tree: Path | None):
        from tests.integration.cluster import Cluster

        self.key, self.name, self.roles = key, name, roles
        self.tmp = Path(tempfile.mkdtemp(prefix=f"tandem-bench-long-{key}-"))
        self.c = Cluster(self.tmp, heartbeat_ms=1000)
        self.c.env["TANDEM_ENGINE_KV_CACHE_BUDGET"] = args.kv_budget
        self.timeline = self.tmp / "timeline.jsonl"
        if "prefill" in roles:
            self.c.env["TANDEM_WORKER_CPU_GATE"] = str(self.tmp / "cpu.gate")
            self.c.env["TANDEM_TIMELINE"] = str(self.timeline)
        here = os.getcwd()
        if tree is not None:
            # ``python -m`` puts the working directory first on sys.path: start it from the tree.
            self.c.env["PYTHONPATH"] = str(tree)
            os.chdir(tree)
        try:
            self.c.start_broker()
            extra = ["--model", args.model] if args.model else []
            self.procs = [self.c.start_worker(r, *extra, engine="mlx", wait=False) for r in roles]
        finally:
            os.chdir(here)

    def ready(self) -> None:
        for p in self.procs:
            p.wait_ready(600)
        self.c.wait_workers(self.c.client(timeout_s=60), timeout=600, **{r: self.roles.count(r) for r in set(self.roles)})

    def one(self, prompt: list[int], max_tokens: int) -> dict:
        rid = os.urandom(16)
        out = asyncio.run(_one(self.c, prompt, max_tokens, rid))
        if self.timeline.exists():
            out.update(_handoff_gap(self.timeline, rid.hex()))
        return out

    def handoffs(self) -> list[tuple[float, str]]:
        """(ms, strategy) of every handoff so far, from the prefill worker's log."""
        text = "".join(p.log.read_text() for p in self.procs)
        return [(float(ms), how) for ms, how in re.findall(r"handoff \w+: \d+ KV bytes to \S+ in ([\d.]+) ms \(([^)]*)\)", text)]

    def close(self) -> None:
        self.c.close()


def _handoff_gap(path: Path, rid: str) -> dict:
    """From the workers' timeline (TANDEM_TIMELINE, one monotonic clock): the first token's
    publication by the prefill worker -> the decode worker has the whole KV (handed to its
    engine) -> it publishes the second token (the import into its KV store and a decode step)."""
    lines = [json.loads(x) for x in path.read_text().splitlines() if rid in x]
    pub = {x["seq"]: x["t"] for x in lines if x["ev"] == "publish"}
    ingested = next((x["t"] for x in lines if x["ev"] == "kv_ingested"), None)
    if 0 not in pub or 1 not in pub or ingested is None:
        return {}
    return {"kv_in_after_first_ms": (ingested - pub[0]) * 1e3, "second_after_kv_ms": (pub[1] - ingested) * 1e3}


async def _one(c, prompt, max_tokens, rid) -> dict:
    from tandem.kvtypes import SamplingParams
    from tandem.wire.client import AsyncClient

    times = []
    async with AsyncClient(c.endpoints["frontend"], c.endpoints["stream_out"], secret=c.secret, timeout_s=600,
                           idle_timeout_s=600) as ac:
        t0 = time.perf_counter()
        async for ev in ac.generate(prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True),
                                    request_id=rid):
            times += [time.perf_counter() - t0] * len(ev.tokens)
    return {"ttft_ms": times[0] * 1e3, "second_ms": times[1] * 1e3, "total_ms": times[-1] * 1e3, "tokens": len(times)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", help="model directory (default: the default model)")
    p.add_argument("--prompt-tokens", type=int, default=4096)
    p.add_argument("--prompts", type=int, default=6, help="measured prompts, each to every layout")
    p.add_argument("--warm", type=int, default=4, help="long prompts per layout before measuring")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--baseline", default="51535d1", help="git ref of the handoff code to compare with (default: the last "
                   "commit before the decode worker imported streamed parts as they arrive)")
    p.add_argument("--kv-budget", default="1GiB", help="each worker's engine.kv_cache_budget")
    p.add_argument("--out", default=str(ROOT / "docs" / "benchmarks"))
    args = p.parse_args()
    base = baseline_tree(args.baseline)
    specs = [("hybrid", "hybrid (1 worker)", ["hybrid"], None),
             ("before", f"1 prefill + 1 decode, {args.baseline}", ["prefill", "decode"], base),
             ("after", "1 prefill + 1 decode, this tree", ["prefill", "decode"], None)]
    live: list[Layout] = []
    per: dict[str, list[dict]] = {k: [] for k, *_ in specs}
    how: dict[str, list[str]] = {k: [] for k, *_ in specs}
    try:
        for key, name, roles, tree in specs:
            live.append(Layout(key, name, roles, args, tree))
        for lay in live:
            lay.ready()
        for i, pr in enumerate(prompts(args.warm, args.prompt_tokens, seed=1)):
            for lay in live:
                lay.one(pr, 2)
        for i, pr in enumerate(prompts(args.prompts, args.prompt_tokens, seed=2)):
            for lay in live[i % len(live):] + live[:i % len(live)]:
                time.sleep(SETTLE_S)
                n = len(lay.handoffs())
                per[lay.key].append(lay.one(pr, args.max_tokens))
                new = lay.handoffs()[n:]
                how[lay.key].append(f"{new[0][1]}, {new[0][0]:.0f} ms" if new else "")
    finally:
        for lay in live:
            lay.close()

    result = {**machine(), "args": vars(args), "layouts": {}}
    hyb = per["hybrid"]
    md = ["# A long prompt's latency: hybrid vs disaggregated, a baseline's handoff vs this tree's\n",
          f"{result['when']}, {result['cpus']} cores shared by every process (load average {result['load_avg_1m']:.1f} "
          f"at the end), {args.model or 'the default model'}; {args.prompt_tokens}-token prompts, {args.max_tokens} "
          f"tokens each, temperature 0, one request at a time; {args.prompts} fresh prompts, each to every layout "
          f"(order rotated), after {args.warm} warm-up prompts per layout. Time to the 2nd token is the first the "
          "decode worker produces: the KV handoff lies before it (1st -> 2nd token: the client's time between "
          "them, the handoff's cost to the request). Ratios: median over prompts of the layout's time "
          "/ hybrid's for the same prompt. From the workers' timeline (one monotonic clock): the prefill worker "
          "publishes the first token -> the decode worker has the whole KV (hands it to its engine) -> it publishes "
          "the second token (copying what of the KV is not in its KV store yet, and one decode step). The handoffs column is the prefill "
          "worker's own measure: from the end of the prefill (its last part queued) to the decode worker's "
          "acknowledgement.\n",
          f"Command: `flock /tmp/tandem-bench.lock python bench/long_prompt.py --prompt-tokens {args.prompt_tokens} "
          f"--prompts {args.prompts} --warm {args.warm} --max-tokens {args.max_tokens} --baseline {args.baseline}"
          + (f" --model {args.model}" if args.model else "") + "`\n",
          "| layout | TTFT p50 | vs hybrid | 2nd token p50 | vs hybrid | last token p50 | vs hybrid | 1st -> 2nd token | 1st token -> KV in | KV in -> 2nd token | handoffs (strategy, ms after the prefill) |",
          "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for key, name, *_ in specs:
        rs = per[key]
        row = {"requests": rs, "handoffs": how[key]}
        cells = []
        for m in ("ttft_ms", "second_ms", "total_ms"):
            row[m.replace("_ms", "_p50_ms")] = statistics.median(r[m] for r in rs)
            row[m.replace("_ms", "_ratio")] = statistics.median(r[m] / h[m] for r, h in zip(rs, hyb))
            cells.append(f"{row[m.replace('_ms', '_p50_ms')]:.0f} ms | {row[m.replace('_ms', '_ratio')]:.2f}x")
        row["first_to_second_p50_ms"] = statistics.median(r["second_ms"] - r["ttft_ms"] for r in rs)
        cells.append(f"{row['first_to_second_p50_ms']:.0f} ms")
        for m in ("kv_in_after_first_ms", "second_after_kv_ms"):
            xs = [r[m] for r in rs if m in r]
            row[m.replace("_ms", "_p50_ms")] = statistics.median(xs) if xs else None
            cells.append(f"{statistics.median(xs):.0f} ms" if xs else "-")
        result["layouts"][key] = {"name": name, **row}
        md.append(f"| {name} | " + " | ".join(cells) + " | " + ("; ".join(h for h in how[key] if h) or "-") + " |")
    b, a = result["layouts"]["before"], result["layouts"]["after"]
    md.append(f"\nThis tree against {args.baseline}, disaggregated: 1st -> 2nd token "
              f"{statistics.median((x['second_ms'] - x['ttft_ms']) / (y['second_ms'] - y['ttft_ms']) for x, y in zip(per['after'], per['before'])):.2f}x, "
              "end to end (last token) "
              f"{statistics.median(x['total_ms'] / y['total_ms'] for x, y in zip(per['after'], per['before'])):.2f}x, "
              "time to the 2nd token "
              f"{statistics.median(x['second_ms'] / y['second_ms'] for x, y in zip(per['after'], per['before'])):.2f}x, "
              f"TTFT {statistics.median(x['ttft_ms'] / y['ttft_ms'] for x, y in zip(per['after'], per['before'])):.2f}x "
              "(median over prompts of the per-prompt ratio). Against hybrid: 2nd token "
              f"{b['second_ratio']:.2f}x before, {a['second_ratio']:.2f}x after; TTFT {b['ttft_ratio']:.2f}x before, "
              f"{a['ttft_ratio']:.2f}x after.")
    write_results(args.out, "long_prompt", "\n".join(md) + "\n", result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
