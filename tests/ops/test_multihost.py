"""A cluster on six "hosts" (network namespaces): broker, two prefill, two decode, edge.

Requests go through the edge; mid-stream one decode host's link is cut, and every
stream must still finish with exactly the text of an uninterrupted run.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.ops.netns import Cluster, namespaces_available

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
HERE = Path(__file__).resolve().parent
HB = "200"  # heartbeat ms: failure is detected within a second


class Proc:
    def __init__(self, cluster, host, argv):
        self.lines: list[str] = []
        self.host = host
        self.proc = cluster.popen(host, argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                  env={**os.environ, "PYTHONUNBUFFERED": "1"})
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


def test_multihost_serving_survives_a_cut_decode_link(cluster, tiny_model_dir, tmp_path):
    secret = tmp_path / "cluster-secret"
    secret.write_text(os.urandom(32).hex())
    secret.chmod(0o600)
    tandem = [sys.executable, "-m", "tandem.cli"]
    common = ["--cluster-secret-file", str(secret)]
    b = cluster.address["broker"]
    procs = [Proc(cluster, "broker", tandem + [
        "broker", "--frontend", f"tcp://{b}:5555", "--backend", f"tcp://{b}:5556", "--stream-in", f"tcp://{b}:5557",
        "--stream-out", f"tcp://{b}:5558", "--stats", f"tcp://{b}:5559", "--heartbeat-ms", HB] + common)]
    procs[0].wait_line('{"event": "ready"')
    worker = tandem + ["worker", "--model", str(tiny_model_dir), "--broker-backend", f"tcp://{b}:5556",
                       "--broker-stream", f"tcp://{b}:5557", "--heartbeat-ms", HB] + common
    for host in ("d1", "d2"):
        procs.append(Proc(cluster, host, worker + ["--role", "decode", "--name", host,
                                                   "--kv-bind", f"tcp://{cluster.address[host]}:5600"]))
    for host in ("p1", "p2"):
        procs.append(Proc(cluster, host, worker + ["--role", "prefill", "--name", host]))
    e = cluster.address["edge"]
    edge = Proc(cluster, "edge", tandem + ["edge", "--bind", f"{e}:8000", "--broker", f"tcp://{b}:5555",
                                           "--broker-stream", f"tcp://{b}:5558", "--model", str(tiny_model_dir),
                                           "--model-name", "tiny"] + common)
    procs.append(edge)
    try:
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
        env = {**os.environ, "PYTHONPATH": str(HERE.parents[1])}
        reference = cluster.run("edge", client, capture_output=True, text=True, timeout=300, env=env)
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

        stats = cluster.run("broker", tandem + ["stats", "--json", "--stats", f"tcp://{b}:5559"] + common,
                            capture_output=True, text=True, timeout=30)
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
