"""The chaos run's cluster: the whole stack on loopback under one supervisor, with every
broker link of every process through a proxy the run can cut.

Processes: broker, 2 prefill + 2 decode workers, the edge (gunicorn arbiter + 2 workers),
each started with the same argv as ``tandem serve`` would give it, restarted by
:class:`tandem.supervisor.Supervisor` when it dies. Each worker reaches the broker's
backend and stream sockets, and the edge its frontend and stream, through a TCP proxy of
its own (:class:`Link`), so "cut the link of decode-1" drops exactly that process's
connections and refuses new ones until it is restored, as a pulled cable would.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import sys
import time
import urllib.request
from pathlib import Path

from tandem.supervisor import ChildSpec, Supervisor

HOST = "127.0.0.1"


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


class Link:
    """A TCP proxy ``listen -> target`` that can be cut (every connection dropped, new ones
    refused) and restored on the same port."""

    def __init__(self, name: str, target: int):
        self.name = name
        self.target = target
        self.port = free_port()
        self._server: asyncio.AbstractServer | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self.cut_until = 0.0

    async def up(self) -> None:
        self._server = await asyncio.start_server(self._serve, HOST, self.port, reuse_address=True)

    async def cut(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None
        for w in list(self._writers):
            w.transport.abort()
        self._writers.clear()

    @property
    def is_cut(self) -> bool:
        return self._server is None

    async def _serve(self, reader, writer) -> None:
        try:
            up_r, up_w = await asyncio.open_connection(HOST, self.target)
        except OSError:
            writer.transport.abort()
            return
        self._writers |= {writer, up_w}

        async def pump(r, w):
            try:
                while data := await r.read(1 << 16):
                    w.write(data)
                    await w.drain()
            except (OSError, asyncio.CancelledError):
                pass
            finally:
                w.transport.abort()
                self._writers.discard(w)

        try:
            await asyncio.gather(pump(reader, up_w), pump(up_r, writer))
        except asyncio.CancelledError:
            pass


def write_configs(tmp: Path, *, decode_kv_budget: str, transfer_timeout_s: float) -> tuple[Path, Path]:
    """Two TOML files: one for the broker, edge and prefill workers, one for the decode
    workers (the same plus a small KV pool, so a burst of long requests fills it)."""
    common = f"""
[engine]
parallel = 8
prefill_chunk_size = 64
max_batch_prefill = 4

[broker]
heartbeat_interval_ms = 500
heartbeat_liveness = 4
stats_verbose = true
queue_timeout_s = 20.0
failover_wait_s = 20.0

[worker]
transfer_timeout_s = {transfer_timeout_s}
stall_timeout_s = 20.0
drain_grace_s = 5.0

