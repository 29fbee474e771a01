"""A worker process's IO loop against a hand-driven broker (real sockets, in threads)."""

from __future__ import annotations

import contextlib
import os
import threading
import time

import pytest
import zmq

from tandem.kvtypes import SamplingParams
from tandem.pipeline.api import EngineStats
from tandem.wire import codec
from tandem.wire import messages as M
from tandem.wire.protocol import STREAM_BATCH_TOPIC, STREAM_PING_TOPIC
from tandem.workers.settings import WorkerSettings
from tests.stub_engine import StubEngine, reference_tokens
from tandem.workers.worker import Worker


class FakeBroker:
    def __init__(self, ctx, secret):
        from tandem.wire.sockets import bound_endpoint, make_socket

        self.backend = make_socket(ctx, zmq.ROUTER, bind="tcp://127.0.0.1:*", security=secret)
        self.backend_addr = bound_endpoint(self.backend)
        self.xsub = make_socket(ctx, zmq.XSUB, bind="tcp://127.0.0.1:*", security=secret)
        self.xsub_addr = bound_endpoint(self.xsub)
        self.xsub.send(b"\x01")
        self.identity = None

    def recv(self, timeout=3.0, want=None):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.backend.poll(50):
                ident, *frames = self.backend.recv_multipart()
                self.identity = ident
                msg = codec.decode(frames)
                if want is None or isinstance(msg, want):
                    return msg
        return None

    def wait_stream(self, timeout=5.0):
        """Like the real broker: dispatch only once a stream ping proved the PUB is connected."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.xsub.poll(50) and self.xsub.recv_multipart()[0] == STREAM_PING_TOPIC:
                return
        raise AssertionError("no stream ping from the worker")

    def send(self, msg):
        self.backend.send_multipart([self.identity, *codec.encode(msg)])

    def tokens(self, timeout=2.0):
        out = []
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.xsub.poll(50):
                topic, body = self.xsub.recv_multipart()
                if topic == STREAM_PING_TOPIC:
                    continue
                assert topic == STREAM_BATCH_TOPIC
                for attempt, msg in codec.decode_batch([topic, body]):
                    out.append((attempt, msg))
                    if msg.finish_reason or msg.error:
                        return out
        return out


@pytest.fixture
def env():
    ctx = zmq.Context()
    secret = os.urandom(32)
    broker = FakeBroker(ctx, secret)
    workers = []

    def start(engine, **kw):
        transfer = kw.pop("transfer", None)
        settings = WorkerSettings(role=kw.pop("role", "hybrid"), name=kw.pop("name", "w-test"), **kw)
        w = Worker(engine, settings=settings, backend=broker.backend_addr, stream_in=broker.xsub_addr,
                   secret=secret, model_id="stub", heartbeat_s=0.05, capacity=4, ctx=ctx, transfer=transfer)
        t = threading.Thread(target=w.run, daemon=True)
        t.start()
        workers.append((w, t))
        return w

    yield broker, start
    for w, t in workers:
        w.stop()
        t.join(5)
    ctx.destroy(0)


def test_registers_runs_and_publishes_under_its_attempt(env):
    broker, start = env
    start(StubEngine())
    ready = broker.recv(want=M.Ready)
    assert ready.role == "hybrid" and ready.capacity == 4
    assert broker.recv(want=M.Heartbeat) is not None
    broker.wait_stream()
    rid = os.urandom(16)
    broker.send(M.Dispatch(rid, "hybrid", [1, 2, 3], SamplingParams(max_tokens=5), attempt=7))
    msgs = broker.tokens()
    assert [a for a, _ in msgs] == [7] * len(msgs)
    assert [m.seq for _, m in msgs] == list(range(len(msgs)))
    assert sum((m.tokens for _, m in msgs), []) == reference_tokens([1, 2, 3], 5)
    done = broker.recv(want=M.Done)
    assert done.request_id == rid and done.finish_reason == "length"


def test_a_burst_of_registration_requests_gets_one_ready_per_heartbeat(env):
    """A restarted broker answers each message of a backlog with Disconnect; the worker
    announces itself once, not once per answer (the chaos run saw an unbounded storm)."""
    broker, start = env
    start(StubEngine())
    assert broker.recv(want=M.Ready) is not None
    time.sleep(0.1)  # past the first READY's heartbeat interval
    for _ in range(50):
        broker.send(M.Disconnect("broker", "unknown worker: send READY"))
    readies = 0
    deadline = time.monotonic() + 0.5
    while time.monotonic() < deadline:
        if broker.recv(timeout=0.05, want=M.Ready) is not None:
            readies += 1
    # 0.5 s is ten heartbeat intervals: one READY each at most, and at least one at all.
    assert 1 <= readies <= 11


def test_resume_continues_sequence_numbers_and_tokens(env):
    broker, start = env
    start(StubEngine())
    broker.recv(want=M.Ready)
    broker.wait_stream()
    rid = os.urandom(16)
    full = reference_tokens([4, 5], 6)
    broker.send(M.Resume(rid, [4, 5], full[:2], 3, SamplingParams(max_tokens=4), attempt=2))
    msgs = broker.tokens()
    assert msgs[0][1].seq == 3
    assert full[:2] + sum((m.tokens for _, m in msgs), []) == full


class StalledEngine(StubEngine):
    """Takes requests, never steps: what a wedged MLX call looks like from outside."""

    def start(self):
        pass

    def stats(self):
        return EngineStats(running=1, waiting=0, total_blocks=10, free_blocks=10, steps=0)


def test_heartbeats_stop_when_the_engine_stalls(env):
    broker, start = env
    w = start(StalledEngine(), stall_timeout_s=0.3)
    broker.recv(want=M.Ready)
    broker.send(M.Dispatch(os.urandom(16), "hybrid", [1], SamplingParams(max_tokens=5), attempt=1))
    time.sleep(0.6)
    while broker.backend.poll(0):
        broker.backend.recv_multipart()
    assert broker.recv(timeout=0.5, want=M.Heartbeat) is None
    assert w.stalled


def test_engine_refusal_is_reported(env):
    broker, start = env
    start(StubEngine(max_queue=0))
    broker.recv(want=M.Ready)
    rid = os.urandom(16)
    broker.send(M.Dispatch(rid, "hybrid", [1], SamplingParams(max_tokens=5), attempt=1))
    refused = broker.recv(want=M.Refused)
    assert refused.request_id == rid and refused.reason == "at_capacity"


def test_drain_finishes_in_flight_then_disconnects(env):
    broker, start = env
    w = start(StubEngine(step_s=0.01), drain_grace_s=10)
    broker.recv(want=M.Ready)
    broker.wait_stream()
    rid = os.urandom(16)
    broker.send(M.Dispatch(rid, "hybrid", [1, 2], SamplingParams(max_tokens=30), attempt=1))
    time.sleep(0.05)
    w.drain()
    seen = []
    deadline = time.monotonic() + 5
    sent_second = False
    while time.monotonic() < deadline:
        msg = broker.recv(timeout=0.5)
        if msg is None:
            continue
        seen.append(msg)
        if isinstance(msg, M.Heartbeat) and msg.draining and not sent_second:
            broker.send(M.Dispatch(os.urandom(16), "hybrid", [1], SamplingParams(max_tokens=3), attempt=1))
            sent_second = True
        if isinstance(msg, M.Disconnect):
            break
    kinds = [type(m).__name__ for m in seen]
    assert sent_second and "Disconnect" == kinds[-1]
    assert any(isinstance(m, M.Refused) and m.reason == "draining" for m in seen)
    assert any(isinstance(m, M.Done) and m.request_id == rid and m.finish_reason == "length" for m in seen)


def test_drain_grace_expiry_hands_requests_back(env):
    broker, start = env
    w = start(StubEngine(step_s=0.05), drain_grace_s=0.2)
    broker.recv(want=M.Ready)
    rid = os.urandom(16)
    broker.send(M.Dispatch(rid, "hybrid", [1, 2], SamplingParams(max_tokens=1000), attempt=1))
    time.sleep(0.1)
    w.drain()
    failed = broker.recv(want=M.Failed)
    assert failed.request_id == rid and failed.retryable
    assert broker.recv(want=M.Disconnect) is not None


def test_abort_frees_engine_slot(env):
    broker, start = env
    eng = StubEngine(step_s=0.01)
    start(eng)
    broker.recv(want=M.Ready)
    rid = os.urandom(16)
    broker.send(M.Dispatch(rid, "hybrid", [1], SamplingParams(max_tokens=10_000), attempt=1))
    time.sleep(0.1)
    assert eng.stats().running == 1
    broker.send(M.Abort(rid))
    deadline = time.monotonic() + 2
    while eng.stats().running and time.monotonic() < deadline:
        time.sleep(0.02)
    assert eng.stats().running == 0


def test_prefill_handoff_to_a_silent_decode_worker_times_out_and_is_reported(env):
    broker, start = env
    silent = zmq.Context.instance().socket(zmq.ROUTER)  # accepts the TCP connection, never answers
    port = silent.bind_to_random_port("tcp://127.0.0.1")
    try:
        w = start(StubEngine(), role="prefill", transfer_timeout_s=0.3)
        broker.recv(want=M.Ready)
        broker.wait_stream()
        rid = os.urandom(16)
        broker.send(M.Dispatch(rid, "prefill", [1, 2, 3], SamplingParams(max_tokens=5), decode_node="d",
                               decode_address=f"tcp://127.0.0.1:{port}", attempt=1))
        first = broker.tokens(timeout=1.0)
        assert [m.tokens for _, m in first] == [reference_tokens([1, 2, 3], 1)]  # the first token went out
        refused = broker.recv(want=M.Refused, timeout=3)
        assert refused.request_id == rid and "not acknowledged" in refused.message
        assert not w.local and w.sender.counters["handoff_failures"] == 1  # nothing held any more
    finally:
        silent.close(0)


@contextlib.contextmanager
def offline_worker(engine, **settings):
    """A Worker that is never started and whose sockets lead nowhere, for driving its
    methods directly; its sockets and contexts are closed afterwards."""
    ctx = zmq.Context()
    try:
        w = Worker(engine, settings=WorkerSettings(**settings), backend="tcp://127.0.0.1:9",
                   stream_in="tcp://127.0.0.1:9", secret=os.urandom(32), model_id="stub", ctx=ctx)
        try:
            yield w
        finally:
            w.backend.close(0)
            w.pub.close(0)
            if w._pub_ctx is not ctx:
                w._pub_ctx.term()
    finally:
        ctx.destroy(0)


def test_a_batch_of_first_tokens_is_published_before_any_handoff_starts():
    """Starting a handoff seals megabytes on the IO thread: the other prompts of the same
    prefill batch must not wait for it to see their first token."""
    from tandem.pipeline.api import TokenEvent
    from tandem.workers.local import Local

    with offline_worker(StubEngine(), role="prefill", name="p-test") as w:
        order = []
        w._publish = lambda local, tokens, *a, **k: order.append(("publish", local.request_id))
        w._hand_off = lambda local, snap: order.append(("handoff", local.request_id))
        rids = [bytes([i]) * 16 for i in (1, 2, 3)]
        for rid in rids:
            w.local[rid] = Local(rid, 1, 0, "prefill", 4, 0, "d0", "tcp://127.0.0.1:9")
            w._events.put((1, TokenEvent(rid, [5], snapshot=object())))
        w._drain_events()
        assert order == [("publish", r) for r in rids] + [("handoff", r) for r in rids]
        assert all(w.local[r].handing_off for r in rids)


def test_a_prefill_worker_holds_the_cpu_gate_until_the_handoff_is_over(tmp_path):
    """The co-located decode worker should find every KV of a burst queued when it gets the
    cores (one import step), so the prompt keeps the gate until its handoff's outcome."""
    from tandem.pipeline.api import TokenEvent
    from tandem.workers.local import Local

    with offline_worker(StubEngine(), role="prefill", name="p-gate", cpu_gate=str(tmp_path / "g")) as w:
        w._hand_off = lambda local, snap: None
        a, b = b"a" * 16, b"b" * 16
        w.gate.prefill_started([a, b])
        for rid in (a, b):
            w.local[rid] = Local(rid, 1, 0, "prefill", 4, 0, "d0", "tcp://127.0.0.1:9")
            on_event = w._callback(1, export=True)
            on_event(TokenEvent(rid, [5]))  # the engine's first token, then the KV
            assert w.gate.held
            on_event(TokenEvent(rid, [], snapshot=object()))
        w._drain_events()
        assert w.gate.held  # first tokens out, handoffs still going
        w._handoff_outcomes([(a, None)])
        assert w.gate.held
        w._handoff_outcomes([(b, "decode worker refused")])  # a failure lets go as well
        assert not w.gate.held
        # A prompt aborted before its handoff lets go too.
        w.gate.prefill_started([b"c" * 16])
        w._abort(b"c" * 16)
        assert not w.gate.held
        w.gate.close()
        w.gate = None


