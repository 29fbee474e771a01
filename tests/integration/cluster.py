"""Real broker and worker processes on loopback for integration tests.

Every process starts in its own session, so teardown can SIGKILL its whole process
group even when a test failed halfway; ports are chosen by the OS (``:*``) and read
back from each process's one-line JSON ready message.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

from tandem._parent_death import parent_death_signal
from tandem.wire.client import Client

READY_TIMEOUT_S = 60.0
ROOT = Path(__file__).resolve().parents[2]


def _own_group_die_with_parent() -> None:
    """In the child: its own process group (teardown kills the group), and SIGKILL when the
    test process dies, so even a killed pytest leaves no worker or broker behind."""
    os.setsid()
    parent_death_signal(signal.SIGKILL)


class Proc:
    def __init__(self, args: list[str], env: dict, log: Path):
        self.args = args
        self.log = log
        self._errf = open(log, "ab")
        self.p = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=self._errf, env=env, preexec_fn=_own_group_die_with_parent)
        self.info: dict = {}

    def wait_ready(self, timeout: float = READY_TIMEOUT_S) -> dict:
        deadline = time.monotonic() + timeout
        buf = b""
        fd = self.p.stdout.fileno()
        while time.monotonic() < deadline:
            if self.p.poll() is not None:
                raise RuntimeError(f"{self.args[4:6]} exited with {self.p.returncode}: {self.log.read_text()[-3000:]}")
            r, _, _ = select.select([fd], [], [], 0.1)
            if r:
                chunk = os.read(fd, 65536)
                buf += chunk
                for line in buf.split(b"\n"):
                    if line.startswith(b"{"):
                        try:
                            msg = json.loads(line)
                        except ValueError:
                            continue
                        if msg.get("event") == "ready":
                            self.info = msg
                            return msg
        raise TimeoutError(f"{self.args[4:6]} not ready in {timeout}s: {self.log.read_text()[-3000:]}")

    def signal(self, sig) -> None:
        try:
            os.killpg(self.p.pid, sig)
        except ProcessLookupError:
            pass

    def kill(self) -> None:
        self.signal(signal.SIGKILL)
        try:
            self.p.wait(10)
        except subprocess.TimeoutExpired:
            pass
        if self.p.stdout:
            self.p.stdout.close()
        self._errf.close()

    @property
    def alive(self) -> bool:
        return self.p.poll() is None


class Cluster:
    def __init__(self, tmp: Path, *, heartbeat_ms: int = 200, secret: bytes | None = None):
        self.tmp = tmp
        self.heartbeat_ms = heartbeat_ms
        # Hex, not raw bytes: the secret loader drops a trailing newline from the file, so
        # a random binary secret ending in \n or \r would differ from what processes load.
        self.secret = secret if secret is not None else os.urandom(32).hex().encode()
        self.secret_file = tmp / "cluster.secret"
        self.secret_file.write_bytes(self.secret)
        self.secret_file.chmod(0o600)
        self.procs: list[Proc] = []
        self.broker: Proc | None = None
        self.endpoints: dict = {}
        self.clients: list[Client] = []
        self.env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.env.pop("TANDEM_CLUSTER_SECRET", None)
        self.env.pop("TANDEM_CLUSTER_SECRET_FILE", None)

    def _spawn(self, name: str, args: list[str], module: str = "tandem.cli") -> Proc:
        """``python -m module -v args``; a module of the tests (the stub worker) finds them
        through the repository root put first on PYTHONPATH."""
        env = self.env
        if not module.startswith("tandem."):
            env = dict(env, PYTHONPATH=os.pathsep.join(filter(None, (str(ROOT), env.get("PYTHONPATH")))))
        p = Proc([sys.executable, "-m", module, "-v", *args], env, self.tmp / f"{name}-{len(self.procs)}.log")
        self.procs.append(p)
        return p

    def start_broker(self, *extra: str, reuse_ports: bool = False) -> Proc:
        if reuse_ports and self.endpoints:
            addrs = [self.endpoints[k] for k in ("frontend", "backend", "stream_in", "stream_out", "stats")]
        else:
            addrs = ["tcp://127.0.0.1:*"] * 5
        args = ["broker", "--frontend", addrs[0], "--backend", addrs[1], "--stream-in", addrs[2],
                "--stream-out", addrs[3], "--stats", addrs[4], "--heartbeat-ms", str(self.heartbeat_ms),
                "--cluster-secret-file", str(self.secret_file), *extra]
        self.broker = self._spawn("broker", args)
        info = self.broker.wait_ready()
        self.endpoints = {k: info[k] for k in ("frontend", "backend", "stream_in", "stream_out", "stats")}
        return self.broker

    def start_worker(self, role: str, *extra: str, engine: str = "stub", model: Path | None = None,
                     secret_file: Path | None = None, wait: bool = True, name: str | None = None) -> Proc:
        """A ``tandem worker`` process; ``engine="stub"``: the same command with the model-free
        engine of tests/stub_engine.py (``--stub-step-ms`` in ``extra`` sets its step time),
        ``"mlx"``: the product's worker loading ``model``."""
        assert engine in ("stub", "mlx"), engine
        args = ["worker", "--role", role, "--broker-backend", self.endpoints["backend"],
                "--broker-stream", self.endpoints["stream_in"], "--heartbeat-ms", str(self.heartbeat_ms),
                "--cluster-secret-file", str(secret_file or self.secret_file), *extra]
        if model is not None:
            args += ["--model", str(model)]
        if name:
            args += ["--name", name]
        p = self._spawn(f"worker-{role}", args, "tests.stub_engine" if engine == "stub" else "tandem.cli")
        if wait:
            p.wait_ready()
        return p

    def client(self, timeout_s: float = 20.0, **kw) -> Client:
        c = Client(self.endpoints["frontend"], self.endpoints["stream_out"], secret=self.secret, timeout_s=timeout_s, **kw)
        self.clients.append(c)
        return c

    def wait_workers(self, client: Client, timeout: float = 60.0, **want: int) -> dict:
        deadline = time.monotonic() + timeout
        last = None
        while time.monotonic() < deadline:
            try:
                last = client.ready()["workers"]
            except Exception as exc:
                print(f"ready() failed: {exc!r}")
                last = None
            if last and all(last.get(k, 0) >= v for k, v in want.items()):
                return last
            time.sleep(0.1)
        raise TimeoutError(f"workers not ready: want {want}, have {last}")

    def close(self) -> None:
        for c in self.clients:
            try:
                c.close()
            except Exception:
                pass
        for p in self.procs:
            p.kill()

    def logs(self) -> str:
        return "\n".join(f"== {p.log.name}\n{p.log.read_text()[-2000:]}" for p in self.procs if p.log.exists())
