"""`tandem serve` end to end: real children on loopback, an OpenAI request, a killed
child restarted, and nothing left behind."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request

import pytest

from tests.ops.procs import is_live


def free_port_block(n: int) -> int:
    """A base port with n free consecutive ports (best effort)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        if base + n >= 65000:
            continue
        try:
            socks = []
            for i in range(n):
                t = socket.socket()
                socks.append(t)
                t.bind(("127.0.0.1", base + i))
            return base
        except OSError:
            continue
        finally:
            for t in socks:
                t.close()
    raise RuntimeError("no free port block")


def pids_in_session(sid_root: int) -> set[int]:
    """Every live process whose ancestry includes sid_root (via /proc)."""
    parents = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                if fields[0] != "Z":
                    parents[int(entry)] = int(fields[1])
            except OSError:
                continue
    found = set()
    for pid in parents:
        p = pid
        while p in parents and p > 1:
            if parents[p] == sid_root:
                found.add(pid)
                break
            p = parents[p]
    return found


class Serve:
    def __init__(self, args, tmp_path):
        self.lines: list[str] = []
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tandem.cli", "serve", *args, "--state-dir", str(tmp_path / "state")],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        self.descendants: set[int] = set()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))

    def wait_for(self, text, *more, timeout=240):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if any(text in l and all(m in l for m in more) for l in self.lines):
                return
            if self.proc.poll() is not None:
                break
            time.sleep(0.2)
        raise AssertionError(f"{text!r} not seen; output:\n" + "\n".join(self.lines[-40:]))

    def stop(self):
        if self.proc.poll() is None:
            self.descendants |= pids_in_session(self.proc.pid)
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=90)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        for pid in pids_in_session(self.proc.pid) | self.descendants:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


@pytest.fixture
def serve(tiny_model_dir, tmp_path):
    started = []

    def start(*extra):
        base = free_port_block(12)
        port = free_port_block(1)
        s = Serve(["--model", str(tiny_model_dir), "--base-port", str(base), "--port", str(port), *extra], tmp_path)
        s.url = f"http://127.0.0.1:{port}"
        started.append(s)
        return s

    yield start
    for s in started:
        s.stop()


