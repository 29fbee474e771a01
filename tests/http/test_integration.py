"""The real stack on loopback: gunicorn edge (-k asgi, 2 workers) + broker + hybrid mlx
worker with the tiny model, driven by the official ``openai`` client.

The oracle is the single-request greedy path (``tandem.pipeline.generate``, which is
``mlx_lm.stream_generate``) on the same model directory.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import os
import select
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

import openai

API_KEY = "test-key-0123456789"
READY_TIMEOUT_S = 90.0
MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "What is the capital of France?"}]


class Proc:
    """One `tandem` subcommand in its own process group; ready when it prints its JSON line."""

    def __init__(self, args: list[str], log: Path, env: dict):
        self.log = log
        self._err = open(log, "ab")
        self.p = subprocess.Popen([sys.executable, "-m", "tandem.cli", *args], stdout=subprocess.PIPE,
                                  stderr=self._err, env=env, start_new_session=True)

    def ready(self) -> dict:
        deadline, buf = time.monotonic() + READY_TIMEOUT_S, b""
        while time.monotonic() < deadline:
            if self.p.poll() is not None:
                raise RuntimeError(f"{self.log.name}: exited {self.p.returncode}: {self.log.read_text()[-3000:]}")
            if select.select([self.p.stdout], [], [], 0.1)[0]:
                buf += os.read(self.p.stdout.fileno(), 65536)
                for line in buf.split(b"\n"):
                    if line.startswith(b"{") and b'"ready"' in line:
                        return json.loads(line)
        raise TimeoutError(f"{self.log.name} not ready: {self.log.read_text()[-3000:]}")

    def kill(self) -> None:
        try:
            os.killpg(self.p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.p.wait(10)
        self.p.stdout.close()
        self._err.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def stack(tmp_path_factory, tiny_model_dir):
    tmp = tmp_path_factory.mktemp("edge-stack")
    secret = tmp / "cluster.secret"
    secret.write_text(os.urandom(32).hex())
    secret.chmod(0o600)
    env = dict(os.environ, PYTHONUNBUFFERED="1", TANDEM_ENGINE_MAX_QUEUE_DEPTH="512")
    for name in ("TANDEM_CLUSTER_SECRET", "TANDEM_CLUSTER_SECRET_FILE", "PROMETHEUS_MULTIPROC_DIR"):
        env.pop(name, None)
    procs: list[Proc] = []
    try:
        broker = Proc(["broker", *sum((["--" + k, "tcp://127.0.0.1:*"] for k in ("frontend", "backend", "stream-in", "stream-out", "stats")), []),
                       "--cluster-secret-file", str(secret)], tmp / "broker.log", env)
        procs.append(broker)
        ends = broker.ready()
        worker = Proc(["worker", "--role", "hybrid", "--model", str(tiny_model_dir), "--broker-backend", ends["backend"],
                       "--broker-stream", ends["stream_in"], "--parallel", "32", "--cluster-secret-file", str(secret)],
                      tmp / "worker.log", env)
        procs.append(worker)
        worker.ready()
        port = _free_port()
        edge = Proc(["edge", "--bind", f"127.0.0.1:{port}", "--workers", "2", "--model", str(tiny_model_dir), "--model-name", "tiny",
                     "--broker", ends["frontend"], "--broker-stream", ends["stream_out"],
                     "--cluster-secret-file", str(secret), "--api-key", API_KEY, "--max-request-bytes", "65536"],
                    tmp / "edge.log", dict(env, TANDEM_EDGE_KEEPALIVE_S="0.2"))
        procs.append(edge)
        info = edge.ready()
        base = info["url"]
        deadline = time.monotonic() + READY_TIMEOUT_S
        while _get(port, "/ready")[0] != 200:  # the worker registers with the broker
            assert time.monotonic() < deadline, "edge never became ready"
            time.sleep(0.2)
        yield {"port": port, "base": base + "/v1", "logs": tmp, "env": env, "ends": ends, "secret": secret,
               "model": tiny_model_dir}
    finally:
        for p in reversed(procs):
            p.kill()


@pytest.fixture(scope="module")
def oracle(tiny_model_dir):
    from tandem.pipeline.generate import generate_tokens
    from tandem.pipeline.loader import load_model

    loaded = load_model(tiny_model_dir)
    tok = loaded.tokenizer

    def run(prompt_tokens: list[int], max_tokens: int) -> list[int]:
        return generate_tokens(loaded, prompt_tokens, max_tokens=max_tokens, temperature=0.0)

    def chat_tokens(messages) -> list[int]:
        return list(tok.apply_chat_template(messages, add_generation_prompt=True))

    run.chat_tokens = chat_tokens
    run.encode = lambda text: list(tok.encode(text))
    return run


@pytest.fixture(scope="module")
def edge_tok(tiny_model_dir):
    from tandem.http.tokenizer import load_tokenizer

    return load_tokenizer(tiny_model_dir)


def _client(stack, key=API_KEY, **kw):
    return openai.OpenAI(base_url=stack["base"], api_key=key, max_retries=0, timeout=60, **kw)


def _get(port: int, path: str, headers: dict | None = None):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request("GET", path, headers=headers or {})
        r = conn.getresponse()
        return r.status, r.read()
    except OSError:
        return 0, b""
    finally:
        conn.close()


def _post_raw(port: int, path: str, body: bytes, headers: dict | None = None):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request("POST", path, body=body, headers={"Authorization": f"Bearer {API_KEY}",
                                                       "Content-Type": "application/json", **(headers or {})})
        r = conn.getresponse()
        return r.status, {k.lower(): v for k, v in r.getheaders()}, r.read()
    finally:
        conn.close()


def _expected(edge_tok, tokens: list[int], max_tokens: int):
    text = edge_tok.decode(tokens)
    finish = "stop" if tokens and tokens[-1] in edge_tok.eos_token_ids else "length"
    assert finish == "stop" or len(tokens) == max_tokens
    return text, finish


@pytest.mark.parametrize("stream", [False, True])
def test_chat_matches_greedy_oracle(stack, oracle, edge_tok, stream):
    want = oracle(oracle.chat_tokens(MESSAGES), 24)
    text, finish = _expected(edge_tok, want, 24)
    client = _client(stack)
    if stream:
        chunks = list(client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=24, temperature=0,
                                                     stream=True, logprobs=True))
        got = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        got_finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
        lps = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    else:
        r = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=24, temperature=0, logprobs=True)
        got, got_finish, lps = r.choices[0].message.content, [r.choices[0].finish_reason], r.choices[0].logprobs.content
        assert r.usage.prompt_tokens == len(oracle.chat_tokens(MESSAGES))
        assert r.usage.completion_tokens == len(want)
    assert got == text
    assert got_finish == [finish]
    # Token by token: the bytes of every generated token equal the oracle's.
    assert [bytes(e.bytes) for e in lps] == [edge_tok.raw_bytes(t) for t in want]


@pytest.mark.parametrize("stream", [False, True])
def test_completions_match_greedy_oracle(stack, oracle, edge_tok, stream):
    prompt = "The quick brown fox"
    want = oracle(oracle.encode(prompt), 16)
    text, finish = _expected(edge_tok, want, 16)
    client = _client(stack)
    if stream:
        chunks = list(client.completions.create(model="tiny", prompt=prompt, max_tokens=16, temperature=0, stream=True))
        got = "".join(c.choices[0].text for c in chunks if c.choices)
        got_finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    else:
        r = client.completions.create(model="tiny", prompt=prompt, max_tokens=16, temperature=0)
        got, got_finish = r.choices[0].text, [r.choices[0].finish_reason]
    assert (got, got_finish) == (text, [finish])


def test_include_usage_chunk(stack, oracle):
    client = _client(stack)
    chunks = list(client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=8, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    last = chunks[-1]
    assert last.choices == [] and last.usage is not None
    assert all(c.usage is None for c in chunks[:-1])
    assert last.usage.prompt_tokens == len(oracle.chat_tokens(MESSAGES))
    assert last.usage.total_tokens == last.usage.prompt_tokens + last.usage.completion_tokens
    assert last.usage.prompt_tokens_details.cached_tokens >= 0
    # The same prompt again: the worker's prefix cache serves whole blocks of it.
    again = list(client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=8, temperature=0,
                                                stream=True, stream_options={"include_usage": True}))[-1]
    assert last.usage.prompt_tokens > 16, "the prompt must span a full KV block for this check"
    assert 0 < again.usage.prompt_tokens_details.cached_tokens < again.usage.prompt_tokens


def test_cached_tokens_reported_when_a_stop_string_ends_the_choice(stack, oracle, edge_tok):
    """A stop string makes the edge abort the request before the worker's final
    message, so the cached count has to come from the stream's first message."""
    prompt = "Once upon a time " * 12  # longer than one 16-token block
    want = oracle(oracle.encode(prompt), 24)
    full = edge_tok.decode(want)
    stop = next((full[i:i + 3] for i in range(4, len(full) - 3) if "\ufffd" not in full[i:i + 3]), None)
    if stop is None:
        pytest.skip(f"greedy text of the random model has no usable stop string: {full!r}")
    client = _client(stack)
    client.completions.create(model="tiny", prompt=prompt, max_tokens=24, temperature=0)  # warm the prefix cache
    r = client.completions.create(model="tiny", prompt=prompt, max_tokens=24, temperature=0, stop=[stop])
    assert r.choices[0].finish_reason == "stop"
    assert 0 < r.usage.prompt_tokens_details.cached_tokens < r.usage.prompt_tokens


