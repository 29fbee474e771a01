"""The broker's decisions, driven directly with messages (no sockets)."""

from __future__ import annotations

import pytest

from tandem.broker import jobs as J
from tandem.broker.dispatcher import Dispatcher
from tandem.broker.settings import BrokerSettings
from tandem.broker.streams import MAX_AHEAD, REORDER_WINDOW_S
from tandem.kvtypes import SamplingParams
from tandem.wire import messages as M


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


class Harness:
    def __init__(self, **kw):
        self.clock = Clock()
        self.to_w, self.to_c, self.pub = [], [], []
        self.d = Dispatcher(BrokerSettings(**kw), to_worker=lambda i, m: self.to_w.append((i, m)),
                            to_client=lambda i, m: self.to_c.append((i, m)), publish=self.pub.append, clock=self.clock)

    def worker(self, name, role, capacity=4, free=100):
        ident = name.encode()
        kv = f"tcp://127.0.0.1:{9000 + len(self.d.registry.workers)}" if role != "prefill" else None
        self.d.worker_message(ident, M.Ready(name, role, "m", capacity, kv, 16, free))
        self.d.stream_ping(ident)
        return ident

    def submit(self, n=1, prompt=(1, 2, 3), max_tokens=8, subscribe=True, client=b"c"):
        rids = []
        for _ in range(n):
            rid = len(self.d.jobs).to_bytes(2, "big") + bytes(14) if False else __import__("os").urandom(16)
            if subscribe:
                self.d.subscribe(rid)
            self.d.submit(client, M.Submit(rid, list(prompt), SamplingParams(max_tokens=max_tokens)))
            rids.append(rid)
        return rids

    def dispatches(self):
        return [(i, m) for i, m in self.to_w if isinstance(m, (M.Dispatch, M.Resume))]


def test_dispatch_waits_for_subscription():
    h = Harness()
    h.worker("h0", "hybrid")
    (rid,) = h.submit(subscribe=False)
    assert isinstance(h.to_c[-1][1], M.Accepted)
    assert h.dispatches() == []
    h.d.subscribe(rid)
    assert not isinstance(h.to_c[-1][1], M.Refused)
    (ident, msg), = h.dispatches()
    assert ident == b"h0" and msg.mode == "hybrid" and msg.attempt == 1


def test_a_subscription_no_request_claims_ends_with_an_error():
    """After a broker restart, clients' SUB sockets resubscribe to requests the new broker
    never saw: their streams end with an error after subscribe_timeout_s, not the client's
    idle timeout (found by bench/chaos.py)."""
    h = Harness(subscribe_timeout_s=5.0)
    h.worker("h0", "hybrid")
    lost, early = bytes(range(16)), bytes(range(1, 17))
    h.d.subscribe(lost)
    h.d.subscribe(early)
    h.clock.t += 1.0
    h.d.submit(b"c", M.Submit(early, [1, 2, 3], SamplingParams(max_tokens=8)))  # the usual order
    h.clock.t += 3.5
    h.d.tick()
    assert h.pub == []  # within the window: a SUBMIT may still come
    h.clock.t += 1.0
    h.d.tick()
    (msg,) = [m for m in h.pub if m.request_id == lost]
    assert msg.finish_reason == "error" and "restarted" in msg.error
    assert not [m for m in h.pub if m.request_id == early and m.error]
    h.clock.t += 10
    h.d.tick()
    assert len([m for m in h.pub if m.request_id == lost]) == 1  # once


def test_prefill_gets_decode_target():
    h = Harness()
    h.worker("p0", "prefill")
    h.worker("d0", "decode")
    h.submit()
    (ident, msg), = h.dispatches()
    assert ident == b"p0" and msg.mode == "prefill" and msg.decode_node == "d0" and msg.decode_address.startswith("tcp://")


def test_queue_full_is_busy_with_retry_after():
    h = Harness(max_queue=2, retry_after_s=2.5)
    h.worker("h0", "hybrid", capacity=1)
    h.submit(n=3)  # one runs, two queue
    (rid,) = h.submit()
    ident, msg = h.to_c[-1]
    assert isinstance(msg, M.Refused) and msg.reason == "busy" and msg.retry_after_s == 2.5 and msg.request_id == rid


def test_no_worker_refused():
    h = Harness()
    h.submit()
    assert isinstance(h.to_c[-1][1], M.Refused) and h.to_c[-1][1].reason == "no_worker"