def chat(url, text="Hello"):
    body = json.dumps({"model": "tiny-llama0", "temperature": 0, "max_tokens": 8,
                       "messages": [{"role": "user", "content": text}]}).encode()
    req = urllib.request.Request(url + "/v1/chat/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read())


@pytest.mark.timeout(400)
def test_serve_comes_up_serves_restarts_and_leaves_nothing(serve, tmp_path):
    from openai import OpenAI

    s = serve()
    s.wait_for("ready: http://")
    secret = tmp_path / "state" / "cluster-secret"
    assert oct(secret.stat().st_mode & 0o777) == "0o600" and len(bytes.fromhex(secret.read_text())) == 32
    client = OpenAI(base_url=s.url + "/v1", api_key="unused")
    model = client.models.list().data[0].id
    reply = client.chat.completions.create(model=model, temperature=0, max_tokens=8,
                                           messages=[{"role": "user", "content": "Hello"}])
    assert reply.usage.completion_tokens >= 1
    first = reply.choices[0].message.content

    # Kill the decode worker: serve reports it, restarts it, and the stack serves again.
    descendants = pids_in_session(s.proc.pid)
    s.descendants |= descendants
    decode = [p for p in descendants if "--role\0decode" in open(f"/proc/{p}/cmdline").read()]
    assert len(decode) == 1
    os.kill(decode[0], signal.SIGKILL)
    s.wait_for("decode-0 was killed by signal 9", "restarting it (1/5)")
    deadline = time.monotonic() + 120
    while True:
        try:
            again = client.chat.completions.create(model=model, temperature=0, max_tokens=8,
                                                   messages=[{"role": "user", "content": "Hello"}])
            break
        except Exception:
            if time.monotonic() > deadline:
                raise
            time.sleep(1)
    assert again.choices[0].message.content == first

    all_pids = pids_in_session(s.proc.pid) | s.descendants
    s.proc.send_signal(signal.SIGINT)
    assert s.proc.wait(timeout=120) == 0
    time.sleep(0.5)
    alive = [p for p in all_pids if is_live(p)]
    assert alive == [], f"left behind: {alive}"
    assert s.lines[-1].endswith("stopped")


def test_port_in_use_is_a_one_line_error(tiny_model_dir, tmp_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        proc = subprocess.run(
            [sys.executable, "-m", "tandem.cli", "serve", "--model", str(tiny_model_dir), "--port", str(port),
             "--state-dir", str(tmp_path)], capture_output=True, text=True, timeout=60,
        )
    assert proc.returncode == 2
    assert proc.stderr.strip() == f"tandem serve: port {port} (HTTP) is already in use; pick other ports with --port / --base-port"


def test_a_child_that_cannot_start_fails_serve_loudly(tiny_model_dir, tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("[broker]\nheartbeat_interval_ms = 1\n")  # below the minimum: the broker refuses to start
    base = free_port_block(12)
    proc = subprocess.run(
        [sys.executable, "-m", "tandem.cli", "serve", "--model", str(tiny_model_dir), "--config", str(bad),
         "--base-port", str(base), "--port", str(free_port_block(1)), "--state-dir", str(tmp_path)],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 1
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("tandem serve: broker exited with status 2") and "heartbeat_interval_ms" in last


def test_colocated_prefill_and_decode_workers_share_one_cpu_gate(tmp_path):
    import argparse

    from tandem.commands import serve as serve_cmd

    p = argparse.ArgumentParser()
    serve_cmd.add_arguments(p)
    args = p.parse_args(["--prefill", "2", "--decode", "1"])
    gate = tmp_path / "gate.lock"
    specs, _ = serve_cmd.build_specs(args, tmp_path, tmp_path / "secret", gate)
    workers = [s for s in specs if s.name.startswith(("prefill", "decode"))]
    assert len(workers) == 3
    for s in workers:
        i = s.argv.index("--cpu-gate")
        assert s.argv[i + 1] == str(gate)
    assert not any("--cpu-gate" in s.argv for s in specs if not s.name.startswith(("prefill", "decode")))
    hybrid = serve_cmd.build_specs(p.parse_args(["--topology", "hybrid"]), tmp_path, tmp_path / "secret", gate)[0]
    assert not any("--cpu-gate" in s.argv for s in hybrid)
    ungated = serve_cmd.build_specs(args, tmp_path, tmp_path / "secret", None)[0]
    assert not any("--cpu-gate" in s.argv for s in ungated)


def test_every_worker_serve_starts_takes_its_share_of_the_device(tmp_path):
    """Workers on one device size their KV and memory limit from a share of it: serve tells
    each how many share it (two processes that each took the whole GPU ran out of memory)."""
    import argparse

    from tandem.commands import serve as serve_cmd
    from tandem.commands import worker as worker_cmd

    p = argparse.ArgumentParser()
    serve_cmd.add_arguments(p)

    def shares(argv):
        specs, _ = serve_cmd.build_specs(p.parse_args(argv), tmp_path, tmp_path / "secret", None)
        return {s.argv[s.argv.index("--workers-per-device") + 1] for s in specs if s.name.startswith(("prefill", "decode", "hybrid"))}

    assert shares([]) == {"2"}
    assert shares(["--prefill", "2", "--decode", "3"]) == {"5"}
    assert shares(["--topology", "hybrid"]) == {"1"}
    assert shares(["--topology", "hybrid", "--hybrid", "3"]) == {"3"}
    wp = argparse.ArgumentParser()
    worker_cmd.add_arguments(wp)
    assert wp.parse_args(["--role", "decode", "--workers-per-device", "2"]).workers_per_device == 2


def test_workers_are_placed_on_gpus_one_each_and_share_only_their_own(tmp_path):
    """--gpus: each worker gets one GPU (CUDA_VISIBLE_DEVICES), in turn; a worker's memory
    share counts only the workers on its GPU; workers on GPUs of their own skip the CPU gate."""
    import argparse

    from tandem.commands import UserError
    from tandem.commands import serve as serve_cmd

    p = argparse.ArgumentParser()
    serve_cmd.add_arguments(p)
    gate = tmp_path / "gate"

    def workers(argv, gpus):
        specs, _ = serve_cmd.build_specs(p.parse_args(argv), tmp_path, tmp_path / "secret", gate, gpus)
        return {s.name: (s.env.get("CUDA_VISIBLE_DEVICES"), s.argv[s.argv.index("--workers-per-device") + 1],
                         "--cpu-gate" in s.argv) for s in specs if s.name.startswith(("prefill", "decode", "hybrid"))}

    assert workers([], ["0", "1"]) == {"decode-0": ("0", "1", False), "prefill-0": ("1", "1", False)}
    assert workers(["--topology", "disaggregated"], ["3"]) == {"decode-0": ("3", "2", True), "prefill-0": ("3", "2", True)}
    assert workers([], ["3"]) == {"hybrid-0": ("3", "1", False)}  # auto: one GPU, one hybrid worker
    assert workers(["--decode", "1"], ["3"]) == {"decode-0": ("3", "2", True), "prefill-0": ("3", "2", True)}
    assert workers([], []) == {"decode-0": (None, "2", True), "prefill-0": (None, "2", True)}
    assert workers(["--topology", "hybrid"], ["0", "1"]) == {"hybrid-0": ("0", "1", False), "hybrid-1": ("1", "1", False)}
    assert workers(["--prefill", "2", "--decode", "1"], ["0", "1"]) == {
        "decode-0": ("0", "2", False), "prefill-0": ("1", "1", False), "prefill-1": ("0", "2", False)}
    assert serve_cmd.visible_gpus("none") == [] and serve_cmd.visible_gpus(" 1,0 ") == ["1", "0"]
    for bad in ("0,0", "a", ","):
        with pytest.raises(UserError, match="--gpus"):
            serve_cmd.visible_gpus(bad)


def test_port_check_ignores_connections_lingering_in_time_wait():
    """After Ctrl-C the HTTP port keeps closed connections in TIME_WAIT for a minute;
    gunicorn binds it anyway (SO_REUSEADDR), so the check before it must too (#45)."""
    from tandem.commands import UserError
    from tandem.commands.serve import check_port_free
    from tests.ops.test_first_run import time_wait_on

    with socket.socket() as lst:
        lst.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as gunicorn's listener
        lst.bind(("127.0.0.1", 0))
        lst.listen()
        port = lst.getsockname()[1]
        client = socket.create_connection(("127.0.0.1", port))
        conn, _ = lst.accept()
        conn.close()  # the server closes first: its side lingers
        client.close()
        with pytest.raises(UserError):
            check_port_free("127.0.0.1", port, "HTTP")  # a listener still holds it
    assert time_wait_on(port)
    check_port_free("127.0.0.1", port, "HTTP")


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_hybrid_serve_single_worker_sigkilled_mid_stream_continues_exactly(serve):
    """Issue #45 item 6 through the whole stack: `serve --topology hybrid`, its only worker
    SIGKILLed mid-stream; serve restarts it and the stream ends as an undisturbed one."""
    from pathlib import Path

    s = serve("--topology", "hybrid")
    s.wait_for("ready: http://")
    here = Path(__file__).resolve().parent
    client = [sys.executable, str(here / "stream_client.py"), s.url, "tiny-llama0", "1", "3000"]
    env = {**os.environ, "PYTHONPATH": str(here.parents[1])}
    ref = subprocess.run(client, capture_output=True, text=True, timeout=300, env=env)
    (reference,) = [json.loads(l) for l in ref.stdout.splitlines() if '"done"' in l]
    assert reference["error"] is None and reference["finish"] == "length", reference

    run = subprocess.Popen(client, stdout=subprocess.PIPE, text=True, env=env)
    assert '"streaming"' in run.stdout.readline()
    s.descendants |= pids_in_session(s.proc.pid)
    (worker,) = [p for p in pids_in_session(s.proc.pid) if "--role\0hybrid" in open(f"/proc/{p}/cmdline").read()]
    os.kill(worker, signal.SIGKILL)
    done = json.loads(run.stdout.readline())
    run.wait(timeout=60)
    assert done["error"] is None, done["error"]
    assert done["text"] == reference["text"]
    s.wait_for("hybrid-0 was killed by signal 9", "restarting it (1/5)")


def test_serve_hands_speculative_to_the_workers_that_decode(tmp_path):
    import argparse

    from tandem.commands import serve as serve_cmd

    p = argparse.ArgumentParser()
    serve_cmd.add_arguments(p)

    def modes(argv):
        specs, _ = serve_cmd.build_specs(p.parse_args(argv), tmp_path, tmp_path / "secret", None)
        return {s.name: s.argv[s.argv.index("--speculative") + 1] if "--speculative" in s.argv else None
                for s in specs if s.name.startswith(("prefill", "decode", "hybrid"))}

    assert modes(["--speculative", "ngram"]) == {"decode-0": "ngram", "prefill-0": None}
    assert modes(["--topology", "hybrid", "--speculative", "draft:/m"]) == {"hybrid-0": "draft:/m"}
    assert set(modes([]).values()) == {None}


def test_prefill_and_decode_counts_are_refused_with_the_hybrid_topology():
    """--prefill / --decode name disaggregated workers: with --topology hybrid they would be
    silently ignored, so serve refuses them with a one-line reason before starting anything."""
    import argparse

    from tandem.commands import UserError
    from tandem.commands import serve as serve_cmd

    p = argparse.ArgumentParser()
    serve_cmd.add_arguments(p)
    with pytest.raises(UserError, match="--hybrid N"):
        serve_cmd.run(p.parse_args(["--topology", "hybrid", "--prefill", "2"]))
    with pytest.raises(UserError, match="at least 1"):
        serve_cmd.run(p.parse_args(["--decode", "0"]))
