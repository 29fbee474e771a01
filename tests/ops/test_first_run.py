"""A scripted first run, as a new user does it (issue #45 items 3, 4 and 5):

start `tandem serve` with an API key on non-default ports, paste the curl line it
prints, run `tandem client` and `tandem stats` with no flags at all, Ctrl-C, and start
it again at once on the same ports while the last connections linger in TIME_WAIT.
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from tests.ops.procs import is_live
from tests.ops.test_serve import free_port_block, pids_in_session

CLI = [sys.executable, "-m", "tandem.cli"]


class Serve:
    def __init__(self, argv, env):
        self.lines: list[str] = []
        self.proc = subprocess.Popen(CLI + ["serve", *argv], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, env={**env, "PYTHONUNBUFFERED": "1"})
        self.pids: set[int] = set()
        threading.Thread(target=lambda: [self.lines.append(l.rstrip("\n")) for l in self.proc.stdout], daemon=True).start()

    def line(self, text, timeout=180) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            hit = next((l for l in self.lines if text in l), None)
            if hit is not None:
                self.pids |= pids_in_session(self.proc.pid)
                return hit
            assert self.proc.poll() is None, "serve exited:\n" + "\n".join(self.lines[-30:])
            time.sleep(0.2)
        raise AssertionError(f"{text!r} not seen:\n" + "\n".join(self.lines[-30:]))

    def interrupt(self) -> int:
        self.pids |= pids_in_session(self.proc.pid)
        self.proc.send_signal(signal.SIGINT)
        return self.proc.wait(timeout=120)

    def kill(self) -> None:
        for pid in {self.proc.pid} | self.pids | pids_in_session(self.proc.pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def time_wait_on(port: int) -> bool:
    """Some TCP connection whose local port is ``port`` lingers in TIME_WAIT (state 06)."""
    with open("/proc/net/tcp") as f:
        rows = [line.split() for line in f.readlines()[1:]]
    return any(int(r[1].split(":")[1], 16) == port and r[3] == "06" for r in rows)


@pytest.mark.timeout(400)
def test_first_run_serve_curl_client_stats_ctrl_c_and_serve_again(tiny_model_dir, tmp_path):
    env = {**os.environ, "XDG_STATE_HOME": str(tmp_path / "xdg")}
    for k in [k for k in env if k.startswith("TANDEM_")]:
        del env[k]
    key = tmp_path / "api-key"
    key.write_text("sk-first-run-key")
    cfg = tmp_path / "tandem.toml"
    cfg.write_text("[broker]\nlog_stats_interval_s = 1.0\n")
    base, port = free_port_block(12), free_port_block(1)
    argv = ["--model", str(tiny_model_dir), "--topology", "hybrid", "--base-port", str(base), "--port", str(port),
            "--api-key-file", str(key), "--config", str(cfg), "--access-log"]
    serve = Serve(argv, env)
    try:
        serve.line("ready: http://")

        # Item 5: the printed curl line works as pasted (it carries the key's header).
        hint = serve.line("try: curl").split("try: ", 1)[1]
        assert "sk-first-run-key" not in hint  # the key itself never reaches the log
        out = subprocess.run(["bash", "-c", hint + " --max-time 60 -sS --fail-with-body"], capture_output=True,
                             text=True, timeout=90, env=env)
        assert out.returncode == 0, out.stdout + out.stderr
        assert "data: [DONE]" in out.stdout and '"chat.completion.chunk"' in out.stdout
        # Item 8: the access log and the periodic throughput line show in serve's output.
        assert '"POST /v1/chat/completions HTTP/1.1" 200' in serve.line("POST /v1/chat/completions", timeout=10)
        assert "tokens/s, running:" in serve.line("avg generation throughput:", timeout=10)

        # Item 3: client and stats find this serve's secret and ports by themselves.
        client = subprocess.run(CLI + ["client", "Hello", "--max-tokens", "4"], capture_output=True, text=True,
                                timeout=120, env=env)
        assert client.returncode == 0, client.stderr
        assert "[finish: " in client.stderr
        stats = subprocess.run(CLI + ["stats", "--json"], capture_output=True, text=True, timeout=60, env=env)
        assert stats.returncode == 0, stats.stderr
        body = json.loads(stats.stdout)
        assert [w["role"] for w in body["workers"]] == ["hybrid"] and body["counters"]["completed"] >= 2

        # Item 4: an idle keep-alive connection that the server closes as it stops leaves
        # the HTTP port in TIME_WAIT; serve must start again on it at once.
        keep = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        keep.request("GET", "/health")
        assert keep.getresponse().read() is not None
        assert serve.interrupt() == 0
        keep.close()
        assert time_wait_on(port), "the test needs a lingering connection on the HTTP port"
        assert not (tmp_path / "xdg" / "tandem" / "serve.json").exists()  # withdrawn on exit
        stopped = subprocess.run(CLI + ["stats", "--timeout", "1"], capture_output=True, text=True, timeout=60, env=env)
        assert stopped.returncode == 2 and "serve.json" in stopped.stderr, stopped.stderr  # says where it looked

        again = Serve(argv, env)
        try:
            again.line("ready: http://", timeout=180)
            assert again.interrupt() == 0
        finally:
            again.kill()
    finally:
        serve.kill()
    time.sleep(0.5)
    assert [p for p in serve.pids | again.pids if is_live(p)] == []