@pytest.mark.parametrize("strategy", ["round_robin", "least_loaded", "memory_aware", "prompt_length_aware", "prefix_aware"])
def test_every_strategy_spreads_load(strategy):
    h = Harness(strategy=strategy)
    for i in range(4):
        h.worker(f"h{i}", "hybrid", capacity=100)
    h.submit(n=40, prompt=list(range(40)))
    counts = {}
    for ident, _ in h.dispatches():
        counts[ident] = counts.get(ident, 0) + 1
    assert sorted(counts.values()) == [10, 10, 10, 10], counts


def test_least_loaded_prefers_idle_worker():
    h = Harness(strategy="least_loaded")
    a = h.worker("a", "hybrid", capacity=100)
    b = h.worker("b", "hybrid", capacity=100)
    h.d.worker_message(a, M.Heartbeat("a", running=0, waiting=5))
    h.submit(n=4)
    assert [i for i, _ in h.dispatches()].count(b) >= 3


def test_memory_aware_prefers_free_blocks():
    h = Harness(strategy="memory_aware")
    a = h.worker("a", "hybrid", capacity=100)
    b = h.worker("b", "hybrid", capacity=100)
    h.d.worker_message(a, M.Heartbeat("a", free_blocks=10, total_blocks=100))
    h.d.worker_message(b, M.Heartbeat("b", free_blocks=90, total_blocks=100))
    h.submit(n=3)
    assert all(i == b for i, _ in h.dispatches())


def test_prompt_length_aware_sends_long_prompts_to_least_prefill_work():
    h = Harness(strategy="prompt_length_aware", long_prompt_tokens=100)
    a = h.worker("a", "hybrid", capacity=100)
    b = h.worker("b", "hybrid", capacity=100)
    h.submit(prompt=list(range(1000)))  # long -> a (tie, first)
    h.submit(n=3, prompt=[1, 2])  # short ones: fewest requests
    h.submit(prompt=list(range(900)))  # long: least queued prompt tokens
    idents = [i for i, _ in h.dispatches()]
    assert idents[0] == a and idents[-1] == b


def test_prefix_aware_follows_prefix_but_respects_load_guard():
    h = Harness(strategy="prefix_aware", prefix_load_guard=2.0)
    a = h.worker("a", "hybrid", capacity=100)
    b = h.worker("b", "hybrid", capacity=100)
    shared = list(range(64))
    h.submit(prompt=shared + [1])
    first = h.dispatches()[0][0]
    h.submit(n=2, prompt=shared + [2])
    idents = [i for i, _ in h.dispatches()]
    assert idents[:3] == [first] * 3  # same prefix, load still within the guard
    h.submit(n=6, prompt=shared + [3])
    idents = [i for i, _ in h.dispatches()]
    other = b if first == a else a
    assert idents.count(other) >= 2  # the guard pushed some away from the hot worker
    loads = [len(h.d.registry.get(x).inflight) for x in (a, b)]
    assert max(loads) <= 2.0 * (min(loads) + 1)


def test_decode_allowlist():
    h = Harness(decode_allowlist=["d1"])
    h.worker("p0", "prefill")
    h.worker("d0", "decode")
    h.worker("d1", "decode")
    h.submit(n=4)
    assert {m.decode_node for _, m in h.dispatches()} == {"d1"}


def test_tokens_tracked_and_stale_attempt_dropped():
    h = Harness()
    h.worker("h0", "hybrid")
    (rid,) = h.submit()
    job = h.d.jobs[rid]
    assert h.d.stream(job, 1, M.TokenMessage(rid, 0, [5, 6])) == "forward"
    assert h.d.stream(job, 0, M.TokenMessage(rid, 1, [7])) == "drop"  # old attempt
    assert h.d.stream(job, 1, M.TokenMessage(rid, 0, [5, 6])) == "drop"  # duplicate
    assert job.generated == [5, 6] and job.next_seq == 1


