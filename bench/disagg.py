"""Hybrid vs disaggregated (1 prefill + 1 decode worker) on this machine, same load.

Both layouts run behind the same broker build in this one invocation: the same prompts
(fixed seed), the same concurrency, temperature 0. Reported side by side: aggregate
generated tokens/s, time to first token (p50/p90), and, for the disaggregated run, the
KV handoff time the prefill worker measured (send -> decode worker's "ingested" ack),
so the TTFT overhead can be compared with the transfer it pays for.

    .venv/bin/python bench/disagg.py [--model PATH] [--requests 16] [--concurrency 8]
                                     [--prompt-tokens 256] [--max-tokens 32]

Writes docs/benchmarks/disagg.{md,json}.
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

from _common import ROOT, cpu_s, machine, pct, write_results


# A pause before each layout's turn: the layout that ran last may still have MKL's OpenMP
# threads spinning (200 ms by default after a parallel region; a hybrid worker keeps the
# default), which took a core from the first prefill of the next layout's request.
SETTLE_S = 0.3
FILL_TOKENS = 4


def prompts(n, length, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(100, 40000) for _ in range(length)] for _ in range(n)]


async def drive(endpoints, secret, ps, concurrency, max_tokens, marks=None):
    """``marks``: a list to append (rid hex, submit, first token) monotonic times to."""

    from tandem.kvtypes import SamplingParams
    from tandem.wire.client import AsyncClient

    sem = asyncio.Semaphore(concurrency)
    ttft, total = [], 0
    async with AsyncClient(endpoints["frontend"], endpoints["stream_out"], secret=secret, timeout_s=600,
                           idle_timeout_s=600) as ac:
        by_prompt = [None] * len(ps)

        async def one(i, p):
            nonlocal total
            async with sem:
                rid = os.urandom(16)
                t = time.perf_counter()
                first = None
                async for ev in ac.generate(p, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True),
                                            request_id=rid):
                    if first is None and ev.tokens:
                        first = time.perf_counter() - t
                    total += len(ev.tokens)
                ttft.append(first)
                by_prompt[i] = first * 1e3
                if marks is not None:
                    marks.append((rid.hex(), t, t + first))
        t0 = time.perf_counter()
        await asyncio.gather(*(one(i, p) for i, p in enumerate(ps)))
        wall = time.perf_counter() - t0
    return {"tok_s": total / wall, "tokens": total, "wall_s": wall,
            "ttft_p50_ms": pct(ttft, 0.5) * 1e3, "ttft_p90_ms": pct(ttft, 0.9) * 1e3, "ttft_by_prompt_ms": by_prompt}


class Layout:
    """One layout's broker and workers, up for the whole run (idle while another layout is
    measured), so the unloaded requests can alternate between layouts."""

    def __init__(self, args, key: str, name: str, roles: list[str], gate: bool):
        from tests.integration.cluster import Cluster

        self.key, self.name, self.roles = key, name, roles
        self.tmp = Path(tempfile.mkdtemp(prefix="tandem-bench-disagg-"))
        self.c = Cluster(self.tmp, heartbeat_ms=1000)
        self.timeline = self.tmp / "timeline.jsonl"
        if args.kv_budget:
            self.c.env["TANDEM_ENGINE_KV_CACHE_BUDGET"] = args.kv_budget
        if gate:
            self.c.env["TANDEM_WORKER_CPU_GATE"] = str(self.tmp / "cpu.gate")
        if args.timeline:
            self.c.env["TANDEM_TIMELINE"] = str(self.timeline)
        self.c.start_broker()
        extra = ["--model", args.model] if args.model else []
        self.procs = [self.c.start_worker(role, *extra, engine="mlx", wait=False) for role in roles]

    def ready(self, warm, args) -> None:
        for p in self.procs:
            p.wait_ready(600)
        cl = self.c.client(timeout_s=60)
        self.c.wait_workers(cl, timeout=600, **{r: self.roles.count(r) for r in set(self.roles)})
        self.drive(warm, args.concurrency, 4)  # compile / warm both sides
        self.filled = self.fill(cl, args)

    def fill(self, cl, args) -> int:
        """Run distinct short requests through the layout (at the loaded concurrency)
        before anything is measured, so that every worker's KV store has grown to what the
        rounds need and the handoff path is warm. A store starts at 64 blocks and doubles
        when the pool's high-water mark passes it. Until 0a23b43 the high-water mark crept
        up by a request's blocks per request (the pool handed out never-used blocks before
        evicting cached ones), so with the engine's auto budget every layout's rounds 2 and
        4 carried a doubling: 0.9-1.0 s at 512 -> 1024 blocks and 2.2-2.7 s at 1024 -> 2048
        in the workers' logs, a 12 s round's time moved by up to 20% in one layout or the
        other. Now a store grows only for blocks in use, and the fill takes it to the
        working set of ``--concurrency`` requests. Returns the requests run."""
        if args.fill == 0:
            return 0
        n = args.fill
        if n < 0:
            total = max((w.get("total_blocks", 0) for w in cl.stats().get("workers", [])), default=0)
            per_request = -(-(args.prompt_tokens + 1) // 16)
            n = -(-total // per_request) + args.concurrency if total else 0
            if n > 200:
                print(f"{self.name}: a pool of {total} blocks takes {n} requests to fill; filling 200 (set --kv-budget)")
                n = 200
        ps = prompts(n, args.prompt_tokens, seed=1000)
        # Four tokens, not one: a one-token request ends on the prefill worker, and the
        # first loaded burst then paid the handoff path's and the decode worker's one-off
        # costs at batch 8 (first handoff 164 ms instead of 26-41, decode phase 1,351 ms
        # instead of 980-1,110: the gated layout's first round 0.94x, the others 0.96-1.01x).
        self.drive(ps, args.concurrency, FILL_TOKENS)
        return n

    def drive(self, ps, concurrency, max_tokens, marks=None):
        return asyncio.run(drive(self.c.endpoints, self.c.secret, ps, concurrency, max_tokens, marks))

    def handoffs(self):
        return _handoffs(self.procs) or ([], [])

    def cpu(self) -> dict:
        """CPU seconds so far of this layout's broker and each worker (all their threads)."""
        out = {}
        for p in self.c.procs:
            name = p.log.stem.rsplit("-", 1)[0].removeprefix("worker-")
            try:
                out[name] = out.get(name, 0.0) + cpu_s(p.p.pid)
            except OSError:
                pass
        return out

    def close(self):
        self.c.close()


