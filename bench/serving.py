"""Serving benchmark: tandem (edge + broker + hybrid worker) vs mlx_lm.server, one run, one client.

For each concurrency level N, N clients each send ``--rounds`` streaming chat requests
back to back (prompts of about ``--prompt-tokens`` tokens under the chat template,
``--max-tokens`` new tokens, temperature 0, EOS suppressed with a -100 logit bias on
every EOS id, which both servers honour). Measured per level: aggregate generated
tokens per second over the level's wall time, time to first token (mean, p95),
inter-token latency (mean gap between streamed tokens; p95), errors (non-200,
broken streams, or fewer tokens than asked), and the CPU seconds each server process
group (tandem: broker, worker, edge with its gunicorn workers) and this client used
during the level: on a 2-core machine every process competes with the model's threads.

The servers run one after the other on the same machine (never both at once), on the
same model: tandem with ``--weights auto`` by default (what ``tandem serve`` runs: on the
CPU a 4-bit checkpoint stays packed), mlx_lm.server on a dequantized float32 copy (its
fastest CPU format: MLX's quantized CPU products are ~5x slower), under a Python that
imports tandem first, so both use MKL.

    .venv/bin/python bench/serving.py                      # full sweep, default model
    .venv/bin/python bench/serving.py --concurrency 1,4 --rounds 1 --servers tandem
    .venv/bin/python bench/serving.py --servers tandem,llama --concurrency 1,16 --baseline main

``--baseline REF`` also serves tandem as of git REF (its ``tandem/`` unpacked to a temp dir
and put first on the processes' PYTHONPATH), right after this tree's, with the same
prompts; the ratio columns then compare this tree with it as well as with the peers.

Writes docs/benchmarks/serving.md and serving.json, and the charts serving.svg (aggregate
tok/s per level) and serving-ttft.svg (TTFT p95 per level); ``--out`` changes the stem.
``--replot`` rewrites the report and redraws the two charts from an existing ``<stem>.json`` without running servers:

    .venv/bin/python bench/serving.py --replot

Loopback only.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import select
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import tandem  # noqa: F401  (BLAS before mlx)
from _common import bar_chart_svg, baseline_tree, http_body_chunks, sse_data  # noqa: E402  (bench/ is first on sys.path when run as a script)
import llama_server  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
HOST = "127.0.0.1"
CORPUS = (
    "The history of the river valley begins with the first farmers who cleared the forests, drained the marshes, "
    "and built low stone walls to mark their fields. Over the centuries the villages grew into market towns, the "
    "towns were linked by roads and canals, and merchants carried grain, wool, timber and salt to the coast. Wars, "
    "floods and plagues emptied some settlements and enriched others; monasteries kept records of harvests and "
    "prices; engineers later straightened the river, and railways replaced the barges. "
)


# ---------------------------------------------------------------- processes -------------

class Server:
    def __init__(self, name: str, args: list[str], log: Path, env: dict, stdout_to_log: bool = False):
        self.name = name
        self.log = log
        self._err = open(log, "ab")
        # In the run's temp dir, not the repository: `python -m` puts the working directory first
        # on sys.path, ahead of PYTHONPATH, so a --baseline tree's tandem was shadowed by this one.
        self.p = subprocess.Popen(args, stdout=self._err if stdout_to_log else subprocess.PIPE, stderr=self._err,
                                  env=env, start_new_session=True, cwd=log.parent)

    def ready_line(self, timeout: float = 300.0) -> dict:
        deadline, buf = time.monotonic() + timeout, b""
        while time.monotonic() < deadline:
            if self.p.poll() is not None:
                raise RuntimeError(f"{self.name} exited: {self.log.read_text()[-2000:]}")
            if select.select([self.p.stdout], [], [], 0.2)[0]:
                buf += os.read(self.p.stdout.fileno(), 65536)
                for line in buf.split(b"\n"):
                    if line.startswith(b"{") and b'"ready"' in line:
                        return json.loads(line)
        raise TimeoutError(f"{self.name} not ready: {self.log.read_text()[-2000:]}")

    def stop(self) -> None:
        try:
            os.killpg(self.p.pid, signal.SIGTERM)
            self.p.wait(15)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            try:
                os.killpg(self.p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.p.wait(5)
        self._err.close()


def stat_fields(path: str) -> list[str] | None:
    """The fields of a ``/proc/<pid>[/task/<tid>]/stat`` after the command name (state,
    ppid, pgrp, ...), or None when the process is gone."""
    try:
        return Path(path).read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None


def stat_cpu_s(fields: list[str]) -> float:
    """User + system CPU seconds from :func:`stat_fields`."""
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def group_cpu_s(pgid: int) -> float:
    """User + system CPU seconds of every live process in process group ``pgid`` (a
    server started in its own session, with its children: gunicorn's workers)."""
    total = 0.0
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (fields := stat_fields(f"/proc/{entry}/stat")) is not None and int(fields[2]) == pgid:
            total += stat_cpu_s(fields)
    return total


def prefill_blas() -> str:
    """What tandem's CPU prefill products run on (tandem._blas.openblas_sgemm: numpy's
    OpenBLAS, unless TANDEM_PREFILL_BLAS or the numpy build says otherwise)."""
    from tandem import _blas

    if _blas.openblas_sgemm() is None:
        return f"mlx with {tandem.BLAS}"
    return f"numpy's bundled OpenBLAS ({_blas.openblas_core()} kernels), one single-threaded call per core"


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def wait_http(port: int, path: str, timeout: float = 300.0, ok=lambda status, body: status == 200,
              server: Server | None = None) -> None:
    """Poll until ``path`` answers; with ``server``, fail as soon as its process exits."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server is not None and server.p.poll() is not None:
            raise RuntimeError(f"{server.name} exited with {server.p.returncode}: {server.log.read_text()[-2000:]}")
        try:
            status, body = asyncio.run(http_get(port, path))
            if ok(status, body):
                return
        except OSError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"127.0.0.1:{port}{path} did not come up")


def start_tandem(model: Path, weights: str, parallel: int, edge_workers: int, tmp: Path, env: dict,
                 engine: str = "mlx", stub_step_ms: float = 5.0, topology: str = "hybrid") -> tuple[list[Server], int]:
    py = [sys.executable, "-m", "tandem.cli"]
    secret = tmp / "cluster.secret"
    secret.write_text(os.urandom(32).hex())
    secret.chmod(0o600)
    procs = []
    broker = Server("broker", py + ["broker", *sum((["--" + k, f"tcp://{HOST}:*"] for k in ("frontend", "backend", "stream-in", "stream-out", "stats")), []),
                                    "--cluster-secret-file", str(secret)], tmp / "broker.log", env)
    procs.append(broker)
    ends = broker.ready_line()
    for role in (("hybrid",) if topology == "hybrid" else ("decode", "prefill")):
        # The stub: the same worker command with tests/stub_engine.py's model-free engine.
        run = ([sys.executable, "-m", "tests.stub_engine", "--stub-step-ms", str(stub_step_ms)]
               if engine == "stub" else py)
        worker = Server(role, run + ["worker", "--role", role, "--model", str(model), "--weights", weights,
                                     "--parallel", str(parallel), "--broker-backend", ends["backend"],
                                     "--broker-stream", ends["stream_in"], "--cluster-secret-file", str(secret)],
                        tmp / f"worker-{role}.log",
                        dict(env, PYTHONPATH=os.pathsep.join(filter(None, (str(ROOT), env.get("PYTHONPATH")))))
                        if engine == "stub" else env)
        procs.append(worker)
        worker.ready_line()
    port = free_port()
    edge = Server("edge", py + ["edge", "--bind", f"{HOST}:{port}", "--workers", str(edge_workers), "--model", str(model),
                                "--broker", ends["frontend"], "--broker-stream", ends["stream_out"],
                                "--cluster-secret-file", str(secret)], tmp / "edge.log", env)
    procs.append(edge)
    edge.ready_line()
    wait_http(port, "/ready")
    return procs, port


def dense_copy(model: Path, out: Path) -> Path:
    """A float32 dequantized copy of ``model`` (what tandem's worker runs with --weights dense)."""
    from mlx_lm.utils import save_config, save_model

    from tandem.pipeline.loader import load_model

    loaded = load_model(model, "dense")
    out.mkdir(parents=True, exist_ok=True)
    save_model(out, loaded.model)
    config = dict(loaded.config)
    config.pop("quantization", None)
    config.pop("quantization_config", None)
    save_config(config, out / "config.json")
    for f in model.iterdir():
        if f.name.startswith("tokenizer") or f.name in ("special_tokens_map.json", "generation_config.json", "chat_template.jinja"):
            shutil.copy(f, out / f.name)
    return out


def start_mlx_lm(model_dir: Path, tmp: Path, env: dict) -> tuple[list[Server], int]:
    port = free_port()
    # Import tandem first: its MKL preload gives mlx_lm.server the same BLAS as tandem, and
    # its malloc settings (tandem._malloc) the same allocator behaviour.
    code = ("import tandem, runpy, sys; "
            f"sys.argv = ['mlx_lm.server', '--model', {str(model_dir)!r}, '--host', '{HOST}', '--port', '{port}', '--log-level', 'WARNING']; "
            "runpy.run_module('mlx_lm.server', run_name='__main__')")
    server = Server("mlx_lm.server", [sys.executable, "-c", code], tmp / "mlx_lm_server.log", env)
    wait_http(port, "/v1/models")
    return [server], port


def start_llama_server(tmp: Path, env: dict) -> tuple[list[Server], int]:
    port = free_port()
    server = Server("llama-server", llama_server.command(port, HOST, llama_server.gguf()), tmp / "llama_server.log",
                    env, stdout_to_log=True)
    wait_http(port, "/health", server=server)
    return [server], port


# ---------------------------------------------------------------- client ----------------

@dataclass
class Sample:
    ok: bool
    ttft: float = 0.0
    gaps: list[float] = field(default_factory=list)
    tokens: int = 0
    error: str = ""

    @property
    def decode_tok_s(self) -> float:
        """Tokens after the first over the time from the first content chunk to the last (a
        chunk may carry several tokens: speculative decoding's accepted drafts)."""
        span = sum(self.gaps)
        return (self.tokens - 1) / span if span > 0 and self.tokens > 1 else float("nan")


async def http_get(port: int, path: str) -> tuple[int, bytes]:
    reader, writer = await asyncio.open_connection(HOST, port)
    try:
        writer.write(f"GET {path} HTTP/1.1\r\nHost: {HOST}\r\nConnection: close\r\n\r\n".encode())
        await writer.drain()
        data = await asyncio.wait_for(reader.read(), 10)
    finally:
        writer.close()
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), body


async def stream_chat(port: int, body: dict, timeout: float) -> Sample:
    payload = json.dumps(body).encode()
    t0 = time.perf_counter()
    try:
        reader, writer = await asyncio.open_connection(HOST, port)
    except OSError as exc:
        return Sample(False, error=f"connect: {exc}")
    try:
        writer.write(f"POST /v1/chat/completions HTTP/1.1\r\nHost: {HOST}\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {len(payload)}\r\nConnection: close\r\n\r\n".encode() + payload)
        await writer.drain()
        async with asyncio.timeout(timeout):
            status_line = await reader.readline()
            headers = {}
            while (line := await reader.readline()) not in (b"\r\n", b"\n", b""):
                k, _, v = line.decode().partition(":")
                headers[k.strip().lower()] = v.strip()
            status = int(status_line.split()[1])
            if status != 200:
                rest = b"".join([c async for c in http_body_chunks(reader, headers)])
                return Sample(False, error=f"HTTP {status}: {rest[:200]!r}")
            first, stamps, usage, done = None, [], None, False
            async for payload in sse_data(reader, headers):
                if payload == b"[DONE]":
                    done = True
                    continue
                chunk = json.loads(payload)
                if "error" in chunk:
                    return Sample(False, error=f"stream error: {chunk['error'].get('message')}")
                usage = chunk.get("usage") or usage
                for choice in chunk.get("choices") or []:
                    if (choice.get("delta") or {}).get("content"):
                        now = time.perf_counter()
                        first = first or now
                        stamps.append(now)
        if not done or first is None:
            return Sample(False, error="stream ended without [DONE]" if not done else "no content")
        tokens = int(usage["completion_tokens"]) if usage else len(stamps)
        return Sample(True, ttft=first - t0, gaps=[b - a for a, b in zip(stamps, stamps[1:])], tokens=tokens)
    except (OSError, asyncio.IncompleteReadError, TimeoutError, ValueError) as exc:
        return Sample(False, error=f"{type(exc).__name__}: {exc}")
    finally:
        writer.close()


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, int(round(q * (len(s) - 1))))]