def test_gap_ends_stream_with_error_after_the_reorder_window():
    h = Harness()
    w = h.worker("h0", "hybrid")
    (rid,) = h.submit()
    job = h.d.jobs[rid]
    h.d.stream(job, 1, M.TokenMessage(rid, 0, [5]))
    assert h.d.stream(job, 1, M.TokenMessage(rid, 2, [7])) == "held"  # seq 1 may still come
    h.clock.t += REORDER_WINDOW_S / 2
    h.d.tick()
    assert not h.pub
    h.clock.t += REORDER_WINDOW_S
    h.d.tick()
    (last,) = h.pub
    assert last.seq == 1 and last.error and "gap" in last.error
    assert any(isinstance(m, M.Abort) for i, m in h.to_w if i == w)
    assert not h.d.reordering and h.d.counters["stream_gaps"] == 1


def test_messages_ahead_of_a_missing_one_wait_for_it():
    """A prefill worker's first token and the decode worker's next ones travel over
    different connections: the later ones wait, then everything goes out in order."""
    h = Harness()
    h.worker("h0", "hybrid")
    (rid,) = h.submit()
    job = h.d.jobs[rid]
    assert h.d.stream(job, 1, M.TokenMessage(rid, 2, [9], None, "length"), b"two") == "held"
    assert h.d.stream(job, 1, M.TokenMessage(rid, 1, [7]), b"one") == "held"
    assert h.d.stream(job, 1, M.TokenMessage(rid, 1, [7])) == "drop"  # a duplicate of a held one
    assert h.d.stream(job, 1, M.TokenMessage(rid, 0, [5])) == "forward"
    ready = h.d.take_ready(job)
    assert [m.seq for _, m, _ in ready] == [1, 2] and [hd for _, _, hd in ready] == [b"one", b"two"]
    assert [h.d.stream(job, a, m, hd) for a, m, hd in ready] == ["forward", "forward"]
    assert job.generated == [5, 7, 9] and job.state == "finished" and not h.d.reordering
    h.clock.t += 10 * REORDER_WINDOW_S
    h.d.tick()
    assert not h.pub and h.d.counters["stream_gaps"] == 0


def test_too_many_messages_ahead_end_the_stream():
    h = Harness()
    h.worker("h0", "hybrid")
    (rid,) = h.submit(max_tokens=100)
    job = h.d.jobs[rid]
    for seq in range(1, MAX_AHEAD + 1):
        assert h.d.stream(job, 1, M.TokenMessage(rid, seq, [seq])) == "held"
    assert h.d.stream(job, 1, M.TokenMessage(rid, MAX_AHEAD + 1, [0])) == "drop"
    (last,) = h.pub
    assert last.seq == 0 and "gap" in last.error


def test_decode_death_migrates_with_streamed_tokens():
    h = Harness(heartbeat_interval_ms=100, heartbeat_liveness=3)
    p = h.worker("p0", "prefill")
    d0 = h.worker("d0", "decode")
    d1 = h.worker("d1", "decode")
    (rid,) = h.submit(max_tokens=10)
    job = h.d.jobs[rid]
    (_, disp), = h.dispatches()
    target = disp.decode_node.encode()
    h.d.stream(job, 1, M.TokenMessage(rid, 0, [11]))
    h.d.worker_message(p, M.Done(rid, None, None, handed_to=disp.decode_node))
    assert job.holders == {target}
    h.d.stream(job, 1, M.TokenMessage(rid, 1, [12, 13]))
    # Everyone but the decode target keeps heartbeating; the target goes silent.
    h.clock.t += 0.35
    for ident in (p, d0, d1):
        if ident != target:
            h.d.worker_message(ident, M.Heartbeat(ident.decode()))
    h.d.tick()
    (ident, res), = [(i, m) for i, m in h.dispatches() if isinstance(m, M.Resume)]
    assert ident != target and res.generated == [11, 12, 13] and res.next_seq == 2 and res.attempt == 2
    assert res.sampling.max_tokens == 7 and res.prompt == [1, 2, 3]
    # Seeded sampling resumes at token 3 of its random stream.
    assert res.sampling.seed_offset == 3 and job.sampling.seed_offset == 0
    assert job.migrations == 1 and h.d.registry.get(target).state == "down"
    # The new worker's final message gets the client's usage, not its own.
    verdict = h.d.stream(job, 2, M.TokenMessage(rid, 2, [14], finish_reason="length", usage=M.Usage(6, 1)))
    assert verdict == "patched"
    assert job.state == J.FINISHED and job.generated == [11, 12, 13, 14]