def test_stop_string_cuts_greedy_text(stack, oracle, edge_tok):
    want = oracle(oracle.encode("Hello"), 32)
    full = edge_tok.decode(want)
    clean = full.replace("\ufffd", "")
    stop = next((full[i:i + 3] for i in range(4, len(full) - 3) if "\ufffd" not in full[i:i + 3]), None)
    if stop is None or not clean:
        pytest.skip(f"greedy text of the random model has no usable stop string: {full!r}")
    r = _client(stack).completions.create(model="tiny", prompt="Hello", max_tokens=32, temperature=0, stop=[stop])
    assert r.choices[0].text == full[: full.index(stop)]
    assert r.choices[0].finish_reason == "stop"
    assert stop not in r.choices[0].text


def test_n_two_and_logprobs(stack, oracle, edge_tok):
    want = oracle(oracle.chat_tokens(MESSAGES), 10)
    r = _client(stack).chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=10, temperature=0, n=2,
                                               logprobs=True, top_logprobs=3)
    assert [c.index for c in r.choices] == [0, 1]
    for c in r.choices:
        assert c.message.content == edge_tok.decode(want)
        for entry in c.logprobs.content:
            assert len(entry.top_logprobs) == 3
            # Greedy picks the most likely token: it heads the top list.
            assert entry.top_logprobs[0].bytes == entry.bytes
            assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob, abs=1e-4)
    assert r.usage.completion_tokens == 2 * len(want)