[edge]
workers = 2
request_timeout_s = 40.0
keepalive_s = 1.0
graceful_timeout_s = 5
"""
    a, b = tmp / "common.toml", tmp / "decode.toml"
    a.write_text(common)
    b.write_text(common.replace("[engine]\n", f'[engine]\nkv_cache_budget = "{decode_kv_budget}"\n'))
    return a, b


class Stack:
    """The supervised processes, their links, and what the run asks of them (pids, RSS,
    the broker's stats)."""

    WORKERS = ("prefill-0", "prefill-1", "decode-0", "decode-1")

    def __init__(self, tmp: Path, model: Path, *, log, decode_kv_budget: str = "1MiB", transfer_timeout_s: float = 4.0):
        self.tmp = tmp
        self.model = model
        self.secret = tmp / "cluster.secret"
        self.secret.write_text(os.urandom(32).hex())
        self.secret.chmod(0o600)
        self.ports = {k: free_port() for k in ("frontend", "backend", "stream_in", "stream_out", "stats")}
        self.http_port = free_port()
        self.kv_ports = {f"decode-{i}": free_port() for i in range(2)}
        self.links: dict[str, list[Link]] = {}
        for name in self.WORKERS:
            self.links[name] = [Link(name, self.ports["backend"]), Link(name, self.ports["stream_in"])]
        self.links["edge"] = [Link("edge", self.ports["frontend"]), Link("edge", self.ports["stream_out"])]
        common, decode = write_configs(tmp, decode_kv_budget=decode_kv_budget, transfer_timeout_s=transfer_timeout_s)
        self.sup = Supervisor(self._specs(common, decode), max_restarts=10_000, restart_window_s=60.0, out=log)

    def addr(self, key: str) -> str:
        return f"tcp://{HOST}:{self.ports[key]}"

    def _specs(self, common: Path, decode: Path) -> list[ChildSpec]:
        py = [sys.executable, "-m", "tandem.cli"]
        sec = ["--cluster-secret-file", str(self.secret)]
        specs = [ChildSpec("broker", py + ["broker", "--config", str(common), *sec] + sum(
            (["--" + k.replace("_", "-"), self.addr(k)] for k in self.ports), []), stop_grace_s=5.0)]
        for name in self.WORKERS:
            role = name.split("-")[0]
            back, stream = self.links[name]
            argv = py + ["worker", "--role", role, "--name", name, "--model", str(self.model), *sec,
                         "--config", str(decode if role == "decode" else common),
                         "--broker-backend", f"tcp://{HOST}:{back.port}", "--broker-stream", f"tcp://{HOST}:{stream.port}"]
            if role == "decode":
                argv += ["--kv-bind", f"tcp://{HOST}:{self.kv_ports[name]}"]
            specs.append(ChildSpec(name, argv, stop_grace_s=5.0))
        front, stream = self.links["edge"]
        specs.append(ChildSpec("edge", py + ["edge", "--config", str(common), "--bind", f"{HOST}:{self.http_port}",
                                             "--model", str(self.model), *sec, "--broker", f"tcp://{HOST}:{front.port}",
                                             "--broker-stream", f"tcp://{HOST}:{stream.port}"], stop_grace_s=8.0))
        return specs

    async def start(self, timeout_s: float = 300.0) -> None:
        for links in self.links.values():
            for link in links:
                await link.up()
        deadline = time.monotonic() + timeout_s
        for child in self.sup.children:
            await asyncio.to_thread(self.sup.start, child, max(1.0, deadline - time.monotonic()))
        await self.wait_healthy(deadline - time.monotonic())

    def child(self, name: str):
        return next(c for c in self.sup.children if c.spec.name == name)

    def pid(self, name: str) -> int | None:
        c = self.child(name)
        return c.proc.pid if c.proc is not None and c.poll() is None else None

    def edge_arbiter(self) -> int | None:
        """Pid of gunicorn's arbiter, the child of the ``tandem edge`` process."""
        edge = self.pid("edge")
        return next((p for p, ppid in _parents().items() if ppid == edge), None) if edge else None

    def edge_workers(self) -> list[int]:
        """Pids of the gunicorn workers under the edge's arbiter."""
        arbiter = self.edge_arbiter()
        return [] if arbiter is None else [p for p, ppid in _parents().items() if ppid == arbiter]

    def processes(self) -> dict[int, str]:
        """Every live process of the stack: pid -> role name."""
        out = {}
        for c in self.sup.children:
            if (pid := self.pid(c.spec.name)) is not None:
                out[pid] = c.spec.name
        if (arbiter := self.edge_arbiter()) is not None:
            out[arbiter] = "edge-arbiter"
        for pid in self.edge_workers():
            out[pid] = "edge-worker"
        return out

    def stats(self, timeout_s: float = 3.0) -> dict:
        from tandem.commands.stats import fetch

        return fetch(self.addr("stats"), self.secret.read_bytes(), timeout_s, verbose=True)

    def http_ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://{HOST}:{self.http_port}/ready", timeout=3) as r:
                return r.status == 200
        except OSError:
            return False

    def workers_idle(self) -> tuple[bool, dict]:
        """Whether the broker sees all four workers with every KV block free; and its stats."""
        try:
            st = self.stats()
        except Exception as exc:  # the broker may be restarting
            return False, {"error": repr(exc)}
        ws = {w.get("name"): w for w in st.get("workers", []) if w.get("state") == "up"}
        ok = all(n in ws and ws[n].get("total_blocks", 0) > 0 and ws[n].get("free_blocks") == ws[n].get("total_blocks")
                 for n in self.WORKERS)
        return ok, st

    async def wait_healthy(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self.sup.check()
            ok, _ = await asyncio.to_thread(self.workers_idle)
            if ok and await asyncio.to_thread(self.http_ready):
                return
            await asyncio.sleep(0.5)
        raise TimeoutError(f"stack not healthy within {timeout_s:.0f}s: {self.workers_idle()[1]}")

    def stop(self) -> None:
        self.sup.stop_all()


def _parents() -> dict[int, int]:
    out = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if fields[0] != "Z":
                out[int(entry)] = int(fields[1])
    return out


def rss_mb(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def send_signal(pid: int, sig: int) -> bool:
    try:
        os.kill(pid, sig)
        return True
    except ProcessLookupError:
        return False


def resume_all(pids) -> None:
    for pid in pids:
        send_signal(pid, signal.SIGCONT)


def dumps(obj) -> str:
    return json.dumps(obj, sort_keys=True)