def test_migration_limit_ends_stream_with_error():
    h = Harness(max_migrations=0)
    a = h.worker("a", "hybrid")
    h.worker("b", "hybrid")
    (rid,) = h.submit()
    h.d.worker_message(a, M.Failed(rid, "engine crashed", retryable=True)) if h.dispatches()[0][0] == a else \
        h.d.worker_message(b"b", M.Failed(rid, "engine crashed", retryable=True))
    (last,) = h.pub
    assert last.error and "no migration" in last.error and rid not in h.d.jobs


def test_reprobe_single_flight_before_refusing():
    h = Harness(heartbeat_interval_ms=100, heartbeat_liveness=1, reprobe_interval_ms=250, reprobe_timeout_ms=500)
    w = h.worker("h0", "hybrid")
    h.clock.t += 0.2
    h.d.tick()  # h0 missed its heartbeat
    assert h.d.registry.get(w).state == "down"
    (rid,) = h.submit()
    h.d.tick()
    h.d.tick()
    probes = [m for i, m in h.to_w if isinstance(m, M.Heartbeat)]
    assert len(probes) == 1  # rate-limited: one probe round
    assert not any(isinstance(m, M.Refused) for _, m in h.to_c)  # waits for the probe
    # The worker answers the probe: the queued request is dispatched instead of refused.
    h.d.worker_message(w, M.Heartbeat("h0"))
    h.d.stream_ping(w)
    assert [m.request_id for _, m in h.dispatches()] == [rid]


def test_reprobe_timeout_refuses():
    h = Harness(heartbeat_interval_ms=100, heartbeat_liveness=1, reprobe_timeout_ms=500)
    h.worker("h0", "hybrid")
    h.clock.t += 0.2
    h.d.tick()
    h.submit()
    h.d.tick()
    h.clock.t += 0.6
    h.d.tick()
    assert isinstance(h.to_c[-1][1], M.Refused) and h.to_c[-1][1].reason == "no_worker"


def _lose_the_only_worker_mid_stream(h):
    w = h.worker("h0", "hybrid")
    (rid,) = h.submit(max_tokens=10)
    job = h.d.jobs[rid]
    h.d.stream(job, 1, M.TokenMessage(rid, 0, [11, 12]))
    h.clock.t += 0.2
    h.d.tick()  # h0 missed its heartbeat: killed
    assert h.d.registry.get(w).state == "down"
    return rid, job


def test_only_worker_killed_mid_stream_the_request_waits_and_continues_exactly():
    """Issue #45: one hybrid worker, SIGKILLed mid-stream and restarted by its supervisor.
    The stream must not end with "no worker is available" while it is away."""
    h = Harness(heartbeat_interval_ms=100, heartbeat_liveness=1, reprobe_timeout_ms=500, failover_wait_s=20)
    rid, job = _lose_the_only_worker_mid_stream(h)
    for _ in range(40):  # 4 s away, many unanswered probe rounds
        h.clock.t += 0.1
        h.d.tick()
    assert not any(m.error for m in h.pub if m.request_id == rid) and job.state == J.QUEUED
    assert not any(isinstance(m, M.Refused) for _, m in h.to_c)
    h.worker("h0-restarted", "hybrid")  # a new process: a new identity
    (ident, res), = [(i, m) for i, m in h.dispatches() if isinstance(m, M.Resume)]
    assert ident == b"h0-restarted" and res.generated == [11, 12] and res.next_seq == 1
    assert res.sampling.max_tokens == 8 and job.state == J.RUNNING


def test_a_worker_that_never_returns_ends_the_stream_after_the_bound():
    h = Harness(heartbeat_interval_ms=100, heartbeat_liveness=1, queue_timeout_s=1, failover_wait_s=5)
    rid, job = _lose_the_only_worker_mid_stream(h)
    h.clock.t += 4.9
    h.d.tick()
    assert job.state == J.QUEUED
    h.clock.t += 0.2
    h.d.tick()
    (last,) = [m for m in h.pub if m.request_id == rid and m.error]
    assert "no worker came back" in last.error and "5s" in last.error and rid not in h.d.jobs


def test_a_new_request_is_still_refused_at_once_without_workers():
    h = Harness(heartbeat_interval_ms=100, heartbeat_liveness=1, reprobe_timeout_ms=500, failover_wait_s=20)
    _lose_the_only_worker_mid_stream(h)
    (rid,) = h.submit()
    h.d.tick()
    h.clock.t += 0.6
    h.d.tick()
    assert any(isinstance(m, M.Refused) and m.request_id == rid and m.reason == "no_worker" for _, m in h.to_c)