async def run_level(port: int, bodies: list[dict], clients: int, rounds: int, max_tokens: int, timeout: float,
                    groups: dict[str, int] | None = None) -> dict:
    """One level; ``groups`` (name -> process group) are the server's processes whose CPU
    seconds during the level go into the row, next to this client's own."""
    samples: list[Sample] = []
    groups = groups or {}
    cpu0 = {name: group_cpu_s(g) for name, g in groups.items()}
    client0 = time.process_time()

    async def client(i: int) -> None:
        for r in range(rounds):
            s = await stream_chat(port, bodies[(i * rounds + r) % len(bodies)], timeout)
            if s.ok and s.tokens < max_tokens:
                s = Sample(False, error=f"only {s.tokens} of {max_tokens} tokens")
            samples.append(s)

    t0 = time.perf_counter()
    await asyncio.gather(*(client(i) for i in range(clients)))
    wall = time.perf_counter() - t0
    cpu = {name: group_cpu_s(g) - cpu0[name] for name, g in groups.items()}
    cpu["client"] = time.process_time() - client0
    good = [s for s in samples if s.ok]
    ttfts = [s.ttft for s in good]
    gaps = [g for s in good for g in s.gaps]
    itl = [(sum(s.gaps) / len(s.gaps)) for s in good if s.gaps]
    errors = [s.error for s in samples if not s.ok]
    return {
        "clients": clients,
        "requests": len(samples),
        "errors": len(errors),
        "error_examples": errors[:3],
        "wall_s": wall,
        "tokens": sum(s.tokens for s in good),
        "tok_per_s": sum(s.tokens for s in good) / wall if wall else 0.0,
        "ttft_mean_s": statistics.fmean(ttfts) if ttfts else float("nan"),
        "ttft_p95_s": pct(ttfts, 0.95),
        "itl_mean_ms": 1000 * statistics.fmean(itl) if itl else float("nan"),
        "itl_p95_ms": 1000 * pct(gaps, 0.95),
        "decode_tok_s": statistics.fmean(d) if (d := [s.decode_tok_s for s in good if s.gaps]) else float("nan"),
        "cpu_s": cpu,
    }