def test_a_request_the_engine_rejects_fails_without_stopping_the_worker():
    """engine.submit raises ValueError for a request the model cannot run (token ids past
    its vocabulary): the request fails; the IO thread, which runs _dispatch, goes on."""
    class Picky(StubEngine):
        def submit(self, req):
            raise ValueError("prompt token ids must be in [0, 385)")

    with offline_worker(Picky(), role="hybrid", name="h-picky") as w:
        sent = []
        w._send = sent.append
        rid = os.urandom(16)
        w._dispatch(M.Dispatch(rid, "hybrid", [40000], SamplingParams(max_tokens=2), attempt=1))
        assert [type(m) for m in sent] == [M.Failed] and sent[0].request_id == rid and not sent[0].retryable
        assert "385" in sent[0].error and rid not in w.local


def test_a_prefill_worker_publishes_first_tokens_from_the_engine_thread(tmp_path):
    """The first token of a handed-off request goes out from the engine's callback (the IO
    thread, at a low priority under the CPU gate, is not woken for it), on the same PUB
    socket and sequence as the rest; the KV event that follows publishes nothing and the
    handoff continues the stream at sequence 1. The token socket's I/O thread keeps its
    priority when the worker lowers its socket threads."""
    from tandem.kvtypes import Usage
    from tandem.pipeline.api import TokenEvent
    from tandem.wire.sockets import make_socket
    from tandem.workers import priority
    from tandem.workers.local import Local

    ctx = zmq.Context()
    secret = os.urandom(32)
    sub = make_socket(ctx, zmq.SUB, bind="tcp://127.0.0.1:*", security=secret, subscribe=[b""])
    try:
        w = Worker(StubEngine(), settings=WorkerSettings(role="prefill", name="p-first", cpu_gate=str(tmp_path / "g")),
                   backend="tcp://127.0.0.1:9", stream_in=sub.getsockopt(zmq.LAST_ENDPOINT).decode(), secret=secret,
                   model_id="stub", ctx=ctx)
        deadline = time.monotonic() + 10
        while not sub.poll(50):  # a PUB drops messages until the subscription has reached it
            assert time.monotonic() < deadline
            w._pub_send([STREAM_PING_TOPIC, b"p"])
        while sub.poll(100):
            sub.recv_multipart()
        handed = []
        w._hand_off = lambda local, snap: handed.append((local.request_id, local.seq))
        rid = os.urandom(16)
        w.local[rid] = Local(rid, 2, 0, "prefill", 3, 0, "d0", "tcp://127.0.0.1:9")
        w.gate.prefill_started([rid])
        on_event = w._callback(2, export=True)
        on_event(TokenEvent(rid, [7], usage=Usage(3, 1)))
        assert w._events.empty()  # nothing for the IO thread to publish
        assert sub.poll(5000)
        topic, head = sub.recv_multipart()
        [(attempt, msg)] = codec.decode_batch([topic, head])
        assert (topic, attempt, msg.request_id) == (STREAM_BATCH_TOPIC, 2, rid)
        assert (msg.seq, msg.tokens, msg.usage.completion_tokens) == (0, [7], 1)
        assert w.gate.held  # the prompt keeps the cores until its handoff
        on_event(TokenEvent(rid, [], snapshot=object()))
        w._drain_events()
        assert handed == [(rid, 1)] and not sub.poll(200)  # the KV event published nothing

        def lowered():
            done.extend(priority.lower_socket_threads(19))
        done: list[int] = []
        t = threading.Thread(target=lowered)
        t.start()
        t.join()
        names = {}
        for tid in os.listdir("/proc/self/task"):
            try:
                with open(f"/proc/self/task/{tid}/comm") as f:
                    names[int(tid)] = f.read().strip()
            except FileNotFoundError:
                continue  # a thread (of another test's leftovers) that just ended
        mine = w._pub_ctx  # its I/O thread is alive as long as the context: it cannot vanish here
        kept = [tid for tid, n in names.items() if n.endswith("ZMQbg/IO/0") and not n.startswith("ZMQbg/")]
        assert mine is not None and kept and not set(kept) & set(done)

        def nice(tid):
            try:
                return os.getpriority(os.PRIO_PROCESS, tid)
            except ProcessLookupError:
                return 0  # ended since (another test's context being collected)
        assert all(nice(tid) == 0 for tid in kept)
        w.gate.close()
        w.gate = None
        w.backend.close(0)
        w.pub.close(0)
        w._pub_ctx.term()
    finally:
        sub.close(0)
        ctx.destroy(0)