def test_abort_reaches_every_holder_and_frees_accounting():
    h = Harness()
    p = h.worker("p0", "prefill")
    d = h.worker("d0", "decode")
    (rid,) = h.submit()
    h.d.abort(rid)
    aborted = {i for i, m in h.to_w if isinstance(m, M.Abort)}
    assert aborted == {p, d}
    assert all(not w.inflight for w in h.d.registry.workers.values()) and rid not in h.d.jobs


def test_unknown_worker_asked_to_register():
    h = Harness()
    h.d.worker_message(b"ghost", M.Heartbeat("ghost"))
    assert isinstance(h.to_w[-1][1], M.Disconnect)


def test_refused_handoff_moves_request_to_another_decode_worker():
    h = Harness()
    p = h.worker("p0", "prefill")
    h.worker("d0", "decode")
    h.worker("d1", "decode")
    (rid,) = h.submit(max_tokens=10)
    job = h.d.jobs[rid]
    (_, disp), = h.dispatches()
    h.d.stream(job, disp.attempt, M.TokenMessage(rid, 0, [42]))
    # The chosen decode worker was full when the KV arrived: the prefill side says so.
    h.d.worker_message(p, M.Refused(rid, "at_capacity", "decode worker is full", 0.0))
    (ident, res), = [(i, m) for i, m in h.dispatches() if isinstance(m, M.Resume)]
    assert ident.decode() != disp.decode_node and ident != p
    assert res.generated == [42] and res.next_seq == 1 and job.migrations == 0
    assert h.d.registry.get(disp.decode_node.encode()).refusals == 1


def test_worker_refusal_does_not_spin():
    h = Harness()
    w = h.worker("h0", "hybrid")
    (rid,) = h.submit()
    h.d.worker_message(w, M.Refused(rid, "at_capacity", "engine queue full", 1.0))
    # Saturated until its next heartbeat: the request waits instead of bouncing.
    assert len(h.dispatches()) == 1 and h.d.jobs[rid].state == J.QUEUED
    h.d.worker_message(w, M.Heartbeat("h0"))
    assert len(h.dispatches()) == 2


def test_a_refusing_worker_that_finishes_a_request_takes_work_again():
    h = Harness()
    w = h.worker("h0", "hybrid")
    done, refused = h.submit(2)
    h.d.worker_message(w, M.Refused(refused, "at_capacity", "engine queue full", 1.0))
    assert len(h.dispatches()) == 2 and h.d.jobs[refused].state == J.QUEUED
    h.d.worker_message(w, M.Done(done, "length", M.Usage(3, 8)))  # room again, before any heartbeat
    (ident, msg) = h.dispatches()[-1]
    assert len(h.dispatches()) == 3 and ident == w and msg.request_id == refused


def test_requests_naming_a_client_stream_wait_for_that_subscription_only():
    """A client's stream topic is subscribed once: every request naming it waits for it,
    then all go; a later request goes at once. A request's own topic does not count."""
    h = Harness()
    h.worker("h0", "hybrid", capacity=8)
    topic = b"s" * 17
    rids = [bytes([i]) * 16 for i in range(3)]
    h.d.subscribe(rids[0])  # its own topic: not what it named
    for rid in rids[:2]:
        h.d.submit(b"c", M.Submit(rid, [1, 2], SamplingParams(max_tokens=2), stream=topic))
    assert h.dispatches() == [] and all(h.d.jobs[r].state == J.WAITING_SUB for r in rids[:2])
    h.d.subscribe(topic)
    assert [m.request_id for _, m in h.dispatches()] == rids[:2]
    h.d.submit(b"c", M.Submit(rids[2], [1, 2], SamplingParams(max_tokens=2), stream=topic))
    assert [m.request_id for _, m in h.dispatches()] == rids
    assert not h.d.awaiting_stream and topic not in h.d.unclaimed  # no request-less stream to end