def machine_cpu_s() -> tuple[float, float]:
    """(busy, stolen) CPU seconds of the whole machine so far, all cores (/proc/stat)."""
    f = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    user, nice, system, _idle, _iowait, irq, softirq, steal = f
    tick = os.sysconf("SC_CLK_TCK")
    return (user + nice + system + irq + softirq) / tick, steal / tick


def ours_cpu_s(live) -> float:
    """CPU seconds so far of every process this benchmark runs (itself included)."""
    return time.process_time() + sum(sum(lay.cpu().values()) for lay in live)


def run_loaded(layout: Layout, args, ps, with_timeline: bool, live=()) -> dict:
    before = len(layout.handoffs()[0])
    marks = []
    cpu0 = layout.cpu()
    (busy0, steal0), ours0 = machine_cpu_s(), ours_cpu_s(live)
    t_start = time.monotonic()
    result = layout.drive(ps, args.concurrency, args.max_tokens, marks)
    t_end = time.monotonic()
    cpu1 = layout.cpu()
    (busy1, steal1), ours1 = machine_cpu_s(), ours_cpu_s(live)
    # CPU seconds per process during the round (against 2 cores x wall_s available).
    result["cpu_s"] = {k: cpu1[k] - cpu0.get(k, 0.0) for k in cpu1}
    # Work outside the benchmark on the same cores (the CPU lock keeps out only those who
    # take it): rounds 55-65% as fast as the rest of their run had their decode steps at
    # 68-75 ms instead of 30 and a 4-prompt prefill at 3.15 s instead of 2.1, in every
    # layout that ran at that moment (bench timeline, 21:08).
    result["other_cpu_s"] = (busy1 - busy0) - (ours1 - ours0)
    result["stolen_cpu_s"] = steal1 - steal0
    ms, nbytes = (x[before:] for x in layout.handoffs())
    if ms:
        result["handoff_p50_ms"] = statistics.median(ms)
        result["handoff_mean_bytes"] = statistics.mean(nbytes)
        result["handoff_gb_s"] = sum(nbytes) / (sum(ms) / 1e3) / 1e9
    if with_timeline:
        result["timeline"] = _timeline(layout.timeline, marks, t_start, t_end)
    return result