# ---- KV streamed while the prompt is prefilled ------------------------------------------

def _streaming_pair(broker, start, *, prefill_step_s=0.05, decode_engine=None, **decode_kw):
    """A decode worker and a prefill worker whose stub prefills 16 tokens a step and
    streams each chunk's KV; the broker's next message goes to the prefill worker."""
    from tandem.wire.settings import TransferSettings

    d = start(decode_engine or StubEngine(), role="decode", name="d-test", **decode_kw)
    p = start(StubEngine(prefill_chunk=16, step_s=prefill_step_s), role="prefill", name="p-test",
              transfer=TransferSettings(strategy="streamed"))
    for _ in range(2):
        broker.recv(want=M.Ready)
        broker.wait_stream()
    broker.identity = b"p-test"
    return p, d


def _until(cond, timeout=5.0):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_a_streamed_handoff_opens_during_the_prefill_and_continues_exactly(env):
    broker, start = env
    p, d = _streaming_pair(broker, start)
    headers = []
    decoded = d.kv_in.on_decoded
    d.kv_in.on_decoded = lambda peer, msg: (headers.append(msg.final) if isinstance(msg, M.KVHeader) else None,
                                            decoded(peer, msg))[1]
    rid, prompt = os.urandom(16), list(range(3, 83))  # 80 tokens: 5 chunks, 5 blocks
    broker.send(M.Dispatch(rid, "prefill", prompt, SamplingParams(max_tokens=6), decode_node="d-test",
                           decode_address=d.kv_address, attempt=1))
    msgs = broker.tokens(timeout=5)
    assert [t for _, m in msgs for t in m.tokens] == reference_tokens(prompt, 6)
    assert {a for a, _ in msgs} == {1} and [m.seq for _, m in msgs] == list(range(len(msgs)))
    assert headers == [False, True]  # opened by the first part, completed by the final one
    dones = [broker.recv(want=M.Done), broker.recv(want=M.Done)]  # the prefill's (handed to) and the decode's
    assert {x.request_id for x in dones} == {rid} and {x.handed_to for x in dones} == {"d-test", None}
    _until(lambda: not p.local and not d.local and d.kv_in.partial == 0)
    assert p.sender.counters["handoffs"] == 1 and not p.sender._transfers
    # The decode engine took blocks 0-3 as they came (reserved at the first), the last with the final part.
    assert d.engine.parts_imported == 4 and not d.engine.reserved


