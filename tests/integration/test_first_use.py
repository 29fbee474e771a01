"""What a user sees from the commands and from a single-worker cluster (issue #45):
real broker and stub-engine workers on loopback."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

from tandem.kvtypes import SamplingParams
from tests.stub_engine import reference_tokens

CLI = [sys.executable, "-m", "tandem.cli"]


def test_only_hybrid_worker_sigkilled_mid_stream_the_stream_continues_exactly(cluster):
    """The request waits for the restarted worker (here: a fresh one, as serve's
    supervisor starts) and the stream ends exactly as an uninterrupted run."""
    cluster.start_broker()
    w = cluster.start_worker("hybrid", "--stub-step-ms", "30")
    c = cluster.client()
    cluster.wait_workers(c, hybrid=1)
    prompt = [5, 4, 3]
    toks, restarted, done = [], [], threading.Event()

    def restart_later():
        time.sleep(2.0)  # well past the broker's detection and its probe round
        restarted.append(cluster.start_worker("hybrid", "--stub-step-ms", "30"))
        done.wait(60)  # the worker dies with the thread that started it (PR_SET_PDEATHSIG)

    for ev in c.generate(prompt, SamplingParams(max_tokens=60)):
        toks += ev.tokens
        if len(toks) >= 10 and w.alive:
            w.kill()
            threading.Thread(target=restart_later, daemon=True).start()
    done.set()
    assert restarted and toks == reference_tokens(prompt, 60)
    assert c.stats()["counters"]["migrations"] == 1


def test_client_reply_ends_its_line_before_the_finish_line(cluster):
    cluster.start_broker()
    cluster.start_worker("hybrid")
    cluster.wait_workers(cluster.client(), hybrid=1)
    e = cluster.endpoints
    # stdout and stderr into one pipe, as `tandem client ... 2>&1 | tee log` does (and
    # buffered as there: no PYTHONUNBUFFERED).
    env = {k: v for k, v in cluster.env.items() if k != "PYTHONUNBUFFERED"}
    out = subprocess.run(CLI + ["client", "--token-ids", "1,2,3", "--max-tokens", "6", "--broker", e["frontend"],
                                "--stream", e["stream_out"], "--cluster-secret-file", str(cluster.secret_file)],
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=60, env=env)
    assert out.returncode == 0, out.stdout
    lines = [l for l in out.stdout.splitlines() if "tandem." not in l]  # no log lines at INFO here, but be safe
    assert [int(t) for t in lines[0].split()] == reference_tokens([1, 2, 3], 6)
    assert lines[1].startswith("[finish: length;"), out.stdout


def test_stats_into_a_pipe_that_closes_ends_without_a_traceback(cluster):
    cluster.start_broker()
    e = cluster.endpoints
    for extra in (["--json"], ["--watch", "0.05"]):
        # `tandem stats ... | head -1`: the reader leaves after one line.
        proc = subprocess.Popen(CLI + ["stats", *extra, "--stats", e["stats"], "--cluster-secret-file",
                                       str(cluster.secret_file)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                env=cluster.env)
        assert proc.stdout.readline()
        proc.stdout.close()
        _, err = proc.communicate(timeout=60)
        assert b"Traceback" not in err and b"BrokenPipe" not in err, err.decode()
        assert proc.returncode in (0, 141)


def test_generate_quiet_prints_only_the_reply(tiny_model_dir):
    out = subprocess.run(CLI + ["generate", "--quiet", "--model", str(tiny_model_dir), "--max-tokens", "4", "Hello"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip()
    assert out.stderr == ""


def test_decode_worker_on_a_wildcard_bind_advertises_a_routable_address(cluster):
    """What tandem-decode@.service does (--kv-bind tcp://0.0.0.0:%i): the ready line and
    the broker must carry an address a peer can connect to, not 0.0.0.0 (issue #45)."""
    cluster.start_broker("--stats-verbose")
    d = cluster.start_worker("decode", "--kv-bind", "tcp://0.0.0.0:0")
    assert d.info["kv_address"].startswith("tcp://127.0.0.1:"), d.info
    c = cluster.client()
    cluster.wait_workers(c, decode=1)
    (w,) = c.stats(verbose=True)["workers"]
    assert w["kv_address"] == d.info["kv_address"]