@pytest.mark.parametrize("kwargs,exc,status,code", [
    ({"presence_penalty": 2.5}, "BadRequestError", 400, "invalid_value"),
    ({"extra_body": {"frobnicate": 1}}, "BadRequestError", 400, "unknown_parameter"),
    ({"temperature": 5}, "BadRequestError", 400, "invalid_value"),
    ({"n": 100}, "BadRequestError", 400, "invalid_value"),
    ({"max_tokens": 100000}, "BadRequestError", 400, "context_length_exceeded"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": []}}]}, "BadRequestError", 400, "invalid_type"),
    ({"model": "gpt-4o"}, "NotFoundError", 404, "model_not_found"),
])
def test_bad_requests_via_openai(stack, kwargs, exc, status, code):
    args = {"model": "tiny", "messages": MESSAGES, "max_tokens": 4, **kwargs}
    with pytest.raises(getattr(openai, exc)) as info:
        _client(stack).chat.completions.create(**args)
    assert info.value.status_code == status
    err = info.value.response.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == code


@pytest.mark.parametrize("body,status,code", [
    (b"{not json", 400, "invalid_json"),
    (json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "x" * 70000}]}).encode(), 413, "request_too_large"),
    (json.dumps({"model": "tiny", "messages": []}).encode(), 400, "invalid_value"),
])
def test_bad_bodies_raw(stack, body, status, code):
    got, _, raw = _post_raw(stack["port"], "/v1/chat/completions", body)
    assert got == status and json.loads(raw)["error"]["code"] == code