def _handoffs(procs):
    ms, nbytes = [], []
    for p in procs:
        for m in re.finditer(r"handoff \w+: (\d+) KV bytes to \S+ in ([\d.]+) ms", p.log.read_text()):
            nbytes.append(int(m.group(1)))
            ms.append(float(m.group(2)))
    return (ms, nbytes) if ms else None


def _timeline(path: Path, marks, t_start: float, t_end: float) -> dict:
    """Where each request's time to first token went, from the workers' timeline lines
    (TANDEM_TIMELINE) and the client's own submit / first-token times, all on the
    monotonic clock: submit -> the entry worker has the DISPATCH -> the engine tick
    that prefills it is scheduled -> the engine emits its first token -> the worker
    publishes it -> the client has it. Also: how the prefill ticks were batched and how
    many decode ticks (any worker) ran while the prompts were being prefilled."""
    lines = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    lines = [x for x in lines if t_start <= x["t"] <= t_end]
    first = {}
    for x in lines:
        first.setdefault((x["ev"], x["rid"]), x)
    ticks = [x for x in lines if x["ev"] == "tick"]
    prefill_tick = {}
    for x in ticks:
        if x["kind"] == "prefill":
            for rid in x["rows"]:
                prefill_tick.setdefault(rid, x)
    parts = {k: [] for k in ("to_dispatch", "engine_queue", "prefill", "to_publish", "to_client")}
    for rid, sub, got in marks:
        d, tk = first.get(("dispatch", rid)), prefill_tick.get(rid)
        ev = next((x for x in lines if x["ev"] == "event" and x["rid"] == rid and x["tokens"]), None)
        pub = first.get(("publish", rid))
        if not (d and tk and ev and pub):
            continue
        parts["to_dispatch"].append(d["t"] - sub)
        parts["engine_queue"].append(tk["t"] - d["t"])
        parts["prefill"].append(ev["t"] - tk["t"])
        parts["to_publish"].append(pub["t"] - ev["t"])
        parts["to_client"].append(got - pub["t"])
    pre = [x for x in ticks if x["kind"] == "prefill" and any(r in prefill_tick and prefill_tick[r] is x for r in x["rows"])]
    nodes = sorted({x["node"] for x in ticks})
    # Wall time during which some prompt of the run was between its prefill tick and its
    # first token, and the decode ticks scheduled inside those spans (contention).
    spans = sorted((prefill_tick[r]["t"], first[("event", r)]["t"]) for r, *_ in marks
                   if r in prefill_tick and ("event", r) in first)
    decode_in = sum(1 for x in ticks if x["kind"] == "decode" and any(a <= x["t"] <= b for a, b in spans))
    return {
        "requests": len(parts["prefill"]),
        **{f"{k}_p50_ms": pct(v, 0.5) * 1e3 for k, v in parts.items()},
        **{f"{k}_mean_ms": statistics.mean(v) * 1e3 if v else float("nan") for k, v in parts.items()},
        "prefill_ticks": len(pre), "prompts_per_prefill_tick": [len(x["rows"]) for x in pre],
        "decode_ticks_during_prefills": decode_in,
        "ticks_by_node": {n: {k: sum(1 for x in ticks if x["node"] == n and x["kind"] == k) for k in ("prefill", "decode")}
                          for n in nodes},
    }


TARGET_RATIO = 0.95
OTHER_CPU_MARK_S = 0.2
TTFT_SLACK_MS = 5.0


