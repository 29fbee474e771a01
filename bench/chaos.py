"""Chaos and soak: the whole stack under mixed load and a seeded fault schedule, checked
for lost, repeated or reordered tokens, hung requests or processes, leaked KV blocks and
growing memory.

    .venv/bin/python bench/chaos.py --minutes 30 --seed 1 --out docs/benchmarks
    .venv/bin/python bench/chaos.py --netns --minutes 30 --seed 1 --out docs/benchmarks   (root)

The stack (bench/chaos_stack.py): broker, 2 prefill + 2 decode workers, the edge with 2
gunicorn workers, supervised and restarted as ``tandem serve`` does. On loopback every
broker link and each decode worker's KV ingest goes through a cuttable proxy; with
``--netns`` every process (and this client) is on a host of its own, a network namespace,
and a cut drops the packets between two hosts, so connections stall rather than reset
(tests/ops/netns.py builds the hosts). Before any fault, every request of a seeded catalogue (chat and
completions; temperature 0 and seeded temperature 0.8; n 1-2; stop strings; logprobs;
short, shared-prefix and long prompts that park in chunked prefill) runs once on the
undisturbed stack: its texts are the reference. Then, for ``--minutes``, client loops send
catalogue requests (streaming or not, some read slowly, some abort at a random point)
while a fault loop SIGKILLs or SIGSTOPs (1-8 s) a random process of a random role,
restarts the broker, cuts a process's broker links or a prefill -> decode KV path for
seconds (across hosts also a whole host's cable), fills the decode workers' KV until they
refuse, and plays the named scenarios (abort during KV wait, decode refusing before
admission, prefill death mid-transfer, transfer timeout, KV link cut mid-transfer, broker
restart mid-handoff); garbage and oversized HTTP and hostile ZeroMQ peers arrive
throughout.

Every request ends in one class: ``exact`` (every choice's text equals the reference),
``failed_clean`` (an HTTP error or an SSE error event with an OpenAI error body, and what
streamed before it a prefix of the reference), ``aborted`` (by this client; what streamed
a prefix), ``severed`` (the connection dropped without an error while the edge process
serving it was being killed: nothing could have answered), ``unclean`` (anything else),
or ``hung`` (open past its deadline). Text that is not a prefix of its reference counts
its tokens as lost (the reference's rest) and duplicated (the output's rest). Requests
with logprobs are also checked token by token: the (token, logprob) sequence streamed
must be the reference's (or a prefix of it), logprobs equal up to float rounding, so a
token lost, repeated or reordered shows even where the text would hide it. At the end
the faults stop, every stopped process resumes, links come back, and the run waits for
the broker to see every worker with all KV blocks free; blocks still in use are
``leaked_blocks``. ``rss_growth_mb`` is the largest resident-memory growth of any
process that lived long enough to measure, from its warm-up to its end, net of what
its heartbeats say is no leak: the bytes its KV store holds (it grows once to its block
budget as prefixes are cached), the bytes of its decode mirror (the decode batch's KV
copied contiguous; its buffers grow to the largest batch x context decoded, then stay), and
the freed memory it keeps for reuse: glibc's free heap, the top chunk's resident pages
included (tandem._malloc keeps freed memory by design, so resident memory is the
high-water mark of what a worker ever held at once), and MLX's buffer cache of freed
arrays.
``rss_raw_growth_mb`` is the same without subtracting them.

The last line of output is one JSON object (requests, completed_exact, failed_clean,
lost_tokens, duplicated_tokens, hung, leaked_blocks, faults, rss_growth_mb, ...).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from _common import ROOT, http_body_chunks, machine, sse_data  # noqa: F401  (puts the repository first on sys.path)
from chaos_stack import Stack, resume_all, rss_mb, send_signal

WORDS = ("river valley farmers forests marshes stone walls fields villages market towns roads canals merchants "
         "grain wool timber salt coast floods monasteries harvests engineers railways barges quick brown fox").split()
DEADLINE_S = 120.0


# ---------------------------------------------------------------- catalogue -------------

@dataclass
class Spec:
    """One catalogue entry: an OpenAI request body and the endpoint it goes to."""

    key: int
    path: str
    body: dict
    ref: list[str] | None = None  # one text per choice, from the undisturbed run
    ref_tokens: list[list[tuple[bytes, float]]] | None = None  # with logprobs: (token, logprob) per choice
    long: bool = False


def _text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


def catalogue(seed: int, size: int) -> list[Spec]:
    rng = random.Random(seed)
    shared = "Background: " + _text(rng, 40)
    specs = []
    for key in range(size):
        kind = rng.choice(("short", "short", "shared", "shared", "long"))
        prompt = {"short": lambda: _text(rng, rng.randint(3, 20)),
                  "shared": lambda: shared + " Question: " + _text(rng, rng.randint(2, 10)),
                  "long": lambda: _text(rng, rng.randint(100, 160))}[kind]()
        body: dict = {"max_tokens": rng.randint(4, 40), "n": rng.choice((1, 1, 1, 2))}
        if rng.random() < 0.5:
            body["temperature"] = 0
        else:
            body.update(temperature=0.8, seed=rng.randint(0, 2**31))
        path = "/v1/chat/completions" if rng.random() < 0.75 else "/v1/completions"
        if path == "/v1/chat/completions":
            body["messages"] = [{"role": "user", "content": prompt}]
            if rng.random() < 0.25:
                body.update(logprobs=True, top_logprobs=2)
        else:
            body["prompt"] = prompt
            if rng.random() < 0.25:
                body["logprobs"] = 2
        if rng.random() < 0.3:
            body["stop"] = ["__STOP_FROM_REFERENCE__"]  # replaced by a piece of the reference text
        specs.append(Spec(key, path, body, long=kind == "long"))
    return specs


def kv_fill_specs(seed: int, count: int) -> list[Spec]:
    """Long prompts with long answers: a burst of them fills a decode worker's small pool."""
    rng = random.Random(seed + 7919)
    return [Spec(10_000 + i, "/v1/chat/completions",
                 {"messages": [{"role": "user", "content": _text(rng, rng.randint(150, 200))}],
                  "max_tokens": 160, "temperature": 0, "ignore_eos": True}, long=True) for i in range(count)]


# ---------------------------------------------------------------- one request -----------

@dataclass
class Outcome:
    spec: int
    kind: str  # exact | failed_clean | aborted | severed | unclean | hung | mismatch
    texts: list[str] = field(default_factory=list)
    tokens: list[list[tuple[bytes, float]]] | None = None  # when the request asked for logprobs
    detail: str = ""
    t0: float = 0.0
    t1: float = 0.0
    stream: bool = False