def test_auth_required(stack):
    with pytest.raises(openai.AuthenticationError) as info:
        _client(stack, key="wrong").chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=2)
    assert info.value.status_code == 401
    assert _get(stack["port"], "/v1/models")[0] == 401
    assert _get(stack["port"], "/v1/models", {"Authorization": f"Bearer {API_KEY}"})[0] == 200
    assert _get(stack["port"], "/health")[0] == 200


def _worker_load(port: int) -> dict:
    status, raw = _get(port, "/v1/stats", {"Authorization": f"Bearer {API_KEY}"})
    assert status == 200, raw
    stats = json.loads(raw)
    (w,) = stats["workers"]
    assert not any(k in json.dumps(stats) for k in ("tcp://", "127.0.0.1"))  # redacted
    return {"used_blocks": w["used_blocks"], "running": w["running"], "inflight": w["inflight"]}


def test_disconnect_mid_stream_frees_worker_blocks(stack):
    port = stack["port"]
    body = json.dumps({"model": "tiny", "prompt": "The quick brown fox " * 20, "max_tokens": 3000,
                       "temperature": 0, "ignore_eos": True, "stream": True}).encode()
    sock = socket.create_connection(("127.0.0.1", port), timeout=30)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 + f"Authorization: Bearer {API_KEY}\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
    received = b""
    while received.count(b"data: ") < 5:
        received += sock.recv(65536)
    assert received.startswith(b"HTTP/1.1 200")
    deadline = time.monotonic() + 10
    while not ((during := _worker_load(port))["used_blocks"] > 0 and during["running"] == 1):
        # The broker learns a worker's load from its heartbeats: wait for one.
        assert time.monotonic() < deadline, f"the worker never reported the request: {during}"
        time.sleep(0.1)
    sock.close()
    deadline = time.monotonic() + 20
    while (load := _worker_load(port)) != {"used_blocks": 0, "running": 0, "inflight": 0}:
        assert time.monotonic() < deadline, f"worker still holds the request: {load}"
        time.sleep(0.2)


def test_two_hundred_concurrent_streams_complete(stack):
    async def one(client, i):
        stream = await client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": f"request {i}"}], max_tokens=6, temperature=0,
            stream=True, stream_options={"include_usage": True})
        finish, usage = None, None
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].finish_reason:
                finish = chunk.choices[0].finish_reason
            usage = chunk.usage or usage
        return finish, usage

    async def main():
        client = openai.AsyncOpenAI(base_url=stack["base"], api_key=API_KEY, max_retries=0, timeout=120)
        try:
            return await asyncio.gather(*(one(client, i) for i in range(200)), return_exceptions=True)
        finally:
            await client.close()

    results = asyncio.run(main())
    errors = [r for r in results if isinstance(r, BaseException)]
    assert not errors, f"{len(errors)} failed, first: {errors[0]!r}"
    assert all(f in ("stop", "length") and u is not None and u.completion_tokens >= 1 for f, u in results)


def _metric_sum(port: int, prefix: str) -> float:
    status, raw = _get(port, "/metrics")
    assert status == 200
    return sum(float(line.split()[-1]) for line in raw.decode().splitlines() if line.startswith(prefix))