def criteria(r: dict, hybrid: dict) -> list[dict]:
    """Issue 5's targets for one disaggregated layout against hybrid, each with the exact
    statistic compared and PASS/FAIL."""
    out = [{"criterion": "throughput", "statistic": "aggregate tok/s, median round, / hybrid's",
            "measured": r["throughput_ratio"], "allowed": TARGET_RATIO, "pass": r["throughput_ratio"] >= TARGET_RATIO,
            "measured_text": f"{r['throughput_ratio']:.3f}x", "allowed_text": f">= {TARGET_RATIO:.2f}x"}]
    if "handoff_p50_ms" in r:
        n = sum(len(rr["ttft_by_prompt_ms"]) for rr in r["rounds"])
        lim = r["handoff_p50_ms"] + TTFT_SLACK_MS
        v = r["ttft_overhead_pairs_p50_ms"]
        out.append({"criterion": "TTFT overhead, loaded", "statistic": f"median of {n} same-prompt pairs",
                    "measured": v, "allowed": lim, "pass": v <= lim, "measured_text": f"{v:+.1f} ms",
                    "allowed_text": f"<= {r['handoff_p50_ms']:.1f} + {TTFT_SLACK_MS:.0f} ms"})
    u = r.get("unloaded")
    if u and "ttft_overhead_p50_ms" in u and "handoff_p50_ms" in u:
        lim = u["handoff_p50_ms"] + TTFT_SLACK_MS
        v = u["ttft_overhead_p50_ms"]
        out.append({"criterion": "TTFT overhead, unloaded", "statistic": f"median of {len(u['ttft_ms'])} same-prompt pairs",
                    "measured": v, "allowed": lim, "pass": v <= lim, "measured_text": f"{v:+.1f} ms",
                    "allowed_text": f"<= {u['handoff_p50_ms']:.1f} + {TTFT_SLACK_MS:.0f} ms"})
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", help="model directory (default: the default model)")
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--prompt-tokens", type=int, default=256)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--rounds", type=int, default=2, help="loaded runs per layout, rotating the order (medians reported)")
    p.add_argument("--unloaded", type=int, default=8, metavar="N",
                   help="then N fresh prompts one at a time (concurrency 1), each to every layout in turn; 0 = skip")
    p.add_argument("--kv-budget", default="256MiB",
                   help="each worker's engine.kv_cache_budget (default 256MiB: 364 blocks of the default model, over "
                        "twice what 8 requests in flight hold); '' = the engine's own (auto: half the free memory)")
    p.add_argument("--fill", type=int, default=-1,
                   help="before measuring, N 4-token requests per layout so its KV stores have grown to what the "
                        "rounds need (-1 = as many as the pool the workers report has room for, at most 200; 0 = none)")
    p.add_argument("--gate", choices=("both", "on", "off"), default="both",
                   help="disaggregated runs with worker.cpu_gate (prefill first across the two workers), without, or both")
    p.add_argument("--timeline", action="store_true",
                   help="workers write a per-request timeline (TANDEM_TIMELINE); report where TTFT goes")
    p.add_argument("--out", default=str(ROOT / "docs" / "benchmarks"))
    args = p.parse_args()
    warm = prompts(2, args.prompt_tokens, seed=2)
    unloaded = prompts(args.unloaded, args.prompt_tokens, seed=3)
    specs = [("hybrid", "hybrid (1 worker)", ["hybrid"], False)]
    if args.gate in ("both", "off"):
        specs.append(("disaggregated", "1 prefill + 1 decode", ["prefill", "decode"], False))
    if args.gate in ("both", "on"):
        specs.append(("disaggregated_gated", "1 prefill + 1 decode, cpu_gate on", ["prefill", "decode"], True))
    live: list[Layout] = []
    runs: dict[str, list] = {key: [] for key, *_ in specs}
    pairs: dict[str, list] = {key: [] for key, *_ in specs}
    try:
        for spec in specs:
            live.append(Layout(args, *spec))
        for lay in live:
            lay.ready(warm, args)
        # Loaded: each round gives every layout the same fresh prompts (a new seed per round,
        # so no round hits a prefix cached by the one before), in a rotated order.
        for rnd in range(args.rounds):
            ps = prompts(args.requests, args.prompt_tokens, seed=10 + rnd)
            order = live[rnd % len(live):] + live[:rnd % len(live)]
            for lay in order:
                time.sleep(SETTLE_S)
                runs[lay.key].append(run_loaded(lay, args, ps, args.timeline and rnd == 0, live))
        # Unloaded: one request at a time, the same fresh prompt to each layout in turn.
        # The order rotates per prompt, as the rounds' does: whichever layout goes first
        # after the others ran is not always the same one.
        for i, p in enumerate(unloaded):
            for lay in live[i % len(live):] + live[:i % len(live)]:
                time.sleep(SETTLE_S)
                before = len(lay.handoffs()[0])
                (busy0, _), ours0 = machine_cpu_s(), ours_cpu_s(live)
                one = lay.drive([p], 1, args.max_tokens)
                (busy1, _), ours1 = machine_cpu_s(), ours_cpu_s(live)
                ms = lay.handoffs()[0][before:]
                pairs[lay.key].append((one["ttft_p50_ms"], ms[0] if ms else None, (busy1 - busy0) - (ours1 - ours0)))
    finally:
        for lay in live:
            lay.close()

    def summary(key):
        rs = runs[key]
        out = {k: statistics.median(r[k] for r in rs) for k in rs[0] if isinstance(rs[0][k], (int, float))}
        out["rounds"] = rs
        if "timeline" in rs[0]:
            out["timeline"] = rs[0]["timeline"]
            out["timeline_file"] = str(next(lay.timeline for lay in live if lay.key == key))
        if pairs[key]:
            ttfts = [t for t, *_ in pairs[key]]
            out["unloaded"] = {"requests": len(ttfts), "ttft_ms": ttfts, "ttft_p50_ms": statistics.median(ttfts),
                               "ttft_p90_ms": pct(ttfts, 0.9)}
            out["unloaded"]["other_cpu_s"] = [o for *_, o in pairs[key]]
            hs = [h for _, h, _ in pairs[key] if h is not None]
            if hs:
                out["unloaded"]["handoff_p50_ms"] = statistics.median(hs)
        return out
    live_fill = ", ".join(sorted({str(lay.filled) for lay in live}))
    hybrid = summary("hybrid")
    ungated = summary("disaggregated") if "disaggregated" in runs else None
    gated = summary("disaggregated_gated") if "disaggregated_gated" in runs else None
    layouts = [("hybrid (1 worker)", "hybrid", hybrid)]
    if ungated:
        layouts.append(("1 prefill + 1 decode", "disaggregated", ungated))
    if gated:
        layouts.append(("1 prefill + 1 decode, cpu_gate on", "disaggregated_gated", gated))
    result = {**machine(), "args": vars(args), **{key: r for _, key, r in layouts}}
    cmd = (f"python bench/disagg.py --requests {args.requests} --concurrency {args.concurrency} "
           f"--prompt-tokens {args.prompt_tokens} --max-tokens {args.max_tokens} --rounds {args.rounds} "
           f"--unloaded {args.unloaded}"
           + (f" --gate {args.gate}" if args.gate != "both" else "")
           + (f" --kv-budget '{args.kv_budget}'" if args.kv_budget != "256MiB" else "")
           + (f" --fill {args.fill}" if args.fill != -1 else "") + (" --timeline" if args.timeline else ""))
    md = [
        "# Hybrid vs disaggregated serving on one machine\n",
        f"{result['when']}, {result['cpus']} cores shared by every process (1-minute load average "
        f"{result['load_avg_1m']:.1f} at the end), default model unless --model. {args.requests} requests, "
        f"{args.concurrency} in flight, {args.prompt_tokens}-token prompts, {args.max_tokens} generated tokens each, "
        f"temperature 0. Each layout has its own broker and workers, all started at once (KV pool "
        f"{args.kv_budget or 'auto'}, every layout warmed first by {live_fill} {FILL_TOKENS}-token requests at the loaded concurrency); loaded rows are medians of {args.rounds} rounds (fresh prompts per round, layout order rotated). "
        "TTFT is submit -> first token at the client.\n",
        f"Command: `{cmd}`\n",
    ]
    at_criteria = len(md)
    md += [
        "| layout | aggregate tok/s | vs hybrid | TTFT p50 | TTFT p90 | TTFT p50 overhead | TTFT overhead, median of pairs | KV handoff p50 | KV bytes/request |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, key, r in layouts:
        r["throughput_ratio"] = r["tok_s"] / hybrid["tok_s"]
        r["ttft_overhead_p50_ms"] = r["ttft_p50_ms"] - hybrid["ttft_p50_ms"]
        # The same prompt in the same round through both layouts: a loaded TTFT p50 falls
        # between the first and the second prefill batch of a burst (8 of 16 requests
        # each), so it moves by a whole batch when one round splits its prompts differently.
        diffs = [a - b for rr, hh in zip(r["rounds"], hybrid["rounds"])
                 for a, b in zip(rr["ttft_by_prompt_ms"], hh["ttft_by_prompt_ms"])]
        r["ttft_overhead_pairs_p50_ms"] = statistics.median(diffs)
        md.append(f"| {name} | {r['tok_s']:.1f} | {r['throughput_ratio']:.2f}x | {r['ttft_p50_ms']:.0f} ms | "
                  f"{r['ttft_p90_ms']:.0f} ms | " + ("" if r is hybrid else f"{r['ttft_overhead_p50_ms']:+.0f} ms") + " | "
                  + ("" if r is hybrid else f"{r['ttft_overhead_pairs_p50_ms']:+.0f} ms") + " | "
                  + (f"{r['handoff_p50_ms']:.1f} ms | {r['handoff_mean_bytes'] / 1e6:.2f} MB |"
                     if "handoff_p50_ms" in r else "- | - |"))
    md += ["\nPer round (the same prompts for every layout; the headline compares the layouts' median rounds), "
           "aggregate tok/s and, for the others, the ratio to hybrid's same round; then CPU seconds per round "
           f"(median of rounds; 2 cores x wall time are available):\n",
           "| layout | " + " | ".join(f"round {i + 1}" for i in range(args.rounds)) + " | CPU s per round, by process |",
           "|---|" + "---:|" * args.rounds + "---|"]
    for name, key, r in layouts:
        cells = []
        for rr, hh in zip(r["rounds"], hybrid["rounds"]):
            cells.append(f"{rr['tok_s']:.1f}" + ("" if r is hybrid else f" ({rr['tok_s'] / hh['tok_s']:.2f}x)"))
        r["round_ratios"] = [rr["tok_s"] / hh["tok_s"] for rr, hh in zip(r["rounds"], hybrid["rounds"])]
        procs = r["rounds"][0].get("cpu_s", {})
        r["cpu_s_per_round"] = {k: statistics.median(rr["cpu_s"][k] for rr in r["rounds"]) for k in procs}
        wall = statistics.median(rr["wall_s"] for rr in r["rounds"])
        cpu = ", ".join(f"{k} {v:.2f}" for k, v in r["cpu_s_per_round"].items())
        md.append(f"| {name} | " + " | ".join(cells) + f" | {cpu} (wall {wall:.2f} s) |")
    md += ["\nCPU seconds used on the machine during each round by processes outside this benchmark "
           "(all cores' busy time from /proc/stat minus this benchmark's processes; and time stolen by the "
           "hypervisor). A round with seconds of it shared the cores with other work:\n",
           "| layout | " + " | ".join(f"round {i + 1}" for i in range(args.rounds)) + " |", "|---|" + "---:|" * args.rounds]
    for name, key, r in layouts:
        md.append(f"| {name} | " + " | ".join(f"{rr['other_cpu_s']:.1f}" + (f" (+{rr['stolen_cpu_s']:.1f} stolen)" if rr['stolen_cpu_s'] >= 0.05 else "")
                                              for rr in r["rounds"]) + " |")
    if args.unloaded:
        md += [f"\nUnloaded: {args.unloaded} fresh prompts one at a time (concurrency 1), each sent to every layout "
               "in turn, the order rotated per prompt (all layouts are up; the others idle), so each prompt gives a pair:\n",
               "| layout | TTFT p50 | TTFT p90 | overhead, median of pairs | KV handoff p50 |", "|---|---:|---:|---:|---:|"]
        for name, key, r in layouts:
            u = r["unloaded"]
            if r is not hybrid:
                diffs = [a - b for a, b in zip(u["ttft_ms"], hybrid["unloaded"]["ttft_ms"])]
                u["ttft_overhead_pairs_ms"] = diffs
                u["ttft_overhead_p50_ms"] = statistics.median(diffs)
            md.append(f"| {name} | {u['ttft_p50_ms']:.0f} ms | {u['ttft_p90_ms']:.0f} ms | "
                      + ("" if r is hybrid else f"{u['ttft_overhead_p50_ms']:+.0f} ms") + " | "
                      + (f"{u['handoff_p50_ms']:.1f} ms |" if "handoff_p50_ms" in u else "- |"))
        # A single 256-token prefill takes about 0.52 s here; work outside the benchmark
        # for a second or two (it does not take the CPU lock) made one take 0.9-1.0 s and
        # moved the median of 8 pairs past the target (21:25 run).
        md += [f"\nPer prompt, TTFT in ms and, for the others, the difference to hybrid's; * marks a request "
               f"during which processes outside the benchmark used over {OTHER_CPU_MARK_S} CPU s:\n",
               "| layout | " + " | ".join(f"prompt {i + 1}" for i in range(args.unloaded)) + " |",
               "|---|" + "---:|" * args.unloaded]
        hu = hybrid["unloaded"]
        for name, key, r in layouts:
            u = r["unloaded"]
            cells = []
            for i, t in enumerate(u["ttft_ms"]):
                mark = "*" if u["other_cpu_s"][i] > OTHER_CPU_MARK_S else ""
                cells.append(f"{t:.0f}{mark}" + ("" if r is hybrid else f" ({t - hu['ttft_ms'][i]:+.0f})"))
            md.append(f"| {name} | " + " | ".join(cells) + " |")
    if args.timeline:
        md += ["\nWhere time to first token goes (workers' timeline, p50 per request, ms; a tick is marked when "
               "the engine schedules it, which is before the previous step has finished):\n",
               "| layout | submit → dispatch | dispatch → prefill tick | prefill tick → first token | → published | → client | prefill ticks (prompts each) | decode ticks during prefills |",
               "|---|---:|---:|---:|---:|---:|---|---:|"]
        for name, key, r in layouts:
            tl = r["timeline"]
            md.append(f"| {name} | {tl['to_dispatch_p50_ms']:.1f} | {tl['engine_queue_p50_ms']:.1f} | {tl['prefill_p50_ms']:.1f} | "
                      f"{tl['to_publish_p50_ms']:.1f} | {tl['to_client_p50_ms']:.1f} | {tl['prefill_ticks']} "
                      f"({', '.join(map(str, tl['prompts_per_prefill_tick']))}) | {tl['decode_ticks_during_prefills']} |")
    result["criteria"] = {key: criteria(r, hybrid) for _, key, r in layouts if r is not hybrid}
    head = ["## Targets (issue 5), each layout against hybrid\n",
            "Throughput: the ratio of the layouts' median-round aggregate tok/s, at least 0.95x. Time to first "
            "token overhead: at most the KV handoff time measured in the same run + 5 ms. Loaded, the overhead is "
            "the median over every request of TTFT(layout) - TTFT(hybrid) for the same prompt in the same round "
            f"({args.rounds} x {args.requests} pairs), against the loaded handoff p50; the p50 difference in the "
            "table below is not the criterion (a loaded p50 falls between a burst's first and second prefill "
            "batch, so it moves by a whole batch, +-200 ms, with how one round's prompts split into batches). "
            "Unloaded, the median over the prompts of the same difference (one request at a time), against the "
            "unloaded handoff p50.\n",
            "| layout | criterion | statistic | measured | allowed | result |", "|---|---|---|---:|---:|---|"]
    for name, key, r in layouts:
        for c in result["criteria"].get(key, []):
            head.append(f"| {name} | {c['criterion']} | {c['statistic']} | {c['measured_text']} | {c['allowed_text']} | "
                        f"**{'PASS' if c['pass'] else 'FAIL'}** |")
    for name, key, r in layouts:
        if key in result["criteria"]:
            ok = all(c["pass"] for c in result["criteria"][key])
            head.append(f"\n{name}: **{'all targets met' if ok else 'targets missed'}** "
                        f"({', '.join(c['criterion'] + ' ' + ('PASS' if c['pass'] else 'FAIL') for c in result['criteria'][key])}).")
    md[at_criteria:at_criteria] = head + ["\n## Measurements\n"]
    md.append("\nOn one machine both layouts share the same cores, so the disaggregated layout cannot win on "
              "compute: it pays for the handoff and gains only the isolation of decode from prefill. "
              "Separate prefill and decode hardware is where the split pays.")
    write_results(args.out, "disagg", "\n".join(md) + "\n", result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
