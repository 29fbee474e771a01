"""The chaos run's cluster: the whole stack under one supervisor, with links the run can cut.

Processes: broker, 2 prefill + 2 decode workers, the edge (gunicorn arbiter + 2 workers),
each started with the same argv as ``tandem serve`` would give it, restarted by
:class:`tandem.supervisor.Supervisor` when it dies.

On loopback (the default) each worker reaches the broker's backend and stream sockets,
the edge its frontend and stream, and the prefill workers each decode worker's KV ingest,
through a TCP proxy of its own (:class:`Link`): "cut the link of decode-1" drops exactly
those connections (the peers see a reset) and refuses new ones until it is restored.

Across hosts (``cluster``: a :class:`tests.ops.netns.Cluster` with one network namespace
per process and one for the client) every process binds its own host's address and
connects to the others directly; a cut is a :class:`RouteCut`, packets between two hosts
dropped both ways, so connections stall silently as on a failed path instead of being
reset, and a whole host can lose its cable.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import socket
import sys
import time
import urllib.request
from pathlib import Path

from tandem.supervisor import ChildSpec, Supervisor

HOST = "127.0.0.1"


def _ephemeral_low() -> int:
    """The first port of the host's ephemeral range (Linux: ip_local_port_range)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


_picked: set[int] = set()


def free_port() -> int:
    """A port free now and below the host's ephemeral range, never the same twice.

    The stack's processes die and restart on their ports. A port from the ephemeral range
    (what binding to port 0 returns) is, while its owner restarts, one the kernel may hand
    to any process on the host that binds port 0: the only unclean request of a 10-minute
    run connected after the killed edge's processes were gone and before the new edge
    listened, and was reset (as a CURVE ZeroMQ socket, which tandem's tests bind to port 0
    by the dozen, answers HTTP). Below that range only a process that names the port can
    take it, as with ``tandem serve``'s fixed ports.
    """
    rng = random.SystemRandom()
    low = max(_ephemeral_low(), 20_001)
    for _ in range(2000):
        port = rng.randrange(20_000, low)
        if port in _picked:
            continue
        with socket.socket() as s:
            try:
                s.bind((HOST, port))
            except OSError:
                continue
        _picked.add(port)
        return port
    raise RuntimeError(f"no free port in 20000-{low - 1} on {HOST}")