def test_requests_naming_a_stream_never_subscribed_are_refused_and_forgotten():
    h = Harness(subscribe_timeout_s=1.0)
    h.worker("h0", "hybrid")
    rid = b"r" * 16
    h.d.submit(b"c", M.Submit(rid, [1, 2], SamplingParams(max_tokens=2), stream=b"s" * 17))
    h.clock.t += 2.0
    h.d.tick()
    assert isinstance(h.to_c[-1][1], M.Refused) and h.to_c[-1][1].reason == "invalid"
    assert not h.d.awaiting_stream and rid not in h.d.jobs


def test_request_missing_from_heartbeats_is_moved_on():
    h = Harness(heartbeat_interval_ms=100)
    a = h.worker("a", "hybrid")
    b = h.worker("b", "hybrid")
    (rid,) = h.submit()
    (first, _), = h.dispatches()
    h.d.worker_message(first, M.Heartbeat(first.decode(), requests=[]))  # within the grace: fine
    assert len(h.dispatches()) == 1
    h.clock.t += 0.25
    h.d.worker_message(first, M.Heartbeat(first.decode(), requests=[rid]))  # listed: fine
    assert len(h.dispatches()) == 1
    h.d.worker_message(first, M.Heartbeat(first.decode(), requests=[]))  # lost it
    (second, msg) = h.dispatches()[-1]
    assert second != first and msg.request_id == rid and h.d.counters["lost_requests"] == 1


@pytest.mark.parametrize("done_first", [True, False])
def test_finished_job_is_forgotten_whichever_of_done_and_final_arrives_last(done_first):
    # Left behind, finished jobs piled up for FINISHED_LINGER_S and every tick walked them.
    h = Harness()
    w = h.worker("h0", "hybrid")
    (rid,) = h.submit()
    job = h.d.jobs[rid]
    final = M.TokenMessage(rid, 0, [5], None, "length", M.Usage(3, 1))
    done = M.Done(rid, "length", M.Usage(3, 1))
    if done_first:
        h.d.worker_message(w, done)
        assert rid in h.d.jobs and rid in h.d.awaiting_final
        assert h.d.stream(job, 1, final) == "forward"
    else:
        assert h.d.stream(job, 1, final) == "forward"
        assert rid in h.d.jobs  # its worker still holds it until DONE
        h.d.worker_message(w, done)
    assert rid not in h.d.jobs
    assert not h.d.registry.get(w).inflight
    h.clock.t += 60
    h.d.tick()
    assert h.d.counters["lost_finals"] == 0 and not h.d.awaiting_final and not h.pub


def test_lost_final_is_written_by_the_broker_after_the_grace_period():
    h = Harness()
    w = h.worker("h0", "hybrid")
    (rid,) = h.submit()
    h.d.stream(h.d.jobs[rid], 1, M.TokenMessage(rid, 0, [5]))
    h.d.worker_message(w, M.Done(rid, "length", M.Usage(3, 1)))
    h.d.tick()
    assert not h.pub  # still within the grace period
    h.clock.t += 10
    h.d.tick()
    (last,) = h.pub
    assert last.seq == 1 and last.finish_reason == "length" and last.error is None
    assert h.d.counters["lost_finals"] == 1 and rid not in h.d.jobs and not h.d.awaiting_final


def test_stats_report_loop_rounds():
    from tandem.broker.stats import snapshot

    h = Harness()
    assert snapshot(h.d)["loop_rounds"] == {"rounds": 0, "busy_total": 0}
    rounds = snapshot(h.d, rounds_s=[0.001] * 99 + [0.5], busy_rounds=250)["loop_rounds"]
    assert rounds == {"rounds": 100, "p50_ms": 1.0, "p99_ms": 500.0, "max_ms": 500.0, "busy_total": 250}