# ---------------------------------------------------------------- workload --------------

def build_bodies(model: Path, prompt_tokens: int, max_tokens: int, count: int) -> tuple[list[dict], int]:
    from tandem.http.tokenizer import load_tokenizer

    tok = load_tokenizer(model)
    bodies, lengths = [], []
    words = CORPUS.split()
    for i in range(count):
        # Distinct from the first word on, so no request reuses another's prompt beyond the template.
        text, k = f"Request {i}: summarise this passage.", i * 7
        while True:
            candidate = text + " " + words[k % len(words)]
            messages = [{"role": "user", "content": candidate}]
            if len(tok.apply_chat_template(messages)) > prompt_tokens:
                break
            text, k = candidate, k + 1
        messages = [{"role": "user", "content": text}]
        lengths.append(len(tok.apply_chat_template(messages)))
        bias = {str(t): -100 for t in sorted(tok.eos_token_ids | tok.special_ids)}
        bodies.append({"messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True,
                       "stream_options": {"include_usage": True}, "logit_bias": bias})
    return bodies, round(statistics.fmean(lengths))


def sweep(name: str, port: int, model_id: str, bodies: list[dict], levels: list[int], rounds: int,
          max_tokens: int, timeout: float, groups: dict[str, int] | None = None) -> list[dict]:
    bodies = [dict(b, model=model_id) for b in bodies]
    asyncio.run(run_level(port, bodies[-1:], 1, 1, max_tokens, timeout))  # warm-up, not measured
    rows = []
    offset = 0
    for n in levels:
        # Each level gets prompts the server has not seen: reusing the earlier levels'
        # would let both servers' prompt caches skip prefills (docs/benchmarks/
        # serving-sweep-16: mlx_lm.server's 16-client level ran at 81 tok/s, TTFT p95
        # 5.6 s, against 71-72 tok/s and 7.2-7.6 s with fresh prompts).
        level_bodies = bodies[offset: offset + n * rounds]
        offset += n * rounds
        row = asyncio.run(run_level(port, level_bodies, n, rounds, max_tokens, timeout, groups))
        row["server"] = name
        rows.append(row)
        print(f"  {name:14s} {n:3d} clients: {row['tok_per_s']:7.1f} tok/s  TTFT mean {row['ttft_mean_s']:.2f} s "
              f"p95 {row['ttft_p95_s']:.2f} s  ITL {row['itl_mean_ms']:.1f} ms  errors {row['errors']}  CPU s "
              + " ".join(f"{k} {v:.2f}" for k, v in row["cpu_s"].items()), flush=True)
    return rows