class RouteCut:
    """The path between two hosts of a namespace cluster, cuttable like a :class:`Link`."""

    def __init__(self, cluster, a: str, b: str):
        self.cluster, self.a, self.b = cluster, a, b
        self.name = f"{a}<->{b}"
        self._cut = False

    async def up(self) -> None:
        if self._cut:
            await asyncio.to_thread(self.cluster.restore_route, self.a, self.b)
            self._cut = False

    async def cut(self) -> None:
        await asyncio.to_thread(self.cluster.cut_route, self.a, self.b)
        self._cut = True

    @property
    def is_cut(self) -> bool:
        return self._cut


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
    PREFILLS = ("prefill-0", "prefill-1")
    DECODES = ("decode-0", "decode-1")
    HOSTS = ("broker", *WORKERS, "edge")

    def __init__(self, tmp: Path, model: Path, *, log, cluster=None, decode_kv_budget: str = "1MiB",
                 transfer_timeout_s: float = 4.0):
        self.tmp = tmp
        self.model = model
        self.cluster = cluster
        self.secret = tmp / "cluster.secret"
        self.secret.write_text(os.urandom(32).hex())
        self.secret.chmod(0o600)
        keys = ("frontend", "backend", "stream_in", "stream_out", "stats")
        # links[name]: what "cut name's links" cuts; kv_links[key]: a KV path into a decode
        # worker (loopback: key is the decode worker; across hosts: "prefill-i>decode-j").
        self.links: dict[str, list] = {}
        self.kv_links: dict[str, list] = {}
        if cluster is None:
            self.host = dict.fromkeys(self.HOSTS, HOST)
            self.ports = {k: free_port() for k in keys}
            self.http_port = free_port()
            self.kv_ports = {d: free_port() for d in self.DECODES}
            for name in self.WORKERS:
                self.links[name] = [Link(name, self.ports["backend"]), Link(name, self.ports["stream_in"])]
            self.links["edge"] = [Link("edge", self.ports["frontend"]), Link("edge", self.ports["stream_out"])]
            for d in self.DECODES:
                self.kv_links[d] = [Link(d, self.kv_ports[d])]
            # Where each process connects: its own proxies (and a decode worker advertises its KV proxy).
            self.connect = {name: {"backend": links[0].port, "stream_in": links[1].port} for name, links in self.links.items()
                            if name != "edge"}
            self.connect["edge"] = {"frontend": self.links["edge"][0].port, "stream_out": self.links["edge"][1].port}
            self.kv_advertise = {d: f"tcp://{HOST}:{self.kv_links[d][0].port}" for d in self.DECODES}
        else:
            self.host = {name: cluster.address[name] for name in self.HOSTS}
            self.ports = {k: 5555 + i for i, k in enumerate(keys)}
            self.http_port = 8000
            self.kv_ports = dict.fromkeys(self.DECODES, 5600)
            for name in (*self.WORKERS, "edge"):
                self.links[name] = [RouteCut(cluster, name, "broker")]
            for p in self.PREFILLS:
                for d in self.DECODES:
                    self.kv_links[f"{p}>{d}"] = [RouteCut(cluster, p, d)]
            self.connect = {name: self.ports for name in (*self.WORKERS, "edge")}
            self.kv_advertise = {}
        common, decode = write_configs(tmp, decode_kv_budget=decode_kv_budget, transfer_timeout_s=transfer_timeout_s)
        self.sup = Supervisor(self._specs(common, decode), max_restarts=10_000, restart_window_s=60.0, out=log)

    @property
    def http(self) -> tuple[str, int]:
        return self.host["edge"], self.http_port

    def addr(self, key: str) -> str:
        return f"tcp://{self.host['broker']}:{self.ports[key]}"

    def zmq_targets(self) -> list[tuple[str, int]]:
        """Every ZeroMQ socket a hostile peer can reach: the broker's and the KV ingests."""
        return [(self.host["broker"], p) for p in self.ports.values()] + [(self.host[d], p) for d, p in self.kv_ports.items()]

    def kv_links_into(self, decode: str) -> list:
        return [link for key, links in self.kv_links.items() if key.split(">")[-1] == decode for link in links]

    def _on_host(self, name: str, argv: list[str]) -> list[str]:
        return argv if self.cluster is None else ["ip", "netns", "exec", self.cluster.hosts[name], *argv]

    def _specs(self, common: Path, decode: Path) -> list[ChildSpec]:
        py = [sys.executable, "-m", "tandem.cli"]
        sec = ["--cluster-secret-file", str(self.secret)]
        broker = self.host["broker"]
        specs = [ChildSpec("broker", self._on_host("broker", py + ["broker", "--config", str(common), *sec] + sum(
            (["--" + k.replace("_", "-"), self.addr(k)] for k in self.ports), [])), stop_grace_s=5.0)]
        for name in self.WORKERS:
            role = name.split("-")[0]
            ports = self.connect[name]
            argv = py + ["worker", "--role", role, "--name", name, "--model", str(self.model), *sec,
                         "--config", str(decode if role == "decode" else common),
                         "--broker-backend", f"tcp://{broker}:{ports['backend']}",
                         "--broker-stream", f"tcp://{broker}:{ports['stream_in']}"]
            if role == "decode":
                argv += ["--kv-bind", f"tcp://{self.host[name]}:{self.kv_ports[name]}"]
                if name in self.kv_advertise:
                    argv += ["--kv-advertise", self.kv_advertise[name]]
            specs.append(ChildSpec(name, self._on_host(name, argv), stop_grace_s=5.0))
        ports = self.connect["edge"]
        specs.append(ChildSpec("edge", self._on_host("edge", py + [
            "edge", "--config", str(common), "--bind", f"{self.host['edge']}:{self.http_port}", "--model", str(self.model),
            *sec, "--broker", f"tcp://{broker}:{ports['frontend']}", "--broker-stream", f"tcp://{broker}:{ports['stream_out']}"]),
            stop_grace_s=8.0))
        return specs

    def all_links(self) -> list:
        return [link for group in (self.links, self.kv_links) for links in group.values() for link in links]

    async def start(self, timeout_s: float = 300.0) -> None:
        for link in self.all_links():
            if isinstance(link, Link):
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
            with urllib.request.urlopen(f"http://{self.host['edge']}:{self.http_port}/ready", timeout=3) as r:
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