def test_heartbeat_kv_totals_become_bandwidth_in_stats():
    from tandem.broker.stats import snapshot

    h = Harness()
    p = h.worker("p0", "prefill")
    row = snapshot(h.d)["workers"][0]
    assert row["kv_handoffs"] == 0 and row["kv_gb_s"] is None and row["kv_gb_s_recent"] is None
    h.d.worker_message(p, M.Heartbeat("p0", kv_handoffs=2, kv_sent_bytes=4_000_000, kv_sent_s=0.002))
    row = snapshot(h.d)["workers"][0]
    assert row["kv_sent_bytes"] == 4_000_000 and row["kv_gb_s"] == 2.0 and row["kv_gb_s_recent"] == 2.0
    # The next interval moved 1 GB/s: the moving average leans toward it, the total average follows the sums.
    h.d.worker_message(p, M.Heartbeat("p0", kv_handoffs=3, kv_sent_bytes=5_000_000, kv_sent_s=0.003))
    row = snapshot(h.d)["workers"][0]
    assert row["kv_gb_s_recent"] == pytest.approx(1.7, abs=1e-3) and row["kv_gb_s"] == pytest.approx(5 / 3, abs=1e-3)
    # No handoff in an interval: the recent figure holds; a restarted worker's totals start over.
    h.d.worker_message(p, M.Heartbeat("p0", kv_handoffs=3, kv_sent_bytes=5_000_000, kv_sent_s=0.003))
    assert snapshot(h.d)["workers"][0]["kv_gb_s_recent"] == pytest.approx(1.7, abs=1e-3)
    h.d.worker_message(p, M.Heartbeat("p0", kv_handoffs=1, kv_sent_bytes=1_000_000, kv_sent_s=0.0002))
    row = snapshot(h.d)["workers"][0]
    assert row["kv_handoffs"] == 1 and row["kv_gb_s"] == 5.0 and row["kv_gb_s_recent"] == pytest.approx(0.3 * 5 + 0.7 * 1.7, abs=1e-3)


def test_heartbeat_prefix_counts_reach_stats():
    from tandem.broker.stats import snapshot

    h = Harness()
    d = h.worker("d0", "decode")
    row = snapshot(h.d)["workers"][0]
    assert row["prefix_queries"] == 0 and row["prefix_hits"] == 0
    h.d.worker_message(d, M.Heartbeat("d0", running=1, prefix_queries=8, prefix_hits=3, spec_draft_tokens=40,
                                      spec_accepted_tokens=31, kv_store_bytes=5 << 20,
                                      heap_free_bytes=3 << 20, kv_mirror_bytes=7 << 20))
    row = snapshot(h.d)["workers"][0]
    assert row["prefix_queries"] == 8 and row["prefix_hits"] == 3
    assert row["spec_draft_tokens"] == 40 and row["spec_accepted_tokens"] == 31
    assert row["kv_store_bytes"] == 5 << 20 and row["heap_free_bytes"] == 3 << 20 and row["kv_mirror_bytes"] == 7 << 20


def test_each_worker_s_device_reaches_stats():
    from tandem.broker.stats import snapshot

    h = Harness()
    h.d.worker_message(b"g1", M.Ready("d1", "decode", "m", 4, "tcp://127.0.0.1:5600", 16, 100, "gpu 1"))
    h.d.worker_message(b"c0", M.Ready("p0", "prefill", "m", 4, None, 16, 100))
    assert {r["node"]: r["device"] for r in snapshot(h.d)["workers"]} == {"decode-0": "gpu 1", "prefill-0": ""}


def test_a_worker_restarted_under_its_name_counts_as_a_failure():
    """A supervisor can restart a worker faster than its heartbeats expire: its READY comes
    from the same identity with another incarnation, which the stats count as a failure
    (what an operator's console and dashboards watch); a repeated READY does not."""
    from tandem.broker.stats import snapshot

    h = Harness()
    ready = lambda inc: M.Ready("d0", "decode", "m", 4, "tcp://127.0.0.1:5600", 16, 100, "cpu", inc)  # noqa: E731
    h.d.worker_message(b"d0", ready(7))
    h.d.worker_message(b"d0", ready(7))
    assert snapshot(h.d)["workers"][0]["failures"] == 0
    h.d.worker_message(b"d0", ready(8))
    row = snapshot(h.d)["workers"][0]
    assert row["failures"] == 1 and row["state"] != "down" and len(snapshot(h.d)["workers"]) == 1


def test_streamed_tokens_count_for_the_worker_that_made_them():
    from tandem.broker.stats import snapshot

    h = Harness()
    h.worker("p0", "prefill")
    h.worker("d0", "decode")
    (rid,) = h.submit()
    job = h.d.jobs[rid]
    (_, disp), = h.dispatches()
    h.d.stream(job, disp.attempt, M.TokenMessage(rid, 0, [11]))
    h.d.stream(job, disp.attempt, M.TokenMessage(rid, 1, [12, 13]))
    h.d.stream(job, disp.attempt, M.TokenMessage(rid, 1, [12, 13]))  # a duplicate counts for no one
    rows = {r["node"]: r for r in snapshot(h.d)["workers"]}
    assert rows["prefill-0"]["tokens"] == 1 and rows["decode-0"]["tokens"] == 2