# ---------------------------------------------------------------- report ----------------

COLORS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd")


def server_names(results: dict) -> list[str]:
    """The servers of a run in the order they ran (tandem's formats first)."""
    names: list[str] = []
    for row in results["rows"]:
        if row["server"] not in names:
            names.append(row["server"])
    return names


def reference(names: list[str]) -> tuple[str | None, list[str]]:
    """The tandem row ratios are taken for (its first format) and the peers (a baseline
    tree's tandem among them)."""
    ours = next((n for n in names if n.startswith("tandem")), None)
    return ours, [n for n in names if not n.startswith("tandem") or (n != ours and not n.startswith("tandem ("))]


def chart_names(out: Path) -> tuple[str, str]:
    """File names of the tok/s and TTFT charts next to ``<out>.md`` (linked relative to it)."""
    return f"{out.name}.svg", f"{out.name}-ttft.svg"


def plots(results: dict, out: Path) -> None:
    """Write the tok/s chart (annotated tandem / mlx_lm.server where both ran) and the TTFT p95 chart."""
    by: dict[int, dict[str, dict]] = {}
    for row in results["rows"]:
        by.setdefault(row["clients"], {})[row["server"]] = row
    levels = sorted(by)
    names = server_names(results)
    ran = list(zip(names, COLORS))
    groups = [f"{n} client{'s' if n != 1 else ''}" for n in levels]
    ours, peers = reference(names)

    def series(key: str) -> list[tuple[str, str, list[float | None]]]:
        return [(name, color, [by[n][name][key] if name in by[n] else None for n in levels]) for name, color in ran]

    ratios = []
    for n in levels:
        a = by[n].get(ours)
        ratios.append(" ".join(f"{a['tok_per_s'] / by[n][p]['tok_per_s']:.2f}x" for p in peers
                               if a and p in by[n] and by[n][p]["tok_per_s"]))
    model = results["meta"]["model"]
    tok_svg, ttft_svg = chart_names(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    (out.parent / tok_svg).write_text(bar_chart_svg(
        f"aggregate streamed tok/s per concurrency level ({model})", groups, series("tok_per_s"),
        ratios if any(ratios) else None, y_label="tok/s"))
    (out.parent / ttft_svg).write_text(bar_chart_svg(
        f"time to first token, p95, per concurrency level ({model})", groups, series("ttft_p95_s"),
        y_label="seconds (lower is better)"))

def report(results: dict, out: Path) -> str:
    by = {}
    for row in results["rows"]:
        by.setdefault(row["clients"], {})[row["server"]] = row
    servers = server_names(results)
    ours, peers = reference(servers)
    others = [s for s in servers if s != ours] if ours else []
    head = "| clients | " + " | ".join(f"{s} tok/s | {s} TTFT mean / p95 (s) | {s} ITL mean / p95 (ms) | {s} errors" for s in servers)
    head += "".join(f" | tok/s {ours} / {p} | TTFT p95 {ours} / {p}" for p in others)
    lines = [head + " |", "|" + "---|" * (head.count("|"))]
    for n in sorted(by):
        cells = [str(n)]
        for s in servers:
            r = by[n].get(s)
            cells += ["-"] * 4 if r is None else [f"{r['tok_per_s']:.1f}", f"{r['ttft_mean_s']:.2f} / {r['ttft_p95_s']:.2f}",
                                                  f"{r['itl_mean_ms']:.1f} / {r['itl_p95_ms']:.1f}", f"{r['errors']}/{r['requests']}"]
        for p in others:
            a, b = by[n].get(ours), by[n].get(p)
            cells.append(f"{a['tok_per_s'] / b['tok_per_s']:.2f}x" if a and b and b["tok_per_s"] else "-")
            cells.append(f"{a['ttft_p95_s'] / b['ttft_p95_s']:.2f}x" if a and b and b["ttft_p95_s"] else "-")
        lines.append("| " + " | ".join(cells) + " |")
    table = "\n".join(lines)
    # A server whose chunks all arrive together (mlx_lm.server here: ITL ~0) has no
    # per-request decode speed to read off its stream.
    per_request = [f"{s} {by[1][s]['decode_tok_s']:.0f}" if by[1][s]["itl_mean_ms"] >= 0.5
                   else f"{s} - (its chunks arrive together)" for s in servers if 1 in by and s in by[1]
                   and by[1][s].get("decode_tok_s", float("nan")) == by[1][s].get("decode_tok_s")]
    if per_request:
        table += "\n\nPer-request decode speed at 1 client (tokens after the first / first to last token, mean over requests, tok/s): " + ", ".join(per_request) + "."
    if meta_skipped := results["meta"].get("skipped"):
        table += "\n\nNot run: " + "; ".join(meta_skipped) + "."
    cpu_rows = [r for n in sorted(by) for r in by[n].values() if r.get("cpu_s")]
    if cpu_rows:
        table += ("\n\nCPU seconds each process group used during the level (user + system, all threads and "
                  "children; client = this benchmark's own process; the machine has "
                  f"{os.cpu_count()} cores, so a level of W seconds offers {os.cpu_count()} x W):\n\n"
                  "| clients | server | wall s | CPU s per process |\n|---|---|---|---|\n")
        table += "\n".join(f"| {r['clients']} | {r['server']} | {r['wall_s']:.2f} | "
                            + ", ".join(f"{k} {v:.2f}" for k, v in r["cpu_s"].items()) + " |" for r in cpu_rows)
    meta = results["meta"]
    stub = meta["engine"] == "stub"
    md = [
        "# Serving benchmark: the edge + broker path (model-free stub engine)" if stub
        else "# Serving benchmark: tandem vs " + ", ".join(n for n in server_names(results) if not n.startswith("tandem")),
        "",
        f"Produced by `{meta['command']}` on {meta['date']} ({meta['machine']}).",
        "",
        f"![aggregate tok/s per concurrency level]({chart_names(out)[0]}) "
        f"![TTFT p95 per concurrency level]({chart_names(out)[1]})",
        "",
        (f"Tokenizer of `{meta['model']}`; the worker runs the model-free stub engine (tests/stub_engine.py), so this measures what the "
         f"edge, broker and wire add per token: at {meta.get('stub_step_ms')} ms per engine step the ceiling is "
         f"clients x {1000 / (meta.get('stub_step_ms') or 1):.0f} tok/s. " if stub else
         f"Model `{meta['model']}` (tandem --weights {meta['weights']}, speculative decoding "
         f"{meta.get('speculative', 'as configured')}; mlx_lm.server on "
         f"{'a dequantized fp32 copy' if meta.get('mlx_lm_dense') or 'dense' in meta['weights'].split(',') else 'the checkpoint as stored'}, "
         f"BLAS {meta['blas']}; on the CPU "
         "tandem's decode multiplies the same values from the checkpoint's 4-bit codes, "
         "engine.native_kernels, and its prefill products run through "
         f"{meta.get('prefill_blas', 'the same BLAS')}, docs/cpu-performance.md; llama-server: llama.cpp built from the "
         f"llama-cpp-python sdist, `{' '.join(llama_server.ARGS)}`, on the Q4_1 GGUF the default model is converted from). ")
        + "Chat prompts of "
        f"{meta['prompt_tokens']} tokens on average, {meta['max_tokens']} new tokens, temperature 0, EOS suppressed "
        f"(logit bias -100), {meta['rounds']} request(s) per client per level, every level's prompts new to the server, "
        "streaming, the same client for every server. "
        f"tandem: broker + {'one hybrid worker' if meta.get('topology', 'hybrid') == 'hybrid' else 'one prefill + one decode worker'} "
        f"(parallel {meta['parallel']}) + edge ({meta['edge_workers']} gunicorn worker(s)). "
        "The servers ran one after the other, never together. 1-minute load average when each started "
        "(the second one's includes the first server's own, just ended, sweep): "
        + ", ".join(f"{k} {v:.1f}" for k, v in meta["load_average_at_start"].items())
        + (" (other work was running on the machine: absolute numbers are low, compare the ratios)."
           if next(iter(meta["load_average_at_start"].values()), 0.0) > 1.0 else "."),
        "",
        "tok/s: generated tokens of successful requests / wall time of the level. TTFT: request sent to first content "
        "token. ITL: mean gap between streamed tokens per request (mean over requests) / p95 over all gaps. "
        "Ratios are the first tandem row over each other server (higher tok/s is better, lower TTFT is better).",
        "",
        table,
        "",
    ]
    text = "\n".join(md)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".md").write_text(text)
    out.with_suffix(".json").write_text(json.dumps(results, indent=1))
    plots(results, out)
    return table


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="mlx-lm model directory (default: tandem's default model)")
    p.add_argument("--weights", default="auto",
                   help="tandem's weight format(s), a comma list of auto, dense, quantized: tandem runs once per "
                        "format, in this order (mlx_lm.server always gets a dense float32 copy)")
    p.add_argument("--speculative", default="",
                   help="tandem's speculative decoding mode(s), a comma list of off, ngram, draft:PATH: tandem runs once "
                        "per mode and weight format (default: the configured one)")
    p.add_argument("--concurrency", default="1,2,4,8,16,32")
    p.add_argument("--rounds", type=int, default=1, help="requests per client per level")
    p.add_argument("--prompt-tokens", type=int, default=170)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--parallel", type=int, default=32, help="tandem engine: maximum active sequences")
    p.add_argument("--edge-workers", type=int, default=1)
    p.add_argument("--topology", choices=("hybrid", "split"), default="hybrid",
                   help="tandem workers: one hybrid, or one prefill + one decode (KV handoff)")
    p.add_argument("--servers", default="tandem,mlx_lm,llama", help="comma list of tandem, mlx_lm, llama "
                   "(llama.cpp's llama-server, when built: --build-llama-server)")
    p.add_argument("--build-llama-server", action="store_true",
                   help="build llama-server from the llama-cpp-python sdist first if it is not built (~10 min)")
    p.add_argument("--engine", choices=("mlx", "stub"), default="mlx",
                   help="stub: a model-free engine (tests/stub_engine.py), to measure the edge+broker path alone (tandem only)")
    p.add_argument("--stub-step-ms", type=float, default=5.0, help="stub engine: time per step")
    p.add_argument("--baseline", metavar="GIT_REF",
                   help="also serve tandem as of this git ref (e.g. main), right after this tree's")
    p.add_argument("--timeout", type=float, default=900.0, help="per-request limit in seconds")
    p.add_argument("--out", default=str(ROOT / "docs" / "benchmarks" / "serving"))
    p.add_argument("--replot", action="store_true",
                   help="only rewrite the report and redraw the charts from the existing <out>.json (runs no servers)")
    args = p.parse_args()
    if args.replot:
        out = Path(args.out)
        source = out.with_suffix(".json")
        if not source.exists():
            raise SystemExit(f"--replot: {source} does not exist; run the benchmark first or point --out at its stem")
        report(json.loads(source.read_text()), out)
        print(f"wrote {out.with_suffix('.md')}, {chart_names(out)[0]} and {chart_names(out)[1]} from {source}")
        return 0

    from tandem.pipeline.model_store import resolve_model

    model = resolve_model(args.model).resolve()
    levels = [int(x) for x in args.concurrency.split(",")]
    servers = [s.strip() for s in args.servers.split(",") if s.strip()]
    formats = [w.strip() for w in args.weights.split(",") if w.strip()]
    if unknown := [w for w in formats if w not in ("auto", "dense", "quantized")] or [
            s for s in servers if s not in ("tandem", "mlx_lm", "llama")]:
        raise SystemExit(f"unknown --weights or --servers entries: {', '.join(unknown)}")
    if args.engine == "stub":
        servers = [s for s in servers if s == "tandem"]
    skipped = []
    if "llama" in servers and llama_server.binary() is None:
        if args.build_llama_server:
            llama_server.build()
        else:
            print(llama_server.why_absent(), flush=True)
            skipped.append(llama_server.why_absent())
            servers.remove("llama")
    bodies, mean_len = build_bodies(model, args.prompt_tokens, args.max_tokens, sum(levels) * args.rounds + 1)
    env = dict(os.environ, PYTHONUNBUFFERED="1", TANDEM_ENGINE_MAX_QUEUE_DEPTH="1024")
    if tandem.OPENBLAS_REPLACED:
        # The servers start from the environment as it was (this process's import of tandem
        # replaced it): each tandem, a --baseline tree's included, makes its own choice.
        env["OPENBLAS_CORETYPE"] = tandem.OPENBLAS_REPLACED
    for name in ("PROMETHEUS_MULTIPROC_DIR", "TANDEM_CLUSTER_SECRET", "TANDEM_CLUSTER_SECRET_FILE"):
        env.pop(name, None)
    tmp = Path(tempfile.mkdtemp(prefix="tandem-bench-serving-"))
    rows: list[dict] = []
    load: dict[str, float] = {}
    print(f"model {model.name} ({args.weights}), prompts ~{mean_len} tokens, {args.max_tokens} new, levels {levels}", flush=True)
    modes = [m.strip() for m in args.speculative.split(",") if m.strip()] or [None]
    runs = [("tandem" + "".join(f" ({x})" for x in (fmt if len(formats) > 1 else None, mode if len(modes) > 1 else None) if x),
             fmt, env if mode is None else dict(env, TANDEM_SPECULATIVE_MODE=mode))
            for fmt in formats for mode in modes]
    base_src = None
    if args.baseline and "tandem" in servers:
        base_src = baseline_tree(args.baseline)
        runs.append((f"tandem {args.baseline}", formats[0],
                     dict(env, PYTHONPATH=os.pathsep.join(filter(None, (str(base_src), env.get("PYTHONPATH")))))))
    try:
        for name, fmt, run_env in runs if "tandem" in servers else []:
            load[name] = os.getloadavg()[0]
            procs, port = start_tandem(model, fmt, args.parallel, args.edge_workers, tmp, run_env,
                                       args.engine, args.stub_step_ms, args.topology)
            try:
                model_id = json.loads(asyncio.run(http_get(port, "/v1/models"))[1])["data"][0]["id"]
                groups = {proc.name: proc.p.pid for proc in procs}  # each in its own session
                rows += sweep(name, port, model_id, bodies, levels, args.rounds, args.max_tokens, args.timeout, groups)
            finally:
                for proc in reversed(procs):
                    proc.stop()
        if "llama" in servers:
            load["llama-server"] = os.getloadavg()[0]
            procs, port = start_llama_server(tmp, env)
            try:
                rows += sweep("llama-server", port, "default_model", bodies, levels, args.rounds, args.max_tokens,
                              args.timeout, {proc.name: proc.p.pid for proc in procs})
            finally:
                for proc in procs:
                    proc.stop()
        if "mlx_lm" in servers:
            load["mlx_lm.server"] = os.getloadavg()[0]
            served = dense_copy(model, tmp / "dense")
            procs, port = start_mlx_lm(served, tmp, env)
            try:
                rows += sweep("mlx_lm.server", port, "default_model", bodies, levels, args.rounds, args.max_tokens,
                              args.timeout, {proc.name: proc.p.pid for proc in procs})
            finally:
                for proc in procs:
                    proc.stop()
    finally:
        logs = sorted(tmp.glob("*.log"))
        if any(r["errors"] for r in rows):
            for log in logs:
                print(f"== {log.name}\n{log.read_text()[-1500:]}", file=sys.stderr)
        shutil.rmtree(tmp, ignore_errors=True)
        if base_src is not None:
            shutil.rmtree(base_src, ignore_errors=True)
    results = {
        "meta": {
            "command": "python bench/serving.py " + " ".join(sys.argv[1:]),
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, {platform.system()}",
            "model": model.name, "weights": args.weights, "mlx_lm_dense": True,
            "speculative": args.speculative or "as configured",
            "blas": tandem.BLAS,
            "prefill_blas": prefill_blas(),
            "prompt_tokens": mean_len, "max_tokens": args.max_tokens, "rounds": args.rounds,
            "parallel": args.parallel, "edge_workers": args.edge_workers, "topology": args.topology, "engine": args.engine,
            "stub_step_ms": args.stub_step_ms if args.engine == "stub" else None,
            "load_average_at_start": load, "baseline": args.baseline,
            "skipped": skipped,
        },
        "rows": rows,
    }
    print(report(results, Path(args.out)))
    return 1 if any(r["errors"] for r in rows if r["clients"] <= 32) else 0


if __name__ == "__main__":
    sys.exit(main())