def _is_openai_error(obj) -> bool:
    return (isinstance(obj, dict) and isinstance(obj.get("error"), dict)
            and isinstance(obj["error"].get("message"), str) and "type" in obj["error"])


def _token_key(label: str) -> bytes:
    """A completions logprobs token label as bytes (``bytes:\\xe2`` names a partial character)."""
    if label.startswith("bytes:"):
        return bytes(int(h, 16) for h in label[len("bytes:"):].split("\\x")[1:])
    return label.encode()


def _logprob_tokens(lp) -> list[tuple[bytes, float]]:
    """(token bytes, logprob) of each token of a choice's ``logprobs`` (chat or completions shape)."""
    if not lp:
        return []
    if "content" in lp:
        return [(bytes(t["bytes"]), float(t["logprob"])) for t in lp["content"] or []]
    return [(_token_key(t), float(v)) for t, v in zip(lp["tokens"], lp["token_logprobs"])]


def wants_logprobs(body: dict) -> bool:
    lp = body.get("logprobs")
    return lp is True or (type(lp) is int and "prompt" in body)


async def _read_head(reader) -> tuple[int, dict]:
    status_line = await reader.readline()
    if not status_line:
        raise ConnectionResetError("connection closed before a status line")
    headers = {}
    while (line := await reader.readline()) not in (b"\r\n", b"\n", b""):
        k, _, v = line.decode("latin-1").partition(":")
        headers[k.strip().lower()] = v.strip()
    return int(status_line.split()[1]), headers


async def send(http: tuple[str, int], spec: Spec, *, stream: bool, abort_after: int | None, slow: bool) -> Outcome:
    """Send one catalogue request and classify how it ended (before the reference check)."""
    body = dict(spec.body, stream=stream)
    n = body.get("n", 1)
    payload = json.dumps(body).encode()
    out = Outcome(spec.key, "unclean", [""] * n, t0=time.monotonic(), stream=stream)
    if wants_logprobs(body):
        out.tokens = [[] for _ in range(n)]
    host, port = http
    try:
        reader, writer = await asyncio.open_connection(host, port, limit=1 << 22)
    except OSError as exc:
        out.detail = f"connect: {exc}"
        out.kind = "refused"
        out.t1 = time.monotonic()
        return out
    try:
        writer.write(f"POST {spec.path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {len(payload)}\r\nConnection: close\r\n\r\n".encode() + payload)
        await writer.drain()
        async with asyncio.timeout(DEADLINE_S):
            status, headers = await _read_head(reader)
            if status != 200 or not stream:
                raw = b"".join([c async for c in http_body_chunks(reader, headers)])
                obj = json.loads(raw) if raw else None
                if status != 200:
                    out.kind = "failed_clean" if _is_openai_error(obj) and status in (429, 500, 502, 503, 504) else "unclean"
                    out.detail = f"HTTP {status}: {raw[:200]!r}"
                    return out
                for choice in obj["choices"]:
                    msg = choice.get("message")
                    out.texts[choice["index"]] = msg["content"] if msg is not None else choice["text"]
                    if out.tokens is not None:
                        out.tokens[choice["index"]] = _logprob_tokens(choice.get("logprobs"))
                out.kind = "exact"  # provisional: checked against the reference later
                return out
            events, finished = 0, set()
            async for payload in sse_data(reader, headers):
                if payload == b"[DONE]":
                    if len(finished) != n:
                        out.detail = f"[DONE] with {len(finished)} of {n} choices finished"
                        return out
                    out.kind = "exact"
                    return out
                chunk = json.loads(payload)
                if "error" in chunk:
                    out.kind = "failed_clean" if _is_openai_error(chunk) else "unclean"
                    out.detail = f"stream error: {chunk['error']}"
                    return out
                for choice in chunk.get("choices") or []:
                    i = choice["index"]
                    piece = (choice.get("delta") or {}).get("content") if "delta" in choice else choice.get("text")
                    toks = _logprob_tokens(choice.get("logprobs")) if out.tokens is not None else []
                    if piece or toks:
                        if i in finished:
                            out.detail = f"choice {i} got text after its finish_reason"
                            return out
                        out.texts[i] += piece or ""
                        if toks:
                            out.tokens[i] += toks
                    if choice.get("finish_reason"):
                        finished.add(i)
                events += 1
                if abort_after is not None and events >= abort_after:
                    out.kind = "aborted"
                    return out
                if slow:
                    await asyncio.sleep(0.2)
            out.detail = "stream ended without [DONE]"
            out.kind = "severed"
            return out
    except TimeoutError:
        out.kind = "hung"
        out.detail = f"open past its {DEADLINE_S:.0f} s deadline"
        return out
    except (OSError, asyncio.IncompleteReadError, ConnectionResetError) as exc:
        out.kind = "severed"
        out.detail = f"{type(exc).__name__}: {exc}"
        return out
    except (ValueError, KeyError, TypeError) as exc:
        out.detail = f"malformed answer: {type(exc).__name__}: {exc}"
        return out
    finally:
        out.t1 = time.monotonic()
        writer.transport.abort()


LOGPROB_TOLERANCE = 1e-3  # the same token scored in another batch may differ in float rounding, not more


def token_diff(got, ref, *, complete: bool, ids: dict[bytes, int] | None = None) -> tuple[list[str], int, int, float]:
    """Compare per-choice (token bytes, logprob) sequences with the reference's: each must
    equal it (``complete``) or be a prefix of it, token by token, with logprobs within
    :data:`LOGPROB_TOLERANCE`. Returns (problems, tokens lost, tokens duplicated, the
    largest logprob difference among matching tokens)."""
    if got is None or ref is None:
        return [], 0, 0, 0.0
    problems, lost, dup, worst = [], 0, 0, 0.0
    name = (lambda t: f"{ids.get(t[0], '?')}:{t[0]!r}") if ids else (lambda t: repr(t[0]))
    for i, (g, r) in enumerate(zip(got, ref)):
        common = 0
        while common < min(len(g), len(r)) and g[common][0] == r[common][0]:
            common += 1
        for k, ((_, a), (_, b)) in enumerate(zip(g[:common], r[:common])):
            diff = abs(a - b) if a != b else 0.0  # equal infinities match
            worst = max(worst, diff)
            if diff > LOGPROB_TOLERANCE:
                problems.append(f"choice {i} token {k} ({name(g[k])}): logprob {a} want {b}")
                break
        if common < len(g) or (complete and common < len(r)):
            lost += len(r) - common
            dup += len(g) - common
            problems.append(f"choice {i} token {common}: got {[name(t) for t in g[common:common + 3]]} "
                            f"want {[name(t) for t in r[common:common + 3]]} ({len(g)} vs {len(r)} tokens)")
    return problems, lost, dup, worst