def test_an_abort_during_a_streamed_transfer_frees_both_sides_at_once(env):
    broker, start = env
    p, d = _streaming_pair(broker, start, prefill_step_s=0.3)  # transfer_timeout_s stays 10 s
    rid = os.urandom(16)
    broker.send(M.Dispatch(rid, "prefill", list(range(3, 83)), SamplingParams(max_tokens=6), decode_node="d-test",
                           decode_address=d.kv_address, attempt=1))
    _until(lambda: d.kv_in.partial == 1 and rid in d.local and rid in d.engine.reserved)  # a part is there, the prefill goes on
    broker.send(M.Abort(rid))
    _until(lambda: d.kv_in.partial == 0 and not d.local and not p.local and not d.engine.reserved, timeout=2)
    _until(lambda: p.engine.stats().running == 0, timeout=2)
    assert not p.sender._transfers and broker.tokens(timeout=0.5) == []


def test_a_prefill_that_dies_mid_transfer_leaves_nothing_held_on_the_decode_side(env):
    broker, start = env
    p, d = _streaming_pair(broker, start, prefill_step_s=0.3, transfer_timeout_s=0.5)
    rid = os.urandom(16)
    broker.send(M.Dispatch(rid, "prefill", list(range(3, 83)), SamplingParams(max_tokens=6), decode_node="d-test",
                           decode_address=d.kv_address, attempt=1))
    _until(lambda: d.kv_in.partial == 1 and rid in d.local and rid in d.engine.reserved)
    p.stop()  # its sockets close without a word to the decode worker
    _until(lambda: d.kv_in.partial == 0 and not d.local and not d.engine.reserved, timeout=3)


