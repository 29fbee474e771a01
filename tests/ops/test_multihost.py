"""A cluster on six "hosts" (network namespaces): broker, two prefill, two decode, edge,
each process started with its systemd unit's own command line.

Requests go through the edge; mid-stream one decode host's link is cut, and every
stream must still finish with exactly the text of an uninterrupted run.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.ops.netns import Cluster, namespaces_available
from tests.ops.test_systemd import ROOT, parse

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
HERE = Path(__file__).resolve().parent
HB = "200"  # heartbeat ms: failure is detected within a second


class Proc:
    def __init__(self, cluster, host, argv, env=None):
        self.lines: list[str] = []
        self.host = host
        self.proc = cluster.popen(host, argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                  env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))

    def wait_line(self, prefix, timeout=180, count=1):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            hits = [l for l in self.lines if l.startswith(prefix)]
            if len(hits) >= count:
                return hits
            if self.proc.poll() is not None:
                break
            time.sleep(0.1)
        raise AssertionError(f"{self.host}: {prefix!r} x{count} not seen:\n" + "\n".join(self.lines[-30:]))


@pytest.fixture
def cluster():
    reason = namespaces_available()
    if reason:
        pytest.skip(f"multi-host test skipped: {reason}")
    with Cluster(["broker", "p1", "p2", "d1", "d2", "edge"]) as c:
        yield c


def unit_argv(unit: str, config: Path, instance: str = "", host: str = "") -> list[str]:
    """A systemd unit's own ExecStart, with this interpreter for the venv's `tandem`."""
    service = parse(ROOT / "ops" / "systemd" / unit)["Service"]
    argv = shlex.split(service["ExecStart"].replace("%i", instance).replace("%H", host))
    assert argv[0] == "/opt/tandem/venv/bin/tandem"
    return [sys.executable, "-m", "tandem.cli", *[str(config) if a == "/etc/tandem/tandem.toml" else a for a in argv[1:]]]


def test_multihost_serving_survives_a_cut_decode_link(cluster, tiny_model_dir, tmp_path):
    """Every process runs its unit's ExecStart (decode: --kv-bind tcp://0.0.0.0:%i) with
    one tandem.toml, the secret as a systemd credential, as docs/operations.md sets up."""
    creds = tmp_path / "credentials"
    creds.mkdir()
    (creds / "cluster-secret").write_text(os.urandom(32).hex())
    (creds / "cluster-secret").chmod(0o600)
    b, e = cluster.address["broker"], cluster.address["edge"]
    cfg = tmp_path / "tandem.toml"
    cfg.write_text(f"""[model]
path = "{tiny_model_dir}"
[broker]
frontend = "tcp://{b}:5555"
backend = "tcp://{b}:5556"
stream_in = "tcp://{b}:5557"
stream_out = "tcp://{b}:5558"
stats = "tcp://{b}:5559"
heartbeat_interval_ms = {HB}
[edge]
bind = "{e}:8000"
model_name = "tiny"
""")
    env = {"CREDENTIALS_DIRECTORY": str(creds)}
    procs = [Proc(cluster, "broker", unit_argv("tandem-broker.service", cfg), env)]
    procs[0].wait_line('{"event": "ready"')
    decode = {host: Proc(cluster, host, unit_argv("tandem-decode@.service", cfg, "5600", host), env) for host in ("d1", "d2")}
    procs += decode.values()
    for i, host in enumerate(("p1", "p2")):
        procs.append(Proc(cluster, host, unit_argv("tandem-prefill@.service", cfg, str(i), host), env))
    edge = Proc(cluster, "edge", unit_argv("tandem-edge.service", cfg), env)
    procs.append(edge)
    tandem = [sys.executable, "-m", "tandem.cli"]
    try:
        for host, p in decode.items():
            ready = json.loads(p.wait_line('{"event": "ready"')[0])
            assert ready["kv_address"] == f"tcp://{cluster.address[host]}:5600", ready
        for p in procs[1:]:
            p.wait_line('{"event": "ready"')
        url = f"http://{e}:8000"
        probe = ("import sys, time, urllib.request\n"
                 "for _ in range(300):\n"
                 "    try:\n"
                 "        if urllib.request.urlopen(sys.argv[1] + '/ready', timeout=2).status == 200: sys.exit(0)\n"
                 "    except Exception: pass\n"
                 "    time.sleep(0.3)\n"
                 "sys.exit(1)\n")
        assert cluster.run("edge", [sys.executable, "-c", probe, url], timeout=120).returncode == 0, "edge never ready"

        client = [sys.executable, str(HERE / "stream_client.py"), url, "tiny", "2", "600"]
        client_env = {**os.environ, "PYTHONPATH": str(HERE.parents[1])}
        reference = cluster.run("edge", client, capture_output=True, text=True, timeout=300, env=client_env)
        ref = {d["request"]: d for d in map(json.loads, reference.stdout.splitlines()) if d["event"] == "done"}
        assert len(ref) == 2 and all(d["error"] is None and d["finish"] == "length" for d in ref.values()), reference.stdout

        run = Proc(cluster, "edge", client)
        run.proc.args  # noqa: B018
        run.wait_line('{"event": "streaming"', count=2, timeout=120)
        cluster.cut("d1")
        done = run.wait_line('{"event": "done"', count=2, timeout=300)
        results = {d["request"]: d for d in map(json.loads, done)}
        for i in (0, 1):
            assert results[i]["error"] is None, results[i]["error"]
            assert results[i]["text"] == ref[i]["text"], f"request {i} differs after failover"

        stats = cluster.run("broker", tandem + ["stats", "--json", "--config", str(cfg)],
                            capture_output=True, text=True, timeout=30, env={**os.environ, **env})
        assert stats.returncode == 0, stats.stderr
        assert '"migrations"' in stats.stdout
        body = json.loads(stats.stdout)
        assert _find(body, "migrations") >= 1, stats.stdout
    finally:
        for p in procs:
            if p.proc.poll() is None:
                p.proc.terminate()
        for p in procs:
            try:
                p.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.proc.kill()


def _find(obj, key):
    """The first numeric value stored under ``key`` anywhere in a JSON document."""
    if isinstance(obj, dict):
        if isinstance(obj.get(key), (int, float)):
            return obj[key]
        for v in obj.values():
            found = _find(v, key)
            if found is not None:
                return found
    elif isinstance(obj, list):
        for v in obj:
            found = _find(v, key)
            if found is not None:
                return found
    return None