# ---------------------------------------------------------------- hostile input ---------

GARBAGE = [
    b"\x00\xff" * 300,
    b"GET / HTTP/1.1\r\nHost: x\r\nContent-Length: -5\r\n\r\n",
    b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
    b"GARBAGE" * 2000 + b"\r\n\r\n",
]
BAD_BODIES = [  # (body, statuses that count as a clean answer)
    (b"{not json", (400,)),
    (json.dumps({"messages": [{"role": "user", "content": "x"}], "n": 1000}).encode(), (400,)),
    (json.dumps({"messages": [{"role": "user", "content": "x"}], "max_tokens": -3}).encode(), (400,)),
    (json.dumps({"messages": "nope"}).encode(), (400,)),
    (json.dumps({"messages": [{"role": "user", "content": "x" * (3 << 20)}]}).encode(), (413,)),
]


async def garbage_http(http: tuple[str, int], rng: random.Random) -> tuple[str, str]:
    """One hostile HTTP exchange; returns (kind, detail): clean when the edge answered an
    error body of OpenAI's shape (or closed on bytes that are not HTTP)."""
    host, port = http
    try:
        reader, writer = await asyncio.open_connection(host, port)
    except OSError as exc:
        return "severed", f"connect: {exc}"
    try:
        if rng.random() < 0.4:
            junk = rng.choice(GARBAGE)
            writer.write(junk)
            await writer.drain()
            try:
                async with asyncio.timeout(15):
                    await reader.read(1 << 16)
            except TimeoutError:
                return "unclean", f"no answer within 15 s to garbage {junk[:60]!r}"
            return "clean", "raw garbage"
        body, ok = rng.choice(BAD_BODIES)
        writer.write(f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode())
        writer.write(body)
        try:
            await writer.drain()
        except OSError:
            pass  # the edge may refuse an oversized body before reading it all
        async with asyncio.timeout(15):
            status, headers = await _read_head(reader)
            raw = b"".join([c async for c in http_body_chunks(reader, headers)])
        clean = status in ok and _is_openai_error(json.loads(raw))
        return ("clean" if clean else "unclean"), f"HTTP {status}: {raw[:160]!r}"
    except TimeoutError:
        return "unclean", "no answer to garbage within 15 s"
    except (OSError, asyncio.IncompleteReadError, ValueError) as exc:
        return "severed", f"{type(exc).__name__}: {exc}"
    finally:
        writer.transport.abort()


def hostile_zmq(stack: Stack, rng: random.Random) -> str:
    """A peer without the cluster secret (plain ZeroMQ, a wrong CURVE key, or raw TCP bytes)
    talks to a broker socket or a decode worker's KV port; nothing should reach anyone."""
    import socket as _socket

    import zmq

    from tandem.wire.sockets import make_socket

    host, port = rng.choice(stack.zmq_targets())
    how = rng.choice(("plain", "wrong-key", "tcp"))
    if how == "tcp":
        try:
            with _socket.create_connection((host, port), timeout=2) as s:
                s.sendall(os.urandom(rng.randint(1, 4096)))
        except OSError:
            pass
        return f"tcp:{port}"
    ctx = zmq.Context.instance()
    security = os.urandom(32).hex().encode() if how == "wrong-key" else None
    sock = make_socket(ctx, zmq.DEALER, connect=f"tcp://{host}:{port}", security=security)
    try:
        for _ in range(3):
            sock.send_multipart([os.urandom(rng.randint(0, 64)) for _ in range(rng.randint(1, 4))], zmq.NOBLOCK)
        time.sleep(0.2)
    except zmq.ZMQError:
        pass
    finally:
        sock.close(0)
    return f"{how}:{port}"


# ---------------------------------------------------------------- the run ---------------