def test_metrics_aggregate_across_gunicorn_workers(stack):
    port = stack["port"]
    before = _metric_sum(port, "tandem_requests_total{")
    refused_before = _metric_sum(port, 'tandem_requests_refused_total{reason="unsupported_parameter"}')
    for _ in range(6):  # fresh connections: gunicorn hands them to either worker
        status, _, _ = _post_raw(port, "/v1/completions", json.dumps({"model": "tiny", "prompt": "a", "max_tokens": 2}).encode(),
                                 {"Connection": "close"})
        assert status == 200
    status, _, _ = _post_raw(port, "/v1/completions", json.dumps({"model": "tiny", "prompt": "a", "echo": True}).encode())
    assert status == 400
    assert _metric_sum(port, "tandem_requests_total{") == before + 6
    assert _metric_sum(port, 'tandem_requests_refused_total{reason="unsupported_parameter"}') == refused_before + 1
    text = _get(port, "/metrics")[1].decode()
    for name in ("tandem_requests_running", "tandem_requests_waiting", "tandem_time_to_first_token_seconds_bucket",
                 "tandem_inter_token_latency_seconds_bucket", "tandem_request_duration_seconds_bucket",
                 "tandem_prompt_tokens_total", "tandem_generation_tokens_total", "tandem_prefix_cache_hit_ratio",
                 "tandem_kv_cache_usage_ratio", "tandem_broker_up 1.0"):
        assert name in text, name


def test_sigterm_drains_open_streams(stack):
    """SIGTERM to `tandem edge` stops new connections but lets an open stream finish."""
    tmp = stack["logs"]
    port = _free_port()
    edge = Proc(["edge", "--bind", f"127.0.0.1:{port}", "--model", str(stack["model"]), "--model-name", "tiny",
                 "--broker", stack["ends"]["frontend"], "--broker-stream", stack["ends"]["stream_out"],
                 "--cluster-secret-file", str(stack["secret"])], tmp / "edge-drain.log", stack["env"])
    try:
        edge.ready()
        body = json.dumps({"model": "tiny", "prompt": "drain", "max_tokens": 1500, "temperature": 0,
                           "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}).encode()
        sock = socket.create_connection(("127.0.0.1", port), timeout=60)
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     + f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode() + body)
        received = b""
        while b"data: " not in received:
            received += sock.recv(65536)
        edge.p.send_signal(signal.SIGTERM)  # the command forwards it to gunicorn's master
        while chunk := sock.recv(65536):
            received += chunk
        sock.close()
        assert edge.p.wait(30) == 0
        # gunicorn saw the stream still open when it began to stop, and waited for it.
        assert "Waiting for 1 connections to finish" in (tmp / "edge-drain.log").read_text()
        assert b"data: [DONE]" in received
        usage = [json.loads(line[6:]) for line in received.split(b"\n")
                 if line.startswith(b"data: {") and b'"choices":[]' in line]
        assert usage and usage[0]["usage"]["completion_tokens"] == 1500
        assert _get(port, "/health")[0] == 0  # no longer listening
    finally:
        edge.kill()


def test_backpressure_and_unreachable_broker_are_503(stack):
    """A broker with no worker refuses (503 + Retry-After); a dead broker is 503 unavailable."""
    tmp, env = stack["logs"], dict(stack["env"], TANDEM_EDGE_BROKER_TIMEOUT_S="1")
    secret = str(stack["secret"])
    broker = Proc(["broker", *sum((["--" + k, "tcp://127.0.0.1:*"] for k in ("frontend", "backend", "stream-in", "stream-out", "stats")), []),
                   "--cluster-secret-file", secret], tmp / "broker-empty.log", env)
    edge = None
    try:
        ends = broker.ready()
        port = _free_port()
        edge = Proc(["edge", "--bind", f"127.0.0.1:{port}", "--model", str(stack["model"]), "--model-name", "tiny",
                     "--broker", ends["frontend"], "--broker-stream", ends["stream_out"], "--cluster-secret-file", secret],
                    tmp / "edge-empty.log", env)
        edge.ready()
        body = json.dumps({"model": "tiny", "messages": MESSAGES, "max_tokens": 4, "stream": True}).encode()
        status, headers, raw = _post_raw(port, "/v1/chat/completions", body)
        assert status == 503 and int(headers["retry-after"]) >= 1
        assert json.loads(raw)["error"]["code"] == "no_worker"
        assert _get(port, "/ready")[0] == 503
        broker.kill()
        status, headers, raw = _post_raw(port, "/v1/chat/completions", body)
        assert status == 503 and json.loads(raw)["error"]["code"] == "unavailable"
        assert _get(port, "/health")[0] == 200
    finally:
        if edge is not None:
            edge.kill()
        broker.kill()