def test_a_stream_the_decode_engine_cannot_reserve_is_refused_cleanly(env):
    """The decode worker takes the transfer, but its engine has no room for the blocks when
    the first part comes: the transfer is refused (backpressure), nothing stays reserved,
    and the broker hears after the first token, as for a refusal at the door."""
    broker, start = env
    p, d = _streaming_pair(broker, start, decode_engine=StubEngine(kv_blocks=2))  # 5 blocks needed
    rid, prompt = os.urandom(16), list(range(3, 83))
    broker.send(M.Dispatch(rid, "prefill", prompt, SamplingParams(max_tokens=6), decode_node="d-test",
                           decode_address=d.kv_address, attempt=1))
    refused = broker.recv(want=M.Refused, timeout=5)
    assert refused.request_id == rid and "no room to reserve" in refused.message
    assert [m.tokens for _, m in broker.tokens(timeout=0.5)] == [reference_tokens(prompt, 1)]
    _until(lambda: not p.local and not d.local and d.kv_in.partial == 0 and not p.sender._transfers)
    assert not d.engine.reserved and d.engine.parts_imported == 0 and d.engine.stats().running == 0


def test_a_request_that_ends_at_its_first_token_frees_the_decode_reservation(env):
    """max_tokens 1: the prefill worker finishes the request itself and cancels the stream
    it opened; the decode worker drops the transfer and its engine the reserved blocks."""
    broker, start = env
    p, d = _streaming_pair(broker, start, prefill_step_s=0.1)
    rid, prompt = os.urandom(16), list(range(3, 83))
    broker.send(M.Dispatch(rid, "prefill", prompt, SamplingParams(max_tokens=1), decode_node="d-test",
                           decode_address=d.kv_address, attempt=1))
    _until(lambda: rid in d.engine.reserved)
    msgs = broker.tokens(timeout=5)
    assert [t for _, m in msgs for t in m.tokens] == reference_tokens(prompt, 1) and msgs[-1][1].finish_reason == "length"
    _until(lambda: not d.local and d.kv_in.partial == 0 and not d.engine.reserved and not p.sender._transfers)


