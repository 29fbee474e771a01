"""The periodic throughput line (issue #45 item 8), driven by the dispatcher's own counters."""

from __future__ import annotations

from tandem.broker.throughput import ThroughputLog
from tandem.wire import messages as M
from tests.broker.test_dispatcher import Harness


def test_the_line_reports_rates_over_the_interval_and_goes_quiet_when_idle():
    h = Harness()
    h.worker("h0", "hybrid", free=75)  # 100 blocks in all: 25 in use
    h.d.worker_message(b"h0", M.Heartbeat("h0", free_blocks=75, total_blocks=100))
    tl = ThroughputLog(10.0, clock=h.clock)
    assert tl.line(h.d) is None  # not due yet, and nothing happened
    (rid,) = h.submit(prompt=list(range(40)), max_tokens=100)
    job = h.d.jobs[rid]
    h.d.stream(job, 1, M.TokenMessage(rid, 0, [1]))
    h.d.stream(job, 1, M.TokenMessage(rid, 1, list(range(19))))
    h.clock.t += 5
    assert tl.line(h.d) is None
    h.clock.t += 5
    assert tl.line(h.d) == ("avg prompt throughput: 4.0 tokens/s, avg generation throughput: 2.0 tokens/s, "
                            "running: 1 reqs, queued: 0 reqs, KV cache usage: 25.0%, workers up: 1")
    h.d.stream(job, 1, M.TokenMessage(rid, 2, [7], finish_reason="length", usage=M.Usage(40, 21)))
    h.clock.t += 10
    assert "avg generation throughput: 0.1 tokens/s, running: 0 reqs" in tl.line(h.d)  # the last active interval
    h.clock.t += 10
    assert tl.line(h.d).startswith("avg prompt throughput: 0.0 tokens/s, avg generation throughput: 0.0")  # went idle
    h.clock.t += 10
    assert tl.line(h.d) is None  # and says so once


def test_zero_interval_switches_it_off():
    h = Harness()
    tl = ThroughputLog(0.0, clock=h.clock)
    h.clock.t += 100
    assert tl.line(h.d) is None