class Run:
    def __init__(self, stack: Stack, specs: list[Spec], fill: list[Spec], seed: int, minutes: float,
                 clients: int, fault_every_s: float, log):
        self.stack = stack
        self.specs = {s.key: s for s in specs + fill}
        self.catalogue = specs
        self.fill = fill
        self.seed = seed
        self.minutes = minutes
        self.clients = clients
        self.fault_every_s = fault_every_s
        self.log = log
        self.outcomes: list[Outcome] = []
        self.scenario_of: dict[int, str] = {}  # id(outcome) -> scenario name
        self.faults: list[dict] = []
        self.scenarios: Counter = Counter()
        self.scenario_evidence: Counter = Counter()
        self.hostile: Counter = Counter()
        self.hostile_examples: list[str] = []
        self.reference_failures: list[str] = []
        self.stopped: set[int] = set()
        self.unplugged: set[str] = set()
        self.edge_kills: list[float] = []  # times an edge process was killed (severed streams are excused near them)
        # pid -> (time, name, RSS MB, MB of it that is no leak (KV store + freed heap the
        # allocator keeps): 0 for a process that reports none, None if unknown)
        self.rss: dict[int, list[tuple[float, str, float, float | None]]] = {}
        self.t_start = 0.0
        self.stop_event = asyncio.Event()

    # ------------------------------------------------------------ reference
    async def reference(self) -> None:
        """Every catalogue request once on the undisturbed stack (4 at a time), twice when it
        asks for a stop string: once to find one in its text, once with it. A request the
        undisturbed stack cannot answer is itself a finding: it is reported and left out."""
        sem = asyncio.Semaphore(4)

        async def one(spec: Spec) -> None:
            async with sem:
                if spec.body.get("stop") == ["__STOP_FROM_REFERENCE__"]:
                    plain = Spec(spec.key, spec.path, {k: v for k, v in spec.body.items() if k != "stop"})
                    o = await send(self.stack.http, plain, stream=False, abort_after=None, slow=False)
                    text = o.texts[0] if o.kind == "exact" else ""
                    piece = text[len(text) // 2: len(text) // 2 + 3] if len(text) >= 6 else ""
                    if piece.strip():
                        spec.body["stop"] = [piece]
                    else:
                        del spec.body["stop"]
                for _ in range(3):
                    o = await send(self.stack.http, spec, stream=False, abort_after=None, slow=False)
                    if o.kind == "exact":
                        spec.ref, spec.ref_tokens = o.texts, o.tokens
                        return
                self.reference_failures.append(f"spec {spec.key}: {o.kind} {o.detail[:300]}")

        await asyncio.gather(*(one(s) for s in self.specs.values()))
        self.catalogue = [s for s in self.catalogue if s.ref is not None]
        self.fill = [s for s in self.fill if s.ref is not None]
        # The same requests streamed must give the same texts and tokens (checked undisturbed).
        with_logprobs = [s for s in self.catalogue if s.ref_tokens is not None]
        for spec in self.catalogue[:8] + with_logprobs[:4]:
            o = await send(self.stack.http, spec, stream=True, abort_after=None, slow=False)
            if o.kind != "exact" or o.texts != spec.ref or token_diff(o.tokens, spec.ref_tokens, complete=True)[0]:
                self.reference_failures.append(f"spec {spec.key} streamed: {o.kind} {o.detail[:200]} {o.texts!r} vs {spec.ref!r}")

    # ------------------------------------------------------------ load
    async def request(self, spec: Spec, rng: random.Random, scenario: str | None = None, **kw) -> Outcome:
        stream = kw.pop("stream", rng.random() < 0.6)
        abort_after = kw.pop("abort_after", rng.randint(1, 8) if stream and rng.random() < 0.12 else None)
        slow = kw.pop("slow", stream and rng.random() < 0.1)
        o = await send(self.stack.http, spec, stream=stream, abort_after=abort_after, slow=slow)
        self.outcomes.append(o)
        if scenario:
            self.scenario_of[id(o)] = scenario
        return o

    async def client_loop(self, i: int) -> None:
        rng = random.Random(f"{self.seed}-client-{i}")
        while not self.stop_event.is_set():
            o = await self.request(rng.choice(self.catalogue), rng)
            await asyncio.sleep(rng.random() * 0.3 + (0.5 if o.kind == "refused" else 0.0))

    async def hostile_loop(self) -> None:
        rng = random.Random(f"{self.seed}-hostile")
        while not self.stop_event.is_set():
            await asyncio.sleep(rng.uniform(0.5, 3.0))
            if rng.random() < 0.6:
                kind, detail = await garbage_http(self.stack.http, rng)
                self.hostile[f"http_{kind}"] += 1
                if kind == "unclean":
                    self.log(f"chaos | garbage HTTP got an unclean answer: {detail}")
                    self.hostile_examples.append(detail)
            else:
                await asyncio.to_thread(hostile_zmq, self.stack, rng)
                self.hostile["zmq"] += 1

    # ------------------------------------------------------------ faults
    def fault(self, kind: str, target: str, **detail) -> None:
        self.faults.append({"t": round(time.monotonic() - self.t_start, 1), "kind": kind, "target": target, **detail})
        self.log(f"chaos | fault {kind} {target} {detail if detail else ''}")

    def pid_of(self, name: str) -> int | None:
        if name == "edge-worker":
            pids = self.stack.edge_workers()
            return random.Random(time.monotonic()).choice(pids) if pids else None
        if name == "edge-arbiter":
            return self.stack.edge_arbiter()
        return self.stack.pid(name)

    def kill(self, name: str, sig: int = signal.SIGKILL) -> bool:
        pid = self.pid_of(name)
        if pid is None or not send_signal(pid, sig):
            return False
        if name.startswith("edge") and sig == signal.SIGKILL:
            self.edge_kills.append(time.monotonic())
        self.fault("sigkill" if sig == signal.SIGKILL else "sigterm", name, pid=pid)
        return True

    async def pause(self, name: str, seconds: float) -> None:
        pid = self.pid_of(name)
        if pid is not None and send_signal(pid, signal.SIGSTOP):
            self.stopped.add(pid)
            self.fault("sigstop", name, pid=pid, seconds=round(seconds, 1))
            await asyncio.sleep(seconds)
            send_signal(pid, signal.SIGCONT)
            self.stopped.discard(pid)

    async def cut(self, name: str, seconds: float, links: list | None = None, kind: str = "cut_link") -> None:
        """Cut ``links`` (default: ``name``'s broker links) for ``seconds``."""
        links = self.stack.links[name] if links is None else links
        if any(link.is_cut for link in links):
            return
        self.fault(kind, name, seconds=round(seconds, 1))
        for link in links:
            await link.cut()
        await asyncio.sleep(seconds)
        for link in links:
            await link.up()

    async def unplug(self, host: str, seconds: float) -> None:
        """Across hosts: a host loses its cable (every link of it at once)."""
        if host in self.unplugged:
            return
        self.unplugged.add(host)
        self.fault("unplug", host, seconds=round(seconds, 1))
        try:
            await asyncio.to_thread(self.stack.cluster.cut, host)
            await asyncio.sleep(seconds)
        finally:
            await asyncio.to_thread(self.stack.cluster.plug, host)
            self.unplugged.discard(host)

    async def long_requests(self, rng: random.Random, scenario: str, count: int = 3, stream: bool = True) -> list[asyncio.Task]:
        longs = [s for s in self.catalogue if s.long] or self.catalogue
        return [asyncio.create_task(self.request(rng.choice(longs), rng, scenario, stream=stream, abort_after=None, slow=False))
                for _ in range(count)]

    async def refusals(self) -> int:
        try:
            st = await asyncio.to_thread(self.stack.stats)
        except Exception:
            return -1
        return sum(w.get("refusals", 0) for w in st.get("workers", []))

    async def scenario(self, name: str, rng: random.Random) -> None:
        self.scenarios[name] += 1
        self.fault("scenario", name)
        decodes = ["decode-0", "decode-1"]
        if name == "abort_during_kv_wait":
            # Decode workers frozen: the prefill finishes and its KV waits for a decode that
            # does not answer; the client gives up meanwhile.
            pauses = [asyncio.create_task(self.pause(d, 2.5)) for d in decodes]
            longs = [s for s in self.catalogue if s.long] or self.catalogue
            tasks = [asyncio.create_task(self.request(rng.choice(longs), rng, name, stream=True, abort_after=None, slow=False))
                     for _ in range(2)]
            await asyncio.sleep(rng.uniform(0.8, 2.0))
            for t in tasks:
                t.cancel()
            for t in tasks:
                try:
                    await t
                except asyncio.CancelledError:
                    self.outcomes.append(o := Outcome(-1, "aborted", [], t0=time.monotonic(), t1=time.monotonic()))
                    self.scenario_of[id(o)] = name
            await asyncio.gather(*pauses)
        elif name == "decode_refuses_before_admission":
            before = await self.refusals()
            tasks = [asyncio.create_task(self.request(s, rng, name, stream=rng.random() < 0.5, abort_after=None, slow=False))
                     for s in self.fill]
            await asyncio.sleep(3.0)
            after = await self.refusals()
            if before >= 0 and after > before:
                self.scenario_evidence[name] += 1
            await asyncio.gather(*tasks)
        elif name == "prefill_death_mid_transfer":
            tasks = await self.long_requests(rng, name)
            await asyncio.sleep(rng.uniform(0.2, 2.5))
            self.kill(rng.choice(["prefill-0", "prefill-1"]))
            await asyncio.gather(*tasks)
        elif name == "transfer_timeout":
            tasks = await self.long_requests(rng, name)
            await asyncio.sleep(rng.uniform(0.2, 1.0))
            await asyncio.gather(*(self.pause(d, 5.5) for d in decodes))
            await asyncio.gather(*tasks)
        elif name == "kv_link_cut_mid_transfer":
            # Prefill -> decode KV paths into one decode worker fail while handoffs are in flight.
            tasks = await self.long_requests(rng, name)
            await asyncio.sleep(rng.uniform(0.1, 1.5))
            decode = rng.choice(decodes)
            await self.cut(decode, rng.uniform(2.0, 8.0), self.stack.kv_links_into(decode), kind="cut_kv")
            await asyncio.gather(*tasks)
        elif name == "broker_restart_mid_handoff":
            tasks = await self.long_requests(rng, name)
            await asyncio.sleep(rng.uniform(0.3, 2.0))
            self.kill("broker", rng.choice([signal.SIGKILL, signal.SIGTERM]))
            await asyncio.gather(*tasks)

    SCENARIOS = ("abort_during_kv_wait", "decode_refuses_before_admission", "prefill_death_mid_transfer",
                 "transfer_timeout", "kv_link_cut_mid_transfer", "broker_restart_mid_handoff")
    ROLES = ("broker", "prefill-0", "prefill-1", "decode-0", "decode-1", "edge", "edge-arbiter", "edge-worker", "edge-worker")

    async def fault_loop(self) -> None:
        rng = random.Random(f"{self.seed}-faults")
        background: set[asyncio.Task] = set()
        while not self.stop_event.is_set():
            await asyncio.sleep(rng.expovariate(1.0 / self.fault_every_s))
            if self.stop_event.is_set():
                break
            kind = rng.choices(("kill", "stop", "broker_restart", "cut", "cut_kv", "unplug", "kv_fill", "scenario"),
                               weights=(24, 30, 5, 14, 6, 6 if self.stack.cluster else 0, 5, 18))[0]
            target = rng.choice(self.ROLES)
            if kind == "kill":
                # The -0 workers are never killed, so their memory is watched over the whole run.
                if target in ("prefill-0", "decode-0"):
                    target = target[:-1] + "1"
                self.kill(target)
            elif kind == "stop" and target == "edge-worker" and rng.random() < 0.25:
                # Longer than gunicorn's worker timeout (30 s): its arbiter must kill and replace it.
                now = time.monotonic()
                self.edge_kills += [now + 30 + k for k in range(0, 15, 2)]
                background.add(asyncio.create_task(self.pause(target, 45.0)))
            elif kind == "stop":
                background.add(asyncio.create_task(self.pause(target, rng.uniform(1.0, 8.0))))
            elif kind == "broker_restart":
                self.kill("broker", signal.SIGTERM)
            elif kind == "cut":
                name = rng.choice(list(self.stack.links))
                background.add(asyncio.create_task(self.cut(name, rng.uniform(1.0, 8.0))))
            elif kind == "cut_kv":
                key = rng.choice(list(self.stack.kv_links))
                background.add(asyncio.create_task(self.cut(key, rng.uniform(1.0, 8.0), self.stack.kv_links[key], kind="cut_kv")))
            elif kind == "unplug":
                host = rng.choice(self.stack.HOSTS)
                background.add(asyncio.create_task(self.unplug(host, rng.uniform(1.0, 8.0))))
            elif kind == "kv_fill":
                self.fault("kv_fill", "decode")
                for s in self.fill:
                    background.add(asyncio.create_task(self.request(s, rng, "kv_fill", abort_after=None)))
            else:
                background.add(asyncio.create_task(self.scenario(rng.choice(self.SCENARIOS), rng)))
            background = {t for t in background if not t.done()}
        await asyncio.gather(*background, return_exceptions=True)

    # ------------------------------------------------------------ watching
    async def supervise_loop(self) -> None:
        while True:
            try:
                self.stack.sup.check()
            except Exception as exc:
                self.log(f"chaos | supervisor: {exc}")
            await asyncio.sleep(0.5)

    async def rss_loop(self) -> None:
        workers = set(self.stack.WORKERS)
        while True:
            try:
                st = await asyncio.to_thread(self.stack.stats)
            except Exception:
                st = {}
            kv = {w.get("name"): (w["kv_store_bytes"] + w.get("kv_mirror_bytes", 0) + w.get("heap_free_bytes", 0)) / 1e6
                  for w in st.get("workers", []) if w.get("state") == "up" and "kv_store_bytes" in w}
            now = time.monotonic()
            for pid, name in self.stack.processes().items():
                if pid in self.stopped:
                    continue
                if (mb := rss_mb(pid)) is not None:
                    self.rss.setdefault(pid, []).append((now, name, mb, kv.get(name) if name in workers else 0.0))
            await asyncio.sleep(5.0)

    def rss_growth(self, warmup_s: float, min_span_s: float) -> tuple[float, float, list[dict]]:
        """(largest growth net of the KV store and freed heap, largest raw growth, one row per process)."""
        rows = []
        for pid, samples in self.rss.items():
            start = samples[0][0] + warmup_s
            # Samples whose KV store and heap figures are unknown (the broker was down) are left out.
            after = [(mb, kv) for t, _, mb, kv in samples if t >= start and kv is not None]
            if len(after) < 6 or samples[-1][0] - start < min_span_s:
                continue

            def med3(xs: list[tuple[float, float]], net: bool) -> float:
                return sorted(mb - kv if net else mb for mb, kv in xs)[len(xs) // 2]

            half = len(after) // 2
            first, mid, last = after[:3], after[half - 1: half + 2], after[-3:]
            # The second half's growth tells a leak (it keeps growing) from pools and caches
            # that fill once (growth in the first half only).
            rows.append({"pid": pid, "name": samples[0][1], "span_s": round(samples[-1][0] - start),
                         "rss_mb_start": round(med3(first, False), 1), "rss_mb_mid": round(med3(mid, False), 1),
                         "rss_mb_end": round(med3(last, False), 1), "not_in_use_mb_end": round(last[-1][1], 1),
                         "raw_growth_mb": round(med3(last, False) - med3(first, False), 1),
                         "growth_mb": round(med3(last, True) - med3(first, True), 1),
                         "second_half_growth_mb": round(med3(last, True) - med3(mid, True), 1)})
        net = max((r["growth_mb"] for r in rows), default=float("nan"))
        raw = max((r["raw_growth_mb"] for r in rows), default=float("nan"))
        return net, raw, rows

    # ------------------------------------------------------------ verdicts
    def judge(self, tok) -> dict:
        counts: Counter = Counter()
        lost = duplicated = 0
        examples: dict[str, list[str]] = {}
        per_scenario: dict[str, Counter] = {}
        errors: Counter = Counter()
        tokens_checked = token_requests = 0
        worst_logprob = 0.0
        ids: dict[bytes, int] = {}
        for i in range(len(tok.hf)):
            ids.setdefault(tok.raw_bytes(i), i)

        def ntok(text: str) -> int:
            return len(tok.encode(text)) if text else 0

        for o in self.outcomes:
            kind = o.kind
            spec = self.specs.get(o.spec)
            if spec is not None and spec.ref_tokens is not None and o.tokens is not None:
                # Token granularity: the (token, logprob) sequence streamed is the reference's,
                # or a prefix of it for a request that ended early.
                problems, t_lost, t_dup, worst = token_diff(o.tokens, spec.ref_tokens, complete=kind == "exact", ids=ids)
                token_requests += 1
                tokens_checked += sum(map(len, o.tokens))
                worst_logprob = max(worst_logprob, worst)
                if problems:
                    lost += t_lost
                    duplicated += t_dup
                    kind = "mismatch"
                    examples.setdefault("token_mismatch", []).extend(f"spec {o.spec} {p}" for p in problems)
            if spec is not None and spec.ref is not None and kind != "mismatch":
                for i, text in enumerate(o.texts):
                    ref = spec.ref[i]
                    if text == ref:
                        continue
                    if kind != "exact" and ref.startswith(text):
                        continue  # a request that ended early: what came is a prefix
                    common = os.path.commonprefix([text, ref])
                    lost += ntok(ref[len(common):])
                    duplicated += ntok(text[len(common):])
                    kind = "mismatch"
                    examples.setdefault("mismatch", []).append(f"spec {o.spec} choice {i}: got {text!r} want {ref!r}")
            if kind == "severed":
                near_edge_kill = any(o.t0 - 1 <= t <= o.t1 + 1 for t in self.edge_kills)
                kind = "severed" if near_edge_kill else "unclean"
            if kind == "refused":  # nothing was accepted: fine while a killed edge restarts
                kind = "refused" if any(t <= o.t0 <= t + 30 for t in self.edge_kills) else "unclean"
            if kind in ("unclean", "hung"):
                examples.setdefault(kind, []).append(f"t={o.t0 - self.t_start:.0f}s spec {o.spec} stream={o.stream}: {o.detail}")
            if kind == "failed_clean":
                errors[o.detail[:140]] += 1
            counts[kind] += 1
            if (sc := self.scenario_of.get(id(o))) is not None:
                per_scenario.setdefault(sc, Counter())[kind] += 1
        return {"counts": counts, "lost": lost, "duplicated": duplicated, "token_requests": token_requests,
                "tokens_checked": tokens_checked, "logprob_max_abs_diff": worst_logprob,
                "examples": {k: v[:5] for k, v in examples.items()}, "errors": dict(errors.most_common(8)),
                "per_scenario": {k: dict(v) for k, v in per_scenario.items()}}


async def settle(stack: Stack, timeout_s: float) -> tuple[bool, dict]:
    """Wait until the broker sees every worker with all KV blocks free and the edge is ready."""
    deadline = time.monotonic() + timeout_s
    ok, st = False, {}
    while time.monotonic() < deadline:
        ok, st = await asyncio.to_thread(stack.workers_idle)
        if ok and await asyncio.to_thread(stack.http_ready):
            return True, st
        await asyncio.sleep(1.0)
    return False, st


def decode_kv_budget(model: Path, tokens: int = 2048) -> str:
    """A decode worker's KV pool for ``tokens`` tokens (float32 KV, as on the CPU): a burst
    of :func:`kv_fill_specs` fills it, whatever the model."""
    c = json.loads((model / "config.json").read_text())
    head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    per_token = c["num_hidden_layers"] * 2 * c.get("num_key_value_heads", c["num_attention_heads"]) * head_dim * 4
    return f"{-(-tokens * per_token // 1024)}KiB"


def commit() -> str:
    import subprocess

    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
        return head + ("+changes" if dirty else "")
    except OSError:
        return "unknown"


async def chaos(args, tmp: Path, log, cluster=None) -> dict:
    from tandem.http.tokenizer import load_tokenizer

    model = Path(args.model) if args.model else None
    if model is None:
        sys.path.insert(0, str(ROOT))
        from tests.tiny_model import build_tiny_model

        model = build_tiny_model(tmp / "tiny-model")
    restarts: Counter = Counter()  # the supervisor's own list keeps only its restart window

    def log_and_count(line: str) -> None:
        if line.endswith(")") and "; restarting it (" in line:
            restarts[line.split("|", 1)[1].split()[0]] += 1
        log(line)

    stack = Stack(tmp, model, log=log_and_count, cluster=cluster, decode_kv_budget=decode_kv_budget(model))
    specs = catalogue(args.seed, args.catalogue)
    fill = kv_fill_specs(args.seed, 6)
    for spec in specs + fill:
        spec.body["model"] = model.name
    run = Run(stack, specs, fill, args.seed, args.minutes, args.clients, args.fault_every, log)
    tasks: list[asyncio.Task] = []
    try:
        t = time.monotonic()
        await stack.start()
        up_s = time.monotonic() - t
        say(f"stack up in {up_s:.0f} s; computing {len(run.specs)} reference texts on the undisturbed stack")
        await run.reference()
        ok, idle_stats = await settle(stack, 60)
        idle = {w["name"]: w["total_blocks"] for w in idle_stats.get("workers", [])}
        say(f"reference done; idle KV blocks {idle}; chaos for {args.minutes} min")
        run.t_start = time.monotonic()
        tasks = [asyncio.create_task(run.supervise_loop()), asyncio.create_task(run.rss_loop())]
        load = [asyncio.create_task(run.client_loop(i)) for i in range(args.clients)]
        load += [asyncio.create_task(run.hostile_loop()), asyncio.create_task(run.fault_loop())]
        end = run.t_start + args.minutes * 60
        while time.monotonic() < end:
            await asyncio.sleep(min(30.0, max(0.1, end - time.monotonic())))
            c = Counter(o.kind for o in run.outcomes)
            say(f"t={time.monotonic() - run.t_start:.0f}s requests {len(run.outcomes)} {dict(c)} faults {len(run.faults)}")
        run.stop_event.set()
        say("load and faults stop; waiting for open requests (each has its deadline)")
        await asyncio.gather(*load, return_exceptions=True)
        resume_all(list(run.stopped))
        for link in stack.all_links():
            if link.is_cut:
                await link.up()
        settled, final_stats = await settle(stack, 90)
        hung_processes = []
        if not settled:
            ws = {w.get("name"): w for w in final_stats.get("workers", []) if w.get("state") == "up"}
            hung_processes = [n for n in stack.WORKERS if n not in ws]
            if not await asyncio.to_thread(stack.http_ready):
                hung_processes.append("edge")
            if "error" in final_stats:
                hung_processes.append("broker")
        leaked = {w["name"]: w["total_blocks"] - w["free_blocks"] for w in final_stats.get("workers", [])
                  if w.get("state") == "up" and w.get("total_blocks", 0) - w.get("free_blocks", 0) > 0}
        # After all that, the stack still answers every kind of request exactly.
        rng = random.Random(args.seed)
        after = [await run.request(s, rng, "after_chaos", abort_after=None, slow=False) for s in rng.sample(specs, min(8, len(specs)))]
        duration = time.monotonic() - run.t_start
        warmup = min(120.0, 0.2 * duration)
        growth, raw_growth, rss_rows = run.rss_growth(warmup, min_span_s=max(30.0, 0.3 * duration))
        verdict = run.judge(load_tokenizer(model))
        counts = verdict["counts"]
        hung = counts.get("hung", 0) + len(hung_processes)
        result = {
            "requests": len(run.outcomes),
            "completed_exact": counts.get("exact", 0),
            "failed_clean": counts.get("failed_clean", 0),
            "aborted": counts.get("aborted", 0),
            "severed_by_edge_kill": counts.get("severed", 0),
            "refused_while_edge_restarts": counts.get("refused", 0),
            "unclean": counts.get("unclean", 0),
            "mismatched": counts.get("mismatch", 0),
            "lost_tokens": verdict["lost"],
            "duplicated_tokens": verdict["duplicated"],
            "hung": hung,
            "hung_processes": hung_processes,
            "leaked_blocks": sum(leaked.values()),
            "leaked_by_worker": leaked,
            "faults": len(run.faults),
            "fault_kinds": dict(Counter(f["kind"] for f in run.faults)),
            "fault_targets": dict(Counter(f["target"] for f in run.faults if f["kind"] in ("sigkill", "sigstop", "sigterm"))),
            "scenarios": dict(run.scenarios),
            "scenario_evidence": dict(run.scenario_evidence),
            "scenario_outcomes": verdict["per_scenario"],
            "after_chaos_exact": sum(o.kind == "exact" and o.texts == run.specs[o.spec].ref for o in after),
            "after_chaos_requests": len(after),
            "reference_failures": run.reference_failures,
            "hostile": dict(run.hostile),
            "hostile_unclean_examples": run.hostile_examples[:5],
            "rss_growth_mb": None if growth != growth else round(growth, 1),
            "rss_raw_growth_mb": None if raw_growth != raw_growth else round(raw_growth, 1),
            "rss_second_half_growth_mb": max((r["second_half_growth_mb"] for r in rss_rows), default=None),
            "rss": rss_rows,
            "restarts": dict(restarts),
            "examples": verdict["examples"],
            "clean_errors": verdict["errors"],
            "minutes": round(duration / 60, 1),
            "seed": args.seed,
            "stack_up_s": round(up_s, 1),
            "model": Path(args.model).name if args.model else "tests/tiny_model.py (random weights, 2 layers)",
            "network": "netns" if cluster is not None else "loopback",
            "commit": commit(),
            "command": "bench/chaos.py " + " ".join(sys.argv[1:]),
            "token_requests": verdict["token_requests"],
            "tokens_checked": verdict["tokens_checked"],
            "logprob_max_abs_diff": verdict["logprob_max_abs_diff"],
            "machine": machine(),
        }
        return result
    finally:
        run.stop_event.set()
        for task in tasks:
            task.cancel()
        resume_all(list(run.stopped) + list(stack.processes()))
        await asyncio.to_thread(stack.stop)


async def chaos_until_signalled(args, tmp: Path, log, cluster=None) -> dict:
    """:func:`chaos`, cancelled by SIGTERM or SIGINT so its cleanup runs (a process it
    left stopped would otherwise outlive it)."""
    task = asyncio.current_task()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, task.cancel)
    return await chaos(args, tmp, log, cluster)


VARIANTS = {"loopback": "chaos.json", "netns": "chaos-netns.json"}
WHERE = {
    "loopback": "The whole stack on loopback (broker, 2 prefill + 2 decode workers, the edge with 2 gunicorn workers, "
                "supervised as `tandem serve` does); every broker link and each decode worker's KV ingest through a "
                "proxy the run cuts (the peers see resets).",
    "netns": "The same stack across seven hosts (network namespaces joined by a bridge: broker, each worker, the edge, "
             "the client); a cut drops every packet between two hosts (broker links, or one prefill -> decode KV "
             "path), so connections stall instead of being reset, and an unplug takes a host's cable away.",
}


def report_section(r: dict) -> list[str]:
    """One run's part of docs/benchmarks/chaos.md."""
    ok = not (r["lost_tokens"] or r["duplicated_tokens"] or r["hung"] or r["leaked_blocks"] or r["unclean"] or r["mismatched"])
    lines = [
        f"## {r['network']}: `{r['command']}`",
        "",
        f"{r['minutes']} min of faults, seed {r['seed']}, model {r['model']}, commit {r['commit']}, {r['machine']['when']}, "
        f"{r['machine']['cpus']} cores shared with other work (load average {r['machine']['load_avg_1m']:.1f} at the end).",
        "",
        WHERE[r["network"]] + " Verdict: "
        + ("**nothing lost, repeated, hung or leaked**." if ok else "**invariants broken** (see below)."),
        "",
        "| figure | value |",
        "|---|---|",
    ]
    for key in ("requests", "completed_exact", "failed_clean", "aborted", "severed_by_edge_kill",
                "refused_while_edge_restarts", "unclean", "mismatched", "lost_tokens", "duplicated_tokens", "hung",
                "leaked_blocks", "faults", "rss_growth_mb", "rss_raw_growth_mb", "rss_second_half_growth_mb", "token_requests", "tokens_checked",
                "logprob_max_abs_diff"):
        if key in r:  # a run from before a figure existed lacks it
            lines.append(f"| `{key}` | {r[key]} |")
    lines.append(f"| after the faults, catalogue requests answered exactly | {r['after_chaos_exact']} of {r['after_chaos_requests']} |")
    lines += ["", "Faults: " + ", ".join(f"{k} {v}" for k, v in sorted(r["fault_kinds"].items())) + ". "
              "Signals by target (SIGKILL, SIGSTOP, SIGTERM): "
              + ", ".join(f"{k} {v}" for k, v in sorted(r["fault_targets"].items()))
              + ". Restarts by the supervisor (a process that died): " + ", ".join(f"{k} {v}" for k, v in r["restarts"].items()) + "."]
    lines += ["", "| scenario | runs | outcomes of its requests |", "|---|---|---|"]
    for name in Run.SCENARIOS + ("kv_fill",):
        outcomes = r["scenario_outcomes"].get(name, {})
        runs = r["scenarios"].get(name, r["fault_kinds"].get("kv_fill", 0) if name == "kv_fill" else 0)
        lines.append(f"| {name} | {runs} | " + ", ".join(f"{k} {v}" for k, v in sorted(outcomes.items())) + " |")
    if r["scenario_evidence"]:
        lines += ["", "Decode refusals seen in the broker's counters during decode_refuses_before_admission: "
                  f"{r['scenario_evidence'].get('decode_refuses_before_admission', 0)} of its runs."]
    lines += ["", "Clean errors clients saw:", ""]
    lines += [f"- {v} x {k}" for k, v in r["clean_errors"].items()] or ["- none"]
    lines += ["", "Hostile input: " + ", ".join(f"{k} {v}" for k, v in sorted(r["hostile"].items())) + "."]
    lines += ["", "| process (lived long enough to measure) | measured for s | RSS start MB | mid MB | end MB "
              "| KV store + mirror + freed heap at end MB | RSS growth MB | growth net of them MB |", "|---|---|---|---|---|---|---|---|"]
    lines += [f"| {x['name']} (pid {x['pid']}) | {x['span_s']} | {x['rss_mb_start']} | {x['rss_mb_mid']} | {x['rss_mb_end']} "
              # A run from before the net figure reported raw growth only, as growth_mb.
              f"| {x.get('not_in_use_mb_end', '-')} | {x.get('raw_growth_mb', x['growth_mb'])} "
              f"| {x['growth_mb'] if 'raw_growth_mb' in x else '-'} |" for x in r["rss"]]
    if r["reference_failures"]:
        lines += ["", "Catalogue requests the undisturbed stack failed:", ""] + [f"- {x}" for x in r["reference_failures"]]
    if r["examples"]:
        lines += ["", "Examples of broken invariants:", ""] + [f"- {k}: {v}" for k, vs in r["examples"].items() for v in vs]
    return lines + [""]


NOTES = "<!-- notes: kept when bench/chaos.py rewrites this page -->"


def report(out: Path) -> str:
    """docs/benchmarks/chaos.md from the runs' JSON files there; what the page has below
    :data:`NOTES` (written by hand) is kept."""
    lines = ["# Chaos and soak", "",
             "bench/chaos.py runs the whole stack under mixed load while a seeded schedule kills, freezes, restarts "
             "and cuts it; its docstring says what each check means. One section per network variant.", ""]
    for variant, name in VARIANTS.items():
        if (out / name).exists():
            lines += report_section(json.loads((out / name).read_text()))
    page = out / "chaos.md"
    old = page.read_text() if page.exists() else ""
    lines += [NOTES + old.partition(NOTES)[2].rstrip(), ""]
    return "\n".join(lines)


def say(text: str) -> None:
    print(f"chaos | {text}", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=2.0)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--model", help="mlx-lm model directory (default: the test suite's tiny random model)")
    ap.add_argument("--netns", action="store_true", help="every process on a host of its own (network namespaces; root)")
    ap.add_argument("--clients", type=int, default=4, help="concurrent client loops")
    ap.add_argument("--catalogue", type=int, default=24, help="distinct requests in the reference catalogue")
    ap.add_argument("--fault-every", type=float, default=4.0, help="mean seconds between faults")
    ap.add_argument("--log", default="/tmp/tandem-chaos.log", help="every process's output and every fault")
    ap.add_argument("--out", help="directory to write chaos.md and the run's JSON into (docs/benchmarks)")
    args = ap.parse_args()
    cluster = None
    if args.netns:
        sys.path.insert(0, str(ROOT))
        from tests.ops.netns import Cluster, namespaces_available

        if reason := namespaces_available():
            print(f"chaos: --netns cannot run here: {reason}", file=sys.stderr)
            return 2
        cluster = Cluster([*Stack.HOSTS, "client"], subnet_id=78).__enter__()
        cluster.enter("client")  # this process is the client host; ip netns exec starts the others
    logf = open(args.log, "w")

    def log(line: str) -> None:
        logf.write(f"{time.strftime('%H:%M:%S')} {line}\n")
        logf.flush()

    try:
        with tempfile.TemporaryDirectory(prefix="tandem-chaos-") as tmp:
            result = asyncio.run(chaos_until_signalled(args, Path(tmp), log, cluster))
    except asyncio.CancelledError:
        print("chaos: interrupted; the stack is stopped", file=sys.stderr)
        return 1
    finally:
        if cluster is not None:
            cluster.close()
    logf.close()
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / VARIANTS[result["network"]]).write_text(json.dumps(result, indent=1) + "\n")
        (out / "chaos.md").write_text(report(out))
    print(json.dumps(result), flush=True)
    bad = (result["lost_tokens"] or result["duplicated_tokens"] or result["hung"] or result["leaked_blocks"]
           or result["reference_failures"])
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
