"""Alternating A/B of tandem's engine on the GPU: one ``gpu_decode.py --sections engine``
process per (round, config), configs alternating within each round, one table at the end.

From process to process the engine on the lent H200 moves by up to ~15%, so a change is
compared only against processes of the same call, taken in turns. A config is a list of
``NAME=value`` environment settings ("" = the defaults)::

    python bench/gpu_ab.py --config "" --config "TANDEM_PAGED_KERNELS=off" --rounds 2 \\
        --batches 1,64 --out $OUT/ab

Each process's log goes to ``<out>/<round>-<config index>.log``; the rows of every process
to ``<out>/ab.json`` (written after each process, so a call that runs out of time still
returns what finished). ``--tiny`` passes the smoke-test shape through (CPU, no GPU).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
COLUMNS = (("decode_tps", "decode tok/s", "{:,.0f}"), ("prefill_tps_alone", "prefill alone", "{:,.0f}"),
           ("tick_forward_ms_p50", "forward ms", "{:.2f}"), ("tick_encode_ms_p50", "encode ms", "{:.2f}"),
           ("tick_wait_ms_p50", "wait ms", "{:.2f}"), ("gap_max_ms", "max gap ms", "{:.1f}"),
           ("graph_replays", "graph replays", "{:,}"), ("clock_start_ms", "device start ms", "{:.2f}"),
           ("clock_span_ms", "device span ms", "{:.2f}"), ("clock_idle_ms", "device idle ms", "{:.2f}"),
           ("clock_token_ms", "token ms", "{:.2f}"))


def parse_config(text: str) -> dict[str, str]:
    """``"A=1 B=x"`` -> {"A": "1", "B": "x"}; "" -> {} (the defaults)."""
    env = {}
    for item in text.split():
        name, sep, value = item.partition("=")
        if not sep or not name:
            raise ValueError(f"config item {item!r}: expected NAME=value")
        env[name] = value
    return env


def engine_rows(result: dict) -> list[dict]:
    """The engine section's per-batch rows of one gpu_decode.json."""
    rows = []
    for r in result.get("runs", []):
        if r.get("section") == "engine" and "batch" in r:
            gap = r.get("gap_ms_p50_p90_max")
            g = r.get("graph_step")  # the captured one-row step: its replays (None: off)
            c = r.get("prefill_clock") or {}  # gpu_decode.prefill_clocked: one row's prefill, device clock
            rows.append({**r, "gap_max_ms": gap[-1] if gap else None,
                         "graph_replays": g["replays"] if g else None,
                         "clock_start_ms": c.get("device_start"), "clock_span_ms": c.get("device_span_ms"),
                         "clock_idle_ms": (c["device_idle_first_ms"] + c["device_idle_ms"]
                                           if "device_idle_ms" in c else None),
                         "clock_token_ms": c.get("token_done")})
    return rows


def table(rows: list[dict], labels: list[str]) -> str:
    """One line per (batch, round, config), configs in turn within a round."""
    head = ["batch", "round", "config"] + [c[1] for c in COLUMNS]
    lines = [" | ".join(head), " | ".join("---" for _ in head)]
    for batch in sorted({r["batch"] for r in rows}):
        for r in (r for r in rows if r["batch"] == batch):
            cells = [str(batch), str(r["round"]), labels[r["config"]]]
            for key, _, fmt in COLUMNS:
                v = r.get(key)
                cells.append(fmt.format(v) if isinstance(v, (int, float)) else "-")
            lines.append(" | ".join(cells))
    return "\n".join("| " + line + " |" for line in lines)


def run_process(env_extra: dict[str, str], args, log_path: Path) -> tuple[int, list[dict]]:
    part = Path(tempfile.mkdtemp(prefix="gpu-ab-"))
    cmd = [sys.executable, str(HERE / "gpu_decode.py"), "--sections", "engine", "--batches", args.batches,
           "--prefill-reps", str(args.prefill_reps), "--steps", str(args.steps), "--out", str(part)] + (["--tiny"] if args.tiny else [])
    env = {**os.environ, **env_extra}
    try:
        with open(log_path, "w") as log:
            try:
                rc = subprocess.run(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=args.timeout).returncode
            except subprocess.TimeoutExpired:
                rc = 124
        result = part / "gpu_decode.json"
        rows = engine_rows(json.loads(result.read_text())) if result.exists() else []
        return rc, rows
    finally:
        shutil.rmtree(part, ignore_errors=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", action="append", required=True,
                    help='environment settings of one side, e.g. "TANDEM_X=0" ("" = defaults); repeat')
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--batches", default="1")
    ap.add_argument("--prefill-reps", type=int, default=5)
    ap.add_argument("--steps", type=int, default=32,
                    help="gpu_decode.py's decode steps (batch 4 and under generate 3 x steps + 2 tokens)")
    ap.add_argument("--timeout", type=int, default=100, help="seconds per process")
    ap.add_argument("--out", required=True)
    ap.add_argument("--tiny", action="store_true", help="gpu_decode.py's smoke-test shape")
    args = ap.parse_args()
    try:
        configs = [parse_config(c) for c in args.config]
    except ValueError as exc:
        ap.error(str(exc))
    labels = [" ".join(f"{k}={v}" for k, v in c.items()) or "defaults" for c in configs]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows: list[dict] = []
    processes = []
    for rnd in range(1, args.rounds + 1):
        for i, env in enumerate(configs):
            t = time.perf_counter()
            rc, got = run_process(env, args, out / f"{rnd}-{i}.log")
            secs = time.perf_counter() - t
            rows += [{**r, "round": rnd, "config": i} for r in got]
            processes.append({"round": rnd, "config": labels[i], "rc": rc, "seconds": round(secs, 1)})
            done = ", ".join(f"B={r['batch']} {r.get('decode_tps') or 0:,.0f} tok/s" for r in got)
            print(f"round {rnd} [{labels[i]}] rc={rc} {secs:.0f} s: {done or 'no rows'}", flush=True)
            (out / "ab.json").write_text(json.dumps({"configs": labels, "processes": processes, "rows": rows},
                                                    indent=1))
    print("\n" + table(rows, labels))
    return 0 if rows and all(p["rc"] == 0 for p in processes) else 1


if __name__ == "__main__":
    sys.exit(main())