def test_a_new_attempt_replaces_a_dead_prefill_workers_transfer(env):
    """The prefill worker dies mid-transfer and the broker dispatches the request again
    (attempt 2) to another prefill worker with the same decode target, before the first
    transfer timed out there: the newer transfer replaces the old one, reserved blocks
    and all, and the request continues exactly under attempt 2."""
    from tandem.wire.settings import TransferSettings

    broker, start = env
    p, d = _streaming_pair(broker, start, prefill_step_s=0.3)  # transfer_timeout_s stays 10 s
    rid, prompt = os.urandom(16), list(range(3, 83))
    broker.send(M.Dispatch(rid, "prefill", prompt, SamplingParams(max_tokens=6), decode_node="d-test",
                           decode_address=d.kv_address, attempt=1))
    _until(lambda: d.kv_in.partial == 1 and rid in d.engine.reserved and d.engine.reserved[rid][1] >= 1)
    p.stop()
    start(StubEngine(prefill_chunk=16, step_s=0.02), role="prefill", name="p2-test",
          transfer=TransferSettings(strategy="streamed"))
    broker.recv(want=M.Ready)
    broker.wait_stream()
    broker.identity = b"p2-test"
    broker.send(M.Dispatch(rid, "prefill", prompt, SamplingParams(max_tokens=6), decode_node="d-test",
                           decode_address=d.kv_address, attempt=2))
    got = []
    while not got or not (got[-1][1].finish_reason or got[-1][1].error):
        batch = broker.tokens(timeout=5)
        assert batch, "no more tokens"
        got += [(a, m) for a, m in batch if a == 2]
    assert [t for _, m in got for t in m.tokens] == reference_tokens(prompt, 6)
    _until(lambda: not d.local and d.kv_in.partial == 0 and not d.engine.reserved)


