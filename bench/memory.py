"""Idle memory of `tandem serve`: PSS (and RSS) summed over its process tree, per weight format.

For each ``--weights`` format it starts ``tandem serve`` (``--topology``, default hybrid)
in its own session on free loopback ports, waits for /ready, lets it settle, and reads
/proc/PID/smaps_rollup of it and every descendant: PSS counts a page shared by n
processes as 1/n, so the sum is what the stack costs the machine. The formats run one
after the other, in one run, so their ratio is side by side.

    flock /tmp/tandem-bench.lock .venv/bin/python bench/memory.py --weights dense,auto --llama-server

Writes docs/benchmarks/memory.md and memory.json (``--out`` changes the stem). Loopback only.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def free_port_block(n: int) -> int:
    """A port p with p .. p + n - 1 free on loopback now."""
    for _ in range(200):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        if base + n > 65535:
            continue
        try:
            socks = []
            for i in range(n):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", base + i))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError("no block of free loopback ports")


def _tree(root: int) -> set[int]:
    """``root`` and every live descendant (serve starts its children in their own sessions,
    so a process group would miss them)."""
    parent = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                parent[int(entry)] = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except OSError:
                continue
    tree, grew = {root}, True
    while grew:
        more = {pid for pid, pp in parent.items() if pp in tree} - tree
        tree |= more
        grew = bool(more)
    return tree


def tree_memory(root: int) -> dict:
    """Per process of ``root``'s tree: name, RSS and PSS in bytes (smaps_rollup)."""
    procs = []
    for pid in _tree(root):
        entry = str(pid)
        try:
            roll = Path(f"/proc/{entry}/smaps_rollup").read_text()
            cmd = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        kb = {line.split(":")[0]: int(line.split()[1]) for line in roll.splitlines()[1:] if line.split()[-1] == "kB"}
        name = " ".join(c.decode(errors="replace") for c in cmd[2:5] if c)
        procs.append({"pid": int(entry), "cmd": name, "rss": kb["Rss"] * 1024, "pss": kb["Pss"] * 1024})
    return {"processes": sorted(procs, key=lambda p: -p["pss"]),
            "pss": sum(p["pss"] for p in procs), "rss": sum(p["rss"] for p in procs)}


def start_serve(extra: list[str], state: Path, timeout: float) -> tuple[subprocess.Popen, int]:
    """``tandem serve`` with ``extra`` arguments on free loopback ports, its own state dir
    and log (``state/serve.log``), once /ready answers -> (process, HTTP port)."""
    port, base = free_port_block(1), free_port_block(20)
    cmd = [sys.executable, "-m", "tandem.cli", "serve", *extra, "--port", str(port), "--base-port", str(base),
           "--state-dir", str(state), "--startup-timeout", str(timeout)]
    env = {k: v for k, v in os.environ.items() if not k.startswith("TANDEM_CLUSTER_SECRET")}
    with open(state / "serve.log", "wb") as log:
        p = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env)
    deadline = time.monotonic() + timeout
    while True:
        if p.poll() is not None:
            raise RuntimeError(f"tandem serve exited {p.returncode}: {(state / 'serve.log').read_text()[-2000:]}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/ready", timeout=2) as r:
                if r.status == 200:
                    return p, port
        except OSError:
            pass
        if time.monotonic() > deadline:
            stop_serve(p)
            raise TimeoutError(f"tandem serve not ready after {timeout:.0f} s: {(state / 'serve.log').read_text()[-2000:]}")
        time.sleep(1)


def stop_serve(p: subprocess.Popen) -> None:
    """SIGTERM (serve drains and stops its children), SIGKILL after a minute."""
    try:
        os.killpg(p.pid, signal.SIGTERM)
        p.wait(60)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        p.wait(10)


def measure(weights: str, topology: str, model: str | None, settle: float, timeout: float) -> dict:
    state = Path(tempfile.mkdtemp(prefix="tandem-bench-memory-"))
    try:
        p, _ = start_serve(["--topology", topology, "--weights", weights] + (["--model", model] if model else []),
                           state, timeout)
        try:
            time.sleep(settle)
            out = tree_memory(p.pid)
        finally:
            stop_serve(p)
        out["weights"] = next((line.split("weights ", 1)[1].split(", device")[0]
                               for line in (state / "serve.log").read_text().splitlines() if "weights " in line
                               and ", device" in line), weights)
        return out
    finally:
        shutil.rmtree(state, ignore_errors=True)