def test_refusal_after_the_stream_ended_releases_the_worker():
    """A prefill worker whose handoff acknowledgement was lost reports the handoff failed
    after the decode worker already finished the stream: its claim goes, nothing lingers."""
    h = Harness()
    p = h.worker("p0", "prefill")
    d = h.worker("d0", "decode")
    (rid,) = h.submit(max_tokens=3)
    job = h.d.jobs[rid]
    h.d.stream(job, 1, M.TokenMessage(rid, 0, [11]))
    h.d.stream(job, 1, M.TokenMessage(rid, 1, [12, 13], finish_reason="length", usage=M.Usage(3, 3)))
    h.d.worker_message(d, M.Done(rid, "length", M.Usage(3, 3)))
    assert job.state == J.FINISHED and job.holders == {p} and rid in h.d.jobs
    h.d.worker_message(p, M.Refused(rid, "at_capacity", "KV channel broke", 0.0))
    assert rid not in h.d.jobs and not h.d.registry.get(p).inflight and not h.d.registry.get(d).inflight
    assert not [m for _, m in h.dispatches() if isinstance(m, M.Resume)]


def test_dispatch_from_the_submit_bytes_equals_the_dispatch_message():
    """With the socket loop's raw path (to_worker_raw + the SUBMIT's bytes), every dispatch
    (prefill with a decode target, and a re-dispatch after a refusal) decodes to exactly
    the Dispatch the message path sends."""
    from tandem.broker import frames as F
    from tandem.wire import codec

    def run(raw: bool):
        h = Harness()
        out = []
        if raw:
            h.d.to_worker_raw = lambda i, head: out.append((i, F.decode(head)))
        h.worker("p0", "prefill")
        h.worker("d0", "decode")
        h.worker("d1", "decode")
        rid = bytes(range(16))
        sub = M.Submit(rid, [5, 6, 7, 8, 9], SamplingParams(temperature=0.5, seed=3, max_tokens=9), priority=2, model="m")
        h.d.subscribe(rid)
        h.d.submit(b"c", sub, F.submit_tail(codec.encode(sub)[0], sub.stream) if raw else None)
        first = (out or h.dispatches())[-1][1]
        h.d.worker_message(b"p0", M.Refused(rid, "at_capacity", "decode full", 0.0))
        return out if raw else h.dispatches(), first

    (raw, first_raw), (plain, first_plain) = run(True), run(False)
    assert first_raw.decode_address and first_raw.mode == "prefill"
    assert len(raw) == len(plain) >= 2
    assert raw == plain


@pytest.mark.parametrize("arrived", [[14, 15, 16, 17], [14]])
def test_lost_final_of_a_resumed_request_checks_its_token_count(arrived):
    # Found by bench/chaos.py: a migrated request whose last messages (and final) were
    # lost in transit ended "length" with tokens missing, because the broker skipped the
    # count check for any migrated request. A resumed worker counts its own tokens only.
    h = Harness(heartbeat_interval_ms=100, heartbeat_liveness=3)
    h0 = h.worker("h0", "hybrid")
    h1 = h.worker("h1", "hybrid")
    (rid,) = h.submit(max_tokens=7)
    job = h.d.jobs[rid]
    (first, _), = h.dispatches()
    h.d.stream(job, 1, M.TokenMessage(rid, 0, [11, 12, 13]))
    h.clock.t += 0.35
    other = h1 if first == h0 else h0
    h.d.worker_message(other, M.Heartbeat(other.decode()))
    h.d.tick()  # the first worker went silent: the request resumes on the other
    (ident, res), = [(i, m) for i, m in h.dispatches() if isinstance(m, M.Resume)]
    assert ident == other and res.generated == [11, 12, 13]
    h.d.stream(job, 2, M.TokenMessage(rid, 1, arrived))
    h.d.worker_message(other, M.Done(rid, "length", M.Usage(6, 4)))  # 4 tokens of its own
    h.clock.t += 10
    h.d.tick()
    last = h.pub[-1]
    if len(arrived) == 4:
        assert last.finish_reason == "length" and last.error is None
    else:
        assert last.error and "lost in transit" in last.error
    assert rid not in h.d.jobs