class FullEngine(StubEngine):
    def can_accept(self, n_tokens: int) -> bool:
        return False


def test_a_decode_worker_that_refuses_a_stream_is_reported_after_the_first_token(env):
    """The refusal comes while the prompt is still prefilled: the prefill finishes, its
    first token goes out, then the broker hears of the refusal (it continues the request
    elsewhere from that token, excluding that decode worker)."""
    broker, start = env
    p, d = _streaming_pair(broker, start, decode_engine=FullEngine())
    rid, prompt = os.urandom(16), list(range(3, 83))
    broker.send(M.Dispatch(rid, "prefill", prompt, SamplingParams(max_tokens=6), decode_node="d-test",
                           decode_address=d.kv_address, attempt=1))
    refused = broker.recv(want=M.Refused, timeout=5)
    assert refused.request_id == rid and "full" in refused.message
    first = broker.tokens(timeout=0.5)
    assert [m.tokens for _, m in first] == [reference_tokens(prompt, 1)]
    _until(lambda: not p.local and not d.local and d.kv_in.partial == 0 and not p.sender._transfers)


def test_a_decode_worker_receiving_a_long_stream_is_not_stalled(env):
    """The place a decode worker holds while a prompt's KV streams in is no work for its
    engine: a prefill longer than stall_timeout_s must not make it stop heartbeating."""
    broker, start = env
    p, d = _streaming_pair(broker, start, prefill_step_s=0.3, stall_timeout_s=0.2)
    rid, prompt = os.urandom(16), list(range(3, 83))
    broker.send(M.Dispatch(rid, "prefill", prompt, SamplingParams(max_tokens=6), decode_node="d-test",
                           decode_address=d.kv_address, attempt=1))
    _until(lambda: d.kv_in.partial == 1 and rid in d.local)
    time.sleep(0.6)  # three stall timeouts with nothing for the engine to do
    assert not d.stalled and d.kv_in.partial == 1
    msgs = broker.tokens(timeout=5)
    assert [t for _, m in msgs for t in m.tokens] == reference_tokens(prompt, 6) and not d.stalled