def measure_llama_server(settle: float, timeout: float) -> dict:
    """The same reading for llama.cpp's llama-server (bench/llama_server.py: its serving
    bench's arguments, the default model's GGUF), idle after /health answers."""
    import llama_server

    with socket.socket() as sk:
        sk.bind(("127.0.0.1", 0))
        port = sk.getsockname()[1]
    state = Path(tempfile.mkdtemp(prefix="tandem-bench-memory-"))
    try:
        with open(state / "llama.log", "wb") as log:
            p = subprocess.Popen(llama_server.command(port, "127.0.0.1", llama_server.gguf()), stdout=log,
                                 stderr=subprocess.STDOUT, start_new_session=True)
        try:
            deadline = time.monotonic() + timeout
            while True:
                try:
                    with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                        if r.status == 200:
                            break
                except OSError:
                    pass
                if p.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"llama-server did not come up: {(state / 'llama.log').read_text()[-1500:]}")
                time.sleep(1)
            time.sleep(settle)
            out = tree_memory(p.pid)
        finally:
            stop_serve(p)
        out["weights"] = "Q4_1 GGUF, " + " ".join(llama_server.ARGS)
        return out
    finally:
        shutil.rmtree(state, ignore_errors=True)


def report(results: dict) -> str:
    meta, rows = results["meta"], results["rows"]
    lines = ["# Idle memory of `tandem serve`", "",
             f"`{meta['command']}` — {meta['date']}, {meta['machine']}, topology {meta['topology']}, "
             f"model {meta['model']}, settled {meta['settle_s']:.0f} s after /ready.", "",
             "| server | runs as | PSS total | RSS total | largest process (PSS) | processes |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        top = r["processes"][0]
        lines.append(f"| {r['format']} | {r['weights']} | {r['pss'] / 2**30:.2f} GiB | {r['rss'] / 2**30:.2f} GiB | "
                     f"{top['cmd']} {top['pss'] / 2**30:.2f} GiB | {len(r['processes'])} |")
    if len(rows) > 1:
        lines += ["", "PSS ratios against the first format: " + ", ".join(
            f"{r['format']} {r['pss'] / rows[0]['pss']:.2f}x" for r in rows[1:])]
    return "\n".join(lines) + "\n"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--weights", default="dense,auto", help="comma list of weight formats, run in this order")
    p.add_argument("--topology", choices=("hybrid", "disaggregated"), default="hybrid")
    p.add_argument("--model", help="mlx-lm model directory (default: tandem's default model)")
    p.add_argument("--llama-server", action="store_true",
                   help="also llama.cpp's llama-server on the default model's GGUF, where built (bench/serving.py "
                        "--build-llama-server)")
    p.add_argument("--settle", type=float, default=5.0, help="seconds to wait after /ready before reading")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds to wait for /ready")
    p.add_argument("--out", default=str(ROOT / "docs" / "benchmarks" / "memory"))
    args = p.parse_args()
    rows = []
    import llama_server

    formats = [w.strip() for w in args.weights.split(",") if w.strip()]
    if args.llama_server:
        if llama_server.binary() is None:
            print(llama_server.why_absent(), flush=True)
        else:
            formats.append("llama-server")
    for fmt in formats:
        r = (measure_llama_server(args.settle, args.timeout) if fmt == "llama-server"
             else measure(fmt, args.topology, args.model, args.settle, args.timeout))
        r["format"] = fmt
        rows.append(r)
        print(f"{fmt}: PSS {r['pss'] / 2**30:.2f} GiB over {len(r['processes'])} processes ({r['weights']})", flush=True)
    results = {"meta": {"command": "python bench/memory.py " + " ".join(sys.argv[1:]),
                        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
                        "topology": args.topology, "model": Path(args.model).name if args.model else "default",
                        "settle_s": args.settle},
               "rows": rows}
    out = Path(args.out)
    out.with_suffix(".json").write_text(json.dumps(results, indent=1) + "\n")
    text = report(results)
    out.with_suffix(".md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
